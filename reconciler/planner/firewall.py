"""Desired iptables rules (pure) and the one restore transaction that converges them.

Every rule we write is in a chain we own (``RECONCILER-*``) except one jump
per chain from the built-in chain that feeds it. Rules carry a comment naming
the resource they serve (``reconciler:subnet=NAME``) so live rules can be
attributed, and an unknown owner is recognisably stale.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from reconciler.domain.live import LiveChainSet
from reconciler.domain.model import DesiredState, Subnet
from reconciler.domain.ops import FirewallRestore, encode
from reconciler.domain.ownership import CHAIN_PREFIX, RULE_COMMENT
from reconciler.domain.plan import Action, AttrChange, Change

FORWARD = CHAIN_PREFIX + "FORWARD"
POSTROUTING = CHAIN_PREFIX + "POSTROUTING"
DNAT = CHAIN_PREFIX + "DNAT"

_LOCAL = ("-m", "addrtype", "--dst-type", "LOCAL")
#: owned chain -> its table and the built-in chains that jump to it (with match tokens):
#: port maps are DNAT'd for traffic arriving from outside (PREROUTING) and for the host's
#: own connections, 127.0.0.1 included (OUTPUT), in both cases only to local addresses.
JUMPS: dict[str, tuple[str, tuple[tuple[str, tuple[str, ...]], ...]]] = {
    FORWARD: ("filter", (("FORWARD", ()),)),
    POSTROUTING: ("nat", (("POSTROUTING", ()),)),
    DNAT: ("nat", (("PREROUTING", _LOCAL), ("OUTPUT", _LOCAL))),
}
TABLE_ORDER = ("filter", "nat")
#: "[" "]" for IPv6 DNAT targets (``[fd00::2]:80``); still nothing that ends a token or line
_SAFE_TOKEN = re.compile(r"^[A-Za-z0-9_.:/=!,+\[\]\-]+$")


def comment(owner_kind: str, owner: str) -> tuple[str, ...]:
    return ("-m", "comment", "--comment", f"{RULE_COMMENT}:{owner_kind}={owner}")


def jump_rule(chain: str, match: tuple[str, ...]) -> str:
    return " ".join((*match, "-m", "comment", "--comment", RULE_COMMENT, "-j", chain))


_OWNER = re.compile(r"--comment " + re.escape(RULE_COMMENT) + r":(\S+)")


def owner_of(rule: str) -> str | None:
    """``subnet=NAME`` / ``alloc=ID`` from a rule's comment, if it is one of ours."""
    m = _OWNER.search(rule)
    return m.group(1) if m else None


def by_owner(chains: Iterable[tuple[str, Iterable[str]]]) -> dict[str, list[tuple[str, str]]]:
    """Our rules grouped by the resource they serve (``subnet=NAME``), as (chain, rule)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for chain, rules in chains:
        for r in rules:
            owner = owner_of(r)
            if owner is not None:
                out.setdefault(owner, []).append((chain, r))
    return out


def live_by_owner(live: LiveChainSet) -> dict[str, list[tuple[str, str]]]:
    """:func:`by_owner` over the live chains of one family (built-in and owned)."""
    return by_owner((chain, rules) for (_t, chain), rules in sorted(live.chains.items()))


@dataclass
class RuleSet:
    """Desired rules of one family: owned chain -> rules in order."""

    family: int
    chains: dict[str, list[str]] = field(default_factory=dict)

    def add(self, chain: str, tokens: Iterable[str]) -> None:
        toks = tuple(tokens)
        for t in toks:
            # Defence in depth: names are validated by the loader, but nothing that
            # could end a token or a line ever reaches iptables-restore.
            if not _SAFE_TOKEN.fullmatch(t):
                raise ValueError(f"unsafe iptables token {t!r}")
        self.chains.setdefault(chain, []).append(" ".join(toks))

    def table_of(self, chain: str) -> str:
        return JUMPS[chain][0] if chain in JUMPS else "nat"


def subnet_rules(rs: RuleSet, s: Subnet) -> None:
    """Nomad's admin chain (forward accept both ways) and masquerade of egress."""
    cidr = s.cidr if rs.family == 4 else s.cidr6
    if cidr is None:
        return
    c = comment("subnet", s.name)
    rs.add(FORWARD, ("-d", str(cidr), "-o", s.bridge, *c, "-j", "ACCEPT"))
    rs.add(FORWARD, ("-s", str(cidr), "-i", s.bridge, *c, "-j", "ACCEPT"))
    if s.masquerade:
        rs.add(POSTROUTING, ("-s", str(cidr), "!", "-d", str(cidr), *c, "-j", "MASQUERADE"))


def desired_rules(desired: DesiredState, family: int) -> RuleSet:
    rs = RuleSet(family)
    for name in sorted(desired.subnets):
        subnet_rules(rs, desired.subnets[name])
    return rs


# Rules for further kinds (alloc port maps) register here: fn(desired, ruleset, context).
EXTRA_RULES: list[object] = []


def _owned_chains(live: LiveChainSet) -> dict[tuple[str, str], tuple[str, ...]]:
    return {k: v for k, v in live.chains.items() if k[1].startswith(CHAIN_PREFIX)}


_OUR_JUMP_MARK = f"--comment {RULE_COMMENT} -j {CHAIN_PREFIX}"


def _live_jumps(live: LiveChainSet) -> dict[tuple[str, str], list[str]]:
    """Our jump rules (carrying our comment) in chains we do not own, by (table, chain)."""
    out: dict[tuple[str, str], list[str]] = {}
    for (table, chain), rules in live.chains.items():
        if chain.startswith(CHAIN_PREFIX):
            continue
        for r in rules:
            if _OUR_JUMP_MARK in r:
                out.setdefault((table, chain), []).append(r)
    return out


def _foreign_references(live: LiveChainSet, table: str, chain: str) -> list[str]:
    """Rules someone else wrote that jump or go to ``chain``: we never delete those."""
    refs = []
    for (t, c), rules in live.chains.items():
        if t != table or c.startswith(CHAIN_PREFIX):
            continue
        for r in rules:
            toks = r.split()
            if _OUR_JUMP_MARK not in r and any(
                    toks[i] in ("-j", "-g", "--jump", "--goto") and toks[i + 1] == chain
                    for i in range(len(toks) - 1)):
                refs.append(f"{c}: {r}")
    return refs


@dataclass(frozen=True)
class FirewallDiff:
    script: str
    attrs: tuple[AttrChange, ...]
    missing_owners: frozenset[str]
    stale_owners: frozenset[str]
    empty_desired: bool
    empty_live: bool
    warnings: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.script)


def diff(rs: RuleSet, live: LiveChainSet) -> FirewallDiff:
    """Compare desired and live owned chains; build the restore script that converges them."""
    owned = _owned_chains(live)
    live_jumps = _live_jumps(live)
    # per table, in the order iptables-restore needs: declarations, rules, jumps, removals
    per_table: dict[str, tuple[list[str], list[str], list[str], list[str]]] = {}

    def bucket(table: str, i: int) -> list[str]:
        return per_table.setdefault(table, ([], [], [], []))[i]

    attrs: list[AttrChange] = []
    warnings: list[str] = []
    missing: set[str] = set()
    stale: set[str] = set()
    desired_keys = {(rs.table_of(ch), ch) for ch, rules in rs.chains.items() if rules}

    for chain in sorted(rs.chains):
        rules = rs.chains[chain]
        if not rules:
            continue
        table = rs.table_of(chain)
        have = owned.get((table, chain))
        if have is None or tuple(have) != tuple(rules):
            before = list(have or ())
            missing |= {o for r in rules if r not in before and (o := owner_of(r))}
            stale |= {o for r in before if r not in rules and (o := owner_of(r))}
            attrs.append(AttrChange(f"{table}/{chain}",
                                    f"{len(before)} rules" if have is not None else None,
                                    f"{len(rules)} rules"))
            bucket(table, 0).append(f":{chain} - [0:0]")
            bucket(table, 1).extend(f"-A {chain} {r}" for r in rules)
        for builtin, match in (JUMPS[chain][1] if chain in JUMPS else ()):
            want = jump_rule(chain, match)
            jumps = [j for j in live_jumps.get((table, builtin), []) if j.split()[-1] == chain]
            if want not in jumps:
                bucket(table, 2).append(f"-I {builtin} 1 {want}")
                attrs.append(AttrChange(f"{table}/{builtin} jump to {chain}", None, "present"))
            extra = list(jumps)
            if want in extra:
                extra.remove(want)
            for j in extra:
                bucket(table, 2).append(f"-D {builtin} {j}")
            if extra:
                attrs.append(AttrChange(f"{table}/{builtin} jump to {chain}",
                                        f"{len(jumps)} copies", "1 copy"))

    # owned chains nobody wants any more: drop their jumps, flush, delete
    for (table, chain) in sorted(owned):
        if (table, chain) in desired_keys:
            continue
        ours = [(builtin, j) for (jt, builtin), rules in live_jumps.items() if jt == table
                for j in rules if j.split()[-1] == chain]
        foreign = _foreign_references(live, table, chain)
        if foreign:
            # -X would fail (and abort the whole transaction) while a rule refers to it
            warnings.append(f"ipv{rs.family} {table}/{chain} is no longer needed but is kept "
                            f"(emptied): rules the reconciler did not write refer to it: "
                            f"{'; '.join(foreign[:3])}")
            if not owned[(table, chain)] and not ours:
                continue  # already as empty as it can be: nothing to do, every run
        stale |= {o for r in owned[(table, chain)] if (o := owner_of(r))}
        attrs.append(AttrChange(f"{table}/{chain}", f"{len(owned[(table, chain)])} rules", None))
        bucket(table, 2).extend(f"-D {builtin} {j}" for builtin, j in ours)
        bucket(table, 3).append(f"-F {chain}")
        if not foreign:
            bucket(table, 3).append(f"-X {chain}")

    script = ""
    for table in sorted(per_table, key=lambda t: (t not in TABLE_ORDER, t)):
        lines = [line for part in per_table[table] for line in part]
        if lines:
            script += f"*{table}\n" + "\n".join(lines) + "\nCOMMIT\n"
    return FirewallDiff(script, tuple(attrs), frozenset(missing), frozenset(stale),
                        not desired_keys, not owned, tuple(warnings))


def firewall_change(family: int, d: FirewallDiff) -> Change | None:
    if not d.changed:
        return None
    if d.empty_live:
        action, reason = Action.CREATE, "owned chains missing"
    elif d.empty_desired:
        action, reason = Action.DELETE, "no resource needs rules any more"
    else:
        parts = []
        if d.missing_owners:
            parts.append("rules missing for " + ", ".join(sorted(d.missing_owners)))
        if d.stale_owners - d.missing_owners:
            parts.append("stale rules of " + ", ".join(sorted(d.stale_owners - d.missing_owners)))
        action, reason = Action.UPDATE, "; ".join(parts) or "rules or jumps differ"
    return Change("firewall", f"ipv{family}", action, reason, d.attrs,
                  (encode(FirewallRestore(family, d.script)),))
