"""Checkpoints and restores (pure): what a pending change records, and the plan that puts
it back.

``take`` reads the owned state out of a ``LiveState`` (every owned link, every owned
allocation namespace, our chains, the sysctls we set, our Docker networks of this scope
with their attachments); ``restore_plan`` compares a checkpoint with the live state now
and returns a ``Plan`` of the ordinary ops that makes the owned state what it was: it
deletes what the change created, re-creates what it deleted and sets back what it
changed. What the old files left to the kernel goes back to the value it had (an MTU a
bridge followed from its ports, a hairpin flag), because the checkpoint holds values,
not declarations. A revert is verified the way an apply is: ``take`` again, and the
restore plan of that must be empty.

The firewall is put back as one transaction per family built by the planner's own
``firewall.diff`` from the recorded chains, so the jumps into them are the ones every
apply writes, and with it go the conntrack entries the restored port maps leave stale.

See docs/decisions/025-safe-change-checkpoint.md.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable

from reconciler.domain import fwmark
from reconciler.domain.checkpoint import (
    AllocPoint,
    Checkpoint,
    LinkPoint,
    NetworkPoint,
    network_to_json,
)
from reconciler.domain.hints import command
from reconciler.domain.live import LiveChainSet, LiveLink, LiveState
from reconciler.domain.model import Bridge, BridgeName, DesiredState
from reconciler.domain.ops import (
    AddrAdd,
    AddrDel,
    AllocAttach,
    AllocConfigure,
    ConntrackDelete,
    DockerRemove,
    DockerRestore,
    LinkAddBridge,
    LinkDelete,
    LinkSet,
    LinkSetHairpin,
    LinkSetMac,
    NeighDelete,
    NeighReplace,
    NetnsCreate,
    NetnsDelete,
    RouteDelDefault,
    SysctlSet,
    TypedOp,
    decode,
    encode,
)
from reconciler.domain.ownership import (
    ALLOC_IFNAME,
    CHAIN_PREFIX,
    ZERO_MAC,
    alloc_ns_alias,
    alloc_veth_name,
)
from reconciler.domain.plan import Action, AttrChange, Change, Plan, fingerprint
from reconciler.planner import conntrack, firewall, nftplan, nftview
from reconciler.planner.allocs.live import owned_ns
from reconciler.planner.allocs.neighbours import own_neighbour
from reconciler.planner.hostlinks import is_temp_bridge_name

#: the host-wide sysctls an apply may set (and a revert therefore sets back)
HOST_SYSCTLS = ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding")

#: the MTU a link has unless someone sets another: not pinned on a re-created bridge
DEFAULT_MTU = 1500


def route_localnet_key(bridge: str) -> str:
    return f"net/ipv4/conf/{bridge}/route_localnet"


def bridge_sysctl_keys(bridge: str) -> tuple[str, ...]:
    """Return the per-bridge sysctls an apply may set: route_localnet (port maps from loopback)
    and the IPv6 address generation an IPv6 gateway turns on (``engine.hostops``: the
    kernel then makes a link-local address, which goes again when generation is set back
    to none)."""
    return (route_localnet_key(bridge), f"net/ipv6/conf/{bridge}/addr_gen_mode",
            f"net/ipv6/conf/{bridge}/accept_dad")


def sysctl_keys(live: LiveState) -> list[str]:
    """Return the sysctls a checkpoint of ``live`` records (the engine reads the per-bridge ones
    that the observation did not)."""
    return [*HOST_SYSCTLS, *(k for n, lk in sorted(live.links.items())
                             if _recorded_link(lk) and lk.kind == "bridge"
                             for k in bridge_sysctl_keys(n))]


def _recorded_link(lk: LiveLink) -> bool:
    # a marked temporary bridge is an interrupted creation, garbage the next plan removes
    return lk.owned and not is_temp_bridge_name(lk.name)


def _veth_ours(live: LiveState, name: str) -> bool:
    """Tell whether a revert may delete the host link ``name`` (an allocation's veth name). As the
    planner decides (``planner.allocs``): its name proves nothing, only our mark or a
    peer inside an owned allocation namespace does (a crash before its marking)."""
    lk = live.links.get(name)
    if lk is None or lk.kind != "veth":
        return False
    if lk.owned:
        return True
    return lk.peer_netnsid is not None and any(
        ns.nsid == lk.peer_netnsid and owned_ns(live.host_id, ns) for ns in live.netns.values())


def _foreign_link(live: LiveState, name: str) -> str | None:
    """Return the one-line description of a link called ``name`` that is there and not ours
    (a revert must not delete, re-create over or set it), None if there is none."""
    lk = live.links.get(name)
    if lk is None or _recorded_link(lk) or _veth_ours(live, name):
        return None
    return (f"host link {name} exists but is not the reconciler's ({lk.kind or 'link'}, "
            "no mark): it is left alone and the revert cannot complete (remove or rename "
            "it, then revert again)")


def take(live: LiveState, docker: Iterable[NetworkPoint] | None = None) -> Checkpoint:
    """Take the owned state of ``live``; ``docker``: our networks of this scope with their
    attachments (``drivers.docker``), None when Docker is not part of it."""
    links = {}
    for name, lk in sorted(live.links.items()):
        if not _recorded_link(lk):
            continue
        links[name] = LinkPoint(name, lk.kind, lk.mtu, lk.up, lk.master, lk.hairpin, lk.mac,
                                tuple(sorted(str(a.address) for a in lk.addresses if a.owned)))
    allocs = {}
    for name, ns in sorted(live.netns.items()):
        if not owned_ns(live.host_id, ns):
            continue
        lo = next(lk for lk in ns.links if lk.name == "lo")
        eth0 = next((lk for lk in ns.links if lk.name == ALLOC_IFNAME), None)
        gateways = tuple(sorted(r.gateway for r in ns.routes
                                if r.dst == "default" and r.owned and r.gateway))
        if eth0 is None:
            allocs[name] = AllocPoint(name, lo.alias, gateways=gateways)
        else:
            allocs[name] = AllocPoint(
                name, lo.alias, eth0.mtu, eth0.mac, eth0.up,
                tuple(sorted(str(a.address) for a in eth0.addresses if a.owned)), gateways)
    fw = {}
    for family, chains in ((4, live.firewall4), (6, live.firewall6)):
        if chains.available:
            fw[family] = {k: tuple(v) for k, v in sorted(chains.chains.items())
                          if k[1].startswith(CHAIN_PREFIX)}
    keys = sysctl_keys(live)
    sysctls = {k: live.sysctls[k] for k in keys if k in live.sysctls}
    foreign = {
        "links": tuple(sorted(n for n, lk in live.links.items() if not lk.owned)),
        "netns": tuple(sorted(n for n, ns in live.netns.items() if not owned_ns(live.host_id, ns))),
        "docker": tuple(sorted({n.name for n in (live.docker.networks if live.docker else ())
                                if not n.owned})),
    }
    return Checkpoint(live.host_id, links, allocs, fw, sysctls,
                      None if docker is None else tuple(sorted(docker, key=lambda n: n.name)),
                      foreign)


def observation(cp: Checkpoint) -> DesiredState:
    """Return what a revert observes with: nothing declared but the checkpoint's bridges.

    Everything owned is read whatever is declared, but our neighbour entries only on
    declared bridges (a bridge is all the observer can ask the kernel about); with
    none declared, a revert of a change that added an allocation never saw the
    entries seeded with it, and left them behind for the next plan to delete.
    """
    names = sorted(n for n, point in cp.links.items() if point.kind == "bridge")
    return DesiredState(bridges={BridgeName(n): Bridge(BridgeName(n)) for n in names})


# -- the restore ---------------------------------------------------------------------------

class _Changes:
    def __init__(self) -> None:
        self.changes: list[Change] = []
        self.blocked: set[str] = set()  # links a conflict leaves alone

    def add(self, kind: str, name: str, action: Action, reason: str,
            ops: Iterable[TypedOp], attrs: Iterable[AttrChange] = ()) -> None:
        encoded = tuple(encode(op) for op in ops)
        if encoded:
            self.changes.append(Change(kind, name, action, reason, tuple(attrs), encoded))

    def conflict(self, kind: str, name: str, reason: str, *links: str) -> None:
        """Record something in the way that is not ours: no ops, and the revert is not done
        (``engine.safechange``: a residual conflict fails it with this one line)."""
        self.changes.append(Change(kind, name, Action.CONFLICT, reason))
        self.blocked.update(links)


def restore_plan(cp: Checkpoint, live: LiveState,
                 docker: Iterable[NetworkPoint] | None = None) -> Plan:
    """Plan what makes the owned state of ``live`` what ``cp`` recorded.

    Its changes run in order: what the change created goes first (allocations, then
    bridges), then bridges, allocations, the links' settings (after their ports are
    back: a bridge's MTU follows them), sysctls, one firewall transaction per family and
    Docker networks last. ``docker``: our networks of this scope now (None: not read).
    """
    now = take(live, docker)
    out = _Changes()
    _deletes(cp, now, live, out)
    for name, point in sorted(cp.links.items()):
        if point.kind == "bridge":
            _bridge(point, now.links.get(name), live, out)
    for alloc in (cp.allocs[n] for n in sorted(cp.allocs)):
        _alloc(cp, alloc, now, live, out)
    for name, point in sorted(cp.links.items()):
        if name not in out.blocked:
            _settings(point, now.links.get(name), out)
    _neighbours(cp, live, out)
    _sysctls(cp, now, out)
    _firewall(cp, live, out)
    if cp.docker is not None and now.docker is not None:
        _docker(cp.docker, now.docker, out, set(cp.foreign.get("docker", ())))
    return Plan(tuple(out.changes), fingerprint(now.to_json()))


def _deletes(cp: Checkpoint, now: Checkpoint, live: LiveState, out: _Changes) -> None:
    foreign_ns = set(cp.foreign.get("netns", ()))
    for name in sorted(set(now.allocs) - set(cp.allocs) - foreign_ns):
        veth = alloc_veth_name(name)
        # the veth first: a namespace something holds outlives its unmount, and so would it
        ops: list[TypedOp] = [LinkDelete(veth)] if _veth_ours(live, veth) else []
        out.add("alloc", name, Action.DELETE, "created by the change", [*ops, NetnsDelete(name)])
    going = {alloc_veth_name(n) for n in set(now.allocs) - set(cp.allocs)}
    foreign = set(cp.foreign.get("links", ()))
    for name, point in sorted(now.links.items()):
        if name in cp.links or name in going:  # an allocation's veth goes with it
            continue
        if name in foreign:  # adopted by the change: ours now, never deleted by a revert
            continue
        out.add(point.kind or "link", name, Action.DELETE, "created by the change",
                [LinkDelete(name)])


def _bridge(point: LinkPoint, have: LinkPoint | None, live: LiveState,
            out: _Changes) -> None:
    if have is None and (foreign := _foreign_link(live, point.name)) is not None:
        out.conflict("bridge", point.name, foreign, point.name)
        return
    if have is None or have.kind != "bridge":
        ops: list[TypedOp] = [LinkDelete(point.name)] if have is not None else []
        mac = point.mac if point.mac not in (None, ZERO_MAC) else None
        ops.append(LinkAddBridge(point.name, None, mac=mac))
        if not point.up:
            ops.append(LinkSet(point.name, up=False))
        ops += [AddrAdd(point.name, a) for a in point.addresses]
        out.add("bridge", point.name, Action.CREATE, "deleted by the change", ops,
                [AttrChange("addresses", None, list(point.addresses))])
        return
    gone = sorted(set(have.addresses) - set(point.addresses))
    back = sorted(set(point.addresses) - set(have.addresses))
    ops = [*(AddrDel(point.name, a) for a in gone), *(AddrAdd(point.name, a) for a in back)]
    out.add("bridge", point.name, Action.UPDATE, "addresses changed by the change", ops,
            [AttrChange("addresses", list(have.addresses), list(point.addresses))])


def _alloc(cp: Checkpoint, point: AllocPoint, now: Checkpoint, live: LiveState,
           out: _Changes) -> None:
    veth_name = alloc_veth_name(point.name)
    veth = cp.links.get(veth_name)
    have = now.allocs.get(point.name)
    live_veth = live.links.get(veth_name)
    # the mark of this host now: after a reboot its namespace (a sandbox's) is another one
    mark = alloc_ns_alias(live.host_id)
    attach: list[TypedOp] = []
    if veth is not None and veth.master is not None and point.eth0_mtu is not None:
        mtu = point.eth0_mtu
        v6 = any(ipaddress.ip_interface(a).version == 6 for a in point.addresses)
        attach = [AllocAttach(point.name, veth_name, veth.master, mtu, bool(veth.hairpin),
                              mac=point.eth0_mac),
                  AllocConfigure(point.name, point.addresses, point.gateways, mtu, v6,
                                 mark, announce=True)]
    if have is None:
        foreign = _foreign_link(live, veth_name)
        if foreign is not None:
            out.conflict("alloc", point.name, foreign, veth_name)
            return
        stale = live.netns.get(point.name)
        if stale is not None and (stale.usable or stale.file_mark != mark):
            # a live namespace not ours, or an empty file without our xattr: someone's
            # (``ip netns add`` between its create and its mount, a tool keeping the name)
            what = ("is a network namespace that is not the reconciler's" if stale.usable
                    else "exists, is not a live namespace and was not made by the "
                    "reconciler (no mark on the file)")
            out.conflict("alloc", point.name,
                         f"/run/netns/{point.name} {what}: it is left alone and the revert "
                         "cannot complete (remove it, then revert again)", veth_name)
            return
        ops: list[TypedOp] = [LinkDelete(veth_name)] if live_veth is not None else []
        ops.append(NetnsCreate(point.name, stale is not None, mark))
        out.add("alloc", point.name, Action.CREATE, "deleted by the change", [*ops, *attach],
                [AttrChange("addresses", None, list(point.addresses))])
        return
    eth0_gone = have.eth0_mtu is None and point.eth0_mtu is not None
    veth_gone = veth is not None and veth_name not in now.links
    if eth0_gone or veth_gone or have.eth0_mac != point.eth0_mac:
        ops = [LinkDelete(ALLOC_IFNAME, netns=point.name)] if have.eth0_mtu is not None else []
        if live_veth is not None:
            foreign = _foreign_link(live, veth_name)
            if foreign is not None:
                out.conflict("alloc", point.name, foreign, veth_name)
                return
            ops.append(LinkDelete(veth_name))
        out.add("alloc", point.name, Action.REPLACE, "its link was changed by the change",
                [*ops, *attach])
        return
    ops = [AddrDel(ALLOC_IFNAME, a, netns=point.name)
           for a in sorted(set(have.addresses) - set(point.addresses))]
    versions = {ipaddress.ip_address(g).version for g in point.gateways}
    for gw in have.gateways:
        version = ipaddress.ip_address(gw).version
        if version not in versions:
            ops.append(RouteDelDefault(version, point.name))
            versions.add(version)
    if (set(point.addresses) - set(have.addresses) or set(point.gateways) - set(have.gateways)
            or have.eth0_mtu != point.eth0_mtu or have.eth0_up != point.eth0_up
            or have.mark != mark):
        ops += attach[1:]
    out.add("alloc", point.name, Action.UPDATE, "changed by the change", ops,
            [AttrChange("addresses", list(have.addresses), list(point.addresses))])


def _settings(point: LinkPoint, have: LinkPoint | None, out: _Changes) -> None:
    """Set back the MTU, master, hairpin, MAC and up of a link that is (or is now being made) there
    again.

    A re-created link is predicted from how it is made: a bridge with its MAC and the
    default MTU, a veth on its bridge with eth0's MTU and hairpin but a MAC of the
    kernel's; a link moved to another bridge, with hairpin off. The revert's verification
    compares the result and plans again if needed.
    """
    if have is None:
        have = (LinkPoint(point.name, point.kind, DEFAULT_MTU, point.up, mac=point.mac)
                if point.kind == "bridge" else
                LinkPoint(point.name, point.kind, point.mtu, True, point.master, point.hairpin))
    ops: list[TypedOp] = []
    attrs: list[AttrChange] = []

    def differs(name: str, before: object, after: object) -> bool:
        if before == after:
            return False
        attrs.append(AttrChange(name, before, after))
        return True

    if differs("master", have.master, point.master):
        ops.append(LinkSet(point.name, master=point.master or ""))
        # a link that changes bridge is a new port there: the kernel starts it hairpin off
        have = dataclasses.replace(have, hairpin=False if point.master else None)
    if differs("mtu", have.mtu, point.mtu):
        ops.append(LinkSet(point.name, mtu=point.mtu))
    if point.hairpin is not None and differs("hairpin", have.hairpin, point.hairpin):
        ops.append(LinkSetHairpin(point.name, point.hairpin))
    if point.mac not in (None, ZERO_MAC) and differs("mac", have.mac, point.mac):
        ops.append(LinkSetMac(point.name, str(point.mac)))
    if differs("up", have.up, point.up):
        ops.append(LinkSet(point.name, up=point.up))
    out.add(point.kind or "link", point.name, Action.UPDATE, "settings changed by the change",
            ops, attrs)


def _neighbours(cp: Checkpoint, live: LiveState, out: _Changes) -> None:
    """Put our neighbour entries on the recorded bridges back: delete those for an address no
    recorded allocation has there (seeded with one the change added: the kernel never
    collects them), replace those naming another MAC than the recorded ``eth0``'s (one
    the change gave an address of a pruned allocation). Entries that are not ours are
    never touched (``allocs.neighbours.own_neighbour``); a bridge the revert deletes or
    makes takes or has none."""
    for name, point in sorted(cp.links.items()):
        link = live.links.get(name)
        if point.kind != "bridge" or link is None or link.kind != "bridge" or not link.owned:
            continue
        wanted: dict[str, str | None] = {}
        for alloc in cp.allocs.values():
            veth = cp.links.get(alloc_veth_name(alloc.name))
            if veth is not None and veth.master == name:
                for a in alloc.addresses:
                    wanted[str(ipaddress.ip_interface(a).ip)] = alloc.eth0_mac
        ops: list[TypedOp] = []
        attrs: list[AttrChange] = []
        for n in live.neighbours:
            if not own_neighbour(link, n):
                continue
            if n.address not in wanted:
                ops.append(NeighDelete(name, n.address))
                attrs.append(AttrChange("neighbour", f"{n.address} at {n.mac}", None))
            elif (mac := wanted[n.address]) is not None and mac != n.mac:
                ops.append(NeighReplace(name, n.address, mac))
                attrs.append(AttrChange("neighbour", f"{n.address} at {n.mac}", mac))
        out.add("bridge", name, Action.UPDATE, "neighbour entries changed by the change", ops,
                attrs)


def _sysctls(cp: Checkpoint, now: Checkpoint, out: _Changes) -> None:
    for key, value in sorted(cp.sysctls.items()):
        if now.sysctls.get(key) != value:
            out.add("sysctl", key, Action.UPDATE, "set by the change",
                    [SysctlSet(key, value)], [AttrChange("value", now.sysctls.get(key), value)])


def _firewall(cp: Checkpoint, live: LiveState, out: _Changes) -> None:
    """Put our table's entries back as recorded (the record is their rule form)."""
    if not cp.firewall or not live.table.available:
        return
    sets = []
    for family in (4, 6):
        rs = firewall.RuleSet(family)
        for (table, chain), rules in sorted(cp.firewall.get(family, {}).items()):
            if rs.table_of(chain) == table:
                rs.chains[chain] = list(rules)
        sets.append(rs)
    recorded = nftview.entries_of(sets)
    if recorded == set(live.table.entries) and live.table.intact:
        return
    no_old = dataclasses.replace(live, old4=LiveChainSet(False), old6=LiveChainSet(False))
    change, _ = nftplan.plan_table(recorded, no_old, prune=True,
                                   bit=live.table.mark or fwmark.DEFAULT_MARK)
    if change is None:
        return
    ops: list[TypedOp] = [decode(o) for o in change.ops]
    for family, rs, live_rules in ((4, sets[0], live.firewall4), (6, sets[1], live.firewall6)):
        stale = conntrack.stale_maps(rs, live_rules)
        if stale:
            ops.append(ConntrackDelete(family, tuple(str(m) for m in stale)))
    out.add("firewall", nftplan.NAME, Action.UPDATE, "rules changed by the change", ops,
            change.attrs)


def _docker(was: Iterable[NetworkPoint], now: Iterable[NetworkPoint], out: _Changes,
            foreign: set[str]) -> None:
    """Restore Docker networks: what the change created first (it may hold the subnet a restored
    network needs), then networks with containers (they wait without a network until it is back),
    then the rest.

    A network is restored when it is gone or its settings differ, never because its
    containers did: they start, stop and are attached by others in the window, and a
    change makes no attachment (a replace by an apply carries the containers over)."""
    before = {n.name: n for n in was}
    current = {n.name: n for n in now}
    for name, net in sorted(current.items()):
        if name not in before and name not in foreign:
            out.add("docker_network", name, Action.DELETE, "created by the change",
                    [DockerRemove(net.id, name)])
    for name, net in sorted(before.items(), key=lambda kv: (not kv[1].endpoints, kv[0])):
        have = current.get(name)
        if have is not None and have.settings() == net.settings():
            continue
        action = Action.CREATE if have is None else Action.REPLACE
        out.add("docker_network", name, action,
                "deleted by the change" if have is None else "changed by the change",
                [DockerRestore(network_to_json(net), have.id if have is not None else "")],
                [AttrChange("containers", None if have is None else len(have.endpoints),
                            len(net.endpoints))])


# -- irreversible changes ------------------------------------------------------------------

def postpone(plan: Plan, held: Iterable[str]) -> tuple[Plan, tuple[Change, ...]]:
    """Return ``plan`` with the deletions of the allocation namespaces ``held`` (by processes: a
    revert could not bring them back into a new namespace) taken out, and those changes.

    Each becomes its veth set down: within the window the allocation is cut off (its
    rules go with the firewall transaction of the same plan) and a revert brings the
    veth up again; the deletion itself runs at confirm.
    """
    held = set(held)
    kept: list[Change] = []
    postponed: list[Change] = []
    for c in plan.changes:
        if c.kind == "alloc" and c.action is Action.DELETE and c.name in held:
            postponed.append(c)
            kept.append(dataclasses.replace(
                c, reason=f"{c.reason}; held by processes: deleted at `{command('confirm')}`, "
                          "its veth down until then",
                attrs=(*c.attrs, AttrChange("veth", "up", "down")),
                ops=(encode(LinkSet(alloc_veth_name(c.name), up=False)),)))
        else:
            kept.append(c)
    if not postponed:
        return plan, ()
    return dataclasses.replace(plan, changes=tuple(kept)), tuple(postponed)


def without_postponed(residual: Plan, postponed: Iterable[str]) -> Plan:
    """Drop from a verification's residual the deletions that wait for the confirm."""
    names = set(postponed)
    return dataclasses.replace(residual, changes=tuple(
        c for c in residual.changes
        if not (c.kind == "alloc" and c.action is Action.DELETE and c.name in names)))
