"""gc and apply leave the veth of a live namespace; a foreign rule naming an allocation is
no leftover of ours.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json

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
from reconciler.domain.ownership import alloc_veth_name
from reconciler.engine import reconcile
from reconciler.planner import PlanOptions, make_plan
from reconciler.planner.gc import gc_plan
from tests.support.fakehost import FakeHost

# ------------------------------------------------------------------ gc


def _converged() -> FakeHost:
    host = FakeHost()
    desired = DesiredState(bridges={BridgeName("br0"): Bridge(BridgeName("br0"))},
                           subnets={SubnetName("net"): Subnet(
                               SubnetName("net"), BridgeName("br0"),
                               ipaddress.IPv4Network("10.0.0.0/24"),
                               ipaddress.IPv4Address("10.0.0.1"), None, None, None)},
                           allocs={AllocId("a"): Alloc(AllocId("a"), SubnetName("net"), None,
                                                       None, (PortMap(8080, 80, "tcp", None),))})
    result = reconcile.Reconciler(host, runner=host,  # type: ignore[arg-type]
                                  sleep=lambda _s: None).apply(desired, PlanOptions())
    assert result.ok, result.failed
    return host


def test_gc_and_apply_leave_the_veth_of_a_live_namespace_whatever_its_marks_say() -> None:
    host = _converged()
    lo = host.netns["a"].links["lo"]
    host.netns["a"].links["lo"] = dataclasses.replace(lo, alias="a workload's own words")
    live = host.observe(DesiredState())
    assert "a" not in live.netns  # not read as ours any more ...
    veth = alloc_veth_name("a")
    for plan in (gc_plan(live), gc_plan(live, DesiredState()),
                 make_plan(DesiredState(), live, PlanOptions())):
        assert not [c for c in plan.changes if c.name == veth], plan.changes  # ... nor cut
        assert any(w.startswith(f"veth {veth}: its peer is in /run/netns/a") for w in
                   plan.warnings), plan.warnings
    del host.netns["a"]  # unmounted, held by a process: now it is an orphan
    plan = gc_plan(host.observe(DesiredState()))
    assert [c.address for c in plan.changes] == [f"veth/{veth}"]


def test_a_foreign_rule_naming_an_allocation_is_no_leftover_of_ours() -> None:
    host = _converged()
    host.fw[4].chains[("filter", "FORWARD")].append(
        "-m comment --comment reconciler:alloc=ghost -j ACCEPT")
    plan = gc_plan(host.observe(DesiredState()))
    assert not plan.has_changes and not plan.warnings, (plan.changes, plan.warnings)
    files = gc_plan(host.observe(DesiredState()), DesiredState())
    assert "ghost" not in json.dumps(files.to_json())

