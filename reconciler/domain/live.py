"""Values describing the live state of the host, as observers report it.

Observation is read-only and produces one ``LiveState``; the planner compares
it with the ``DesiredState``. Parsing of raw payloads (netlink messages,
``iptables-save`` output, Docker inspect data) into these values is pure.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from reconciler.domain.nftable import TableState
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE

IPInterface = ipaddress.IPv4Interface | ipaddress.IPv6Interface


@dataclass(frozen=True)
class LiveAddress:
    address: IPInterface
    owned: bool  # carries our IFA_PROTO marker


@dataclass(frozen=True)
class LiveLink:
    """A link in the namespace the reconciler acts on."""

    name: str
    index: int
    kind: str  # IFLA_INFO_KIND: "bridge", "veth", "dummy", "" for physical
    mtu: int
    up: bool
    owned: bool
    alias: str | None = None
    master: str | None = None  # name of the bridge this link is a port of
    addresses: tuple[LiveAddress, ...] = ()
    hairpin: bool | None = None  # bridge ports only
    peer_netnsid: int | None = None  # veth only: where the peer lives (IFLA_LINK_NETNSID)
    mac: str | None = None  # IFLA_ADDRESS, lower-case ``aa:bb:..``; None: the link has none
    #: bridges we own: whether their MAC is set (addr_assign_type NET_ADDR_SET), so it no
    #: longer follows their ports; None: not asked (``engine.observe`` asks for bridges)
    mac_pinned: bool | None = None


@dataclass(frozen=True)
class LiveRoute:
    dst: str  # "default" or a prefix
    gateway: str | None
    owned: bool
    #: ifindex of the output link (RTA_OIF); 0 when the route has none (blackhole,
    #: unreachable, multipath)
    oif: int = 0
    #: the route type when it is not a plain unicast route: "blackhole", "unreachable", ...
    type: str = "unicast"
    #: its routing table (RTA_TABLE): 254 is main; the host's routes of other tables are
    #: those an ``ip rule`` selects (Tailscale's 52, WireGuard's fwmark table)
    table: int = 254


@dataclass(frozen=True)
class LiveNeighbour:
    """A neighbour (ARP / NDP) entry with a link-layer address, on a link of the host."""

    index: int  # ifindex of the link it is on
    address: str  # the IP address, as ``ipaddress`` prints it
    mac: str
    permanent: bool  # NUD_PERMANENT: someone pinned it (``ip neigh add ... permanent``)
    #: NTF_EXT_LEARNED: made by a control plane (``extern_learn``), exempt from the kernel's
    #: GC, so never collected by it; ours carry it (and ``protocol``)
    extern_learn: bool = False
    protocol: int = 0  # NDA_PROTOCOL (0: none), ``ownership.NEIGH_PROTO`` on ours


@dataclass(frozen=True)
class LiveNetns:
    """An allocation namespace under /run/netns and what is inside it."""

    name: str
    usable: bool  # False: the file exists but is not a live namespace mount
    links: tuple[LiveLink, ...] = ()
    routes: tuple[LiveRoute, ...] = ()
    nsid: int | None = None
    #: the reconciler's tag on the file itself (read when it is not a live namespace)
    file_mark: str | None = None
    #: the namespace's inode (a live one): the namespace the reconciler runs in is never
    #: an allocation's, whatever its name or marks
    inode: int | None = None


@dataclass(frozen=True)
class LiveChainSet:
    """Rules of one iptables table family as ``iptables-save`` prints them.

    ``chains`` maps ``(table, chain)`` to the chain's rules, each the text after
    ``-A CHAIN`` exactly as iptables-save canonicalises it.
    """

    available: bool
    chains: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    policies: dict[tuple[str, str], str] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class LiveEndpoint:
    """A container attached to a Docker network, as the network's inspect lists it."""

    name: str
    ipv4: str | None = None  # the address without its prefix length
    ipv6: str | None = None
    #: its IPv4Address / IPv6Address as the inspect gives them (``ip/len``): ``show``,
    #: ``graph``
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class LiveDockerNetwork:
    id: str
    name: str
    driver: str
    labels: dict[str, str]
    options: dict[str, str]
    enable_ipv6: bool
    internal: bool
    subnets: tuple[str, ...]  # IPAM config subnets as Docker reports them
    containers: int
    #: the containers attached, by name (what a replace disconnects: ``planner.impact``)
    endpoints: tuple[LiveEndpoint, ...] = ()

    @property
    def owned(self) -> bool:
        return self.labels.get(DOCKER_LABEL) == DOCKER_LABEL_VALUE


@dataclass(frozen=True)
class LiveDocker:
    available: bool
    error: str | None = None
    default_mtu: int | None = None
    networks: tuple[LiveDockerNetwork, ...] = ()
    #: which reconciler instance we are, for the scope label of the networks we create:
    #: "host", or the network namespace a sandbox run acts on
    scope: str = "host"


@dataclass(frozen=True)
class DockerNetworkUse:
    """Where one live Docker network sits in the address space (from one list call)."""

    name: str
    id: str
    subnets: tuple[str, ...]  # IPAM config subnets as Docker reports them
    bridge: str  # its Linux bridge: docker0, br-<id[:12]>, or the bridge.name option
    owned: bool = False
    driver: str = "bridge"


@dataclass(frozen=True)
class DockerAddressSpace:
    """Every live Docker network's subnets and the daemon's default address pools.

    Docker networks are global to the daemon, so they count whichever network
    namespace the reconciler acts on. ``available`` is False when the daemon did
    not answer: its networks are unknown then (their bridges' routes still show).
    """

    available: bool
    networks: tuple[DockerNetworkUse, ...] = ()
    #: ``default-address-pools``: (base prefix, size of the subnets handed out)
    pools: tuple[tuple[str, int], ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class LiveFlow:
    """A conntrack entry of a TCP or UDP flow, for the impact's flow counts.

    ``src``/``sport`` -> ``dst``/``dport``: what its first packet was (before NAT);
    ``reply_src``/``reply_sport``: where the replies come from (a DNATed flow: the
    allocation the rule sent it to). ``established``: TCP in state ESTABLISHED, UDP
    answered at least once.
    """

    family: int
    proto: str  # "tcp" or "udp"
    src: str
    sport: int
    dst: str
    dport: int
    reply_src: str
    reply_sport: int
    established: bool


@dataclass(frozen=True)
class LiveState:
    #: identity of the host: inode of the network namespace the reconciler acts on
    host_id: str = ""
    links: dict[str, LiveLink] = field(default_factory=dict)
    #: our nftables table as read back (``domain.nftable``); ``firewall4``/``firewall6`` are
    #: its entries in the planner's rule form (``planner.nftview``)
    table: TableState = field(default_factory=lambda: TableState(available=False))
    firewall4: LiveChainSet = field(default_factory=lambda: LiveChainSet(available=False))
    firewall6: LiveChainSet = field(default_factory=lambda: LiveChainSet(available=False))
    #: the iptables rules (``iptables-save``): the ``RECONCILER-*`` chains of earlier
    #: versions the first apply removes, Docker's published ports, the FORWARD that needs
    #: the mark accept; unavailable: no iptables here
    old4: LiveChainSet = field(default_factory=lambda: LiveChainSet(available=False))
    old6: LiveChainSet = field(default_factory=lambda: LiveChainSet(available=False))
    #: iptables-legacy's rules beside the nf_tables backend we write (``planner.legacy``
    #: names those on a declared path); None: no legacy table here, or legacy is our backend
    legacy4: LiveChainSet | None = None
    legacy6: LiveChainSet | None = None
    sysctls: dict[str, str] = field(default_factory=dict)
    netns: dict[str, LiveNetns] = field(default_factory=dict)
    docker: LiveDocker | None = None  # None: not observed (nothing Docker declared or owned)
    listening: frozenset[tuple[str, int]] = frozenset()  # (proto, port) bound on the host
    #: routes of the host in every table an ``ip rule`` selects (read when subnets or Docker
    #: networks are declared)
    routes: tuple[LiveRoute, ...] = ()
    #: all Docker networks and pools; None: no Docker here, or nothing that needs it declared
    docker_space: DockerAddressSpace | None = None
    #: neighbour entries on the declared bridges (read when allocations are declared)
    neighbours: tuple[LiveNeighbour, ...] = ()
    #: conntrack entries of the flows a plan's impact counts; None: not read (they are read
    #: only for a plan that disrupts something, and only those: ``engine.impact``)
    flows: tuple[LiveFlow, ...] | None = None
    #: nsid (here) -> name under /run/netns of a live namespace that ``netns`` does not hold,
    #: where the peer of an owned veth whose allocation namespace was not found is (read
    #: only for such veths): such a veth is no orphan, whatever the marks say
    peer_namespaces: dict[int, str] = field(default_factory=dict)
    #: the scope's lease table (``domain/leases``): resource -> leased field -> value
    leases: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: why the lease file could not be read (then ``leases`` is empty): one plan warning
    leases_problem: str | None = None
