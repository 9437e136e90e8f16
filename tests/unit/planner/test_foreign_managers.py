"""Other firewall managers beside our table (issue 26), as pure logic.

* iptables-legacy rules beside our nf_tables backend are followed along each declared path:
  one that blocks a path whole is a plan error, one that names part of one a warning.
* The probes' diagnosis names our chain for a direct reach, and a legacy rule.

``FakeHost`` runs the planner's restore scripts the way iptables-restore would.
"""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest

from reconciler.domain.live import LiveChainSet
from reconciler.domain.model import DesiredState
from reconciler.domain.probes import ProbeSpec
from reconciler.drivers import iptables
from reconciler.drivers.iptables import parse_save
from reconciler.planner import PlanOptions, firewall, fwpaths, legacy, make_plan
from reconciler.planner.fwpaths import Flow, Match
from reconciler.planner.probes import (
    Facts,
    RuleHit,
    Sighting,
    classify,
    foreign_hits,
)
from tests.support.fakehost import FakeHost
from tests.support.planning import alloc, converge, port, state, subnet

#: the real one (the unit tests' autouse fixture puts a tripwire in its place)
OBSERVE_LEGACY = iptables.IptablesDriver.observe_legacy
JUMP = "-m comment --comment reconciler -j RECONCILER-FORWARD"
NET = ipaddress.ip_network("10.0.0.0/24")
INTO = Flow("into", dst=NET, oif="br0", states=fwpaths.UNADMITTED)


def desired(*, v6: bool = False, isolation: str = "ports") -> DesiredState:
    s = dataclasses.replace(subnet(cidr6="fd00:1::/64" if v6 else None),
                            isolation=isolation)  # type: ignore[arg-type]
    return state(alloc("a1", port(8080, 80), port(8443, 443, host_ip="127.0.0.1")), sub=s)


def fresh() -> FakeHost:
    """A host whose lo has 127.0.0.1 (a 127.0.0.1 map takes effect there)."""
    host = FakeHost()
    host.add_link("lo", "", addresses=("127.0.0.1/8",))
    return host


def plan(host: FakeHost, d: DesiredState, **live: object):  # type: ignore[no-untyped-def]
    return make_plan(d, dataclasses.replace(host.observe(d), **live), PlanOptions())


def fw(host: FakeHost, family: int = 4) -> dict[tuple[str, str], list[str]]:
    return host.fw[family].chains


# ------------------------------------------------------------------ matching


@pytest.mark.parametrize(("rule", "want", "names"), [
    ("-j ACCEPT", Match.ALL, False),
    ("-i docker0 ! -o docker0 -j ACCEPT", Match.SOME, False),
    ("-o docker0 -j DOCKER", Match.NONE, False),
    ("-o br+ -j ACCEPT", Match.ALL, True),
    ("-o eth+ -j ACCEPT", Match.NONE, False),
    ("-d 10.0.0.0/16 -j ACCEPT", Match.ALL, True),
    ("-d 10.0.0.128/25 -j ACCEPT", Match.SOME, True),
    ("-d 10.1.0.0/24 -j ACCEPT", Match.NONE, False),
    ("! -d 10.1.0.0/24 -j ACCEPT", Match.ALL, False),
    ("-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT", Match.NONE, False),
    ("-m conntrack --ctstate NEW -j ACCEPT", Match.SOME, False),
    ("-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j ACCEPT", Match.ALL, False),
    ("-p tcp -m tcp --dport 22 -j ACCEPT", Match.SOME, False),
    ("-m comment --comment \"a b\" -j ACCEPT", Match.ALL, False),
    ("-m mark --mark 0x1/0x1 -j ACCEPT", Match.SOME, False),
    ("-p icmp -m icmp --icmp-type 8 -j ACCEPT", Match.SOME, False),
])
def test_a_rule_matches_none_some_or_all_of_a_flow(rule: str, want: Match, names: bool) -> None:
    v = fwpaths.match(rule, INTO)
    assert (v.match, v.names_it) == (want, names)


def test_ports_states_and_protocols_compare_as_sets() -> None:
    f = Flow("map", protos=frozenset({"tcp"}), dports=((8080, 8080),))
    assert fwpaths.match("-p tcp -m tcp --dport 8080 -j DNAT", f).match is Match.ALL
    assert fwpaths.match("-p tcp -m tcp --dport 8000:8100 -j DNAT", f).match is Match.ALL
    assert fwpaths.match("-p tcp -m multiport --dports 80,8080 -j DNAT", f).match is Match.ALL
    assert fwpaths.match("-p udp -m udp --dport 8080 -j DNAT", f).match is Match.NONE
    assert fwpaths.match("-p 6 -m tcp --dport 9 -j DNAT", f).match is Match.NONE
    assert fwpaths.match("-p tcp -m tcp ! --dport 8080 -j DNAT", f).match is Match.NONE
    wide = Flow("replies", dports=fwpaths.EPHEMERAL)
    assert fwpaths.match("-p tcp --dport 22 -j DROP", wide).match is Match.NONE
    assert fwpaths.match("--dport 2000:3000 -j DROP", wide).match is Match.SOME


# ------------------------------------------------------------------ (b) iptables-legacy

LEGACY_EMPTY = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
COMMIT
"""


def _legacy(filter_rules: str = "", nat: str = "", forward: str = "ACCEPT",
            input_: str = "ACCEPT") -> LiveChainSet:
    text = LEGACY_EMPTY.replace(":FORWARD ACCEPT", f":FORWARD {forward}").replace(
        ":INPUT ACCEPT", f":INPUT {input_}").replace("COMMIT", filter_rules + "COMMIT", 1)
    if nat:
        text += ("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
                 f":POSTROUTING ACCEPT [0:0]\n{nat}COMMIT\n")
    return parse_save(text)


def _legacy_plan(host: FakeHost, d: DesiredState, chains: LiveChainSet,
                 family: int = 4):  # type: ignore[no-untyped-def]
    return plan(host, d, **{f"legacy{family}": chains})


@pytest.mark.parametrize(("chains", "chain"), [
    (_legacy(forward="DROP"), "FORWARD"),
    (_legacy("-A FORWARD -d 10.0.0.0/24 -j DROP\n"), "FORWARD"),
    (_legacy("-A FORWARD -o br0 -p tcp -j REJECT\n"), "FORWARD"),
    (_legacy("-A FORWARD -s 10.0.0.0/24 -p tcp -m tcp --dport 25 -j REJECT\n"), "FORWARD"),
    # the replies to the host's own port-map connections: our table's guard marks them
    (_legacy(input_="DROP"), "INPUT"),
])
def test_a_legacy_forward_drop_is_passed_by_the_shim_not_named(chains: LiveChainSet,
                                                               chain: str) -> None:
    """The shim goes first in the legacy FORWARD or INPUT (planner.shim): declared traffic
    carries our mark past every DROP there, so none is an error or a warning any more
    (decision 048)."""
    host, d = fresh(), desired()
    converge(host, d)
    p = _legacy_plan(host, d, chains)
    assert (p.errors, p.warnings) == ((), ())
    [c] = p.actionable
    assert (c.kind, c.name, c.action.value) == ("shim", f"iptables-legacy filter/{chain}",
                                                "create")
    assert [(o.name, o.args["legacy"], o.args["position"]) for o in c.ops] == [
        ("firewall.shim", True, 1)]
    assert c.ops[0].args["rule"] == ("-m mark --mark 0x2000/0x2000 -m comment --comment "
                                     "reconciler:shim -j ACCEPT")


@pytest.mark.parametrize(("chains", "named"), [
    (_legacy(nat="-A PREROUTING -p tcp -m tcp --dport 8080 -j REDIRECT --to-ports 9\n"),
     "iptables-legacy nat/PREROUTING: -A PREROUTING -p tcp -m tcp --dport 8080 -j REDIRECT "
     "--to-ports 9 sends port map 8080/tcp of alloc a1 elsewhere"),
    (_legacy(nat="-A OUTPUT -d 127.0.0.1/32 -p tcp -m tcp --dport 8443 -j DNAT "
                 "--to-destination 127.0.0.1:9\n"),
     "nat/OUTPUT: -A OUTPUT -d 127.0.0.1/32 -p tcp -m tcp --dport 8443 -j DNAT "
     "--to-destination 127.0.0.1:9 sends port map 127.0.0.1:8443/tcp of alloc a1 elsewhere"),
])
def test_a_legacy_rule_that_blocks_a_declared_path_is_a_plan_error(chains: LiveChainSet,
                                                                   named: str) -> None:
    host, d = fresh(), desired()
    converge(host, d)
    p = _legacy_plan(host, d, chains)
    assert not p.has_changes and not p.warnings
    assert len(p.errors) == 1 and named in p.errors[0], p.errors
    assert "iptables-legacy acts on every packet" in p.errors[0]


def test_a_legacy_rule_through_a_chain_it_jumps_to_is_named_with_the_jump() -> None:
    host, d = fresh(), desired()
    converge(host, d)
    chains = _legacy(nat="-A PREROUTING -m addrtype --dst-type LOCAL -j LEGACY-DNAT\n"
                         "-A LEGACY-DNAT -p tcp -m tcp --dport 8080 -j DNAT "
                         "--to-destination 192.0.2.9:80\n")
    chains.chains[("nat", "LEGACY-DNAT")] = chains.chains.pop(("nat", "LEGACY-DNAT"))
    [error] = _legacy_plan(host, d, chains).errors
    assert error.startswith("iptables-legacy nat/LEGACY-DNAT: -A LEGACY-DNAT -p tcp -m tcp "
                            "--dport 8080 -j DNAT --to-destination 192.0.2.9:80 (from -j "
                            "LEGACY-DNAT) sends port map 8080/tcp"), error


@pytest.mark.parametrize("chains", [
    _legacy(),  # the usual leftover: empty tables, ACCEPT policies
    _legacy("-A FORWARD -i eth0 -p tcp -m tcp --dport 25 -j REJECT\n"),  # broad, not ours
    _legacy("-A FORWARD -m conntrack --ctstate INVALID -j DROP\n"),
    _legacy("-A INPUT -p tcp -m tcp --dport 22 -j DROP\n"),  # not a reply's port
    _legacy("-A FORWARD -d 10.0.0.0/24 -j ACCEPT\n-A FORWARD -s 10.0.0.0/24 -j ACCEPT\n",
            forward="DROP"),  # the subnet let through before the policy
    _legacy("-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n", input_="DROP"),
    _legacy(nat="-A PREROUTING -p tcp -m tcp --dport 9090 -j REDIRECT --to-ports 9\n"),
])
def test_legacy_rules_off_the_declared_paths_are_not_named(chains: LiveChainSet) -> None:
    host, d = fresh(), desired()
    converge(host, d)
    p = _legacy_plan(host, d, chains)
    assert (p.errors, p.warnings) == ((), ())


def test_a_legacy_rule_on_part_of_a_path_it_names_is_a_warning() -> None:
    host, d = fresh(), desired()
    converge(host, d)
    # (a REJECT in INPUT or FORWARD is passed by the shim there: filter OUTPUT has none)
    p = _legacy_plan(host, d, _legacy("-A OUTPUT -d 10.0.0.0/24 -p tcp -m tcp --sport 40000 "
                                      "-j REJECT\n"))
    assert p.errors == ()
    [w] = p.warnings
    assert w.startswith("iptables-legacy filter/OUTPUT: -A OUTPUT -d 10.0.0.0/24 -p tcp -m tcp "
                        "--sport 40000 -j REJECT drops some of port map 8080/tcp of alloc a1")


def test_ip6tables_legacy_is_read_for_the_ipv6_paths() -> None:
    host, d = fresh(), desired(v6=True)
    converge(host, d)
    p = _legacy_plan(host, d, _legacy("-A OUTPUT -d fd00:1::/64 -j DROP\n"), family=6)
    assert [e.split(" drops ")[0] for e in p.errors] == [
        "ip6tables-legacy filter/OUTPUT: -A OUTPUT -d fd00:1::/64 -j DROP"]
    p = _legacy_plan(host, d, _legacy(input_="DROP"), family=6)
    assert p.errors == () and [c.name for c in p.actionable] == [
        "ip6tables-legacy filter/INPUT"]
    p = _legacy_plan(host, d, _legacy(forward="DROP"), family=6)
    assert p.errors == () and [c.name for c in p.actionable] == [
        "ip6tables-legacy filter/FORWARD"]


def test_unreadable_legacy_tables_are_a_warning() -> None:
    host, d = fresh(), desired()
    converge(host, d)
    p = _legacy_plan(host, d, LiveChainSet(False, error="iptables-legacy-save: boom"))
    assert p.errors == () and len(p.warnings) == 1 and "boom" in p.warnings[0]


def test_the_declared_paths_follow_the_maps_and_subnets() -> None:
    d = desired()
    rs = firewall.RuleSet(4)
    for s in d.subnets.values():
        firewall.subnet_rules(rs, s)
    rs.add(firewall.DNAT, ("-p", "tcp", "-m", "tcp", "--dport", "8080", "-m", "comment",
                           "--comment", "reconciler:alloc=a1", "-j", "DNAT",
                           "--to-destination", "10.0.0.2:80"))
    paths = legacy.declared_paths(d, rs, 4)
    assert sorted(paths) == [("filter", "FORWARD"), ("filter", "INPUT"), ("filter", "OUTPUT"),
                             ("nat", "OUTPUT"), ("nat", "PREROUTING")]
    [dnated, replies, egress, back] = paths[("filter", "FORWARD")]
    assert (dnated.dst, dnated.oif, dnated.dports) == (ipaddress.ip_network("10.0.0.2/32"),
                                                       "br0", ((80, 80),))
    assert (replies.src, replies.iif, replies.sports) == (ipaddress.ip_network("10.0.0.2/32"),
                                                          "br0", ((80, 80),))
    assert (egress.src, egress.iif, back.dst, back.oif) == (NET, "br0", NET, "br0")


def test_no_legacy_table_costs_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(iptables.IptablesDriver, "observe_legacy", OBSERVE_LEGACY)
    monkeypatch.setattr(iptables, "_legacy_tables", lambda _f: False)
    monkeypatch.setattr(iptables, "active_backend", lambda _f: pytest.fail("asked"))
    assert iptables.IptablesDriver(4).observe_legacy() is None
    monkeypatch.setattr(iptables, "_legacy_tables", lambda _f: True)
    monkeypatch.setattr(iptables, "active_backend", lambda _f: "legacy")  # ours: no "beside"
    assert iptables.IptablesDriver(4).observe_legacy() is None


# ------------------------------------------------------------------ the probes' diagnosis

BEFORE = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [5:300]
:OUTPUT ACCEPT [0:0]
:RECONCILER-FORWARD - [0:0]
[0:0] -A FORWARD -i br-1 ! -o br-1 -j ACCEPT
[3:180] -A FORWARD -d 10.0.0.0/24 -j ACCEPT
[9:540] -A FORWARD -m comment --comment reconciler -j RECONCILER-FORWARD
[0:0] -A RECONCILER-FORWARD -d 10.0.0.0/24 -o br0 -m conntrack --ctstate RELATED,ESTABLISHED,DNAT -m comment --comment reconciler:subnet=net -j ACCEPT
[0:0] -A RECONCILER-FORWARD -d 10.0.0.0/24 -o br0 -m comment --comment reconciler:subnet=net -j DROP
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
[0:0] -A PREROUTING -p tcp -m tcp --dport 8080 -j REDIRECT --to-ports 9
COMMIT
"""


def test_a_direct_reach_names_our_chain() -> None:
    spec = ProbeSpec("a1", "direct", "tcp", 4, "external", "10.0.0.2", 80, 80, 80, False)
    cause = classify(spec, Sighting(True, "connected"), Facts())
    assert cause.ours
    assert cause.line == ("reached 10.0.0.2:80 directly although the subnet's isolation is "
                          "ports: the drop in chain isolate of table inet reconciler did not "
                          "take it (its entry is missing or the table was changed: a pass "
                          "rebuilds it)")


def test_legacy_counters_name_drops_and_redirects() -> None:
    after = BEFORE.replace(":FORWARD DROP [5:300]", ":FORWARD DROP [6:360]").replace(
        "[0:0] -A PREROUTING", "[1:60] -A PREROUTING")
    hits = foreign_hits(4, BEFORE, after, legacy=True)
    assert [str(h) for h in hits] == [
        "iptables-legacy filter/FORWARD: policy DROP",
        "iptables-legacy nat/PREROUTING: -A PREROUTING -p tcp -m tcp --dport 8080 -j REDIRECT "
        "--to-ports 9"]
    # iptables-nft: its DNATs and REDIRECTs count too (a foreign one can take a mapped port)
    assert [h.rule for h in foreign_hits(4, BEFORE, after)] == [
        "policy DROP", "-A PREROUTING -p tcp -m tcp --dport 8080 -j REDIRECT --to-ports 9"]
    spec = ProbeSpec("a1", "external", "tcp", 4, "external", "192.0.2.1", 8080, 8080, 80, True)
    cause = classify(spec, Sighting(False, "refused"), Facts(hits=tuple(hits)))
    assert cause.line == ("a foreign rule sends it elsewhere: iptables-legacy nat/PREROUTING: "
                          "-A PREROUTING -p tcp -m tcp --dport 8080 -j REDIRECT --to-ports 9")
    assert str(RuleHit(6, "filter", "FORWARD", "policy DROP", legacy=True)) == \
        "ip6tables-legacy filter/FORWARD: policy DROP"


def test_the_upgrade_removes_the_mark_chain_of_the_version_before_the_table() -> None:
    """A host the iptables version with the shim ran on: RECONCILER-MARK (mangle) goes with
    the other RECONCILER-* chains once the table marks; the shim itself stays (same text)."""
    from reconciler.planner import nftplan
    old = parse_save(
        "*mangle\n:FORWARD ACCEPT [0:0]\n:RECONCILER-MARK - [0:0]\n"
        "-A FORWARD -m comment --comment reconciler -j RECONCILER-MARK\n"
        "-A RECONCILER-MARK -o br0 -m comment --comment reconciler:subnet=net "
        "-j MARK --set-xmark 0x2000/0x2000\nCOMMIT\n"
        "*filter\n:FORWARD DROP [0:0]\n"
        "-A FORWARD -m mark --mark 0x2000/0x2000 -m comment --comment reconciler:shim "
        "-j ACCEPT\nCOMMIT\n")
    host, d = fresh(), desired()
    converge(host, d)
    c4, _c6, warnings = nftplan.cleanup_scripts(dataclasses.replace(host.observe(d), old4=old))
    assert warnings == []
    assert c4 == ("*mangle\n-D FORWARD -m comment --comment reconciler -j RECONCILER-MARK\n"
                  "-F RECONCILER-MARK\n-X RECONCILER-MARK\nCOMMIT\n"), c4
