"""What a restore may touch (planner/checkpoint, drivers/docker/snapshot): Docker networks
only when their settings changed, never a container the checkpoint does not list; a veth
or a /run/netns file only when the mark (or the peer) proves it ours; and the IPv6
sysctls an IPv6 gateway changes on an owned bridge are recorded."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

import docker.errors
import pytest

from reconciler.domain.checkpoint import EndpointPoint, NetworkPoint
from reconciler.domain.errors import ConflictError
from reconciler.domain.live import LiveAddress, LiveChainSet, LiveLink, LiveNetns, LiveState
from reconciler.domain.ownership import (
    DOCKER_LABEL,
    DOCKER_LABEL_VALUE,
    LINK_ALIAS,
    alloc_mac,
    alloc_ns_alias,
    alloc_veth_name,
)
from reconciler.drivers.docker import snapshot
from reconciler.engine import safechange
from reconciler.planner.checkpoint import restore_plan, sysctl_keys, take

HOST = "4026531840"
VETH = alloc_veth_name("a1")
OURS = ((DOCKER_LABEL, DOCKER_LABEL_VALUE),)


def _live(*, alloc: bool = True, netns: dict[str, LiveNetns] | None = None,
          veth: LiveLink | None = None) -> LiveState:
    links = {"br0": LiveLink("br0", 5, "bridge", 1500, True, True, alias=LINK_ALIAS,
                             addresses=(LiveAddress(ipaddress.ip_interface("10.0.0.1/24"),
                                                    True),),
                             mac="02:00:00:00:00:01")}
    if alloc:
        links[VETH] = LiveLink(VETH, 6, "veth", 1500, True, True, alias=LINK_ALIAS,
                               master="br0", hairpin=False, mac="aa:00:00:00:00:06",
                               peer_netnsid=0)
    elif veth is not None:
        links[VETH] = veth
    spaces = dict(netns or {})
    if alloc:
        lo = LiveLink("lo", 1, "", 65536, True, False, alias=alloc_ns_alias(HOST))
        eth0 = LiveLink("eth0", 2, "veth", 1500, True, True, alias=LINK_ALIAS,
                        addresses=(LiveAddress(ipaddress.ip_interface("10.0.0.2/24"), True),),
                        mac=alloc_mac("a1"))
        spaces["a1"] = LiveNetns("a1", True, (lo, eth0), nsid=0)
    return LiveState(host_id=HOST, links=links, firewall4=LiveChainSet(available=True),
                     firewall6=LiveChainSet(available=True), netns=spaces,
                     sysctls={"net/ipv4/ip_forward": "1", "net/ipv6/conf/all/forwarding": "0"})


def _ops(plan: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(op.name, op.args) for c in plan.actionable for op in c.ops]


# -- 1: Docker --------------------------------------------------------------------------------

WEB = NetworkPoint("web", "1" * 64, labels=OURS, pools=(("10.5.0.0/16", "10.5.0.1"),),
                   endpoints=(EndpointPoint("c" * 64, "c1", "10.5.0.3"),))


def test_containers_coming_and_going_on_an_unchanged_network_are_left_alone() -> None:
    """The change never touched Docker; in the window c1 stopped and someone attached d1:
    nothing to restore (before: the network was torn down and rebuilt)."""
    live = _live()
    cp = take(live, (WEB,))
    now = dataclasses.replace(WEB, endpoints=(EndpointPoint("d" * 64, "d1", "10.5.0.9"),))
    assert not restore_plan(cp, live, (now,)).has_changes
    # settings changed (the change replaced it): rebuilt, in place of the one there now
    changed = dataclasses.replace(now, id="3" * 64, pools=(("10.6.0.0/16", "10.6.0.1"),))
    ops = _ops(restore_plan(cp, live, (changed,)))
    assert [n for n, _a in ops] == ["docker.restore"] and ops[0][1]["replace_id"] == "3" * 64


class FakeApi:
    """The SDK's API client as ``snapshot.restore`` uses it: containers that exist, one
    network there now."""

    def __init__(self, containers: set[str], current: dict[str, Any] | None = None) -> None:
        self.containers = containers
        self.current = current
        self.calls: list[tuple[str, str]] = []

    def inspect_network(self, net_id: str) -> dict[str, Any]:
        if self.current is None or self.current["Id"] != net_id:
            raise docker.errors.NotFound(f"network {net_id} not found")
        return self.current

    def inspect_container(self, cid: str) -> dict[str, Any]:
        if cid not in self.containers:
            raise docker.errors.NotFound(f"No such container: {cid}")
        return {"Id": cid}

    def disconnect_container_from_network(self, cid: str, net_id: str,
                                          force: bool = False) -> None:
        self.calls.append(("disconnect", cid))

    def remove_network(self, net_id: str) -> None:
        self.calls.append(("remove", net_id))

    def create_network(self, name: str, **_kw: Any) -> dict[str, str]:
        self.calls.append(("create", name))
        return {"Id": "9" * 64}

    def connect_container_to_network(self, cid: str, net_id: str, **_kw: Any) -> None:
        if cid not in self.containers:
            raise docker.errors.NotFound(f"No such container: {cid}")
        self.calls.append(("connect", cid))


def test_a_recorded_container_that_is_gone_is_reported_not_a_failure() -> None:
    point = dataclasses.replace(WEB, endpoints=(
        EndpointPoint("c" * 64, "c1", "10.5.0.3"), EndpointPoint("e" * 64, "e1", "10.5.0.4")))
    api = FakeApi({"c" * 64})
    restored = snapshot.restore(api, point)
    assert restored.id == "9" * 64 and restored.gone == ("e1",)
    assert api.calls == [("create", "web"), ("connect", "c" * 64)]


def test_a_rebuild_never_detaches_a_container_the_checkpoint_does_not_list() -> None:
    current = {"Id": "3" * 64, "Labels": dict(OURS),
               "Containers": {"c" * 64: {}, "d" * 64: {}}}
    api = FakeApi({"c" * 64, "d" * 64}, current)
    with pytest.raises(ConflictError, match="d{12}"):
        snapshot.restore(api, WEB, "3" * 64)
    assert api.calls == []  # nothing disconnected, nothing removed


# -- 3: only what the mark proves ours ---------------------------------------------------------

def test_a_foreign_link_with_the_veth_name_is_a_conflict_not_deleted() -> None:
    cp = take(_live())
    foreign = LiveLink(VETH, 7, "veth", 1500, True, False, mac="aa:00:00:00:00:07")
    plan = restore_plan(cp, _live(alloc=False, veth=foreign))
    assert ("link.delete", {"name": VETH}) not in _ops(plan)
    assert [c.name for c in plan.conflicts] == ["a1"]
    assert VETH in plan.conflicts[0].reason and "\n" not in plan.conflicts[0].reason
    # ours (marked): deleted and the allocation re-made
    marked = dataclasses.replace(foreign, owned=True, alias=LINK_ALIAS)
    ops = _ops(restore_plan(cp, _live(alloc=False, veth=marked)))
    assert ops[0] == ("link.delete", {"name": VETH}) and ops[1][0] == "netns.create"


def test_a_foreign_link_in_place_of_a_live_allocations_veth_is_a_conflict() -> None:
    """The allocation is there but its veth is gone and someone's veth has its name."""
    cp = take(_live())
    now = _live()
    now.links[VETH] = LiveLink(VETH, 7, "veth", 1500, True, False, peer_netnsid=None)
    plan = restore_plan(cp, now)
    assert not any(n == "link.delete" and a.get("name") == VETH for n, a in _ops(plan))
    assert not any(a.get("name") == VETH for _n, a in _ops(plan))  # not set either
    assert [c.name for c in plan.conflicts] == ["a1"]


def test_an_unmarked_file_under_run_netns_is_a_conflict_not_replaced() -> None:
    cp = take(_live())
    unmarked = {"a1": LiveNetns("a1", False)}
    plan = restore_plan(cp, _live(alloc=False, netns=unmarked))
    assert not any(n == "netns.create" for n, _a in _ops(plan))
    assert [c.name for c in plan.conflicts] == ["a1"]
    marked = {"a1": LiveNetns("a1", False, file_mark=alloc_ns_alias(HOST))}
    create = next(a for n, a in _ops(restore_plan(cp, _live(alloc=False, netns=marked)))
                  if n == "netns.create")
    assert create["replace_stale"] is True


def test_a_revert_left_with_a_conflict_is_not_done() -> None:
    cp = take(_live())
    plan = restore_plan(cp, _live(alloc=False, netns={"a1": LiveNetns("a1", False)}))
    result = safechange.RevertResult(residual=plan)
    assert not result.ok
    assert "/run/netns/a1" in safechange.residual_line(plan)


# -- 4: the IPv6 sysctls of owned bridges ------------------------------------------------------

def test_the_ipv6_address_generation_of_owned_bridges_is_recorded() -> None:
    keys = sysctl_keys(_live())
    assert "net/ipv6/conf/br0/addr_gen_mode" in keys
    assert "net/ipv6/conf/br0/accept_dad" in keys
    assert not any(VETH in k for k in keys)
    live = _live()
    live.sysctls.update({"net/ipv6/conf/br0/addr_gen_mode": "1",
                         "net/ipv6/conf/br0/accept_dad": "1"})
    cp = take(live)
    live.sysctls.update({"net/ipv6/conf/br0/addr_gen_mode": "0",
                         "net/ipv6/conf/br0/accept_dad": "0"})
    ops = _ops(restore_plan(cp, live))
    assert ("sysctl.set", {"key": "net/ipv6/conf/br0/addr_gen_mode", "value": "1"}) in ops
    assert ("sysctl.set", {"key": "net/ipv6/conf/br0/accept_dad", "value": "1"}) in ops
