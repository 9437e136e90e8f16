"""Addresses and host ports of allocations, kept from the live state (pure).

IPAM is derived from live state, not from a side file: an allocation keeps the
(owned) address its ``eth0`` already has while that address is still valid;
new allocations take the lowest free address of the range. Automatic host
ports are kept the same way, from the live DNAT rules of the allocation.

See docs/decisions/004-ipam-and-ports-from-live-state.md.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from reconciler.domain.model import Alloc, Subnet, SubnetName
from reconciler.planner import firewall
from reconciler.planner.allocs.live import IPAddr, live_addr
from reconciler.planner.context import PlanContext


@dataclass(frozen=True)
class Mapped:
    """One (alloc, protocol) port map with its host port decided."""

    proto: str
    host: int
    to: int
    host_ip: IPAddr | None

    @classmethod
    def of(cls, rule: firewall.DnatRule) -> Mapped:
        """Return the map a live DNAT rule serves."""
        return cls(rule.proto, rule.port, rule.to, rule.host_ip)


def _bounds(s: Subnet, version: int) -> tuple[int, int]:
    if version == 4:
        if s.range is not None:
            return int(s.range.start), int(s.range.end)
        return int(s.cidr.network_address) + 1, int(s.cidr.broadcast_address) - 1
    assert s.cidr6 is not None
    return int(s.cidr6.network_address) + 1, int(s.cidr6.broadcast_address)


def _assign(ctx: PlanContext, s: Subnet, members: list[Alloc], version: int) -> dict[str, IPAddr]:
    """Assign declared addresses, then kept live ones, then the lowest free ones, in id order."""
    make = ipaddress.IPv4Address if version == 4 else ipaddress.IPv6Address
    gateway = s.gateway if version == 4 else s.gateway6
    lo, hi = _bounds(s, version)
    taken: set[int] = {int(gateway)} if gateway is not None else set()
    if not ctx.options.prune:
        # allocations kept undeclared (--no-prune) still hold their addresses
        for name in ctx.live.netns:
            if name not in ctx.desired.allocs and (kept := live_addr(ctx, name, version)):
                taken.add(int(kept))
    out: dict[str, IPAddr] = {}
    for a in members:
        declared = a.address if version == 4 else a.address6
        if declared is not None:
            out[a.id] = declared
            taken.add(int(declared))
    for a in members:
        if a.id in out:
            continue
        cur = live_addr(ctx, a.id, version)
        if cur is not None and lo <= int(cur) <= hi and int(cur) not in taken:
            out[a.id] = cur
            taken.add(int(cur))
    cursor = lo
    for a in members:
        if a.id in out:
            continue
        while cursor <= hi and cursor in taken:
            cursor += 1
        if cursor > hi:
            ctx.fatal.append(
                f"alloc {a.id!r} ({a.source}): subnet {s.name!r} has no free IPv{version} "
                f"address left in {make(lo)}-{make(hi)} ({len(members)} allocations)")
            break
        out[a.id] = make(cursor)
        taken.add(cursor)
    return out


def assign_addresses(ctx: PlanContext) -> dict[str, tuple[IPAddr | None, IPAddr | None]]:
    result: dict[str, tuple[IPAddr | None, IPAddr | None]] = {}
    by_subnet: dict[SubnetName, list[Alloc]] = {}
    for aid in sorted(ctx.desired.allocs):
        a = ctx.desired.allocs[aid]
        by_subnet.setdefault(a.subnet, []).append(a)
    for sname, members in sorted(by_subnet.items()):
        s = ctx.desired.subnets[sname]  # the loader checked the reference
        v4 = _assign(ctx, s, members, 4)
        v6 = _assign(ctx, s, members, 6) if s.cidr6 is not None else {}
        for a in members:
            result[a.id] = (v4.get(a.id), v6.get(a.id))
    return result


# ------------------------------------------------------------------ host ports


def live_port_maps(ctx: PlanContext) -> dict[str, list[Mapped]]:
    """Read the live port maps per alloc id (both families; one map per family), from the
    live DNAT rules: what auto ports keep and what the plan shows an allocation had."""
    out: dict[str, list[Mapped]] = {}
    rules = (*ctx.live.firewall4.chains.get(("nat", firewall.DNAT), ()),
             *ctx.live.firewall6.chains.get(("nat", firewall.DNAT), ()))
    for d in firewall.dnat_rules(rules):
        out.setdefault(d.alloc, []).append(Mapped.of(d))
    return out


def _docker_published(ctx: PlanContext) -> dict[tuple[str, int], str]:
    """Find the host ports Docker publishes through DNAT (``nat/DOCKER``, userland proxy off)."""
    out: dict[tuple[str, int], str] = {}
    for fw in (ctx.live.firewall4, ctx.live.firewall6):
        for r in fw.chains.get(("nat", "DOCKER"), ()):
            t = r.split()
            try:
                if t[t.index("-j") + 1] != "DNAT":
                    continue
                key = (t[t.index("-p") + 1], int(t[t.index("--dport") + 1]))
                out.setdefault(key, t[t.index("--to-destination") + 1])
            except (ValueError, IndexError):
                continue
    return out


def assign_ports(ctx: PlanContext) -> dict[str, list[Mapped]]:
    """Assign the host port of every port map; ``auto`` ports are kept from live rules when
    possible."""
    allocs = [ctx.desired.allocs[a] for a in sorted(ctx.desired.allocs)]
    lo, hi = ctx.desired.settings.auto_port_range
    docker = _docker_published(ctx)
    used: set[tuple[str, int]] = set()
    for a in allocs:
        for p in a.ports:
            if p.host is not None:
                used |= {(proto, p.host) for proto in p.protocols}
                for proto in p.protocols:
                    if (proto, p.host) in ctx.live.listening:
                        ctx.fatal.append(
                            f"alloc {a.id!r} ({a.source}): host port {p.host}/{proto} is already "
                            "in use on this host (a socket is bound to it)")
                    elif (proto, p.host) in docker:
                        ctx.fatal.append(
                            f"alloc {a.id!r} ({a.source}): host port {p.host}/{proto} is already "
                            f"published by Docker (nat/DOCKER: DNAT to {docker[(proto, p.host)]})")
    busy = used | set(ctx.live.listening) | set(docker)
    live = live_port_maps(ctx)
    chosen: dict[tuple[str, int], int] = {}
    for a in allocs:  # pass 1: keep live auto ports
        for i, p in enumerate(a.ports):
            if p.host is not None:
                continue
            for m in live.get(a.id, ()):
                ports = {(proto, m.host) for proto in p.protocols}
                if (m.proto == p.protocols[0] and m.to == p.to and lo <= m.host <= hi
                        and m.host_ip == p.host_ip and not ports & busy):
                    chosen[(a.id, i)] = m.host
                    busy |= ports
                    break
    cursor = lo
    out: dict[str, list[Mapped]] = {}
    for a in allocs:  # pass 2: lowest free port for the rest
        maps: list[Mapped] = []
        for i, p in enumerate(a.ports):
            host = p.host if p.host is not None else chosen.get((a.id, i))
            if host is None:
                while cursor <= hi and any((proto, cursor) in busy for proto in p.protocols):
                    cursor += 1
                if cursor > hi:
                    ctx.fatal.append(f"alloc {a.id!r} ({a.source}): no free host port left in "
                                     f"the auto range {lo}-{hi}")
                    break
                host = cursor
                busy |= {(proto, cursor) for proto in p.protocols}
            maps += [Mapped(proto, host, p.to, p.host_ip) for proto in p.protocols]
        out[a.id] = maps
    return out
