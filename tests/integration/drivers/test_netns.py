"""The netns and links drivers against the real kernel.

Every test runs in its own host_ns namespace (``host_ns``, see
``tests/integration/conftest.py``); results are checked with ``ip -n NS -j -d …`` — and with
pyroute2 for the IFA_PROTO marker, which iproute2 6.1 does not print — never
with the parsers under test.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from reconciler.domain.errors import ConflictError, DriverError
from reconciler.domain.live import LiveNetns, LiveRoute
from reconciler.domain.ownership import alloc_veth_name
from reconciler.drivers import netns, nsfs
from reconciler.drivers.netlink import client as links
from reconciler.drivers.netlink import parse as nlparse
from tests.support.host import REPO, Netns, ip_json, ip_link, sh, wait_for

pytestmark = pytest.mark.root

GW4 = ipaddress.ip_address("10.77.0.1")
GW6 = ipaddress.ip_address("fd00:77::1")


def iface(text: str) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
    return ipaddress.ip_interface(text)


def addr_protos(ns: str, ifname: str) -> dict[str, int | None]:
    """address/prefix -> IFA_PROTO, read with pyroute2 (independent of our parser)."""
    from pyroute2 import IPRoute

    with netns.enter(ns):
        ipr = IPRoute()
    try:
        index = ipr.link_lookup(ifname=ifname)[0]
        return {f"{m.get_attr('IFA_ADDRESS')}/{m['prefixlen']}": m.get_attr("IFA_PROTO")
                for m in ipr.addr("dump", index=index)
                if not str(m.get_attr("IFA_ADDRESS")).startswith("fe80")}
    finally:
        ipr.close()


def build_alloc(nl: links.Netlink, box: Netns, suffix: str, addr4: str,
                addr6: str | None = None, hairpin: bool = True) -> tuple[str, str]:
    name = box.ns(suffix)
    veth = alloc_veth_name(name)
    assert nl.create_netns(name)
    assert nl.create_veth_into_netns(veth, name, "rtbr0", mtu=1400, hairpin=hairpin)
    addrs = [iface(addr4)] + ([iface(addr6)] if addr6 else [])
    gws = [GW4] + ([GW6] if addr6 else [])
    nl.configure_inside(name, addrs, gws, mtu=1400)
    return name, veth


def bridge(nl: links.Netlink) -> None:
    assert nl.ensure_bridge("rtbr0", mtu=1400)
    nl.add_address("rtbr0", iface(f"{GW4}/16"))
    nl.add_address("rtbr0", iface(f"{GW6}/64"))


# --- namespaces -------------------------------------------------------------------


def test_create_and_delete_like_ip_netns(host_ns: Netns) -> None:
    name = host_ns.ns("a")
    assert netns.create(name) is True
    assert name in sh("ip", "netns", "list").stdout
    assert netns.is_namespace_mount(name)
    # usable by other processes: ip sees its loopback, down, like any fresh namespace
    (lo,) = ip_json(name, "link", "show")
    assert lo["ifname"] == "lo" and "UP" not in lo["flags"]
    assert netns.create(name) is False  # EEXIST on a live namespace is success
    assert name in netns.list_names()
    # our thread is back where it was
    assert nsfs.current_inode() != netns.namespace_inode(name)
    assert netns.delete(name) is True
    assert not os.path.exists(f"/run/netns/{name}")
    assert netns.delete(name) is False


def test_a_namespace_file_is_marked_before_it_has_its_name(
        host_ns: Netns, monkeypatch: pytest.MonkeyPatch) -> None:
    """``/run/netns/ID`` appears with its ownership mark already on it: a run killed
    between creating the file and marking it (simulated: the mark fails) leaves no
    unmarked file under the name — which the planner must then leave alone as foreign,
    so the next apply refused that allocation for ever."""
    name = host_ns.ns("m")
    before = set(os.listdir("/run/netns"))

    def killed(fd: int, mark: str) -> None:
        raise OSError(errno.EINTR, "killed here")

    mark = f"host-{name}"  # a mark of its own: no shared marked file of it exists yet
    monkeypatch.setattr(netns, "set_file_mark", killed)
    with pytest.raises((DriverError, OSError)):
        netns.create(name, file_mark=mark)
    # neither the name nor a temporary (only new names count: other tests come and go)
    assert set(os.listdir("/run/netns")) - before == set()
    monkeypatch.undo()
    assert netns.create(name, file_mark=mark) is True
    assert netns.is_namespace_mount(name) and name in netns.list_names()
    assert netns.delete(name) is True


def test_marked_namespace_files_share_one_inode_and_each_takes_its_own_mount(
        host_ns: Netns) -> None:
    """The namespace files a process makes with one mark are names of one marked inode
    (no inode allocated per namespace): each name still holds its own namespace, an
    unmounted name shows the mark, and once every name is gone the next create makes a
    fresh marked file (the old one can no longer be linked)."""
    mark = f"host-{host_ns.ns('i')}"
    a, b, c = host_ns.ns("ia"), host_ns.ns("ib"), host_ns.ns("ic")
    assert netns.create(a, file_mark=mark) and netns.create(b, file_mark=mark)
    assert netns.namespace_inode(a) != netns.namespace_inode(b)  # two namespaces
    # ip's own view: both are namespaces, one link made in a is not in b
    subprocess.run(["ip", "-n", a, "link", "add", "rbshare0", "type", "veth", "peer", "name", "rbshare1"], check=True)
    shown = subprocess.run(["ip", "-n", b, "-j", "link"], capture_output=True, text=True,
                           check=True).stdout
    assert "rbshare0" not in shown
    under_b = os.stat(f"/run/netns/{b}").st_ino
    assert netns._libc.umount2(f"/run/netns/{a}".encode(), netns.MNT_DETACH) == 0
    st = os.stat(f"/run/netns/{a}")  # the file under a's mount
    assert st.st_nlink >= 2 and netns.file_mark(a) == mark
    assert netns.is_namespace_mount(b) and os.stat(f"/run/netns/{b}").st_ino == under_b
    assert netns.delete(a) is True and netns.delete(b) is True
    assert netns.create(c, file_mark=mark) is True  # every name gone: a fresh file
    assert netns.is_namespace_mount(c)
    assert netns._libc.umount2(f"/run/netns/{c}".encode(), netns.MNT_DETACH) == 0
    assert os.stat(f"/run/netns/{c}").st_nlink == 1 and netns.file_mark(c) == mark
    assert netns.delete(c) is True


def test_a_mark_that_did_not_take_is_not_shared_with_the_next_file(
        host_ns: Netns, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mark is best effort (an xattr): a file it did not take on must not become the
    one the next namespaces of this process share, or all of them would be unmarked."""
    mark = f"host-{host_ns.ns('u')}"
    a, b = host_ns.ns("ua"), host_ns.ns("ub")
    monkeypatch.setattr(netns, "set_file_mark", lambda fd, value: None)
    assert netns.create(a, file_mark=mark) is True
    monkeypatch.undo()
    assert netns.create(b, file_mark=mark) is True
    assert netns._libc.umount2(f"/run/netns/{b}".encode(), netns.MNT_DETACH) == 0
    assert netns.file_mark(b) == mark
    assert netns.delete(a) is True and netns.delete(b) is True


def test_a_creator_killed_before_the_file_has_its_name_leaves_nothing(
        host_ns: Netns) -> None:
    """SIGKILL of a process in ``netns.create`` after the file was made and marked but
    before it has its name: nothing is left under /run/netns (a named temporary was, in
    the kill -9 tests)."""
    name = host_ns.ns("k")
    before = set(os.listdir("/run/netns"))
    child = textwrap.dedent(f"""
        import os, signal
        from reconciler.drivers import netns
        mark = netns.set_file_mark
        def killed(fd, value):
            mark(fd, value)
            os.kill(os.getpid(), signal.SIGKILL)
        netns.set_file_mark = killed
        netns.create({name!r}, file_mark="host-1")
    """)
    p = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True,
                       timeout=60)
    assert p.returncode == -9, p.stderr
    assert set(os.listdir("/run/netns")) - before == set()  # others may have gone meanwhile


def test_empty_file_is_not_a_namespace(host_ns: Netns, nl: links.Netlink) -> None:
    name = host_ns.ns("stale")
    with open(f"/run/netns/{name}", "w"):
        pass
    assert netns.is_namespace_mount(name) is False
    assert netns.namespace_inode(name) is None
    with pytest.raises(DriverError, match="not a namespace"):
        netns.create(name)
    with pytest.raises(DriverError, match="not a namespace"), netns.enter(name):
        pass
    observed = nl.observe_netns([name, host_ns.ns("missing")])
    assert observed == {name: LiveNetns(name=name, usable=False)}
    assert netns.create(name, replace_stale=True) is True
    assert netns.is_namespace_mount(name)
    assert ip_json(name, "link", "show")[0]["ifname"] == "lo"


def test_enter_switches_only_the_calling_thread(host_ns: Netns) -> None:
    home = nsfs.current_inode()
    target = netns.namespace_inode(host_ns.name)
    seen: list[int] = []
    go = threading.Event()

    def other() -> None:
        go.wait(10)
        seen.append(nsfs.current_inode())

    t = threading.Thread(target=other)
    t.start()  # before entering: a thread started inside would inherit the namespace
    with netns.enter(host_ns.name):
        assert nsfs.current_inode() == target
        go.set()
        t.join()
        born_inside: list[int] = []
        t2 = threading.Thread(target=lambda: born_inside.append(nsfs.current_inode()))
        t2.start()
        t2.join()
    assert seen == [home]
    assert born_inside == [target]  # documented pitfall: clone() copies the thread's netns
    assert nsfs.current_inode() == home
    with pytest.raises(DriverError, match="does not exist"), netns.enter(host_ns.ns("nope")):
        pass
    assert nsfs.current_inode() == home


def _python(code: str, *prefix: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, env=env, timeout=60)


def test_enter_process_netns(host_ns: Netns) -> None:
    code = """
        import os, sys
        from reconciler.drivers import netns
        from reconciler.domain.errors import PreconditionError
        try:
            netns.enter_process_netns(sys.argv[1] if len(sys.argv) > 1 else "%s")
        except PreconditionError as e:
            print("ERR", e)
        else:
            print(os.stat("/proc/self/ns/net").st_ino)
    """
    out = _python(code % host_ns.name)
    assert out.stdout.strip() == str(netns.namespace_inode(host_ns.name)), out.stderr
    out = _python(code % host_ns.ns("missing"))
    assert out.stdout.startswith("ERR network namespace") and "does not exist" in out.stdout
    with open(f"/run/netns/{host_ns.ns('empty')}", "w"):
        pass
    out = _python(code % host_ns.ns("empty"))
    assert "ERR" in out.stdout and "not a namespace" in out.stdout


def test_private_mount_namespace_is_detected(host_ns: Netns) -> None:
    code = f"""
        from reconciler.drivers import netns
        from reconciler.domain.errors import PreconditionError
        print("PROBLEM" if netns.private_mount_namespace_problem() else "FINE")
        try:
            netns.create("{host_ns.ns('inner')}")
        except PreconditionError as e:
            print("REFUSED", e)
        else:
            print("CREATED")
            netns.delete("{host_ns.ns('inner')}")
    """
    under_exec = _python(code, "ip", "netns", "exec", host_ns.name)
    assert under_exec.stdout.splitlines()[0] == "PROBLEM", under_exec.stderr
    assert "REFUSED" in under_exec.stdout and "ip netns exec" in under_exec.stdout
    assert not os.path.exists(f"/run/netns/{host_ns.ns('inner')}")
    under_nsenter = _python(code, "nsenter", f"--net=/run/netns/{host_ns.name}")
    assert under_nsenter.stdout.split() == ["FINE", "CREATED"], under_nsenter.stderr
    assert netns.private_mount_namespace_problem() is None


def test_namespace_created_in_process_outlives_it(host_ns: Netns) -> None:
    name = host_ns.ns("kept")
    out = _python(f"""
        from reconciler.drivers import netns
        print(netns.create("{name}"))
    """, "nsenter", f"--net=/run/netns/{host_ns.name}")
    assert out.stdout.strip() == "True", out.stderr
    assert netns.is_namespace_mount(name)
    assert ip_json(name, "link", "show")[0]["ifname"] == "lo"


# --- links ------------------------------------------------------------------------


def test_ensure_bridge(host_ns: Netns, nl: links.Netlink) -> None:
    assert nl.ensure_bridge("rtbr0", mtu=1400) is True
    br = ip_link(host_ns.name, "rtbr0")
    assert br is not None
    assert br["linkinfo"]["info_kind"] == "bridge" and br["mtu"] == 1400
    assert br["ifalias"] == "managed-by=reconciler" and "UP" in br["flags"]
    assert br["inet6_addr_gen_mode"] == "none"  # off before it was first up
    assert not [a for a in ip_json(host_ns.name, "addr", "show", "dev", "rtbr0")[0]["addr_info"]]
    assert nl.ensure_bridge("rtbr0", mtu=1500) is False
    assert ip_link(host_ns.name, "rtbr0")["mtu"] == 1400  # type: ignore[index]
    nl.set_link("rtbr0", mtu=1450, up=False, alias="")
    br = ip_link(host_ns.name, "rtbr0")
    assert br is not None
    assert br["mtu"] == 1450 and "UP" not in br["flags"] and "ifalias" not in br


def test_bridge_name_taken_by_another_kind(host_ns: Netns, nl: links.Netlink) -> None:
    sh("ip", "-n", host_ns.name, "link", "add", "rtbr0", "type", "veth", "peer", "name", "p")
    with pytest.raises(ConflictError, match="rtbr0.*veth"):
        nl.ensure_bridge("rtbr0")
    assert ip_link(host_ns.name, "rtbr0")["linkinfo"]["info_kind"] == "veth"  # type: ignore


def test_errors_name_the_object(host_ns: Netns, nl: links.Netlink) -> None:
    with pytest.raises(DriverError, match="link nosuch") as e:
        nl.set_link("nosuch", mtu=1400)
    assert e.value.errno == errno.ENODEV
    with pytest.raises(DriverError, match="link nosuch"):
        nl.add_address("nosuch", iface("10.1.0.1/24"))
    assert nl.delete_link("nosuch") is False
    assert nl.del_address("nosuch", iface("10.1.0.1/24")) is False
    nl.ensure_bridge("rtbr0")
    with pytest.raises(DriverError, match="rtbr0.*Invalid argument"):
        nl.set_link("rtbr0", mtu=10)
    assert nl.del_address("rtbr0", iface("10.1.0.1/24")) is False


def test_addresses_are_marked_and_idempotent(host_ns: Netns, nl: links.Netlink) -> None:
    nl.ensure_bridge("rtbr0")
    assert nl.add_address("rtbr0", iface("10.77.0.1/16")) is True
    assert nl.add_address("rtbr0", iface("10.77.0.1/16")) is False  # EEXIST: done
    assert nl.add_address("rtbr0", iface("fd00:77::1/64")) is True
    assert addr_protos(host_ns.name, "rtbr0") == {"10.77.0.1/16": 0x52, "fd00:77::1/64": 0x52}
    live = nl.dump_links()["rtbr0"]
    assert {a.address for a in live.addresses} == {iface("10.77.0.1/16"), iface("fd00:77::1/64")}
    assert nl.del_address("rtbr0", iface("10.77.0.1/16")) is True
    assert nl.del_address("rtbr0", iface("10.77.0.1/16")) is False
    assert list(addr_protos(host_ns.name, "rtbr0")) == ["fd00:77::1/64"]


def test_alloc_build_checked_with_ip(host_ns: Netns, nl: links.Netlink) -> None:
    bridge(nl)
    name, veth = build_alloc(nl, host_ns, "web", "10.77.0.10/16", "fd00:77::10/64")

    host_end = ip_link(host_ns.name, veth)
    assert host_end is not None
    assert host_end["master"] == "rtbr0" and "UP" in host_end["flags"]
    assert host_end["mtu"] == 1400 and host_end["ifalias"] == "managed-by=reconciler"
    assert host_end["linkinfo"]["info_slave_data"]["hairpin"] is True
    assert host_end["inet6_addr_gen_mode"] == "none"  # no link-local on a bridge port
    assert "link_netnsid" in host_end

    eth0 = ip_link(name, "eth0")
    assert eth0 is not None
    assert "UP" in eth0["flags"] and eth0["mtu"] == 1400
    assert eth0["inet6_addr_gen_mode"] == "none"
    assert eth0["ifalias"] == "managed-by=reconciler"
    assert "UP" in ip_link(name, "lo")["flags"]  # type: ignore[index]
    assert addr_protos(name, "eth0") == {"10.77.0.10/16": 0x52, "fd00:77::10/64": 0x52}
    routes = {(r["dst"], r.get("gateway"), r.get("protocol"))
              for r in ip_json(name, "route", "show")}
    assert ("default", "10.77.0.1", "82") in routes
    routes6 = {(r["dst"], r.get("gateway"), r.get("protocol"))
               for r in ip_json(name, "-6", "route", "show")}
    assert ("default", "fd00:77::1", "82") in routes6

    # the same again changes nothing (ADD must not be repeated blindly: EDGE 9)
    before = (ip_json(host_ns.name, "link", "show"), ip_json(name, "addr", "show"),
              ip_json(name, "route", "show"))
    assert nl.create_veth_into_netns(veth, name, "rtbr0", mtu=1400, hairpin=True) is False
    nl.configure_inside(name, [iface("10.77.0.10/16"), iface("fd00:77::10/64")], [GW4, GW6],
                        mtu=1400)
    after = (ip_json(host_ns.name, "link", "show"), ip_json(name, "addr", "show"),
             ip_json(name, "route", "show"))
    assert _stable(before) == _stable(after)

    # what observation reports matches what ip showed
    obs = nl.observe_netns([name])[name]
    assert obs.usable and obs.nsid == host_end["link_netnsid"]
    inside = {lk.name: lk for lk in obs.links}
    assert inside["eth0"].owned and inside["eth0"].up and inside["lo"].up
    assert {a.address for a in inside["eth0"].addresses if a.owned} == \
        {iface("10.77.0.10/16"), iface("fd00:77::10/64")}
    eth0_index = inside["eth0"].index  # both default routes leave through eth0 (RTA_OIF)
    assert LiveRoute("default", "10.77.0.1", True, oif=eth0_index) in obs.routes
    assert LiveRoute("default", "fd00:77::1", True, oif=eth0_index) in obs.routes
    hostside = nl.dump_links()[veth]
    assert (hostside.master, hostside.hairpin, hostside.owned, hostside.peer_netnsid) == \
        ("rtbr0", True, True, obs.nsid)


def _stable(state: tuple[list[dict[str, Any]], ...]) -> str:
    """ip's JSON minus what the kernel changes by itself after a while (timers,
    lifetimes, operstate and DAD flags settling) — not what we configure."""
    ticking = re.compile(r"(_timer|_life_time)$|^(operstate|tentative|flags)$")

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not ticking.search(k)}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    return json.dumps(strip(state), sort_keys=True)


def test_gateway_change_replaces_default_route(host_ns: Netns, nl: links.Netlink) -> None:
    bridge(nl)
    name, _ = build_alloc(nl, host_ns, "gw", "10.77.0.11/16")
    nl.replace_default_route("eth0", ipaddress.ip_address("10.77.0.2"), ns=name)
    defaults = [r for r in ip_json(name, "route", "show") if r["dst"] == "default"]
    assert [(r["gateway"], r["protocol"]) for r in defaults] == [("10.77.0.2", "82")]
    assert nl.del_default_route(4, ns=name) is True
    assert nl.del_default_route(4, ns=name) is False
    assert not [r for r in ip_json(name, "route", "show") if r["dst"] == "default"]


def test_hairpin_toggles(host_ns: Netns, nl: links.Netlink) -> None:
    bridge(nl)
    _, veth = build_alloc(nl, host_ns, "hp", "10.77.0.12/16", hairpin=False)

    def hairpin() -> bool:
        return bool(ip_link(host_ns.name, veth)["linkinfo"]["info_slave_data"]["hairpin"])  # type: ignore

    assert hairpin() is False
    nl.set_hairpin(veth, True)
    assert hairpin() is True
    assert nl.dump_links()[veth].hairpin is True
    nl.set_hairpin(veth, False)
    assert hairpin() is False


def test_bridge_recreated_behind_our_back_is_found_again(host_ns: Netns,
                                                         nl: links.Netlink) -> None:
    bridge(nl)
    build_alloc(nl, host_ns, "r1", "10.77.0.13/16")  # the bridge's index is remembered now
    sh("ip", "-n", host_ns.name, "link", "del", "rtbr0")
    sh("ip", "-n", host_ns.name, "link", "add", "rtbr0", "type", "bridge")
    _, veth = build_alloc(nl, host_ns, "r2", "10.77.0.14/16")
    assert ip_link(host_ns.name, veth)["master"] == "rtbr0"  # type: ignore[index]


def test_namespace_that_already_has_eth0(host_ns: Netns, nl: links.Netlink) -> None:
    bridge(nl)
    name = host_ns.ns("busy")
    netns.create(name)
    sh("ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "other")
    veth = alloc_veth_name(name)
    with pytest.raises(DriverError, match="already has a link named eth0"):
        nl.create_veth_into_netns(veth, name, "rtbr0")
    assert ip_link(host_ns.name, veth) is None  # no half-made veth


def test_host_veth_whose_peer_is_elsewhere(host_ns: Netns, nl: links.Netlink) -> None:
    bridge(nl)
    name = host_ns.ns("orphan")
    netns.create(name)
    veth = alloc_veth_name(name)
    sh("ip", "-n", host_ns.name, "link", "add", veth, "type", "veth", "peer", "name", "p0")
    with pytest.raises(DriverError, match="orphan"):
        nl.create_veth_into_netns(veth, name, "rtbr0")
    assert nl.delete_link(veth) is True
    assert ip_link(host_ns.name, veth) is None
    assert nl.create_veth_into_netns(veth, name, "rtbr0") is True


def test_observe_many_and_out_of_band_delete(host_ns: Netns, nl: links.Netlink) -> None:
    bridge(nl)
    names = [build_alloc(nl, host_ns, f"m{i}", f"10.77.1.{i + 1}/16")[0] for i in range(12)]
    obs = nl.observe_netns(names)
    assert set(obs) == set(names)
    for i, name in enumerate(names):
        eth0 = {lk.name: lk for lk in obs[name].links}["eth0"]
        assert [str(a.address) for a in eth0.addresses] == [f"10.77.1.{i + 1}/16"]
        # same view without entering: dumps through the target nsid from the host socket
        via_nsid = nlparse.assemble_links(nl.link_messages(nsid=obs[name].nsid),
                                        nl.addr_messages(nsid=obs[name].nsid))
        assert {lk.name: lk.addresses for lk in via_nsid} == \
            {lk.name: lk.addresses for lk in obs[name].links}

    # deleted behind our back: the cached socket must not keep it (and its veth) alive
    gone = names.pop()
    sh("ip", "netns", "del", gone)
    obs = nl.observe_netns(names + [gone])
    assert gone not in obs
    wait_for(lambda: ip_link(host_ns.name, alloc_veth_name(gone)) is None,
               what="the veth of a deleted namespace to disappear")

    # re-created under the same name: observed afresh, not through the stale socket
    netns.create(gone)
    assert {lk.name for lk in nl.observe_netns([gone])[gone].links} == {"lo"}

    for name in names + [gone]:
        assert nl.delete_netns(name) is True
    wait_for(lambda: not [lk for lk in ip_json(host_ns.name, "link", "show")
                            if lk["ifname"].startswith("vr")],
               what="all allocation veths to disappear")


def test_get_nsid(host_ns: Netns, nl: links.Netlink) -> None:
    name = host_ns.ns("id")
    netns.create(name)
    assert nl.get_nsid(name) is None  # no veth across yet: nothing assigned
    sh("ip", "-n", host_ns.name, "netns", "set", name, "auto")
    nsid = nl.get_nsid(name)
    listed = sh("ip", "-n", host_ns.name, "netns", "list-id").stdout
    assert nsid is not None and nsid >= 0 and f"nsid {nsid} " in listed + " "
