"""What each resource needs of the firewall, in iptables rule form (pure).

The rules are the planner's statement of what each subnet, bridge and allocation needs;
they are written as entries of our nftables table (``planner.nftview``,
docs/decisions/045-nftables-table-of-our-own.md). :func:`diff` against an empty rule set
is the script that removes the ``RECONCILER-*`` chains of earlier versions (046).

In those versions every rule is in a chain we own (``RECONCILER-*``) except one jump
per chain from the built-in chain that feeds it (and, where dockerd has it, one first in
``DOCKER-USER``), kept ahead of every rule of others that could accept what our isolation
drops. Rules carry a comment naming
the resource they serve (``reconciler:subnet=NAME``) so live rules can be
attributed, and an unknown owner is recognisably stale.

See docs/decisions/014-iptables-owned-chains.md.
See docs/decisions/015-subnet-isolation.md.
See docs/decisions/034-forward-jump-kept-first.md.
See docs/decisions/048-mark-shim.md.
See docs/decisions/049-diagnosis-names-what-issue-26-saw.md.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from reconciler.domain import fwmark
from reconciler.domain.live import LiveChainSet
from reconciler.domain.model import DesiredState, Subnet, SubnetName
from reconciler.domain.ownership import CHAIN_PREFIX, RULE_COMMENT
from reconciler.domain.plan import AttrChange
from reconciler.planner import fwpaths

FORWARD = CHAIN_PREFIX + "FORWARD"
POSTROUTING = CHAIN_PREFIX + "POSTROUTING"
DNAT = CHAIN_PREFIX + "DNAT"
INPUT = CHAIN_PREFIX + "INPUT"
#: the mangle FORWARD chain of the version before our nftables table, which ORed our mark
#: in: known here so that the upgrade (``nftplan.cleanup_scripts``) removes it with its jump;
#: the table's forward chain marks now (``domain.nftable``)
MARK = CHAIN_PREFIX + "MARK"

#: conntrack states admitted into an isolated subnet from outside it: replies, and what a
#: declared port map DNATed (the DNAT rules in RECONCILER-DNAT are the declaration)
ADMITTED = "RELATED,ESTABLISHED,DNAT"
#: the loopback guard's exemptions (kube-proxy's, after CVE-2020-8558): replies to the
#: host's own 127.0.0.1 port-map connections, and what someone DNATed to 127.0.0.0/8
LOOPBACK_EXEMPT = "RELATED,ESTABLISHED,DNAT"

_LOCAL = ("-m", "addrtype", "--dst-type", "LOCAL")
#: owned chain -> its table and the built-in chains that jump to it (with match tokens):
#: port maps are DNAT'd for traffic arriving from outside (PREROUTING) and for the host's
#: own connections, 127.0.0.1 included (OUTPUT), in both cases only to local addresses.
JUMPS: dict[str, tuple[str, tuple[tuple[str, tuple[str, ...]], ...]]] = {
    FORWARD: ("filter", (("FORWARD", ()),)),
    INPUT: ("filter", (("INPUT", ()),)),
    POSTROUTING: ("nat", (("POSTROUTING", ()),)),
    DNAT: ("nat", (("PREROUTING", _LOCAL), ("OUTPUT", _LOCAL))),
    MARK: ("mangle", (("FORWARD", ()),)),
}
#: IPv6's nat OUTPUT jump leaves ``::1`` alone: a packet to ``[::1]:PORT`` DNATed to an
#: allocation can never leave ``lo`` (IPv6 has no ``route_localnet``), so a host service on
#: ``[::1]:PORT`` hung instead of answering (SPEC §12: the IPv6 output DNAT never matches ::1)
_NOT_LOOPBACK6 = ("!", "-d", "::1/128")
TABLE_ORDER = ("filter", "nat", "mangle")
#: "[" "]" for IPv6 DNAT targets (``[fd00::2]:80``); still nothing that ends a token or line
_SAFE_TOKEN = re.compile(r"^[A-Za-z0-9_.:/=!,+\[\]\-]+$")


def comment(owner_kind: str, owner: str) -> tuple[str, ...]:
    return ("-m", "comment", "--comment", f"{RULE_COMMENT}:{owner_kind}={owner}")


def jump_rule(chain: str, match: tuple[str, ...]) -> str:
    return " ".join((*match, "-m", "comment", "--comment", RULE_COMMENT, "-j", chain))


def jumps_of(family: int, chain: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Return the built-in chains that jump to ``chain`` in ``family``, with their matches."""
    out = JUMPS[chain][1] if chain in JUMPS else ()
    if family == 6 and chain == DNAT:
        out = tuple((b, (*_NOT_LOOPBACK6, *m) if b == "OUTPUT" else m) for b, m in out)
    return out


_OWNER = re.compile(r"--comment " + re.escape(RULE_COMMENT) + r":(\S+)")


def owner_of(rule: str) -> str | None:
    """Read ``subnet=NAME`` / ``alloc=ID`` from a rule's comment, if it is one of ours."""
    m = _OWNER.search(rule)
    return m.group(1) if m else None


IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class DnatRule:
    """One allocation's DNAT rule (``RECONCILER-DNAT``) read back: what it matches, where
    it sends. The one reader of these rules: host ports kept (``allocs``), stale conntrack
    entries (``conntrack``) and the probes' targets (``probes``) all start here."""

    alloc: str
    proto: str
    port: int  # the host port (``--dport``)
    host_ip: IPAddr | None  # ``-d``; None: any local address
    dest: IPAddr  # ``--to-destination`` address (``[v6]`` unbracketed)
    to: int  # ``--to-destination`` port


def parse_dnat(rule: str) -> DnatRule | None:
    """Parse the DNAT rule of an allocation (``reconciler:alloc=ID``), or None for any other rule
    or one whose tokens do not read."""
    owner = owner_of(rule)
    if not owner or not owner.startswith("alloc="):
        return None
    t = rule.split()
    try:
        proto = t[t.index("-p") + 1]
        port = int(t[t.index("--dport") + 1])
        host_ip = ipaddress.ip_address(t[t.index("-d") + 1].split("/")[0]) if "-d" in t else None
        addr, _, to = t[t.index("--to-destination") + 1].rpartition(":")
        dest = ipaddress.ip_address(addr.strip("[]"))
        return DnatRule(owner.split("=", 1)[1], proto, port, host_ip, dest, int(to))
    except (ValueError, IndexError):
        return None


def dnat_rules(rules: Iterable[str]) -> list[DnatRule]:
    """Return the allocations' DNAT rules among ``rules``, in order (others skipped)."""
    return [d for r in rules if (d := parse_dnat(r)) is not None]


def by_owner(chains: Iterable[tuple[str, Iterable[str]]]) -> dict[str, list[tuple[str, str]]]:
    """Group our rules by the resource they serve (``subnet=NAME``), as (chain, rule)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for chain, rules in chains:
        for r in rules:
            owner = owner_of(r)
            if owner is not None:
                out.setdefault(owner, []).append((chain, r))
    return out


def live_by_owner(live: LiveChainSet) -> dict[str, list[tuple[str, str]]]:
    """Apply :func:`by_owner` to our own live chains of one family: a rule in any other chain is
    someone else's, whatever its comment names (``gc`` warned for good of the "vanished
    allocation" a foreign rule with ``reconciler:alloc=X`` named)."""
    return by_owner((chain, rules) for (_t, chain), rules in sorted(live.chains.items())
                    if chain.startswith(CHAIN_PREFIX))


@dataclass
class RuleSet:
    """Desired rules of one family: owned chain -> rules in order.

    A chain has a head and a tail: rules added with ``head=True`` come before every
    tail rule, in the order they were added. ``RECONCILER-FORWARD`` decides what
    enters each subnet in its head and accepts what leaves in its tail, so a packet
    from one subnet to another meets the isolation of the one it enters first,
    whatever the order of the subnets' names.
    """

    family: int
    chains: dict[str, list[str]] = field(default_factory=dict)
    #: the bit our table's forward chain ORs in (``settings.firewall_mark``)
    mark: int = fwmark.DEFAULT_MARK
    _heads: dict[str, int] = field(default_factory=dict)

    def add(self, chain: str, tokens: Iterable[str], *, head: bool = False) -> None:
        toks = tuple(tokens)
        for t in toks:
            # Defence in depth: names are validated by the loader, but nothing that
            # could end a token or a line ever reaches iptables-restore.
            if not _SAFE_TOKEN.fullmatch(t):
                raise ValueError(f"unsafe iptables token {t!r}")
        self.add_rule(chain, " ".join(toks), head=head)

    def add_rule(self, chain: str, rule: str, *, head: bool = False) -> None:
        """Add a rule already in iptables-save form (a kept live one: ``--no-prune``)."""
        rules = self.chains.setdefault(chain, [])
        if head:
            n = self._heads.get(chain, 0)
            rules.insert(n, rule)
            self._heads[chain] = n + 1
        else:
            rules.append(rule)

    def table_of(self, chain: str) -> str:
        return JUMPS[chain][0] if chain in JUMPS else "nat"


def subnet_rules(rs: RuleSet, s: Subnet) -> None:
    """Add the rules of a subnet: what is forwarded into it (its isolation), what leaves it,
    masquerade of egress.

    ``isolation: ports`` admits from outside the subnet only replies and what a
    declared port map DNATed (conntrack keeps the original destination), plus
    traffic between the subnet's own allocations (bridged traffic passes FORWARD with
    ``bridge-nf-call-iptables=1``), and drops the rest: a host that routes to the
    subnet reaches neither unmapped listeners nor mapped ports behind the map's
    back. ``isolation: open`` is Nomad's admin chain: anything to the subnet. What
    the host itself sends (OUTPUT) never passes FORWARD and is untouched.
    """
    cidr = s.cidr if rs.family == 4 else s.cidr6
    if cidr is None:
        return
    c = comment("subnet", s.name)
    into = ("-d", str(cidr), "-o", s.bridge)
    if s.isolation == "open":
        rs.add(FORWARD, (*into, *c, "-j", "ACCEPT"), head=True)
    else:
        rs.add(FORWARD, (*into, "-m", "conntrack", "--ctstate", ADMITTED, *c, "-j", "ACCEPT"),
               head=True)
        # in iptables-save's order (-s -d -i -o), or the live rule never compares equal
        rs.add(FORWARD, ("-s", str(cidr), "-d", str(cidr), "-i", s.bridge, "-o", s.bridge, *c,
                         "-j", "ACCEPT"), head=True)
        rs.add(FORWARD, (*into, *c, "-j", "DROP"), head=True)
    rs.add(FORWARD, ("-s", str(cidr), "-i", s.bridge, *c, "-j", "ACCEPT"))
    if s.masquerade:
        rs.add(POSTROUTING, ("-s", str(cidr), "!", "-d", str(cidr), *c, "-j", "MASQUERADE"))


def is_ingress(chain: str, rule: str) -> bool:
    """Tell whether a rule of ``RECONCILER-FORWARD`` decides what enters a subnet (goes in the
    head)."""
    return chain == FORWARD and " -o " in f" {rule} "


def live_isolation(live: LiveChainSet, subnet: str) -> str | None:
    """Read the isolation the live rules of ``subnet`` give it: "ports", "open", or None (no
    rules)."""
    ingress = [r for r in live.chains.get(("filter", FORWARD), ())
               if owner_of(r) == f"subnet={subnet}" and is_ingress(FORWARD, r)]
    if not ingress:
        return None
    if any(r.endswith("-j DROP") for r in ingress):
        return "ports"
    return "open"


def loopback_guard(rs: RuleSet, bridge: str) -> None:
    """Drop what arrives on ``bridge`` for 127.0.0.0/8 unless it is a reply or was DNATed.

    ``route_localnet=1`` (needed for 127.0.0.1 port maps: the kernel otherwise drops
    loopback sources leaving a real interface) also lets the bridge accept packets *to*
    127.0.0.0/8: an allocation that routes 127.0.0.1 via its gateway would reach the
    host's loopback-only services (CVE-2020-8558). Packets the host sends itself
    arrive on ``lo`` and never match ``-i BRIDGE``; the replies of 127.0.0.1 port maps
    are ESTABLISHED. The rule is on every bridge the reconciler manages, whether or not
    ``route_localnet`` is on at the moment, so no order of changes leaves a window.
    """
    if rs.family != 4:
        return  # IPv6 has no route_localnet: the kernel never accepts ::1 from a link
    c = comment("bridge", bridge)
    # replies on the bridge to what the host started (its port-map connections, 127.0.0.1
    # ones included): they must come back however the host's INPUT defaults (ufw's deny,
    # or its rules flushed under a DROP policy)
    rs.add(INPUT, ("-i", bridge, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", *c,
                   "-j", "ACCEPT"))
    rs.add(INPUT, ("-d", "127.0.0.0/8", "-i", bridge, "-m", "conntrack", "!", "--ctstate",
                   LOOPBACK_EXEMPT, *c, "-j", "DROP"))


def change_notes(desired: DesiredState, live: LiveChainSet, family: int,
                 subnets: Iterable[str]) -> list[str]:
    """Say what a firewall change opens or closes, for the people reading the plan.

    The first plan after an upgrade to ``isolation: ports`` as the default says so here.
    """
    notes: list[str] = []
    for name in sorted(subnets):
        s = desired.subnets.get(SubnetName(name))
        cidr = None if s is None else (s.cidr if family == 4 else s.cidr6)
        if s is None or cidr is None:
            continue
        was = live_isolation(live, s.name)
        if was is None or was == s.isolation:
            continue
        if s.isolation == "ports":
            notes.append(f"subnet {s.name}: isolation ports closes forwarding into {cidr} from "
                         "outside it (other hosts, other subnets, Docker networks) except "
                         "declared port maps and replies; it was open (every port of every "
                         "allocation); `isolation: open` keeps that")
        else:
            notes.append(f"subnet {s.name}: isolation open forwards anything into {cidr} "
                         "(every port of every allocation, for hosts that route to it)")
    return notes


def _owned_chains(live: LiveChainSet) -> dict[tuple[str, str], tuple[str, ...]]:
    return {k: v for k, v in live.chains.items() if k[1].startswith(CHAIN_PREFIX)}


_OUR_JUMP_MARK = f"--comment {RULE_COMMENT} -j {CHAIN_PREFIX}"


def _live_jumps(live: LiveChainSet) -> dict[tuple[str, str], list[str]]:
    """Find our jump rules (carrying our comment) in chains we do not own, by (table, chain)."""
    out: dict[tuple[str, str], list[str]] = {}
    for (table, chain), rules in live.chains.items():
        if chain.startswith(CHAIN_PREFIX):
            continue
        for r in rules:
            if _OUR_JUMP_MARK in r:
                out.setdefault((table, chain), []).append(r)
    return out


def _foreign_references(live: LiveChainSet, table: str, chain: str) -> list[str]:
    """Find rules someone else wrote that jump or go to ``chain``: we never delete those."""
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


#: dockerd's chain for its users' rules, which it keeps first in ``FORWARD`` (it jumps there
#: before its own accepts, and puts that jump back on top after every change it makes)
DOCKER_USER = "DOCKER-USER"


def guarded_flows(rules: Iterable[str]) -> list[fwpaths.Flow]:
    """Return what each DROP rule among ``rules`` (a chain of ours) is there to drop: the
    packets it matches that our accepts before it leave to it (neither replies nor DNATed)."""
    out = []
    for r in rules:
        if fwpaths.target(r) != ("DROP", False):
            continue
        t = r.split()
        # our rules: plain options, each with one value, "!" only before --ctstate
        opts = {t[i]: t[i + 1] for i in range(len(t) - 1)
                if t[i].startswith("-") and (i == 0 or t[i - 1] != "!")}
        src, dst = opts.get("-s"), opts.get("-d")
        owner = owner_of(r) or "?"
        out.append(fwpaths.Flow(
            f"what {owner.replace('=', ' ')} drops",
            src=None if src is None else ipaddress.ip_network(src, strict=False),
            dst=None if dst is None else ipaddress.ip_network(dst, strict=False),
            iif=opts.get("-i"), oif=opts.get("-o"), states=fwpaths.UNADMITTED, mark=0))
    return out


def accepts_ahead(chains: Mapping[tuple[str, str], Sequence[str]], table: str, builtin: str,
                  chain: str, flows: Iterable[fwpaths.Flow]) -> list[fwpaths.Hit]:
    """Find the rules of others that can accept some of ``flows`` before our jump to ``chain``
    in ``builtin`` is reached (through the chains they jump to: a ``DOCKER-USER`` holding our
    jump first lets nothing by). In the order met, each once."""
    ours = jump_rule(chain, ())
    out: dict[tuple[str, str, str, str | None], fwpaths.Hit] = {}
    for flow in flows:
        w = fwpaths.walk(chains, table, builtin, flow, fwpaths.ACCEPTS,
                         stop_at=lambda r: r == ours)
        for h in w.hits:
            out.setdefault((h.table, h.chain, h.rule, h.via), h)
    return list(out.values())


def describe_ahead(hits: Iterable[fwpaths.Hit], chain: str) -> str:
    """Say what accepts ahead of our jump: ``filter/FORWARD: -A FORWARD ... -j ACCEPT accepts
    ahead of the jump to CHAIN``."""
    hits = list(hits)
    text = "; ".join(h.where() + (f" (from -j {h.via.split()[-1]})" if h.via else "")
                     for h in hits[:3])
    more = f" and {len(hits) - 3} more" if len(hits) > 3 else ""
    return f"{text}{more} accept{'s' if len(hits) == 1 else ''} ahead of the jump to {chain}"


@dataclass(frozen=True)
class FirewallDiff:
    script: str
    attrs: tuple[AttrChange, ...]
    missing_owners: frozenset[str]
    stale_owners: frozenset[str]
    empty_desired: bool
    empty_live: bool
    warnings: tuple[str, ...] = ()
    #: what others' accepts above our jumps let by (position drift), for the reason
    ahead: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.script)


def diff(rs: RuleSet, live: LiveChainSet, *, add_jumps: bool = True) -> FirewallDiff:
    """Compare desired and live owned chains; build the restore script that converges them.

    ``add_jumps=False`` (``reconcile gc``, which only removes) leaves a missing jump
    missing: everything else the script does is then a removal.
    """
    owned = _owned_chains(live)
    live_jumps = _live_jumps(live)
    # per table, in the order iptables-restore needs: declarations, rules, jumps, removals
    per_table: dict[str, tuple[list[str], list[str], list[str], list[str]]] = {}

    def bucket(table: str, i: int) -> list[str]:
        return per_table.setdefault(table, ([], [], [], []))[i]

    attrs: list[AttrChange] = []
    warnings: list[str] = []
    ahead: list[str] = []
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
        for builtin, match in jumps_of(rs.family, chain):
            want = jump_rule(chain, match)
            jumps = [j for j in live_jumps.get((table, builtin), []) if j.split()[-1] == chain]
            if want not in jumps and add_jumps:
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
            flows = guarded_flows(rules) if table == "filter" and add_jumps else []
            if not flows:
                continue
            # kept ahead of every accept another manager puts above it: observed every pass
            chains = dict(live.chains)
            if builtin == "FORWARD" and (table, DOCKER_USER) in chains:
                chains[(table, DOCKER_USER)] = _docker_user(
                    live.chains[(table, DOCKER_USER)], table, chain, want, flows, chains,
                    bucket(table, 2), attrs, ahead)
            # what they let by now (a missing jump is said as missing, above)
            now = accepts_ahead(live.chains, table, builtin, chain, flows) if want in jumps \
                else []
            if now:
                ahead.append(describe_ahead(now, chain))
            if want in jumps and accepts_ahead(chains, table, builtin, chain, flows):
                bucket(table, 2).extend((f"-D {builtin} {want}", f"-I {builtin} 1 {want}"))
                attrs.append(AttrChange(f"{table}/{builtin} jump to {chain}",
                                        "behind accepting rules", "first"))

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
                        not desired_keys, not owned, tuple(warnings), tuple(ahead))


def _docker_user(rules: tuple[str, ...], table: str, chain: str, want: str,
                 flows: list[fwpaths.Flow], chains: Mapping[tuple[str, str], Sequence[str]],
                 script: list[str], attrs: list[AttrChange],
                 ahead: list[str]) -> tuple[str, ...]:
    """Put our jump first in dockerd's ``DOCKER-USER`` (it exists: we never create another
    manager's chain), so dockerd's later accepts above our jump in ``FORWARD`` (a network
    created, a restart) are never reached first; return the chain as it will be."""
    mine = [r for r in rules if r == want]
    field_ = f"{table}/{DOCKER_USER} jump to {chain}"
    if not mine:
        script.append(f"-I {DOCKER_USER} 1 {want}")
        attrs.append(AttrChange(field_, None, "present"))
    else:
        script.extend(f"-D {DOCKER_USER} {want}" for _ in mine[1:])
        found = accepts_ahead(chains, table, DOCKER_USER, chain, flows)
        if found:
            ahead.append(describe_ahead(found, chain))
            script.extend((f"-D {DOCKER_USER} {want}", f"-I {DOCKER_USER} 1 {want}"))
            attrs.append(AttrChange(field_, "behind accepting rules", "first"))
        elif len(mine) > 1:
            attrs.append(AttrChange(field_, f"{len(mine)} copies", "1 copy"))
    return (want, *(r for r in rules if r != want))
