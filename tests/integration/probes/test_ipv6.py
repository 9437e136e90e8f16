"""IPv6 port maps probed from the external vantage point, against the real kernel (issue 13).

The vantage link carries an IPv6 pair from a reserved ULA /126 beside its IPv4 /30, so an
IPv6 map is probed from "another host" too: ``external`` through the map (ip6tables
PREROUTING DNAT, FORWARD) and ``direct`` to the allocation's own IPv6 address. What the
probes claim is checked against listeners inside the allocation that log each peer's
address, against ``ip -j -6 addr`` inside the vantage namespace and ``ip6tables-save``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import pytest

from reconciler.domain.ownership import probe_vantage_names
from reconciler.domain.probes import PROBE_PORTS, ProbeResult
from reconciler.drivers import netns
from tests.support.host import Netns, sh, write
from tests.support.probing import failures, recorder_lines, setup
from tests.support.probing import probe as run_probes

pytestmark = pytest.mark.root

#: the vantage link's IPv6 pair as docs/verify.md documents it (not read from our code)
V6_NET, V6_HOST, V6_PEER = "fd18:d6bc:22af::/126", "fd18:d6bc:22af::1", "fd18:d6bc:22af::2"

#: logs "PROTO PORT PEERADDR PEERPORT" for every TCP connection and UDP datagram
RECORDER6 = r"""
import socket, sys, threading
lock = threading.Lock()
def log(*words):
    with lock:
        sys.stdout.write(" ".join(map(str, words)) + "\n"); sys.stdout.flush()
def tcp(port):
    s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0); s.bind(("::", port)); s.listen(64)
    while True:
        c, peer = s.accept(); log("tcp", port, peer[0], peer[1]); c.close()
def udp(port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0); s.bind(("::", port))
    while True:
        _d, peer = s.recvfrom(512); log("udp", port, peer[0], peer[1])
for spec in sys.argv[1:]:
    proto, port = spec.split(":")
    threading.Thread(target=tcp if proto == "tcp" else udp, args=(int(port),), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""

Seen = list[tuple[str, int, str, int]]


@contextlib.contextmanager
def recording(ns: str, *specs: str) -> Iterator[Seen]:
    """Listeners in ``ns``; the list fills with (proto, port, peer, peer port) at the end."""
    seen: Seen = []
    try:
        with recorder_lines(ns, RECORDER6, *specs) as words:
            yield seen
    finally:
        seen += [(proto, int(port), peer.removeprefix("::ffff:"), int(pport))
                 for proto, port, peer, pport in words]


def _vantage(host: Netns) -> tuple[str, str]:
    return probe_vantage_names(str(os.stat(f"/run/netns/{host.name}").st_ino))


def _v6_addresses(ns: str | None, dev: str) -> list[dict[str, object]]:
    """``ip -j -6 addr show dev DEV`` (in ``ns``): every IPv6 address with its flags."""
    cmd = ["ip", *(["-n", ns] if ns else []), "-j", "-6", "addr", "show", "dev", dev]
    links = json.loads(sh(*cmd).stdout or "[]")
    return [a for lk in links for a in lk.get("addr_info", ())]


def by_path(results: list[ProbeResult], family: int = 6) -> dict[tuple[str, str, int | None],
                                                                  ProbeResult]:
    return {(r.path, r.proto, r.port): r for r in results if r.family == family}


def _alloc6(alloc: str) -> str:
    addrs = json.loads(sh("ip", "-n", alloc, "-j", "-6", "addr", "show", "dev", "eth0").stdout)
    return next(str(a["local"]) for a in addrs[0]["addr_info"] if a.get("scope") == "global")


def test_an_ipv6_map_is_probed_from_outside_and_direct_is_held_back(
        host_ns: Netns, tmp_path: object) -> None:
    """isolation: ports — ``external`` v6 arrives through the map (from the vantage's IPv6
    address, as the listener sees it), ``direct`` v6 to the allocation's own address does
    not (the expectation, and it holds). The vantage link has its pair, with no link-local
    address and no DAD (checked with ``ip -j -6 addr`` on both ends)."""
    path, (a0, _a1) = setup(host_ns, tmp_path)
    ns, link = _vantage(host_ns)
    ends: dict[str, list[dict[str, object]]] = {}

    def look() -> None:
        ends["peer"] = _v6_addresses(ns, "eth0")
        ends["host"] = _v6_addresses(host_ns.name, link)

    with recording(a0, "tcp:80", "udp:53") as seen:
        results = run_probes(host_ns, path, look, external=True, allocs={a0})
    assert failures(results) == [], (results, seen)
    v6 = by_path(results)
    for key in (("external", "tcp", 18080), ("external", "udp", 15353),
                ("direct", "tcp", 80), ("direct", "udp", 53)):
        assert key in v6, sorted(v6)
        assert v6[key].ok and not v6[key].skipped, v6[key]
    assert ("external", "tcp", 18443) not in v6  # a 127.0.0.1-only map is IPv4
    # the listener saw the external probes from the vantage's IPv6 address and a reserved
    # source port, once each: the direct ones (isolation: ports) never arrived
    from_vantage = [(p, q) for p, q, peer, pport in seen
                    if peer == V6_PEER and PROBE_PORTS[0] <= pport <= PROBE_PORTS[1]]
    assert sorted(from_vantage) == [("tcp", 80), ("udp", 53)], seen
    # the pair, and nothing else: no link-local (address generation off), no DAD (nodad)
    for end, want in (("peer", V6_PEER), ("host", V6_HOST)):
        got = ends[end]
        assert [(a["local"], a["prefixlen"]) for a in got] == [(want, 126)], (end, got)
        assert got[0].get("nodad") is True and not got[0].get("tentative"), (end, got)
    # the vantage is gone with the prober, v6 pair and all
    assert ns not in [ln.split()[0] for ln in sh("ip", "netns", "list").stdout.splitlines()
                      if ln.strip()]
    assert host_ns.link(link) is None


def test_open_isolation_expects_the_ipv6_direct_path(host_ns: Netns, tmp_path: object) -> None:
    path, (a0, _a1) = setup(host_ns, tmp_path, isolation="open")
    with recording(a0, "tcp:80", "udp:53") as seen:
        results = run_probes(host_ns, path, external=True, allocs={a0})
    assert failures(results) == []
    v6 = by_path(results)
    assert v6[("direct", "tcp", 80)].ok and v6[("direct", "udp", 53)].ok, v6
    assert not v6[("direct", "tcp", 80)].skipped
    # through the map and straight to the address: twice each from the vantage's address
    from_vantage = sorted((p, q) for p, q, peer, _pp in seen if peer == V6_PEER)
    assert from_vantage == [("tcp", 80), ("tcp", 80), ("udp", 53), ("udp", 53)], seen


def test_a_foreign_ip6tables_drop_is_named_by_verify_on_the_ipv6_external_path(
        host_ns: Netns, tmp_path: object) -> None:
    """A foreign ip6tables DROP in FORWARD for the allocation's IPv6 address: FORWARD now
    drops, so the config lacks our shim there (SPEC §12: ``verify --no-probe`` exits 1 naming
    the rule), the IPv4 paths and the IPv6 paths from inside the host hold, and ``verify``
    fails on the IPv6 external path naming the rule. An apply puts the shim ahead of it and
    the declared paths hold with the rule still there."""
    path, (a0, _a1) = setup(host_ns, tmp_path)
    addr6 = _alloc6(a0)
    rule = ("FORWARD", "-s", V6_PEER, "-d", addr6, "-j", "DROP")
    saved = f"-A FORWARD -s {V6_PEER}/128 -d {addr6}/128 -j DROP"
    host_ns.run("ip6tables", "-I", *rule)
    try:
        assert saved in host_ns.iptables_save(6)
        config_only = host_ns.reconcile("verify", path, "--no-probe")
        assert config_only.rc == 1, config_only.all
        assert f"+ shim ip6tables filter/FORWARD: the chain drops ({saved})" in \
            config_only.out, config_only.all
        r = host_ns.reconcile("verify", path, "--output", "json")
        assert r.rc == 1, r.all
        doc = json.loads(r.out)
        assert doc["config"]["ok"] is False
        assert [c["kind"] for c in doc["config"]["changes"]] == ["shim"], doc["config"]
        bad = {(p["alloc"], p["path"], p["proto"], p["family"]): p["cause"]
               for p in doc["probes"] if not p["ok"] and not p["skipped"]}
        assert set(bad) == {(a0, "external", "tcp", 6), (a0, "external", "udp", 6)}, bad
        assert all(f"ip6tables filter/FORWARD: -A FORWARD -s {V6_PEER}/128" in str(c)
                   for c in bad.values()), bad
        # the shim, ahead of the foreign DROP, lets the declared paths through it
        assert host_ns.reconcile("apply", path).rc == 0
        after = host_ns.iptables_save(6)
        assert after.index("reconciler:shim") < after.index(saved), after
        healed = host_ns.reconcile("verify", path)
        assert healed.rc == 0, healed.all
    finally:
        host_ns.run("ip6tables", "-D", *rule)
    text = host_ns.reconcile("verify", path)
    assert text.rc == 1 and "shim" in text.out, text.all  # no drop left: the shim goes
    assert host_ns.reconcile("apply", path).rc == 0
    assert "reconciler:shim" not in host_ns.iptables_save(6)
    assert host_ns.reconcile("verify", path).rc == 0


def test_ipv6_forwarding_off_is_named_on_the_ipv6_external_path(
        host_ns: Netns, tmp_path: object) -> None:
    path, (a0, _a1) = setup(host_ns, tmp_path)
    assert host_ns.run("sysctl", "-n", "net.ipv6.conf.all.forwarding").stdout.strip() == "1"
    host_ns.run("sysctl", "-qw", "net.ipv6.conf.all.forwarding=0")
    try:
        results = run_probes(host_ns, path, external=True, allocs={a0})
    finally:
        host_ns.run("sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
    failed = {(r.path, r.proto, r.family): r for r in results if not r.ok and not r.skipped}
    assert {("external", "tcp", 6), ("external", "udp", 6)} <= set(failed), \
        [r.describe() for r in failed.values()]
    assert all(f[2] == 6 for f in failed), [r.describe() for r in failed.values()]
    for key in (("external", "tcp", 6), ("external", "udp", 6)):
        assert failed[key].cause == "forwarding is off (net.ipv6.conf.all.forwarding=0)"
        assert failed[key].ours
    assert failures(run_probes(host_ns, path, external=True, allocs={a0})) == []


@pytest.mark.real_process  # the exit code and error shape of a real process
def test_a_declared_prefix_on_the_reserved_ipv6_pair_is_a_conflict(
        host_ns: Netns, tmp_path: object) -> None:
    cfg = write(tmp_path, "v6.yaml", "\n".join((
        "version: 1", "bridges: [{name: rv6r0}]", "subnets:", "  - name: clash",
        "    bridge: rv6r0", "    cidr: 10.79.0.0/24", "    cidr6: fd18:d6bc:22af::/64", "")))
    r = host_ns.reconcile("plan", cfg, "--no-agent")
    assert r.rc == 1, r.all
    assert (f"! subnet clash: cidr6 fd18:d6bc:22af::/64 overlaps {V6_NET}, reserved for the "
            "probes' external vantage link") in r.out, r.out
    assert f"# {cfg}:4" in r.out, r.out
    assert "Traceback" not in r.all
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 1, r.all
    assert "1 resource(s) blocked" in r.err and "subnet clash: cidr6" in r.err, r.all
    assert "Traceback" not in r.all
    # the subnet is blocked (SPEC §11): its bridge may be made, no address of it is
    assert host_ns.link("rv6r0") is None or not host_ns.addrs("rv6r0")


def test_a_vantage_link_without_ipv6_keeps_its_ipv4_paths_and_says_why_v6_is_skipped(
        host_ns: Netns, tmp_path: object) -> None:
    """IPv6 disabled on new links of the host (``default.disable_ipv6=1``, after the apply):
    the vantage link cannot have its pair. The IPv4 external paths still hold, the IPv6
    ones are skipped with the reason, none fails."""
    path, (a0, _a1) = setup(host_ns, tmp_path)
    _ns, link = _vantage(host_ns)
    host_ns.run("sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
    try:
        results = run_probes(host_ns, path, external=True, allocs={a0})
    finally:
        host_ns.run("sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=0")
    assert failures(results) == []
    v4, v6 = by_path(results, 4), by_path(results, 6)
    assert v4[("external", "tcp", 18080)].ok and not v4[("external", "tcp", 18080)].skipped
    why = f"IPv6 is disabled on the external vantage link (net.ipv6.conf.{link}.disable_ipv6=1)"
    for key in (("external", "tcp", 18080), ("external", "udp", 15353),
                ("direct", "tcp", 80), ("direct", "udp", 53)):
        assert v6[key].skipped and v6[key].cause == why, v6[key]
    assert not v6[("host", "tcp", 18080)].skipped and v6[("host", "tcp", 18080)].ok


def test_a_foreign_ip6tables_raw_drop_is_named_on_the_ipv6_external_path(
        host_ns: Netns, tmp_path: object) -> None:
    """raw/PREROUTING, before conntrack and the DNAT: the IPv6 external TCP probe fails
    naming the rule; the IPv4 one and the UDP one hold, direct (held back anyway) holds."""
    path, (a0, _a1) = setup(host_ns, tmp_path)
    rule = ("PREROUTING", "-s", V6_PEER, "-p", "tcp", "-j", "DROP")
    host_ns.run("ip6tables", "-t", "raw", "-I", *rule)
    try:
        assert f"-A PREROUTING -s {V6_PEER}/128 -p tcp -j DROP" in \
            host_ns.run("ip6tables-save", "-t", "raw").stdout
        results = run_probes(host_ns, path, external=True, allocs={a0})
    finally:
        host_ns.run("ip6tables", "-t", "raw", "-D", *rule)
    failed = {(r.path, r.proto, r.family): r.cause for r in results if not r.ok and not r.skipped}
    assert set(failed) == {("external", "tcp", 6)}, failed
    assert failed[("external", "tcp", 6)] == (
        f"a foreign rule drops it: ip6tables raw/PREROUTING: -A PREROUTING -s {V6_PEER}/128 "
        "-p tcp -j DROP")


def test_a_vantage_left_without_its_ipv6_pair_is_made_again(host_ns: Netns,
                                                            tmp_path: object) -> None:
    """A vantage made by a version before the IPv6 pair (or whose pair someone removed),
    left behind by a killed agent: the next prober that has it alone makes it again, so
    the IPv6 external paths are probed, not skipped for the life of the prober."""
    from reconciler.drivers.probe import vantage as probe_vantage

    path, (a0, _a1) = setup(host_ns, tmp_path)
    ns, link = _vantage(host_ns)
    with netns.enter(host_ns.name):
        probe_vantage.create_vantage(ns, link)
    sh("ip", "-n", host_ns.name, "addr", "del", f"{V6_HOST}/126", "dev", link)
    sh("ip", "-n", ns, "addr", "del", f"{V6_PEER}/126", "dev", "eth0")
    assert _v6_addresses(host_ns.name, link) == []
    with recording(a0, "tcp:80", "udp:53") as seen:
        results = run_probes(host_ns, path, external=True, allocs={a0})
    assert failures(results) == [], (results, seen)
    v6 = by_path(results)
    for key in (("external", "tcp", 18080), ("external", "udp", 15353)):
        assert v6[key].ok and not v6[key].skipped, v6[key]
    assert host_ns.link(link) is None  # gone with the prober, as any vantage
