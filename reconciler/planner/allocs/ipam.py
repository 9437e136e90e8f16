"""Addresses, MACs and host ports of allocations: declared, leased, live or new (pure).

Per value (SPEC §11): a declared one; else its lease (``LiveState.leases``, the
scope's lease file), which live drift is healed back to; else, while it has no
lease yet, the (owned) value the live state has (an allocation's ``eth0``
address and MAC, its DNAT rules' ``auto`` ports: an upgrade moves nothing);
else the lowest free address or port in id order, the MAC derived from the id.
Each choice is recorded in ``ctx.picks`` with its origin; the engine saves the
table before the first op.

See docs/decisions/004-ipam-and-ports-from-live-state.md and
docs/decisions/041-leases.md.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass

from reconciler.domain.leases import DECLARED, LEASE, LIVE, NEW, port_field
from reconciler.domain.model import Alloc, Subnet, SubnetName
from reconciler.domain.ownership import ALLOC_IFNAME, alloc_mac
from reconciler.planner import firewall
from reconciler.planner.allocs.live import IPAddr, inner_link, is_ours, live_addr
from reconciler.planner.context import PlanContext
from reconciler.planner.leases import choose, valid_mac


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


def _ip(value: object, version: int) -> IPAddr | None:
    """Read a leased address, or None when it is not one of ``version``."""
    try:
        ip = ipaddress.ip_address(str(value))
    except ValueError:
        return None
    return ip if ip.version == version else None


def _assign(ctx: PlanContext, s: Subnet, members: list[Alloc], version: int) -> dict[str, IPAddr]:
    """Assign declared addresses, then leased ones, then (with no lease yet) kept live ones, then
    the lowest free ones, in id order (SPEC §11)."""
    make = ipaddress.IPv4Address if version == 4 else ipaddress.IPv6Address
    field = "address" if version == 4 else "address6"
    picks = ctx.picks
    gateway = s.gateway if version == 4 else s.gateway6
    lo, hi = _bounds(s, version)
    taken: set[int] = {int(gateway)} if gateway is not None else set()
    if not ctx.options.prune:
        # allocations kept undeclared (--no-prune) still hold their addresses
        for name in ctx.live.netns:
            if name not in ctx.desired.allocs and (kept := live_addr(ctx, name, version)):
                taken.add(int(kept))
    out: dict[str, IPAddr] = {}
    declared_by: dict[int, str] = {}
    for a in members:
        declared = a.address if version == 4 else a.address6
        if declared is not None:
            out[a.id] = declared
            taken.add(int(declared))
            declared_by[int(declared)] = a.id
            picks.record(f"alloc/{a.id}", field, str(declared), DECLARED)
    leased: set[str] = set()
    for a in members:
        lease = picks.lease(f"alloc/{a.id}", field)
        if a.id in out or lease is None:
            continue
        leased.add(a.id)
        ip = _ip(lease, version)
        if ip is not None and lo <= int(ip) <= hi and int(ip) not in taken:
            out[a.id] = ip
            taken.add(int(ip))
            picks.record(f"alloc/{a.id}", field, str(ip), LEASE)
        elif ip is not None and int(ip) in declared_by:
            picks.dropped(f"alloc/{a.id}", field,
                          f"is declared by alloc {declared_by[int(ip)]} now")
        else:
            picks.dropped(f"alloc/{a.id}", field, f"is no longer valid (not in {make(lo)}-"
                          f"{make(hi)} of subnet {s.name})")
    for a in members:
        if a.id in out or a.id in leased:
            continue
        cur = live_addr(ctx, a.id, version)
        if cur is not None and lo <= int(cur) <= hi and int(cur) not in taken:
            out[a.id] = cur
            taken.add(int(cur))
            picks.record(f"alloc/{a.id}", field, str(cur), LIVE)
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
        picks.record(f"alloc/{a.id}", field, str(out[a.id]), NEW)
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


def assign_macs(ctx: PlanContext) -> dict[str, str]:
    """Choose each declared allocation's ``eth0`` MAC: leased, else (no lease yet) the one its
    live ``eth0`` has, else the one derived from its id (``ownership.alloc_mac``)."""
    out: dict[str, str] = {}
    for aid in sorted(ctx.desired.allocs):
        address = f"alloc/{aid}"
        lease = ctx.picks.lease(address, "mac")
        ns = ctx.live.netns.get(aid)
        eth0 = inner_link(ns, ALLOC_IFNAME) if is_ours(ctx, ns) else None
        live = eth0.mac if eth0 is not None and eth0.kind == "veth" else None
        mac, source, dropped = choose(None, lease if isinstance(lease, str) else None, live,
                                      valid=valid_mac, pick=functools.partial(alloc_mac, aid))
        if lease is not None and not isinstance(lease, str):
            dropped = True
        if dropped:
            ctx.picks.dropped(address, "mac", "is not a unicast MAC")
        assert mac is not None
        ctx.picks.record(address, "mac", mac, source)
        out[aid] = mac
    return out


# ------------------------------------------------------------------ host ports


def live_port_maps(ctx: PlanContext) -> dict[str, list[Mapped]]:
    """Read the live port maps per alloc id (both families; one map per family), from the
    live DNAT rules: what auto ports keep and what the plan shows an allocation had."""
    out: dict[str, list[Mapped]] = {}
    # our table's, then (the first apply after an upgrade) the iptables chains of earlier
    # versions': an "auto" host port keeps its number across the conversion
    for fw in ((ctx.live.firewall4, ctx.live.firewall6), (ctx.live.old4, ctx.live.old6)):
        rules = (*fw[0].chains.get(("nat", firewall.DNAT), ()),
                 *fw[1].chains.get(("nat", firewall.DNAT), ()))
        if out and fw[0] is ctx.live.old4:
            break
        for d in firewall.dnat_rules(rules):
            out.setdefault(d.alloc, []).append(Mapped.of(d))
    return out


def _docker_published(ctx: PlanContext) -> dict[tuple[str, int], str]:
    """Find the host ports Docker publishes through DNAT (``nat/DOCKER``, userland proxy off)."""
    out: dict[tuple[str, int], str] = {}
    for fw in (ctx.live.old4, ctx.live.old6):  # iptables-save: Docker's chains
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


def _port_lease(ctx: PlanContext, a: Alloc, i: int, lo: int, hi: int,
                declared_by: dict[tuple[str, int], str], leased: set[tuple[str, int]],
                docker: dict[tuple[str, int], str]) -> int | None:
    """Return the leased host port of ``a``'s ``auto`` map ``i`` when it is still its, or None
    (re-picked, said in the plan). A leased port that a socket or Docker holds now stays its,
    and blocks the allocation (``Picks.blocked``): never moved, never taken over."""
    p = a.ports[i]
    address, field = f"alloc/{a.id}", port_field(p.protocols, p.to, p.host_ip)
    lease = ctx.picks.lease(address, field)
    port = lease if isinstance(lease, int) and not isinstance(lease, bool) else None
    ports = {(proto, port) for proto in p.protocols} if port is not None else set()
    if port is None or not lo <= port <= hi:
        ctx.picks.dropped(address, field, f"is no longer valid (outside the auto range {lo}-{hi})")
        return None
    if ports & declared_by.keys():
        other = declared_by[min(ports & declared_by.keys())]
        ctx.picks.dropped(address, field, f"is declared by alloc {other} now")
        return None
    if ports & leased:
        ctx.picks.dropped(address, field, "is leased to another map too")
        return None
    for proto, held in sorted(ports):
        if (proto, held) in ctx.live.listening:
            ctx.picks.blocked.setdefault(a.id, (
                f"host port {held}/{proto} (leased to its map to port {p.to}) is held by a "
                f"socket that is not the reconciler's (`ss -lnp 'sport = :{held}'` names it): "
                "the map is not moved and the port not taken over; stop that socket, or "
                f"`reconcile release alloc/{a.id}` to pick another port"))
        elif (proto, held) in docker:
            ctx.picks.blocked.setdefault(a.id, (
                f"host port {held}/{proto} (leased to its map to port {p.to}) is published by "
                f"Docker now (nat/DOCKER: DNAT to {docker[(proto, held)]}): the map is not "
                f"moved; free the port, or `reconcile release alloc/{a.id}`"))
    ctx.picks.record(address, field, port, LEASE)
    return port


def assign_ports(ctx: PlanContext) -> dict[str, list[Mapped]]:
    """Assign the host port of every port map: declared, else leased, else (no lease yet) kept
    from the live rules, else the lowest free one."""
    allocs = [ctx.desired.allocs[a] for a in sorted(ctx.desired.allocs)]
    lo, hi = ctx.desired.settings.auto_port_range
    docker = _docker_published(ctx)
    used: set[tuple[str, int]] = set()
    declared_by: dict[tuple[str, int], str] = {}
    for a in allocs:
        for p in a.ports:
            if p.host is not None:
                used |= {(proto, p.host) for proto in p.protocols}
                for proto in p.protocols:
                    declared_by.setdefault((proto, p.host), a.id)
                    if (proto, p.host) in ctx.live.listening:
                        ctx.fatal.append(
                            f"alloc {a.id!r} ({a.source}): host port {p.host}/{proto} is already "
                            "in use on this host (a socket is bound to it)")
                    elif (proto, p.host) in docker:
                        ctx.fatal.append(
                            f"alloc {a.id!r} ({a.source}): host port {p.host}/{proto} is already "
                            f"published by Docker (nat/DOCKER: DNAT to {docker[(proto, p.host)]})")
    busy = used | set(ctx.live.listening) | set(docker)
    chosen: dict[tuple[str, int], int] = {}
    with_lease: set[tuple[str, int]] = set()
    leased: set[tuple[str, int]] = set()
    for a in allocs:  # pass 0: leases
        for i, p in enumerate(a.ports):
            if p.host is not None or ctx.picks.lease(
                    f"alloc/{a.id}", port_field(p.protocols, p.to, p.host_ip)) is None:
                continue
            with_lease.add((a.id, i))
            port = _port_lease(ctx, a, i, lo, hi, declared_by, leased, docker)
            if port is not None:
                chosen[(a.id, i)] = port
                leased |= {(proto, port) for proto in p.protocols}
                busy |= {(proto, port) for proto in p.protocols}
    live = live_port_maps(ctx)
    for a in allocs:  # pass 1: keep live auto ports of maps with no lease yet
        for i, p in enumerate(a.ports):
            if p.host is not None or (a.id, i) in with_lease:
                continue
            have = live.get(a.id, [])
            protos: dict[tuple[int, int, object], set[str]] = {}
            for m in have:
                protos.setdefault((m.host, m.to, m.host_ip), set()).add(m.proto)
            # a live port that carries exactly this map's protocols first: the table's
            # entries have no order, so a "both" map finds its tcp+udp port, a tcp one its own
            want = set(p.protocols)
            ordered = [m for m in have if protos[(m.host, m.to, m.host_ip)] == want] + [
                m for m in have if protos[(m.host, m.to, m.host_ip)] != want]
            for m in ordered:
                ports = {(proto, m.host) for proto in p.protocols}
                if (m.proto == p.protocols[0] and m.to == p.to and lo <= m.host <= hi
                        and m.host_ip == p.host_ip and not ports & busy):
                    chosen[(a.id, i)] = m.host
                    busy |= ports
                    ctx.picks.record(f"alloc/{a.id}", port_field(p.protocols, p.to, p.host_ip),
                                     m.host, LIVE)
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
                ctx.picks.record(f"alloc/{a.id}", port_field(p.protocols, p.to, p.host_ip),
                                 host, NEW)
            maps += [Mapped(proto, host, p.to, p.host_ip) for proto in p.protocols]
        out[a.id] = maps
    return out
