"""Stable identities against the real kernel: derived MACs, pinned bridge MACs, neighbour
entries and announcements (issue 13, item 1).

Each test runs the CLI in a sandbox host namespace (``host_ns``) and checks with
``ip -j``, ``/sys`` of the namespace (``ip netns exec`` mounts its own), an
AF_PACKET capture on the bridge and real TCP from a client namespace routed to
the sandbox. MACs are derived here independently of the package (sha256 of
the documented prefix and the name)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from reconciler.drivers import netns
from tests.support.host import Netns, sh, unique
from tests.support.identities import (
    BRIDGE,
    alloc_mac,
    apply_ok,
    bridge_mac,
    config,
    ids,
    v4_of,
    v6_of,
)
from tests.support.lifetime import lease_file
from tests.support.traffic import HOST_IP, client_of, fetch, listening

pytestmark = pytest.mark.root


def veth_name(aid: str) -> str:
    return "vr" + hashlib.sha1(aid.encode()).hexdigest()[:12]


def link_mac(ns: str, name: str) -> str:
    (link,) = json.loads(sh("ip", "-n", ns, "-j", "link", "show", "dev", name).stdout)
    return str(link["address"])


def assign_type(ns: str, name: str) -> int:
    """addr_assign_type from a sysfs of that namespace (``ip netns exec`` mounts one)."""
    return int(sh("ip", "netns", "exec", ns, "cat",
                  f"/sys/class/net/{name}/addr_assign_type").stdout)


def neighbours(host: Netns, dev: str) -> dict[str, tuple[str | None, list[str]]]:
    out = json.loads(sh("ip", "-n", host.name, "-j", "neigh", "show", "dev", dev).stdout or "[]")
    return {n["dst"]: (n.get("lladdr"), n.get("state", [])) for n in out}


def notify_settings(ns: str) -> list[str]:
    """arp_notify and ndisc_notify of the namespace's eth0 (``/proc/sys/net`` of it)."""
    return [sh("ip", "netns", "exec", ns, "cat", f"/proc/sys/net/{key}").stdout.strip()
            for key in ("ipv4/conf/eth0/arp_notify", "ipv6/conf/eth0/ndisc_notify")]


def connect_soon(client: Netns, port: int, within: float) -> tuple[str, float]:
    """The answer of the port map and how long the first successful connection took."""
    start = time.monotonic()
    got = ""
    while time.monotonic() - start < within and not got:
        got = fetch(client, HOST_IP, port, timeout=0.3)
    return got, time.monotonic() - start


def test_a_healed_veth_keeps_eth0s_mac_and_the_port_map_answers_at_once(host_ns: Netns,
                                                                       tmp_path):
    # a second allocation keeps the bridge's carrier up when the first's veth goes: else
    # the kernel flushes the bridge's neighbour entries (arp_evict_nocarrier) and the
    # stale MAC would be forgotten anyway
    aid, other = ids(2)
    path = config(tmp_path, [{"id": aid, "ports": [{"host": 18080, "to": 80}]}, {"id": other}])
    with client_of(host_ns) as client:
        apply_ok(host_ns, path)
        # the bridge's MAC set (as this version makes it; the line is a no-op then), so
        # that a change of it, which flushes its neighbour entries, hides nothing here
        sh("ip", "-n", host_ns.name, "link", "set", BRIDGE, "address",
           link_mac(host_ns.name, BRIDGE))
        first = link_mac(aid, "eth0")
        with listening(aid, 80):
            assert fetch(client, HOST_IP, 18080) == "ok 80"
            ip = v4_of(aid)
            assert neighbours(host_ns, BRIDGE)[ip][0] == first  # the host has it cached
            sh("ip", "-n", host_ns.name, "link", "del", veth_name(aid))
            r = host_ns.reconcile("apply", path)
            assert r.rc == 0, r.all
            got, took = connect_soon(client, 18080, within=1.0)
            assert got == "ok 80", f"port map unreachable for {took:.1f}s after the heal"
        assert first == link_mac(aid, "eth0") == alloc_mac(aid)  # ip -j link inside
        assert host_ns.reconcile("plan", path).out.count("No changes.") == 1


def test_the_bridge_mac_is_set_at_creation_and_kept_as_allocs_come_and_go(host_ns: Netns,
                                                                          tmp_path):
    a, b = ids(2)
    apply_ok(host_ns, config(tmp_path, [{"id": a}, {"id": b}]))
    mac = link_mac(host_ns.name, BRIDGE)
    seen = [mac]
    for allocs in ([{"id": b}], [], [{"id": a}]):
        apply_ok(host_ns, config(tmp_path, allocs))
        seen.append(link_mac(host_ns.name, BRIDGE))  # with none: not 00:00:00:00:00:00
    assert seen == [mac] * 4, seen
    assert mac == bridge_mac(BRIDGE) and assign_type(host_ns.name, BRIDGE) == 3


def test_an_older_bridge_is_pinned_to_its_mac_and_older_allocs_keep_theirs(host_ns: Netns,
                                                                          tmp_path):
    # a bridge as versions before stable MACs made it (no MAC set, our alias), with a port
    # (which also keeps its carrier up through the heal below: without carrier the kernel
    # flushes the bridge's neighbour entries itself)
    h = host_ns.name
    sh("ip", "-n", h, "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "-n", h, "link", "set", BRIDGE, "alias", "managed-by=reconciler", "up")
    port = unique("p")
    sh("ip", "-n", h, "link", "add", port, "type", "veth", "peer", "name", port + "x")
    sh("ip", "-n", h, "link", "set", port, "master", BRIDGE)
    sh("ip", "-n", h, "link", "set", port + "x", "up")
    sh("ip", "-n", h, "link", "set", port, "up")  # both ends up: the port has carrier
    before = link_mac(h, BRIDGE)
    assert assign_type(h, BRIDGE) != 3 and before == link_mac(h, port)

    (aid,) = ids(1)
    path = config(tmp_path, [{"id": aid, "ports": [{"host": 18081, "to": 80}]}])
    r = host_ns.reconcile("plan", path)
    assert r.rc == 2 and f"mac: {before} -> pin {before}" in r.out.replace('"', ""), r.all
    apply_ok(host_ns, path)
    assert link_mac(h, BRIDGE) == before and assign_type(h, BRIDGE) == 3

    # an allocation made before stable MACs: a random eth0 MAC, kept (no churn); such a
    # version kept no leases (with one, a MAC changed by hand is drift: tests/integration/
    # lifetime/test_leases.py)
    os.unlink(lease_file(host_ns))
    old = "06:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(5))
    sh("ip", "-n", aid, "link", "set", "eth0", "address", old)
    sh("ip", "netns", "exec", aid, "sh", "-c", "echo 0 > /proc/sys/net/ipv4/conf/default/arp_notify"
       " && echo 0 > /proc/sys/net/ipv6/conf/default/ndisc_notify")  # as earlier versions made it
    with client_of(host_ns) as client, listening(aid, 80):
        assert fetch(client, HOST_IP, 18081) == "ok 80"
        ip = v4_of(aid)
        assert neighbours(host_ns, BRIDGE)[ip][0] == old
        r = host_ns.reconcile("plan", path)
        assert r.rc == 0 and "No changes." in r.out, r.all
        assert link_mac(aid, "eth0") == old
        # re-created by a heal: the derived MAC, and the bridge's entry follows in the run
        sh("ip", "-n", h, "link", "del", veth_name(aid))
        r = host_ns.reconcile("plan", path)
        assert f"neighbour: {ip} at {old} -> {alloc_mac(aid)}" in r.out.replace('"', ""), r.all
        r = host_ns.reconcile("apply", path)
        assert r.rc == 0, r.all
        assert link_mac(aid, "eth0") == alloc_mac(aid)
        assert neighbours(host_ns, BRIDGE)[ip][0] == alloc_mac(aid)
        assert notify_settings(aid) == ["1", "1"]  # a namespace of an earlier run: entered
        got, took = connect_soon(client, 18081, within=1.0)
        assert got == "ok 80", f"port map unreachable for {took:.1f}s"
    sh("ip", "-n", h, "link", "del", port)
    assert link_mac(h, BRIDGE) == before  # the port whose MAC it had went: kept


def test_a_stale_neighbour_entry_is_replaced_and_a_permanent_one_reported(host_ns: Netns,
                                                                         tmp_path):
    (aid,) = ids(1)
    path = config(tmp_path, [{"id": aid}])
    apply_ok(host_ns, path)
    ip, ip6 = v4_of(aid), v6_of(aid)
    wrong = "02:00:5e:10:00:01"
    for addr in (ip, ip6):
        sh("ip", "-n", host_ns.name, "neigh", "replace", addr, "lladdr", wrong, "dev", BRIDGE,
           "nud", "stale")
    r = host_ns.reconcile("plan", path)
    assert r.rc == 2 and f"~ alloc {aid}" in r.out and "neighbour" in r.out, r.all
    apply_ok(host_ns, path)
    table = neighbours(host_ns, BRIDGE)
    assert table[ip][0] == alloc_mac(aid) and table[ip6][0] == alloc_mac(aid), table

    sh("ip", "-n", host_ns.name, "neigh", "replace", ip, "lladdr", wrong, "dev", BRIDGE,
       "nud", "permanent")
    r = host_ns.reconcile("apply", path)
    assert r.rc == 0 and "No changes." in r.out, r.all
    # a long warning is wrapped onto indented lines (SPEC §13), never cut
    assert f"permanent neighbour entry {ip} lladdr {wrong}" in " ".join(r.all.split()), r.all
    assert neighbours(host_ns, BRIDGE)[ip] == (wrong, ["PERMANENT"])


@contextlib.contextmanager
def capture(host: Netns, dev: str) -> Iterator[socket.socket]:
    """An AF_PACKET socket on ``dev`` of the sandbox host, seeing every frame it gets."""
    with netns.enter(host.name):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    try:
        sock.bind((dev, 0))
        sock.setblocking(False)
        yield sock
    finally:
        sock.close()


def frames(sock: socket.socket, wait: float) -> list[bytes]:
    out = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            out.append(sock.recv(2048))
        except BlockingIOError:
            time.sleep(0.01)
    return out


def garps(seen: list[bytes], mac: bytes | None = None, ip: bytes | None = None) -> list[bytes]:
    """Gratuitous ARP requests (broadcast, sender = target address), of ``mac`` for ``ip``."""
    return [f for f in seen if f[12:14] == b"\x08\x06" and f[:6] == b"\xff" * 6
            and struct.unpack("!H", f[20:22])[0] == 1 and f[28:32] == f[38:42]
            and (mac is None or (f[6:12] == mac and f[22:28] == mac))
            and (ip is None or f[28:32] == ip)]


def unsolicited_nas(seen: list[bytes], mac: bytes | None = None,
                    ip6: bytes | None = None) -> list[bytes]:
    """Neighbour advertisements to ff02::1 (override flag, target link-layer address)."""
    return [f for f in seen if f[12:14] == b"\x86\xdd" and f[20] == 58 and f[21] == 255
            and f[38:54] == socket.inet_pton(socket.AF_INET6, "ff02::1") and f[54] == 136
            and f[58] & 0x20 and f[78:80] == b"\x02\x01"
            and (mac is None or (f[6:12] == mac and f[80:86] == mac))
            and (ip6 is None or f[62:78] == ip6)]


def assert_announced(seen: list[bytes], aid: str) -> None:
    mac = bytes.fromhex(alloc_mac(aid).replace(":", ""))
    assert garps(seen, mac, socket.inet_aton(v4_of(aid))), "no gratuitous ARP for the address"
    assert unsolicited_nas(seen, mac, socket.inet_pton(socket.AF_INET6, v6_of(aid))), \
        "no unsolicited neighbour advertisement (override, target lladdr) for it"


def test_a_fresh_bulk_create_announces_nothing(host_ns: Netns, tmp_path):
    # addresses nothing on the segment has seen: no cache to update, and each announcement
    # would be flooded to every port (O(N^2) frames for a bulk create)
    apply_ok(host_ns, config(tmp_path, []))
    allocs = ids(20)
    with capture(host_ns, BRIDGE) as sock:
        apply_ok(host_ns, config(tmp_path, [{"id": a} for a in allocs]))
        seen = frames(sock, 0.5)
    assert not garps(seen), f"{len(garps(seen))} gratuitous ARP(s) for new addresses"
    assert not unsolicited_nas(seen), f"{len(unsolicited_nas(seen))} unsolicited NA(s)"
    assert notify_settings(allocs[0]) == ["1", "1"]  # still on, for a later MAC change
    # on eth0 itself, not as the namespace's defaults
    assert [sh("ip", "netns", "exec", allocs[0], "cat", f"/proc/sys/net/{key}").stdout.strip()
            for key in ("ipv4/conf/default/arp_notify", "ipv6/conf/default/ndisc_notify")] == \
        ["0", "0"]


def test_an_address_handed_over_in_one_run_is_announced_on_the_wire(host_ns: Netns,
                                                                     tmp_path):
    old, new = ids(2)
    apply_ok(host_ns, config(tmp_path, [{"id": old}]))
    ip, ip6 = v4_of(old), v6_of(old)
    with capture(host_ns, BRIDGE) as sock:
        apply_ok(host_ns, config(tmp_path, [{"id": new}]))  # old pruned, new takes its address
        seen = frames(sock, 0.5)
    assert (v4_of(new), v6_of(new)) == (ip, ip6)
    assert_announced(seen, new)
    assert notify_settings(new) == ["1", "1"]


def test_a_heal_is_announced_on_the_wire(host_ns: Netns, tmp_path):
    aid, other = ids(2)  # the other keeps the bridge's carrier up through the heal
    path = config(tmp_path, [{"id": aid}, {"id": other}])
    apply_ok(host_ns, path)
    sh("ip", "-n", host_ns.name, "link", "del", veth_name(aid))
    r = host_ns.reconcile("-v", "plan", path)
    assert r.out.count("announce=True") == 1 and f"netns={aid}, " in r.out, r.all
    with capture(host_ns, BRIDGE) as sock:
        apply_ok(host_ns, path)
        seen = frames(sock, 0.5)
    assert_announced(seen, aid)
    other_mac = bytes.fromhex(alloc_mac(other).replace(":", ""))
    assert not garps(seen, other_mac) and not unsolicited_nas(seen, other_mac)
