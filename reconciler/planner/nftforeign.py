"""Drops in other managers' own nftables tables, for a failed probe's cause (pure).

iptables-save shows only iptables-nft's tables; a table someone made with ``nft``
(``inet foo``, a base chain on the forward hook) drops a declared path while our rules and
the iptables counters all look fine. Here ``nft -a list ruleset`` (before and after a
failed probe's re-run) is read for the rules of such tables that end in ``drop`` or
``reject`` and the base chains whose policy is drop: a rule whose counter rose drops the
probe for certain; one without a counter is named when it names the probe (its address or
port) or matches everything; a dropping policy when the probe's path crosses its hook.

See docs/decisions/049-diagnosis-names-what-issue-26-saw.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: iptables-nft's tables (read through iptables-save -c already) by family
IPTABLES_TABLES = frozenset({"filter", "nat", "mangle", "raw", "security"})
_TABLE = re.compile(r"^table (\S+) (\S+) \{$")
_CHAIN = re.compile(r"^chain (\S+) \{$")
_TYPE = re.compile(r"^type \S+ hook (\S+) .*policy (\w+);")
_HANDLE = re.compile(r"\s*# handle (\d+)$")
_COUNTER = re.compile(r"counter packets (\d+) bytes \d+ ?")
_VERDICT = re.compile(r"\b(drop|reject(?: with .*)?)$")


@dataclass(frozen=True)
class NftRule:
    """A rule (or ``policy drop``) of another manager's nftables table that can drop."""

    family: str
    table: str
    chain: str
    hook: str | None  # the chain's hook when it is a base chain
    text: str  # the rule without its counter and handle, or "policy drop"
    handle: int  # 0 for a policy
    packets: int | None  # its counter, if it has one

    def where(self) -> str:
        hook = f" (hook {self.hook})" if self.hook else ""
        return f"nftables {self.family} {self.table}/{self.chain}{hook}: {self.text}"


def parse_ruleset(text: str) -> list[NftRule]:
    """Read the dropping rules and policies of ``nft -a list ruleset`` outside iptables-nft's
    tables and ours (``reconciler*``)."""
    out: list[NftRule] = []
    family = table = chain = None
    hook: str | None = None
    depth = 0
    for raw in text.splitlines():
        full = raw.strip()
        h = _HANDLE.search(full)
        line = full[: h.start()].strip() if h else full
        if line == "}":
            depth -= 1
            if depth <= 1:
                chain = hook = None
            if depth <= 0:
                family = table = None
            continue
        if m := _TABLE.match(line):
            family, table, depth = m.group(1), m.group(2), 1
            continue
        if line.endswith("{"):
            depth += 1
            if depth == 2 and (m := _CHAIN.match(line)):
                chain = m.group(1)
            continue
        if family is None or table is None or chain is None or depth != 2:
            continue
        if (family in ("ip", "ip6") and table in IPTABLES_TABLES) or \
                table.startswith("reconciler"):
            continue
        if m := _TYPE.match(line):
            hook = m.group(1)
            if m.group(2) == "drop":
                out.append(NftRule(family, table, chain, hook, "policy drop", 0, None))
            continue
        if h is None:
            continue
        body = line
        c = _COUNTER.search(body)
        packets = int(c.group(1)) if c else None
        body = _COUNTER.sub("", body).strip()
        if _VERDICT.search(body):
            out.append(NftRule(family, table, chain, hook, body, int(h.group(1)), packets))
    return out


#: the hooks the first packet of a probe's path crosses, by whether the host forwards it
FORWARDED_HOOKS = frozenset({"prerouting", "forward", "postrouting"})
LOCAL_HOOKS = frozenset({"output", "postrouting", "input"})


def drops(before: str, after: str, *, family: int, forwarded: bool,
          names: frozenset[str]) -> list[NftRule]:
    """Find what can have dropped a probe: rules whose counter rose first, then rules without
    a counter that name it (``names``: its addresses and ports) or match everything, then
    dropping policies on hooks its path crosses. ``family`` 4 reads ``ip`` and ``inet``
    tables, 6 ``ip6`` and ``inet``."""
    fams = {"inet", "ip" if family == 4 else "ip6"}
    hooks = FORWARDED_HOOKS if forwarded else LOCAL_HOOKS
    old = {(r.family, r.table, r.chain, r.handle): r.packets for r in parse_ruleset(before)}
    rose, named, policies = [], [], []
    for r in parse_ruleset(after):
        if r.family not in fams:
            continue
        if r.handle == 0:
            if r.hook in hooks:
                policies.append(r)
        elif r.packets is not None:
            if r.packets > (old.get((r.family, r.table, r.chain, r.handle)) or 0):
                rose.append(r)
        elif _VERDICT.fullmatch(r.text) or set(re.split(r"[\s,{}:]+", r.text)) & names:
            named.append(r)
    return rose + named + policies
