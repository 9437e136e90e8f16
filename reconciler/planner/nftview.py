"""Translate between the planner's rules and the entries of our nftables table (pure).

The planner states what each resource needs in the rule form of ``planner.firewall``
(``RuleSet``: a DNAT of a host port, an isolation drop, a masquerade), and every reader
of the firewall (ports kept, stale conntrack entries, probes, ``show``, ``graph``, ``gc``,
impact) reads that form. The table holds the same facts as set and map entries: here is
the one mapping, both ways, so :func:`entries_of` of a rule set and :func:`view` of the
entries read back compare equal rule for rule.

See docs/decisions/045-nftables-table-of-our-own.md.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from reconciler.domain import nftable
from reconciler.domain.live import LiveChainSet
from reconciler.domain.nftable import Entry
from reconciler.domain.ownership import RULE_COMMENT
from reconciler.planner import firewall


def _opts(rule: str) -> tuple[dict[str, str], set[str]]:
    t = rule.split()
    opts: dict[str, str] = {}
    negated: set[str] = set()
    for i in range(len(t) - 1):
        if t[i].startswith("-"):
            opts.setdefault(t[i], t[i + 1])
            if i > 0 and t[i - 1] == "!":
                negated.add(t[i])
    return opts, negated


def _net(text: str) -> str:
    return str(ipaddress.ip_network(text, strict=False))


def entry_of(family: int, chain: str, rule: str) -> Entry | None:
    """Return the entry a rule of ours stands for, or None (not one of ours, or unread)."""
    owner = firewall.owner_of(rule)
    if owner is None:
        return None
    v = family
    o, neg = _opts(rule)
    target = o.get("-j", "")
    try:
        if chain == firewall.DNAT:
            d = firewall.parse_dnat(rule)
            if d is None:
                return None
            if d.host_ip is None:
                return Entry(f"pm{v}", (d.proto, str(d.port)), (str(d.dest), str(d.to)), owner)
            return Entry(f"pmip{v}", (str(d.host_ip), d.proto, str(d.port)),
                         (str(d.dest), str(d.to)), owner)
        if chain == firewall.FORWARD:
            if "-d" in o and "-o" in o and ("--ctstate" in o or target == "DROP"):
                return Entry(f"ports{v}", (o["-o"], _net(o["-d"])), (), owner)
            if "-s" in o and "-d" in o:
                return Entry(f"intra{v}", (o["-i"], _net(o["-s"]), _net(o["-d"])), (), owner)
            if "-d" in o:
                return Entry(f"open{v}", (o["-o"], _net(o["-d"])), (), owner)
            return Entry(f"egress{v}", (o["-i"], _net(o["-s"])), (), owner)
        if chain == firewall.POSTROUTING:
            if "-d" in neg:
                return Entry(f"masq{v}", (_net(o["-s"]),), (), owner)
            if "--ctstate" in o:
                return Entry(f"hairpin{v}", (o["-o"], _net(o["-s"]), _net(o["-d"])), (), owner)
            return Entry("lomasq", (o["-o"],), (), owner)
        if chain == firewall.INPUT:
            return Entry("guarded", (o["-i"],), (), owner)
    except (KeyError, ValueError):
        return None
    return None


def entries_of(rule_sets: Iterable[firewall.RuleSet]) -> set[Entry]:
    """Return the entries the rules of ``rule_sets`` stand for (one per set and key: the
    first owner in the rules' order keeps a key two resources share)."""
    out: dict[tuple[str, tuple[str, ...]], Entry] = {}
    for rs in rule_sets:
        for chain, rules in rs.chains.items():
            for r in rules:
                e = entry_of(rs.family, chain, r)
                if e is not None:
                    try:
                        e.check()
                    except ValueError:
                        continue
                    out.setdefault((e.set, e.key), e)
    return set(out.values())


def _c(owner: str) -> str:
    return f"-m comment --comment {RULE_COMMENT}:{owner}"


def rules_of(e: Entry) -> list[tuple[str, str, str, bool]]:
    """Return the rules an entry stands for: (table, chain, rule, head of the chain)."""
    c, k = _c(e.owner), e.key
    kind = e.set.rstrip("46")
    if kind in ("pm", "pmip"):
        dest = f"{e.data[0]}:{e.data[1]}" if "." in e.data[0] else f"[{e.data[0]}]:{e.data[1]}"
        host = e.key[0] if kind == "pmip" else None
        proto, port = e.key[-2:]
        match = f"-d {host}/{ipaddress.ip_address(host).max_prefixlen} " if host else ""
        return [("nat", firewall.DNAT, f"{match}-p {proto} -m {proto} --dport {port} {c} "
                 f"-j DNAT --to-destination {dest}", False)]
    if kind == "ports":
        br, net = k
        return [("filter", firewall.FORWARD, f"-d {net} -o {br} -m conntrack --ctstate "
                 f"{firewall.ADMITTED} {c} -j ACCEPT", True),
                ("filter", firewall.FORWARD, f"-d {net} -o {br} {c} -j DROP", True)]
    if kind == "intra":
        br, s, d = k
        return [("filter", firewall.FORWARD, f"-s {s} -d {d} -i {br} -o {br} {c} -j ACCEPT", True)]
    if kind == "open":
        return [("filter", firewall.FORWARD, f"-d {k[1]} -o {k[0]} {c} -j ACCEPT", True)]
    if kind == "egress":
        return [("filter", firewall.FORWARD, f"-s {k[1]} -i {k[0]} {c} -j ACCEPT", False)]
    if kind == "masq":
        return [("nat", firewall.POSTROUTING, f"-s {k[0]} ! -d {k[0]} {c} -j MASQUERADE", False)]
    if kind == "hairpin":
        br, s, d = k
        return [("nat", firewall.POSTROUTING, f"-s {s} -d {d} -o {br} -m conntrack --ctstate DNAT "
                 f"{c} -j MASQUERADE", False)]
    if kind == "lomasq":
        return [("nat", firewall.POSTROUTING, f"-s 127.0.0.0/8 -o {k[0]} {c} -j MASQUERADE", False)]
    return [("filter", firewall.INPUT, f"-i {k[0]} -m conntrack --ctstate RELATED,ESTABLISHED "
             f"{c} -j ACCEPT", False),
            ("filter", firewall.INPUT, f"-d 127.0.0.0/8 -i {k[0]} -m conntrack ! --ctstate "
             f"{firewall.LOOPBACK_EXEMPT} {c} -j DROP", False)]


def family_of(e: Entry) -> int:
    return 6 if e.set.endswith("6") else 4


def _order(e: Entry) -> tuple[str, str, tuple[tuple[int, str], ...]]:
    return e.owner, e.set, tuple((int(k), "") if k.isdigit() else (0, k) for k in e.key)


def view(state: nftable.TableState, family: int) -> LiveChainSet:
    """Return the entries of ``family`` read back from our table in the planner's rule form."""
    if not state.available:
        return LiveChainSet(available=False, error=state.error)
    placed: dict[tuple[str, str], list[tuple[bool, str, int, int, str]]] = {}
    for n, e in enumerate(sorted(state.entries, key=_order)):
        if family_of(e) != family:
            continue
        for table, chain, rule, head in rules_of(e):
            # a subnet's ingress in the order the planner writes it: admitted, its own, drop
            rank = 2 if rule.endswith("-j DROP") else 1 if e.set.startswith("intra") else 0
            placed.setdefault((table, chain), []).append((not head, e.owner, rank, n, rule))
    chains = {k: tuple(r[-1] for r in sorted(v)) for k, v in placed.items()}
    return LiveChainSet(available=True, chains=chains)
