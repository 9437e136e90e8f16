"""Which foreign rules decided a failed probe's packet, from two ``iptables-save -c`` snapshots
(pure): the counters that rose between them.

See docs/decisions/031-probes-capture-decides.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.domain.ownership import CHAIN_PREFIX
from reconciler.planner import fwpaths


@dataclass(frozen=True)
class RuleHit:
    """A foreign rule that decided a probe's packet: a DROP/REJECT rule (or a chain's DROP
    policy) whose counter rose, a legacy DNAT/REDIRECT that sent it elsewhere, an accept
    above our jump that let it by."""

    family: int
    table: str
    chain: str
    rule: str  # "-A CHAIN ..." as iptables-save prints it, or "policy DROP"
    #: in iptables-legacy's tables, beside the nf_tables backend the reconciler writes
    legacy: bool = False

    def __str__(self) -> str:
        tool = ("iptables" if self.family == 4 else "ip6tables") + ("-legacy" if self.legacy
                                                                    else "")
        prefix = "" if tool == "iptables" else f"{tool} "
        return f"{prefix}{self.table}/{self.chain}: {self.rule}"

    @property
    def target(self) -> str:
        if self.rule.startswith("policy "):
            return self.rule.split()[1]
        return fwpaths.target(self.rule)[0]


_Counted = dict[tuple[str, str, str, int], tuple[int, str]]


def parse_counters(text: str) -> _Counted:
    """Parse ``iptables-save -c`` as {(table, chain, rule or "policy X", n): (packets, target)}
    (pure).

    Rules are keyed by their text (and its occurrence), not position, so a rule
    inserted between two snapshots shifts nothing.
    """
    out: _Counted = {}
    table = ""
    seen: dict[tuple[str, str, str], int] = {}
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif line.startswith(":"):
            parts = line[1:].split()
            if len(parts) >= 3 and parts[1] != "-":
                out[(table, parts[0], f"policy {parts[1]}", 0)] = (_packets(parts[2]), parts[1])
        elif line.startswith("[") and "] -A " in line:
            counter, rule = line.split("] ", 1)
            tokens = rule.split()
            chain = tokens[1] if len(tokens) > 1 else ""
            target = tokens[tokens.index("-j") + 1] if "-j" in tokens[:-1] else ""
            n = seen.get((table, chain, rule), 0)
            seen[(table, chain, rule)] = n + 1
            out[(table, chain, rule, n)] = (_packets(counter + "]"), target)
    return out


def _packets(counter: str) -> int:
    try:
        return int(counter.strip("[]").split(":")[0])
    except ValueError:
        return 0


def foreign_hits(family: int, before: str, after: str, *, legacy: bool = False) -> list[RuleHit]:
    """Find the foreign (not ``RECONCILER-*``) DROP/REJECT rules and DROP policies whose
    counters rose between two ``iptables-save -c`` snapshots, in any table (raw included),
    and their DNAT and REDIRECT rules: one that takes a mapped host port before our jump
    sends the probe elsewhere (``legacy``: snapshots of iptables-legacy beside our
    nf_tables backend).
    """
    old = parse_counters(before)
    targets = ("DROP", "REJECT", "DNAT", "REDIRECT")
    hits = []
    for key, (packets, target) in parse_counters(after).items():
        table, chain, rule, _n = key
        if chain.startswith(CHAIN_PREFIX) or target not in targets:
            continue
        if packets > old.get(key, (0, ""))[0]:
            hits.append(RuleHit(family, table, chain, rule, legacy))
    return hits
