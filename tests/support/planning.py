"""The pure planner on an in-memory host: builders of desired states (a bridge, a subnet,
allocations with port maps; subnets and Docker networks for the address space) and
plan / converge against a :class:`FakeHost`."""

from __future__ import annotations

import ipaddress
from typing import Any

from reconciler.domain.model import (
    AddrRange,
    Alloc,
    AllocId,
    AutoPrefix,
    Bridge,
    BridgeName,
    DesiredState,
    DockerNetwork,
    PortMap,
    Settings,
    Subnet,
    SubnetName,
)
from reconciler.domain.plan import Plan
from reconciler.engine.reconcile import Reconciler
from reconciler.planner import PlanOptions, make_plan
from reconciler.ui.render import render_text
from tests.support.fakehost import FakeHost


def bridge(name: str = "br0", mtu: int | None = 1500, hairpin: bool = True) -> Bridge:
    return Bridge(BridgeName(name), mtu, hairpin)


def subnet(name: str = "net", br: str = "br0", cidr: str = "10.0.0.0/24",
           cidr6: str | None = None, rng: tuple[str, str] | None = None) -> Subnet:
    net = ipaddress.IPv4Network(cidr)
    net6 = ipaddress.IPv6Network(cidr6) if cidr6 else None
    r = AddrRange(ipaddress.IPv4Address(rng[0]), ipaddress.IPv4Address(rng[1])) if rng else None
    return Subnet(SubnetName(name), BridgeName(br), net, net.network_address + 1, net6,
                  net6.network_address + 1 if net6 else None, r)


def alloc(aid: str, *ports: PortMap, sub: str = "net", address: str | None = None,
          address6: str | None = None) -> Alloc:
    return Alloc(AllocId(aid), SubnetName(sub),
                 ipaddress.IPv4Address(address) if address else None,
                 ipaddress.IPv6Address(address6) if address6 else None, tuple(ports))


def port(host: int | None, to: int, protocol: str = "tcp", host_ip: str | None = None) -> PortMap:
    return PortMap(host, to, protocol, ipaddress.ip_address(host_ip) if host_ip else None)  # type: ignore[arg-type]


def state(*allocs: Alloc, sub: Subnet | None = None, br: Bridge | None = None,
          auto: tuple[int, int] = (20000, 32000)) -> DesiredState:
    s = sub or subnet()
    b = br or bridge()
    return DesiredState(bridges={b.name: b}, subnets={s.name: s},
                        allocs={a.id: a for a in allocs}, settings=Settings(auto))


# ------------------------------------------------------------------ the address space


def sub(name: str, bridge: str, cidr: str, cidr6: str | None = None) -> Subnet:
    """A subnet as the address-space planner takes it: ``cidr`` / ``cidr6`` a prefix or
    ``auto(pool, size)``; no gateways, no range."""
    def prefix(text: str | None) -> Any:
        if text is None:
            return None
        if text.startswith("auto "):
            _auto, pool, size = text.split()
            return AutoPrefix(ipaddress.ip_network(pool), int(size))
        return ipaddress.ip_network(text)

    return Subnet(SubnetName(name), BridgeName(bridge), prefix(cidr), None, prefix(cidr6))


def auto(pool: str, size: int) -> str:
    return f"auto {pool} {size}"


def desired(*subnets: Subnet, docker: tuple[DockerNetwork, ...] = ()) -> DesiredState:
    """The subnets with a bridge each (by its name) and the Docker networks."""
    return DesiredState(bridges={s.bridge: Bridge(s.bridge) for s in subnets},
                        subnets={s.name: s for s in subnets},
                        docker_networks={d.name: d for d in docker})


def plan(host: FakeHost, desired: DesiredState, **opts: object) -> Plan:
    return make_plan(desired, host.observe(desired), PlanOptions(**opts))  # type: ignore[arg-type]


def converge(host: FakeHost, desired: DesiredState, *, leases: FakeHost | None = None,
             **opts: object) -> Plan:
    """Apply and check nothing is left; ``leases``: keep the lease table there (the host)."""
    result = Reconciler(host, runner=host, sleep=lambda _s: None,  # type: ignore[arg-type]
                        leases=leases).apply(desired, PlanOptions(**opts))  # type: ignore[arg-type]
    assert result.ok, render_text(result.residual or result.plan)
    again = plan(host, desired, **opts)
    assert not again.has_changes, render_text(again)
    return result.plan
