"""Describe our nftables table ``inet reconciler``: its entries, chains and JSON (pure).

Everything the firewall does per resource is an *entry* in a set or map of the table: a
port map is one element of a map keyed by ``proto . port``, an isolated subnet one element
of a set keyed by ``bridge . cidr``. The chains are fixed (the *skeleton*): a handful of
rules that look the packet up, so neither a packet's path nor the change of one
allocation's entries grows with the number of allocations. An entry is a domain value
(set name, key, data, owner), validated before it becomes JSON for libnftables; no
configured name is ever pasted into nft text.

See docs/decisions/045-nftables-table-of-our-own.md.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reconciler.domain.fwmark import is_one_bit

FAMILY = "inet"
TABLE = "reconciler"
#: the table is ours by its name and by the one element of its set ``MARKER``, whose
#: comment says so (nft 1.0's JSON carries no table comment); the version (the element)
#: changes with the skeleton
VERSION = 2
MARKER = "owned_by"
COMMENT = "reconciler: this table is rewritten by the reconciler; do not edit it"

#: chain -> (type, hook, priority); names that are no nft keywords
PORTMAP_IN, PORTMAP_LOCAL, MASQ, ISOLATE, GUARD = (
    "portmap_in", "portmap_local", "masq", "isolate", "guard")
#: the filter chains run before every ``filter`` (priority 0) chain of other tables: a drop
#: here is final, whatever Docker's or ufw's chains accept later
CHAINS: dict[str, tuple[str, str, int]] = {
    PORTMAP_IN: ("nat", "prerouting", -100),
    PORTMAP_LOCAL: ("nat", "output", -100),
    MASQ: ("nat", "postrouting", 100),
    ISOLATE: ("filter", "forward", -10),
    GUARD: ("filter", "input", -10),
}

_IFNAME = re.compile(r"^[A-Za-z0-9_.:@+-]{1,15}$")
_OWNER = re.compile(r"^(alloc|subnet|bridge)=[A-Za-z0-9_.:@+-]{1,100}$")
PROTOS = ("tcp", "udp", "sctp")

#: logical set -> its key fields; "if" an interface, "a4"/"a6" an address, "n4"/"n6" a
#: prefix, "proto", "port"
KEYS: dict[str, tuple[str, ...]] = {}
#: logical set -> its data fields (maps only)
DATA: dict[str, tuple[str, ...]] = {}
for _v in (4, 6):
    KEYS[f"pm{_v}"] = ("proto", "port")
    DATA[f"pm{_v}"] = (f"a{_v}", "port")
    KEYS[f"pmip{_v}"] = (f"a{_v}", "proto", "port")
    DATA[f"pmip{_v}"] = (f"a{_v}", "port")
    KEYS[f"ports{_v}"] = ("if", f"n{_v}")
    KEYS[f"intra{_v}"] = ("if", f"n{_v}", f"n{_v}")
    KEYS[f"open{_v}"] = ("if", f"n{_v}")
    KEYS[f"egress{_v}"] = ("if", f"n{_v}")
    KEYS[f"hairpin{_v}"] = ("if", f"n{_v}", f"n{_v}")
    KEYS[f"masq{_v}"] = (f"n{_v}",)
KEYS["lomasq"] = ("if",)
KEYS["guarded"] = ("if",)


@dataclass(frozen=True, order=True)
class Entry:
    """One element of a logical set: ``key`` (and ``data`` for a map) as canonical strings,
    and the resource it serves (``alloc=ID``, ``subnet=NAME``, ``bridge=NAME``)."""

    set: str
    key: tuple[str, ...]
    data: tuple[str, ...] = ()
    owner: str = ""

    def check(self) -> None:
        """Raise ValueError unless every field is a value of its type (nothing else reaches nft)."""
        if self.set not in KEYS:
            raise ValueError(f"unknown set {self.set!r}")
        if not _OWNER.fullmatch(self.owner):
            raise ValueError(f"bad owner {self.owner!r}")
        want = KEYS[self.set], DATA.get(self.set, ())
        for kinds, values in zip(want, (self.key, self.data), strict=True):
            if len(kinds) != len(values):
                raise ValueError(f"{self.set}: {values!r} does not have {len(kinds)} fields")
            for kind, value in zip(kinds, values, strict=True):
                if canonical(kind, value) != value:
                    raise ValueError(f"{self.set}: {value!r} is not a canonical {kind}")

    def wire(self) -> dict[str, Any]:
        return {"set": self.set, "key": list(self.key), "data": list(self.data),
                "owner": self.owner}

    @classmethod
    def of_wire(cls, d: Mapping[str, Any]) -> Entry:
        e = cls(str(d["set"]), tuple(str(x) for x in d["key"]),
                tuple(str(x) for x in d.get("data", ())), str(d["owner"]))
        e.check()
        return e


def canonical(kind: str, value: str) -> str:
    """Return ``value`` in the canonical form of a field ``kind``; ValueError if it is none."""
    if kind == "if":
        if not _IFNAME.fullmatch(value):
            raise ValueError(f"{value!r} is not an interface name")
        return value
    if kind == "proto":
        if value not in PROTOS:
            raise ValueError(f"{value!r} is not one of {', '.join(PROTOS)}")
        return value
    if kind == "port":
        n = int(value)
        if not 0 < n < 65536:
            raise ValueError(f"{value!r} is not a port")
        return str(n)
    version = int(kind[1])
    if kind[0] == "a":
        a = ipaddress.ip_address(value)
        if a.version != version:
            raise ValueError(f"{value!r} is not an IPv{version} address")
        return str(a)
    net = ipaddress.ip_network(value, strict=False)
    if net.version != version:
        raise ValueError(f"{value!r} is not an IPv{version} prefix")
    return str(net)


# -- JSON for libnftables ----------------------------------------------------------------

def _t(**kw: Any) -> dict[str, Any]:
    return {"family": FAMILY, "table": TABLE, **kw}


_NFT_TYPE = {"if": "ifname", "proto": "inet_proto", "port": "inet_service",
             "a4": "ipv4_addr", "a6": "ipv6_addr", "n4": "ipv4_addr", "n6": "ipv6_addr"}


def physical_sets() -> dict[str, tuple[tuple[str, ...], str | None, bool]]:
    """Return the nft sets and maps of the table: name -> (key types, data type, interval)."""
    out: dict[str, tuple[tuple[str, ...], str | None, bool]] = {}
    for name, kinds in KEYS.items():
        types = tuple(_NFT_TYPE[k] for k in kinds)
        interval = any(k[0] == "n" for k in kinds)
        if name in DATA:
            addr, port = (_NFT_TYPE[k] for k in DATA[name])
            out[f"{name}_addr"] = (types, addr, False)
            out[f"{name}_port"] = (types, port, False)
        elif name.startswith("masq"):
            out[name] = (types, None, True)
            out[f"{name}_skip"] = (types * 2, None, True)
        else:
            out[name] = (types, None, interval)
    return out


def _val(kind: str, value: str) -> Any:
    if kind == "port":
        return int(value)
    if kind[0] == "n":
        net = ipaddress.ip_network(value)
        return {"prefix": {"addr": str(net.network_address), "len": net.prefixlen}}
    return value


def _key(kinds: tuple[str, ...], values: tuple[str, ...]) -> Any:
    vals = [_val(k, v) for k, v in zip(kinds, values, strict=True)]
    return vals[0] if len(vals) == 1 else {"concat": vals}


def elements(e: Entry) -> list[tuple[str, Any]]:
    """Return the nft elements of an entry: (physical set, element JSON)."""
    kinds = KEYS[e.set]
    key = {"elem": {"val": _key(kinds, e.key), "comment": e.owner}}
    if e.set in DATA:
        a, p = DATA[e.set]
        return [(f"{e.set}_addr", [key, _val(a, e.data[0])]),
                (f"{e.set}_port", [key, _val(p, e.data[1])])]
    if e.set.startswith("masq"):
        return [(e.set, key), (f"{e.set}_skip",
                               {"elem": {"val": _key(kinds * 2, e.key * 2), "comment": e.owner}})]
    return [(e.set, key)]


def element_commands(verb: str, entries: Iterable[Entry]) -> list[dict[str, Any]]:
    """Return one ``add``/``delete`` element command per physical set for ``entries``."""
    per: dict[str, list[Any]] = {}
    for e in entries:
        for name, elem in elements(e):
            per.setdefault(name, []).append(elem)
    return [{verb: {"element": _t(name=name, elem=elems)}} for name, elems in sorted(per.items())]


# rule expressions --------------------------------------------------------------------------

def _m(left: Any, right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def _p(proto: str, fld: str) -> dict[str, Any]:
    return {"payload": {"protocol": proto, "field": fld}}


_META = {"meta": {"key": "mark"}}
_L4 = {"meta": {"key": "l4proto"}}
_DPORT = _p("th", "dport")
_LOCAL = _m({"fib": {"result": "type", "flags": ["daddr"]}}, "local")
_IIF, _OIF = {"meta": {"key": "iifname"}}, {"meta": {"key": "oifname"}}
_ACCEPT, _DROP, _RETURN = {"accept": None}, {"drop": None}, {"return": None}


def _cat(*xs: Any) -> dict[str, Any]:
    return {"concat": list(xs)}


def _in(key: Any, name: str) -> dict[str, Any]:
    return _m(key, f"@{name}")


def _nfproto(fam: str) -> dict[str, Any]:
    return _m({"meta": {"key": "nfproto"}}, "ipv4" if fam == "ip" else "ipv6")


def _mark(bit: int) -> list[dict[str, Any]]:
    return [{"mangle": {"key": _META, "value": {"|": [_META, bit]}}}, _ACCEPT]


def _dnat(fam: str, key: Any, name: str) -> dict[str, Any]:
    return {"dnat": {"family": fam, "addr": {"map": {"key": key, "data": f"@{name}_addr"}},
                     "port": {"map": {"key": key, "data": f"@{name}_port"}}}}


def _rules(mark: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """Return the skeleton's rules, (chain, expressions), in order."""
    out: list[tuple[str, list[dict[str, Any]]]] = []
    for v, fam in ((4, "ip"), (6, "ip6")):
        daddr, saddr = _p(fam, "daddr"), _p(fam, "saddr")
        for chain in (PORTMAP_IN, PORTMAP_LOCAL):
            head = [_nfproto(fam), _LOCAL]
            if chain == PORTMAP_LOCAL and v == 6:
                head.append(_m(daddr, "::1", "!="))  # a host service on [::1]:port stays its
            out.append((chain, [*head, _dnat(fam, _cat(daddr, _L4, _DPORT), f"pmip{v}")]))
            out.append((chain, [*head, _dnat(fam, _cat(_L4, _DPORT), f"pm{v}")]))
        dnated = _m({"ct": {"key": "status"}}, "dnat", "in")
        out.append((MASQ, [dnated, _in(_cat(_OIF, saddr, daddr), f"hairpin{v}"),
                           {"masquerade": None}]))
        if v == 4:
            out.append((MASQ, [_m(saddr, {"prefix": {"addr": "127.0.0.0", "len": 8}}),
                               _in(_OIF, "lomasq"), {"masquerade": None}]))
        out.append((MASQ, [_in(_cat(saddr, daddr), f"masq{v}_skip"), _RETURN]))
        out.append((MASQ, [_in(saddr, f"masq{v}"), {"masquerade": None}]))
        into = _cat(_OIF, daddr)
        replies = _m({"ct": {"key": "state"}}, ["established", "related"], "in")
        out += [
            (ISOLATE, [replies, _in(into, f"ports{v}"), *_mark(mark)]),
            (ISOLATE, [dnated, _in(into, f"ports{v}"), *_mark(mark)]),
            (ISOLATE, [_in(_cat(_IIF, saddr, daddr), f"intra{v}"), *_mark(mark)]),
            (ISOLATE, [_in(into, f"ports{v}"), _DROP]),
            (ISOLATE, [_in(into, f"open{v}"), *_mark(mark)]),
            (ISOLATE, [_in(_cat(_IIF, saddr), f"egress{v}"), *_mark(mark)]),
        ]
    replies = _m({"ct": {"key": "state"}}, ["established", "related"], "in")
    out += [  # marked too: an iptables INPUT that drops (ufw's deny) lets them by (the shim)
        (GUARD, [_in(_IIF, "guarded"), replies, *_mark(mark)]),
        (GUARD, [_in(_IIF, "guarded"), _m({"ct": {"key": "status"}}, "dnat", "in"),
                 *_mark(mark)]),
        (GUARD, [_in(_IIF, "guarded"),
                 _m(_p("ip", "daddr"), {"prefix": {"addr": "127.0.0.0", "len": 8}}), _DROP]),
    ]
    return out


def skeleton(mark: int) -> list[dict[str, Any]]:
    """Return the commands that create the table, its sets and maps, chains and rules (empty
    sets: the entries follow)."""
    cmds: list[dict[str, Any]] = [
        {"add": {"table": {"family": FAMILY, "name": TABLE}}},
        {"add": {"set": _t(name=MARKER, type="inet_service")}},
        {"add": {"element": _t(name=MARKER, elem=[
            {"elem": {"val": VERSION, "comment": COMMENT}}])}}]
    for name, (types, data, interval) in physical_sets().items():
        body: dict[str, Any] = _t(name=name, type=list(types) if len(types) > 1 else types[0])
        if interval:
            body["flags"] = ["interval"]
        if data is None:
            cmds.append({"add": {"set": body}})
        else:
            cmds.append({"add": {"map": {**body, "map": data}}})
    for name, (kind, hook, prio) in CHAINS.items():
        cmds.append({"add": {"chain": _t(name=name, type=kind, hook=hook, prio=prio,
                                          policy="accept")}})
    for chain, expr in _rules(mark):
        cmds.append({"add": {"rule": _t(chain=chain, expr=expr)}})
    return cmds


def rule_counts(mark: int) -> dict[str, int]:
    """Return how many rules each chain of the skeleton holds (what the read-back checks)."""
    out = dict.fromkeys(CHAINS, 0)
    for chain, _ in _rules(mark):
        out[chain] += 1
    return out


def rebuild(mark: int, entries: Iterable[Entry], *, exists: bool) -> list[dict[str, Any]]:
    """Return one transaction that (re)creates the whole table with ``entries``: where it
    exists it is deleted first in the same transaction, so no packet sees it missing."""
    head: list[dict[str, Any]] = []
    if exists:
        head = [{"add": {"table": {"family": FAMILY, "name": TABLE}}},
                {"delete": {"table": {"family": FAMILY, "name": TABLE}}}]
    return [*head, *skeleton(mark), *element_commands("add", sorted(entries))]


def drop() -> list[dict[str, Any]]:
    """Return one transaction that deletes the table, if it exists."""
    return [{"add": {"table": {"family": FAMILY, "name": TABLE}}},
            {"delete": {"table": {"family": FAMILY, "name": TABLE}}}]


# -- reading the table back ------------------------------------------------------------------

@dataclass(frozen=True)
class TableState:
    """Our table as read back: whether it exists, its skeleton holds, and its entries."""

    available: bool = True
    exists: bool = False
    #: the chains, rules, sets and comment are the skeleton's (else: rebuilt whole)
    intact: bool = False
    entries: frozenset[Entry] = frozenset()
    error: str | None = None
    #: what does not hold, for the plan's reason
    broken: str = ""
    #: the bit the forward chain ORs into the mark (None: no such rule read)
    mark: int | None = None


def _from_val(kind: str, v: Any) -> str:
    if isinstance(v, dict) and "prefix" in v:
        return canonical(kind, f"{v['prefix']['addr']}/{v['prefix']['len']}")
    if isinstance(v, dict) and "range" in v:
        raise ValueError("ranges are not ours")
    return canonical(kind, str(v))


def _split_elem(raw: Any) -> tuple[Any, str]:
    if isinstance(raw, dict) and "elem" in raw:
        return raw["elem"]["val"], str(raw["elem"].get("comment", ""))
    return raw, ""


def _key_of(kinds: tuple[str, ...], val: Any) -> tuple[str, ...]:
    vals = val["concat"] if isinstance(val, dict) and "concat" in val else [val]
    if len(vals) != len(kinds):
        raise ValueError("key of another shape")
    return tuple(_from_val(k, v) for k, v in zip(kinds, vals, strict=True))


def parse_table(listing: Mapping[str, Any], mark: int | None = None) -> TableState:
    """Read ``nft -j list table inet reconciler`` into a :class:`TableState` (pure).

    ``mark``: the bit its rules must OR in, else the table is not intact (None: any one
    bit, the same in every rule; the planner compares it with the settings')."""
    objs = [o for o in listing.get("nftables", []) if isinstance(o, dict)]
    tables = [o["table"] for o in objs if "table" in o]
    if not tables:
        return TableState(exists=False)
    problems: list[str] = []
    sets = physical_sets()
    found: dict[str, list[Any]] = {}
    for o in objs:
        body = o.get("set") or o.get("map")
        if body is None:
            continue
        name = body.get("name")
        if name == MARKER:
            if body.get("elem") != [{"elem": {"val": VERSION, "comment": COMMENT}}]:
                problems.append("the table is not this version's")
            found[name] = []
            continue
        if name not in sets:
            problems.append(f"set {name} is not ours")
            continue
        found[name] = list(body.get("elem", []))
    missing = sorted({*sets, MARKER} - set(found))
    if missing:
        problems.append("sets missing: " + ", ".join(missing[:3]))
    counts = dict.fromkeys(CHAINS, -1)
    for o in objs:
        c = o.get("chain")
        if c is not None:
            want = CHAINS.get(c.get("name"))
            if want is None or (c.get("type"), c.get("hook"), c.get("prio"),
                                c.get("policy")) != (*want, "accept"):
                problems.append(f"chain {c.get('name')} is not the skeleton's")
            else:
                counts[c["name"]] = 0
    for o in objs:
        r = o.get("rule")
        if r is not None and r.get("chain") in counts and counts[r["chain"]] >= 0:
            counts[r["chain"]] += 1
    seen_mark = _mark_of(objs)
    expected = rule_counts(mark if mark is not None else seen_mark or 1)
    for chain, n in counts.items():
        if n != expected[chain]:
            problems.append(f"chain {chain} missing" if n < 0
                            else f"chain {chain} holds {n} rules, not {expected[chain]}")
    if seen_mark is not None and (seen_mark < 0 or (mark is not None and seen_mark != mark)):
        problems.append("the forward chain sets another mark")
    entries, broken = _entries(found)
    problems += broken
    return TableState(exists=True, intact=not problems, entries=frozenset(entries),
                      broken="; ".join(problems),
                      mark=seen_mark if seen_mark is not None and seen_mark > 0 else None)


def _mark_of(objs: list[dict[str, Any]]) -> int | None:
    """Return the one bit our rules OR into the mark, None without any, -1 if they differ."""
    seen: set[object] = set()
    for o in objs:
        r = o.get("rule")
        if r is None or r.get("chain") not in (ISOLATE, GUARD):
            continue
        for x in r.get("expr", []):
            if "mangle" in x:
                value = x["mangle"].get("value", {}).get("|", [None, None])
                seen.add(value[1] if isinstance(value[1], int) else -1)
    if not seen:
        return None
    bit = seen.pop() if len(seen) == 1 else -1
    return bit if isinstance(bit, int) and (bit == -1 or is_one_bit(bit)) else -1


def _entries(found: Mapping[str, list[Any]]) -> tuple[list[Entry], list[str]]:
    """Join the physical sets' elements into entries; name what does not pair up."""
    out: list[Entry] = []
    problems: list[str] = []
    for name, kinds in KEYS.items():
        try:
            if name in DATA:
                addr_k, port_k = DATA[name]
                ports = {}
                for raw, value in found.get(f"{name}_port", []):
                    val, _ = _split_elem(raw)
                    ports[_key_of(kinds, val)] = _from_val(port_k, value)
                addrs = found.get(f"{name}_addr", [])
                for raw, value in addrs:
                    val, owner = _split_elem(raw)
                    key = _key_of(kinds, val)
                    if key not in ports:
                        raise ValueError("a port map's halves do not pair up")
                    out.append(Entry(name, key, (_from_val(addr_k, value), ports.pop(key)),
                                     owner))
                if ports:
                    raise ValueError("a port map's halves do not pair up")
                continue
            skip = None
            if name.startswith("masq"):
                skip = {_key_of(kinds * 2, _split_elem(r)[0]) for r in found.get(
                    f"{name}_skip", [])}
            for raw in found.get(name, []):
                val, owner = _split_elem(raw)
                key = _key_of(kinds, val)
                if skip is not None:
                    if key * 2 not in skip:
                        raise ValueError("a masquerade's halves do not pair up")
                    skip.discard(key * 2)
                out.append(Entry(name, key, (), owner))
            if skip:
                raise ValueError("a masquerade's halves do not pair up")
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"set {name}: {exc}")
    bad = [e for e in out if not _OWNER.fullmatch(e.owner)]
    if bad:
        problems.append(f"set {bad[0].set}: an element without our owner comment")
    return out, problems
