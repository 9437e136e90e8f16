"""Planning of allocations: namespaces, veths, addresses, routes and port maps (pure).

IPAM is derived from live state, not from a side file: an allocation keeps the
(owned) address its ``eth0`` already has while that address is still valid;
new allocations take the lowest free address of the range. Automatic host
ports are kept the same way, from the live DNAT rules of the allocation.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from reconciler.domain import ownership
from reconciler.domain.live import LiveLink, LiveNeighbour, LiveNetns
from reconciler.domain.model import Alloc, BridgeName, Subnet, SubnetName
from reconciler.domain.ops import (
    AddrDel,
    AllocAttach,
    AllocConfigure,
    LinkDelete,
    LinkSet,
    LinkSetHairpin,
    NeighDelete,
    NeighReplace,
    NetnsCreate,
    NetnsDelete,
    RouteDelDefault,
    encode,
)
from reconciler.domain.ownership import ALLOC_IFNAME, alloc_ns_alias, alloc_veth_name
from reconciler.domain.plan import Action, AttrChange, Change, Op
from reconciler.planner import firewall
from reconciler.planner.context import PlanContext

IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Mapped:
    """One (alloc, protocol) port map with its host port decided."""

    proto: str
    host: int
    to: int
    host_ip: IPAddr | None

    @classmethod
    def of(cls, rule: firewall.DnatRule) -> Mapped:
        """The map a live DNAT rule serves."""
        return cls(rule.proto, rule.port, rule.to, rule.host_ip)


# ------------------------------------------------------------------ live helpers


def _owned_ns(ctx: PlanContext, ns: LiveNetns | None) -> bool:
    return owned_ns(ctx.live.host_id, ns)


def owned_ns(host_id: str, ns: LiveNetns | None) -> bool:
    """An allocation namespace of the host ``host_id``: its ``lo`` carries our mark."""
    if ns is None or not ns.usable:
        return False
    lo = _inner(ns, "lo")
    return lo is not None and lo.alias == alloc_ns_alias(host_id)


def veth_pair_ok(ns: LiveNetns, veth: LiveLink | None) -> bool:
    """The allocation's veth pair is whole: the host end and ``eth0`` inside, one pair."""
    eth0 = _inner(ns, ALLOC_IFNAME)
    return (veth is not None and eth0 is not None and eth0.kind == "veth"
            and veth.kind == "veth" and (ns.nsid is None or veth.peer_netnsid in
                                         (None, ns.nsid)))


def _inner(ns: LiveNetns | None, name: str) -> LiveLink | None:
    if ns is None:
        return None
    return next((lk for lk in ns.links if lk.name == name), None)


def _is_own_namespace(ctx: PlanContext, ns: LiveNetns | None) -> bool:
    """The namespace the reconciler runs in (``--netns X``'s X, or the host's own bind-mounted
    under /run/netns): never an allocation's, to adopt, fill or delete. Its own veth in it
    would be a loop, and deleting it unmounts the sandbox itself."""
    return ns is not None and ns.inode is not None and str(ns.inode) == ctx.live.host_id


def _veth_is_ours(ctx: PlanContext, aid: str, veth: LiveLink, ns: LiveNetns | None) -> bool:
    """May the host link named ``alloc_veth_name(aid)`` be changed or deleted? Its name
    proves nothing (anyone may call a link ``vr`` + 12 hex): a veth that carries our mark,
    or a veth whose peer is inside this allocation's namespace (ours, or being adopted) —
    what a crash between the veth's creation and its marking leaves."""
    if veth.kind != "veth":
        return False
    if veth.owned:
        return True
    return (ns is not None and ns.usable and ns.nsid is not None
            and veth.peer_netnsid == ns.nsid
            and (_owned_ns(ctx, ns) or ctx.adopted("alloc", aid)))


def _describe_link(lk: LiveLink) -> str:
    """``veth 10.77.0.50/24`` for a plan line: what a deletion takes with it."""
    addrs = " ".join(sorted(str(x.address) for x in lk.addresses))
    return f"{lk.kind or 'link'}{' ' + addrs if addrs else ''}"


def _live_addr(ctx: PlanContext, aid: str, version: int) -> IPAddr | None:
    ns = ctx.live.netns.get(aid)
    if not _owned_ns(ctx, ns):
        return None
    eth0 = _inner(ns, ALLOC_IFNAME)
    for a in (eth0.addresses if eth0 else ()):
        if a.owned and a.address.version == version:
            return a.address.ip
    return None


# ------------------------------------------------------------------ IPAM


def _bounds(s: Subnet, version: int) -> tuple[int, int]:
    if version == 4:
        if s.range is not None:
            return int(s.range.start), int(s.range.end)
        return int(s.cidr.network_address) + 1, int(s.cidr.broadcast_address) - 1
    assert s.cidr6 is not None
    return int(s.cidr6.network_address) + 1, int(s.cidr6.broadcast_address)


def _assign(ctx: PlanContext, s: Subnet, members: list[Alloc], version: int) -> dict[str, IPAddr]:
    """Declared addresses, then kept live ones, then the lowest free ones, in id order."""
    make = ipaddress.IPv4Address if version == 4 else ipaddress.IPv6Address
    gateway = s.gateway if version == 4 else s.gateway6
    lo, hi = _bounds(s, version)
    taken: set[int] = {int(gateway)} if gateway is not None else set()
    if not ctx.options.prune:
        # allocations kept undeclared (--no-prune) still hold their addresses
        for name in ctx.live.netns:
            if name not in ctx.desired.allocs and (kept := _live_addr(ctx, name, version)):
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
        cur = _live_addr(ctx, a.id, version)
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


def _live_dnat(ctx: PlanContext) -> dict[str, list[Mapped]]:
    """Live DNAT rules per alloc id, from their comments (both families)."""
    out: dict[str, list[Mapped]] = {}
    rules = (*ctx.live.firewall4.chains.get(("nat", firewall.DNAT), ()),
             *ctx.live.firewall6.chains.get(("nat", firewall.DNAT), ()))
    for d in firewall.dnat_rules(rules):
        out.setdefault(d.alloc, []).append(Mapped.of(d))
    return out


def _docker_published(ctx: PlanContext) -> dict[tuple[str, int], str]:
    """Host ports Docker publishes through DNAT (``nat/DOCKER``, userland proxy off)."""
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
    """Host port of every port map; ``auto`` ports are kept from live rules when possible."""
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
    live = _live_dnat(ctx)
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


# ------------------------------------------------------------------ rules


def alloc_rules(ctx: PlanContext, a: Alloc, addrs: tuple[IPAddr | None, IPAddr | None],
                maps: Iterable[Mapped]) -> None:
    """DNAT from the host ports to the allocation (host, other hosts, localhost)."""
    c = firewall.comment("alloc", a.id)
    for m in maps:
        for rs, addr in ((ctx.rules4, addrs[0]), (ctx.rules6, addrs[1])):
            if addr is None or (m.host_ip is not None and m.host_ip.version != addr.version):
                continue
            dest = f"{addr}:{m.to}" if addr.version == 4 else f"[{addr}]:{m.to}"
            match = ("-d", f"{m.host_ip}/{m.host_ip.max_prefixlen}") if m.host_ip else ()
            rs.add(firewall.DNAT, (*match, "-p", m.proto, "-m", m.proto, "--dport", str(m.host),
                                   *c, "-j", "DNAT", "--to-destination", dest))


def subnet_port_rules(ctx: PlanContext, s: Subnet) -> None:
    """Hairpin and localhost port maps need SNAT back through the host (portmap's snat)."""
    c = firewall.comment("subnet", s.name)
    ctx.rules4.add(firewall.POSTROUTING, ("-s", str(s.cidr), "-d", str(s.cidr), "-o", s.bridge,
                                          "-m", "conntrack", "--ctstate", "DNAT", *c,
                                          "-j", "MASQUERADE"))
    ctx.rules4.add(firewall.POSTROUTING, ("-s", "127.0.0.0/8", "-o", s.bridge, *c,
                                          "-j", "MASQUERADE"))
    if s.cidr6 is not None:
        ctx.rules6.add(firewall.POSTROUTING, ("-s", str(s.cidr6), "-d", str(s.cidr6), "-o",
                                              s.bridge, "-m", "conntrack", "--ctstate", "DNAT",
                                              *c, "-j", "MASQUERADE"))
    # 127.0.0.1 -> alloc: the kernel drops loopback sources leaving a real interface otherwise
    ctx.sysctls[f"net/ipv4/conf/{s.bridge}/route_localnet"] = "1"


# ------------------------------------------------------------------ MACs and neighbours


def mac_clashes(ctx: PlanContext) -> dict[str, str]:
    """Declared allocations whose derived MAC another one on the same bridge derives too:
    id -> the conflict's reason. (46 bits of hash: never seen, but two ``eth0`` with one
    MAC on one bridge would steal each other's frames.)"""
    by_mac: dict[tuple[BridgeName, str], list[str]] = {}
    for aid in sorted(ctx.desired.allocs):
        bridge = ctx.desired.subnets[ctx.desired.allocs[aid].subnet].bridge
        by_mac.setdefault((bridge, ownership.alloc_mac(aid)), []).append(aid)
    out: dict[str, str] = {}
    for (bridge, mac), ids in by_mac.items():
        for one in ids if len(ids) > 1 else ():
            others = ", ".join(repr(o) for o in ids if o != one)
            out[one] = (f"its eth0 MAC {mac} (derived from its id) is also that of alloc "
                        f"{others} on bridge {bridge}: rename one of them")
    return out


def _neighbour_ops(ctx: PlanContext, a: Alloc, bridge: str, addrs: tuple[IPAddr | None, ...],
                   mac: str | None, gone: Sequence[StaleNeighbour] = ()
                   ) -> tuple[list[AttrChange], list[Op]]:
    """Entries of the bridge's neighbour table for the allocation's addresses that name
    another MAC than ``mac`` (eth0's: live, or the derived one it is (re)created with),
    and ``gone``: ours of its MAC for addresses it no longer has (:func:`stale_neighbours`).

    Replaced, not waited out: the kernel would keep sending to the old MAC until
    the entry went stale and its probes failed (40 s and more). A permanent entry
    is someone's on purpose: a warning names it, it is left alone.
    """
    attrs, ops = _deletions(ctx, gone)
    link = ctx.live.links.get(bridge)
    if mac is None or link is None or link.kind != "bridge":
        return attrs, ops
    want = {str(x) for x in addrs if x is not None}
    for n in ctx.neighbours_of(link.index, want):
        if n.mac == mac:
            continue
        if n.permanent:
            ctx.warnings.append(
                f"alloc {a.id!r} ({a.source}): bridge {bridge} has a permanent neighbour entry "
                f"{n.address} lladdr {n.mac}, not eth0's {mac}: traffic to the allocation goes "
                f"to {n.mac}; not ours, left alone (ip neigh del {n.address} dev {bridge})")
            continue
        attrs.append(AttrChange("neighbour", f"{n.address} at {n.mac}", mac))
        ops.append(encode(NeighReplace(bridge, n.address, mac)))
    return attrs, ops


@dataclass(frozen=True)
class StaleNeighbour:
    """One of our neighbour entries on a bridge for an address no allocation has there now."""

    bridge: str
    entry: LiveNeighbour
    #: the allocation whose eth0 MAC it names (declared, or a live namespace of ours);
    #: None when there is none any more (an orphan)
    owner: str | None


def own_neighbour(link: LiveLink, n: LiveNeighbour) -> bool:
    """Did we make neighbour entry ``n``, on ``link``? Only if all of this holds, on the
    object itself: ``link`` is a bridge of ours (our alias) and the entry is on it; it is
    exempt from the kernel's GC (``extern_learn``: the kernel never collects it) and
    carries our protocol (``ownership.NEIGH_PROTO``: what ``Netlink`` seeds and replaces
    with; no other control plane uses 82); it is not permanent (someone's pin).

    Not its MAC: the kernel updates an entry's lladdr from ARP and NDP and keeps its
    flags and protocol, so an allocation whose eth0 took another MAC (a vendor's, say)
    would otherwise leave an entry nobody collects (the review saw it outlive a prune).
    The MAC only says whose change deletes it (:func:`stale_neighbours`).
    """
    return (link.kind == "bridge" and link.owned and n.index == link.index and n.extern_learn
            and n.protocol == ownership.NEIGH_PROTO and not n.permanent)


def stale_neighbours(ctx: PlanContext, addrs: Mapping[str, tuple[IPAddr | None, IPAddr | None]]
                     ) -> list[StaleNeighbour]:
    """Our entries (:func:`own_neighbour`) on the declared bridges for addresses no
    allocation has there: of one pruned, re-addressed or moved to another bridge.

    The kernel never collects them (exempt from its GC), so the plan deletes them: with
    the change of the allocation whose MAC they name (its eth0's, or derived from its id),
    or on their own when that allocation is gone (``owner`` None). Kept: an address of a
    declared allocation on that bridge (a wrong MAC there is :func:`_neighbour_ops`'s),
    any address an undeclared namespace of ours still has when nothing is pruned.
    """
    wanted: set[tuple[str, str]] = set()
    macs: dict[str, str] = {}
    for aid, a in ctx.desired.allocs.items():
        bridge = ctx.desired.subnets[a.subnet].bridge
        wanted.update((bridge, str(x)) for x in addrs.get(aid, ()) if x is not None)
        macs[ownership.alloc_mac(aid)] = aid
    kept: set[str] = set()
    for name, ns in sorted(ctx.live.netns.items()):
        if not _owned_ns(ctx, ns):
            continue
        eth0 = _inner(ns, ALLOC_IFNAME)
        if eth0 is not None and eth0.mac is not None:
            macs.setdefault(eth0.mac, name)
        macs.setdefault(ownership.alloc_mac(name), name)
        if name not in ctx.desired.allocs and not ctx.options.prune:
            kept.update(str(x.address.ip) for x in (eth0.addresses if eth0 else ()))
    out = []
    for bname in sorted(ctx.desired.bridges):
        link = ctx.live.links.get(bname)
        if link is None or f"bridge/{bname}" in ctx.blocked:
            continue
        out += [StaleNeighbour(bname, n, macs.get(n.mac)) for n in ctx.live.neighbours
                if own_neighbour(link, n) and (bname, n.address) not in wanted
                and n.address not in kept]
    return out


def _deletions(ctx: PlanContext, gone: Sequence[StaleNeighbour]
               ) -> tuple[list[AttrChange], list[Op]]:
    """The attributes and ops that delete ``gone`` (recorded as observed: a saved plan is
    applied only while they are as it saw them)."""
    attrs: list[AttrChange] = []
    ops: list[Op] = []
    for g in gone:
        ctx.observed[f"neighbour/{g.bridge}/{g.entry.address}"] = g.entry.mac
        attrs.append(AttrChange("neighbour", f"{g.entry.address} at {g.entry.mac}", None))
        ops.append(encode(NeighDelete(g.bridge, g.entry.address)))
    return attrs, ops


def plan_orphan_neighbours(ctx: PlanContext, gone: Sequence[StaleNeighbour]) -> list[Change]:
    """Our entries whose allocation is gone (no namespace, nothing declared of that MAC):
    a crash between a prune and its deletions, or a namespace deleted by hand. Deleted
    whether pruning or not, like an orphan veth: nothing is left that could use them."""
    changes = []
    for g in gone:
        attrs, ops = _deletions(ctx, (g,))
        changes.append(Change("neighbour", f"{g.bridge}/{g.entry.address}", Action.DELETE,
                              f"orphan: ours (extern_learn, proto {ownership.NEIGH_PROTO}), "
                              "no allocation has this address or MAC", tuple(attrs),
                              tuple(ops)))
    return changes


def seen_addresses(ctx: PlanContext) -> frozenset[tuple[int | None, str]]:
    """Addresses some cache on a segment may hold a MAC for: (bridge index, address) of
    each neighbour entry of the declared bridges (any state observation keeps), and
    (None, address) of each address an allocation namespace of ours has now (one being
    pruned may hand its address to a new one in the same plan; its peers cached it).

    A new allocation announces its addresses only when one of them is here: a gratuitous
    ARP or an unsolicited NA updates entries that exist, and no cache can hold an address
    that was never on the segment. Not announcing keeps a bulk create linear: each
    announcement is flooded to every port of the bridge (O(N^2) frames in all). A bridge
    with a foreign port (a NIC, another tool's veth) leads to caches we cannot see: there
    every new address is announced.
    """
    seen: set[tuple[int | None, str]] = {(n.index, n.address) for n in ctx.live.neighbours}
    # A bridge with a port that is not one of our allocations' veths (a NIC, someone's
    # veth) reaches caches we cannot read: everything on it is announced ("*").
    index = {lk.name: lk.index for lk in ctx.live.links.values() if lk.kind == "bridge"}
    seen.update((index[lk.master], "*") for lk in ctx.live.links.values()
                if lk.master in index and not (lk.kind == "veth" and lk.owned))
    for ns in ctx.live.netns.values():
        if _owned_ns(ctx, ns):
            eth0 = _inner(ns, ALLOC_IFNAME)
            seen.update((None, str(x.address.ip)) for x in (eth0.addresses if eth0 else ()))
    return frozenset(seen)


def _seen(ctx: PlanContext, seen: frozenset[tuple[int | None, str]], bridge: str,
          addrs: tuple[IPAddr | None, ...]) -> bool:
    link = ctx.live.links.get(bridge)
    index = link.index if link is not None else None
    if index is not None and (index, "*") in seen:
        return True
    return any(x is not None and ((index, str(x)) in seen or (None, str(x)) in seen)
               for x in addrs)


# ------------------------------------------------------------------ per alloc


def _view(ctx: PlanContext, aid: str) -> object:
    ns = ctx.live.netns.get(aid)
    veth = ctx.live.links.get(alloc_veth_name(aid))
    return {
        "ns": None if ns is None else {
            "usable": ns.usable,
            "links": sorted((lk.name, lk.kind, lk.mtu, lk.up, lk.owned,
                             tuple(sorted(f"{x.address}{'*' if x.owned else ''}"
                                          for x in lk.addresses))) for lk in ns.links),
            "routes": sorted((r.dst, r.gateway or "", r.owned) for r in ns.routes)},
        "veth": None if veth is None else (veth.master, veth.mtu, veth.up, veth.hairpin,
                                           veth.owned),
        "rules": sorted(r for _chain, r in ctx.live_rules(4).get(f"alloc={aid}", ())),
    }


def plan_alloc(ctx: PlanContext, a: Alloc, addrs: tuple[IPAddr | None, IPAddr | None],
               maps: list[Mapped], clash: str | None = None,
               seen: frozenset[tuple[int | None, str]] = frozenset(),
               left: Sequence[StaleNeighbour] = ()) -> Change:
    """The change of one declared allocation. ``seen``: :func:`seen_addresses`; ``left``:
    our neighbour entries of its MAC for addresses it no longer has (deleted)."""
    s = ctx.desired.subnets[a.subnet]
    b = ctx.desired.bridges[s.bridge]
    src = str(a.source)
    ctx.observed[f"alloc/{a.id}"] = _view(ctx, a.id)
    if f"subnet/{s.name}" in ctx.blocked or f"bridge/{b.name}" in ctx.blocked:
        return Change("alloc", a.id, Action.NOOP, f"blocked by subnet {s.name}", source=src)
    if clash is not None:
        ctx.blocked.add(f"alloc/{a.id}")
        return Change("alloc", a.id, Action.CONFLICT, clash, source=src)
    derived_mac = ownership.alloc_mac(a.id)
    veth_name = alloc_veth_name(a.id)
    v4, v6 = addrs
    want = [f"{v4}/{s.cidr.prefixlen}"]
    gateways = [str(s.gateway)]
    if v6 is not None and s.cidr6 is not None:
        want.append(f"{v6}/{s.cidr6.prefixlen}")
        gateways.append(str(s.gateway6))
    # Hairpin only where a port map needs it (an alloc reaching its own host port comes
    # back out of the port it entered by): on every other port it would only send the
    # alloc its own broadcasts and multicasts back. Ports with hairpin on where the
    # bridge allows it are left alone (a previous version set it on every port).
    hairpin = b.hairpin and bool(a.ports)
    attach = AllocAttach(a.id, veth_name, b.name, b.mtu, hairpin, mac=derived_mac)
    mark = alloc_ns_alias(ctx.live.host_id)
    configure = AllocConfigure(a.id, tuple(want), tuple(gateways), b.mtu, v6 is not None, mark)
    ports = sorted(f"{m.host}/{m.proto}->{m.to}" + (f"@{m.host_ip}" if m.host_ip else "")
                   for m in maps)
    ns = ctx.live.netns.get(a.id)
    veth = ctx.live.links.get(veth_name)
    if _is_own_namespace(ctx, ns):
        ctx.blocked.add(f"alloc/{a.id}")
        return Change("alloc", a.id, Action.CONFLICT,
                      f"network namespace {a.id} is the one the reconciler runs in (--netns "
                      f"{a.id}): it cannot be an allocation (its veth would loop back into "
                      "it); give the allocation another id", source=src)
    if veth is not None and not _veth_is_ours(ctx, a.id, veth, ns):
        ctx.blocked.add(f"alloc/{a.id}")
        return Change("alloc", a.id, Action.CONFLICT,
                      f"host link {veth_name} (the name of this allocation's veth) exists "
                      f"but is not the reconciler's ({_describe_link(veth)}, no mark, peer "
                      "not in the allocation's namespace): it is left alone (remove or "
                      "rename it)", source=src)
    stale_veth = [encode(LinkDelete(veth_name))] if veth is not None else []
    if (ns is not None and not ns.usable and ns.file_mark != mark
            and not ctx.adopted("alloc", a.id)):
        # an empty file under /run/netns is someone's too (`ip netns add` between its
        # create and its mount, a tool that keeps the name): only our xattr proves it ours
        ctx.blocked.add(f"alloc/{a.id}")
        return Change("alloc", a.id, Action.CONFLICT,
                      f"/run/netns/{a.id} exists, is not a live namespace and was not "
                      "made by the reconciler (no mark on the file): it is left alone "
                      f"(--adopt alloc/{a.id} replaces it)", source=src)

    if ns is None or not ns.usable:
        # a veth left behind: its namespace (and eth0, with these addresses) may live on
        announce = bool(stale_veth) or _seen(ctx, seen, b.name, addrs)
        configure = dataclasses.replace(configure, announce=announce)
        attrs = (AttrChange("subnet", None, s.name), AttrChange("address", None, want[0]),
                 *((AttrChange("address6", None, want[1]),) if len(want) > 1 else ()),
                 *((AttrChange("ports", None, ports),) if ports else ()),
                 AttrChange("mac", None, derived_mac))
        neigh_attrs, neigh_ops = _neighbour_ops(ctx, a, b.name, addrs, derived_mac, left)
        attrs += tuple(neigh_attrs)
        made = (*stale_veth, encode(NetnsCreate(a.id, ns is not None, mark)), encode(attach),
                encode(configure), *neigh_ops)
        if ns is not None:
            return Change("alloc", a.id, Action.REPLACE,
                          f"/run/netns/{a.id} exists but is not a live namespace",
                          attrs, made, src)
        reason = "not present" if veth is None else "namespace missing (veth left behind)"
        return Change("alloc", a.id, Action.CREATE, reason, attrs, made, src)
    if not _owned_ns(ctx, ns) and not ctx.adopted("alloc", a.id):
        ctx.blocked.add(f"alloc/{a.id}")
        return Change("alloc", a.id, Action.CONFLICT,
                      f"network namespace {a.id} exists but was not created by the reconciler "
                      f"(--adopt alloc/{a.id} takes it over)", source=src)

    attrs_l: list[AttrChange] = []
    ops: list[Op] = []
    eth0 = _inner(ns, ALLOC_IFNAME)
    if not veth_pair_ok(ns, veth):
        attrs_l.append(AttrChange("veth", "missing" if veth is None or eth0 is None
                                  else "wrong peer", veth_name))
        # every deletion is said in the plan, not only in -v's ops: an adopted namespace's
        # own eth0 (and its addresses and routes) goes here
        if eth0 is not None:
            attrs_l.append(AttrChange(f"{ALLOC_IFNAME} inside", _describe_link(eth0),
                                      "deleted (the new veth's peer takes its place)"))
            ops.append(encode(LinkDelete(ALLOC_IFNAME, netns=a.id)))
        if veth is not None:
            attrs_l.append(AttrChange(f"host {veth_name}", _describe_link(veth),
                                      "deleted (re-created)"))
        # a default route through another link of the namespace is replaced by ours
        gone = eth0.index if eth0 is not None else None
        for r in ns.routes:
            if (r.dst == "default" and r.gateway is not None and r.gateway not in gateways
                    and (gone is None or r.oif != gone)
                    and any(ipaddress.ip_address(g).version
                            == ipaddress.ip_address(r.gateway).version for g in gateways)):
                attrs_l.append(AttrChange("default route", f"via {r.gateway} (replaced)",
                                          "via the gateway"))
        ops += stale_veth
        # a heal: whoever talked to eth0 caches the MAC of the one that went
        ops += [encode(attach), encode(dataclasses.replace(configure, announce=True))]
        eth0_mac: str | None = derived_mac  # what the new eth0 will have
    else:
        assert veth is not None and eth0 is not None
        if veth.master != b.name:
            attrs_l.append(AttrChange("bridge", veth.master, b.name))
            ops.append(encode(LinkSet(veth_name, master=b.name)))
            # a new bridge port starts with hairpin off: set it where it is wanted
            if hairpin:
                ops.append(encode(LinkSetHairpin(veth_name, True)))
        elif (veth.hairpin is not None and veth.hairpin != hairpin
              and not (veth.hairpin and b.hairpin)):
            attrs_l.append(AttrChange("hairpin", veth.hairpin, hairpin))
            ops.append(encode(LinkSetHairpin(veth_name, hairpin)))
        if b.mtu is not None and veth.mtu != b.mtu:
            attrs_l.append(AttrChange("mtu", veth.mtu, b.mtu))
            ops.append(encode(LinkSet(veth_name, mtu=b.mtu)))
        if not veth.up or not veth.owned:
            attrs_l.append(AttrChange("veth", "down" if not veth.up else "unmarked", "up"))
            ops.append(encode(LinkSet.up_owned(veth_name)))
        have = {str(x.address) for x in eth0.addresses if x.owned}
        for stale in sorted(have - set(want)):
            attrs_l.append(AttrChange("address", stale, None))
            ops.append(encode(AddrDel(ALLOC_IFNAME, stale, netns=a.id)))
        inside_ok = True
        unowned = {str(x.address) for x in eth0.addresses if not x.owned}
        for w in want:
            if w not in have:
                attrs_l.append(AttrChange("address6" if ":" in w else "address", None, w))
                inside_ok = False
                # (re)added to a live allocation: announced (its peers may know it elsewhere)
                configure = dataclasses.replace(configure, announce=True)
                if w in unowned:
                    # there, but without our tag (an adopted namespace): re-add it as ours,
                    # or configure would take "exists" for done and never converge
                    ops.append(encode(AddrDel(ALLOC_IFNAME, w, netns=a.id)))
        for gw in gateways:
            if not any(r.dst == "default" and r.gateway == gw for r in ns.routes):
                family = ipaddress.ip_address(gw).version
                # a default route there (an adopted namespace's own) is replaced: say so
                old = [f"via {r.gateway} (replaced)" for r in ns.routes
                       if r.dst == "default" and r.gateway is not None
                       and ipaddress.ip_address(r.gateway).version == family]
                attrs_l.append(AttrChange("default route", old[0] if old else None,
                                          f"via {gw}"))
                inside_ok = False
        # our default route of a family the subnet no longer has (cidr6 dropped): the
        # kernel keeps an IPv6 route via a gateway after the address is gone
        versions = {ipaddress.ip_address(g).version for g in gateways}
        for r in ns.routes:
            if r.dst == "default" and r.owned and r.gateway is not None:
                version = ipaddress.ip_address(r.gateway).version
                if version not in versions:
                    attrs_l.append(AttrChange("default route", f"via {r.gateway}", None))
                    ops.append(encode(RouteDelDefault(version, a.id)))
                    versions.add(version)  # one delete per family
        lo = _inner(ns, "lo")
        if (lo is None or not lo.up or lo.alias != mark or not eth0.up
                or (b.mtu is not None and eth0.mtu != b.mtu)):
            attrs_l.append(AttrChange("links inside", "down or wrong MTU", "up"))
            inside_ok = False
        if not inside_ok:
            ops.append(encode(configure))
        eth0_mac = eth0.mac  # kept, whatever it is: no churn of allocations made before
    neigh_attrs, neigh_ops = _neighbour_ops(ctx, a, b.name, addrs, eth0_mac, left)
    attrs_l += neigh_attrs
    ops += neigh_ops
    if not ops:
        return Change("alloc", a.id, Action.NOOP, source=src)
    return Change("alloc", a.id, Action.UPDATE,
                  "changed: " + ", ".join(dict.fromkeys(x.field for x in attrs_l)),
                  tuple(attrs_l), tuple(ops), src)


def plan_pruned(ctx: PlanContext,
                gone: Mapping[str, Sequence[StaleNeighbour]] | None = None) -> list[Change]:
    """Owned namespaces no file declares, and owned veths whose namespace is gone.
    ``gone``: our bridge-side neighbour entries of each (by name), deleted with it."""
    changes: list[Change] = []
    veth_of = {alloc_veth_name(n): n for n in ctx.live.netns}
    veth_of.update({alloc_veth_name(a): a for a in ctx.desired.allocs})
    mark = alloc_ns_alias(ctx.live.host_id)
    for name in sorted(ctx.live.netns):
        ns = ctx.live.netns[name]
        if name in ctx.desired.allocs:
            continue
        if not ns.usable and ns.file_mark == mark:
            # the empty file a crash between unmount and unlink left: always garbage
            ctx.observed[f"alloc/{name}"] = {"file_mark": mark}
            changes.append(Change("alloc", name, Action.DELETE,
                                  "leftover file of a deleted namespace", (),
                                  (encode(NetnsDelete(name)),)))
            continue
        if not _owned_ns(ctx, ns) or _is_own_namespace(ctx, ns):
            continue
        ctx.observed[f"alloc/{name}"] = _view(ctx, name)
        if ctx.options.prune:
            attrs, neigh_ops = _deletions(ctx, (gone or {}).get(name, ()))
            changes.append(Change("alloc", name, Action.DELETE, "no longer declared",
                                  tuple(attrs), (encode(NetnsDelete(name)), *neigh_ops)))
    for lname, lk in sorted(ctx.live.links.items()):
        if lk.kind != "veth" or not lk.owned or lname in veth_of:
            continue
        # an owned veth whose allocation namespace is gone (kill -9 mid-create, or the
        # namespace file was removed while something kept the namespace alive)
        ctx.observed[f"veth/{lname}"] = (lk.master, lk.peer_netnsid)
        changes.append(Change("veth", lname, Action.DELETE,
                              "orphan: its allocation namespace is gone", (),
                              (encode(LinkDelete(lname)),)))
    return changes


def counted_neighbours(ctx: PlanContext) -> dict[int, int]:
    """IP version -> how many entries of the declared bridges for addresses of their
    subnets count toward the kernel's limit (neither ``extern_learn`` nor permanent)."""
    served: dict[int, list[ipaddress.IPv4Network | ipaddress.IPv6Network]] = {}
    for s in ctx.desired.subnets.values():
        link = ctx.live.links.get(s.bridge)
        if link is not None and link.kind == "bridge":
            served.setdefault(link.index, []).extend(
                net for net in (s.cidr, s.cidr6) if net is not None)
    out = {4: 0, 6: 0}
    for n in ctx.live.neighbours:
        if n.extern_learn or n.permanent:
            continue
        ip = ipaddress.ip_address(n.address)
        if any(ip.version == net.version and ip in net for net in served.get(n.index, ())):
            out[ip.version] += 1
    return out


def neighbour_table_warnings(ctx: PlanContext) -> None:
    """Warn when our allocations' neighbour entries that the kernel counts may pass its limit.

    The ARP and NDISC tables are one each for every namespace of the machine, and
    ``gc_thresh3`` is a hard limit on the entries that count: past it, resolving a new
    neighbour fails ("neighbour table overflow") and the packets waiting for it are
    dropped, so some allocations are unreachable however right their configuration is
    (the probes of 1000 allocations found it: 3,416 failures at the default 1024).

    The entries this version seeds for a new allocation (its addresses on the bridge,
    its gateways inside) are exempt (``extern_learn``, kernel >= 5.0) and do not count:
    a first apply of any number of allocations warns of nothing. What still counts is
    what the plan can see on the declared bridges: plain entries for the subnets'
    addresses, seeded by an older version (whose allocations then have a plain gateway
    entry inside too: counted twice, an upper bound) or learnt by the kernel (an address
    added to a live allocation is not seeded). Entries inside the namespaces for one
    another (allocations talking directly) count too and are not seen here.
    """
    counted = counted_neighbours(ctx)
    for family, key in ((4, "net/ipv4/neigh/default/gc_thresh3"),
                        (6, "net/ipv6/neigh/default/gc_thresh3")):
        raw = ctx.live.sysctls.get(key)
        if raw is None or not raw.strip().isdigit() or not counted[family]:
            continue
        limit, need = int(raw), 2 * counted[family]
        if need > limit:
            ctx.warnings.append(
                f"{counted[family]} IPv{family} neighbour entries of the allocations' bridges "
                f"are not exempt from the kernel's GC (made by an older version, or learnt): "
                f"with their gateways' inside up to {need}, but the kernel keeps at most "
                f"{limit} for all namespaces ({key.replace('/', '.')}): past it, traffic to "
                f"some allocations is dropped (neighbour table overflow); raise it (and "
                f"gc_thresh2) above {need}")


def plan_allocs(ctx: PlanContext) -> list[Change]:
    neighbour_table_warnings(ctx)
    addrs = assign_addresses(ctx)
    ports = assign_ports(ctx)
    if ctx.fatal:
        return []
    changes = []
    with_ports: set[SubnetName] = set()
    clashes = mac_clashes(ctx)
    seen = seen_addresses(ctx)
    gone: dict[str | None, list[StaleNeighbour]] = {}
    for g in stale_neighbours(ctx, addrs):
        gone.setdefault(g.owner, []).append(g)
    for aid in sorted(ctx.desired.allocs):
        a = ctx.desired.allocs[aid]
        change = plan_alloc(ctx, a, addrs[aid], ports[aid], clashes.get(aid), seen,
                            gone.get(aid, ()))
        changes.append(change)
        if change.action is Action.CONFLICT or f"subnet/{a.subnet}" in ctx.blocked:
            continue  # nothing of a blocked alloc reaches the firewall
        alloc_rules(ctx, a, addrs[aid], ports[aid])
        if a.ports:
            with_ports.add(a.subnet)
    for sname in sorted(with_ports):
        subnet_port_rules(ctx, ctx.desired.subnets[sname])
    changes += plan_pruned(ctx, {k: v for k, v in gone.items() if k is not None})
    changes += plan_orphan_neighbours(ctx, gone.get(None, ()))
    return changes
