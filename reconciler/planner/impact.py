"""What a plan disrupts, before it happens (pure, SPEC §8).

Each change that takes connectivity away says from what: an allocation deleted,
re-wired (its veth re-created, moved to another bridge), re-addressed or left
without its gateway; a container disconnected from a Docker network that is
re-created; a port map closed or sent elsewhere. Read from the changes' ops and
the live state they act on, never guessed from the reason text, so a change
that disrupts nothing (a create, an MTU, a hairpin flag, a neighbour entry) has
no impact.

Established flows through each item are counted from ``LiveState.flows``, the
conntrack entries the engine reads for exactly these items once a plan has an
impact (:func:`flow_query`): TCP flows in state ESTABLISHED and answered UDP
ones, without the probes' reserved source ports (they are ours and short-lived).
A plan made without them says nothing about flows (``Impact.flows`` None).

See docs/decisions/020-impact-before-it-happens.md.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from reconciler.domain.live import LiveFlow, LiveNetns, LiveState
from reconciler.domain.model import DockerNetwork, DockerNetworkName
from reconciler.domain.ops import (
    AddrAdd,
    AddrDel,
    DockerRemove,
    DockerReplace,
    LinkDelete,
    LinkSet,
    NetnsDelete,
    OpError,
    RouteDelDefault,
    TypedOp,
    decode,
)
from reconciler.domain.ownership import ALLOC_IFNAME, alloc_ns_marks, alloc_veth_name
from reconciler.domain.plan import Action, Change, FlowMatch, Impact, Op, Plan
from reconciler.domain.probes import PROBE_PORTS, VANTAGE6_PEER, VANTAGE_PEER
from reconciler.planner import firewall
from reconciler.planner.context import PlanContext
from reconciler.planner.hostspace import local_addresses

IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address


# ------------------------------------------------------------------ what is disrupted


def assess(ctx: PlanContext, changes: list[Change]) -> list[Change]:
    """Assess the ``impact`` of ``changes`` (flows counted when ``ctx.live`` has them)."""
    deleted = {c.name for c in changes if c.kind == "alloc" and c.action is Action.DELETE}
    index = None if ctx.live.flows is None else _FlowIndex(ctx.live.flows,
                                                           ProbeSources.of(ctx.live))
    out = []
    for c in changes:
        found = _impact_of(ctx, c, deleted) if c.action not in (Action.NOOP,
                                                                Action.CONFLICT) else []
        if found:
            c = dataclasses.replace(c, impact=tuple(_counted(found, index)))
        out.append(c)
    return out


#: the ops that can take connectivity away (the others are not even decoded)
_DISRUPTIVE = frozenset({NetnsDelete.NAME, LinkDelete.NAME, LinkSet.NAME, AddrDel.NAME,
                         AddrAdd.NAME, RouteDelDefault.NAME, DockerReplace.NAME,
                         DockerRemove.NAME})


def _impact_of(ctx: PlanContext, c: Change, deleted: set[str]) -> list[Impact]:
    if c.kind == "firewall":  # one change for our table: both families
        return _port_maps(ctx, 4) + _port_maps(ctx, 6)
    ops = [t for t in (_typed(o) for o in c.ops if o.name in _DISRUPTIVE) if t is not None]
    if c.kind == "alloc":
        one = _alloc(ctx, c, ops)
        return [one] if one is not None else []
    if c.kind == "veth":
        return [Impact("alloc", c.name, "orphan veth deleted: the namespace behind it (no longer "
                       "under /run/netns, kept alive by a process) loses connectivity")
                for op in ops if isinstance(op, LinkDelete) and op.netns is None]
    if c.kind in ("bridge", "subnet"):
        return _on_bridge(ctx, c, ops, deleted)
    if c.kind == "docker_network":
        return _containers(ctx, c, ops)
    return []


def _typed(op: Op) -> TypedOp | None:
    try:
        return decode(op)
    except OpError:  # the planner's own ops always decode; be safe for the reader
        return None


def _addresses(ns: LiveNetns | None, *, owned_only: bool = True) -> tuple[str, ...]:
    eth0 = next((lk for lk in (ns.links if ns else ()) if lk.name == ALLOC_IFNAME), None)
    return tuple(str(a.address.ip) for a in (eth0.addresses if eth0 else ())
                 if a.owned or not owned_only)


def _live_ns(ctx: PlanContext, name: str) -> LiveNetns | None:
    """Return the live allocation namespace ``name`` when it is one of this host's (usable,
    marked)."""
    ns = ctx.live.netns.get(name)
    if ns is None or not ns.usable:
        return None
    lo = next((lk for lk in ns.links if lk.name == "lo"), None)
    if lo is None or lo.alias not in alloc_ns_marks(ctx.live.host_id):
        return None
    return ns


def _alloc(ctx: PlanContext, c: Change, ops: list[TypedOp]) -> Impact | None:
    """Describe one entry per allocation, whatever of it the change takes away."""
    ns = ctx.live.netns.get(c.name)
    usable = ns if ns is not None and ns.usable else None
    if any(isinstance(op, NetnsDelete) for op in ops):
        if usable is None:
            return None  # an empty file or a dead mount: nothing there had connectivity
        addrs = _addresses(usable, owned_only=False)
        return Impact("alloc", c.name, "deleted: loses connectivity", addrs,
                      match=FlowMatch(addrs))
    effects: list[str] = []
    removed: list[str] = []
    veth_name = alloc_veth_name(c.name)
    veth = ctx.live.links.get(veth_name)
    deletes = [op for op in ops if isinstance(op, LinkDelete)]
    # without the host's end there was no connectivity to lose
    if deletes and veth is not None and usable is not None:
        effects.append("its veth is re-created: no connectivity until it is back")
    elif deletes and veth is not None:
        # a veth left behind by a namespace that lives on (a process holds it)
        effects.append("the namespace left behind (kept alive by a process) loses its veth")
    for op in ops:
        if isinstance(op, LinkSet) and op.master is not None and op.name == veth_name:
            effects.append(f"moves from bridge {veth.master if veth else '(none)'} to "
                           f"{op.master}")
        elif isinstance(op, AddrDel) and op.netns == c.name and op.link == ALLOC_IFNAME:
            if _is_owned_address(usable, op.address):
                effects.append(f"loses address {op.address}")
                removed.append(str(ipaddress.ip_interface(op.address).ip))
        elif isinstance(op, RouteDelDefault):
            gw = next((r.gateway for r in (usable.routes if usable else ())
                       if r.dst == "default" and r.owned and r.gateway is not None
                       and ipaddress.ip_address(r.gateway).version == op.version), None)
            effects.append(f"loses its IPv{op.version} default route"
                           + (f" via {gw}" if gw else ""))
    if not effects:
        return None
    addrs = tuple(removed) if removed else _addresses(usable)
    return Impact("alloc", c.name, "; ".join(effects), addrs, match=FlowMatch(addrs))


def _is_owned_address(ns: LiveNetns | None, address: str) -> bool:
    """Tell whether ``address`` is one of eth0's own (an unmarked one re-added as ours is no
    loss)."""
    eth0 = next((lk for lk in (ns.links if ns else ()) if lk.name == ALLOC_IFNAME), None)
    return any(a.owned and str(a.address) == address for a in (eth0.addresses if eth0 else ()))


def _on_bridge(ctx: PlanContext, c: Change, ops: list[TypedOp],
               deleted: set[str]) -> list[Impact]:
    """Find the allocations whose bridge goes, or whose gateway address is taken off it.

    Allocations deleted by the same plan are not repeated here: their own change says it.
    """
    bridge_gone = {op.name for op in ops if isinstance(op, LinkDelete) and op.netns is None}
    gateways: dict[str, list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]] = {}
    # an address taken over (deleted, then added as ours by the same change) stays there
    readded = {(op.link, op.address) for op in ops if isinstance(op, AddrAdd)}
    for op in ops:
        if isinstance(op, AddrDel) and op.netns is None and (op.link, op.address) not in readded:
            gateways.setdefault(op.link, []).append(ipaddress.ip_interface(op.address))
    if not bridge_gone and not gateways:
        return []
    out = []
    for name in sorted(ctx.live.netns):
        ns = _live_ns(ctx, name)
        veth = ctx.live.links.get(alloc_veth_name(name))
        if ns is None or name in deleted or veth is None or veth.master is None:
            continue
        addrs = _addresses(ns)
        if veth.master in bridge_gone:
            out.append(Impact("alloc", name, f"its bridge {veth.master} is deleted", addrs,
                              match=FlowMatch(addrs)))
            continue
        lost = [gw for gw in gateways.get(veth.master, ())
                if any(ipaddress.ip_address(a) in gw.network for a in addrs)]
        if lost:
            behind = tuple(a for a in addrs
                           if any(ipaddress.ip_address(a) in gw.network for gw in lost))
            out.append(Impact("alloc", name, "loses its gateway " + ", ".join(
                f"{gw.ip} on bridge {veth.master}" for gw in lost), behind,
                match=FlowMatch(behind)))
    return out


def _port_maps(ctx: PlanContext, family: int) -> list[Impact]:
    """Find the live port maps of ``family`` the new rules close or send elsewhere."""
    live = ctx.live.firewall4 if family == 4 else ctx.live.firewall6
    live_rules = live.chains.get(("nat", firewall.DNAT), ())
    desired = (ctx.rules4 if family == 4 else ctx.rules6).chains.get(firewall.DNAT, [])
    # both sides are in iptables-save's words (the firewall diff compares them so): a rule
    # in both is a map that stays as it is, only the others are read
    kept = set(desired)
    have = firewall.dnat_rules(r for r in live_rules if r not in kept)
    if not have:
        return []
    live_set = set(live_rules)
    want = {(d.proto, d.port, d.host_ip): d
            for d in firewall.dnat_rules(r for r in desired if r not in live_set)}
    out = []
    seen: set[tuple[str, int, IPAddr | None]] = set()
    for d in have:
        key = (d.proto, d.port, d.host_ip)
        if key in seen:
            continue
        seen.add(key)
        new = want.get(key)
        if new is not None and (new.dest, new.to) == (d.dest, d.to):
            continue
        was = f"alloc {d.alloc} at {_hostport(d.dest, d.to)}"
        effect = (f"closed (it sent to {was})" if new is None else
                  f"moves from {was} to alloc {new.alloc} at {_hostport(new.dest, new.to)}")
        out.append(Impact("port_map", port_map_name(d.proto, d.port, d.host_ip), effect,
                          (str(d.dest),), match=FlowMatch((str(d.dest),), (d.proto, d.port))))
    return out


def port_map_name(proto: str, port: int, host_ip: IPAddr | None) -> str:
    """Name a port map: ``8080/tcp``, or ``127.0.0.1:8080/tcp`` for a map on one host address."""
    return f"{_hostport(host_ip, port)}/{proto}" if host_ip is not None else f"{port}/{proto}"


def _hostport(ip: IPAddr | None, port: int) -> str:
    return f"[{ip}]:{port}" if ip is not None and ip.version == 6 else f"{ip}:{port}"


def _containers(ctx: PlanContext, c: Change, ops: list[TypedOp]) -> list[Impact]:
    """Find the containers a replace disconnects (then reconnects, with the addresses the new
    network still holds: the driver keeps the live subnets unless the file declares others),
    or a removal disconnects (the planner removes only networks without containers, and the
    driver refuses one that gained some meanwhile: listed should that ever change)."""
    docker = ctx.live.docker
    if docker is None:
        return []
    spec = ctx.desired.docker_networks.get(DockerNetworkName(c.name))
    out = []
    for op in ops:
        if not isinstance(op, DockerReplace | DockerRemove):
            continue
        live = next((n for n in docker.networks if n.id == op.id), None)
        if live is None:
            continue
        for ep in sorted(live.endpoints, key=lambda e: e.name):
            addrs = tuple(a for a in (ep.ipv4, ep.ipv6) if a is not None)
            if isinstance(op, DockerRemove):
                effect = f"disconnected: docker network {c.name} is removed"
            else:
                effect = (f"disconnected from docker network {c.name} while it is re-created, "
                          "then reconnected")
                lost = [a for a in addrs if not _kept(spec, a)]
                if lost:
                    effect += " without " + ", ".join(lost) + " (outside the new subnets)"
            # the containers' flows are in the conntrack table of dockerd's namespace: the
            # one we read only when we act on the host itself
            match = FlowMatch(addrs) if docker.scope == "host" else None
            out.append(Impact("container", ep.name, effect, addrs, match=match))
    return out


def _kept(spec: DockerNetwork | None, address: str) -> bool:
    """Tell whether a container keeps ``address`` when it is reconnected to the new network."""
    ip = ipaddress.ip_address(address)
    declared = None if spec is None else (spec.subnet if ip.version == 4 else spec.subnet6)
    return declared is None or ip in declared


# ------------------------------------------------------------------ flows


def flow_query(plan: Plan) -> dict[int, tuple[frozenset[IPAddr], frozenset[tuple[str, int]]]]:
    """Say which conntrack entries the plan's impact counts: per IP family, the addresses
    (flows they start or answer) and the (protocol, host port) of port maps."""
    out: dict[int, tuple[set[IPAddr], set[tuple[str, int]]]] = {}
    for i in (i for c in plan.actionable for i in c.impact):
        if i.match is None:
            continue
        for a in i.match.addresses:
            ip = ipaddress.ip_address(a)
            addrs, ports = out.setdefault(ip.version, (set(), set()))
            if i.match.port is not None:
                ports.add(i.match.port)
            else:
                addrs.add(ip)
    return {f: (frozenset(a), frozenset(p)) for f, (a, p) in sorted(out.items())}


def with_flows(plan: Plan, live: LiveState) -> Plan:
    """Count each impact's flows of ``plan`` from ``live.flows``."""
    if live.flows is None:
        return plan
    index = _FlowIndex(live.flows, ProbeSources.of(live))
    changes = tuple(dataclasses.replace(c, impact=tuple(_counted(c.impact, index)))
                    if c.impact else c for c in plan.changes)
    return dataclasses.replace(plan, changes=changes)


def _counted(found: Iterable[Impact], index: _FlowIndex | None) -> list[Impact]:
    if index is None:
        return list(found)
    return [dataclasses.replace(i, flows=index.count(i.match)) if i.match is not None else i
            for i in found]


@dataclass(frozen=True)
class ProbeSources:
    """Where the probes' flows start: the host itself (any address of its links, loopback
    included) and the external vantage's peer; the hairpin probe starts in the allocation
    it reaches again (its replies come from where it started)."""

    local: frozenset[str]
    loopback: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def of(cls, live: LiveState) -> ProbeSources:
        exact, loopback = local_addresses(live)
        return cls(frozenset({*(str(ip) for ip in exact), VANTAGE_PEER, VANTAGE6_PEER,
                              "127.0.0.1", "::1"}), tuple(loopback))

    def started(self, f: LiveFlow) -> bool:
        """Tell whether a probe could have started ``f``: from the host, the vantage, or hairpin."""
        if f.src in self.local or f.src == f.reply_src:
            return True
        ip = ipaddress.ip_address(f.src)
        return any(ip in net for net in self.loopback)


def counts_as_flow(f: LiveFlow, probes: ProbeSources) -> bool:
    """Tell whether a flow counts: established TCP or answered UDP, and not one of the probes'.

    A probe's flow is one from the probes' reserved source ports *and* from where
    probes start (``ProbeSources``): the port range alone is also a real client's
    (Windows and many NATs hand out 49152-65535), whose flows from another host count.
    """
    lo, hi = PROBE_PORTS
    return f.established and not (lo <= f.sport <= hi and probes.started(f))


class _FlowIndex:
    """The counted flows by the addresses that start them and those that answer them."""

    def __init__(self, flows: Iterable[LiveFlow], probes: ProbeSources) -> None:
        self.by_src: dict[str, list[LiveFlow]] = {}
        self.by_reply: dict[str, list[LiveFlow]] = {}
        for f in flows:
            if counts_as_flow(f, probes):
                self.by_src.setdefault(f.src, []).append(f)
                self.by_reply.setdefault(f.reply_src, []).append(f)

    def count(self, match: FlowMatch) -> int:
        picked: dict[int, LiveFlow] = {}
        for a in match.addresses:
            a = str(ipaddress.ip_address(a))
            if match.port is not None:
                proto, port = match.port
                for f in self.by_reply.get(a, ()):
                    # DNATed by the map: to its host port, answered by its destination
                    if f.proto == proto and f.dport == port and f.dst != f.reply_src:
                        picked[id(f)] = f
                continue
            for f in (*self.by_src.get(a, ()), *self.by_reply.get(a, ())):
                picked[id(f)] = f
        return len(picked)
