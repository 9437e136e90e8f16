"""The pure Docker-network planner on in-memory live states (no daemon)."""

from __future__ import annotations

import dataclasses
import ipaddress
import subprocess
import sys
from typing import Any

import pytest

from reconciler.domain.docker import (
    IPV6_FALLBACK_LABEL,
    OPT_MASQUERADE,
    OPT_MTU,
    SCOPE_LABEL,
    spec_from_json,
    spec_to_json,
    ula_subnet,
)
from reconciler.domain.live import LiveDocker, LiveDockerNetwork, LiveState
from reconciler.domain.model import DesiredState, DockerNetwork, DockerNetworkName
from reconciler.domain.ops import DockerDedupe, DockerEnsure, DockerRemove, DockerReplace, decode
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.domain.plan import Action, Change, Plan
from reconciler.planner import PlanOptions, make_plan
from reconciler.planner.context import PlanContext
from reconciler.planner.docker import plan_docker_networks
from reconciler.ui.render import render_text

OURS = {DOCKER_LABEL: DOCKER_LABEL_VALUE, SCOPE_LABEL: "host"}


def spec(name: str = "kind", **kw: Any) -> DockerNetwork:
    return DockerNetwork(name=DockerNetworkName(name), **kw)


def net(name: str = "kind", id: str = "a" * 64, **kw: Any) -> LiveDockerNetwork:
    base: dict[str, Any] = dict(
        id=id, name=name, driver="bridge", labels=dict(OURS),
        options={OPT_MASQUERADE: "true", OPT_MTU: "1500"}, enable_ipv6=False,
        internal=False, subnets=("172.18.0.0/16",), containers=0)
    base.update(kw)
    return LiveDockerNetwork(**base)


def desired(*specs: DockerNetwork) -> DesiredState:
    return DesiredState(docker_networks={s.name: s for s in specs})


def docker(*networks: LiveDockerNetwork, default_mtu: int | None = 1500) -> LiveDocker:
    return LiveDocker(available=True, default_mtu=default_mtu, networks=networks)


def plan(want: DesiredState, live: LiveDocker | None, **opts: Any) -> tuple[list[Change],
                                                                           PlanContext]:
    ctx = PlanContext(want, LiveState(docker=live), PlanOptions(**opts))
    return plan_docker_networks(ctx), ctx


def one(changes: list[Change]) -> Change:
    assert len(changes) == 1, changes
    return changes[0]


# --------------------------------------------------------------------------
# the daemon is down, or Docker is not involved

def test_daemon_down_with_declared_networks_is_one_error_and_no_changes() -> None:
    down = LiveDocker(available=False, error="docker daemon unreachable at "
                                             "unix:///nonexistent.sock: socket not found")
    changes, ctx = plan(desired(spec()), down)
    assert changes == []
    assert ctx.errors == ["docker: daemon unreachable at unix:///nonexistent.sock: socket not "
                          "found — docker networks not planned"]


def test_listing_failure_is_one_error() -> None:
    down = LiveDocker(available=False, error="docker: listing networks failed: boom")
    _, ctx = plan(desired(spec()), down)
    assert ctx.errors == ["docker: listing networks failed: boom — docker networks not planned"]


def test_nothing_docker_and_not_observed_plans_nothing_quietly() -> None:
    changes, ctx = plan(desired(), None)
    assert changes == [] and ctx.errors == [] and ctx.warnings == []


def test_declared_but_not_observed_is_an_error() -> None:
    changes, ctx = plan(desired(spec()), None)
    assert changes == [] and len(ctx.errors) == 1 and "not planned" in ctx.errors[0]


def test_host_resources_still_plan_when_docker_is_down() -> None:
    from reconciler.domain.model import Bridge, BridgeName

    want = DesiredState(bridges={BridgeName("br0"): Bridge(BridgeName("br0"))},
                        docker_networks={DockerNetworkName("kind"): spec()})
    p = make_plan(want, LiveState(docker=LiveDocker(available=False, error="docker daemon "
                                                    "unreachable at unix:///x: socket not found")))
    assert [c.address for c in p.actionable] == ["bridge/br0"]
    assert p.errors == ("docker: daemon unreachable at unix:///x: socket not found — docker "
                        "networks not planned",)
    assert "error: docker: daemon unreachable" in render_text(p)


# --------------------------------------------------------------------------
# one declared network

def test_missing_network_is_created_with_the_spec_in_the_op() -> None:
    s = spec(ipv6=True, labels=(("team", "infra"),))
    c = one(plan(desired(s), docker())[0])
    assert c.action is Action.CREATE and c.address == "docker_network/kind"
    (op,) = c.ops
    assert op.name == "docker.ensure"
    assert op.args == {"spec": spec_to_json(s), "default_mtu": 1500, "scope": "host"}
    assert spec_from_json(op.args["spec"]) == s
    shown = {a.field: a.after for a in c.attrs}
    assert shown["subnet6"] == "fc00:f853:ccd:e793::/64 (derived)"
    assert shown["mtu"] == "1500 (Docker's default bridge)"
    assert shown["labels.team"] == "infra"


def test_spec_json_roundtrip_with_everything() -> None:
    s = spec("x", ipv6=True, subnet=ipaddress.IPv4Network("172.30.0.0/16"),
             subnet6=ipaddress.IPv6Network("fd00:1::/64"), mtu=1400, masquerade=False,
             internal=True, labels=(("a", "1"), ("b", "2")))
    assert spec_from_json(spec_to_json(s)) == s


def test_live_ours_without_diff_is_noop() -> None:
    live = net(enable_ipv6=True, subnets=("172.18.0.0/16", str(ula_subnet("kind", 3))))
    c = one(plan(desired(spec(ipv6=True)), docker(live))[0])
    assert c.action is Action.NOOP and not c.ops


def test_a_declared_network_of_another_scope_is_a_conflict_never_replaced() -> None:
    """Networks are global to the daemon: a sandbox's declared name must not take the host's
    (or another sandbox's) network, whatever the difference (here: none, and an MTU)."""
    for labels in ({DOCKER_LABEL: DOCKER_LABEL_VALUE, SCOPE_LABEL: "netns/other"},
                   {DOCKER_LABEL: DOCKER_LABEL_VALUE}):  # before scope labels: the host's
        for s in (spec(), spec(mtu=1400)):
            c = one(plan(desired(s), dataclasses.replace(docker(net(labels=labels)),
                                                         scope="netns/me"))[0])
            assert c.action is Action.CONFLICT and not c.ops, c
            assert "another reconciler" in c.reason and "'netns/me'" in c.reason
    # one of ours beside another scope's of the same name: not deduped either
    mine = net(id="1" * 64, labels={**OURS, SCOPE_LABEL: "netns/me"})
    theirs = net(id="2" * 64, labels={**OURS, SCOPE_LABEL: "host"})
    c = one(plan(desired(spec()), dataclasses.replace(docker(mine, theirs), scope="netns/me"))[0])
    assert c.action is Action.CONFLICT and "'host'" in c.reason and not c.ops


def test_difference_is_a_replace_with_the_reason() -> None:
    c = one(plan(desired(spec(mtu=1400)), docker(net()))[0])
    assert c.action is Action.REPLACE
    assert "mtu differ" in c.reason and "in place" in c.reason
    assert [(a.field, a.before, a.after) for a in c.attrs] == [("mtu", "1500", "1400")]
    (op,) = c.ops
    assert op.name == "docker.replace"
    assert op.args["id"] == "a" * 64 and op.args["reconnect"] is False
    assert op.args["adopt"] is False and op.args["default_mtu"] == 1500
    assert "-/+ docker_network kind: mtu differ" in render_text(Plan((c,)))


def test_replace_with_containers_is_refused_without_force() -> None:
    c = one(plan(desired(spec(mtu=1400)), docker(net(containers=2)))[0])
    assert c.action is Action.CONFLICT and not c.ops
    assert c.reason.startswith("replace refused: 2 containers attached")
    assert "--force-replace" in c.reason and "replace: allowed" in c.reason
    assert c.attrs[0].field == "mtu"


def test_replace_with_containers_and_force_reconnects() -> None:
    changes, ctx = plan(desired(spec(mtu=1400)), docker(net(containers=1)), force_replace=True)
    c = one(changes)
    assert c.action is Action.REPLACE and "1 container will be reconnected" in c.reason
    assert c.ops[0].args["reconnect"] is True


def test_containers_without_a_difference_are_fine() -> None:
    assert one(plan(desired(spec()), docker(net(containers=5)))[0]).action is Action.NOOP


def test_declared_mtu_uses_the_observed_default_consistently() -> None:
    # no MTU option on the live network, default 9000 -> equal; the create op carries it
    live = net(options={OPT_MASQUERADE: "true"})
    assert one(plan(desired(spec()), docker(live, default_mtu=9000))[0]).action is Action.NOOP
    c = one(plan(desired(spec()), docker(default_mtu=9000))[0])
    assert c.ops[0].args["default_mtu"] == 9000


def test_ipv6_fallback_network_is_no_diff_but_a_warning() -> None:
    live = net(labels={**OURS, IPV6_FALLBACK_LABEL: "true"})
    changes, ctx = plan(desired(spec(ipv6=True)), docker(live))
    assert one(changes).action is Action.NOOP
    assert len(ctx.warnings) == 1 and "IPv4-only" in ctx.warnings[0]


# --------------------------------------------------------------------------
# foreign networks and duplicates

def test_foreign_network_is_a_conflict_with_adopt_hint() -> None:
    changes, ctx = plan(desired(spec()), docker(net(labels={})))
    c = one(changes)
    assert c.action is Action.CONFLICT and "--adopt docker_network/kind" in c.reason
    assert "docker_network/kind" in ctx.blocked


def test_adopt_replaces_it_with_our_label() -> None:
    c = one(plan(desired(spec()), docker(net(labels={"x": "y"})),
                 adopt=frozenset({"docker_network/kind"}))[0])
    assert c.action is Action.REPLACE and "adopt" in c.reason
    assert c.attrs[0].field == "owner"
    assert c.ops[0].args["adopt"] is True


def test_adopt_with_containers_still_needs_force() -> None:
    c = one(plan(desired(spec()), docker(net(labels={}, containers=1)),
                 adopt=frozenset({"docker_network/kind"}))[0])
    assert c.action is Action.CONFLICT and "--force-replace" in c.reason


def test_duplicates_of_ours_are_deduped_keeping_most_containers() -> None:
    nets = (net(id="1" * 64), net(id="2" * 64, containers=2), net(id="0" * 64))
    c = one(plan(desired(spec()), docker(*nets))[0])
    assert c.action is Action.UPDATE
    assert c.reason.startswith("2 duplicates, keeping 222222222222")
    assert [o.name for o in c.ops] == ["docker.dedupe"]
    assert "~ docker_network kind: 2 duplicates" in render_text(Plan((c,)))


def test_duplicates_tie_goes_to_lowest_id() -> None:
    c = one(plan(desired(spec()), docker(net(id="b" * 64), net(id="a" * 64)))[0])
    assert c.reason.startswith("1 duplicate, keeping aaaaaaaaaaaa")


def test_duplicates_and_a_difference_dedupe_then_replace_the_kept_one() -> None:
    nets = (net(id="1" * 64), net(id="2" * 64))
    c = one(plan(desired(spec(mtu=1400)), docker(*nets))[0])
    assert c.action is Action.REPLACE
    assert [o.name for o in c.ops] == ["docker.dedupe", "docker.replace"]
    assert c.ops[1].args["id"] == "1" * 64


def test_duplicates_with_a_foreign_one_are_a_conflict() -> None:
    nets = (net(id="1" * 64), net(id="2" * 64, labels={}))
    c = one(plan(desired(spec()), docker(*nets))[0])
    assert c.action is Action.CONFLICT and "not ours" in c.reason and not c.ops


def test_duplicates_to_remove_with_containers_are_a_conflict() -> None:
    nets = (net(id="1" * 64, containers=3), net(id="2" * 64, containers=1))
    c = one(plan(desired(spec()), docker(*nets))[0])
    assert c.action is Action.CONFLICT and "222222222222 (1)" in c.reason


# --------------------------------------------------------------------------
# pruning

def test_prune_removes_only_ours_of_our_scope() -> None:
    nets = (
        net("old", id="1" * 64),                                            # ours: removed
        net("old", id="2" * 64),                                            # its duplicate too
        net("other-scope", labels={**OURS, SCOPE_LABEL: "netns/x"}),        # a sandbox's
        net("foreign", labels={}),
        net("bridge", labels=dict(OURS)),                                   # Docker's own
    )
    changes, _ = plan(desired(), docker(*nets))
    c = one(changes)
    assert (c.address, c.action) == ("docker_network/old", Action.DELETE)
    assert [(o.name, o.args["id"]) for o in c.ops] == [("docker.remove", "1" * 64),
                                                       ("docker.remove", "2" * 64)]


def test_an_owned_network_without_the_scope_label_is_the_hosts_to_prune() -> None:
    """Made before networks carried the label (``network_scope``): the host's reconciler
    prunes it, a sandbox's never does (as its conflict check already said)."""
    unscoped = net("unscoped", labels={DOCKER_LABEL: DOCKER_LABEL_VALUE})
    c = one(plan(desired(), docker(unscoped))[0])
    assert (c.address, c.action) == ("docker_network/unscoped", Action.DELETE)
    sandbox = dataclasses.replace(docker(unscoped), scope="netns/x")
    assert plan(desired(), sandbox)[0] == []


def test_no_prune_keeps_them() -> None:
    assert plan(desired(), docker(net("old")), prune=False)[0] == []


def test_prune_scope_follows_the_observed_scope() -> None:
    live = dataclasses.replace(docker(net("old", labels={**OURS, SCOPE_LABEL: "netns/x"})),
                               scope="netns/x")
    assert one(plan(desired(), live)[0]).action is Action.DELETE


def test_prune_with_containers_attached_is_postponed_with_a_warning() -> None:
    # ours, so not a conflict: it must not block destroy or host changes
    changes, ctx = plan(desired(), docker(net("old", containers=1)))
    assert changes == []
    assert any("1 container is attached" in w and "not removed yet" in w for w in ctx.warnings)


# --------------------------------------------------------------------------
# the whole plan

def test_fingerprint_covers_docker_networks() -> None:
    want = desired(spec())
    a = make_plan(want, LiveState(docker=docker(net())))
    b = make_plan(want, LiveState(docker=docker(net(containers=1))))
    assert not a.has_changes and not b.has_changes
    assert a.live_fingerprint != b.live_fingerprint


def test_deletes_come_before_creates() -> None:
    p = make_plan(desired(spec("new")), LiveState(docker=docker(net("old"))))
    assert [(c.name, c.action) for c in p.actionable] == [("old", Action.DELETE),
                                                         ("new", Action.CREATE)]


def test_plan_roundtrips_through_json() -> None:
    p = make_plan(desired(spec(ipv6=True, mtu=1400)), LiveState(docker=docker(net())))
    assert Plan.from_json(p.to_json()).same_work(p)


class FakeDocker:
    """Interprets the planner's docker ops on in-memory networks (like the driver would)."""

    def __init__(self, *networks: LiveDockerNetwork) -> None:
        self.nets = list(networks)
        self.n = 100

    def live(self) -> LiveDocker:
        return docker(*sorted(self.nets, key=lambda x: x.name))

    def _create(self, op: DockerEnsure | DockerReplace) -> None:
        s = spec_from_json(op.spec)
        self.n += 1
        opts = {OPT_MASQUERADE: "true" if s.masquerade else "false"}
        mtu = s.mtu or op.default_mtu
        if mtu:
            opts[OPT_MTU] = str(mtu)
        want6 = s.ipv6 or s.subnet6 is not None
        v6 = str(s.subnet6 or ula_subnet(s.name, 0)) if want6 else None
        self.nets.append(net(s.name, id=f"{self.n:064d}", options=opts,
                             labels={**dict(s.labels), **OURS, SCOPE_LABEL: op.scope},
                             enable_ipv6=want6, internal=s.internal,
                             subnets=tuple(x for x in (str(s.subnet or "172.30.0.0/16"), v6)
                                           if x)))

    def run(self, c: Change) -> None:
        for wire in c.ops:
            match decode(wire):
                case DockerEnsure() as op:
                    self._create(op)
                case DockerReplace() as op:
                    self.nets = [x for x in self.nets if x.id != op.id]
                    self._create(op)
                case DockerDedupe() as op:
                    same = sorted((x for x in self.nets if x.name == op.name),
                                  key=lambda x: (-x.containers, x.id))
                    self.nets = [x for x in self.nets if x not in same[1:]]
                case DockerRemove() as op:
                    self.nets = [x for x in self.nets if x.id != op.id]
                case op:
                    raise AssertionError(op)


@pytest.mark.parametrize("specs", [
    [spec(ipv6=True)],
    [spec(mtu=1400, masquerade=False, internal=True, labels=(("t", "x"),))],
    [spec("a", subnet=ipaddress.IPv4Network("10.1.0.0/16"),
          subnet6=ipaddress.IPv6Network("fd00:9::/64")), spec("b")],
])
def test_apply_then_plan_is_empty(specs: list[DockerNetwork]) -> None:
    host = FakeDocker(net("kind", id="9" * 64), net("kind", id="8" * 64), net("gone"))
    want = desired(*specs)
    p = make_plan(want, LiveState(docker=host.live()), PlanOptions(force_replace=True))
    assert p.has_changes and not p.conflicts
    for c in p.actionable:
        host.run(c)
    again = make_plan(want, LiveState(docker=host.live()))
    assert not again.has_changes and not again.conflicts, render_text(again)


def test_planner_does_not_import_the_docker_sdk() -> None:
    code = ("import sys, reconciler.planner, reconciler.planner.docker; "
            "print('docker' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


# --------------------------------------------------------------------------
# the ops (HostOps) against a fake driver

class FakeDriver:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def ensure(self, s: DockerNetwork, default_mtu: int | None) -> Any:
        from reconciler.drivers.docker.results import EnsureResult

        self.calls.append(("ensure", s, default_mtu))
        return EnsureResult(s.name, "1" * 64, True, ipv6_fallback=True, warnings=(
            f"docker network {s.name}: the Docker daemon cannot set up IPv6 (x); "
            "created it IPv4-only",))

    def replace(self, s: DockerNetwork, live: LiveDockerNetwork, default_mtu: int | None,
                reconnect: bool, *, adopt: bool = False, steps: Any = None) -> Any:
        from reconciler.drivers.docker.results import EnsureResult

        self.calls.append(("replace", s, live.id, live.name, default_mtu, reconnect, adopt))
        return EnsureResult(s.name, "2" * 64, True, reconnected=("c1",))

    def remove(self, ref: str) -> bool:
        self.calls.append(("remove", ref))
        return False


def _ops(drv: FakeDriver) -> Any:
    from reconciler.engine.handles import HostHandles
    from reconciler.engine.hostops import HostOps

    return HostOps(HostHandles(netlink=object(), docker=drv))  # type: ignore[arg-type]


def test_ensure_op_adds_the_scope_label_and_logs_driver_warnings(
        caplog: pytest.LogCaptureFixture) -> None:
    drv = FakeDriver()
    s = spec(ipv6=True, labels=(("team", "infra"),))
    c = one(plan(desired(s), dataclasses.replace(docker(), scope="netns/x"))[0])
    with caplog.at_level("WARNING"):
        _ops(drv).run(c.ops[0])
    (_, created, default_mtu), = drv.calls
    assert default_mtu == 1500
    assert dict(created.labels) == {"team": "infra", SCOPE_LABEL: "netns/x"}
    assert [r.getMessage() for r in caplog.records] == [
        "docker network kind: the Docker daemon cannot set up IPv6 (x); created it IPv4-only"]


def test_replace_and_remove_ops_reach_the_driver() -> None:
    drv = FakeDriver()
    c = one(plan(desired(spec(mtu=1400)), docker(net(containers=2)), force_replace=True)[0])
    ops = _ops(drv)
    ops.run(c.ops[0])
    assert drv.calls[0][2:] == ("a" * 64, "kind", 1500, True, False)
    ops.run(one(plan(desired(), docker(net("old")))[0]).ops[0])
    assert drv.calls[1] == ("remove", "a" * 64)


def test_malformed_op_is_one_clear_error_and_reaches_no_driver() -> None:
    from reconciler.domain.errors import ReconcilerError
    from reconciler.domain.plan import Op

    drv = FakeDriver()
    with pytest.raises(ReconcilerError, match=r"docker.ensure: malformed arguments \(KeyError"):
        _ops(drv).run(Op("docker.ensure", {"spec": {"mtu": 1}, "default_mtu": None,
                                           "scope": "host"}))
    with pytest.raises(ReconcilerError, match="docker.ensure: missing argument 'default_mtu'"):
        _ops(drv).run(Op("docker.ensure", {"spec": {"name": "kind"}}))
    assert drv.calls == []


def test_daemon_down_with_nothing_declared_is_a_warning_not_an_error():
    from reconciler.domain.live import LiveDocker, LiveState
    from reconciler.domain.model import DesiredState
    from reconciler.planner import PlanOptions, make_plan

    live = LiveState(docker=LiveDocker(available=False,
                                       error="docker daemon unreachable at unix:///x: refused"))
    plan = make_plan(DesiredState(), live, PlanOptions())
    assert plan.errors == ()
    assert plan.warnings == ("docker: daemon unreachable at unix:///x: refused — owned docker "
                             "networks not checked for pruning",)
