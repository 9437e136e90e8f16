"""One address space (pure): declared prefixes checked against the host's, ``auto`` picks.

Subnets, Docker networks and the host share one address space; what the host
holds in it (foreign addresses and routes, Docker's networks and unassigned
pools) is ``planner.hostspace``.

* :func:`resolve` picks ``cidr: auto`` / ``subnet: auto`` prefixes, before
  anything else is planned (allocation addresses and gateways depend on them).
  Prefixes already live are kept first -- a subnet's own rules or its bridge's
  gateway address, a Docker network's live subnet say which prefix it has, as
  an allocation's ``eth0`` says which address; new ones are the first free
  prefix of their size in their pool, in name order, each clear of everything
  taken so far: the host's occupants, Docker's unassigned pools, the fixed
  prefixes and host_ips of the files, owned prefixes, and the picks before it.
* :func:`check` finds what each declared prefix overlaps: a conflict naming
  both sides (the Docker network that *is* a declared network excepted, and
  an owned subnet's own gateway and connected route, which are on our own
  bridge), or a warning when it is only an unassigned range of Docker's pools;
  and warns about a ``host_ip`` that is not on the host right now.
* :func:`relevant` is what of the host these depend on: the plan agent keeps a
  plan while it stays the same.

See docs/decisions/004-ipam-and-ports-from-live-state.md.
See docs/decisions/005-one-address-space.md.
See docs/decisions/041-leases.md (a leased prefix is kept before any live one).
"""

from __future__ import annotations

import bisect
import dataclasses
import ipaddress
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from reconciler.domain.docker import sort_duplicates
from reconciler.domain.leases import LEASE, LIVE, NEW
from reconciler.domain.live import LiveState
from reconciler.domain.model import AutoPrefix, DesiredState
from reconciler.domain.probes import VANTAGE_NETS
from reconciler.planner import firewall
from reconciler.planner.hostspace import (
    IPAddr,
    Net,
    PrefixIndex,
    Span,
    docker_elsewhere,
    local_addresses,
    occupants,
    overlaps,
    parse_prefix,
    span_of,
    unassigned_pools,
)
from reconciler.planner.leases import Picks

#: how many occupants a conflict names before "and N more"
NAMED = 3


# ------------------------------------------------------------------ auto picks


class _Taken:
    """Spans taken so far, per family, merged and sorted (lazily) for the first-free search."""

    def __init__(self) -> None:
        self._spans: dict[int, list[tuple[int, int]]] = {4: [], 6: []}
        self._sorted = {4: True, 6: True}

    def add(self, span: Span) -> None:
        self._spans[span[0]].append((span[1], span[2]))
        self._sorted[span[0]] = False

    def merged(self, version: int) -> list[tuple[int, int]]:
        if not self._sorted[version]:
            out: list[tuple[int, int]] = []
            for lo, hi in sorted(self._spans[version]):
                if out and lo <= out[-1][1] + 1:
                    out[-1] = (out[-1][0], max(out[-1][1], hi))
                else:
                    out.append((lo, hi))
            self._spans[version], self._sorted[version] = out, True
        return self._spans[version]

    def hits(self, span: Span) -> bool:
        spans = self.merged(span[0])
        i = bisect.bisect_right(spans, (span[2], 1 << 129)) - 1
        return i >= 0 and spans[i][1] >= span[1]

    def first_free(self, auto: AutoPrefix) -> Net | None:
        """Find the lowest /size in the pool that overlaps nothing taken."""
        pool = auto.pool
        block = 1 << (pool.max_prefixlen - auto.size)
        base, end = int(pool.network_address), int(pool.broadcast_address)
        spans = self.merged(pool.version)
        start = base
        while start + block - 1 <= end:
            last = start + block - 1
            i = bisect.bisect_right(spans, (last, 1 << 129)) - 1
            if i >= 0 and spans[i][1] >= start:
                start = base + (spans[i][1] + 1 - base + block - 1) // block * block
                continue
            return ipaddress.ip_network((start, auto.size))
        return None


@dataclass
class Resolution:
    """The desired state with every ``auto`` prefix picked, and what could not be."""

    desired: DesiredState
    #: "subnet/NAME" or "docker_network/NAME" -> {"cidr": pool text, ...} for the plan text
    picked: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    fatal: list[str] = dataclasses.field(default_factory=list)


def _fits(net: Net | None, auto: AutoPrefix) -> bool:
    return (net is not None and net.version == auto.pool.version and net.prefixlen == auto.size
            and net.subnet_of(auto.pool))  # type: ignore[arg-type]


def _rule_prefixes(live: LiveState, subnet: str, family: int) -> list[Net]:
    """Return the prefixes a subnet's live rules name (``-d CIDR -o BRIDGE``): ours by their
    comment."""
    live_rules = live.firewall4 if family == 4 else live.firewall6
    out = []
    for _chain, rule in firewall.live_by_owner(live_rules).get(f"subnet={subnet}", ()):
        toks = rule.split()
        if "-d" in toks and "-o" in toks and "!" not in toks:
            net = parse_prefix(toks[toks.index("-d") + 1])
            if net is not None and net not in out:
                out.append(net)
    return out


def _named_by_other_rules(live: LiveState, subnet: str, version: int) -> set[Net]:
    """Return the prefixes the live rules of every other subnet (declared or not) name."""
    out: set[Net] = set()
    for owner in firewall.live_by_owner(live.firewall4 if version == 4 else live.firewall6):
        kind, _, name = owner.partition("=")
        if kind == "subnet" and name != subnet:
            out.update(_rule_prefixes(live, name, version))
    return out


def _gateway_prefixes(live: LiveState, bridge: str, version: int) -> list[Net]:
    """Return the prefixes whose first host address is an owned address of the (managed) bridge."""
    link = live.links.get(bridge)
    if link is None or link.kind != "bridge":
        return []
    out = []
    for a in link.addresses:
        net = a.address.network
        if a.owned and a.address.version == version and int(a.address.ip) == int(
                net.network_address) + 1:
            out.append(net)
    return sorted(out, key=lambda n: int(n.network_address))


def _live_docker_prefixes(live: LiveState, name: str, version: int) -> list[Net]:
    if live.docker is None or not live.docker.available:
        return []
    found = sort_duplicates(n for n in live.docker.networks if n.name == name)
    out = []
    for n in found[:1]:
        out += [net for s in n.subnets
                if (net := parse_prefix(s)) is not None and net.version == version]
    return out


def _requests(desired: DesiredState) -> list[tuple[str, str, str, AutoPrefix]]:
    """List (address, name, field, auto) of every ``auto`` prefix, subnets first, in name order."""
    out: list[tuple[str, str, str, AutoPrefix]] = []
    for name in sorted(desired.subnets):
        s = desired.subnets[name]
        for field, auto in (("cidr", s.auto), ("cidr6", s.auto6)):
            if auto is not None:
                out.append((f"subnet/{name}", name, field, auto))
    for dname in sorted(desired.docker_networks):
        d = desired.docker_networks[dname]
        for field, auto in (("subnet", d.auto), ("subnet6", d.auto6)):
            if auto is not None:
                out.append((f"docker_network/{dname}", dname, field, auto))
    return out


def _live_evidence(live: LiveState, address: str, name: str, auto: AutoPrefix) -> list[Net]:
    """Return the prefixes the live state names for this resource: its rules, or its Docker
    network."""
    version = auto.pool.version
    if address.startswith("subnet/"):
        return _rule_prefixes(live, name, version)
    return _live_docker_prefixes(live, name, version)


def _fixed(desired: DesiredState) -> Iterator[tuple[str, str, Net]]:
    """Yield (address, field, prefix) of every fixed declared prefix."""
    for name in sorted(desired.subnets):
        s = desired.subnets[name]
        for field, net in (("cidr", s.prefix), ("cidr6", s.prefix6)):
            if isinstance(net, ipaddress.IPv4Network | ipaddress.IPv6Network):
                yield f"subnet/{name}", field, net
    for dname in sorted(desired.docker_networks):
        d = desired.docker_networks[dname]
        for field, dnet in (("subnet", d.subnet), ("subnet6", d.subnet6)):
            if dnet is not None and (d.auto is None if field == "subnet" else d.auto6 is None):
                yield f"docker_network/{dname}", field, dnet


def _host_ips(desired: DesiredState) -> Iterator[IPAddr]:
    for aid in sorted(desired.allocs):
        for p in desired.allocs[aid].ports:
            if p.host_ip is not None:
                yield p.host_ip


def resolve(desired: DesiredState, live: LiveState, *, prune: bool = True,
            picks: Picks | None = None) -> Resolution:
    """Resolve every ``auto`` prefix of ``desired`` (see the module docstring); each choice is
    recorded in ``picks`` with its origin (lease, live or new)."""
    picks = picks if picks is not None else Picks()
    requests = _requests(desired)
    if not requests:
        return Resolution(desired)
    declared = _Taken()  # what a kept prefix must not overlap: the files' fixed prefixes
    for _address, _field, net in _fixed(desired):
        declared.add(span_of(net))
    taken = _Taken()  # what a new pick must not overlap: all of it
    for version in (4, 6):
        for lo, hi in declared.merged(version):
            taken.add((version, lo, hi))
    for ip in _host_ips(desired):  # a kept prefix holding one is refused by check()
        taken.add((ip.version, int(ip), int(ip)))
    for occ in occupants(desired, live, prune=prune):
        taken.add(span_of(occ.net))
    for pr in unassigned_pools(live):
        taken.add((pr.version, pr.first, pr.last))
    for vnet, _why in VANTAGE_NETS:  # the probes' external vantage link (its /30, /126)
        taken.add(span_of(vnet))
    for lk in live.links.values():  # owned prefixes, also of subnets being pruned (--no-prune)
        for a in lk.addresses:
            if a.owned and lk.owned:
                taken.add(span_of(a.address.network))
    chosen: dict[tuple[str, str], Net] = {}

    def keep(key: tuple[str, str], auto: AutoPrefix, candidates: Iterable[Net]) -> None:
        for net in candidates:
            if _fits(net, auto) and not declared.hits(span_of(net)):
                chosen[key] = net
                declared.add(span_of(net))
                taken.add(span_of(net))
                return

    # pass 0: leases (SPEC §11) -- one no longer valid, or taken by a declared prefix, is
    # re-picked with a plan line
    leased: set[tuple[str, str]] = set()
    for address, _name, field, auto in requests:
        lease = picks.lease(address, field)
        if lease is None:
            continue
        leased.add((address, field))
        leased_net = parse_prefix(str(lease))
        keep((address, field), auto, [leased_net] if leased_net is not None else [])
        if (address, field) in chosen:
            picks.record(address, field, str(leased_net), LEASE)
        elif _fits(leased_net, auto):
            picks.dropped(address, field, "overlaps a prefix the files declare now")
        else:
            picks.dropped(address, field, f"is no longer valid (not a /{auto.size} of pool "
                          f"{auto.pool})")
    # pass 1: keep what is live (no lease yet) -- first what names the resource (its rules,
    # its Docker network), then, for subnets, a gateway address on its bridge (rules flushed)
    for address, name, field, auto in requests:
        if (address, field) not in leased:
            keep((address, field), auto, _live_evidence(live, address, name, auto))
    for address, name, field, auto in requests:
        if ((address, field) in chosen or (address, field) in leased
                or not address.startswith("subnet/")):
            continue
        bridge = desired.subnets[name].bridge  # type: ignore[index]
        version = auto.pool.version
        others = _named_by_other_rules(live, name, version)  # an undeclared subnet's, say
        keep((address, field), auto, [n for n in _gateway_prefixes(live, bridge, version)
                                      if n not in others])
    res = Resolution(desired)
    for address, name, field, auto in requests:  # pass 2: the first free prefix, in order
        key = (address, field)
        res.picked.setdefault(address, {})[field] = str(auto.pool)
        if key in chosen:
            if picks.source(address, field) is None:
                picks.record(address, field, str(chosen[key]), LIVE)
            continue
        pick = taken.first_free(auto)
        if pick is None:
            kind, _, _ = address.partition("/")
            what = "subnet" if kind == "subnet" else "docker network"
            src = (desired.subnets[name].source if kind == "subnet"  # type: ignore[index]
                   else desired.docker_networks[name].source)  # type: ignore[index]
            res.fatal.append(f"{what} {name!r} ({src}): {field}: auto: pool {auto.pool} has no "
                             f"free /{auto.size} left (the host, Docker and the other "
                             "declared prefixes take the rest)")
            continue
        chosen[key] = pick
        taken.add(span_of(pick))
        picks.record(address, field, str(pick), NEW)
    _refuse_collisions(chosen, res)
    if res.fatal:
        return res
    res.desired = _with_picks(desired, chosen)
    return res


def _refuse_collisions(chosen: dict[tuple[str, str], Net], res: Resolution) -> None:
    """Refuse collisions: picks are made against everything taken so far, so they cannot collide;
    say so if they ever do rather than plan two resources on one prefix."""
    items = sorted(chosen.items(), key=lambda kv: span_of(kv[1]))
    for (k1, n1), (k2, n2) in zip(items, items[1:], strict=False):
        if overlaps(span_of(n1), span_of(n2)):
            res.fatal.append(f"{k1[0]} {k1[1]} {n1} and {k2[0]} {k2[1]} {n2} were both picked "
                             "for auto; refusing the plan")


def _with_picks(desired: DesiredState, chosen: dict[tuple[str, str], Net]) -> DesiredState:
    subnets = dict(desired.subnets)
    for name, s in desired.subnets.items():
        if s.resolved:
            continue
        cidr = chosen.get((f"subnet/{name}", "cidr"), s.prefix)
        cidr6 = chosen.get((f"subnet/{name}", "cidr6"), s.prefix6)
        assert isinstance(cidr, ipaddress.IPv4Network)
        assert cidr6 is None or isinstance(cidr6, ipaddress.IPv6Network)
        subnets[name] = s.with_prefixes(cidr, cidr6)
    docker = dict(desired.docker_networks)
    for dname, d in desired.docker_networks.items():
        v4 = chosen.get((f"docker_network/{dname}", "subnet"))
        v6 = chosen.get((f"docker_network/{dname}", "subnet6"))
        if v4 is not None or v6 is not None:
            assert v4 is None or isinstance(v4, ipaddress.IPv4Network)
            assert v6 is None or isinstance(v6, ipaddress.IPv6Network)
            docker[dname] = dataclasses.replace(d, subnet=v4 or d.subnet,
                                                subnet6=v6 or d.subnet6)
    return dataclasses.replace(desired, subnets=subnets, docker_networks=docker)


# ------------------------------------------------------------------ conflicts and warnings


@dataclass
class Findings:
    """What the declared prefixes overlap, for the kind planners to report."""

    #: "subnet/NAME" or "docker_network/NAME" -> the conflict's reason
    conflicts: dict[str, str] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)
    #: what makes the plan unusable: a host_ip inside a subnet picked for ``auto``
    fatal: list[str] = dataclasses.field(default_factory=list)


def _declared(desired: DesiredState) -> Iterator[tuple[str, str, str, Net, bool]]:
    """Yield (address, name, field, prefix, is_docker) of every (resolved) declared prefix."""
    for name in sorted(desired.subnets):
        s = desired.subnets[name]
        yield f"subnet/{name}", name, "cidr", s.cidr, False
        if s.cidr6 is not None:
            yield f"subnet/{name}", name, "cidr6", s.cidr6, False
    for dname in sorted(desired.docker_networks):
        d = desired.docker_networks[dname]
        for field, dnet in (("subnet", d.subnet), ("subnet6", d.subnet6)):
            if dnet is not None:
                yield f"docker_network/{dname}", dname, field, dnet, True


def _named(items: Sequence[str]) -> str:
    shown = ", ".join(items[:NAMED])
    return shown + (f" and {len(items) - NAMED} more" if len(items) > NAMED else "")


def check(desired: DesiredState, live: LiveState, *, prune: bool = True,
          picked: dict[str, dict[str, str]] | None = None) -> Findings:
    """Check the declared (resolved) prefixes and host_ips: conflicts and warnings."""
    picked = picked or {}
    found = Findings()
    occ = PrefixIndex(occupants(desired, live, prune=prune))
    pools = unassigned_pools(live)
    reasons: dict[str, list[str]] = {}
    elsewhere = docker_elsewhere(live)
    for address, name, field, net, is_docker in _declared(desired):
        span = span_of(net)
        hits: list[str] = []
        apart: list[str] = []
        for o in occ.overlapping(net):
            if is_docker and o.docker == name:
                continue
            # in a sandbox, Docker's networks are in the daemon's namespace: a Docker network
            # and the routing here cannot collide (two Docker networks still can: one daemon)
            (apart if elsewhere and (o.docker is None) == is_docker else hits).append(o.what)
        hits += [why for vnet, why in VANTAGE_NETS
                 if vnet.version == net.version and net.overlaps(vnet)]
        auto = " (auto)" if field in picked.get(address, {}) else ""
        if apart:
            found.warnings.append(_apart_warning(address, name, field, net, apart))
        if hits:
            reasons.setdefault(address, []).append(
                f"{field} {net}{auto} overlaps {_named(list(dict.fromkeys(hits)))}")
            continue
        if is_docker:
            continue  # a Docker network's own subnet marks its chunk of the pool as used
        for pr in pools:
            if pr.version == span[0] and pr.first <= span[2] and span[1] <= pr.last:
                chunk = pr.chunk_at(max(span[1], pr.first))
                where = f"{chunk} of " if chunk != pr.pool else ""
                found.warnings.append(
                    f"subnet {name!r}: {field} {net} is in {where}Docker's default address "
                    f"pool {pr.pool}, not handed out yet: Docker skips it only while this "
                    "prefix is routed where dockerd runs")
                break
    for address, parts in reasons.items():
        found.conflicts[address] = "; ".join(parts)
    space = live.docker_space
    if space is not None and not space.available and desired.subnets:
        why = (space.error or "unavailable").removeprefix("docker: ")
        found.warnings.append(f"docker: {why} — subnets not checked against Docker's networks "
                              "(its default pools still are)")
    found.warnings += host_ip_warnings(desired, live)
    found.fatal += _host_ips_inside(desired, picked)
    return found


def _apart_warning(address: str, name: str, field: str, net: Net, apart: Sequence[str]) -> str:
    """Warn of overlaps between a Docker network and the routing of a sandbox whose namespace
    does not hold Docker's networks: no conflict here, one on a host that holds both."""
    kind = "docker network" if address.startswith("docker_network/") else "subnet"
    why = ("Docker's networks are in the daemon's network namespace, not this one"
           if kind == "subnet" else "it is made in the daemon's network namespace, not this one")
    return (f"{kind} {name!r}: {field} {net} overlaps {_named(list(dict.fromkeys(apart)))}: "
            f"no conflict here ({why}), but there would be one in a namespace that holds both")


def _host_ips_inside(desired: DesiredState, picked: dict[str, dict[str, str]]) -> list[str]:
    """Find a host_ip inside an ``auto`` subnet's (kept) prefix: validate could not tell."""
    out = []
    for aid in sorted(desired.allocs):
        a = desired.allocs[aid]
        for i, p in enumerate(a.ports):
            if p.host_ip is None:
                continue
            for name in sorted(desired.subnets):
                s = desired.subnets[name]
                for field, net in (("cidr", s.cidr), ("cidr6", s.cidr6)):
                    if net is not None and field in picked.get(f"subnet/{name}", {}) and \
                            p.host_ip in net:
                        out.append(f"alloc {aid!r} ({a.source}) ports[{i}]: host_ip {p.host_ip} "
                                   f"is inside subnet {name!r} ({field} {net}, auto): a port "
                                   "map publishes an address of the host")
    return out


def host_ip_warnings(desired: DesiredState, live: LiveState) -> list[str]:
    """Warn of a unicast ``host_ip`` not on the host right now (a floating VIP): one line per
    map."""
    exact, loopback = local_addresses(live)
    out = []
    for aid in sorted(desired.allocs):
        a = desired.allocs[aid]
        for i, p in enumerate(a.ports):
            ip = p.host_ip
            if ip is None or ip in exact or any(ip in n for n in loopback):
                continue
            out.append(f"alloc {aid!r} ports[{i}]: host_ip {ip} is not an address of this "
                       "host right now (a floating address?): the map takes effect once it is")
    return out


# ------------------------------------------------------------------ the agent's needs


def relevant(desired: DesiredState, live: LiveState, *, prune: bool = True) -> object:
    """Return what of the host :func:`resolve` and :func:`check` can depend on, as a comparable
    value.

    The occupants and unassigned Docker pool ranges overlapping a declared fixed
    prefix or an ``auto`` pool, whether Docker answered, and which declared host_ips
    are local; two live states that agree on it give the same resolution, conflicts
    and warnings (the rest of the plan depends on links, rules, namespaces and the
    inspected Docker networks, see ``links_that_matter``).
    """
    nets = [net for _a, _f, net in _fixed(desired)]
    nets += [auto.pool for _a, _n, _f, auto in _requests(desired)]
    if not nets and not any(True for _ in _host_ips(desired)):
        return ()
    wanted = [span_of(net) for net in nets]
    index = PrefixIndex(occupants(desired, live, prune=prune))
    occ = sorted({(o.what, str(o.net), o.docker, o.elsewhere) for net in nets
                  for o in index.overlapping(net)})
    pools = sorted((str(pr.pool), pr.size, pr.first, pr.last) for pr in unassigned_pools(live)
                   if any(overlaps((pr.version, pr.first, pr.last), w) for w in wanted))
    space = live.docker_space
    docker = None if space is None else (space.available, space.error)
    exact, loopback = local_addresses(live)
    local = sorted(str(ip) for ip in _host_ips(desired)
                   if ip in exact or any(ip in n for n in loopback))
    return (tuple(occ), tuple(pools), docker, tuple(local))
