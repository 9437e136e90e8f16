"""The planner: a pure function (desired, live, options) -> Plan. No I/O here.

See docs/decisions/016-loopback-guard.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from reconciler.domain.errors import PlanError
from reconciler.domain.live import LiveLink, LiveState
from reconciler.domain.model import DesiredState
from reconciler.domain.ops import ConntrackDelete, StaleMap, SysctlSet, encode
from reconciler.domain.ownership import CHAIN_PREFIX, alloc_veth_name
from reconciler.domain.plan import Action, AttrChange, Change, Plan, fingerprint
from reconciler.planner import (
    addrspace,
    blocking,
    conntrack,
    docker,
    firewall,
    hostlinks,
    impact,
    legacy,
    nftplan,
    shim,
)
from reconciler.planner.allocs import plan as alloc_plan
from reconciler.planner.context import PlanContext, PlanOptions
from reconciler.planner.leases import Picks

__all__ = ["PlanOptions", "change_order", "links_that_matter", "make_plan"]


def links_that_matter(desired: DesiredState, live: LiveState) -> dict[str, LiveLink]:
    """Return the host links a plan can depend on; a change to any other link leaves it unchanged.

    The planner reads host links only by the names it manages (declared and
    subnet bridges, the veths of declared and live allocations), sweeps over
    links it owns, and the bare temporary bridges of interrupted creations with
    their ports. Other tools' links (every container's veth) are not read here:
    the plan agent uses this to keep a plan when only those come and go. Their
    addresses (and the host's routes) matter only through the address space,
    which ``addrspace.relevant`` covers. A planner change that reads other links
    must widen one of them (tests/unit compares plans with and without random
    foreign links, addresses and routes).
    """
    names: set[str] = {*desired.bridges, *(s.bridge for s in desired.subnets.values())}
    names |= {alloc_veth_name(a) for a in desired.allocs}
    names |= {alloc_veth_name(n) for n in live.netns}
    temp = hostlinks.is_temp_bridge_name
    return {name: lk for name, lk in live.links.items()
            if name in names or lk.owned or temp(name)
            or (lk.master is not None and (lk.master in names or temp(lk.master)))}


def _sysctl_changes(ctx: PlanContext) -> list[Change]:
    out = []
    for key in sorted(ctx.sysctls):
        want = ctx.sysctls[key]
        have = ctx.live.sysctls.get(key)
        ctx.observed[f"sysctl/{key}"] = have
        if have != want:
            warn: tuple[str, ...] = ()
            if key == "net/ipv6/conf/all/forwarding":
                warn = ("with IPv6 forwarding on, interfaces stop accepting router "
                        "advertisements unless their accept_ra is 2: a host that learns its "
                        "IPv6 default route that way should set accept_ra=2 on its uplink",)
            out.append(Change("sysctl", key, Action.UPDATE, "needed by the declared subnets",
                              (AttrChange("value", have, want),),
                              (encode(SysctlSet(key, want)),), warnings=warn))
    return out


def undeclared_adoptions(desired: DesiredState, options: PlanOptions) -> list[str]:
    """List the ``--adopt KIND/NAME`` addresses no file declares, sorted.

    Adopting takes an object over in order to make it what a file says; without a file
    there is nothing to make it, and a typo would otherwise go unnoticed (the object stays
    a conflict, or worse, a prune of the name it meant).
    """
    declared: dict[str, Collection[str]] = {
        "bridge": desired.bridges.keys(), "subnet": desired.subnets.keys(),
        "alloc": desired.allocs.keys(), "docker_network": desired.docker_networks.keys()}
    out = []
    for address in sorted(options.adopt):
        kind, _, name = address.partition("/")
        if name not in declared.get(kind, ()):
            out.append(address)
    return out


# Docker networks come last: a daemon refusing one (pool overlap, ...) stops the run,
# and must not leave the host's allocations without their sysctls and rules.
_ORDER = {k: i for i, k in enumerate(("bridge", "subnet", "alloc", "veth", "neighbour",
                                      "sysctl", "firewall", "shim", "docker_network"))}


def make_plan(desired: DesiredState, live: LiveState, options: PlanOptions | None = None,
              files: tuple[tuple[str, str], ...] = ()) -> Plan:
    """Compare desired and live state and return the plan that converges them.

    ``auto`` prefixes are picked first (``addrspace.resolve``): everything after plans
    with resolved subnets and Docker networks.
    """
    opts = options or PlanOptions()
    undeclared = undeclared_adoptions(desired, opts)
    if undeclared:
        raise PlanError(f"--adopt {', '.join(undeclared)}: no file declares "
                        f"{'it' if len(undeclared) == 1 else 'them'}; only declared objects "
                        "can be adopted (check the name, or --hostname and the files' hosts:)")
    picks = Picks(live.leases)
    resolution = addrspace.resolve(desired, live, prune=opts.prune, picks=picks)
    if resolution.fatal:
        raise PlanError("\n".join(resolution.fatal))
    desired = resolution.desired
    found = addrspace.check(desired, live, prune=opts.prune, picked=resolution.picked)
    if found.fatal:
        raise PlanError("\n".join(found.fatal))
    ctx = PlanContext(desired, live, opts, overlaps=found.conflicts, picked=resolution.picked,
                      warnings=list(found.warnings), picks=picks)
    if live.leases_problem is not None:
        ctx.warnings.insert(0, live.leases_problem)
    bit = desired.settings.firewall_mark
    ctx.rules4.mark = ctx.rules6.mark = bit
    changes: list[Change] = []
    # Subnets first: they claim the bridge addresses that are theirs, bridges then
    # remove only owned addresses nobody claims.
    hostlinks.mark_blocked_bridges(ctx)
    subnet_changes = [hostlinks.plan_subnet(ctx, desired.subnets[n])
                      for n in sorted(desired.subnets)]
    subnet_changes += hostlinks.plan_pruned_subnets(ctx)
    bridge_changes = [hostlinks.plan_bridge(ctx, desired.bridges[n])
                      for n in sorted(desired.bridges)]
    bridge_changes += hostlinks.plan_pruned_bridges(ctx)
    _loopback_guards(ctx)
    changes += bridge_changes + subnet_changes
    changes += alloc_plan.plan_allocs(ctx)
    changes = hostlinks.keep_mtu_of_emptied_bridges(ctx, changes)
    changes = hostlinks.annotate_rules(ctx, changes)
    changes += docker.plan_docker_networks(ctx)
    if ctx.fatal:
        raise PlanError("\n".join(ctx.fatal))
    changes += _sysctl_changes(ctx)
    _keep_rules(ctx)
    if not live.table.available:
        if any(rs.chains.values() for rs in (ctx.rules4, ctx.rules6)):
            ctx.errors.append(f"nftables: {live.table.error or 'unavailable'}")
    else:
        ch, fw_warnings = nftplan.plan_table(nftplan.entries((ctx.rules4, ctx.rules6)), live,
                                             prune=ctx.options.prune, bit=bit)
        ctx.warnings.extend(fw_warnings)
        ctx.observed["firewall/nftables"] = nftplan.observed(live)
        planned = [n for n in desired.subnets if f"subnet/{n}" not in ctx.blocked]
        if ch is not None:
            for family, rules, live_rules in ((4, ctx.rules4, live.firewall4),
                                              (6, ctx.rules6, live.firewall6)):
                notes = firewall.change_notes(desired, live_rules, family, planned)
                if notes:
                    ch = dataclasses.replace(ch, reason="; ".join((ch.reason, *notes)))
                ch = _with_conntrack(ch, family, conntrack.stale_maps(rules, live_rules))
            changes.append(ch)
    for family, rules, old in ((4, ctx.rules4, live.legacy4), (6, ctx.rules6, live.legacy6)):
        # iptables-legacy beside our nf_tables rules: a rule there on a declared path is named
        # (what the shim lets by is not: it is walked with the shim in place)
        for seen in ([] if old is None else legacy.findings(desired, rules, old, family, bit)):
            (ctx.errors if seen.blocks else ctx.warnings).append(seen.line)
        if old is not None:
            ctx.observed[f"legacy/ipv{family}/{shim.CHAIN}"] = [
                old.policies.get((shim.TABLE, shim.CHAIN)),
                list(old.chains.get((shim.TABLE, shim.CHAIN), ()))]
    if ctx.options.prune or desired.subnets:
        changes += shim.plan_shims(desired, live, bit)
    changes.sort(key=change_order)
    changes = blocking.with_needs(desired, impact.assess(ctx, changes))
    ctx.warnings.extend(picks.notes)
    return Plan(tuple(changes), fingerprint(ctx.observed), files, tuple(ctx.warnings),
                tuple(ctx.errors), {"prune": opts.prune, "adopt": sorted(opts.adopt),
                                    "force_replace": opts.force_replace},
                {"id": live.host_id} if live.host_id else {},
                blocking.blocked_list(desired, changes, ctx.blocked),
                leases=picks.table(() if opts.prune else _undeclared(desired, live.leases)),
                picks=picks.to_json())


def _undeclared(desired: DesiredState, leases: Collection[str]) -> list[str]:
    """List the lease holders no file declares: kept with --no-prune, as their objects are."""
    declared = {f"bridge/{n}" for n in desired.bridges} | {
        f"subnet/{n}" for n in desired.subnets} | {f"alloc/{n}" for n in desired.allocs} | {
        f"docker_network/{n}" for n in desired.docker_networks}
    return sorted(a for a in leases if a not in declared)


def _with_conntrack(ch: Change, family: int, stale: list[StaleMap]) -> Change:
    """Follow the firewall change with the deletion of the conntrack entries its rules leave stale.

    After the restore in the same change: the next packet of each flow meets the new rules.
    """
    if not stale:
        return ch
    maps = tuple(str(m) for m in stale)
    # one change serves both families: the line names its own
    said = f"IPv{family} entries of " + ", ".join(maps)
    return dataclasses.replace(
        ch, attrs=(*ch.attrs, AttrChange("conntrack", said, None)),
        ops=(*ch.ops, encode(ConntrackDelete(family, maps))))


def _loopback_guards(ctx: PlanContext) -> None:
    """Add the loopback guard on every managed bridge that serves a subnet or has route_localnet on.

    Port maps turn ``route_localnet`` on (never off again): a bridge whose subnet went
    away keeps it, and so keeps its guard.
    """
    served = {s.bridge for s in ctx.desired.subnets.values()}
    for name in sorted(ctx.desired.bridges):
        localnet = ctx.live.sysctls.get(f"net/ipv4/conf/{name}/route_localnet") == "1"
        if f"bridge/{name}" not in ctx.blocked and (name in served or localnet):
            firewall.loopback_guard(ctx.rules4, name)


def _keep_rules(ctx: PlanContext) -> None:
    """Keep as they are the live rules of blocked resources (SPEC §11: nothing is added or
    removed for them), and, with --no-prune, those of subnets and allocs no file declares.

    The planners add no rule for a blocked resource: what it has live is what it keeps.
    """
    kept = {a.replace("/", "=", 1) for a in ctx.blocked}
    if ctx.options.prune and not kept:
        return
    declared = {f"subnet={n}" for n in ctx.desired.subnets} | {
        f"alloc={n}" for n in ctx.desired.allocs} | {f"bridge={n}" for n in ctx.desired.bridges}
    if ctx.options.prune:
        declared = set()
    declared -= kept
    for rules, live in ((ctx.rules4, ctx.live.firewall4), (ctx.rules6, ctx.live.firewall6),
                        (ctx.rules4, ctx.live.old4), (ctx.rules6, ctx.live.old6)):
        # chain by chain, in live order: the kept rules stay where they are
        for (_table, chain), live_rules in sorted(live.chains.items()):
            if not chain.startswith(CHAIN_PREFIX):
                continue
            for r in live_rules:
                owner = firewall.owner_of(r)
                if owner is not None and (owner in kept or (not ctx.options.prune
                                                           and owner not in declared)):
                    rules.add_rule(chain, r, head=firewall.is_ingress(chain, r))


def change_order(c: Change) -> tuple[int, int, str]:
    """Order a plan's changes: deletes first, in reverse dependency order; then
    everything else in order (``planner.gc`` orders what it collects the same way)."""
    rank = _ORDER.get(c.kind, len(_ORDER))
    if c.action is Action.DELETE:
        return (0, -rank, c.name)
    return (1, rank, c.name)
