"""Partial progress (SPEC §11): what is blocked, what depends on it, and that the rest runs."""

from __future__ import annotations

import dataclasses

from reconciler.domain.errors import DriverError
from reconciler.domain.model import DesiredState
from reconciler.domain.plan import Action, Blocked, Change, Op, Plan
from reconciler.engine.executor import Executor
from reconciler.engine.reconcile import Reconciler
from reconciler.planner import PlanOptions
from reconciler.planner.blocking import hold_back, needs, with_needs
from tests.support.fakehost import FakeHost
from tests.support.planning import alloc, bridge, plan, state, subnet


def two_bridges(*allocs_: str) -> DesiredState:
    """Bridge br0 (subnet net, allocation a) and bridge br1 (subnet net1, allocation b)."""
    one = state(alloc("a"))
    b1, s1 = bridge("br1"), subnet("net1", "br1", "10.1.0.0/24")
    return dataclasses.replace(
        one, bridges={**one.bridges, b1.name: b1}, subnets={**one.subnets, s1.name: s1},
        allocs={**one.allocs, **{a.id: a for a in (alloc(x, sub="net1") for x in allocs_)}})


def test_creates_follow_bridge_subnet_alloc_and_per_bridge_changes_their_bridge() -> None:
    d = state(alloc("a"))
    assert needs(d, Change("subnet", "net", Action.CREATE)) == ("bridge/br0",)
    assert needs(d, Change("alloc", "a", Action.CREATE)) == ("subnet/net", "bridge/br0")
    assert needs(d, Change("sysctl", "net/ipv4/conf/br0/route_localnet", Action.UPDATE)) == (
        "bridge/br0",)
    assert needs(d, Change("neighbour", "br0/10.0.0.7", Action.DELETE)) == ()
    assert needs(d, Change("sysctl", "net/ipv4/ip_forward", Action.UPDATE)) == ()
    assert needs(d, Change("docker_network", "kind", Action.REPLACE)) == ()
    assert needs(d, Change("bridge", "br0", Action.UPDATE)) == ()


def test_deletions_wait_the_other_way_round() -> None:
    gone = [Change("alloc", "x", Action.DELETE), Change("subnet", "old", Action.DELETE),
            Change("bridge", "brx", Action.DELETE)]
    d = DesiredState()
    assert needs(d, gone[0], gone) == ()  # an allocation's deletion waits for nothing
    assert needs(d, gone[1], gone) == ("alloc/x",)
    assert needs(d, gone[2], gone) == ("alloc/x", "subnet/old")


def test_a_foreign_bridge_blocks_its_subnet_and_allocs_and_nothing_else() -> None:
    host = FakeHost()
    host.add_link("br1", "bridge")
    p = plan(host, two_bridges("b"))
    blocked = {b.address: b for b in p.blocked}
    assert set(blocked) == {"bridge/br1", "subnet/net1", "alloc/b"}
    assert "--adopt bridge/br1" in blocked["bridge/br1"].reason
    assert blocked["subnet/net1"] == Blocked("subnet", "net1", "blocked by bridge br1",
                                             "bridge/br1")
    assert blocked["alloc/b"].by == "subnet/net1"
    made = {c.address for c in p.actionable}
    assert {"bridge/br0", "subnet/net", "alloc/a"} <= made
    assert not made & set(blocked)
    # the JSON carries it, and reads back
    assert Plan.from_json(p.to_json()).blocked == p.blocked


def test_apply_runs_everything_not_blocked_and_touches_nothing_blocked() -> None:
    host = FakeHost()
    host.add_link("br1", "bridge")
    result = Reconciler(host, runner=host, sleep=lambda _s: None).apply(  # type: ignore[arg-type]
        two_bridges("b"), PlanOptions())
    assert not result.ok and {b.address for b in result.blocked} == {
        "bridge/br1", "subnet/net1", "alloc/b"}
    assert result.residual is not None and not result.residual.has_changes
    assert "a" in host.netns and "b" not in host.netns
    assert not any("br1" in repr(op) or "'b'" in repr(op) for op in host.log), host.log


def test_a_blocked_subnet_keeps_its_live_firewall_rules_as_they_are() -> None:
    host = FakeHost()
    d = two_bridges("b")
    Reconciler(host, runner=host, sleep=lambda _s: None).apply(d, PlanOptions())  # type: ignore[arg-type]
    rules = {f: dict(host.fw[f].chains) for f in (4, 6)}
    # the bridge is taken by someone else: nothing of net1 or b is added or removed
    host.links["br1"] = dataclasses.replace(host.links["br1"], owned=False)
    p = plan(host, d)
    assert "bridge/br1" in {b.address for b in p.blocked}
    assert not any(c.kind == "firewall" for c in p.actionable), p.actionable
    assert {f: dict(host.fw[f].chains) for f in (4, 6)} == rules


class FailOn:
    """Runs ops on a fake host, failing the ones of one resource."""

    def __init__(self, host: FakeHost, name: str) -> None:
        self.host, self.name = host, name

    def run(self, op: Op) -> None:
        if self.name in repr(op.args):
            raise DriverError(f"{op.name}: EPERM")
        self.host.run(op)


def test_a_failed_op_blocks_what_needs_it_and_independent_changes_still_run() -> None:
    host = FakeHost()
    d = two_bridges("b")
    p = plan(host, d)
    outcomes = {o.change.address: o for o in Executor(FailOn(host, "br1")).execute(p)}
    assert outcomes["bridge/br1"].status == "failed"
    assert outcomes["subnet/net1"].status == "skipped"
    assert outcomes["subnet/net1"].error == "blocked by bridge br1"
    assert outcomes["alloc/b"].status == "skipped"
    assert all(outcomes[a].status == "applied" for a in ("bridge/br0", "subnet/net", "alloc/a"))


def test_held_resources_and_their_dependants_leave_the_plan() -> None:
    host = FakeHost()
    d = two_bridges("b")
    p = with_needs(d, plan(host, d).changes)
    held = hold_back(Plan(tuple(p)), {"subnet/net1": "retried in 4.0s"})
    assert {c.address for c in held.actionable} >= {"bridge/br1", "alloc/a"}
    assert not {"subnet/net1", "alloc/b"} & {c.address for c in held.actionable}
    assert [(b.address, b.reason, b.by) for b in held.blocked] == [
        ("subnet/net1", "retried in 4.0s", None),
        ("alloc/b", "blocked by subnet net1", "subnet/net1")]
