"""Domain values of the desired state: what the YAML files declare.

Everything here is frozen and validated by the loader; the planner and the
drivers can rely on names being kernel-safe and addresses being well formed.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from typing import Literal, NewType

BridgeName = NewType("BridgeName", str)
SubnetName = NewType("SubnetName", str)
AllocId = NewType("AllocId", str)
DockerNetworkName = NewType("DockerNetworkName", str)

Protocol = Literal["tcp", "udp", "both"]
#: what a subnet forwards in from outside it: declared port maps and replies, or anything
Isolation = Literal["ports", "open"]
Kind = Literal["bridge", "subnet", "alloc", "docker_network"]


@dataclass(frozen=True, order=True)
class Source:
    """Where a resource was declared."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Bridge:
    name: BridgeName
    mtu: int | None = None
    hairpin: bool = True
    source: Source = field(default=Source("<memory>", 0), compare=False)


@dataclass(frozen=True)
class AddrRange:
    start: ipaddress.IPv4Address
    end: ipaddress.IPv4Address


@dataclass(frozen=True)
class AutoPrefix:
    """``cidr: auto`` (``subnet: auto``): the first free ``/size`` inside ``pool``.

    The planner picks it at plan time (``planner.addrspace``) and keeps it once
    given: the live state shows which prefix a resource has.
    """

    pool: ipaddress.IPv4Network | ipaddress.IPv6Network
    size: int

    def __str__(self) -> str:
        return f"auto /{self.size} from {self.pool}"


class UnresolvedPrefixError(AssertionError):
    """A prefix declared ``auto`` was used before the planner picked it (a bug, not input)."""


@dataclass(frozen=True)
class Subnet:
    """A declared subnet. ``prefix``/``prefix6`` hold what the file says: a prefix, or
    ``AutoPrefix`` for ``cidr: auto``; ``cidr``, ``gateway``... are the resolved values
    (the planner resolves ``auto`` first, ``planner.addrspace.resolve``)."""

    name: SubnetName
    bridge: BridgeName
    prefix: ipaddress.IPv4Network | AutoPrefix
    #: declared gateway; None: the first host address of the prefix
    declared_gateway: ipaddress.IPv4Address | None = None
    prefix6: ipaddress.IPv6Network | AutoPrefix | None = None
    declared_gateway6: ipaddress.IPv6Address | None = None
    range: AddrRange | None = None
    masquerade: bool = True
    isolation: Isolation = "ports"
    source: Source = field(default=Source("<memory>", 0), compare=False)

    @property
    def auto(self) -> AutoPrefix | None:
        """The pool ``cidr: auto`` picks from, or None for a fixed cidr."""
        return self.prefix if isinstance(self.prefix, AutoPrefix) else None

    @property
    def auto6(self) -> AutoPrefix | None:
        return self.prefix6 if isinstance(self.prefix6, AutoPrefix) else None

    @property
    def resolved(self) -> bool:
        return self.auto is None and self.auto6 is None

    @property
    def cidr(self) -> ipaddress.IPv4Network:
        if isinstance(self.prefix, AutoPrefix):
            raise UnresolvedPrefixError(f"subnet {self.name}: cidr is auto and not resolved")
        return self.prefix

    @property
    def cidr6(self) -> ipaddress.IPv6Network | None:
        if isinstance(self.prefix6, AutoPrefix):
            raise UnresolvedPrefixError(f"subnet {self.name}: cidr6 is auto and not resolved")
        return self.prefix6

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        if self.declared_gateway is not None:
            return self.declared_gateway
        return ipaddress.IPv4Address(self.cidr.network_address + 1)

    @property
    def gateway6(self) -> ipaddress.IPv6Address | None:
        cidr6 = self.cidr6
        if cidr6 is None:
            return None
        if self.declared_gateway6 is not None:
            return self.declared_gateway6
        return ipaddress.IPv6Address(cidr6.network_address + 1)

    @property
    def gateway_interface(self) -> ipaddress.IPv4Interface:
        return ipaddress.IPv4Interface(f"{self.gateway}/{self.cidr.prefixlen}")

    @property
    def gateway6_interface(self) -> ipaddress.IPv6Interface | None:
        if self.cidr6 is None or self.gateway6 is None:
            return None
        return ipaddress.IPv6Interface(f"{self.gateway6}/{self.cidr6.prefixlen}")

    def with_prefixes(self, cidr: ipaddress.IPv4Network,
                      cidr6: ipaddress.IPv6Network | None) -> Subnet:
        """Return this subnet with its ``auto`` prefixes picked."""
        return replace(self, prefix=cidr, prefix6=cidr6)


@dataclass(frozen=True)
class PortMap:
    """One declared port map. ``host`` is None for ``host: auto``."""

    host: int | None
    to: int
    protocol: Protocol = "tcp"
    host_ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
    #: ``probe: false``: no probe connects through this map (a service that must not see
    #: connections it did not ask for); the gateway probe of its alloc still runs
    probe: bool = True

    @property
    def protocols(self) -> tuple[str, ...]:
        return ("tcp", "udp") if self.protocol == "both" else (self.protocol,)


@dataclass(frozen=True)
class Alloc:
    id: AllocId
    subnet: SubnetName
    address: ipaddress.IPv4Address | None = None
    address6: ipaddress.IPv6Address | None = None
    ports: tuple[PortMap, ...] = ()
    source: Source = field(default=Source("<memory>", 0), compare=False)


@dataclass(frozen=True)
class DockerNetwork:
    name: DockerNetworkName
    ipv6: bool = False
    subnet: ipaddress.IPv4Network | None = None
    subnet6: ipaddress.IPv6Network | None = None
    mtu: int | None = None
    masquerade: bool = True
    internal: bool = False
    labels: tuple[tuple[str, str], ...] = ()
    source: Source = field(default=Source("<memory>", 0), compare=False)
    #: ``subnet: auto`` / ``subnet6: auto``: picked at plan time into ``subnet``/``subnet6``
    auto: AutoPrefix | None = None
    auto6: AutoPrefix | None = None
    #: ``replace: allowed``: a change Docker cannot make in place re-creates the network
    #: with its containers attached, as ``--force-replace`` does (SPEC §11)
    replace_allowed: bool = False


@dataclass(frozen=True)
class Settings:
    """Host-wide settings (top-level ``settings:``); all optional."""

    #: inclusive range that ``host: auto`` picks ports from
    auto_port_range: tuple[int, int] = (20000, 32000)


@dataclass(frozen=True)
class DesiredState:
    """The merged desired state of all files, keyed by identity."""

    bridges: dict[BridgeName, Bridge] = field(default_factory=dict)
    subnets: dict[SubnetName, Subnet] = field(default_factory=dict)
    allocs: dict[AllocId, Alloc] = field(default_factory=dict)
    docker_networks: dict[DockerNetworkName, DockerNetwork] = field(default_factory=dict)
    settings: Settings = field(default_factory=Settings)
    files: tuple[str, ...] = ()
    #: (absolute path, sha256) of each file as read, for saved plans' staleness check
    file_hashes: tuple[tuple[str, str], ...] = ()
