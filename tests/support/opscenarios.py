"""Plans that between them hold every op kind in every shape the planner writes.

``tests/unit/domain/fixtures/ops/plans.json`` holds these plans as the planner before
typed ops (8d5ad83) wrote them, regenerated for issue 18 (hairpin only on the
ports of allocations with port maps: the same bytes as the untyped planner of
that change, branch ``scale18``) and for issue 14 (the firewall scripts, and the
live fingerprints they feed, of subnet isolation and the loopback guard), and for
issue 13 (stable MACs: bridges and eth0 made with a MAC, pins, neighbour entries;
``plans-before-stable-macs.json`` keeps the plans before it, which must still
decode), and for issue 13 item 6 (our neighbour entries, exempt from the kernel's GC,
deleted with their allocation or as orphans: ``neigh.delete``), and for issue 27 (port
maps shown on the allocation: the ``added``/``removed`` maps of a ``ports`` attribute, and
``within``, the bridge an allocation sits in); ``test_ops`` checks that today's planner prints the same bytes and that every
op survives decode and encode unchanged.
Regenerate (only for a deliberate change of the plan format) with
``python -m tests.support.opscenarios > tests/unit/domain/fixtures/ops/plans.json``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
from collections.abc import Iterator
from typing import Any

from reconciler.domain.checkpoint import Checkpoint, EndpointPoint, NetworkPoint
from reconciler.domain.docker import SCOPE_LABEL
from reconciler.domain.live import (
    LiveAddress,
    LiveDocker,
    LiveDockerNetwork,
    LiveNeighbour,
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
    Settings,
    Subnet,
    SubnetName,
)
from reconciler.domain.ownership import (
    DOCKER_LABEL,
    DOCKER_LABEL_VALUE,
    alloc_ns_alias,
    alloc_veth_name,
)
from reconciler.domain.plan import Plan
from reconciler.engine.reconcile import Reconciler
from reconciler.planner import PlanOptions, make_plan
from reconciler.planner.checkpoint import restore_plan
from tests.support.fakehost import HOST_ID, FakeHost, FakeNetns
from tests.support.host import REPO

#: the plans as recorded (see the module docstring)
FIXTURE = os.path.join(REPO, "tests", "unit", "domain", "fixtures", "ops", "plans.json")
#: the plans before stable MACs (issue 13): saved plans of that version must still run
BEFORE_MACS = os.path.join(os.path.dirname(FIXTURE), "plans-before-stable-macs.json")


def recorded() -> dict[str, Any]:
    with open(FIXTURE) as fh:
        return json.load(fh)  # type: ignore[no-any-return]


def recorded_ops() -> list[dict[str, Any]]:
    """Every op of the recorded plans, today's and those saved before stable MACs."""
    with open(BEFORE_MACS) as fh:
        before = json.load(fh)
    # firewall.restore went with the iptables backend (docs/decisions/045-...): plans
    # holding it are refused as from another version
    return [o for plans in (recorded(), before) for p in plans.values()
            for c in p["changes"] for o in c["ops"] if o["op"] != "firewall.restore"]


def _bridge(name: str = "br0", mtu: int | None = 1500, hairpin: bool = True) -> Bridge:
    return Bridge(BridgeName(name), mtu, hairpin)


def _subnet(name: str = "net", br: str = "br0", cidr: str = "10.0.0.0/24",
            cidr6: str | None = "fd00::/64") -> Subnet:
    net = ipaddress.IPv4Network(cidr)
    net6 = ipaddress.IPv6Network(cidr6) if cidr6 else None
    return Subnet(SubnetName(name), BridgeName(br), net, net.network_address + 1, net6,
                  net6.network_address + 1 if net6 else None, None)


def _alloc(aid: str, *ports: PortMap) -> Alloc:
    return Alloc(AllocId(aid), SubnetName("net"), None, None, ports)


def _state(*bridges: Bridge, sub: Subnet | None = None, allocs: tuple[str, ...] = ("a", "b"),
           docker: tuple[DockerNetwork, ...] = ()) -> DesiredState:
    s = sub or _subnet()
    first = _alloc(allocs[0], PortMap(8080, 80, "tcp", None), PortMap(None, 81, "udp", None))
    return DesiredState(bridges={b.name: b for b in bridges or (_bridge(),)},
                        subnets={s.name: s},
                        allocs={a.id: a for a in (first, *(_alloc(x) for x in allocs[1:]))},
                        docker_networks={d.name: d for d in docker},
                        settings=Settings((20000, 32000)))


def _plan(host: FakeHost, desired: DesiredState, **opts: object) -> Plan:
    return make_plan(desired, host.observe(desired), PlanOptions(**opts))  # type: ignore[arg-type]


def _converged(desired: DesiredState) -> FakeHost:
    host = FakeHost()
    result = Reconciler(host, runner=host, sleep=lambda _s: None).apply(  # type: ignore[arg-type]
        desired, PlanOptions())
    assert result.ok and not _plan(host, desired).has_changes
    return host


def _docker_net(name: str, id: str, *, owned: bool = True, containers: int = 0,
                mtu: str = "1500") -> LiveDockerNetwork:
    labels = {"io.reconciler.managed": "true", "io.reconciler.scope": "host"} if owned else {}
    return LiveDockerNetwork(
        id=id, name=name, driver="bridge", labels=labels,
        options={"com.docker.network.bridge.enable_ip_masquerade": "true",
                 "com.docker.network.driver.mtu": mtu},
        enable_ipv6=False, internal=False, subnets=("172.18.0.0/16",), containers=containers)


def scenarios() -> Iterator[tuple[str, Plan]]:
    """(name, plan) for each situation; the plans are deterministic."""
    want = _state()
    yield "create", _plan(FakeHost(), want)
    yield "create without MTU, hairpin off", _plan(
        FakeHost(), _state(_bridge(mtu=None, hairpin=False)))

    host = FakeHost()
    host.add_link("br0", "bridge", mtu=1400)
    host.links["br0"] = dataclasses.replace(host.links["br0"], up=False)
    yield "adopt a down bridge of another MTU", _plan(host, want, adopt=frozenset({"bridge/br0"}))

    veth = alloc_veth_name("a")
    host = _converged(want)
    host.links[veth] = dataclasses.replace(host.links[veth], up=False, owned=False)
    yield "veth down and unmarked", _plan(host, want)

    host = _converged(want)
    host.links[veth] = dataclasses.replace(host.links[veth], master="other", hairpin=True)
    yield "veth on another bridge", _plan(host, want)

    host = _converged(want)
    yield "hairpin off", _plan(host, _state(_bridge(hairpin=False)))
    yield "MTU changed", _plan(host, _state(_bridge(mtu=9000)))
    yield "cidr6 dropped", _plan(host, _state(sub=_subnet(cidr6=None)))

    host = _converged(_state(_bridge(), _bridge("br1")))
    yield "alloc and bridge pruned", _plan(host, _state(allocs=("a",)))
    yield "nothing pruned", _plan(host, _state(allocs=("a",)), prune=False)

    host = _converged(want)
    br0 = host.links["br0"]
    host.links["br0"] = dataclasses.replace(br0, addresses=(
        *br0.addresses, LiveAddress(ipaddress.ip_interface("10.9.0.1/24"), True)))
    ns = host.netns["a"]
    ns.links["eth0"] = dataclasses.replace(ns.links["eth0"], addresses=(
        *ns.links["eth0"].addresses, LiveAddress(ipaddress.ip_interface("10.0.0.99/24"), True)))
    yield "stray addresses", _plan(host, want)

    host = _converged(want)
    del host.links[veth]
    yield "veth gone, eth0 left", _plan(host, want)

    host = _converged(want)
    host.netns["c"] = FakeNetns(99, {}, [], usable=False, file_mark=alloc_ns_alias(HOST_ID))
    yield "stale namespace file", _plan(host, _state(allocs=("a", "b", "c")))
    orphan = dataclasses.replace(host.links[veth], name=alloc_veth_name("zz"), peer_netnsid=42)
    host.links[orphan.name] = orphan
    yield "orphan veth", _plan(host, want)

    host = _converged(want)
    moved = dataclasses.replace(want, allocs={
        AllocId("a"): _alloc("a"), AllocId("b"): _alloc("b", PortMap(8080, 80, "tcp", None))})
    yield "port maps moved and gone", _plan(host, moved)
    jumbo = _state(_bridge(mtu=9000))
    yield "last ports of a bridge pruned", _plan(_converged(jumbo),
                                                 dataclasses.replace(jumbo, allocs={}))
    host.links["br0"] = dataclasses.replace(host.links["br0"], mac="aa:00:00:00:00:01",
                                            mac_pinned=False)
    yield "bridge MAC not pinned", _plan(host, want)
    host.links["br0"] = dataclasses.replace(host.links["br0"], mac="00:00:00:00:00:00")
    yield "bridge MAC zero", _plan(host, want)

    host = _converged(want)
    host.fw[4].policies[("filter", "FORWARD")] = "DROP"  # dockerd's
    yield "FORWARD drops: the mark shim", _plan(host, want)

    host = _converged(want)
    index = host.links["br0"].index
    address = str(host.netns["a"].links["eth0"].addresses[0].address.ip)
    host.neighbours = [n for n in host.neighbours if n.address != address]
    host.neighbours.append(LiveNeighbour(index, address, "aa:00:00:00:00:02", False))
    yield "stale neighbour entry", _plan(host, want)
    del host.links[veth]
    yield "veth gone, stale neighbour entry", _plan(host, want)

    # our entries (seeded exempt from the kernel's GC) of an allocation that went by hand
    host = _converged(want)
    host.netns.pop("b")
    host.links.pop(alloc_veth_name("b"))
    yield "orphan neighbour entries", _plan(host, _state(allocs=("a",)))

    kind = DockerNetwork(name=DockerNetworkName("kind"), mtu=1400, labels=(("team", "x"),))
    web = DockerNetwork(name=DockerNetworkName("web"), ipv6=True,
                        subnet=ipaddress.IPv4Network("10.5.0.0/16"))
    docker = LiveDocker(available=True, default_mtu=1500, networks=(
        _docker_net("kind", "1" * 64, containers=2), _docker_net("web", "2" * 64),
        _docker_net("web", "3" * 64), _docker_net("old", "4" * 64),
        _docker_net("old", "5" * 64), _docker_net("theirs", "6" * 64, owned=False)))
    theirs = DockerNetwork(name=DockerNetworkName("theirs"))
    live = LiveState(docker=docker)
    yield "docker", make_plan(DesiredState(docker_networks={
        "kind": kind, "web": web, "theirs": theirs,  # type: ignore[dict-item]
        "new": DockerNetwork(name=DockerNetworkName("new"))}), live,  # type: ignore[dict-item]
        PlanOptions(force_replace=True, adopt=frozenset({"docker_network/theirs"})))
    yield "docker, default MTU unknown", make_plan(
        DesiredState(docker_networks={"new": web}),  # type: ignore[dict-item]
        LiveState(docker=dataclasses.replace(docker, default_mtu=None, scope="netns/x")))

    # a revert (planner/checkpoint): the network the checkpoint recorded is gone, another
    # of its name was made in its place by the change
    point = NetworkPoint("kind", "7" * 64, "bridge", (("com.docker.network.driver.mtu", "1400"),),
                         ((DOCKER_LABEL, DOCKER_LABEL_VALUE), (SCOPE_LABEL, "host")), False,
                         False, (("172.30.0.0/16", "172.30.0.1"),),
                         (EndpointPoint("c" * 64, "web1", "172.30.0.5", None, ("web",)),))
    now = dataclasses.replace(point, id="8" * 64, options=(), endpoints=())
    yield "revert of a docker network", restore_plan(Checkpoint("1", docker=(point,)),
                                                     LiveState(host_id="1"), [now])


def plan_json(plan: Plan) -> str:
    """The plan as ``plan --json`` prints it, but for its scope (where it was planned, the
    fake host's id, recorded since), its ``picks`` and ``leases`` (added with leases): the
    recorded bytes are of the changes."""
    return json.dumps({k: v for k, v in plan.to_json().items()
                       if k not in ("scope", "picks", "leases")}, indent=2)


if __name__ == "__main__":
    print(json.dumps({name: json.loads(plan_json(p)) for name, p in scenarios()}, indent=2))
