"""Issue 25's lifetime defects, on pure logic and the fake host.

Their real-kernel twins are in ``tests/integration/test_lifetime_defects.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import socket
import threading
import time
from typing import Any

import pytest

from reconciler.agent.planview import sentinels
from reconciler.agent.safewatch import SafeWatch
from reconciler.agent.sources import DriftFilter, OverlapAlarm
from reconciler.cli import safe
from reconciler.domain.errors import PreconditionError
from reconciler.domain.live import (
    DockerAddressSpace,
    DockerNetworkUse,
    LiveAddress,
    LiveDocker,
    LiveDockerNetwork,
    LiveFlow,
    LiveLink,
    LiveRoute,
    LiveState,
)
from reconciler.domain.model import (
    Alloc,
    AllocId,
    Bridge,
    BridgeName,
    DesiredState,
    DockerNetwork,
    DockerNetworkName,
    PortMap,
    Subnet,
    SubnetName,
)
from reconciler.domain.ops import NetnsCreate, encode
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE, alloc_veth_name
from reconciler.domain.plan import Action, Change, Plan
from reconciler.domain.probes import VANTAGE_PEER
from reconciler.drivers import netns, nsfs
from reconciler.drivers.netlink import listen, parse, wire
from reconciler.drivers.netlink.wire import NlMsg
from reconciler.engine import lock, reconcile, safechange
from reconciler.planner import PlanOptions, addrspace, hostspace, make_plan
from reconciler.planner.checkpoint import take
from reconciler.planner.gc import gc_plan
from reconciler.planner.impact import ProbeSources, counts_as_flow

from .fakehost import FakeHost

# ------------------------------------------------------------------ the hidden namespaces

#: /proc/1/mountinfo of a host with two namespaces under /run/netns (and Docker's, elsewhere)
MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
46 27 254:0 /run/netns /run/netns rw,relatime shared:2 - ext4 /dev/vda rw
48 46 0:4 net:[4026532180] /run/netns/web-1 rw shared:4 - nsfs nsfs rw
49 46 0:4 net:[4026532384] /run/netns/dns rw shared:3 - nsfs nsfs rw
108 27 0:4 net:[4026532187] /run/docker/netns/3bf80fada064 rw - nsfs nsfs rw
""".splitlines()


def test_the_namespace_mounts_under_run_netns_are_read_from_mountinfo() -> None:
    assert netns.nsfs_mount_points(MOUNTINFO, "/run/netns") == {"web-1", "dns"}
    assert netns.nsfs_mount_points(["garbage", ""], "/run/netns") == set()


def _creating(name: str) -> Plan:
    return Plan((Change("alloc", name, Action.CREATE, "not present", (),
                        (encode(NetnsCreate(name, False, None)),)),))


def test_preflight_refuses_where_the_allocations_namespaces_are_hidden(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[list[str], str | None]] = []

    def hidden(names: object, *, marked: str | None = None) -> list[str]:
        asked.append((sorted(names), marked))  # type: ignore[call-overload]
        return ["web-1"]

    monkeypatch.setattr(netns, "private_mount_namespace_problem", lambda: None)
    monkeypatch.setattr(netns, "hidden_namespaces", hidden)
    monkeypatch.setattr(nsfs, "current_inode", lambda: 4026531840)
    with pytest.raises(PreconditionError, match=r"/run/netns/web-1 is a live network namespace"):
        reconcile.preflight(_creating("web-1"))
    assert asked == [(["web-1"], "managed-by=reconciler alloc-of=4026531840")]


# ------------------------------------------------------------------ every routing table


def _message(kind: int, header: bytes, *attrs: bytes) -> bytes:
    body = header + b"".join(attrs)
    return wire.HDR.pack(16 + len(body), kind, 0, 1, 0) + body


def _rule(family: int, table: int, *, action: int = wire.FR_ACT_TO_TBL, big: int | None = None,
          kind: int = wire.RTM_NEWRULE) -> bytes:
    attrs = (wire.u32_attr(wire.FRA_TABLE, big),) if big is not None else ()
    return _message(kind, wire.FIB_RULE_HDR.pack(family, 0, 0, 0, table, 0, 0, action, 0),
                    *attrs)


def _route(dst: str, table: int, oif: int = 6) -> NlMsg:
    net = ipaddress.ip_network(dst)
    family = socket.AF_INET if net.version == 4 else socket.AF_INET6
    return NlMsg.decode(_message(
        wire.RTM_NEWROUTE, wire.RTMSG.pack(family, net.prefixlen, 0, 0, min(table, 252), 3, 0,
                                           1, 0),
        wire.attr(wire.RTA_DST, net.network_address.packed), wire.u32_attr(wire.RTA_OIF, oif),
        wire.u32_attr(wire.RTA_TABLE, table)))


def test_a_rule_says_which_table_it_looks_up() -> None:
    def table(raw: bytes) -> tuple[int, int] | None:
        return parse.parse_rule_table(NlMsg.decode(raw))

    assert table(_rule(socket.AF_INET, 52)) == (socket.AF_INET, 52)  # Tailscale's 5270
    assert table(_rule(socket.AF_INET6, 0, big=51820)) == (socket.AF_INET6, 51820)  # wg-quick
    assert table(_rule(socket.AF_INET, 0, action=2)) is None  # goto
    assert table(_rule(socket.AF_INET, 0)) is None  # l3mdev: a VRF's own table


def test_routes_are_read_from_the_tables_the_rules_select_with_their_table() -> None:
    tables = {socket.AF_INET: frozenset({52, 254}), socket.AF_INET6: frozenset({254})}
    got = parse.parse_route(_route("10.232.0.0/16", 52), tables)
    assert got is not None and got.table == 52 and got.dst == "10.232.0.0/16"
    assert parse.parse_route(_route("10.233.0.0/16", 4242), tables) is None  # no rule
    assert parse.parse_route(_route("fd00:52::/64", 52), tables) is None  # an IPv4 rule only
    assert parse.parse_route(_route("10.232.0.0/16", 52)) is None  # main only by default


def test_a_route_of_another_table_is_a_conflict_naming_that_table() -> None:
    tun = LiveLink("tun0", 6, "", 1280, True, False)
    live = LiveState(links={"tun0": tun}, routes=(
        LiveRoute("10.232.0.0/16", None, False, oif=6, table=52),
        LiveRoute("10.9.0.0/16", None, False, type="blackhole", table=52),
        LiveRoute("10.232.9.0/24", None, False, oif=6)))
    whats = {o.what for o in hostspace.occupants(DesiredState(), live)}
    assert whats == {"route 10.232.0.0/16 on tun0 in table 52",
                     "blackhole route 10.9.0.0/16 in table 52", "route 10.232.9.0/24 on tun0"}


def test_rule_changes_wake_the_alarm_and_the_plan_view_not_a_pass() -> None:
    (ev,) = parse.parse_messages(_rule(socket.AF_INET, 52))
    assert ev.what == "rule" and not ev.deleted
    (gone,) = parse.parse_messages(_rule(socket.AF_INET, 52, kind=wire.RTM_DELRULE))
    assert gone.deleted
    assert not DriftFilter().relevant(ev)
    alarm = OverlapAlarm(lambda _found: None, threading.Event())
    assert alarm.hear(ev)
    assert sentinels._only_routes(_rule(socket.AF_INET, 52))
    assert listen.GROUPS & listen.RTMGRP_IPV4_RULE and listen.GROUPS & listen.RTMGRP_IPV6_RULE


def test_the_alarm_reads_the_routes_of_every_selected_table() -> None:
    class Reader:
        def dump_links(self) -> dict[str, LiveLink]:
            br = LiveLink("br0", 5, "bridge", 1500, True, True, addresses=(
                LiveAddress(ipaddress.ip_interface("10.66.0.1/24"), True),))
            return {"br0": br, "tailscale0": LiveLink("tailscale0", 6, "", 1280, True, False)}

        def dump_host_routes(self) -> tuple[LiveRoute, ...]:
            return (LiveRoute("10.66.0.0/25", None, False, oif=6, table=52),)

    alarm = OverlapAlarm(lambda _found: None, threading.Event())
    (found,) = alarm.check(Reader())  # type: ignore[arg-type]
    assert found.foreign == "route 10.66.0.0/25 on tailscale0 in table 52"


# ------------------------------------------------------------------ Docker in another namespace


def _subnet(name: str, cidr: str) -> Subnet:
    return Subnet(SubnetName(name), BridgeName("b0"), ipaddress.IPv4Network(cidr), None, None)


def _docker(name: str, subnet: str) -> DockerNetwork:
    return DockerNetwork(DockerNetworkName(name), subnet=ipaddress.IPv4Network(subnet))


SPACE = DockerAddressSpace(True, (
    DockerNetworkUse("bridge", "d" * 64, ("172.17.0.0/16",), "docker0"),
    DockerNetworkUse("ten", "e" * 64, ("10.240.77.0/24",), "br-eeeeeeeeeeee"),
    DockerNetworkUse("host", "f" * 64, (), "br-ffffffffffff", driver="host")))


def _sandbox(*links: LiveLink) -> LiveState:
    tun = LiveLink("tun0", 6, "", 1280, True, False)
    return LiveState(links={lk.name: lk for lk in (tun, *links)}, docker_space=SPACE,
                     routes=(LiveRoute("10.250.0.0/16", None, False, oif=6),))


def test_in_a_sandbox_docker_networks_and_the_routing_here_are_a_warning_apart() -> None:
    d = DesiredState(bridges={BridgeName("b0"): Bridge(BridgeName("b0"))},
                     subnets={SubnetName("cni"): _subnet("cni", "10.0.0.0/8")},
                     docker_networks={DockerNetworkName("ci"): _docker("ci", "10.250.3.0/24"),
                                      DockerNetworkName("dup"): _docker("dup", "10.240.77.0/25")})
    live = _sandbox()
    assert hostspace.docker_elsewhere(live)
    found = addrspace.check(d, live)
    # the sandbox's own route is still a conflict, and so are two networks of one daemon
    assert found.conflicts == {
        "subnet/cni": "cidr 10.0.0.0/8 overlaps route 10.250.0.0/16 on tun0",
        "docker_network/dup": "subnet 10.240.77.0/25 overlaps docker network ten "
                              "(10.240.77.0/24 on br-eeeeeeeeeeee)"}
    apart = [w for w in found.warnings if "no conflict here" in w]
    assert len(apart) == 2, found.warnings
    assert apart[0].startswith("subnet 'cni': cidr 10.0.0.0/8 overlaps docker network ten "
                               "(10.240.77.0/24 on br-eeeeeeeeeeee):"), apart
    assert apart[1].startswith("docker network 'ci': subnet 10.250.3.0/24 overlaps route "
                               "10.250.0.0/16 on tun0"), apart
    # the daemon's bridges are links here (the host, or a daemon inside the sandbox): conflicts
    here = _sandbox(LiveLink("docker0", 9, "bridge", 1500, True, False))
    assert not hostspace.docker_elsewhere(here)
    assert set(addrspace.check(d, here).conflicts) == {"subnet/cni", "docker_network/ci",
                                                        "docker_network/dup"}


def test_the_alarm_leaves_owned_docker_networks_of_another_namespace_out() -> None:
    docker = LiveDocker(True, networks=(LiveDockerNetwork(
        "e" * 64, "ten", "bridge", {DOCKER_LABEL: DOCKER_LABEL_VALUE}, {}, False, False,
        ("10.240.77.0/24",), 0),))
    sandbox = dataclasses.replace(_sandbox(), docker=docker)
    assert hostspace.owned_docker_prefixes(sandbox) == ([], set())
    here = dataclasses.replace(sandbox, links={**sandbox.links, "docker0": LiveLink(
        "docker0", 9, "bridge", 1500, True, False)})
    prefixes, bridges = hostspace.owned_docker_prefixes(here)
    assert [str(p) for p, _w, _l in prefixes] == ["10.240.77.0/24"]
    assert bridges == {"br-eeeeeeeeeeee"}


# ------------------------------------------------------------------ a killed reverter

SCOPE = "netns/x"


@pytest.fixture
def state(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A state and a lock directory of the test's own; what spawning a reverter would start
    (the tokens), never a process."""
    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(lock, "LOCK_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(safechange, "docker_scope", lambda: SCOPE)
    monkeypatch.setenv(safechange.BOOT_ID_ENV, "b")
    spawned: list[str] = []

    def spawn(p: safechange.Pending) -> int:
        spawned.append(p.token)
        return 4242

    monkeypatch.setattr(safechange, "spawn_reverter", spawn)
    monkeypatch.setattr(safechange, "reverter_alive", lambda p: p.reverter_pid == 4242)
    return spawned


def _record(*, applied: bool = True, pid: int | None = 999, overdue: bool = False) -> None:
    p = safechange.Pending(SCOPE, "t", time.time() + (-1 if overdue else 60), time.time(), "b",
                           take(LiveState(host_id="1")), reverter_pid=pid, applied=applied)
    safechange._write(safechange.scope_dir(SCOPE), p)


def test_a_command_refused_by_a_pending_change_starts_its_missing_reverter(
        state: list[str]) -> None:
    _record(pid=999)  # its reverter was killed
    with pytest.raises(PreconditionError, match="pending until"):
        safe.guard(reconcile.Reconciler.__new__(reconcile.Reconciler))
    now = safechange.pending(SCOPE)
    assert state == ["t"] and now is not None and now.reverter_pid == 4242
    with pytest.raises(PreconditionError, match="pending until"):
        safe.guard(reconcile.Reconciler.__new__(reconcile.Reconciler))
    assert state == ["t"]  # a live one is left alone


def test_a_record_whose_change_never_started_is_dropped_not_refused(state: list[str]) -> None:
    _record(applied=False, pid=None)  # killed between the record and the spawn
    safe.guard(reconcile.Reconciler.__new__(reconcile.Reconciler))
    assert safechange.pending(SCOPE) is None and state == []


def test_plan_starts_a_missing_reverter_when_the_lock_is_free(state: list[str],
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    _record(applied=False, pid=None)
    safe.tend()  # a change that never started is the next guard's to drop, not plan's
    assert state == [] and safechange.pending(SCOPE) is not None
    _record(pid=999)
    with lock.host_lock(1):  # someone is changing the host: not now
        safe.tend()
    assert state == []
    safe.tend()
    now = safechange.pending(SCOPE)
    assert state == ["t"] and now is not None and now.reverter_pid == 4242


class _Gauge:
    def set(self, _v: float) -> None:
        pass

    def inc(self, _v: float = 1.0) -> None:
        pass


class _Metrics:
    pending_change = reverts = _Gauge()


class _Board:
    def update(self, **_fields: object) -> None:
        pass


def test_the_agent_starts_a_missing_reverter_and_drops_a_change_that_never_started(
        state: list[str]) -> None:
    watch = SafeWatch(None, _Board(), _Metrics(), None, None)
    _record(pid=999)
    held = watch.gate(None, None, "rev", contextlib.nullcontext)  # type: ignore[arg-type]
    assert held is not None and "pending until" in held
    now = safechange.pending(SCOPE)
    assert state == ["t"] and now is not None and now.reverter_pid == 4242
    _record(applied=False, pid=None)
    assert watch.gate(None, None, "rev", contextlib.nullcontext) is None  # type: ignore[arg-type]
    assert safechange.pending(SCOPE) is None


# ------------------------------------------------------------------ impact's flows


def _flow(src: str, sport: int, reply_src: str = "10.0.0.2") -> LiveFlow:
    return LiveFlow(4, "tcp", src, sport, "192.0.2.1", 8080, reply_src, 80, True)


def test_a_clients_flow_from_the_probes_port_range_counts_a_probes_does_not() -> None:
    host = LiveState(links={
        "eth0": LiveLink("eth0", 2, "", 1500, True, False, addresses=(
            LiveAddress(ipaddress.ip_interface("192.0.2.1/24"), False),)),
        "lo": LiveLink("lo", 1, "", 65536, True, False, addresses=(
            LiveAddress(ipaddress.ip_interface("127.0.0.1/8"), False),))})
    probes = ProbeSources.of(host)
    assert counts_as_flow(_flow("198.51.100.7", 61234), probes)  # a client's ephemeral port
    assert counts_as_flow(_flow("192.0.2.1", 40000), probes)  # the host's own, not a probe's
    for probe in (_flow("192.0.2.1", 61000), _flow("127.0.0.5", 61999),  # host, loopback
                  _flow(VANTAGE_PEER, 61500),  # the external vantage
                  _flow("10.0.0.2", 61500)):  # hairpin: answered by where it started
        assert not counts_as_flow(probe, probes), probe


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
