"""Planning of bridges and subnets (pure).

See docs/decisions/013-clean-transitions.md.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import replace

from reconciler.domain.live import LiveLink
from reconciler.domain.model import Bridge, Subnet, SubnetName
from reconciler.domain.ops import (
    AddrAdd,
    AddrDel,
    LinkAddBridge,
    LinkDelete,
    LinkSet,
    LinkSetMac,
    encode,
)
from reconciler.domain.ownership import ZERO_MAC, alloc_veth_name, bridge_mac, temp_bridge_mac
from reconciler.domain.plan import Action, AttrChange, Change, Op
from reconciler.planner import firewall, nftview
from reconciler.planner.context import PlanContext
from reconciler.planner.leases import choose, valid_mac


def _link_view(link: LiveLink | None) -> object:
    if link is None:
        return None
    return {"kind": link.kind, "mtu": link.mtu, "up": link.up, "owned": link.owned,
            "addresses": sorted(f"{a.address}{'*' if a.owned else ''}" for a in link.addresses)}


def _managed_bridge(ctx: PlanContext, name: str) -> LiveLink | None:
    """Return the live bridge if it is ours (or being adopted); None otherwise."""
    link = ctx.live.links.get(name)
    if link is None or link.kind != "bridge":
        return None
    if link.owned or ctx.adopted("bridge", name):
        return link
    return None


def plan_bridge(ctx: PlanContext, b: Bridge) -> Change:
    link = ctx.live.links.get(b.name)
    ctx.observed[f"bridge/{b.name}"] = _link_view(link)
    src = str(b.source)
    mac = _choose_mac(ctx, b.name, link)
    if link is None:
        created = [AttrChange("mtu", None, b.mtu)] if b.mtu else []
        created.append(AttrChange("hairpin", None, b.hairpin))
        created.append(AttrChange("mac", None, mac))
        return Change("bridge", b.name, Action.CREATE, "not present", tuple(created),
                      (encode(LinkAddBridge(b.name, b.mtu, mac=mac)),), src)
    if link.kind != "bridge":
        ctx.blocked.add(f"bridge/{b.name}")
        what = f"a {link.kind} link" if link.kind else "a device"
        return Change("bridge", b.name, Action.CONFLICT,
                      f"{what} named {b.name} exists and is not a bridge; it is left alone",
                      source=src)
    if not link.owned and not ctx.adopted("bridge", b.name):
        ctx.blocked.add(f"bridge/{b.name}")
        return Change("bridge", b.name, Action.CONFLICT,
                      "exists but was not created by the reconciler; it is left alone "
                      f"(--adopt bridge/{b.name} takes it over)", source=src)
    attrs: list[AttrChange] = []
    ops: list[Op] = []
    adopt = not link.owned
    mtu = b.mtu if b.mtu is not None and link.mtu != b.mtu else None
    up = None if link.up else True
    if adopt:
        attrs.append(AttrChange("owner", "foreign", "reconciler"))
    if mtu is not None:
        attrs.append(AttrChange("mtu", link.mtu, mtu))
    if up:
        attrs.append(AttrChange("up", False, True))
    if attrs:
        ops.append(encode(LinkSet(b.name, owned=adopt, mtu=mtu, up=up)))
    if link.mac_pinned is False:  # set (its lease): it stops following its ports
        attrs.append(AttrChange("mac", link.mac, f"pin {mac}"))
        ops.append(encode(LinkSetMac(b.name, mac)))
    elif link.mac is not None and link.mac != mac:  # changed by hand: back to its lease
        attrs.append(AttrChange("mac", link.mac, mac))
        ops.append(encode(LinkSetMac(b.name, mac)))
    stray = sorted(str(a.address) for a in link.addresses
                   if a.owned and (b.name, str(a.address)) not in ctx.claimed_addresses)
    if stray:
        attrs.append(AttrChange("addresses", stray, []))
        ops.extend(encode(AddrDel(b.name, a)) for a in stray)
    if not ops:
        return Change("bridge", b.name, Action.NOOP, source=src)
    reason = "adopt" if not link.owned else "changed: " + ", ".join(a.field for a in attrs)
    return Change("bridge", b.name, Action.UPDATE, reason, tuple(attrs), tuple(ops), src)


def _choose_mac(ctx: PlanContext, name: str, link: LiveLink | None) -> str:
    """Choose a declared bridge's MAC: its lease; else (no lease yet) the one the live bridge
    has when it is ours (a bridge made before stable MACs keeps it: its allocations have it
    cached as their gateway's); else the derived one (``ownership.bridge_mac``), also for a
    bridge without ports (00:00:..)."""
    live = None
    if (link is not None and link.kind == "bridge" and (link.owned or ctx.adopted("bridge", name))
            and link.mac not in (None, ZERO_MAC)):
        live = link.mac
    lease = ctx.picks.lease(f"bridge/{name}", "mac")
    derived = bridge_mac(name)
    mac, source, dropped = choose(None, str(lease) if lease is not None else None, live,
                                  valid=valid_mac, pick=lambda: derived)
    if dropped:
        ctx.picks.dropped(f"bridge/{name}", "mac", "is not a unicast MAC")
    assert mac is not None
    ctx.picks.record(f"bridge/{name}", "mac", mac, source)
    return mac


def _wanted_addresses(s: Subnet) -> list[str]:
    out = [str(s.gateway_interface)]
    if s.gateway6_interface is not None:
        out.append(str(s.gateway6_interface))
    return out


def mark_blocked_bridges(ctx: PlanContext) -> None:
    """Mark bridges that are conflicts, which block their subnets and allocs: know it before
    planning them."""
    for name in ctx.desired.bridges:
        link = ctx.live.links.get(name)
        if link is not None and (link.kind != "bridge" or
                                 (not link.owned and not ctx.adopted("bridge", name))):
            ctx.blocked.add(f"bridge/{name}")


def plan_subnet(ctx: PlanContext, s: Subnet) -> Change:
    src = str(s.source)
    if f"bridge/{s.bridge}" in ctx.blocked:
        ctx.blocked.add(f"subnet/{s.name}")
        ctx.observed[f"subnet/{s.name}"] = {"blocked": s.bridge}
        return Change("subnet", s.name, Action.NOOP, f"blocked by bridge {s.bridge}", source=src)
    wanted = _wanted_addresses(s)
    for a in wanted:
        ctx.claimed_addresses.add((s.bridge, a))
    link = ctx.live.links.get(s.bridge)
    ctx.observed[f"subnet/{s.name}"] = {
        "bridge": _link_view(link),
        "rules4": _rules_of(ctx, 4, f"subnet={s.name}"),
        "rules6": _rules_of(ctx, 6, f"subnet={s.name}"),
    }
    overlap = ctx.overlaps.get(f"subnet/{s.name}")
    if overlap is not None:
        # blocked, with its allocations: what exists of it (its rules, its gateway) stays
        ctx.blocked.add(f"subnet/{s.name}")
        return Change("subnet", s.name, Action.CONFLICT, overlap, source=src)
    ctx.sysctls["net/ipv4/ip_forward"] = "1"
    if s.cidr6 is not None:
        ctx.sysctls["net/ipv6/conf/all/forwarding"] = "1"
    firewall.subnet_rules(ctx.rules4, s)
    firewall.subnet_rules(ctx.rules6, s)
    managed = _managed_bridge(ctx, s.bridge)
    have = {str(a.address): a for a in (managed.addresses if managed else ())}
    ops: list[Op] = []
    attrs: list[AttrChange] = []
    deleted: list[AttrChange] = []  # what adopting removes: shown whatever the action
    for w in wanted:
        iface = ipaddress.ip_interface(w)
        cur = have.get(w)
        if cur is not None and cur.owned:
            continue
        if cur is not None and not cur.owned:
            # The gateway address is there but someone else put it there (forceAddress).
            if not ctx.adopted("subnet", s.name) and not ctx.adopted("bridge", s.bridge):
                ctx.blocked.add(f"subnet/{s.name}")
                return Change("subnet", s.name, Action.CONFLICT,
                              f"address {w} on bridge {s.bridge} was not added by the "
                              f"reconciler (--adopt subnet/{s.name} takes it over)", source=src)
            ops.append(encode(AddrDel(s.bridge, w)))
        for other in have.values():
            o = other.address
            if (not other.owned and o.version == iface.version and str(o) != w
                    and o.network.overlaps(iface.network)):
                if not ctx.adopted("subnet", s.name):
                    ctx.blocked.add(f"subnet/{s.name}")
                    return Change("subnet", s.name, Action.CONFLICT,
                                  f"bridge {s.bridge} has address {o} that the reconciler did "
                                  f"not add and that overlaps {iface.network} "
                                  f"(--adopt subnet/{s.name} replaces it)", source=src)
                ops.append(encode(AddrDel(s.bridge, str(o))))
                # said in the plan, not only in -v's ops: adopting deletes it
                deleted.append(AttrChange(f"address {o} (not ours)", str(o), "deleted"))
        attrs.append(AttrChange("gateway" if iface.version == 4 else "gateway6", None, w))
        ops.append(encode(AddrAdd(s.bridge, w)))
    exists = managed is not None and (len(wanted) > len(attrs) or
                                      any(_rules_of(ctx, f, f"subnet={s.name}") for f in (4, 6)))
    if not exists:
        picked = ctx.picked.get(f"subnet/{s.name}", {})

        def shown(field: str, net: object) -> str:
            return f"{net} (auto from {picked[field]})" if field in picked else str(net)

        attrs = [AttrChange("bridge", None, s.bridge),
                 AttrChange("cidr", None, shown("cidr", s.cidr))]
        if s.cidr6 is not None:
            attrs.append(AttrChange("cidr6", None, shown("cidr6", s.cidr6)))
        attrs += [AttrChange("gateway", None, str(s.gateway_interface)),
                  AttrChange("masquerade", None, s.masquerade), *deleted]
        return Change("subnet", s.name, Action.CREATE, "not present", tuple(attrs),
                      tuple(ops), src)
    attrs += deleted
    if not attrs:
        return Change("subnet", s.name, Action.NOOP, source=src)
    reason = ", ".join(a.field for a in attrs) + " missing or different"
    return Change("subnet", s.name, Action.UPDATE, reason, tuple(attrs), tuple(ops), src)


def _rules_of(ctx: PlanContext, family: int, owner: str) -> list[str]:
    return [f"{chain} {r}" for chain, r in ctx.live_rules(family).get(owner, ())]


def annotate_rules(ctx: PlanContext, changes: list[Change]) -> list[Change]:
    """Say on each unchanged subnet whose rules differ that they do (once all rules are known).

    The firewall change does the work; this tells the reader which subnet it is for.
    """
    wanted = {f: firewall.by_owner(rs.chains.items())
              for f, rs in ((4, ctx.rules4), (6, ctx.rules6))}
    live = {(e.set, e.key, e.data) for e in ctx.live.table.entries}

    def differ(family: int, owner: str) -> bool:
        # compared as our table's entries: a key two subnets share (a bridge's) is held
        # once, under the first owner, and is the other's too
        want = {(e.set, e.key, e.data) for chain, r in wanted[family].get(owner, ())
                if (e := nftview.entry_of(family, chain, r)) is not None}
        held = {(e.set, e.key, e.data) for e in ctx.live.table.entries
                if e.owner == owner and nftview.family_of(e) == family}
        return bool(want - live or held - want)

    out = []
    for c in changes:
        s = ctx.desired.subnets.get(SubnetName(c.name)) if c.kind == "subnet" else None
        if s is not None and c.action is Action.NOOP and f"subnet/{s.name}" not in ctx.blocked:
            families = [f"ipv{f}" for f in (4, 6) if differ(f, f"subnet={s.name}")]
            if families:
                c = Change("subnet", s.name, Action.UPDATE,
                           f"firewall rules missing or different ({', '.join(families)})",
                           (AttrChange("firewall rules", "differ", "as declared"),),
                           source=c.source)
        out.append(c)
    return out


def plan_pruned_subnets(ctx: PlanContext) -> list[Change]:
    """Plan the removal of subnets whose rules are live but which no file declares any more."""
    found: dict[str, tuple[str | None, set[str]]] = {}
    for family in (4, 6):
        for owner, rules in ctx.live_rules(family).items():
            kind, _, name = owner.partition("=")
            if kind != "subnet" or name in ctx.desired.subnets:
                continue
            for _chain, r in rules:
                toks = r.split()
                bridge, cidrs = found.setdefault(name, (None, set()))
                if "-o" in toks:
                    bridge = toks[toks.index("-o") + 1]
                if "-d" in toks and "!" not in toks:
                    cidrs.add(toks[toks.index("-d") + 1])
                found[name] = (bridge, cidrs)
    changes = []
    for name in sorted(found):
        bridge, cidrs = found[name]
        ctx.observed[f"subnet/{name}"] = {"bridge": bridge, "cidrs": sorted(cidrs)}
        ops = []
        managed = _managed_bridge(ctx, bridge) if bridge else None
        if managed is not None and bridge is not None:
            for a in managed.addresses:
                if a.owned and any(a.address.ip in ipaddress.ip_network(c) for c in cidrs) \
                        and (bridge, str(a.address)) not in ctx.claimed_addresses:
                    # claimed either way: with --no-prune the gateway stays, it is no stray
                    ops.append(encode(AddrDel(bridge, str(a.address))))
                    ctx.claimed_addresses.add((bridge, str(a.address)))
        if not ctx.options.prune:
            continue
        changes.append(Change("subnet", name, Action.DELETE, "no longer declared",
                              (AttrChange("cidr", sorted(cidrs), None),), tuple(ops)))
    return changes


_TEMP_BRIDGE = re.compile(r"^rcltmp[0-9a-f]{8}$")


def is_temp_bridge_name(name: str) -> bool:
    """Tell whether ``name`` is the one links.ensure_bridge gives a bridge until it is marked and
    renamed."""
    return bool(_TEMP_BRIDGE.match(name))


def interrupted_creation(links: Mapping[str, LiveLink], name: str) -> bool:
    """Tell whether ``name`` is the temporary bridge of a creation killed before it was renamed
    (links.ensure_bridge).

    Bare (no ports, no addresses, down) under a temporary name, and marked: its alias
    once the creation got that far, before that the MAC it was created with
    (``temp_bridge_mac``). The name alone is no proof: anyone may call a bridge so, and
    an unmarked one is left alone. Always garbage, so removed with ``--no-prune`` too;
    ``planner.gc`` checks its candidates with this same test.
    """
    link = links.get(name)
    return (link is not None and link.kind == "bridge" and not link.up and not link.addresses
            and bool(_TEMP_BRIDGE.match(name))
            and (link.owned or link.mac == temp_bridge_mac(name))
            and not any(lk.master == name for lk in links.values()))


def plan_pruned_bridges(ctx: PlanContext) -> list[Change]:
    changes = []
    for name, link in sorted(ctx.live.links.items()):
        if interrupted_creation(ctx.live.links, name):
            ctx.observed[f"bridge/{name}"] = _link_view(link)
            changes.append(Change("bridge", name, Action.DELETE,
                                  "leftover of an interrupted bridge creation", (),
                                  (encode(LinkDelete(name)),)))
            continue
        if link.kind != "bridge" or not link.owned or name in ctx.desired.bridges:
            continue
        ctx.observed[f"bridge/{name}"] = _link_view(link)
        if ctx.options.prune:
            changes.append(Change("bridge", name, Action.DELETE, "no longer declared", (),
                                  (encode(LinkDelete(name)),)))
    return changes


#: the MTU the kernel gives a bridge without ports whose MTU was not set (ETH_DATA_LEN)
KERNEL_BRIDGE_MTU = 1500

#: the reason of a declared bridge's change that only sets its MTU again after the plan
#: removed its last ports (``planner.gc`` keeps such a change with the deletions)
KEEPS_MTU_REASON = "its last ports go: the kernel resets its MTU then"


def keep_mtu_of_emptied_bridges(ctx: PlanContext, changes: list[Change]) -> list[Change]:
    """Keep the MTU of a declared bridge whose last ports the plan removes, in the same run.

    The kernel sets the MTU of a bridge to 1500 when its last port leaves unless the
    MTU was set by a change after creation (``br_mtu_auto_adjust``; an MTU given at
    creation does not count, so bridges made by earlier versions reset). And a pruned
    allocation's veth leaves when the kernel destroys its namespace, asynchronously,
    after the run has moved on. So the veths of those last ports are first taken off
    the bridge, synchronously (``LinkSet(master="")`` before ``NetnsDelete``: well
    under a millisecond each, where deleting a veth waits ~20-35 ms for RCU), and the
    bridge's MTU is set again after the deletes: a change from 1500 that also marks
    it set, so the next time it stays by itself.
    """
    going = {c.name for c in changes if c.kind == "veth" and c.action is Action.DELETE}
    pruned = {alloc_veth_name(c.name): c.name for c in changes
              if c.kind == "alloc" and c.action is Action.DELETE}
    going |= set(pruned)
    emptied: dict[str, int] = {}
    for name in sorted(ctx.desired.bridges):
        b = ctx.desired.bridges[name]
        link = _managed_bridge(ctx, name)
        if b.mtu in (None, KERNEL_BRIDGE_MTU) or link is None or f"bridge/{name}" in ctx.blocked:
            continue
        ports = [lname for lname, lk in ctx.live.links.items() if lk.master == name]
        if ports and set(ports) <= going:
            emptied[name] = b.mtu
    if not emptied:
        return changes
    ports_of_emptied = {pruned[v] for v, lk in ctx.live.links.items()
                        if v in pruned and lk.master in emptied}
    out = []
    for c in changes:
        if c.kind == "alloc" and c.name in ports_of_emptied:
            c = replace(c, ops=(encode(LinkSet(alloc_veth_name(c.name), master="")), *c.ops))
        elif c.kind == "bridge" and c.name in emptied and c.action in (Action.NOOP,
                                                                       Action.UPDATE):
            mtu = emptied[c.name]
            again = AttrChange("mtu", f"{mtu} ({KERNEL_BRIDGE_MTU} once its last port leaves)",
                               mtu)
            if c.action is Action.NOOP:
                c = replace(c, action=Action.UPDATE, reason=KEEPS_MTU_REASON,
                            attrs=(again,), ops=(encode(LinkSet(c.name, mtu=mtu)),))
            elif not any(a.field == "mtu" for a in c.attrs):  # else it sets it already
                c = replace(c, attrs=(*c.attrs, again),
                            ops=(*c.ops, encode(LinkSet(c.name, mtu=mtu))))
        out.append(c)
    return out
