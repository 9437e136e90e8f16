"""iptables-legacy rules on a declared path, beside the nf_tables backend we write (pure).

The legacy (x_tables) and nf_tables backends are two sets of hooks: every packet passes
both, a DROP in either is final, and NAT binds in whichever table's chain runs first. Our
rules live in nf_tables, so a legacy ``FORWARD`` policy DROP, a legacy rule dropping a
subnet or a legacy REDIRECT of a mapped host port stops a declared path while our own
rules compare equal. The observation reads the legacy tables only where the kernel lists
some (``drivers.iptables.IptablesDriver.observe_legacy``); here each declared path is
followed through them (``fwpaths.walk``), as the first packet of a connection and its
replies:

* per port map: its host port in nat ``PREROUTING`` and ``OUTPUT``; the DNATed packet
  in filter ``FORWARD`` (from outside) and ``OUTPUT`` (the host's own); its replies in
  ``FORWARD`` and ``INPUT``;
* per subnet: what its allocations start, and its replies, in ``FORWARD``.

A rule (or policy) that takes all of a path blocks it: the plan carries an error (apply
still converges everything else, and exits 1 naming it; ``verify`` fails). One that takes
part of a path and names it (its subnet, bridge, address or port) is a warning. Rules that
match a path only by being broad and narrow it by something else (``-i eth0``) are left to
the probes, whose diagnosis reads the legacy counters.

See docs/decisions/035-iptables-legacy-named.md.
See docs/decisions/048-mark-shim.md.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass

from reconciler.domain import fwmark
from reconciler.domain.live import LiveChainSet
from reconciler.domain.model import AllocId, DesiredState, SubnetName
from reconciler.planner import firewall, fwpaths, shim
from reconciler.planner.fwpaths import Flow, Match

#: (table, chain) -> what its rules are read for
_RECORD = {"filter": fwpaths.DROPS, "nat": fwpaths.REDIRECTS}


@dataclass(frozen=True)
class Finding:
    """One legacy rule or policy on declared paths: ``blocks`` (all of one of them: an
    error) or part of them (a warning), and the line that says so."""

    blocks: bool
    line: str


def _host(net: ipaddress.IPv4Address | ipaddress.IPv6Address) -> fwpaths.IPNet:
    return ipaddress.ip_network(net)


def declared_paths(desired: DesiredState, rules: firewall.RuleSet,
                   family: int) -> dict[tuple[str, str], list[Flow]]:
    """Return the declared paths of one family, by the (table, chain) they cross. What crosses
    filter ``FORWARD`` or ``INPUT`` carries our mark (our table's forward and guard chains OR
    it into all of it: ``domain.nftable``)."""
    out: dict[tuple[str, str], list[Flow]] = {}

    def add(table: str, chain: str, flow: Flow) -> None:
        if table == shim.TABLE and chain in shim.CHAINS:
            flow = dataclasses.replace(flow, mark=rules.mark)
        out.setdefault((table, chain), []).append(flow)

    seen = set()
    for d in firewall.dnat_rules(rules.chains.get(firewall.DNAT, ())):
        a = desired.allocs.get(AllocId(d.alloc))
        s = desired.subnets.get(a.subnet) if a is not None else None
        if s is None or (d.proto, d.port, d.host_ip) in seen:
            continue
        seen.add((d.proto, d.port, d.host_ip))
        at = "" if d.host_ip is None else (f"[{d.host_ip}]:" if family == 6 else f"{d.host_ip}:")
        what = f"port map {at}{d.port}/{d.proto} of alloc {d.alloc}"
        proto = frozenset({d.proto})
        before = Flow(what, dst=None if d.host_ip is None else _host(d.host_ip), protos=proto,
                      dports=((d.port, d.port),), states=frozenset({"NEW"}), local=True)
        if d.host_ip is None or not d.host_ip.is_loopback:
            add("nat", "PREROUTING", before)
        add("nat", "OUTPUT", before)
        dnated = Flow(what, dst=_host(d.dest), oif=s.bridge, protos=proto,
                      dports=((d.to, d.to),), states=frozenset({"NEW", "DNAT"}))
        replies = Flow(what, src=_host(d.dest), iif=s.bridge, protos=proto,
                       sports=((d.to, d.to),), dports=fwpaths.EPHEMERAL,
                       states=frozenset({"ESTABLISHED"}))
        add("filter", "OUTPUT", dnated)
        add("filter", "INPUT", replies)
        if d.host_ip is None or not d.host_ip.is_loopback:  # others reach it: forwarded
            add("filter", "FORWARD", dnated)
            add("filter", "FORWARD", replies)
    for name in sorted(desired.subnets):
        s = desired.subnets[SubnetName(name)]
        cidr = s.cidr if family == 4 else s.cidr6
        if cidr is None:
            continue
        what = f"what subnet {name}'s allocations start"
        add("filter", "FORWARD", Flow(what, src=cidr, iif=s.bridge, states=frozenset({"NEW"})))
        add("filter", "FORWARD", Flow(what, dst=cidr, oif=s.bridge,
                                      states=frozenset({"ESTABLISHED", "RELATED"})))
    return out


def findings(desired: DesiredState, rules: firewall.RuleSet, legacy: LiveChainSet,
             family: int, bit: int = fwmark.DEFAULT_MARK) -> list[Finding]:
    """Find the legacy rules and policies on the declared paths of ``family``, one each. The
    chains are walked as the shim leaves them (``planner.shim``: in place where it is
    wanted), so a ``FORWARD`` or ``INPUT`` DROP it lets declared traffic past is no finding."""
    tool = "iptables-legacy" if family == 4 else "ip6tables-legacy"
    if not legacy.available:
        return [Finding(False, f"{tool}: legacy tables exist beside the nf_tables backend "
                               f"but could not be read ({legacy.error}): a rule there may "
                               "block a declared path unseen")]
    hit_by: dict[tuple[str, str, str], tuple[fwpaths.Hit, list[str], bool]] = {}
    chains = dict(legacy.chains)
    for chain in shim.CHAINS:
        if shim.wants(desired, legacy, family, chain):
            chains = shim.with_shim(LiveChainSet(True, chains, legacy.policies), bit, chain)
    for (table, chain), flows in declared_paths(desired, rules, family).items():
        for flow in flows:
            w = fwpaths.walk(chains, table, chain, flow, _RECORD[table],
                             policies=legacy.policies)
            for h in w.hits:
                if h.match is Match.SOME and not h.names_it and not h.rule.startswith("policy"):
                    continue
                key = (h.table, h.chain, h.rule)
                first, whats, blocks = hit_by.get(key, (h, [], False))
                if flow.what not in whats:
                    whats.append(flow.what)
                hit_by[key] = (first, whats, blocks or h.match is Match.ALL)
    out = []
    for h, whats, blocks in hit_by.values():
        listed = ", ".join(whats[:3]) + (f" and {len(whats) - 3} more" if len(whats) > 3 else "")
        how = "" if blocks else "some of "
        does = (f"sends {how}{listed} elsewhere" if h.target in fwpaths.REDIRECTS
                else f"drops {how}{listed}")
        via = f" (from -j {h.via.split()[-1]})" if h.via else ""
        table = "" if h.table == "filter" else f"-t {h.table} "
        out.append(Finding(blocks, (
            f"{tool} {h.where()}{via} {does}: iptables-legacy acts on every packet beside "
            "the reconciler's nf_tables rules, which cannot undo it; remove it or let this "
            f"traffic through (`{tool} {table}-S {h.chain}`)")))
    return out
