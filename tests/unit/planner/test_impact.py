"""Impact before it happens (issue 15 item 2): what each change disrupts, its flows, and
``--max-disruption``; pure parts and the engine over the in-memory host."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import socket
from typing import Any

import pytest

from reconciler.agent.loop import Agent
from reconciler.agent.passes import WatchOptions
from reconciler.domain.docker import SCOPE_LABEL
from reconciler.domain.errors import StalePlanError
from reconciler.domain.live import LiveDocker, LiveDockerNetwork, LiveEndpoint, LiveState
from reconciler.domain.model import DesiredState, DockerNetwork, DockerNetworkName
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.domain.plan import Action, Change, Impact, Plan
from reconciler.drivers.netlink.conntrack import (
    IPS_SEEN_REPLY,
    TCP_CONNTRACK_ESTABLISHED,
    Entry,
    Tuple,
)
from reconciler.engine.impact import DisruptionError, refusal
from reconciler.engine.reconcile import Reconciler
from reconciler.planner import PlanOptions, make_plan
from reconciler.ui.parser import build_parser
from reconciler.ui.render import render_text
from tests.support.fakehost import FakeHost
from tests.support.planning import alloc, converge, port, state, subnet

IP = ipaddress.ip_address
HOST = "192.0.2.10"  # the host address clients reach the maps on


def tcp_flow(client: str, sport: int, host_port: int, alloc_ip: str, to: int, *,
             state_: int = TCP_CONNTRACK_ESTABLISHED) -> Entry:
    """A client's TCP flow to a host port, DNATed to an allocation."""
    return Entry(4, Tuple(IP(client), IP(HOST), socket.IPPROTO_TCP, sport, host_port),
                 Tuple(IP(alloc_ip), IP(client), socket.IPPROTO_TCP, to, sport), 0, 1, 0,
                 state_)


def udp_flow(src: str, sport: int, dst: str, dport: int, *, answered: bool) -> Entry:
    return Entry(4, Tuple(IP(src), IP(dst), socket.IPPROTO_UDP, sport, dport),
                 Tuple(IP(dst), IP(src), socket.IPPROTO_UDP, dport, sport), 0, 2,
                 IPS_SEEN_REPLY if answered else 0)


def two_allocs() -> DesiredState:
    return state(alloc("a", port(8080, 80), address="10.0.0.2"),
                 alloc("b", port(8081, 80), address="10.0.0.3"))


def impacts(plan: Plan) -> dict[tuple[str, str, str], Impact]:
    """Every impact entry by (change address, type, name)."""
    return {(c.address, i.type, i.name): i for c in plan.changes for i in c.impact}


def rec(host: FakeHost) -> Reconciler:
    return Reconciler(host, runner=host, sleep=lambda _s: None)  # type: ignore[arg-type]


# ------------------------------------------------------------------ what is disrupted


def test_a_pruned_alloc_and_its_port_map_are_the_impact_and_nothing_else() -> None:
    host = FakeHost()
    converge(host, two_allocs())
    plan = make_plan(state(alloc("b", port(8081, 80), address="10.0.0.3")),
                     host.observe(two_allocs()))
    found = impacts(plan)
    assert set(found) == {("alloc/a", "alloc", "a"), ("firewall/nftables", "port_map", "8080/tcp")}
    a = found[("alloc/a", "alloc", "a")]
    assert (a.effect, a.addresses, a.flows) == ("deleted: loses connectivity", ("10.0.0.2",),
                                                None)
    m = found[("firewall/nftables", "port_map", "8080/tcp")]
    assert m.effect == "closed (it sent to alloc a at 10.0.0.2:80)"
    assert [(i.type, i.name) for i in plan.impacted] == [("alloc", "a"), ("port_map", "8080/tcp")]


def test_nothing_that_leaves_connectivity_alone_has_an_impact() -> None:
    host = FakeHost()
    converge(host, two_allocs())
    # a new alloc, a new port map of a kept one, a new MTU: no loss anywhere
    more = state(alloc("a", port(8080, 80), port(9090, 90), address="10.0.0.2"),
                 alloc("b", port(8081, 80), address="10.0.0.3"), alloc("c"))
    plan = make_plan(more, host.observe(more))
    assert plan.has_changes and not impacts(plan) and plan.impacted == ()
    assert "impact" not in render_text(plan).lower()
    assert all(c["impact"] == [] for c in plan.to_json()["changes"])


def test_a_moved_map_and_a_new_address_are_said_in_plain_words() -> None:
    host = FakeHost()
    converge(host, two_allocs())
    moved = state(alloc("a", address="10.0.0.9"), alloc("b", port(8081, 80), port(8080, 80),
                                                         address="10.0.0.3"))
    plan = make_plan(moved, host.observe(moved))
    found = impacts(plan)
    assert found[("firewall/nftables", "port_map", "8080/tcp")].effect == \
        "moves from alloc a at 10.0.0.2:80 to alloc b at 10.0.0.3:80"
    a = found[("alloc/a", "alloc", "a")]
    assert (a.effect, a.addresses) == ("loses address 10.0.0.2/24", ("10.0.0.2",))
    text = render_text(plan)
    assert "      impact: alloc a: loses address 10.0.0.2/24 (10.0.0.2)" in text
    assert ("      impact: port map 8080/tcp: moves from alloc a at 10.0.0.2:80 to alloc b at "
            "10.0.0.3:80 (10.0.0.2)") in text
    assert "Impact: 2 items disrupted (1 alloc, 1 port map)." in text


def test_a_veth_re_created_under_a_live_alloc_is_an_impact() -> None:
    host = FakeHost()
    converge(host, two_allocs())
    # eth0 wired to something else: the planner deletes it and makes the pair again
    host.netns["a"].links["eth0"] = dataclasses.replace(host.netns["a"].links["eth0"],
                                                        kind="dummy")
    plan = make_plan(two_allocs(), host.observe(two_allocs()))
    a = impacts(plan)[("alloc/a", "alloc", "a")]
    assert a.effect == "its veth is re-created: no connectivity until it is back"


def test_dual_stack_maps_are_one_item_and_the_gateway_loss_is_said() -> None:
    host = FakeHost()
    dual = state(alloc("a", port(8080, 80)), sub=subnet(cidr6="fd00::/64"))
    converge(host, dual)
    plan = make_plan(state(sub=subnet(cidr6="fd00::/64")), host.observe(dual))
    found = impacts(plan)
    assert {k for k in found if k[1] == "port_map"} == {
        ("firewall/nftables", "port_map", "8080/tcp")}  # both families: one change, one item
    # counted once: one declared map serves both families
    assert sorted((i.type, i.name) for i in plan.impacted) == [("alloc", "a"),
                                                               ("port_map", "8080/tcp")]
    v4only = make_plan(state(alloc("a", port(8080, 80))), host.observe(dual))
    lost = {k: i for k, i in impacts(v4only).items() if k[2] == "a"}
    assert sorted((c, i.effect, i.addresses) for (c, _t, _n), i in lost.items()) == [
        ("alloc/a", "loses address fd00::2/64; loses its IPv6 default route via fd00::1",
         ("fd00::2",)),
        ("bridge/br0", "loses its gateway fd00::1 on bridge br0", ("fd00::2",))]


def _docker_state(spec: DockerNetwork, *endpoints: LiveEndpoint, scope: str = "host") -> LiveState:
    live = LiveDockerNetwork(
        "n" * 64, spec.name, "bridge", {DOCKER_LABEL: DOCKER_LABEL_VALUE, SCOPE_LABEL: scope},
        {"com.docker.network.driver.mtu": "1500"}, False, False, ("172.30.0.0/24",),
        len(endpoints), endpoints)
    return LiveState(docker=LiveDocker(True, default_mtu=1500, networks=(live,), scope=scope))


def test_a_forced_replace_names_each_container_with_its_addresses() -> None:
    name = DockerNetworkName("kind")
    eps = (LiveEndpoint("web", "172.30.0.2"), LiveEndpoint("db", "172.30.0.3"))
    keep = DockerNetwork(name, subnet=ipaddress.IPv4Network("172.30.0.0/24"), mtu=1400)
    plan = make_plan(DesiredState(docker_networks={name: keep}), _docker_state(keep, *eps),
                     PlanOptions(force_replace=True))
    (c,) = plan.actionable
    assert c.action is Action.REPLACE
    assert [(i.type, i.name, i.addresses) for i in c.impact] == [
        ("container", "db", ("172.30.0.3",)), ("container", "web", ("172.30.0.2",))]
    assert c.impact[0].effect == ("disconnected from docker network kind while it is "
                                  "re-created, then reconnected")
    moved = DockerNetwork(name, subnet=ipaddress.IPv4Network("172.31.0.0/24"))
    plan = make_plan(DesiredState(docker_networks={name: moved}), _docker_state(moved, *eps),
                     PlanOptions(force_replace=True))
    assert plan.actionable[0].impact[1].effect.endswith(
        "then reconnected without 172.30.0.2 (outside the new subnets)")
    # without --force-replace it is a conflict: nothing is disrupted
    refused = make_plan(DesiredState(docker_networks={name: moved}), _docker_state(moved, *eps))
    assert refused.conflicts and refused.impacted == ()


# ------------------------------------------------------------------ flows


def test_flows_are_counted_for_what_is_disrupted_and_probes_are_left_out() -> None:
    host = FakeHost()
    converge(host, two_allocs())
    host.conntrack.entries = [
        tcp_flow("198.51.100.7", 40000, 8080, "10.0.0.2", 80),  # through a's map
        tcp_flow("198.51.100.7", 40001, 8080, "10.0.0.2", 80),  # and another
        tcp_flow("10.0.0.1", 61500, 8080, "10.0.0.2", 80),  # a probe: the host, its port
        tcp_flow("10.0.0.2", 61501, 8080, "10.0.0.2", 80),  # a hairpin probe
        tcp_flow("198.51.100.7", 40002, 8080, "10.0.0.2", 80, state_=1),  # SYN_SENT
        tcp_flow("198.51.100.7", 40003, 8081, "10.0.0.3", 80),  # through b's map: kept
        udp_flow("10.0.0.2", 5353, "192.0.2.53", 53, answered=True),  # a's own, answered
        udp_flow("10.0.0.2", 5354, "192.0.2.53", 53, answered=False),  # never answered
    ]
    plan = rec(host).plan(state(alloc("b", port(8081, 80), address="10.0.0.3")),
                          PlanOptions())
    found = impacts(plan)
    assert found[("alloc/a", "alloc", "a")].flows == 3
    assert found[("firewall/nftables", "port_map", "8080/tcp")].flows == 2
    assert host.conntrack.asked == [(4, frozenset({IP("10.0.0.2")}),
                                     frozenset({("tcp", 8080)}))]
    text = render_text(plan)
    assert "impact: alloc a: deleted: loses connectivity (10.0.0.2); 3 established flows" in text
    assert "; 2 established flows" in text
    assert "Impact: 2 items disrupted (1 alloc, 1 port map)." in text
    j = plan.to_json()["changes"]
    assert {"type": "alloc", "name": "a", "effect": "deleted: loses connectivity",
            "addresses": ["10.0.0.2"], "flows": 3} in [i for c in j for i in c["impact"]]


def test_a_plan_that_disrupts_nothing_reads_no_conntrack() -> None:
    host = FakeHost()
    converge(host, two_allocs())
    plan = rec(host).plan(state(*two_allocs().allocs.values(), alloc("c")), PlanOptions())
    assert plan.has_changes and host.conntrack.asked == []


def test_flow_counts_are_no_part_of_the_saved_plans_work() -> None:
    host = FakeHost()
    converge(host, two_allocs())
    smaller = state(alloc("b", port(8081, 80), address="10.0.0.3"))
    before = rec(host).plan(smaller, PlanOptions())
    host.conntrack.entries = [tcp_flow("198.51.100.7", 40000, 8080, "10.0.0.2", 80)]
    after = rec(host).plan(smaller, PlanOptions())
    assert impacts(before) != impacts(after)  # the flows moved ...
    assert before.live_fingerprint == after.live_fingerprint  # ... the work did not
    assert Plan.from_json(json.loads(json.dumps(before.to_json()))).same_work(after)


def test_a_plan_saved_before_impact_existed_loads_and_is_the_same_work() -> None:
    host = FakeHost()
    converge(host, two_allocs())
    plan = rec(host).plan(state(alloc("b", port(8081, 80), address="10.0.0.3")),
                          PlanOptions())
    raw = plan.to_json()
    for c in raw["changes"]:
        del c["impact"]
    old = Plan.from_json(json.loads(json.dumps(raw)))
    assert all(c.impact == () for c in old.changes)
    assert old.same_work(plan)
    assert Impact.from_json({"type": "alloc", "name": "x"}) == Impact("alloc", "x", "")


# ------------------------------------------------------------------ --max-disruption


def test_max_disruption_refuses_before_any_op_and_allows_up_to_n() -> None:
    host = FakeHost()
    converge(host, two_allocs())
    host.log.clear()
    smaller = state(alloc("b", port(8081, 80), address="10.0.0.3"))
    with pytest.raises(DisruptionError) as err:
        rec(host).apply(smaller, PlanOptions(), max_disruption=1)
    assert str(err.value) == ("the plan disrupts 2 items (1 alloc, 1 port map), more than "
                              "--max-disruption 1: refused, nothing changed")
    assert host.log == [] and "a" in host.netns
    assert err.value.plan.impacted
    result = rec(host).apply(smaller, PlanOptions(), max_disruption=2)
    assert result.ok and "a" not in host.netns


def test_max_disruption_zero_lets_a_plan_without_impact_through() -> None:
    host = FakeHost()
    assert rec(host).apply(two_allocs(), PlanOptions(), max_disruption=0).ok
    assert refusal(Plan(), 0) is None


def test_max_disruption_is_an_option_of_plan_apply_and_watch_only() -> None:
    parser = build_parser()
    for command in ("plan", "apply", "watch"):
        assert parser.parse_args([command, "f", "--max-disruption", "3"]).max_disruption == 3
        assert parser.parse_args([command, "f"]).max_disruption is None
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["apply", "f", "--max-disruption", "-1"])
    assert exit_.value.code == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["verify", "f", "--max-disruption", "1"])


def test_watch_refuses_the_pass_and_says_why(tmp_path: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("reconciler.agent.loop.git_revision", lambda paths: None)
    monkeypatch.setattr("reconciler.agent.loop.host_lock", _no_lock)
    host = FakeHost()
    converge(host, two_allocs())
    host.log.clear()
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "a.yaml").write_text(
        "version: 1\nbridges: [{name: br0}]\n"
        "subnets: [{name: net, bridge: br0, cidr: 10.0.0.0/24}]\n"
        "allocs: [{id: b, subnet: net, address: 10.0.0.3, ports: [{host: 8081, to: 80}]}]\n")
    agent = Agent(WatchOptions(paths=(str(conf),), hostname="h", probe=None,
                               max_disruption=1),
                  reconciler_factory=lambda stop: Reconciler(
                      host, runner=host, stop=stop, sleep=lambda _s: None))  # type: ignore[arg-type]
    report = agent.run_pass(["startup"])
    assert report.result == "failed" and host.log == [] and "a" in host.netns
    assert report.error == ("the plan disrupts 2 items (1 alloc, 1 port map), more than "
                            "--max-disruption 1: refused, nothing changed")
    assert {"resource": "alloc/a", "error": "would be disrupted: deleted: loses connectivity"} \
        in report.errors
    assert agent.board.get("last_pass")["error"] == report.error


class _no_lock:  # noqa: N801 (stands in for the host_lock context manager)
    def __init__(self, _timeout: float) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: object) -> None:
        return None


def test_change_json_round_trips_its_impact() -> None:
    c = Change("alloc", "a", Action.DELETE, impact=(
        Impact("alloc", "a", "deleted: loses connectivity", ("10.0.0.2",), 4),))
    again = Change.from_json(json.loads(json.dumps(c.to_json())))
    assert again == c and again.impact[0].flows == 4


def test_a_gateway_taken_over_in_place_is_no_loss() -> None:
    """--adopt of a gateway someone else added: deleted and added again as ours by the same
    change, so the allocations behind it keep it."""
    host = FakeHost()
    converge(host, two_allocs())
    br = host.links["br0"]
    host.links["br0"] = dataclasses.replace(br, addresses=tuple(
        dataclasses.replace(a, owned=False) for a in br.addresses))
    plan = make_plan(two_allocs(), host.observe(two_allocs()),
                     PlanOptions(adopt=frozenset({"subnet/net"})))
    (sub,) = [c for c in plan.actionable if c.kind == "subnet"]
    assert {op.name for op in sub.ops} == {"addr.del", "addr.add"}
    assert plan.impacted == ()


def test_a_removed_network_names_its_containers_should_it_have_any() -> None:
    """The planner removes only networks without containers; were one listed with some (a
    planner change, a hand-made plan), its impact says so."""
    from reconciler.domain.ops import DockerRemove, encode  # noqa: PLC0415
    from reconciler.planner import impact  # noqa: PLC0415
    from reconciler.planner.context import PlanContext  # noqa: PLC0415

    gone = DockerNetwork(DockerNetworkName("old"))
    live = _docker_state(gone, LiveEndpoint("web", "172.30.0.2", "fd00::2"))
    change = Change("docker_network", "old", Action.DELETE,
                    ops=(encode(DockerRemove("n" * 64, "old")),))
    (c,) = impact.assess(PlanContext(DesiredState(), live, PlanOptions()), [change])
    assert [(i.type, i.name, i.effect, i.addresses) for i in c.impact] == [
        ("container", "web", "disconnected: docker network old is removed",
         ("172.30.0.2", "fd00::2"))]
    assert c.impact[0].match is not None  # scope "host": its flows are in this table


FINISHED = ("docker network kind: finished an interrupted replace (started by another run): "
            "4 container(s) attached (c1, c2, c3, c4)")


def test_a_refusal_after_finishing_a_journal_does_not_say_nothing_changed() -> None:
    """apply finishes interrupted changes before it plans (the plan reads the live state):
    a refusal after that must not claim the host is untouched."""
    host = FakeHost()
    converge(host, two_allocs())
    smaller = state(alloc("b", port(8081, 80), address="10.0.0.3"))
    r = rec(host)
    r.finish_journals = lambda: [FINISHED]  # type: ignore[method-assign]
    with pytest.raises(DisruptionError) as err:
        r.apply(smaller, PlanOptions(), max_disruption=1)
    assert str(err.value) == (
        "the plan disrupts 2 items (1 alloc, 1 port map), more than --max-disruption 1: "
        "refused; nothing else changed, but it finished an interrupted change first "
        f"({FINISHED})")
    assert err.value.plan.impacted
    saved = rec(host).plan(smaller, PlanOptions())
    converge(host, state(alloc("a", port(8080, 80), address="10.0.0.2")))
    with pytest.raises(StalePlanError) as stale:
        r.apply(smaller, PlanOptions(), saved=saved)
    assert str(stale.value).endswith(
        "; run plan again; nothing else changed, but it finished an interrupted change "
        f"first ({FINISHED})")
    # a journal left alone (one this version cannot read) changed nothing: not said
    r.finish_journals = lambda: ["journal: /x/journal-a.json: not a journal this "  # type: ignore[method-assign]
                                 "version can finish (format 9); move it away to go on"]
    with pytest.raises(DisruptionError, match=r"refused, nothing changed$"):
        r.apply(smaller, PlanOptions(), max_disruption=0)


def test_a_conflict_refusal_after_finishing_keeps_its_lines() -> None:
    from reconciler.engine.reconcile import after_finishing

    message = ("refusing to apply: 1 conflict(s) with objects the reconciler does not own; "
               "nothing changed\nbridge b: exists, not ours")
    assert after_finishing(message, ["alloc a: finished an interrupted adopt", "x"]) == (
        "refusing to apply: 1 conflict(s) with objects the reconciler does not own; nothing "
        "else changed, but it finished an interrupted change first (alloc a: finished an "
        "interrupted adopt; and 1 more)\nbridge b: exists, not ours")


def test_a_refusal_after_a_journal_that_could_not_be_finished_says_it_tried() -> None:
    from reconciler.engine.reconcile import after_finishing

    line = ("docker network kind: could not finish an interrupted replace yet: 0123 of that "
            "name belongs to another reconciler; kept for the next run")
    assert after_finishing("refused, nothing changed", [line]) == (
        f"refused; nothing else changed, but it tried to finish an interrupted change first "
        f"({line})")
