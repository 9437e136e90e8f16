"""The pure allocation planner: IPAM and port choices from in-memory live state.

Live state comes from ``FakeHost``, which runs plan ops the way the kernel
would (namespaces, veth pairs, owned addresses, default routes, iptables)."""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.domain.errors import PlanError
from reconciler.domain.live import LiveAddress, LiveLink
from reconciler.domain.model import (
    DesiredState,
)
from reconciler.domain.ownership import alloc_mac, alloc_ns_alias, alloc_veth_name
from reconciler.domain.plan import Action
from reconciler.planner import firewall
from tests.support.fakehost import FakeHost, FakeNetns
from tests.support.planning import alloc, bridge, converge, plan, port, state, subnet


def v4(host: FakeHost, aid: str) -> str:
    (a,) = [str(x.address) for x in host.netns[aid].links["eth0"].addresses
            if x.address.version == 4]
    return a


def v6(host: FakeHost, aid: str) -> str:
    (a,) = [str(x.address) for x in host.netns[aid].links["eth0"].addresses
            if x.address.version == 6]
    return a


def dnat(host: FakeHost, family: int = 4) -> list[str]:
    return host.ours(family).get(("nat", "RECONCILER-DNAT"), [])


def host_port(host: FakeHost, aid: str, to: int, proto: str = "tcp") -> int:
    (p,) = {int(r.split("--dport ")[1].split()[0]) for r in dnat(host)
            if f"alloc={aid}" in r and f"-p {proto}" in r and r.endswith(f":{to}")}
    return p


def test_lowest_free_addresses_in_id_order_skipping_the_gateway():
    host = FakeHost()
    converge(host, state(alloc("b"), alloc("a"), alloc("c"),
                         sub=subnet(cidr6="fd00::/64")))
    assert [v4(host, x) for x in "abc"] == ["10.0.0.2/24", "10.0.0.3/24", "10.0.0.4/24"]
    assert [v6(host, x) for x in "abc"] == ["fd00::2/64", "fd00::3/64", "fd00::4/64"]


def test_range_bounds_are_respected():
    host = FakeHost()
    converge(host, state(alloc("a"), alloc("b"), sub=subnet(rng=("10.0.0.100", "10.0.0.101"))))
    assert [v4(host, x) for x in "ab"] == ["10.0.0.100/24", "10.0.0.101/24"]


def test_addresses_are_kept_when_allocs_sorting_before_are_added():
    host = FakeHost()
    converge(host, state(alloc("m"), alloc("n")))
    converge(host, state(alloc("a"), alloc("b"), alloc("m"), alloc("n")))
    assert [v4(host, x) for x in "mn"] == ["10.0.0.2/24", "10.0.0.3/24"]
    assert {v4(host, "a"), v4(host, "b")} == {"10.0.0.4/24", "10.0.0.5/24"}


def test_kept_address_survives_a_lower_one_becoming_free():
    host = FakeHost()
    converge(host, state(alloc("a"), alloc("b")))
    converge(host, state(alloc("b")))
    assert v4(host, "b") == "10.0.0.3/24"  # not moved down to .2


def test_live_address_outside_a_changed_range_is_replaced():
    host = FakeHost()
    converge(host, state(alloc("a")))
    moved = state(alloc("a"), sub=subnet(rng=("10.0.0.50", "10.0.0.60")))
    p = plan(host, moved)
    (c,) = [c for c in p.actionable if c.kind == "alloc"]
    assert c.action is Action.UPDATE
    assert ("address", "10.0.0.2/24", None) in [(x.field, x.before, x.after) for x in c.attrs]
    converge(host, moved)
    assert v4(host, "a") == "10.0.0.50/24"


def test_declared_address_takes_over_and_the_holder_moves():
    host = FakeHost()
    converge(host, state(alloc("b")))
    assert v4(host, "b") == "10.0.0.2/24"
    converge(host, state(alloc("a", address="10.0.0.2"), alloc("b")))
    assert v4(host, "a") == "10.0.0.2/24" and v4(host, "b") == "10.0.0.3/24"


def test_exhausted_range_is_a_plan_error_naming_subnet_and_alloc():
    host = FakeHost()
    desired = state(alloc("a"), alloc("b"), alloc("c"), sub=subnet(rng=("10.0.0.5", "10.0.0.6")))
    with pytest.raises(PlanError) as exc:
        plan(host, desired)
    msg = str(exc.value)
    assert "'c'" in msg and "'net'" in msg and "10.0.0.5-10.0.0.6" in msg and "IPv4" in msg
    assert "\n" not in msg


def test_exhaustion_counts_declared_addresses():
    desired = state(alloc("a"), alloc("z", address="10.0.0.5"),
                    sub=subnet(rng=("10.0.0.5", "10.0.0.5")))
    with pytest.raises(PlanError, match="'a'"):
        plan(FakeHost(), desired)


def test_a_foreign_address_inside_the_alloc_is_not_taken_for_its_own():
    host = FakeHost()
    converge(host, state(alloc("a")))
    eth0 = host.netns["a"].links["eth0"]
    host.netns["a"].links["eth0"] = dataclasses.replace(
        eth0, addresses=(LiveAddress(ipaddress.ip_interface("10.0.0.9/24"), False),))
    p = plan(host, state(alloc("a")))
    (c,) = p.actionable
    assert ("address", None, "10.0.0.2/24") in [(x.field, x.before, x.after) for x in c.attrs]


def test_no_two_allocs_share_an_address_even_when_live_state_says_so():
    """Two namespaces holding the same owned address (a copy, a race): one of them moves."""
    host = FakeHost()
    converge(host, state(alloc("a"), alloc("b")))
    b_eth0 = host.netns["b"].links["eth0"]
    host.netns["b"].links["eth0"] = dataclasses.replace(
        b_eth0, addresses=(LiveAddress(ipaddress.ip_interface("10.0.0.2/24"), True),))
    converge(host, state(alloc("a"), alloc("b")))
    assert v4(host, "a") != v4(host, "b")


def test_explicit_auto_and_both_protocol_ports():
    host = FakeHost()
    converge(host, state(alloc("a", port(8080, 80), port(None, 90, "both"),
                               port(8443, 443, host_ip="127.0.0.1"))))
    rules = dnat(host)
    assert ("-p tcp -m tcp --dport 8080 -m comment --comment reconciler:alloc=a "
            "-j DNAT --to-destination 10.0.0.2:80") in rules
    assert host_port(host, "a", 90, "tcp") == host_port(host, "a", 90, "udp") == 20000
    assert any(r.startswith("-d 127.0.0.1/32 -p tcp") and "--dport 8443" in r for r in rules)


def test_ipv6_rules_use_brackets_and_skip_ipv4_only_host_ips():
    host = FakeHost()
    converge(host, state(alloc("a", port(8080, 80), port(8443, 443, host_ip="127.0.0.1")),
                         sub=subnet(cidr6="fd00::/64")))
    rules6 = dnat(host, 6)
    assert len(rules6) == 1 and rules6[0].endswith("--to-destination [fd00::2]:80")


def test_the_written_dnat_rules_read_back_as_they_were_made():
    """The one reader of RECONCILER-DNAT (firewall.parse_dnat) on what the planner wrote."""
    host = FakeHost()
    converge(host, state(alloc("a", port(8080, 80), port(8443, 443, host_ip="127.0.0.1")),
                         sub=subnet(cidr6="fd00::/64")))
    read4 = sorted((d.alloc, d.proto, d.port, str(d.host_ip), str(d.dest), d.to)
                   for d in firewall.dnat_rules(dnat(host)))
    assert read4 == [("a", "tcp", 8080, "None", "10.0.0.2", 80),
                     ("a", "tcp", 8443, "127.0.0.1", "10.0.0.2", 443)]
    (d6,) = firewall.dnat_rules(dnat(host, 6))
    assert (d6.dest, d6.to, d6.host_ip) == (ipaddress.ip_address("fd00::2"), 80, None)
    assert firewall.parse_dnat("-p tcp -m tcp --dport 80 -j DNAT --to-destination "
                               "10.0.0.2:80") is None  # no comment: not ours
    assert firewall.parse_dnat("-p tcp -m comment --comment reconciler:alloc=a -j DNAT "
                               "--to-destination 10.0.0.2:80") is None  # no --dport


def test_auto_ports_are_kept_when_others_come_and_go():
    host = FakeHost()
    converge(host, state(alloc("m", port(None, 80))))
    assert host_port(host, "m", 80) == 20000
    converge(host, state(alloc("a", port(None, 80)), alloc("m", port(None, 80)),
                         alloc("z", port(None, 80))))
    assert host_port(host, "m", 80) == 20000
    assert {host_port(host, "a", 80), host_port(host, "z", 80)} == {20001, 20002}
    converge(host, state(alloc("m", port(None, 80)), alloc("z", port(None, 80))))
    assert host_port(host, "m", 80) == 20000 and host_port(host, "z", 80) in (20001, 20002)


def test_auto_port_skips_listening_and_explicit_ports():
    host = FakeHost()
    host.listening = {("tcp", 20000)}
    converge(host, state(alloc("a", port(None, 80)), alloc("b", port(20001, 81))))
    assert host_port(host, "a", 80) == 20002


def test_listening_host_port_is_a_plan_error_naming_port_and_alloc():
    host = FakeHost()
    host.listening = {("udp", 5353)}
    with pytest.raises(PlanError) as exc:
        plan(host, state(alloc("dns", port(5353, 53, "both"))))
    assert "5353/udp" in str(exc.value) and "'dns'" in str(exc.value)
    assert host.log == []


def test_port_published_by_docker_is_a_plan_error_and_avoided_by_auto():
    host = FakeHost()
    host.fw[4].chains[("nat", "DOCKER")] = [
        "! -i docker0 -p tcp -m tcp --dport 8080 -j DNAT --to-destination 172.17.0.2:80",
        "! -i docker0 -p tcp -m tcp --dport 20000 -j DNAT --to-destination 172.17.0.3:80"]
    with pytest.raises(PlanError) as exc:
        plan(host, state(alloc("web", port(8080, 80))))
    msg = str(exc.value)
    assert "8080/tcp" in msg and "'web'" in msg and "Docker" in msg and "172.17.0.2:80" in msg
    converge(host, state(alloc("web", port(None, 80))))
    assert host_port(host, "web", 80) == 20001


def test_auto_range_exhausted_is_a_plan_error():
    with pytest.raises(PlanError, match="no free host port"):
        plan(FakeHost(), state(alloc("a", port(None, 80), port(None, 81)), auto=(20000, 20000)))


def test_auto_port_outside_a_changed_range_moves_into_it():
    host = FakeHost()
    converge(host, state(alloc("a", port(None, 80))))
    converge(host, state(alloc("a", port(None, 80)), auto=(30000, 30010)))
    assert host_port(host, "a", 80) == 30000


def test_create_plan_and_ops():
    host = FakeHost()
    p = plan(host, state(alloc("a", port(8080, 80))))
    (c,) = [c for c in p.actionable if c.kind == "alloc"]
    assert c.action is Action.CREATE
    assert [op.name for op in c.ops] == ["netns.create", "alloc.attach", "alloc.configure"]
    assert c.ops[0].args["mark"] == alloc_ns_alias(host.host_id)
    assert c.ops[1].args["veth"] == alloc_veth_name("a")
    assert ("ports", None, ["8080/tcp->80"]) in [(x.field, x.before, x.after) for x in c.attrs]


def test_dropping_cidr6_removes_the_ipv6_address_and_default_route():
    host = FakeHost()
    converge(host, state(alloc("a"), sub=subnet(cidr6="fd00::/64")))
    p = plan(host, state(alloc("a")))
    (c,) = [c for c in p.actionable if c.kind == "alloc"]
    assert [(x.field, x.before, x.after) for x in c.attrs] == [
        ("address", "fd00::2/64", None), ("default route", "via fd00::1", None),
        # its bridge-side entry, seeded exempt from the kernel's GC: never collected by it
        ("neighbour", f"fd00::2 at {alloc_mac('a')}", None)]
    converge(host, state(alloc("a")))
    assert [r.gateway for r in host.netns["a"].routes] == ["10.0.0.1"]
    assert [n.address for n in host.neighbours] == ["10.0.0.2"]


def test_hairpin_change_updates_existing_ports():
    host = FakeHost()
    converge(host, state(alloc("a", port(8080, 80)), alloc("b", port(8081, 80))))
    off = state(alloc("a", port(8080, 80)), alloc("b", port(8081, 80)),
                br=bridge(hairpin=False))
    p = plan(host, off)
    changed = {c.name: c for c in p.actionable if c.kind == "alloc"}
    assert set(changed) == {"a", "b"}
    assert [op.name for op in changed["a"].ops] == ["link.set_hairpin"]
    converge(host, off)
    assert host.links[alloc_veth_name("a")].hairpin is False


def test_reattached_port_gets_its_hairpin_back():
    host = FakeHost()
    converge(host, state(alloc("a", port(8080, 80))))
    veth = alloc_veth_name("a")
    host.links[veth] = dataclasses.replace(host.links[veth], master=None, hairpin=None)
    converge(host, state(alloc("a", port(8080, 80))))
    assert host.links[veth].master == "br0" and host.links[veth].hairpin is True


def test_hairpin_only_on_ports_of_allocs_with_port_maps():
    host = FakeHost()
    converge(host, state(alloc("a", port(8080, 80)), alloc("b")))
    assert host.links[alloc_veth_name("a")].hairpin is True
    assert host.links[alloc_veth_name("b")].hairpin is False
    # b gains a port map: its port gets hairpin; losing it again changes nothing
    with_port = state(alloc("a", port(8080, 80)), alloc("b", port(8081, 80)))
    (c,) = [c for c in plan(host, with_port).actionable if c.kind == "alloc"]
    assert c.name == "b" and ("hairpin", False, True) in [(x.field, x.before, x.after)
                                                           for x in c.attrs]
    converge(host, with_port)
    assert host.links[alloc_veth_name("b")].hairpin is True
    # (the allocation shows the map it loses, but its port is left alone: no op)
    (c,) = [c for c in plan(host, state(alloc("a", port(8080, 80)), alloc("b"))).actionable
            if c.kind == "alloc"]
    assert [(x.field, x.before, x.after) for x in c.attrs] == [("ports", ["8081/tcp->80"], [])]
    assert c.ops == ()


def test_hairpin_on_a_port_without_port_maps_is_no_change_unless_the_bridge_says_off():
    """Hosts built by a version that set hairpin on every port do not churn on upgrade."""
    host = FakeHost()
    converge(host, state(alloc("a")))
    veth = alloc_veth_name("a")
    host.links[veth] = dataclasses.replace(host.links[veth], hairpin=True)  # as before
    assert not [c for c in plan(host, state(alloc("a"))).actionable if c.kind == "alloc"]
    off = state(alloc("a"), br=bridge(hairpin=False))
    (c,) = [c for c in plan(host, off).actionable if c.kind == "alloc"]
    assert ("hairpin", True, False) in [(x.field, x.before, x.after) for x in c.attrs]
    converge(host, off)
    assert host.links[veth].hairpin is False


def test_deleted_veth_is_recreated_without_touching_the_namespace():
    host = FakeHost()
    converge(host, state(alloc("a")))
    host._delete_link(alloc_veth_name("a"), None)
    p = plan(host, state(alloc("a")))
    (c,) = p.actionable
    assert c.action is Action.UPDATE and "netns.create" not in [op.name for op in c.ops]
    converge(host, state(alloc("a")))
    assert v4(host, "a") == "10.0.0.2/24"


def test_empty_namespace_file_is_replaced():
    host = FakeHost()
    converge(host, state(alloc("a")))
    host.netns["a"].usable = False
    (c,) = plan(host, state(alloc("a"))).actionable
    assert c.action is Action.REPLACE and c.ops[-3].args["replace_stale"] is True
    converge(host, state(alloc("a")))


def test_foreign_namespace_is_a_conflict_unless_adopted():
    host = FakeHost()
    host.netns["a"] = FakeNetns(99, {"lo": LiveLink("lo", 1, "", 65536, True, False)})
    p = plan(host, state(alloc("a")))
    assert [c.action for c in p.conflicts] == [Action.CONFLICT]
    assert "--adopt alloc/a" in p.conflicts[0].reason
    converge(host, state(alloc("a")), adopt=frozenset({"alloc/a"}))
    assert host.netns["a"].links["lo"].alias == alloc_ns_alias(host.host_id)
    converge(host, state(alloc("a")))  # ours from now on, without --adopt


def test_namespaces_of_another_host_are_neither_pruned_nor_counted():
    host = FakeHost()
    converge(host, state(alloc("a")))
    host.host_id = "1234"  # the same machine seen from another sandbox
    p = plan(host, DesiredState())
    assert not [c for c in p.actionable if c.kind == "alloc"]


def test_pruned_alloc_takes_namespace_and_rules():
    host = FakeHost()
    converge(host, state(alloc("a", port(8080, 80)), alloc("b", port(8081, 80))))
    p = plan(host, state(alloc("b", port(8081, 80))))
    assert {c.address: c.action for c in p.actionable}["alloc/a"] is Action.DELETE
    converge(host, state(alloc("b", port(8081, 80))))
    assert "a" not in host.netns and alloc_veth_name("a") not in host.links
    assert all("alloc=a" not in r for r in dnat(host))


def test_orphan_owned_veth_is_deleted():
    host = FakeHost()
    converge(host, state(alloc("a")))
    del host.netns["a"]  # the namespace file went away, something keeps the netns alive
    p = plan(host, state())
    assert {c.address: c.action for c in p.actionable}[f"veth/{alloc_veth_name('a')}"] \
        is Action.DELETE
    converge(host, state())
    assert alloc_veth_name("a") not in host.links


def test_live_dnat_of_an_undeclared_alloc_is_not_reused_for_auto_ports():
    host = FakeHost()
    host.fw[4].chains[("nat", "RECONCILER-DNAT")] = [
        "-p tcp -m tcp --dport 20000 -m comment --comment reconciler:alloc=gone "
        "-j DNAT --to-destination 10.0.0.9:80"]
    p = plan(host, state(alloc("a", port(None, 80))))
    assert "20000/tcp->80" in str([c.attrs for c in p.actionable if c.kind == "alloc"])


def test_unparseable_live_rules_do_not_break_planning():
    host = FakeHost()
    host.fw[4].chains[("nat", "RECONCILER-DNAT")] = [
        "-p tcp -m comment --comment reconciler:alloc=a -j DNAT"]
    p = plan(host, state(alloc("a", port(None, 80))))
    assert "20000/tcp->80" in str([c.attrs for c in p.actionable if c.kind == "alloc"])


IDS = ["a", "b", "c", "web-1", "x.y"]


@st.composite
def alloc_states(draw: st.DrawFn) -> DesiredState:
    hairpin = draw(st.booleans())
    mtu = draw(st.one_of(st.none(), st.integers(1280, 9000)))
    sub = subnet(cidr6="fd00:1::/64" if draw(st.booleans()) else None,
                 rng=draw(st.sampled_from([None, ("10.0.0.10", "10.0.0.20")])))
    ids = draw(st.lists(st.sampled_from(IDS), unique=True, max_size=5))
    explicit = iter(range(8000, 8100))
    allocs = []
    for aid in ids:
        ports = []
        for _ in range(draw(st.integers(0, 3))):
            proto = draw(st.sampled_from(["tcp", "udp", "both"]))
            host = None if draw(st.booleans()) else next(explicit)
            ports.append(port(host, draw(st.integers(1, 3)), proto))
        addr = draw(st.sampled_from([None, None, "10.0.0.15"]))
        if addr and any(a.address == ipaddress.IPv4Address(addr) for a in allocs):
            addr = None
        allocs.append(alloc(aid, *ports, address=addr))
    return state(*allocs, sub=sub, br=bridge(mtu=mtu, hairpin=hairpin), auto=(20000, 20020))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(alloc_states(), alloc_states())
def test_allocs_converge_and_tear_down(first: DesiredState, second: DesiredState):
    host = FakeHost()
    for d in (first, second, first, DesiredState()):
        converge(host, d)
        addrs = [str(x.address) for ns in host.netns.values()
                 for x in ns.links["eth0"].addresses]
        assert len(addrs) == len(set(addrs))
        assert set(host.netns) == set(d.allocs)
    assert not host.links and not host.netns
    assert all(not rules for rules in host.fw[4].chains.values())


def test_tagged_empty_netns_file_is_removed_untagged_left_alone():
    from reconciler.domain.live import LiveNetns, LiveState
    from reconciler.domain.model import DesiredState
    from reconciler.domain.ownership import alloc_ns_alias
    from reconciler.domain.plan import Action
    from reconciler.planner import PlanOptions, make_plan

    live = LiveState(host_id="42", netns={
        "ours": LiveNetns("ours", usable=False, file_mark=alloc_ns_alias("42")),
        "other-host": LiveNetns("other-host", usable=False, file_mark=alloc_ns_alias("7")),
        "foreign": LiveNetns("foreign", usable=False)})
    for prune in (True, False):  # garbage, not an undeclared resource: removed either way
        plan = make_plan(DesiredState(), live, PlanOptions(prune=prune))
        assert [(c.name, c.action) for c in plan.actionable] == [("ours", Action.DELETE)]
        assert plan.actionable[0].ops[0].name == "netns.delete"


def test_more_allocations_than_the_neighbour_table_holds_warns_only_of_what_counts():
    # the entries this version seeds are exempt from the kernel's GC (tests/unit/
    # test_neighbours.py has the entries that still count)
    host = FakeHost()
    host.sysctls["net/ipv4/neigh/default/gc_thresh3"] = "8"
    many = state(*(alloc(f"a{i}") for i in range(5)))
    assert not [w for w in plan(host, many).warnings if "neighbour" in w]
