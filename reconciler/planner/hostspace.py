"""What the host holds in the address space (pure): the occupants a declared prefix meets.

The addresses and routes of links the reconciler does not own (a VPN's, the
LAN's), every live Docker network (global to the daemon, whichever namespace we
act on), and the parts of Docker's default address pools it has not handed out
yet; what we own ourselves, for the agent's alarm (:func:`live_overlaps`).
``planner.addrspace`` checks and picks declared prefixes against them.

See docs/decisions/005-one-address-space.md.
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from reconciler.domain.docker import DEFAULT_ADDRESS_POOLS, SCOPE_LABEL, bridge_of
from reconciler.domain.live import LiveLink, LiveRoute, LiveState
from reconciler.domain.model import DesiredState
from reconciler.domain.ownership import PROBE_VANTAGE_ALIAS

Net = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address
#: an inclusive range of addresses of one family: (version, first, last)
Span = tuple[int, int, int]
#: the main routing table: its routes are named without their table
RT_TABLE_MAIN = 254


@dataclass(frozen=True)
class Occupant:
    """Something on the host holding a prefix that a declared one must not overlap."""

    net: Net
    what: str  # "route 10.8.0.0/16 via 192.0.2.7 on eth0", "docker network kind (…)"
    docker: str | None = None  # the Docker network's name, for its own declaration
    #: a Docker network whose bridge is in another network namespace (``docker_elsewhere``)
    elsewhere: bool = False


def span_of(net: Net) -> Span:
    return (net.version, int(net.network_address), int(net.broadcast_address))


def overlaps(a: Span, b: Span) -> bool:
    return a[0] == b[0] and a[1] <= b[2] and b[1] <= a[2]


def parse_prefix(text: str) -> Net | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def _unroutable(net: Net) -> bool:
    """Tell whether a route is one every host has that no declared prefix can mean: multicast, IPv6
    link-local."""
    return net.is_multicast or (net.version == 6 and net.is_link_local)


# ------------------------------------------------------------------ occupants


def _our_links(desired: DesiredState, live: LiveState) -> set[int]:
    """Find the links whose addresses and routes are ours: owned, or a declared bridge (a foreign
    bridge of that name is a conflict of its own, an adopted one becomes ours)."""
    return {lk.index for lk in live.links.values() if lk.owned or lk.name in desired.bridges}


def docker_elsewhere(live: LiveState) -> bool:
    """Tell whether Docker's networks live in another network namespace than the one we act on:
    the daemon lists bridge networks and none of their Linux bridges is a link here (a
    ``--netns`` sandbox beside the host's dockerd). Their prefixes then cannot collide
    with the routing here. Without a bridge network to tell by, they are taken as here."""
    space = live.docker_space
    if space is None or not space.available:
        return False
    bridges = [n.bridge for n in space.networks if n.driver == "bridge"]
    return bool(bridges) and not any(b in live.links for b in bridges)


def _docker_bridges(live: LiveState) -> set[str]:
    """Find the Linux bridges of live Docker networks: their addresses are the networks
    themselves."""
    space = live.docker_space
    if space is None or not space.available:
        return set()
    return {n.bridge for n in space.networks}


def _pruned_docker(desired: DesiredState, live: LiveState, prune: bool) -> set[str]:
    """Find the ids of owned Docker networks this plan removes (no file declares them, no
    containers)."""
    docker = live.docker
    if not prune or docker is None or not docker.available:
        return set()
    return {n.id for n in docker.networks
            if n.owned and n.name not in desired.docker_networks and not n.containers
            and n.labels.get(SCOPE_LABEL) == docker.scope}


def occupants(desired: DesiredState, live: LiveState, *, prune: bool = True,
              not_foreign: Iterable[str] = ()) -> list[Occupant]:
    """List what on the host holds address space a declared prefix must not overlap.

    Addresses of foreign links (a link's connected route is its address), other
    routes through foreign links or through none (blackhole, unreachable), in every
    table an ``ip rule`` selects (named when it is not main: Tailscale's 52), and
    every Docker network the daemon lists -- except those this plan prunes. Default
    routes, multicast and IPv6 link-local routes are left out.
    Links named in ``not_foreign`` count as ours.
    """
    ours = _our_links(desired, live)
    docker_bridges = _docker_bridges(live) | set(not_foreign)
    by_index = {lk.index: lk for lk in live.links.values()}
    out: list[Occupant] = []
    connected: set[tuple[int, Net]] = set()

    def foreign(lk: LiveLink) -> bool:
        # the probes' vantage link is ours, and its prefixes are reserved already (a prefix
        # on them is said to overlap the reservation, not a foreign object)
        return (lk.index not in ours and lk.name not in docker_bridges
                and lk.alias != PROBE_VANTAGE_ALIAS)

    for lk in sorted(live.links.values(), key=lambda x: x.name):
        if not foreign(lk):
            continue
        for a in lk.addresses:
            if a.owned:
                continue
            connected.add((lk.index, a.address.network))
            out.append(Occupant(a.address.network, f"address {a.address} on {lk.name}"))
    for r in live.routes:
        occ = _route_occupant(r, by_index, connected, foreign)
        if occ is not None:
            out.append(occ)
    space = live.docker_space
    if space is not None and space.available:
        pruned = _pruned_docker(desired, live, prune)
        elsewhere = docker_elsewhere(live)
        for n in sorted(space.networks, key=lambda x: (x.name, x.id)):
            if n.id in pruned:
                continue
            for text in n.subnets:
                net = parse_prefix(text)
                if net is not None:
                    out.append(Occupant(net, f"docker network {n.name} ({net} on {n.bridge})",
                                        docker=n.name, elsewhere=elsewhere))
    return out


def _route_occupant(r: LiveRoute, by_index: dict[int, LiveLink],
                    connected: set[tuple[int, Net]],
                    foreign: Callable[[LiveLink], bool]) -> Occupant | None:
    if r.owned or r.dst == "default":
        return None
    net = parse_prefix(r.dst)
    if net is None or net.prefixlen == 0 or _unroutable(net):
        return None
    table = "" if r.table == RT_TABLE_MAIN else f" in table {r.table}"
    if not r.oif:
        kind = "" if r.type == "unicast" else f"{r.type} "
        return Occupant(net, f"{kind}route {net}{table}")
    lk = by_index.get(r.oif)
    if lk is not None and not foreign(lk):
        return None
    if (r.oif, net) in connected:
        return None  # the connected route of an address already named
    via = f" via {r.gateway}" if r.gateway else ""
    return Occupant(net, f"route {net}{via} on {lk.name if lk else f'ifindex {r.oif}'}{table}")


class PrefixIndex:
    """Occupants by prefix, to find those overlapping a prefix without a scan of them all:
    an overlap is either inside the prefix (a range of sorted starts) or one of its at
    most 128 supernets."""

    def __init__(self, items: Iterable[Occupant]) -> None:
        self._order: dict[int, list[tuple[int, int, int, Occupant]]] = {4: [], 6: []}
        self._exact: dict[tuple[int, int, int], list[tuple[int, Occupant]]] = {}
        for i, o in enumerate(items):
            key = (o.net.version, int(o.net.network_address), o.net.prefixlen)
            self._order[o.net.version].append((key[1], o.net.prefixlen, i, o))
            self._exact.setdefault(key, []).append((i, o))
        for entries in self._order.values():
            entries.sort(key=lambda e: (e[0], e[1], e[2]))
        self._starts = {v: [e[0] for e in entries] for v, entries in self._order.items()}

    def overlapping(self, net: Net) -> list[Occupant]:
        """Return the occupants overlapping ``net``, in the order they were given."""
        version, first, last = span_of(net)
        found: dict[int, Occupant] = {}
        starts = self._starts[version]
        entries = self._order[version]
        for e in entries[bisect.bisect_left(starts, first):bisect.bisect_right(starts, last)]:
            found[e[2]] = e[3]
        for length in range(net.prefixlen):
            sup = net.supernet(new_prefix=length)
            for i, o in self._exact.get((version, int(sup.network_address), length), ()):
                found[i] = o
        return [found[i] for i in sorted(found)]


# ------------------------------------------------------------------ Docker's pools


@dataclass(frozen=True)
class PoolRange:
    """A range of one of Docker's default address pools that Docker has not handed out."""

    pool: Net
    size: int
    first: int
    last: int

    @property
    def version(self) -> int:
        return self.pool.version

    def chunk_at(self, address: int) -> Net:
        """Return the /size Docker would hand out that holds ``address``."""
        block = 1 << (self.pool.max_prefixlen - self.size)
        start = int(self.pool.network_address)
        first = start + (address - start) // block * block
        return ipaddress.ip_network((first, self.size))


def _subtract(first: int, last: int, holes: Iterable[tuple[int, int]]) -> Iterator[
        tuple[int, int]]:
    cursor = first
    for lo, hi in sorted(holes):
        if hi < cursor:
            continue
        if lo > last:
            break
        if lo > cursor:
            yield cursor, lo - 1
        cursor = max(cursor, hi + 1)
    if cursor <= last:
        yield cursor, last


def unassigned_pools(live: LiveState) -> list[PoolRange]:
    """Return Docker's default pools less every chunk that overlaps a live Docker network.

    Docker never hands out a chunk that overlaps a network; with the daemon down its
    networks are unknown, so the pools count whole. Empty without Docker on the host.
    """
    space = live.docker_space
    if space is None:
        return []
    nets = [n for d in space.networks for s in d.subnets if (n := parse_prefix(s)) is not None] \
        if space.available else []
    out: list[PoolRange] = []
    for base_text, size in space.pools or DEFAULT_ADDRESS_POOLS:
        base = parse_prefix(base_text)
        if base is None or not base.prefixlen <= size <= base.max_prefixlen:
            continue
        b_first, b_last = int(base.network_address), int(base.broadcast_address)
        block = 1 << (base.max_prefixlen - size)
        holes = []
        for n in nets:
            if n.version != base.version or not n.overlaps(base):
                continue
            lo = max(int(n.network_address), b_first)
            hi = min(int(n.broadcast_address), b_last)
            holes.append((b_first + (lo - b_first) // block * block,
                          b_first + (hi - b_first) // block * block + block - 1))
        out += [PoolRange(base, size, lo, hi) for lo, hi in _subtract(b_first, b_last, holes)]
    return out


def local_addresses(live: LiveState) -> tuple[set[IPAddr], list[Net]]:
    """Return the addresses of the host: those on its links, and every address of ``lo``'s
    prefixes."""
    exact: set[IPAddr] = set()
    loopback: list[Net] = []
    for lk in live.links.values():
        for a in lk.addresses:
            exact.add(a.address.ip)
            if lk.name == "lo":
                loopback.append(a.address.network)
    return exact, loopback


# ------------------------------------------------------------------ the agent's alarm


@dataclass(frozen=True, order=True)
class LiveOverlap:
    """An owned prefix and a foreign one over it (the agent's alarm)."""

    owned: str  # "10.66.0.0/24 on rcpa0", "10.30.0.0/24 of docker network kind"
    foreign: str  # "route 10.66.0.0/25 on tun0"


def owned_prefixes(links: Iterable[LiveLink]) -> list[tuple[Net, str, str | None]]:
    """List (prefix, what, its link) of the owned addresses on owned links: our gateways."""
    out: list[tuple[Net, str, str | None]] = []
    for lk in sorted(links, key=lambda x: x.name):
        if lk.owned:
            out += [(a.address.network, f"{a.address.network} on {lk.name}", lk.name)
                    for a in lk.addresses if a.owned]
    return out


def owned_docker_prefixes(live: LiveState) -> tuple[list[tuple[Net, str, str | None]],
                                                     set[str]]:
    """Return the subnets of owned Docker networks, and their Linux bridges (not foreign to
    them); none when Docker's networks live in another namespace (``docker_elsewhere``)."""
    prefixes: list[tuple[Net, str, str | None]] = []
    bridges: set[str] = set()
    if docker_elsewhere(live):
        return prefixes, bridges  # in the daemon's namespace: the routing here is not theirs
    if live.docker is not None and live.docker.available:
        for n in live.docker.networks:
            if n.owned:
                bridges.add(bridge_of(n.id, n.options))
                prefixes += [(net, f"{net} of docker network {n.name}", None)
                             for s in n.subnets if (net := parse_prefix(s)) is not None]
    return prefixes, bridges


def live_overlaps(owned: Sequence[tuple[Net, str, str | None]], links: Iterable[LiveLink],
                  routes: Iterable[LiveRoute], docker_bridges: Iterable[str] = ()
                  ) -> list[LiveOverlap]:
    """Find foreign addresses and routes of the host over an owned prefix, from fresh dumps.

    The owned prefixes' own links (our bridges, owned Docker networks' bridges) are
    not foreign; everything else is, as in a plan's :func:`occupants`.
    """
    names = {name for _n, _w, name in owned if name is not None} | set(docker_bridges)
    live = LiveState(links={lk.name: lk for lk in links}, routes=tuple(routes))
    foreign = occupants(DesiredState(), live, not_foreign=names)
    out = set()
    for net, what, _link in owned:
        for o in foreign:
            if overlaps(span_of(net), span_of(o.net)):
                out.add(LiveOverlap(what, o.what))
    return sorted(out)
