"""Our nftables table's entries: checked, rendered to JSON and read back (pure)."""

from __future__ import annotations

import json

import pytest

from reconciler.domain import nftable
from reconciler.domain.nftable import Entry
from reconciler.planner import firewall, nftview

E = [Entry("pm4", ("tcp", "8080"), ("10.1.0.2", "80"), "alloc=a1"),
     Entry("pmip6", ("::1", "udp", "53"), ("fd00::2", "53"), "alloc=a1"),
     Entry("ports4", ("br0", "10.1.0.0/24"), (), "subnet=s"),
     Entry("masq6", ("fd00::/64",), (), "subnet=s"),
     Entry("guarded", ("br0",), (), "bridge=br0")]


def test_entries_check_their_values() -> None:
    for e in E:
        e.check()
    for bad in (Entry("pm4", ("tcp", "8080"), ("fd00::2", "80"), "alloc=a1"),
                Entry("ports4", ('br0" ; flush ruleset', "10.1.0.0/24"), (), "subnet=s"),
                Entry("pm4", ("icmp", "1"), ("10.1.0.2", "80"), "alloc=a1"),
                Entry("guarded", ("br0",), (), "nobody")):
        with pytest.raises(ValueError):
            bad.check()


def _listing(commands: list[dict]) -> dict:
    """Build what ``nft -j list table`` prints after ``commands`` (elements merged in)."""
    objs: list[dict] = []
    sets: dict[str, dict] = {}
    for c in commands:
        (kind, body), = c["add"].items()
        if kind in ("set", "map"):
            sets[body["name"]] = dict(body)
            objs.append({kind: sets[body["name"]]})
        elif kind == "element":
            sets[body["name"]].setdefault("elem", []).extend(body["elem"])
        else:
            objs.append({kind: body})
    return json.loads(json.dumps({"nftables": objs}))


def test_a_built_table_reads_back_as_its_entries() -> None:
    state = nftable.parse_table(_listing(nftable.rebuild(0x2000, E, exists=False)), 0x2000)
    assert state.intact, state.broken
    assert state.entries == frozenset(E)


def test_a_flushed_chain_or_another_mark_is_not_intact() -> None:
    cmds = nftable.rebuild(0x2000, E, exists=False)
    no_guard = [c for c in cmds if c["add"].get("rule", {}).get("chain") != nftable.GUARD]
    state = nftable.parse_table(_listing(no_guard), 0x2000)
    assert not state.intact and "guard" in state.broken
    assert not nftable.parse_table(_listing(cmds), 0x4000).intact


def test_the_rule_view_round_trips() -> None:
    state = nftable.TableState(exists=True, intact=True, entries=frozenset(E))
    sets = []
    for family in (4, 6):
        rs = firewall.RuleSet(family)
        for (_t, chain), rules in nftview.view(state, family).chains.items():
            for r in rules:
                rs.add_rule(chain, r)
        sets.append(rs)
    assert nftview.entries_of(sets) == set(E)


def test_ipv6_output_dnat_never_matches_loopback() -> None:
    local = [c["add"]["rule"] for c in nftable.skeleton(0x2000)
             if c["add"].get("rule", {}).get("chain") == nftable.PORTMAP_LOCAL]
    v6 = [r for r in local if any(x.get("dnat", {}).get("family") == "ip6" for x in r["expr"])]
    assert v6 and all({"match": {"op": "!=", "left": {"payload": {"protocol": "ip6",
                       "field": "daddr"}}, "right": "::1"}} in r["expr"] for r in v6)
