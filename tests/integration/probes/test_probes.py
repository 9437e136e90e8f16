"""Probes against the real kernel: what "reached" means, checked by independent listeners.

Each test applies a config in its own sandbox (``host_ns``) with the real CLI, then runs
``Prober`` in-process with the calling thread inside the sandbox. What the probes claim
is checked against listeners inside the allocation (which log every connection and
datagram with its source port), ``iptables``, ``conntrack -L`` and ``ss`` — never
against the prober itself."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time

import pytest

from reconciler.domain.ownership import probe_vantage_names
from reconciler.domain.probes import PROBE_PORTS, VANTAGE_PEER, ProbeSpec
from reconciler.drivers import netns
from reconciler.drivers.probe import runner as probe_runner
from reconciler.engine.observe import Observer
from tests.support.allocs import BRIDGE, veth_name
from tests.support.host import Netns, sh
from tests.support.probing import HOST_ADDR, failures, probe, recording, setup

pytestmark = pytest.mark.root


def test_every_path_is_reached_after_a_good_apply(host_ns: Netns, tmp_path: object) -> None:
    path, (a0, a1) = setup(host_ns, tmp_path)
    with recording(a0, "tcp:80", "udp:53", "tcp:443", "tcp:81") as seen:
        results = probe(host_ns, path, external=True)
    assert failures(results) == []
    reached = {(r.path, r.proto, r.family, r.port) for r in results if not r.skipped}
    assert reached == {
        *((alloc_gw, "icmp", f, None) for alloc_gw in ("gateway",) for f in (4, 6)),
        ("host", "tcp", 4, 18080), ("localhost", "tcp", 4, 18080), ("hairpin", "tcp", 4, 18080),
        ("external", "tcp", 4, 18080), ("direct", "tcp", 4, 80),  # direct: the port probed
        ("host", "udp", 4, 15353), ("localhost", "udp", 4, 15353), ("hairpin", "udp", 4, 15353),
        ("external", "udp", 4, 15353), ("direct", "udp", 4, 53),
        ("host", "tcp", 6, 18080), ("hairpin", "tcp", 6, 18080),
        ("external", "tcp", 6, 18080), ("direct", "tcp", 6, 80),  # the vantage's /126
        ("host", "udp", 6, 15353), ("hairpin", "udp", 6, 15353),
        ("external", "udp", 6, 15353), ("direct", "udp", 6, 53),
        ("localhost", "tcp", 4, 18443), ("direct", "tcp", 4, 443)}
    assert {(r.alloc, r.path) for r in results if r.alloc == a1} == {(a1, "gateway")}
    # the listeners saw each probe that claims to have arrived, from a reserved source port;
    # the direct probes (isolation: ports) did not arrive, and the probe: false map saw nothing
    counts = {(proto, port): sum(1 for p, q, _ in seen if (p, q) == (proto, port))
              for proto, port in (("tcp", 80), ("udp", 53), ("tcp", 443), ("tcp", 81))}
    assert counts == {("tcp", 80): 7, ("udp", 53): 7, ("tcp", 443): 1, ("tcp", 81): 0}, seen
    assert all(PROBE_PORTS[0] <= peer <= PROBE_PORTS[1] for _p, _q, peer in seen), seen


def test_what_must_not_arrive_is_watched_for_a_margin_not_the_whole_timeout(
        host_ns: Netns, tmp_path: object) -> None:
    # not a speed target: with a 20 s timeout, a run whose direct probes (isolation: ports)
    # waited for the timeout would take 20 s; they are watched for a margin after the last
    # probe that had to arrive, and still found not reached
    path, _ = setup(host_ns, tmp_path)
    t0 = time.monotonic()
    results = probe(host_ns, path, external=True, timeout=20.0)
    took = time.monotonic() - t0
    assert failures(results) == []
    assert any(r.path == "direct" and r.ok and not r.skipped for r in results)
    assert took < 10, f"the run took {took:.1f} s: the direct probes waited for the timeout"


def test_a_path_that_must_not_arrive_but_does_is_caught(host_ns: Netns,
                                                       tmp_path: object) -> None:
    """The probes that must not arrive are sent first and watched for a margin from their
    own send, timed by the kernel's stamps: a rule that lets the direct path through
    (isolation: ports says it must not) is still seen arriving and fails the probe.

    Another manager's accept cannot undo our drop (a drop in any nftables base chain is
    final): only a hand edit of our own table's isolation chain opens the path."""
    path, (a0, _a1) = setup(host_ns, tmp_path)
    addrs = json.loads(sh("ip", "-n", a0, "-j", "-4", "addr", "show", "dev", "eth0").stdout)
    ip = addrs[0]["addr_info"][0]["local"]
    sh("ip", "netns", "exec", host_ns.name, "nft", "insert", "rule", "inet", "reconciler",
       "isolate", "ip", "daddr", ip, "tcp", "dport", "80", "accept")
    with recording(a0, "tcp:80") as seen:
        results = probe(host_ns, path, external=True, allocs={a0})
    direct = {(r.proto, r.port, r.family): r for r in results if r.path == "direct"}
    assert not direct["tcp", 80, 4].ok and not direct["tcp", 80, 4].skipped, direct
    # the cause names our table's chain, whose drop did not take it, and a pass heals it
    assert "chain isolate of table inet reconciler" in (direct["tcp", 80, 4].cause or ""), direct
    assert direct["tcp", 80, 4].ours, direct
    assert direct["udp", 53, 4].ok and direct["tcp", 443, 4].ok, direct  # still held back
    assert direct["tcp", 80, 6].ok and direct["udp", 53, 6].ok, direct  # the rule is IPv4
    assert ("tcp", 80) in {(p, q) for p, q, _ in seen}  # it did arrive: the alloc saw it
    others = [r for r in results if r.path != "direct" and not r.ok and not r.skipped]
    assert others == []
    # the kernel's stamps time the arrivals: a sandbox path takes far less than the margin
    assert all(r.ms < probe_runner.NOT_REACHED_MARGIN * 1000 for r in results
               if r.ok and not r.skipped and r.path != "direct"), results


def test_probes_that_share_a_source_port_are_still_told_apart(
        host_ns: Netns, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above 1000 probes in a run (500 allocations with 2 maps) the reserved source ports
    are used again. Two probes of one map from the same port could not be told apart (the
    capture keys arrivals by veth, source port and container port) and, when both are
    masqueraded to the gateway (hairpin, localhost), made the same conntrack reply tuple:
    the kernel moved the second one to another source port. Forced here at two
    allocations: five ports, as many as one map has probes (host, localhost, hairpin,
    external, direct; an IPv6 map has four: no localhost)."""
    path, (a0, _a1) = setup(host_ns, tmp_path)
    monkeypatch.setattr(probe_runner, "PROBE_PORTS", (61000, 61004))
    with recording(a0, "tcp:80", "udp:53", "tcp:443") as seen:
        results = probe(host_ns, path, external=True)
    assert failures(results) == []
    # every probe arrived once, from the source port it was sent from (none moved by NAT)
    counts = {(proto, port): sum(1 for p, q, _ in seen if (p, q) == (proto, port))
              for proto, port in (("tcp", 80), ("udp", 53), ("tcp", 443))}
    assert counts == {("tcp", 80): 7, ("udp", 53): 7, ("tcp", 443): 1}, seen
    assert all(61000 <= peer <= 61004 for _p, _q, peer in seen), seen


def test_open_isolation_expects_the_direct_path(host_ns: Netns, tmp_path: object) -> None:
    path, (a0, _a1) = setup(host_ns, tmp_path, isolation="open")
    with recording(a0, "tcp:80") as seen:
        results = probe(host_ns, path, external=True, allocs={a0})
    assert failures(results) == []
    direct = [r for r in results if r.path == "direct"]
    assert {r.proto for r in direct} == {"tcp", "udp"} and all(r.ok for r in direct)
    assert ("tcp", 80) in {(p, q) for p, q, _ in seen}


def test_a_bare_sandbox_skips_what_cannot_exist(host_ns: Netns, tmp_path: object) -> None:
    path, (a0, _a1) = setup(host_ns, tmp_path, host_address=False)
    results = probe(host_ns, path)
    assert failures(results) == []
    skipped = {(r.path, r.proto, r.family, r.port, r.cause) for r in results if r.skipped}
    assert ("host", "tcp", 4, 18080, "no host address") in skipped
    assert ("host", "udp", 6, 15353, "no host address") in skipped
    assert ("hairpin", "tcp", 4, 18443, "published on 127.0.0.1 only") in skipped
    hairpin = [r for r in results if r.path == "hairpin" and not r.skipped]
    assert hairpin and all(r.ok for r in hairpin)  # to the gateway: local too


def spec_of(a0: str, dst: str, proto: str, port: int, to: int) -> ProbeSpec:
    return ProbeSpec(a0, "host", proto, 4, "host", dst, port, port, to)  # type: ignore[arg-type]


def test_a_reset_from_the_alloc_is_reached_one_from_a_reject_rule_is_not(
        host_ns: Netns, tmp_path: object) -> None:
    path, (a0, _a1) = setup(host_ns, tmp_path)
    tcp = spec_of(a0, HOST_ADDR, "tcp", 18080, 80)
    udp = spec_of(a0, HOST_ADDR, "udp", 15353, 53)
    with netns.enter(host_ns.name):
        # nobody listens on 80/53 in the alloc: its reset (and port unreachable) counts
        plain = probe_runner.run([tcp, udp])
    assert [(o.reached, o.answer) for o in plain] == [(True, "refused"), (True, "refused")]
    # the same answers from a REJECT rule in front of the alloc (after the DNAT: OUTPUT
    # filter sees port 80/53) must not count
    rules = [("OUTPUT", "-p", "tcp", "--dport", "80", "-j", "REJECT", "--reject-with",
              "tcp-reset"), ("OUTPUT", "-p", "udp", "--dport", "53", "-j", "REJECT")]
    for r in rules:
        host_ns.run("iptables", "-I", *r)
    try:
        with netns.enter(host_ns.name):
            rejected = probe_runner.run([tcp, udp])
        results = probe(host_ns, path, allocs={a0})
    finally:
        for r in rules:
            host_ns.run("iptables", "-D", *r)
    assert [o.reached for o in rejected] == [False, False]
    assert rejected[0].answer == "refused"  # what the sender saw is the same as above
    failed = {(r.path, r.proto): r.cause for r in results if not r.ok and not r.skipped}
    assert set(failed) == {("host", "tcp"), ("localhost", "tcp"), ("host", "udp"),
                           ("localhost", "udp")}, failed
    assert "filter/OUTPUT: -A OUTPUT -p tcp -m tcp --dport 80 -j REJECT" in \
        str(failed[("host", "tcp")])
    assert "filter/OUTPUT: -A OUTPUT -p udp -m udp --dport 53 -j REJECT" in \
        str(failed[("host", "udp")])


def test_a_reject_in_forward_fails_the_hairpin_with_its_rule(host_ns: Netns,
                                                            tmp_path: object) -> None:
    path, (a0, _a1) = setup(host_ns, tmp_path)
    rule = ("FORWARD", "-p", "udp", "--dport", "53", "-j", "REJECT")
    host_ns.run("iptables", "-I", *rule)
    try:
        results = probe(host_ns, path, allocs={a0}, external=True)
    finally:
        host_ns.run("iptables", "-D", *rule)
    failed = {(r.path, r.proto, r.family): r.cause for r in results if not r.ok}
    assert set(failed) == {("hairpin", "udp", 4), ("external", "udp", 4)}, failed
    assert all("filter/FORWARD: -A FORWARD -p udp -m udp --dport 53 -j REJECT" in str(c)
               for c in failed.values())


def _conntrack(host: Netns) -> list[str]:
    """Entries of the protocols probes use (the bridge's own IGMP reports are not theirs)."""
    out = host.run("conntrack", "-L", check=False)
    return [ln for ln in out.stdout.splitlines()
            if ln.split()[:1] in (["tcp"], ["udp"], ["icmp"], ["icmpv6"])]


def _probe_sockets(ns: str) -> list[str]:
    out = sh("ip", "netns", "exec", ns, "ss", "-Htuan").stdout.splitlines()
    return [ln for ln in out
            if any(f":{p} " in ln + " " for p in range(PROBE_PORTS[0], PROBE_PORTS[0] + 200))]


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def test_a_probe_run_leaves_nothing_behind(host_ns: Netns, tmp_path: object) -> None:
    if subprocess.run(["which", "conntrack"], capture_output=True).returncode:
        pytest.skip("conntrack(8) not installed")
    path, (a0, a1) = setup(host_ns, tmp_path)
    host_ns.run("conntrack", "-F", check=False)
    # the baseline after one observation: the Docker SDK keeps its unix socket (unixconn)
    # open from the first one on, which is not the probes'
    probe(host_ns, path, allocs=set())
    host_ns.run("conntrack", "-F", check=False)
    fds = _fds()
    with recording(a0, "tcp:80", "udp:53"):
        results = probe(host_ns, path, external=True)
    assert failures(results) == []
    # nothing the run opened is still open: every descriptor now was there before, the same
    # file or socket (an unrelated one the garbage collector closes meanwhile is no leak)
    assert {fd: t for fd, t in _fds().items() if fds.get(fd) != t} == {}
    assert _conntrack(host_ns) == []
    for ns in (host_ns.name, a0, a1):
        assert _probe_sockets(ns) == [], ns
        assert sh("ip", "netns", "exec", ns, "ss", "-Htan", "state", "time-wait").stdout == ""
    vantage, link = probe_vantage_names(str(os.stat(f"/run/netns/{host_ns.name}").st_ino))
    assert vantage not in sh("ip", "netns", "list").stdout
    assert host_ns.link(link) is None
    assert not os.path.exists(f"/run/reconciler/probe-vantage-{vantage.split('-')[1]}.lock")


@pytest.mark.parametrize("breakage", ["mtu", "route_localnet", "hairpin", "forwarding",
                                      "rp_filter"])
def test_a_broken_path_names_its_cause(host_ns: Netns, tmp_path: object, breakage: str) -> None:
    """Each breakage fails the paths it must, with the cause a person can act on, and says
    whether a reconcile pass owns it (the agent heals only those)."""
    path, (a0, _a1) = setup(host_ns, tmp_path)
    veth = veth_name(a0)
    peer = f"{VANTAGE_PEER}/32"
    on, off, failing, words, ours = {
        "mtu": ([("ip", "link", "set", veth, "mtu", "1280")],
                [("ip", "link", "set", veth, "mtu", "1400")],
                {("gateway", 4), ("gateway", 6)}, "MTU black hole: a 1400-byte echo", False),
        "route_localnet": ([("sysctl", "-qw", f"net.ipv4.conf.{BRIDGE}.route_localnet=0")],
                           [("sysctl", "-qw", f"net.ipv4.conf.{BRIDGE}.route_localnet=1")],
                           {("localhost", 4)}, "route_localnet is off", True),
        "hairpin": ([("ip", "link", "set", veth, "type", "bridge_slave", "hairpin", "off")],
                    [("ip", "link", "set", veth, "type", "bridge_slave", "hairpin", "on")],
                    {("hairpin", 4), ("hairpin", 6)}, "hairpin is off", True),
        "forwarding": ([("sysctl", "-qw", "net.ipv4.ip_forward=0")],
                       [("sysctl", "-qw", "net.ipv4.ip_forward=1")],
                       {("hairpin", 4), ("external", 4)}, "forwarding is off", True),
        # strict rp_filter, and the vantage's address routed to another link of the sandbox
        "rp_filter": ([("sysctl", "-qw", "net.ipv4.conf.all.rp_filter=1"),
                       ("ip", "route", "add", peer, "dev", "hostaddr0")],
                      [("ip", "route", "del", peer, "dev", "hostaddr0"),
                       ("sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0")],
                      {("external", 4)}, "strict reverse-path filtering dropped it", False),
    }[breakage]
    for cmd in on:
        host_ns.run(*cmd)
    try:
        results = probe(host_ns, path, allocs={a0}, external=True)
    finally:
        for cmd in off:
            host_ns.run(*cmd)
    failed = [r for r in results if not r.ok and not r.skipped]
    assert {(r.path, r.family) for r in failed} == failing, [r.describe() for r in failed]
    assert all(words in str(r.cause) and r.ours is ours for r in failed), \
        [(r.describe(), r.ours) for r in failed]
    assert failures(probe(host_ns, path, allocs={a0}, external=True)) == []  # holds again


def test_the_diagnosis_reads_from_netlink_what_ip_says(host_ns: Netns, tmp_path: object) -> None:
    """Route, neighbour and eth0 MAC facts come from the netlink driver now (RTM_GETROUTE,
    a neighbour dump, RTM_GETLINK inside the allocation): they must say what ``ip`` says."""
    _path, (a0, _a1) = setup(host_ns, tmp_path)
    n = host_ns.name
    # a reachable entry, a stale one and one without a MAC (incomplete or failed)
    host_ns.run("ping", "-c1", "-W1", "10.77.0.2", check=False)
    sh("ip", "-n", n, "neigh", "replace", "10.77.0.77", "lladdr", "02:00:00:00:77:77", "dev",
       BRIDGE, "nud", "stale")
    host_ns.run("ping", "-c1", "-W1", "10.77.0.99", check=False)
    want_neigh = {e["dst"]: (e.get("lladdr"), ",".join(e.get("state", ())))
                  for e in json.loads(sh("ip", "-n", n, "-j", "neigh", "show", "dev",
                                         BRIDGE).stdout or "[]")}
    want_mac = json.loads(sh("ip", "-n", a0, "-j", "link", "show", "eth0").stdout)[0]["address"]
    routes = {}
    for addr in ("10.77.0.2", "fd00:77::2", HOST_ADDR, "203.0.113.9"):
        r = subprocess.run(["ip", "-n", n, "-j", "route", "get", addr], capture_output=True,
                           text=True, check=False)
        if r.returncode:
            routes[addr] = (None, r.stderr.strip().splitlines()[-1]
                            .removeprefix("RTNETLINK answers: ").lower())
        else:
            got = json.loads(r.stdout)[0]
            routes[addr] = (got.get("dev"), got.get("type", "unicast"))
    assert routes["203.0.113.9"][0] is None  # the sandbox has no default route
    with netns.enter(n):
        obs = Observer()
        try:
            nl = obs.handles.netlink
            index = nl.link_index(BRIDGE)
            assert index is not None
            assert nl.neighbour_states(index) == want_neigh
            assert {a: nl.route_get(a) for a in routes} == routes
            eth0 = nl.get_link("eth0", ns=a0)
            assert eth0 is not None and eth0.mac == want_mac
        finally:
            obs.handles.close()
    assert "10.77.0.77" in want_neigh and want_neigh["10.77.0.77"][1] == "STALE"


pytestmark = pytest.mark.root


@pytest.mark.parametrize("bridged", ["1", "0"])
def test_hairpin_false_is_checked_with_br_netfilter_and_skipped_without(
        host_ns: Netns, tmp_path: object, bridged: str) -> None:
    """With br_netfilter the port's flag stops the hairpin path (expected not to arrive);
    without it the host routes the packet back out of the bridge device and it arrives
    whatever the flag says (``reach`` shows it), so the path is skipped, not failed."""
    from tests.support.allocs import alloc_ids, config, listening, reach  # noqa: PLC0415

    for table in ("iptables", "ip6tables"):
        host_ns.run("sysctl", "-qw", f"net.bridge.bridge-nf-call-{table}={bridged}")
    a0, a1 = alloc_ids(2)
    off = config(tmp_path, [{"id": a0, "ports": [{"host": 8080, "to": 80}]}, {"id": a1}],
                 hairpin=False, name="off.yaml")
    r = host_ns.reconcile("apply", off)
    assert r.rc == 0, r.all
    with listening(a0, "tcp:80"):
        got = reach(a0, "tcp", "10.77.0.1", 8080, timeout=1)
    assert (got is None) == (bridged == "1"), got
    v = host_ns.reconcile("-v", "verify", off)
    assert v.rc == 0, v.all
    hairpin = [ln for ln in v.out.splitlines() if "path hairpin" in ln]
    assert hairpin and all(("held" in ln) == (bridged == "1") for ln in hairpin), hairpin
    if bridged == "0":
        assert all("skipped: hairpin: false cannot stop it" in ln for ln in hairpin), hairpin
