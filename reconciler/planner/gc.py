"""What `reconcile gc` collects (pure): a plan of removals only.

Without files it collects *broken halves*, things that are garbage whatever the
files say: an owned veth whose allocation namespace is gone, an owned allocation
namespace that lost its veth pair, the marked empty file of a deleted namespace
(our neighbour entries, which the kernel never collects, are read on declared
bridges only: without files there are none to look at).
The firewall rules of allocations whose namespace is gone are not among them: the
files may still declare those allocations (a namespace deleted by hand), and the
rules hold their ``auto`` host ports; a warning names them. With files it also
collects what a prune would remove: owned objects nothing declares any more (of this
scope: Docker networks of another scope are never ours to remove), their rules
and their bridge-side neighbour entries included, and our neighbour entries on the
declared bridges whose allocation is gone.

It does not carry its own copy of the ownership rules: the removals are the
planner's own (``make_plan`` with nothing declared and pruning off gives the
always-garbage deletions, ``make_plan`` of the files with pruning on gives the
prunes), restricted to deletions. What the planner does not do by itself, this
module adds: namespaces without their veth (the planner heals those of declared
allocations, and prunes undeclared ones only when pruning), and, with files, firewall
rules removed by owner without any rule added. Every candidate is checked once more
against the mark on the object itself (``_marked``), and the finished plan holds
removal ops only (``only_removals``): a planner change that slipped a creation
into a deletion fails here rather than on the host.

Nothing declared in the files is collected: a declared allocation whose veth or
namespace went is healed by ``apply``, and its rules (its ``auto`` host ports)
are kept for it.

See docs/decisions/022-gc-is-the-planners-removals.md.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from reconciler.domain import fwmark
from reconciler.domain.docker import network_scope
from reconciler.domain.errors import PlanError
from reconciler.domain.hints import command
from reconciler.domain.live import LiveNeighbour, LiveState
from reconciler.domain.model import DesiredState
from reconciler.domain.nftable import Entry
from reconciler.domain.ops import (
    AddrDel,
    DockerRemove,
    FirewallNft,
    LinkDelete,
    LinkSet,
    NeighDelete,
    NetnsDelete,
    decode,
    encode,
)
from reconciler.domain.ownership import alloc_ns_alias, alloc_veth_name
from reconciler.domain.plan import Action, Change, Plan
from reconciler.planner import change_order, firewall, make_plan, nftplan
from reconciler.planner.allocs.live import owned_ns, peer_held, peer_held_warning, veth_pair_ok
from reconciler.planner.allocs.neighbours import own_neighbour
from reconciler.planner.context import PlanOptions, index_neighbours
from reconciler.planner.hostlinks import KEEPS_MTU_REASON, interrupted_creation

#: namespace name -> pids of the processes inside it (``drivers.procfs``)
Holders = Mapping[str, tuple[int, ...]]


def broken_namespaces(live: LiveState) -> list[str]:
    """Find owned allocation namespaces of this host whose veth pair is not whole:
    ``engine.gc`` asks who is inside these before planning."""
    return sorted(name for name, ns in live.netns.items()
                  if owned_ns(live.host_id, ns)
                  and not veth_pair_ok(ns, live.links.get(alloc_veth_name(name))))


def gc_plan(live: LiveState, desired: DesiredState | None = None, *,
            holders: Holders | None = None) -> Plan:
    """Plan the removals of `reconcile gc`: broken halves, and with ``desired`` also what a prune
    of it removes. ``holders``: who is inside each of :func:`broken_namespaces` (a held
    one is left alone without files, see :func:`_namespaces_without_veth`)."""
    declared = set(desired.allocs) if desired is not None else set()
    found: dict[str, Change] = {}
    warnings: list[str] = []
    errors: list[str] = []
    # what the planner removes whatever is declared: its warnings are about declared things
    always = make_plan(DesiredState(), live, PlanOptions(prune=False))
    entries = index_neighbours(live.neighbours)
    for c in always.changes:
        if (c.action is Action.DELETE and _marked(c, live, entries)
                and not _declared_alloc(c, declared)):
            found[c.address] = c
    if desired is None:
        for c in _namespaces_without_veth(live, holders or {}, warnings):
            found[c.address] = c
        # the planner leaves these alone (its warnings are not carried over): say why here
        warnings += [peer_held_warning(name, held) for name, lk in sorted(live.links.items())
                     if lk.kind == "veth" and lk.owned and (held := peer_held(live, lk))]
        kept = _vanished_allocs(live, found)
        if kept:
            warnings.append(_kept_rules_warning(kept))
        drop: set[str] = set()
    else:
        # a prune: it takes every undeclared owned namespace, veth or not
        pruned = make_plan(desired, live, PlanOptions(prune=True), desired.file_hashes)
        warnings += pruned.warnings
        errors += pruned.errors
        for c in pruned.changes:
            if c.kind == "firewall":
                continue  # its transaction also adds what is declared: by owner below
            if (c.action is Action.DELETE and _marked(c, live, entries)) \
                    or _keeps_mtu(c, live):
                found[c.address] = c
        drop = _undeclared_owners(live, desired)
    change = _rules_without(live, drop)
    if change is not None:
        found[change.address] = change
    plan = Plan(tuple(sorted(found.values(), key=change_order)), "",
                desired.file_hashes if desired is not None else (), tuple(warnings),
                tuple(errors), {"gc": True, "files": desired is not None})
    only_removals(plan, live)
    return plan


def _declared_alloc(c: Change, declared: Collection[str]) -> bool:
    """Tell whether ``c`` is a change of a declared allocation (its namespace, or its veth by
    name)."""
    if c.kind == "alloc":
        return c.name in declared
    return c.kind == "veth" and c.name in {alloc_veth_name(a) for a in declared}


#: the live neighbour entries as ``index_neighbours`` gives them
Neighbours = Mapping[tuple[int, str], Sequence[tuple[int, LiveNeighbour]]]


def _marked(c: Change, live: LiveState,
            entries: Neighbours) -> bool:
    """Tell whether the object ``c`` removes carries our mark itself (not only our kind of name)."""
    return _marked_neighbours(c, live, entries) and _marked_object(c, live)


def _marked_neighbours(c: Change, live: LiveState,
                       entries: Neighbours) -> bool:
    """Tell whether each neighbour entry ``c`` deletes (an orphan's, or a pruned allocation's with
    it) is one of ours as the planner tells them (``allocs.neighbours.own_neighbour``)."""
    for op in (decode(raw) for raw in c.ops if raw.name == NeighDelete.NAME):
        assert isinstance(op, NeighDelete)
        link = live.links.get(op.link)
        if link is None or not any(own_neighbour(link, n)
                                   for _, n in entries.get((link.index, op.address), ())):
            return False
    return True


def _marked_object(c: Change, live: LiveState) -> bool:
    if c.kind == "neighbour":
        return bool(c.ops) and all(op.name == NeighDelete.NAME for op in c.ops)
    if c.kind == "alloc":
        ns = live.netns.get(c.name)
        return ns is not None and (owned_ns(live.host_id, ns) or
                                   (not ns.usable and ns.file_mark == alloc_ns_alias(
                                       live.host_id)))
    if c.kind == "bridge" and interrupted_creation(live.links, c.name):
        return True  # marked by its alias or, killed before that, by its MAC
    if c.kind in ("veth", "bridge"):
        link = live.links.get(c.name)
        return link is not None and link.owned
    if c.kind == "subnet":
        # known only from rules carrying our comment; removes owned addresses only
        return all(op.name == AddrDel.NAME for op in c.ops)
    if c.kind == "docker_network":
        docker = live.docker
        if docker is None:
            return False
        ours = {n.id for n in docker.networks
                if n.owned and network_scope(n.labels) == docker.scope}
        ops = [decode(op) for op in c.ops]
        return bool(ops) and all(isinstance(op, DockerRemove) and op.id in ours for op in ops)
    return False


def _keeps_mtu(c: Change, live: LiveState) -> bool:
    """Tell whether ``c`` sets a declared bridge's MTU again after its last ports went: the value it
    has now.

    The kernel would set it to 1500 when the removal takes its last port
    (``hostlinks.keep_mtu_of_emptied_bridges``); setting it to what it is keeps it.
    """
    link = live.links.get(c.name)
    if c.kind != "bridge" or c.reason != KEEPS_MTU_REASON or link is None or not link.owned:
        return False
    ops = [decode(op) for op in c.ops]
    return all(isinstance(op, LinkSet) and op.mtu == link.mtu and op.up is None
               and op.master is None and not op.owned for op in ops)


def _namespaces_without_veth(live: LiveState, holders: Holders,
                             warnings: list[str]) -> list[Change]:
    """Plan the removal of owned namespaces whose veth pair is gone (deleted, or never made: a kill
    between creating the namespace and attaching its veth).

    One with processes inside is left alone, with a warning: without the files it may be
    a declared allocation's, whose next apply gives it a veth again; removed, its
    processes would keep a namespace without network for good.
    """
    out = []
    for name in broken_namespaces(live):
        held = holders.get(name, ())
        if held:
            pids = ", ".join(str(p) for p in held[:5]) + (" …" if len(held) > 5 else "")
            warnings.append(f"alloc {name}: its namespace has no veth, but processes are "
                            f"inside (pid {pids}): left alone (`{command('gc PATH')}` removes it "
                            "when no file declares it; an apply that declares it heals it)")
            continue
        veth = live.links.get(alloc_veth_name(name))
        ops = [encode(LinkDelete(veth.name))] if veth is not None and veth.owned else []
        out.append(Change("alloc", name, Action.DELETE, "broken: its namespace has no veth",
                          (), (*ops, encode(NetnsDelete(name)))))
    return out


def _live_owners(live: LiveState) -> set[str]:
    return {o for chains in (live.firewall4, live.firewall6)
            for o in firewall.live_by_owner(chains)}


def _vanished_allocs(live: LiveState, collected: Mapping[str, Change]) -> set[str]:
    """Find the ``alloc=ID`` owners of live rules whose allocation namespace is gone (or goes
    now)."""
    alive = {name for name, ns in live.netns.items()
             if owned_ns(live.host_id, ns) and f"alloc/{name}" not in collected}
    alive |= set(live.peer_namespaces.values())  # live, only not read as ours: not gone
    return {o for o in _live_owners(live)
            if o.startswith("alloc=") and o.partition("=")[2] not in alive}


def _kept_rules_warning(owners: Collection[str]) -> str:
    """Warn that without files, the rules of allocations whose namespace is gone stay: one line.

    Their namespace may have gone by hand (``ip netns del``) while the files still declare
    them, and their DNAT rules are what holds their ``auto`` host ports: removed, the next
    apply would pick other ones. The files decide: ``gc PATH`` (or an apply that prunes)
    removes the rules of allocations they do not declare.
    """
    names = ", ".join(f"alloc {o.partition('=')[2]}" for o in sorted(owners))
    return (f"the port-map rules of allocations whose namespace is gone are kept: {names} "
            "(the files may still declare them, and their rules hold their `auto` host "
            f"ports; `{command('gc PATH')}` removes them when the files no longer declare "
            "them)")


def _undeclared_owners(live: LiveState, desired: DesiredState) -> set[str]:
    """Find the owners of live rules that no file declares (what a prune's transaction drops)."""
    declared = ({f"subnet={n}" for n in desired.subnets} | {f"alloc={n}" for n in desired.allocs}
                | {f"bridge={n}" for n in desired.bridges})
    return {o for o in _live_owners(live) if o not in declared}


def _rules_without(live: LiveState, drop: set[str]) -> Change | None:
    """Plan the firewall change that removes the entries of the owners in ``drop``, nothing
    else: element deletions in our table, no element added and no rebuild."""
    if not live.table.available or not drop:
        return None
    keep = {e for e in live.table.entries if e.owner not in drop}
    change, _ = nftplan.plan_table(keep, live, prune=True, removal_only=True,
                                   bit=live.table.mark or fwmark.DEFAULT_MARK)
    return change


#: the ops a gc plan may hold
_REMOVALS = (LinkDelete, NetnsDelete, AddrDel, DockerRemove, FirewallNft,
             LinkSet, NeighDelete)


def only_removals(plan: Plan, live: LiveState) -> None:
    """Refuse (PlanError) a gc plan with an op that could create or change something.

    A ``LinkSet`` may only take a veth off its bridge before its namespace goes, or set a
    declared bridge's MTU to the value it has; a firewall transaction may only declare,
    rewrite (with live rules), flush, delete chains and delete rules.
    """
    for c in plan.changes:
        for raw in c.ops:
            op = decode(raw)
            ok = isinstance(op, _REMOVALS)
            if isinstance(op, LinkSet):
                link = live.links.get(op.name)
                ok = not op.owned and op.up is None and op.netns is None and (
                    (op.master == "" and op.mtu is None)
                    or (op.master is None and link is not None and op.mtu == link.mtu))
            elif isinstance(op, FirewallNft):
                ok = (not op.add and not op.rebuild and not op.drop_table and not op.cleanup4
                      and not op.cleanup6
                      and {Entry.of_wire(d) for d in op.delete} <= live.table.entries)
            if not ok:
                raise PlanError(f"gc: {c.kind} {c.name}: {raw.describe()} is not a removal; "
                                "nothing collected")


