"""What a chain of iptables rules does with a class of packets (pure).

Rules are iptables-save's text (``drivers.iptables.parse_save``: the tokens after ``-A
CHAIN``). A :class:`Flow` is a class of packets on a path the reconciler declared — what
enters an isolated subnet undeclared, a port map's DNATed packets, what the allocations
start, a port map's host port before DNAT — described by the fields an iptables rule
matches on (None: any value). :func:`match` says whether a rule matches none, some or
all of a flow; :func:`walk` follows a chain (and the chains it jumps to) the way netfilter
does and records the rules that decide something about the flow.

Two users: ``planner.firewall`` asks whether another manager's rule could accept what our
isolation drops before our jump is reached (an accept above the jump is drift), and
``planner.legacy`` which iptables-legacy rule drops or redirects a declared path.

Matching is conservative where it cannot tell: a match module or option it does not read
makes a rule match *some* of a flow, never all and never none.

See docs/decisions/034-forward-jump-kept-first.md and 035-iptables-legacy-named.md.
"""

from __future__ import annotations

import enum
import ipaddress
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

IPNet = ipaddress.IPv4Network | ipaddress.IPv6Network
Ports = tuple[tuple[int, int], ...]

#: conntrack's states, the virtual SNAT and DNAT included (``-m conntrack --ctstate``)
STATES = frozenset({"INVALID", "NEW", "ESTABLISHED", "RELATED", "UNTRACKED", "SNAT", "DNAT"})
#: what an isolation drop (ours) catches: everything but replies and what a declared map
#: DNATed (``firewall.ADMITTED``)
UNADMITTED = STATES - {"RELATED", "ESTABLISHED", "DNAT"}
#: the ports a host's own outgoing connections bind (the replies of its port-map connections
#: come back to one of them): above the privileged ones, whatever ip_local_port_range says
EPHEMERAL: Ports = ((1024, 65535),)

#: targets that end a packet's path in this hook with an accept (a queue: a program decides)
ACCEPTS = frozenset({"ACCEPT", "QUEUE", "NFQUEUE"})
DROPS = frozenset({"DROP", "REJECT"})
REDIRECTS = frozenset({"DNAT", "REDIRECT"})


class Match(enum.IntEnum):
    NONE = 0
    SOME = 1
    ALL = 2


@dataclass(frozen=True)
class Flow:
    """A class of packets as one chain sees them; ``what`` says it for people."""

    what: str
    src: IPNet | None = None
    dst: IPNet | None = None
    iif: str | None = None
    oif: str | None = None
    protos: frozenset[str] | None = None
    sports: Ports | None = None
    dports: Ports | None = None
    states: frozenset[str] = STATES
    #: addressed to one of the host's own addresses (a port map's host port, before DNAT):
    #: ``-m addrtype --dst-type LOCAL`` matches all of it
    local: bool = False
    #: the packet mark the flow carries (None: unknown); declared forwarded traffic carries
    #: our bit (``domain.fwmark``), what our isolation drops never does
    mark: int | None = None


@dataclass(frozen=True)
class Verdict:
    """How a rule meets a flow: whether it matches none, some or all of it, and whether it
    names the flow itself (an address, interface, protocol or port of the flow, not negated)
    rather than matching it only by being broad."""

    match: Match
    names_it: bool = False


def split(rule: str) -> list[str]:
    """Split a rule into its tokens (iptables-save double-quotes a token with spaces)."""
    if '"' not in rule and "'" not in rule and "\\" not in rule:
        return rule.split()
    try:
        return shlex.split(rule)
    except ValueError:
        return rule.split()


def target(rule: str) -> tuple[str, bool]:
    """Return the rule's target and whether it is a goto (``-g``); ("", False) without one."""
    t = split(rule)
    for i, tok in enumerate(t[:-1]):
        if tok in ("-j", "--jump"):
            return t[i + 1], False
        if tok in ("-g", "--goto"):
            return t[i + 1], True
    return "", False


def chains_of_counters(text: str) -> dict[tuple[str, str], list[str]]:
    """Read the rules of an ``iptables-save -c`` snapshot by (table, chain), counters left out."""
    out: dict[tuple[str, str], list[str]] = {}
    table = ""
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif line.startswith("[") and "] -A " in line:
            words = line.split("] ", 1)[1].split(maxsplit=2)
            if len(words) == 3:
                out.setdefault((table, words[1]), []).append(words[2])
    return out


def _net(text: str) -> IPNet | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def _addr(rule: str, flow: IPNet | None) -> Match:
    net = _net(rule)
    if net is None:
        return Match.SOME
    if net.prefixlen == 0:
        return Match.ALL
    if flow is None or net.version != flow.version:
        return Match.SOME if flow is None else Match.NONE
    if flow.subnet_of(net):  # type: ignore[arg-type]
        return Match.ALL
    return Match.SOME if net.overlaps(flow) else Match.NONE


def _iface(rule: str, flow: str | None) -> Match:
    if rule == "+":
        return Match.ALL
    if flow is None:
        return Match.SOME
    if rule.endswith("+"):
        return Match.ALL if flow.startswith(rule[:-1]) else Match.NONE
    return Match.ALL if rule == flow else Match.NONE


_PROTO_NUMBERS = {"6": "tcp", "17": "udp", "1": "icmp", "58": "ipv6-icmp", "132": "sctp"}


def _proto(rule: str, flow: frozenset[str] | None) -> Match:
    p = _PROTO_NUMBERS.get(rule, rule.lower())
    if p in ("all", "0"):
        return Match.ALL
    if flow is None:
        return Match.SOME
    if p not in flow:
        return Match.NONE
    return Match.ALL if flow == {p} else Match.SOME


def _ranges(text: str) -> Ports | None:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition(":")
        try:
            a = int(lo) if lo else 0
            b = int(hi) if hi else (65535 if _ else a)
        except ValueError:
            return None
        out.append((a, b))
    return tuple(out)


def _ports(rule: str, flow: Ports | None) -> Match:
    have = _ranges(rule)
    if have is None:
        return Match.SOME
    if any(a <= 0 and b >= 65535 for a, b in have):
        return Match.ALL
    if flow is None:
        return Match.SOME

    def covered(lo: int, hi: int) -> bool:
        # every port of [lo, hi] is in some range of the rule (ranges are few)
        p = lo
        while p <= hi:
            nxt = max((b for a, b in have if a <= p <= b), default=None)
            if nxt is None:
                return False
            p = nxt + 1
        return True

    if all(covered(lo, hi) for lo, hi in flow):
        return Match.ALL
    if any(a <= hi and lo <= b for lo, hi in flow for a, b in have):
        return Match.SOME
    return Match.NONE


def _states(rule: str, flow: frozenset[str]) -> Match:
    have = frozenset(rule.upper().split(","))
    if flow <= have:
        return Match.ALL
    return Match.SOME if flow & have else Match.NONE


def _mark(rule: str, mark: int) -> Match:
    """Compare ``--mark VALUE[/MASK]`` with a flow's known mark."""
    value, _, mask = rule.partition("/")
    try:
        v, m = int(value, 0), int(mask, 0) if mask else 0xFFFFFFFF
    except ValueError:
        return Match.SOME
    return Match.ALL if mark & m == v else Match.NONE


def _negate(m: Match) -> Match:
    return {Match.ALL: Match.NONE, Match.NONE: Match.ALL}.get(m, Match.SOME)


#: options whose value is compared with a field of the flow, by the field's name
_FIELDS: dict[str, str] = {
    **dict.fromkeys(("-s", "--source", "--src"), "src"),
    **dict.fromkeys(("-d", "--destination", "--dst"), "dst"),
    **dict.fromkeys(("-i", "--in-interface"), "iif"),
    **dict.fromkeys(("-o", "--out-interface"), "oif"),
    **dict.fromkeys(("-p", "--protocol"), "protos"),
    **dict.fromkeys(("--sport", "--source-port", "--sports", "--source-ports"), "sports"),
    **dict.fromkeys(("--dport", "--destination-port", "--dports", "--destination-ports"),
                    "dports"),
    **dict.fromkeys(("--ctstate", "--state"), "states"),
}


def _compare(name: str, value: str, flow: Flow) -> Match:
    if name in ("src", "dst"):
        return _addr(value, flow.src if name == "src" else flow.dst)
    if name in ("iif", "oif"):
        return _iface(value, flow.iif if name == "iif" else flow.oif)
    if name == "protos":
        return _proto(value, flow.protos)
    if name in ("sports", "dports"):
        return _ports(value, flow.sports if name == "sports" else flow.dports)
    return _states(value, flow.states)


#: options that take one value and say nothing about which packets match
_INERT = frozenset({"-m", "--match", "--comment"})


def match(rule: str, flow: Flow) -> Verdict:
    """Tell whether ``rule`` (its matches, not its target) matches none, some or all of ``flow``."""
    t = split(rule)
    result, names_it = Match.ALL, False
    i, negated = 0, False
    while i < len(t):
        tok = t[i]
        if tok == "!":
            negated = True
            i += 1
            continue
        if tok in ("-j", "--jump", "-g", "--goto"):
            break
        if tok in _INERT:
            i += 2
            negated = False
            continue
        if tok in _FIELDS and i + 1 < len(t):
            name = _FIELDS[tok]
            m = _compare(name, t[i + 1], flow)
            if negated:
                m = _negate(m)
            elif m is not Match.NONE and name != "states" and getattr(flow, name) is not None:
                names_it = True
            i += 2
        elif tok == "--dst-type" and i + 1 < len(t) and flow.local and t[i + 1] == "LOCAL":
            m = _negate(Match.ALL) if negated else Match.ALL
            i += 2
        elif tok == "--mark" and i + 1 < len(t) and flow.mark is not None:
            m = _mark(t[i + 1], flow.mark)
            m = _negate(m) if negated else m
            i += 2
        else:
            # an option we do not read: it narrows the rule to some of the flow at most
            m = Match.SOME
            i += 1
            while i < len(t) and not t[i].startswith("-") and t[i] != "!":
                i += 1
        negated = False
        result = min(result, m)
        if result is Match.NONE:
            return Verdict(Match.NONE)
    return Verdict(result, names_it)


class End(enum.Enum):
    """How a walk of a chain ended for a flow, when it ended for all of it."""

    FELL_THROUGH = "fell through"  # the end of the chain, or a RETURN: the caller goes on
    STOPPED = "stopped"  # a rule matching all of it decided (or reached our jump)


@dataclass(frozen=True)
class Hit:
    """A rule that decides something about a flow: where it is, what it does, how much of
    the flow it matches. ``via`` is the rule of the walked chain that led to it (a jump)."""

    table: str
    chain: str
    rule: str  # the text after "-A CHAIN", or "policy DROP"
    target: str
    match: Match
    names_it: bool
    via: str | None = None

    def where(self) -> str:
        """Say where the rule is: ``TABLE/CHAIN: -A CHAIN ...`` (or ``policy X``)."""
        text = self.rule if self.rule.startswith("policy ") else f"-A {self.chain} {self.rule}"
        return f"{self.table}/{self.chain}: {text}"


@dataclass
class Walk:
    """A walk's record: the hits in the order met, and how it ended."""

    hits: list[Hit] = field(default_factory=list)
    end: End = End.FELL_THROUGH
    #: the walk reached a rule ``stop_at`` picked before anything decided all of the flow
    reached: bool = False
    #: an accept took some of the flow on the way (a policy at the end meets only the rest)
    passed_some: bool = False


def walk(chains: Mapping[tuple[str, str], Sequence[str]], table: str, chain: str, flow: Flow,
         record: frozenset[str], *, stop_at: Callable[[str], bool] | None = None,
         policies: Mapping[tuple[str, str], str] | None = None, depth: int = 8) -> Walk:
    """Follow ``chain`` for ``flow``: record the rules whose target is in ``record`` (and
    the rules that jump to chains holding one), stop where a rule matching all of the flow
    ends its path (an accept, a drop, a redirect, a RETURN out of this chain), or at the
    first rule ``stop_at`` picks (our jump: what comes after it is ours to decide). A
    built-in chain walked to its end meets its policy, recorded as ``policy X`` when X is
    in ``record``.
    """
    out = Walk()
    for rule in chains.get((table, chain), ()):
        if stop_at is not None and stop_at(rule):
            out.end, out.reached = End.STOPPED, True
            return out
        v = match(rule, flow)
        if v.match is Match.NONE:
            continue
        tgt, goto = target(rule)
        whole = v.match is Match.ALL
        if tgt in record:
            out.hits.append(Hit(table, chain, rule, tgt, v.match, v.names_it))
        if tgt in ACCEPTS | DROPS | REDIRECTS:
            if whole:
                out.end = End.STOPPED
                return out
            out.passed_some = out.passed_some or tgt in ACCEPTS
        elif tgt == "RETURN":
            if whole:
                return out
        elif (table, tgt) in chains and depth > 0:
            sub = walk(chains, table, tgt, flow, record, stop_at=stop_at, depth=depth - 1)
            out.hits += [Hit(h.table, h.chain, h.rule, h.target, min(h.match, v.match),
                             h.names_it or v.names_it, h.via or rule) for h in sub.hits]
            out.passed_some = out.passed_some or sub.passed_some
            if sub.end is End.STOPPED and whole:
                out.end, out.reached = End.STOPPED, sub.reached
                return out
            if goto and whole:
                return out  # a goto's chain returns to our caller
    policy = (policies or {}).get((table, chain))
    if policy is not None and policy in record:
        out.hits.append(Hit(table, chain, f"policy {policy}", policy,
                            Match.SOME if out.passed_some else Match.ALL, False))
        out.end = End.STOPPED
    return out
