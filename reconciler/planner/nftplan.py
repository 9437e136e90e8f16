"""Plan the change of our nftables table: entries added and deleted, or the table rebuilt.

The desired entries come from the planner's rules (``nftview.entries_of``), the live ones
from the table read back. A table missing, not this version's, or changed by someone
(a chain flushed, a rule deleted, an element without our owner) is rebuilt whole in the
same one transaction. The first apply on a host holding the ``RECONCILER-*`` iptables
chains of earlier versions builds the table and then, in the same op, removes those
chains and the jumps into them: both hold the same rules meanwhile.

See docs/decisions/045-nftables-table-of-our-own.md and 046-upgrade-from-iptables-chains.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from reconciler.domain.live import LiveChainSet, LiveState
from reconciler.domain.nftable import Entry
from reconciler.domain.ops import FirewallNft, encode
from reconciler.domain.ownership import CHAIN_PREFIX
from reconciler.domain.plan import Action, AttrChange, Change
from reconciler.planner import firewall, nftview, shim

NAME = "nftables"


def has_old_chains(old: LiveChainSet) -> bool:
    return old.available and any(c.startswith(CHAIN_PREFIX) for _t, c in old.chains)


def cleanup_scripts(live: LiveState) -> tuple[str, str, list[str]]:
    """Return the iptables-restore scripts that remove earlier versions' chains (v4, v6)
    and the warnings of chains kept (a foreign rule refers to one)."""
    scripts: list[str] = []
    warnings: list[str] = []
    for family, old in ((4, live.old4), (6, live.old6)):
        if not has_old_chains(old):
            scripts.append("")
            continue
        d = firewall.diff(firewall.RuleSet(family), old, add_jumps=False)
        scripts.append(d.script)
        warnings += d.warnings
    return scripts[0], scripts[1], warnings


def _count(entries: Iterable[Entry]) -> Counter[str]:
    return Counter(e.set for e in entries)


def plan_table(desired: set[Entry], live: LiveState, *, prune: bool, bit: int,
               removal_only: bool = False) -> tuple[Change | None, list[str]]:
    """Return the change that converges our table on ``desired`` (None: nothing to do) and
    warnings. ``bit``: the mark the forward chain ORs in (a table ORing another is rebuilt).
    ``removal_only`` (``gc``): delete entries, never add or rebuild."""
    table = live.table
    c4, c6, warnings = ("", "", []) if removal_only else cleanup_scripts(live)
    have = set(table.entries)
    other_mark = table.exists and table.mark is not None and table.mark != bit
    rebuild = not removal_only and (not table.exists or not table.intact or other_mark)
    drop = prune and not desired and table.exists and not removal_only
    if rebuild and not desired and not table.exists:
        rebuild = False  # nothing to build, nothing to replace
    if removal_only:
        add: set[Entry] = set()
        delete = have - desired
    elif rebuild:
        add, delete = desired, set()
    else:
        add, delete = desired - have, have - desired
    if not (add or delete or rebuild or drop or c4 or c6):
        return None, warnings
    attrs = []
    before, after = _count(have), _count(desired if not removal_only else have - delete)
    for name in sorted({*before, *after}):
        if before[name] != after[name] or rebuild:
            attrs.append(AttrChange(f"set {name}", f"{before[name]} entries" if table.exists
                                    else None, f"{after[name]} entries"))
    reasons = []
    if not table.exists:
        action, reasons = Action.CREATE, ["table inet reconciler missing"]
    elif drop:
        action, reasons = Action.DELETE, ["no resource needs rules any more"]
    else:
        action = Action.UPDATE
        if rebuild and not table.intact:
            reasons.append(f"table inet reconciler differs: {table.broken}")
        if rebuild and other_mark:
            reasons.append(f"the mark bit changed ({table.mark:#x} to {bit:#x})")
            attrs.append(AttrChange("mark", f"{table.mark:#x}", f"{bit:#x}"))
        have_keys = {(e.set, e.key) for e in have}
        want_keys = {(e.set, e.key) for e in desired}
        missing = sorted({e.owner for e in add if (e.set, e.key) not in have_keys})
        if missing and not rebuild:
            reasons.append("entries missing for " + ", ".join(missing))
        stale = sorted({e.owner for e in delete if (e.set, e.key) not in want_keys})
        if stale:
            reasons.append("stale entries of " + ", ".join(stale))
        changed = sorted({e.owner for e in add if (e.set, e.key) in have_keys})
        if changed and not rebuild:
            reasons.append("entries changed for " + ", ".join(changed))
    for family, old in ((4, live.old4), (6, live.old6)):
        if removal_only:
            break
        if has_old_chains(old):
            reasons.append(f"converting the RECONCILER-* ip{'' if family == 4 else '6'}tables "
                           "chains of earlier versions")
            attrs.append(AttrChange(f"ipv{family} RECONCILER-* chains", "present", None))
    op = FirewallNft(rebuild=rebuild, add=tuple(e.wire() for e in sorted(add)),
                     delete=tuple(e.wire() for e in sorted(delete)), drop_table=drop,
                     mark=bit, cleanup4=c4, cleanup6=c6)
    return Change("firewall", NAME, action, "; ".join(reasons), tuple(attrs),
                  (encode(op),)), warnings


def observed(live: LiveState) -> dict[str, object]:
    """Return what the plan's fingerprint records of the firewall."""
    return {"exists": live.table.exists, "intact": live.table.intact,
            "entries": sorted(f"{e.set} {' '.join(e.key)} {' '.join(e.data)} {e.owner}"
                              for e in live.table.entries),
            "old": [f"{f}:{c}" for f, o in ((4, live.old4), (6, live.old6))
                    for _t, c in sorted(o.chains) if c.startswith(CHAIN_PREFIX)],
            "mark": live.table.mark,
            # the filter chains the mark shim (``planner.shim``) is kept in
            "shim": {f"{f}:{c}": [o.policies.get(("filter", c)),
                                  list(o.chains.get(("filter", c), ()))]
                     for f, o in ((4, live.old4), (6, live.old6)) for c in shim.CHAINS}}


def entries(rule_sets: Iterable[firewall.RuleSet]) -> set[Entry]:
    return nftview.entries_of(rule_sets)
