"""Probes, the pure parts: which probes, what each expects, what a plan touched, the cause
named from gathered facts, and the wire formats the driver builds (BPF, ICMP, ctnetlink).

Live state comes from ``FakeHost`` after a converged apply, so targets are read from the
same DNAT rules and eth0 addresses the real host would show.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import socket
import struct

import pytest

from reconciler.config.load import load_sources
from reconciler.domain.errors import ConfigError
from reconciler.domain.model import (
    Alloc,
    AllocId,
    Bridge,
    BridgeName,
    DesiredState,
    PortMap,
    Subnet,
    SubnetName,
)
from reconciler.domain.ownership import (
    PROBE_VANTAGE_ALIAS,
    probe_vantage_names,
    reserved_link_name,
)
from reconciler.domain.plan import Action, Change, Op, Plan
from reconciler.domain.probes import (
    PATHS,
    PROBE_PORTS,
    VANTAGE6_HOST,
    VANTAGE6_PEER,
    VANTAGE_HOST,
    VANTAGE_NET6,
    ProbeResult,
    ProbeSpec,
    sort_key,
)
from reconciler.drivers.netlink import conntrack
from reconciler.drivers.netlink.wire import parse_attrs
from reconciler.drivers.probe import capture as probe_capture
from reconciler.drivers.probe import diagnosis as probe_diagnosis
from reconciler.drivers.probe import echo as probe_echo
from reconciler.drivers.probe import runner as probe_runner
from reconciler.engine import probes as probes_engine
from reconciler.engine.reconcile import conflicts_line
from reconciler.planner import addrspace
from reconciler.planner.probes import (
    Facts,
    RuleHit,
    Sighting,
    Vantage,
    classify,
    foreign_hits,
    parse_counters,
    probe_specs,
    probe_targets,
)

from .fakehost import FakeHost
from .test_allocs_planner import converge

HOST_IP = "192.0.2.10"


def desired(*allocs: Alloc, isolation: str = "ports", cidr6: str | None = "fd00::/64",
            hairpin: bool = True) -> DesiredState:
    net6 = ipaddress.IPv6Network(cidr6) if cidr6 else None
    s = Subnet(SubnetName("net"), BridgeName("br0"), ipaddress.IPv4Network("10.0.0.0/24"),
               None, net6, None, isolation=isolation)  # type: ignore[arg-type]
    b = Bridge(BridgeName("br0"), 1400, hairpin)
    return DesiredState(bridges={b.name: b}, subnets={s.name: s},
                        allocs={a.id: a for a in allocs})


def alloc(aid: str, *ports: PortMap) -> Alloc:
    return Alloc(AllocId(aid), SubnetName("net"), ports=ports)


def pm(host: int | None, to: int, protocol: str = "tcp", host_ip: str | None = None,
       probe: bool = True) -> PortMap:
    return PortMap(host, to, protocol, ipaddress.ip_address(host_ip) if host_ip else None,  # type: ignore[arg-type]
                   probe)


def applied(d: DesiredState, *, host_address: bool = True) -> FakeHost:
    host = FakeHost()
    if host_address:
        host.add_link("eth0", "", addresses=(f"{HOST_IP}/24", "2001:db8::10/64"))
    converge(host, d)
    return host


def paths(specs: list[ProbeSpec]) -> list[tuple[str, str, int, str, bool, str | None]]:
    return [(s.path, s.proto, s.family, s.dst, s.expect, s.skipped) for s in specs]


# ------------------------------------------------------------------ which probes


def test_every_path_of_a_map_with_a_host_address():
    d = desired(alloc("a", pm(8080, 80)))
    specs = probe_specs(d, applied(d).observe(d))
    assert paths(specs) == [
        ("gateway", "icmp", 4, "10.0.0.1", True, None),
        ("gateway", "icmp", 6, "fd00::1", True, None),
        ("host", "tcp", 4, HOST_IP, True, None),
        ("localhost", "tcp", 4, "127.0.0.1", True, None),
        ("hairpin", "tcp", 4, HOST_IP, True, None),
        ("host", "tcp", 6, "2001:db8::10", True, None),  # no IPv6 localhost: no loopback DNAT
        ("hairpin", "tcp", 6, "2001:db8::10", True, None),
    ]
    host = next(s for s in specs if s.path == "host" and s.family == 4)
    assert (host.port, host.dport, host.to) == (8080, 8080, 80)
    gw = specs[0]
    assert gw.src == "10.0.0.2" and gw.size == 1400  # eth0's MTU: the full-size echo


def test_a_bare_sandbox_skips_the_host_path_and_hairpins_to_the_gateway():
    d = desired(alloc("a", pm(8080, 80)), cidr6=None)
    specs = probe_specs(d, applied(d, host_address=False).observe(d))
    assert paths(specs)[1:] == [
        ("host", "tcp", 4, "", True, "no host address"),
        ("localhost", "tcp", 4, "127.0.0.1", True, None),
        ("hairpin", "tcp", 4, "10.0.0.1", True, None),
    ]


def test_a_loopback_only_map_is_probed_on_127_0_0_1_only():
    d = desired(alloc("a", pm(8443, 443, host_ip="127.0.0.1")), cidr6=None)
    specs = probe_specs(d, applied(d).observe(d))
    assert paths(specs)[1:] == [
        ("host", "tcp", 4, "", True, "published on 127.0.0.1 only"),
        ("localhost", "tcp", 4, "127.0.0.1", True, None),
        ("hairpin", "tcp", 4, "", True, "published on 127.0.0.1 only"),
    ]


def test_a_map_on_one_host_address_goes_there_and_not_to_127_0_0_1():
    d = desired(alloc("a", pm(8080, 80, host_ip=HOST_IP)), cidr6=None)
    specs = probe_specs(d, applied(d).observe(d))
    assert [(s.path, s.dst) for s in specs[1:]] == [("host", HOST_IP), ("hairpin", HOST_IP)]


def test_probe_false_leaves_the_map_out_and_the_gateway_in():
    d = desired(alloc("a", pm(8080, 80, probe=False), pm(9090, 90, "both")), cidr6=None)
    specs = probe_specs(d, applied(d).observe(d))
    assert {s.port for s in specs} == {None, 9090}
    assert {(s.path, s.proto) for s in specs if s.port == 9090} >= {("host", "udp"),
                                                                     ("host", "tcp")}


def test_targets_come_from_the_live_rules_not_the_files():
    d = desired(alloc("a", pm(None, 80)), cidr6=None)  # host: auto
    live = applied(d).observe(d)
    (host,) = [s for s in probe_specs(d, live) if s.path == "host"]
    assert host.dport == 20000  # the auto port the DNAT rule carries
    bare = dataclasses.replace(live, firewall4=dataclasses.replace(live.firewall4, chains={}))
    assert [s.path for s in probe_specs(d, bare)] == ["gateway"]  # no rule: nothing to map


def test_external_paths_follow_the_isolation():
    for isolation, reached in (("ports", False), ("open", True)):
        d = desired(alloc("a", pm(8080, 80)), cidr6=None, isolation=isolation)
        specs = probe_specs(d, applied(d).observe(d), vantage=Vantage("v", VANTAGE_HOST))
        ext = [(s.path, s.vantage, s.dst, s.dport, s.expect) for s in specs
               if s.vantage == "external"]
        assert ext == [("external", "external", VANTAGE_HOST, 8080, True),
                       ("direct", "external", "10.0.0.2", 80, reached)]


def test_ipv6_maps_are_probed_from_outside_with_the_ipv4_semantics():
    """external and direct for an IPv6 map too, from the vantage's /126: through the map
    to the host's end of the link, and straight to eth0's IPv6 address (reached only with
    isolation: open); the IPv4 ones are unchanged."""
    for isolation, reached in (("ports", False), ("open", True)):
        d = desired(alloc("a", pm(8080, 80), pm(5353, 53, "udp")), isolation=isolation)
        live = applied(d).observe(d)
        specs = probe_specs(d, live, vantage=Vantage("v", VANTAGE_HOST, VANTAGE6_HOST))
        ext = [(s.path, s.proto, s.family, s.dst, s.dport, s.to, s.expect, s.skipped)
               for s in specs if s.vantage == "external"]
        assert ext == [
            ("external", "tcp", 4, VANTAGE_HOST, 8080, 80, True, None),
            ("direct", "tcp", 4, "10.0.0.2", 80, 80, reached, None),
            ("external", "udp", 4, VANTAGE_HOST, 5353, 53, True, None),
            ("direct", "udp", 4, "10.0.0.2", 53, 53, reached, None),
            ("external", "tcp", 6, VANTAGE6_HOST, 8080, 80, True, None),
            ("direct", "tcp", 6, "fd00::2", 80, 80, reached, None),
            ("external", "udp", 6, VANTAGE6_HOST, 5353, 53, True, None),
            ("direct", "udp", 6, "fd00::2", 53, 53, reached, None),
        ]


def test_an_ipv6_map_on_one_host_address_is_probed_from_outside_on_it():
    d = desired(alloc("a", pm(8080, 80, host_ip="2001:db8::10")))
    specs = probe_specs(d, applied(d).observe(d), vantage=Vantage("v", VANTAGE_HOST,
                                                                  VANTAGE6_HOST))
    assert [(s.path, s.family, s.dst) for s in specs if s.vantage == "external"] == [
        ("external", 6, "2001:db8::10"), ("direct", 6, "fd00::2")]


def test_without_an_ipv6_pair_the_ipv6_external_paths_say_why_they_are_skipped():
    d = desired(alloc("a", pm(8080, 80)))
    why = "IPv6 is disabled on the external vantage link (net.ipv6.conf.x.disable_ipv6=1)"
    specs = probe_specs(d, applied(d).observe(d), vantage=Vantage("v", VANTAGE_HOST, None,
                                                                  no6=why))
    ext = [(s.path, s.family, s.skipped) for s in specs if s.vantage == "external"]
    assert ext == [("external", 4, None), ("direct", 4, None),
                   ("external", 6, why), ("direct", 6, why)]


def test_an_ipv6_external_probe_is_classified_as_the_ipv4_one():
    d = desired(alloc("a", pm(8080, 80)))
    specs = probe_specs(d, applied(d).observe(d), vantage=Vantage("v", VANTAGE_HOST,
                                                                  VANTAGE6_HOST))
    ext6 = next(s for s in specs if s.path == "external" and s.family == 6)
    never = Sighting(reached=False, answer="timeout")
    off = Facts(sysctls={"net/ipv6/conf/all/forwarding": "0", "net/ipv4/ip_forward": "1"})
    assert classify(ext6, never, off).line == \
        "forwarding is off (net.ipv6.conf.all.forwarding=0)"
    hit = RuleHit(6, "filter", "FORWARD", f"-A FORWARD -s {VANTAGE6_PEER}/128 -j DROP")
    assert classify(ext6, never, Facts(hits=(hit,))).line == (
        f"a foreign rule drops it: ip6tables filter/FORWARD: -A FORWARD -s {VANTAGE6_PEER}/128"
        " -j DROP")
    assert classify(ext6, never, Facts(route=(None, "unreachable"))).line == \
        "no route to the allocation's address (unreachable)"
    # an IPv4 rule's hit does not name an IPv6 probe's cause
    v4 = RuleHit(4, "filter", "FORWARD", "-A FORWARD -j DROP")
    assert "never arrived" in classify(ext6, never, Facts(hits=(v4,))).line


def test_an_ipv6_probe_is_never_named_rp_filter() -> None:
    """``IPReversePathFilter`` is IPv4's (a host-wide counter): an IPv4 drop seen during an
    IPv6 probe's re-run must not name it (IPv6 has no rp_filter)."""
    d = desired(alloc("a", pm(8080, 80)))
    specs = probe_specs(d, applied(d).observe(d), vantage=Vantage("v", VANTAGE_HOST,
                                                                  VANTAGE6_HOST))
    ext6 = next(s for s in specs if s.path == "external" and s.family == 6)
    ext4 = next(s for s in specs if s.path == "external" and s.family == 4)
    never = Sighting(reached=False, answer="timeout")
    assert "reverse-path" not in classify(ext6, never, Facts(rp_filter_drops=2)).line
    assert "reverse-path" in classify(ext4, never, Facts(rp_filter_drops=2)).line


def test_another_probers_vantage_pair_is_no_host_address() -> None:
    """The IPv6 /126 of a vantage someone else holds is not the host's address (the /30
    is link-local, left out anyway): host and hairpin probes must not go through it."""
    d = desired(alloc("a", pm(8080, 80)))
    host = applied(d, host_address=False)
    host.add_link("rcprobe1", "", addresses=(f"{VANTAGE_HOST}/30", f"{VANTAGE6_HOST}/126"))
    specs = probe_specs(d, host.observe(d))
    via = {(s.path, s.family): (s.dst, s.skipped) for s in specs if s.path in ("host", "hairpin")}
    assert via[("host", 6)][1] == "no host address", via
    assert all(VANTAGE6_HOST not in dst for dst, _ in via.values()), via


def test_only_the_allocs_asked_for():
    d = desired(alloc("a", pm(8080, 80)), alloc("b"), cidr6=None)
    live = applied(d).observe(d)
    assert {s.alloc for s in probe_specs(d, live, allocs={"b", "gone"})} == {"b"}


def test_reported_in_path_order():
    r = [ProbeResult("a", p, "tcp", 1, True) for p in reversed(PATHS)]
    assert [x.path for x in sorted(r, key=sort_key)] == list(PATHS)
    assert set(r[0].to_json()) == {"alloc", "path", "proto", "port", "ok", "skipped", "cause",
                                   "ms", "family"}


# ------------------------------------------------------------------ what changed


def change(kind: str, name: str, action: Action = Action.UPDATE) -> Change:
    return Change(kind, name, action, ops=(Op("x"),))


def test_targets_of_a_plan():
    d = desired(alloc("a", pm(8080, 80)), alloc("b"), cidr6=None)
    assert probe_targets(Plan((change("alloc", "b"),)), d) == {"b"}
    assert probe_targets(Plan((change("subnet", "net"),)), d) == {"a", "b"}
    assert probe_targets(Plan((change("bridge", "br0"),)), d) == {"a", "b"}
    assert probe_targets(Plan((change("firewall", "ipv4"),)), d) == {"a"}  # port maps
    assert probe_targets(Plan((change("sysctl", "net/ipv4/conf/br0/route_localnet"),)),
                         d) == {"a", "b"}
    assert probe_targets(Plan((change("sysctl", "net/ipv4/ip_forward"),)), d) == {"a", "b"}
    assert probe_targets(Plan((change("alloc", "gone", Action.DELETE),
                               Change("alloc", "a", Action.NOOP))), d) == set()


# ------------------------------------------------------------------ causes

SPEC = ProbeSpec("a", "hairpin", "tcp", 4, "alloc", HOST_IP, 8080, 8080, 80)
LOST = Sighting(False, "timeout")


def test_causes_named_from_facts():
    cases = [
        (Facts(sysctls={"net/ipv4/ip_forward": "0"}), "forwarding is off", True),
        (Facts(route=(None, "network is unreachable")), "no route", False),
        (Facts(alloc_default=False), "no IPv4 default route inside the allocation", True),
        (Facts(route=("tun0", "unicast"), bridge="br0"), "via tun0, not its bridge br0", False),
        (Facts(hits=(RuleHit(4, "raw", "PREROUTING", "-A PREROUTING -p tcp -j DROP"),)),
         "a foreign rule drops it: raw/PREROUTING: -A PREROUTING -p tcp -j DROP", False),
        (Facts(rp_filter_drops=3, sysctls={"net/ipv4/conf/br0/rp_filter": "1"}),
         "strict reverse-path filtering dropped it (rp_filter=1 on br0)", False),
        (Facts(rp_filter_drops=1, route_back=("169.254.250.2", "eth9")),
         "IPReversePathFilter rose by 1; the route back to 169.254.250.2 is via eth9", False),
        (Facts(port_hairpin=False), "hairpin is off on the allocation's bridge port", True),
        (Facts(port_hairpin=False, bridge_hairpin=False), "declares hairpin: false", False),
        (Facts(neighbour=("aa:aa:aa:aa:aa:aa", "STALE"), mac="02:00:00:00:00:01"),
         "stale neighbour entry", False),
    ]
    for facts, words, ours in cases:
        cause = classify(SPEC, LOST, facts)
        assert words in cause.line and cause.ours is ours, (facts, cause)


def test_br_netfilter_is_named_with_the_rule_it_exposes():
    hit = RuleHit(4, "filter", "FORWARD", "-A FORWARD -i br0 -o br0 -j DROP")
    cause = classify(SPEC, LOST, Facts(hits=(hit,), sysctls={
        "net/bridge/bridge-nf-call-iptables": "1"}))
    assert "filter/FORWARD: -A FORWARD -i br0 -o br0 -j DROP" in cause.line
    assert "bridge-nf-call-iptables=1" in cause.line


def test_the_hit_naming_the_probe_wins():
    other = RuleHit(4, "filter", "FORWARD", "-A FORWARD -p udp --dport 53 -j DROP")
    mine = RuleHit(4, "filter", "FORWARD", "-A FORWARD -p tcp --dport 80 -j REJECT")
    assert "--dport 80" in classify(SPEC, LOST, Facts(hits=(other, mine))).line
    v6 = RuleHit(6, "filter", "FORWARD", "-A FORWARD -j DROP")
    assert "foreign" not in classify(SPEC, LOST, Facts(hits=(v6,))).line


def test_a_tcp_probe_that_arrives_must_be_answered():
    assert Sighting(True, "refused").holds(SPEC) and Sighting(True, "connected").holds(SPEC)
    lost_reply = Sighting(True, "timeout")
    assert not lost_reply.holds(SPEC)  # the SYN arrived, nothing came back: a timeout
    assert "arrived in the allocation but nothing came back" in classify(SPEC, lost_reply).line
    udp = dataclasses.replace(SPEC, proto="udp")
    assert Sighting(True, "no answer").holds(udp)  # a datagram needs no answer


def test_physdev_rules_name_br_netfilter_on_any_path():
    hit = RuleHit(4, "filter", "FORWARD", "-A FORWARD -m physdev --physdev-is-in -j DROP")
    ext = dataclasses.replace(SPEC, path="external", vantage="external")
    line = classify(ext, Sighting(True, "timeout"), Facts(hits=(hit,), sysctls={
        "net/bridge/bridge-nf-call-iptables": "1"})).line
    assert "bridge-nf-call-iptables=1" in line and "physdev" in line


def test_causes_without_facts():
    told = classify(SPEC, Sighting(False, "refused")).line
    assert "never arrived in the allocation" in told and "REJECT" in told
    gw = ProbeSpec("a", "gateway", "icmp", 4, "alloc", "10.0.0.1", size=1400)
    assert classify(gw, Sighting(False, "timeout")).line.startswith("no echo reply")
    mtu = classify(gw, Sighting(True, "echo reply", big=False)).line
    assert mtu.startswith("MTU black hole: a 1400-byte echo with DF")
    direct = ProbeSpec("a", "direct", "tcp", 4, "external", "10.0.0.2", 8080, 80, 80,
                       expect=False)
    assert "isolation is ports" in classify(direct, Sighting(True, "connected")).line
    assert not Sighting(True, "connected").holds(direct)
    assert Sighting(False, "timeout").holds(direct)
    assert classify(SPEC, Sighting(False, error="cannot probe")).line == "cannot probe"


SAVE_BEFORE = """*raw
:PREROUTING ACCEPT [10:600]
[0:0] -A PREROUTING -d 10.0.0.2/32 -j DROP
COMMIT
*filter
:INPUT ACCEPT [5:300]
:FORWARD DROP [2:120]
:RECONCILER-FORWARD - [0:0]
[7:420] -A FORWARD -m comment --comment reconciler -j RECONCILER-FORWARD
[1:60] -A FORWARD -p tcp -m tcp --dport 80 -j REJECT --reject-with tcp-reset
[4:240] -A RECONCILER-FORWARD -d 10.0.0.0/24 -o br0 -j DROP
COMMIT
"""


def test_foreign_hits_from_counters():
    after = (SAVE_BEFORE.replace("[0:0] -A PREROUTING", "[1:60] -A PREROUTING")
             .replace(":FORWARD DROP [2:120]", ":FORWARD DROP [3:180]")
             .replace("[4:240] -A RECONCILER", "[9:540] -A RECONCILER")
             .replace("[7:420]", "[9:540]"))
    hits = foreign_hits(4, SAVE_BEFORE, after)
    assert [str(h) for h in hits] == ["raw/PREROUTING: -A PREROUTING -d 10.0.0.2/32 -j DROP",
                                      "filter/FORWARD: policy DROP"]
    assert foreign_hits(4, SAVE_BEFORE, SAVE_BEFORE) == []
    counted = parse_counters(SAVE_BEFORE)
    assert counted[("filter", "FORWARD",
                    "-A FORWARD -p tcp -m tcp --dport 80 -j REJECT --reject-with tcp-reset",
                    0)] == (1, "REJECT")


# ------------------------------------------------------------------ the loader, the space


def load_text(text: str) -> DesiredState:
    return load_sources([("probe.yaml", "probe.yaml", text.encode())])


BASE = """version: 1
bridges: [{name: br0}]
subnets: [{name: net, bridge: br0, cidr: %s}]
allocs:
  - {id: a, subnet: net, ports: [%s]}
"""


def test_probe_false_is_read_and_true_by_default():
    d = load_text(BASE % ("10.0.0.0/24", "{host: 80, to: 80, probe: false}, {host: 81, to: 81}"))
    assert [p.probe for p in d.allocs[AllocId("a")].ports] == [False, True]
    with pytest.raises(ConfigError, match="probe"):
        load_text(BASE % ("10.0.0.0/24", "{host: 80, to: 80, probe: maybe}"))


def test_the_vantage_link_is_reserved_and_so_is_its_prefix():
    _ns, link = probe_vantage_names("4026531840")
    assert reserved_link_name(link) is not None and len(link) <= 15
    d = load_text(BASE % ("169.254.250.0/29", "{host: 80, to: 80}"))
    found = addrspace.check(d, FakeHost().observe(d))
    assert "reserved for the probes' external vantage link" in found.conflicts["subnet/net"]


def test_a_prefix_on_the_reservation_is_said_so_while_a_vantage_is_up():
    """With a prober's vantage link up (the agent's), a prefix on the /126 overlaps the
    reservation: not "an address on rcprobe…", an object the reconciler does not own."""
    d = load_text(BASE6 % ("fd18:d6bc:22af::/64", "fd00:9::/64"))
    host = FakeHost()
    host.add_link("rcprobe1", "", addresses=(f"{VANTAGE_HOST}/30", f"{VANTAGE6_HOST}/126"))
    lk = host.links["rcprobe1"]
    host.links["rcprobe1"] = dataclasses.replace(lk, alias=PROBE_VANTAGE_ALIAS)
    found = addrspace.check(d, host.observe(d))
    assert found.conflicts == {"subnet/net": "cidr6 fd18:d6bc:22af::/64 overlaps "
                               "fd18:d6bc:22af::/126, reserved for the probes' external "
                               "vantage link"}, found.conflicts
    assert conflicts_line(list(found.conflicts.values())) == \
        "1 conflict(s) with the prefix reserved for the probes' vantage"


BASE6 = """version: 1
bridges: [{name: br0}]
subnets: [{name: net, bridge: br0, cidr: 10.0.0.0/24, cidr6: %s}]
docker_networks: [{name: dn, subnet: 10.9.0.0/24, subnet6: %s}]
"""


def test_the_vantage_ipv6_pair_is_a_stable_ula_126_and_reserved_like_the_30():
    gid = hashlib.sha1(b"reconciler probe vantage").digest()[:5]
    derived = ipaddress.IPv6Network((b"\xfd" + gid + bytes(10), 126))
    assert derived == VANTAGE_NET6
    assert VANTAGE_NET6.is_private and not VANTAGE_NET6.is_link_local
    assert (VANTAGE6_HOST, VANTAGE6_PEER) == ("fd18:d6bc:22af::1", "fd18:d6bc:22af::2")
    want = "fd18:d6bc:22af::/126, reserved for the probes' external vantage link"
    d = load_text(BASE6 % ("fd18:d6bc:22af::/64", "fd00:9::/64"))
    found = addrspace.check(d, FakeHost().observe(d))
    assert found.conflicts == {"subnet/net": f"cidr6 fd18:d6bc:22af::/64 overlaps {want}"}
    d = load_text(BASE6 % ("fd00:8::/64", "fd18:d6bc:22af::/120"))
    found2 = addrspace.check(d, FakeHost().observe(d))
    assert found2.conflicts == {
        "docker_network/dn": f"subnet6 fd18:d6bc:22af::/120 overlaps {want}"}
    reasons = [*found.conflicts.values(), *found2.conflicts.values()]
    assert conflicts_line(reasons) == \
        "2 conflict(s) with the prefix reserved for the probes' vantage"
    assert conflicts_line([*reasons, "cidr 10.0.0.0/24 overlaps address 10.0.0.9/24 on eth1"]) \
        == "3 conflict(s) with objects the reconciler does not own"
    # an auto pick steps over it, as over the /30
    d = load_text("version: 1\nbridges: [{name: br0}]\nsubnets: [{name: net, bridge: br0, "
                  "cidr: 10.0.0.0/24, cidr6: auto, pool6: 'fd18:d6bc:22af::/64', size6: 120}]\n")
    picked = addrspace.resolve(d, FakeHost().observe(d)).desired.subnets[SubnetName("net")]
    assert str(picked.cidr6) == "fd18:d6bc:22af::100/120"
    # next to it is free
    d = load_text(BASE6 % ("fd18:d6bc:22af:1::/64", "fd18:d6bc:22af::100/120"))
    assert addrspace.check(d, FakeHost().observe(d)).conflicts == {}


# ------------------------------------------------------------------ wire formats


def run_bpf(prog: bytes, packet: bytes, pkttype: int) -> int:
    """A small classic-BPF interpreter for the opcodes capture_filter uses."""
    insns = [struct.unpack("HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    a = x = pc = 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # ld [k]: only the pkttype ancillary word
            assert k == (-0x1000 + 4) & 0xFFFFFFFF
            a = pkttype
        elif code == 0x30:
            a = packet[k]
        elif code == 0x28:
            a = struct.unpack_from("!H", packet, k)[0]
        elif code == 0x48:
            a = struct.unpack_from("!H", packet, x + k)[0]
        elif code == 0xB1:
            x = 4 * (packet[k] & 0xF)
        elif code == 0x74:
            a >>= k
        elif code == 0x05:
            pc += k
        elif code in (0x15, 0x35, 0x25, 0x45):
            ok = {0x15: a == k, 0x35: a >= k, 0x25: a > k, 0x45: bool(a & k)}[code]
            pc += jt if ok else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(hex(code))


def ipv4(proto: int, sport: int, dport: int, frag: int = 0, ihl: int = 5) -> bytes:
    head = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, 40, 0, frag, 64, proto, 0,
                       bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2]))
    return head + b"\0" * (4 * (ihl - 5)) + struct.pack("!HH", sport, dport) + b"\0" * 16


def ipv6(nxt: int, sport: int, dport: int) -> bytes:
    return (struct.pack("!IHBB", 0x60000000, 20, nxt, 64) + b"\0" * 32
            + struct.pack("!HH", sport, dport) + b"\0" * 16)


def test_capture_filter_passes_only_probe_packets_leaving_a_link():
    prog, lo, hi = probe_capture.capture_filter(), *PROBE_PORTS
    out = probe_capture.PACKET_OUTGOING
    assert run_bpf(prog, ipv4(6, lo, 80), out) and run_bpf(prog, ipv4(17, hi, 53), out)
    assert run_bpf(prog, ipv4(6, lo, 80, ihl=6), out)  # options: the port is further on
    assert run_bpf(prog, ipv6(6, 61500, 80), out) and run_bpf(prog, ipv6(17, lo, 80), out)
    for packet in (ipv4(6, lo - 1, 80), ipv4(6, hi + 1, 80), ipv4(1, lo, 80),
                   ipv4(6, lo, 80, frag=5), ipv6(58, lo, 80), ipv6(6, 60999, 80)):
        assert run_bpf(prog, packet, out) == 0
    assert run_bpf(prog, ipv4(6, lo, 80), 0) == 0  # arriving (PACKET_HOST): not ours to see


def test_a_source_port_is_used_again_only_towards_another_destination(monkeypatch):
    # a run larger than the range reuses ports; two probes of one map (veth, family,
    # protocol, container port) on one port would be one arrival and one NAT reply tuple
    monkeypatch.setattr(probe_runner, "PROBE_PORTS", (61000, 61002))
    ports = probe_runner._Ports()
    http, https = ("vr0", 4, 6, 80), ("vr0", 4, 6, 443)
    assert sorted(ports.take(http) for _ in range(3)) == [61000, 61001, 61002]
    with pytest.raises(OSError, match="no free probe source port"):
        ports.take(http)
    assert sorted(ports.take(https) for _ in range(3)) == [61000, 61001, 61002]


def test_packet_parsing():
    assert probe_capture.parse_l4(ipv4(6, 61000, 80)) == (4, "10.0.0.1", 61000, "10.0.0.2", 80, 6)
    assert probe_capture.parse_l4(ipv6(17, 61001, 53))[1:] == ("::", 61001, "::", 53, 17)
    assert probe_capture.parse_l4(b"\x45\0") is None


def test_echo_request_and_reply():
    req = probe_echo.echo_request(4, 0x1234, 7, probe_echo.echo_payload(4, 1400))
    assert len(req) + 20 == 1400
    total = sum(struct.unpack(f"!{len(req) // 2}H", req))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    assert total == 0xFFFF  # the checksum is right
    reply = bytes([0x45]) + b"\0" * 19 + bytes([0, 0, 0, 0]) + struct.pack("!HH", 0x1234, 7)
    assert probe_echo.parse_echo_reply(4, reply) == (0x1234, 7)
    assert probe_echo.parse_echo_reply(4, reply[:20] + bytes([8]) + reply[21:]) is None
    assert probe_echo.parse_echo_reply(6, bytes([129, 0, 0, 0]) + struct.pack("!HH", 1, 2)) == (1, 2)


def test_a_probe_flow_becomes_the_exact_delete_of_its_conntrack_entry():
    """The probe driver reports its flows; the conntrack driver deletes them by tuple."""
    tcp = conntrack.delete_orig_request(
        probes_engine.flow_tuple(probe_runner.Flow(6, "10.0.0.1", "10.0.0.2", 61000, 80)))
    assert tcp[0] == socket.AF_INET
    orig = parse_attrs(parse_attrs(tcp, 4)[1])
    ip, l4 = parse_attrs(orig[1]), parse_attrs(orig[2])
    assert (ip[1], ip[2]) == (ipaddress.ip_address("10.0.0.1").packed,
                              ipaddress.ip_address("10.0.0.2").packed)
    assert (l4[1], l4[2], l4[3]) == (b"\x06", struct.pack("!H", 61000), struct.pack("!H", 80))
    echo6 = conntrack.delete_orig_request(
        probes_engine.flow_tuple(probe_runner.Flow(58, "fd00::2", "fd00::1", 9, 128)))
    assert echo6[0] == socket.AF_INET6
    l4 = parse_attrs(parse_attrs(parse_attrs(echo6, 4)[1])[2])
    # CTA_PROTO_ICMPV6_ID, _TYPE, _CODE; no ports
    assert (l4[1], l4[7], l4[8], l4[9]) == (b"\x3a", struct.pack("!H", 9), b"\x80", b"\0")
    assert 2 not in l4 and 3 not in l4


def test_netstat_counter():
    text = ("TcpExt: SyncookiesSent IPReversePathFilter\nTcpExt: 0 12\n"
            "IpExt: InNoRoutes\nIpExt: 3\n")
    assert probe_diagnosis.netstat_counter("IPReversePathFilter", text) == 12
    assert probe_diagnosis.netstat_counter("InNoRoutes", text) == 3
    assert probe_diagnosis.netstat_counter("Missing", text) == 0
