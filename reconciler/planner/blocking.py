"""Say what cannot converge in a plan, what depends on what, and what is blocked with it.

SPEC §11 "Partial progress": a resource that cannot converge (a conflict, a refused
replace) blocks only itself and what depends on it; everything else is applied.
Creates and updates follow bridge -> subnet -> allocation (a bridge's sysctls and
neighbour entries follow their bridge); deletions run the other way round (a
blocked allocation deletion blocks the deletion of the subnets and bridges, never
the reverse); Docker networks depend on nothing but their prefix.

See docs/decisions/043-partial-progress.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence

from reconciler.domain.model import DesiredState
from reconciler.domain.plan import Action, Blocked, Change, Plan

#: kinds a deletion of each kind waits for (their deletions come first, and one that fails
#: leaves what it hangs on in place)
_DELETED_AFTER = {"subnet": ("alloc", "veth"), "bridge": ("alloc", "veth", "subnet", "neighbour")}


def needs(desired: DesiredState, change: Change,
          deletions: Sequence[Change] = ()) -> tuple[str, ...]:
    """Return the addresses of the changes ``change`` needs done first (pure).

    ``deletions``: the plan's deletions (what a deletion waits for). Kinds not named
    here (the firewall, global sysctls, Docker networks) need nothing.
    """
    if change.action is Action.DELETE:
        after = _DELETED_AFTER.get(change.kind, ())
        return tuple(d.address for d in deletions if d.kind in after and d is not change)
    if change.kind == "subnet":
        s = desired.subnets.get(change.name)  # type: ignore[call-overload]
        return (f"bridge/{s.bridge}",) if s is not None else ()
    if change.kind == "alloc":
        a = desired.allocs.get(change.name)  # type: ignore[call-overload]
        s = desired.subnets.get(a.subnet) if a is not None else None
        return (f"subnet/{s.name}", f"bridge/{s.bridge}") if s is not None else ()
    bridge = _bridge_of(change)
    if bridge is not None and bridge in desired.bridges:
        return (f"bridge/{bridge}",)
    return ()


def _bridge_of(change: Change) -> str | None:
    """Name the bridge a per-bridge change belongs to: its sysctls (``net/ipv4/conf/BR/…``),
    its neighbour entries (``BR/ADDRESS``); None for the others."""
    if change.kind == "sysctl":
        parts = change.name.split("/")
        if len(parts) >= 4 and parts[2] == "conf" and parts[3] not in ("all", "default"):
            return parts[3]
        return None
    if change.kind == "neighbour":
        return change.name.split("/", 1)[0]
    return None


def with_needs(desired: DesiredState, changes: Sequence[Change]) -> list[Change]:
    """Give each change what it needs (``Change.needs``), for the executor."""
    deletions = [c for c in changes if c.action is Action.DELETE]
    out = []
    for c in changes:
        n = needs(desired, c, deletions)
        out.append(dataclasses.replace(c, needs=n) if n else c)
    return out


def blocked_list(desired: DesiredState, changes: Iterable[Change],
                 blocked: Iterable[str]) -> tuple[Blocked, ...]:
    """List what cannot converge: every conflict (its own reason), then each resource the
    planner left alone because something it depends on is blocked (``blocked``, the
    context's "kind/name" set), naming that one."""
    out: list[Blocked] = []
    by_address = {c.address: c for c in changes}
    roots = {a for a, c in by_address.items() if c.action is Action.CONFLICT}
    for c in by_address.values():
        if c.action is Action.CONFLICT:
            out.append(Blocked(c.kind, c.name, c.reason))
    rank = {"bridge": 0, "subnet": 1, "alloc": 2}
    for address in sorted(set(blocked) - roots,
                          key=lambda a: (rank.get(a.partition("/")[0], 3), a)):
        dep = by_address.get(address)
        if dep is None or dep.action is not Action.NOOP:
            continue
        by = _blocked_by(desired, dep, set(blocked))
        out.append(Blocked(dep.kind, dep.name, f"blocked by {by.replace('/', ' ', 1)}"
                           if by else dep.reason or "blocked", by))
    return tuple(out)


def _blocked_by(desired: DesiredState, c: Change, blocked: set[str]) -> str | None:
    for need in needs(desired, c):
        if need in blocked:
            return need
    return None



def hold_back(plan: Plan, held: Mapping[str, str]) -> Plan:
    """Move the changes of ``held`` resources ("kind/name" -> why), and those that need one of
    them, out of ``plan`` into its blocked list (the agent's per-resource backoff)."""
    if not held:
        return plan
    out: list[Change] = []
    blocked = list(plan.blocked)
    gone: dict[str, str] = {}
    for c in plan.changes:
        if c.action in (Action.NOOP, Action.CONFLICT):
            out.append(c)
            continue
        why = held.get(c.address)
        need = next((n for n in c.needs if n in gone), None)
        if why is None and need is not None:
            why = f"blocked by {need.replace('/', ' ', 1)}"
        if why is None:
            out.append(c)
            continue
        gone[c.address] = why
        blocked.append(Blocked(c.kind, c.name, why, need))
    return dataclasses.replace(plan, changes=tuple(out), blocked=tuple(blocked))


def without(plan: Plan, addresses: Collection[str]) -> Plan:
    """Drop the changes of ``addresses`` from a verification's residual."""
    if not addresses:
        return plan
    return dataclasses.replace(plan, changes=tuple(c for c in plan.changes
                                                   if c.address not in addresses))
