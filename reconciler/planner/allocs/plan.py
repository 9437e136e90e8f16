"""The change of each allocation: namespace, veth pair, addresses, routes, port maps (pure)."""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping, Sequence

from reconciler.domain import ownership
from reconciler.domain.model import Alloc, Subnet, SubnetName
from reconciler.domain.ops import (
    AddrDel,
    AllocAttach,
    AllocConfigure,
    LinkDelete,
    LinkSet,
    LinkSetHairpin,
    NetnsCreate,
    NetnsDelete,
    RouteDelDefault,
    encode,
)
from reconciler.domain.ownership import (
    ALLOC_IFNAME,
    alloc_ns_alias,
    alloc_ns_marks,
    alloc_veth_name,
)
from reconciler.domain.plan import Action, AttrChange, Change, Op, ports_attr
from reconciler.planner import firewall
from reconciler.planner.allocs.ipam import (
    Mapped,
    assign_addresses,
    assign_ports,
    live_port_maps,
)
from reconciler.planner.allocs.live import (
    IPAddr,
    describe_link,
    inner_link,
    is_ours,
    is_own_namespace,
    peer_held,
    peer_held_warning,
    veth_is_ours,
    veth_pair_ok,
)
from reconciler.planner.allocs.neighbours import (
    StaleNeighbour,
    mac_clashes,
    neighbour_deletions,
    neighbour_ops,
    neighbour_table_warnings,
    plan_orphan_neighbours,
    seen_addresses,
    stale_neighbours,
    was_seen,
)
from reconciler.planner.context import PlanContext


def alloc_rules(ctx: PlanContext, a: Alloc, addrs: tuple[IPAddr | None, IPAddr | None],
                maps: Iterable[Mapped]) -> None:
    """Add the DNAT from the host ports to the allocation (host, other hosts, localhost)."""
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
    """Add the SNAT back through the host that hairpin and localhost port maps need (portmap's
    snat)."""
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
               left: Sequence[StaleNeighbour] = (),
               had: Sequence[Mapped] | None = None) -> Change:
    """Plan the change of one declared allocation. ``seen``: :func:`seen_addresses`; ``left``:
    our neighbour entries of its MAC for addresses it no longer has (deleted); ``had``: its
    live port maps (``ipam.live_port_maps``), None when the firewall could not be read."""
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
    ports = _spelled(maps)
    ns = ctx.live.netns.get(a.id)
    veth = ctx.live.links.get(veth_name)
    if is_own_namespace(ctx, ns):
        ctx.blocked.add(f"alloc/{a.id}")
        return Change("alloc", a.id, Action.CONFLICT,
                      f"network namespace {a.id} is the one the reconciler runs in (--netns "
                      f"{a.id}): it cannot be an allocation (its veth would loop back into "
                      "it); give the allocation another id", source=src)
    if veth is not None and not veth_is_ours(ctx, a.id, veth, ns):
        ctx.blocked.add(f"alloc/{a.id}")
        return Change("alloc", a.id, Action.CONFLICT,
                      f"host link {veth_name} (the name of this allocation's veth) exists "
                      f"but is not the reconciler's ({describe_link(veth)}, no mark, peer "
                      "not in the allocation's namespace): it is left alone (remove or "
                      "rename it)", source=src)
    stale_veth = [encode(LinkDelete(veth_name))] if veth is not None else []
    if (ns is not None and not ns.usable and ns.file_mark not in alloc_ns_marks(ctx.live.host_id)
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
        announce = bool(stale_veth) or was_seen(ctx, seen, b.name, addrs)
        configure = dataclasses.replace(configure, announce=announce)
        attrs = (AttrChange("subnet", None, s.name), AttrChange("address", None, want[0]),
                 *((AttrChange("address6", None, want[1]),) if len(want) > 1 else ()),
                 *((ports_attr(None, ports),) if ports else ()),
                 AttrChange("mac", None, derived_mac))
        neigh_attrs, neigh_ops = neighbour_ops(ctx, a, b.name, addrs, derived_mac, left)
        attrs += tuple(neigh_attrs)
        made = (*stale_veth, encode(NetnsCreate(a.id, ns is not None, mark)), encode(attach),
                encode(configure), *neigh_ops)
        if ns is not None:
            return Change("alloc", a.id, Action.REPLACE,
                          f"/run/netns/{a.id} exists but is not a live namespace",
                          attrs, made, src, within=f"bridge/{b.name}")
        reason = "not present" if veth is None else "namespace missing (veth left behind)"
        return Change("alloc", a.id, Action.CREATE, reason, attrs, made, src,
                      within=f"bridge/{b.name}")
    if not is_ours(ctx, ns) and not ctx.adopted("alloc", a.id):
        ctx.blocked.add(f"alloc/{a.id}")
        return Change("alloc", a.id, Action.CONFLICT,
                      f"network namespace {a.id} exists but was not created by the reconciler "
                      f"(--adopt alloc/{a.id} takes it over)", source=src)

    attrs_l: list[AttrChange] = []
    ops: list[Op] = []
    eth0 = inner_link(ns, ALLOC_IFNAME)
    if not veth_pair_ok(ns, veth):
        attrs_l.append(AttrChange("veth", "missing" if veth is None or eth0 is None
                                  else "wrong peer", veth_name))
        # every deletion is said in the plan, not only in -v's ops: an adopted namespace's
        # own eth0 (and its addresses and routes) goes here
        if eth0 is not None:
            attrs_l.append(AttrChange(f"{ALLOC_IFNAME} inside", describe_link(eth0),
                                      "deleted (the new veth's peer takes its place)"))
            ops.append(encode(LinkDelete(ALLOC_IFNAME, netns=a.id)))
        if veth is not None:
            attrs_l.append(AttrChange(f"host {veth_name}", describe_link(veth),
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
        lo = inner_link(ns, "lo")
        if lo is not None and lo.alias != mark and lo.alias in alloc_ns_marks(ctx.live.host_id):
            # an earlier version's mark (the inode alone): this host's mark from now on
            attrs_l.append(AttrChange("mark", lo.alias, mark))
            inside_ok = False
        elif (lo is None or not lo.up or lo.alias != mark or not eth0.up
                or (b.mtu is not None and eth0.mtu != b.mtu)):
            attrs_l.append(AttrChange("links inside", "down or wrong MTU", "up"))
            inside_ok = False
        if not inside_ok:
            ops.append(encode(configure))
        eth0_mac = eth0.mac  # kept, whatever it is: no churn of allocations made before
    neigh_attrs, neigh_ops = neighbour_ops(ctx, a, b.name, addrs, eth0_mac, left)
    attrs_l += neigh_attrs
    ops += neigh_ops
    was = None if had is None else _spelled(dict.fromkeys(had))
    now = _spelled(m for m in maps if _readable(ctx, m))
    if was is not None and was != now:
        # the firewall change makes it; shown here, on the allocation it belongs to (SPEC §13,
        # docs/decisions/050-output-that-scales.md)
        attrs_l.append(ports_attr(was, now))
    if not attrs_l:
        return Change("alloc", a.id, Action.NOOP, source=src)
    return Change("alloc", a.id, Action.UPDATE,
                  "changed: " + ", ".join(dict.fromkeys(x.field for x in attrs_l)),
                  tuple(attrs_l), tuple(ops), src, within=f"bridge/{b.name}")


def _readable(ctx: PlanContext, m: Mapped) -> bool:
    """Tell whether the live rules of ``m`` could be read (an IPv6 host_ip's are IPv6 only)."""
    return ctx.live.firewall6.available or m.host_ip is None or m.host_ip.version == 4


def _spelled(maps: Iterable[Mapped]) -> list[str]:
    """Spell port maps as plans show them, sorted: ``8080/tcp->80``, ``53/udp->53@127.0.0.1``."""
    return sorted(f"{m.host}/{m.proto}->{m.to}" + (f"@{m.host_ip}" if m.host_ip else "")
                  for m in maps)


def plan_pruned(ctx: PlanContext,
                gone: Mapping[str, Sequence[StaleNeighbour]] | None = None) -> list[Change]:
    """Plan the owned namespaces no file declares, and owned veths whose namespace is gone.
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
        if not is_ours(ctx, ns) or is_own_namespace(ctx, ns):
            continue
        ctx.observed[f"alloc/{name}"] = _view(ctx, name)
        if ctx.options.prune:
            attrs, neigh_ops = neighbour_deletions(ctx, (gone or {}).get(name, ()))
            changes.append(Change("alloc", name, Action.DELETE, "no longer declared",
                                  tuple(attrs), (encode(NetnsDelete(name)), *neigh_ops)))
    for lname, lk in sorted(ctx.live.links.items()):
        if lk.kind != "veth" or not lk.owned or lname in veth_of:
            continue
        held = peer_held(ctx.live, lk)
        if held is not None:
            # its peer is in a namespace mounted under /run/netns and live, one not read as
            # an allocation of ours (its mark rewritten): cut off, its workload would lose
            # its network; whatever the marks say, that is no orphan
            ctx.warnings.append(peer_held_warning(lname, held))
            continue
        # an owned veth whose allocation namespace is gone (kill -9 mid-create, or the
        # namespace file was removed while something kept the namespace alive)
        ctx.observed[f"veth/{lname}"] = (lk.master, lk.peer_netnsid)
        changes.append(Change("veth", lname, Action.DELETE,
                              "orphan: its allocation namespace is gone", (),
                              (encode(LinkDelete(lname)),)))
    return changes


def plan_allocs(ctx: PlanContext) -> list[Change]:
    neighbour_table_warnings(ctx)
    addrs = assign_addresses(ctx)
    ports = assign_ports(ctx)
    # the port maps each allocation has: unknown where the IPv4 firewall could not be read
    had = live_port_maps(ctx) if ctx.live.firewall4.available else None
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
                            gone.get(aid, ()), None if had is None else had.get(aid, []))
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
