"""What the reconciler owns on a host, as a topology people can read (pure).

``reconcile show`` and ``reconcile graph`` both start here: bridges, the subnets each
serves, the allocations on each subnet with their addresses, MAC and port maps, and
Docker networks with their containers. Everything is read back from one ``LiveState``
and from the markers the reconciler leaves on what it made, never from the files, so
it is the host's truth: subnets are known by their rules' comments
(``reconciler:subnet=NAME``, with the bridge and prefixes those rules match), an
allocation by the mark on its namespace's ``lo``, its port maps by the comments of
its DNAT rules (``planner.firewall.dnat_rules``, the one reader of them).

See docs/decisions/033-show-and-graph-read-the-host.md.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from reconciler.domain.docker import SCOPE_LABEL
from reconciler.domain.live import LiveLink, LiveNetns, LiveState
from reconciler.domain.ownership import ALLOC_IFNAME, alloc_ns_marks, alloc_veth_name
from reconciler.planner import firewall


@dataclass(frozen=True)
class BridgeView:
    name: str
    mtu: int
    up: bool
    mac: str | None
    #: owned addresses on it (the subnets' gateways), ``ip/len``
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class SubnetView:
    name: str
    bridge: str | None
    #: the prefixes its rules match (IPv4 first)
    cidrs: tuple[str, ...] = ()
    #: the owned addresses on its bridge inside those prefixes, ``ip/len``
    gateways: tuple[str, ...] = ()


@dataclass(frozen=True)
class PortView:
    """One live port map (one protocol), read back from its DNAT rule."""

    protocol: str
    host: int
    to: int
    host_ip: str | None = None

    @property
    def text(self) -> str:
        """As the planner's ``ports`` attribute spells it: ``HOST/PROTO->TO[@HOST_IP]``."""
        return f"{self.host}/{self.protocol}->{self.to}" + (f"@{self.host_ip}"
                                                            if self.host_ip else "")


@dataclass(frozen=True)
class AllocView:
    id: str
    #: the bridge its host-side veth is a port of; None: no veth (or not on a bridge)
    bridge: str | None
    #: the live subnet on that bridge that holds its address; None: none does
    subnet: str | None
    #: owned addresses of its ``eth0``, ``ip/len``
    addresses: tuple[str, ...] = ()
    mac: str | None = None
    #: its port maps, by host port
    ports: tuple[PortView, ...] = ()
    veth: str | None = None


@dataclass(frozen=True)
class ContainerView:
    name: str
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class DockerNetworkView:
    name: str
    id: str
    subnets: tuple[str, ...] = ()
    scope: str | None = None
    containers: tuple[ContainerView, ...] = ()
    #: how many containers Docker says are attached (names may be missing from a list call)
    container_count: int = 0


@dataclass(frozen=True)
class Topology:
    bridges: dict[str, BridgeView] = field(default_factory=dict)
    subnets: dict[str, SubnetView] = field(default_factory=dict)
    allocs: dict[str, AllocView] = field(default_factory=dict)
    docker_networks: dict[str, DockerNetworkView] = field(default_factory=dict)

    def subnets_of(self, bridge: str | None) -> list[SubnetView]:
        return [s for _n, s in sorted(self.subnets.items()) if s.bridge == bridge]

    def allocs_of(self, bridge: str | None, subnet: str | None) -> list[AllocView]:
        return [a for _n, a in sorted(self.allocs.items())
                if a.bridge == bridge and a.subnet == subnet]


def _inner(ns: LiveNetns, name: str) -> LiveLink | None:
    return next((lk for lk in ns.links if lk.name == name), None)


def _live_subnets(live: LiveState) -> dict[str, SubnetView]:
    """Read subnets as their rules name them: ``-o BRIDGE`` / ``-d PREFIX`` of each family."""
    found: dict[str, tuple[str | None, list[str]]] = {}
    for fw in (live.firewall4, live.firewall6):
        for owner, rules in firewall.live_by_owner(fw).items():
            kind, _, name = owner.partition("=")
            if kind != "subnet":
                continue
            bridge, cidrs = found.setdefault(name, (None, []))
            for _chain, rule in rules:
                toks = rule.split()
                if "-o" in toks:
                    bridge = toks[toks.index("-o") + 1]
                if "-d" in toks and toks[toks.index("-d") - 1] != "!":
                    cidr = toks[toks.index("-d") + 1]
                    if cidr not in cidrs:
                        cidrs.append(cidr)
            found[name] = (bridge, cidrs)
    out = {}
    for name, (bridge, cidrs) in sorted(found.items()):
        link = live.links.get(bridge) if bridge else None
        gateways = tuple(str(a.address) for a in (link.addresses if link else ())
                         if a.owned and any(_within(a.address.ip, c) for c in cidrs))
        cidrs.sort(key=lambda c: ":" in c)
        out[name] = SubnetView(name, bridge, tuple(cidrs), gateways)
    return out


def _within(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, cidr: str) -> bool:
    try:
        return ip in ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return False


def live_topology(live: LiveState, *, all_scopes: bool = False) -> Topology:
    """Group everything this host's reconciler owns in ``live`` as people think of it.

    Docker networks are the daemon's, shared by every reconciler that talks to it:
    only those of this one's scope (the host, or the sandbox it acts on) unless
    ``all_scopes``.
    """
    bridges = {n: BridgeView(n, lk.mtu, lk.up, lk.mac,
                             tuple(str(a.address) for a in lk.addresses if a.owned))
               for n, lk in sorted(live.links.items()) if lk.owned and lk.kind == "bridge"}
    subnets = _live_subnets(live)
    ports: dict[str, set[PortView]] = {}
    for fw in (live.firewall4, live.firewall6):
        for d in firewall.dnat_rules(fw.chains.get(("nat", firewall.DNAT), ())):
            # one map of a dual-stack alloc is a rule per family: one map
            ports.setdefault(d.alloc, set()).add(
                PortView(d.proto, d.port, d.to, str(d.host_ip) if d.host_ip else None))
    marks = alloc_ns_marks(live.host_id)
    allocs = {}
    for name, ns in sorted(live.netns.items()):
        lo = _inner(ns, "lo") if ns.usable else None
        if lo is None or lo.alias not in marks:
            continue
        eth0 = _inner(ns, ALLOC_IFNAME)
        addresses = tuple(str(a.address) for a in (eth0.addresses if eth0 else ()) if a.owned)
        veth = live.links.get(alloc_veth_name(name))
        bridge = veth.master if veth is not None else None
        subnet = next((s.name for s in subnets.values() if s.bridge == bridge and any(
            _within(ipaddress.ip_interface(a).ip, c) for a in addresses for c in s.cidrs)),
            None)
        allocs[name] = AllocView(name, bridge, subnet, addresses, eth0.mac if eth0 else None,
                                 tuple(sorted(ports.get(name, ()), key=lambda p: (
                                     p.host, p.protocol, p.host_ip or ""))),
                                 veth.name if veth is not None else None)
    docker = {}
    if live.docker is not None and live.docker.available:
        for n in live.docker.networks:
            if not n.owned or (not all_scopes
                               and n.labels.get(SCOPE_LABEL) != live.docker.scope):
                continue  # another reconciler's (another sandbox's) networks
            # duplicates of one name (kind keeps one, removes the rest): each drawn
            key = n.name if n.name not in docker else f"{n.name} {n.id[:12]}"
            docker[key] = DockerNetworkView(
                n.name, n.id, n.subnets, n.labels.get(SCOPE_LABEL),
                tuple(ContainerView(e.name, e.addresses) for e in n.endpoints), n.containers)
    return Topology(bridges, subnets, allocs, docker)
