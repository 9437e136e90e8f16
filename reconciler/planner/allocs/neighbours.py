"""Allocations' MACs and the bridges' neighbour entries they need replaced or deleted.

See docs/decisions/010-stable-identities.md.
See docs/decisions/012-our-neighbour-entries.md.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from reconciler.domain import ownership
from reconciler.domain.live import LiveLink, LiveNeighbour
from reconciler.domain.model import Alloc, BridgeName
from reconciler.domain.ops import (
    NeighDelete,
    NeighReplace,
    encode,
)
from reconciler.domain.ownership import ALLOC_IFNAME
from reconciler.domain.plan import Action, AttrChange, Change, Op
from reconciler.planner.allocs.live import IPAddr, inner_link, is_ours
from reconciler.planner.context import PlanContext


def mac_clashes(ctx: PlanContext) -> dict[str, str]:
    """Find declared allocations whose derived MAC another one on the same bridge derives too:
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


def neighbour_ops(ctx: PlanContext, a: Alloc, bridge: str, addrs: tuple[IPAddr | None, ...],
                   mac: str | None, gone: Sequence[StaleNeighbour] = ()
                   ) -> tuple[list[AttrChange], list[Op]]:
    """Plan what fixes the entries of the bridge's neighbour table for the allocation's
    addresses that name another MAC than ``mac`` (eth0's: live, or the derived one it is
    (re)created with), and ``gone``: ours of its MAC for addresses it no longer has
    (:func:`stale_neighbours`).

    Replaced, not waited out: the kernel would keep sending to the old MAC until
    the entry went stale and its probes failed (40 s and more). A permanent entry
    is someone's on purpose: a warning names it, it is left alone.
    """
    attrs, ops = neighbour_deletions(ctx, gone)
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
    """Tell whether we made neighbour entry ``n``, on ``link``. Only if all of this holds, on the
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
    """Find our entries (:func:`own_neighbour`) on the declared bridges for addresses no
    allocation has there: of one pruned, re-addressed or moved to another bridge.

    The kernel never collects them (exempt from its GC), so the plan deletes them: with
    the change of the allocation whose MAC they name (its eth0's, or derived from its id),
    or on their own when that allocation is gone (``owner`` None). Kept: an address of a
    declared allocation on that bridge (a wrong MAC there is :func:`neighbour_ops`'s),
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
        if not is_ours(ctx, ns):
            continue
        eth0 = inner_link(ns, ALLOC_IFNAME)
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


def neighbour_deletions(ctx: PlanContext, gone: Sequence[StaleNeighbour]
               ) -> tuple[list[AttrChange], list[Op]]:
    """Return the attributes and ops that delete ``gone`` (recorded as observed: a saved plan is
    applied only while they are as it saw them)."""
    attrs: list[AttrChange] = []
    ops: list[Op] = []
    for g in gone:
        ctx.observed[f"neighbour/{g.bridge}/{g.entry.address}"] = g.entry.mac
        attrs.append(AttrChange("neighbour", f"{g.entry.address} at {g.entry.mac}", None))
        ops.append(encode(NeighDelete(g.bridge, g.entry.address)))
    return attrs, ops


def plan_orphan_neighbours(ctx: PlanContext, gone: Sequence[StaleNeighbour]) -> list[Change]:
    """Plan the deletion of our entries whose allocation is gone (no namespace, nothing
    declared of that MAC): a crash between a prune and its deletions, or a namespace deleted
    by hand. Deleted whether pruning or not, like an orphan veth: nothing is left that could
    use them."""
    changes = []
    for g in gone:
        attrs, ops = neighbour_deletions(ctx, (g,))
        changes.append(Change("neighbour", f"{g.bridge}/{g.entry.address}", Action.DELETE,
                              f"orphan: ours (extern_learn, proto {ownership.NEIGH_PROTO}), "
                              "no allocation has this address or MAC", tuple(attrs),
                              tuple(ops)))
    return changes


def seen_addresses(ctx: PlanContext) -> frozenset[tuple[int | None, str]]:
    """Return the addresses some cache on a segment may hold a MAC for: (bridge index, address) of
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
        if is_ours(ctx, ns):
            eth0 = inner_link(ns, ALLOC_IFNAME)
            seen.update((None, str(x.address.ip)) for x in (eth0.addresses if eth0 else ()))
    return frozenset(seen)


def was_seen(ctx: PlanContext, seen: frozenset[tuple[int | None, str]], bridge: str,
          addrs: tuple[IPAddr | None, ...]) -> bool:
    link = ctx.live.links.get(bridge)
    index = link.index if link is not None else None
    if index is not None and (index, "*") in seen:
        return True
    return any(x is not None and ((index, str(x)) in seen or (None, str(x)) in seen)
               for x in addrs)


def counted_neighbours(ctx: PlanContext) -> dict[int, int]:
    """Count, per IP version, the entries of the declared bridges for addresses of their
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
