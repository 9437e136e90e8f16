"""The ops a plan runs, one frozen dataclass each: the single declaration of an op's
name and arguments.

A plan carries each op in its wire form, ``Op(name, args)``
(``reconciler.domain.plan``): that is what is printed, saved with ``plan --out``,
compared by ``Plan.same_work`` and read back by ``apply FILE``. The planner
builds the typed ops below and ``encode``s them; ``HostOps`` and the unit
tests' fake host ``decode`` them and dispatch on the class. ``decode`` is the
one place a wire op is checked: one that is not ours (hand-edited, or from a
newer version) is one ``OpError`` line, never a ``KeyError``.

The JSON is what plans have always held: each field is one key, in declared
order. Every key is required, except those of fields declared with ``_omit``:
they are left out while they hold their default. Plans print op arguments
unsorted, so key order is visible: an op read from JSON keeps its key order
(``key_order``) and re-encodes to the same bytes.

Pure: no I/O, nothing from above ``reconciler.domain``.

See docs/decisions/006-plans-are-values.md.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, get_args, get_type_hints

from reconciler.domain.checkpoint import NetworkPoint, network_from_json
from reconciler.domain.docker import SCOPE_LABEL, spec_from_json
from reconciler.domain.errors import ReconcilerError
from reconciler.domain.fwmark import DEFAULT_MARK, is_one_bit, is_shim
from reconciler.domain.jsonfields import Mismatch, as_type, describe, show
from reconciler.domain.live import IPInterface
from reconciler.domain.model import DockerNetwork
from reconciler.domain.nftable import Entry
from reconciler.domain.plan import Json, Op

_OMIT = "omit_default"
_T = TypeVar("_T")


class OpError(ReconcilerError, ValueError):
    """A wire op that is not one of ours: unknown name, or arguments of the wrong shape."""


def _omit(default: _T) -> _T:
    """Return a field whose key is left out of the JSON while it holds ``default``."""
    return field(default=default, metadata={_OMIT: True})


@dataclass(frozen=True)
class _TypedOp:
    NAME: ClassVar[str]

    #: the order of the JSON keys when it is not the declared one (see ``LinkSet.up_owned``)
    key_order: tuple[str, ...] = field(default=(), compare=False, repr=False, kw_only=True)

    def check(self) -> None:
        """Raise ValueError (or KeyError, TypeError) if a field holds no valid value."""


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


def _mac(mac: str) -> None:
    if not _MAC.fullmatch(mac):
        raise ValueError(f"{mac!r} is not a MAC address (aa:bb:cc:dd:ee:ff, lower case)")


def _ip_version(version: int) -> None:
    if version not in (4, 6):
        raise ValueError(f"IP version {version} is neither 4 nor 6")


# -- links, addresses and routes (drivers.netlink) ------------------------------------------

@dataclass(frozen=True)
class LinkAddBridge(_TypedOp):
    """Create bridge ``name`` (up, marked ours), or leave an existing one as it is."""

    NAME: ClassVar[str] = "link.add_bridge"
    name: str
    mtu: int | None
    #: the MAC it is created with (set, so it does not follow its ports); plans saved
    #: before stable MACs have none: the kernel's then
    mac: str | None = _omit(None)

    def check(self) -> None:
        if self.mac is not None:
            _mac(self.mac)


@dataclass(frozen=True)
class LinkSet(_TypedOp):
    """Change the given settings of an existing link (here, or inside ``netns``).

    ``owned`` marks it ours (the ownership alias); None leaves a setting as it is.
    """

    NAME: ClassVar[str] = "link.set"
    name: str
    owned: bool = _omit(False)
    mtu: int | None = _omit(None)
    up: bool | None = _omit(None)
    master: str | None = _omit(None)
    netns: str | None = _omit(None)

    @classmethod
    def up_owned(cls, name: str) -> LinkSet:
        """Bring a link up and mark it ours: an allocation's veth.

        Its JSON has always said ``up`` before ``owned``, where a bridge's (adopted
        and down) says ``owned`` first; saved and printed plans keep both.
        """
        return cls(name, owned=True, up=True, key_order=("name", "up", "owned"))


@dataclass(frozen=True)
class LinkDelete(_TypedOp):
    """Delete a link (a veth takes its peer with it); gone already is fine."""

    NAME: ClassVar[str] = "link.delete"
    name: str
    netns: str | None = _omit(None)


@dataclass(frozen=True)
class LinkSetHairpin(_TypedOp):
    """Set a bridge port's hairpin mode."""

    NAME: ClassVar[str] = "link.set_hairpin"
    name: str
    on: bool


@dataclass(frozen=True)
class LinkSetMac(_TypedOp):
    """Set a link's MAC, here or inside ``netns`` (to the one it has: pins a bridge's, which
    then stops following its ports)."""

    NAME: ClassVar[str] = "link.set_mac"
    name: str
    mac: str
    netns: str | None = _omit(None)

    def check(self) -> None:
        _mac(self.mac)


@dataclass(frozen=True)
class NeighReplace(_TypedOp):
    """Point the neighbour entry of ``address`` on ``link`` at ``mac`` (created stale)."""

    NAME: ClassVar[str] = "neigh.replace"
    link: str
    address: str  # an IP address, no prefix
    mac: str

    def ip(self) -> IPAddress:
        return ipaddress.ip_address(self.address)

    def check(self) -> None:
        self.ip()
        _mac(self.mac)


@dataclass(frozen=True)
class NeighDelete(_TypedOp):
    """Delete the neighbour entry of ``address`` on ``link`` (one of ours the kernel never
    collects); gone already is fine."""

    NAME: ClassVar[str] = "neigh.delete"
    link: str
    address: str  # an IP address, no prefix

    def ip(self) -> IPAddress:
        return ipaddress.ip_address(self.address)

    def check(self) -> None:
        self.ip()


@dataclass(frozen=True)
class _AddressOp(_TypedOp):
    """An address on ``link`` (here, or inside ``netns``): what adding and removing share."""

    link: str
    address: str  # an interface: address/prefix
    netns: str | None = _omit(None)

    def interface(self) -> IPInterface:
        return ipaddress.ip_interface(self.address)

    def check(self) -> None:
        self.interface()


@dataclass(frozen=True)
class AddrAdd(_AddressOp):
    """Add an address, tagged ours, to ``link`` (here, or inside ``netns``)."""

    NAME: ClassVar[str] = "addr.add"


@dataclass(frozen=True)
class AddrDel(_AddressOp):
    """Remove an address from ``link`` (here, or inside ``netns``)."""

    NAME: ClassVar[str] = "addr.del"


@dataclass(frozen=True)
class RouteDelDefault(_TypedOp):
    """Remove our default route of IP ``version`` inside an allocation namespace."""

    NAME: ClassVar[str] = "route.del_default"
    version: int
    netns: str

    def check(self) -> None:
        _ip_version(self.version)


# -- allocation namespaces -----------------------------------------------------------------

@dataclass(frozen=True)
class NetnsCreate(_TypedOp):
    """``ip netns add``, with ``lo`` marked ``mark`` before the namespace is mounted."""

    NAME: ClassVar[str] = "netns.create"
    name: str
    replace_stale: bool  # an empty /run/netns file is there: replace it
    mark: str | None


@dataclass(frozen=True)
class NetnsDelete(_TypedOp):
    """``ip netns del``."""

    NAME: ClassVar[str] = "netns.delete"
    name: str


@dataclass(frozen=True)
class AllocAttach(_TypedOp):
    """A veth pair: ``veth`` on ``bridge`` here, its peer ``eth0`` inside ``netns``."""

    NAME: ClassVar[str] = "alloc.attach"
    netns: str
    veth: str
    bridge: str
    mtu: int | None
    hairpin: bool
    #: eth0's MAC (``ownership.alloc_mac``); plans saved before stable MACs have none:
    #: the kernel's random one then
    mac: str | None = _omit(None)

    def check(self) -> None:
        if self.mac is not None:
            _mac(self.mac)


@dataclass(frozen=True)
class AllocConfigure(_TypedOp):
    """Inside ``netns``: lo and eth0 up, our addresses, default routes via ``gateways``."""

    NAME: ClassVar[str] = "alloc.configure"
    netns: str
    addresses: tuple[str, ...]  # interfaces: address/prefix
    gateways: tuple[str, ...]
    mtu: int | None
    ipv6: bool  # the alloc has IPv6; not read since eth0 never gets a link-local address
    # (issue 18), kept: plans saved by earlier versions and the planner's JSON carry it
    mark: str | None  # the alias of lo
    # announce the addresses once eth0 has them (a gratuitous ARP and an unsolicited NA
    # each): only where some cache may hold another MAC for one of them (a heal, an address
    # re-added, an address the segment has seen); a plan of an earlier version: no
    announce: bool = _omit(False)

    def interfaces(self) -> list[IPInterface]:
        return [ipaddress.ip_interface(a) for a in self.addresses]

    def gateway_ips(self) -> list[IPAddress]:
        return [ipaddress.ip_address(g) for g in self.gateways]

    def check(self) -> None:
        self.interfaces()
        self.gateway_ips()


# -- sysctls and the firewall --------------------------------------------------------------

@dataclass(frozen=True)
class SysctlSet(_TypedOp):
    """Write ``value`` to ``/proc/sys/<key>``."""

    NAME: ClassVar[str] = "sysctl.set"
    key: str  # e.g. net/ipv4/ip_forward
    value: str


@dataclass(frozen=True)
class FirewallNft(_TypedOp):
    """One transaction on our nftables table (``domain.nftable``): its entries deleted and
    added, or the whole table rebuilt with ``add`` (``rebuild``) or dropped; then the
    ``RECONCILER-*`` iptables chains of earlier versions removed (``cleanup4``/``6``: an
    ``iptables-restore --noflush`` script), after the table that replaces them is in place.
    """

    NAME: ClassVar[str] = "firewall.nft"
    rebuild: bool = False
    add: tuple[dict[str, Any], ...] = ()
    delete: tuple[dict[str, Any], ...] = ()
    drop_table: bool = False
    #: the bit a rebuilt forward chain ORs into the packet mark (``settings.firewall_mark``)
    mark: int = DEFAULT_MARK
    cleanup4: str = ""
    cleanup6: str = ""

    def check(self) -> None:
        if not is_one_bit(self.mark):
            raise ValueError(f"mark {self.mark:#x} is not one bit")
        self.entries()

    def entries(self) -> tuple[list[Entry], list[Entry]]:
        """Return the entries to add and to delete, each checked (ValueError if one is bad)."""
        return ([Entry.of_wire(d) for d in self.add], [Entry.of_wire(d) for d in self.delete])


@dataclass(frozen=True)
class FirewallShim(_TypedOp):
    """Insert (at ``position``) or delete the mark shim in another manager's iptables chain,
    through ``iptables`` (``ip6tables``) itself, or ``iptables-legacy`` beside nf_tables.

    ``rule`` is the text after ``-A CHAIN`` (``domain.fwmark.shim_rule``); a delete names
    the live rule as iptables-save printed it, so it only ever removes one of ours.
    """

    NAME: ClassVar[str] = "firewall.shim"
    family: int
    legacy: bool
    chain: str
    rule: str
    position: int  # 1-based place to insert it; 0: delete it

    def check(self) -> None:
        _ip_version(self.family)
        if self.position < 0:
            raise ValueError(f"position {self.position} is negative")
        if not is_shim(self.rule):
            raise ValueError(f"{self.rule!r} is not a shim rule of ours")


# -- Docker networks -----------------------------------------------------------------------

def _network(spec: dict[str, object], scope: str) -> DockerNetwork:
    """Return the declared network, with the scope label the networks we create carry."""
    net = spec_from_json(spec)
    if scope:
        labels = {**dict(net.labels), SCOPE_LABEL: scope}
        net = dataclasses.replace(net, labels=tuple(sorted(labels.items())))
    return net


@dataclass(frozen=True)
class DockerEnsure(_TypedOp):
    """Create the network ``spec`` (``domain.docker.spec_to_json``) unless it exists."""

    NAME: ClassVar[str] = "docker.ensure"
    spec: dict[str, object] = field(hash=False)
    default_mtu: int | None  # the MTU of Docker's default bridge
    scope: str  # SCOPE_LABEL of the networks we create

    def network(self) -> DockerNetwork:
        return _network(self.spec, self.scope)

    def check(self) -> None:
        self.network()


@dataclass(frozen=True)
class DockerReplace(_TypedOp):
    """Remove network ``id`` and create ``spec`` in its place (reconnecting containers)."""

    NAME: ClassVar[str] = "docker.replace"
    spec: dict[str, object] = field(hash=False)
    default_mtu: int | None
    scope: str
    id: str
    reconnect: bool  # containers are attached: reconnect them to the new network
    adopt: bool

    def network(self) -> DockerNetwork:
        return _network(self.spec, self.scope)

    def check(self) -> None:
        self.network()


@dataclass(frozen=True)
class DockerDedupe(_TypedOp):
    """Remove all but one of the owned networks called ``name``."""

    NAME: ClassVar[str] = "docker.dedupe"
    name: str


@dataclass(frozen=True)
class DockerRemove(_TypedOp):
    """Remove network ``id`` (``name`` is for people); gone already is fine."""

    NAME: ClassVar[str] = "docker.remove"
    id: str
    name: str


@dataclass(frozen=True)
class DockerRestore(_TypedOp):
    """Re-create a network as a checkpoint recorded it, with its containers attached at
    their addresses and aliases (a revert); first remove ``replace_id`` (the network the
    change made in its place, its containers disconnected), if given."""

    NAME: ClassVar[str] = "docker.restore"
    network: dict[str, object] = field(hash=False)  # ``checkpoint.network_to_json``
    replace_id: str = _omit("")

    def point(self) -> NetworkPoint:
        return network_from_json(self.network)

    def check(self) -> None:
        self.point()


# -- conntrack (drivers.netlink.conntrack) ----------------------------------------------------

@dataclass(frozen=True)
class StaleMap:
    """The flows of one port map whose conntrack entries must go (``ConntrackDelete.maps``).

    Those of ``proto`` to ``port`` (on ``host_ip``, else on any local address) whose
    replies do not come from ``keep`` (``address:port``, the map's destination now),
    if it has one.
    """

    proto: str
    port: int
    host_ip: IPAddress | None
    keep: tuple[IPAddress, int] | None

    @classmethod
    def parse(cls, text: str) -> StaleMap:
        """Parse ``PROTO/PORT[@HOST_IP][>ADDRESS:PORT]`` (IPv6 addresses in brackets after
        ``>``)."""
        head, _, keep = text.partition(">")
        spec, _, host_ip = head.partition("@")
        proto, _, port = spec.partition("/")
        if proto not in ("tcp", "udp"):
            raise ValueError(f"{text!r}: protocol {proto!r} is neither tcp nor udp")
        kept: tuple[IPAddress, int] | None = None
        if keep:
            addr, _, to = keep.rpartition(":")
            kept = (ipaddress.ip_address(addr.strip("[]")), _port(to))
        return cls(proto, _port(port), ipaddress.ip_address(host_ip) if host_ip else None, kept)

    def __str__(self) -> str:
        text = f"{self.proto}/{self.port}" + (f"@{self.host_ip}" if self.host_ip else "")
        if self.keep is not None:
            addr, to = self.keep
            text += f">{addr}:{to}" if addr.version == 4 else f">[{addr}]:{to}"
        return text


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return port


@dataclass(frozen=True)
class ConntrackDelete(_TypedOp):
    """Delete the conntrack entries of IP ``family`` that port maps moved or made stale.

    Runs after the firewall transaction of its family, so the next packet of each
    flow meets the new rules. ``maps`` are ``StaleMap`` texts.
    """

    NAME: ClassVar[str] = "conntrack.delete"
    family: int
    maps: tuple[str, ...]

    def stale_maps(self) -> list[StaleMap]:
        return [StaleMap.parse(m) for m in self.maps]

    def check(self) -> None:
        _ip_version(self.family)
        self.stale_maps()


TypedOp = (LinkAddBridge | LinkSet | LinkDelete | LinkSetHairpin | AddrAdd | AddrDel
           | LinkSetMac | NeighReplace | NeighDelete
           | RouteDelDefault | NetnsCreate | NetnsDelete | AllocAttach | AllocConfigure
           | SysctlSet | FirewallNft | FirewallShim | DockerEnsure | DockerReplace
           | DockerDedupe
           | DockerRemove | DockerRestore | ConntrackDelete)

#: every op, by its wire name
OPS: Mapping[str, type[TypedOp]] = {cls.NAME: cls for cls in get_args(TypedOp)}


# -- the wire form -------------------------------------------------------------------------

@dataclass(frozen=True)
class _Field:
    name: str
    type: Any  # the evaluated annotation
    required: bool
    omit: bool
    default: object


def _fields(cls: type[TypedOp]) -> tuple[_Field, ...]:
    hints = get_type_hints(cls)
    return tuple(
        _Field(f.name, hints[f.name], f.default is dataclasses.MISSING,
               bool(f.metadata.get(_OMIT)), f.default)
        for f in dataclasses.fields(cls) if f.name != "key_order")


_FIELDS: Mapping[type[TypedOp], tuple[_Field, ...]] = {cls: _fields(cls) for cls in OPS.values()}
_NAMES: Mapping[type[TypedOp], frozenset[str]] = {
    cls: frozenset(f.name for f in fields) for cls, fields in _FIELDS.items()}


def encode(op: TypedOp) -> Op:
    """Return the wire form of a typed op, as plans carry it."""
    args: dict[str, Json] = {}
    for f in _FIELDS[type(op)]:
        value = getattr(op, f.name)
        if f.omit and value == f.default:
            continue
        args[f.name] = list(value) if isinstance(value, tuple) else value
    if op.key_order:
        ordered = {k: args[k] for k in op.key_order if k in args}
        args = {**ordered, **args}  # a key the order does not name goes last
    return Op(op.NAME, args)


def decode(op: Op) -> TypedOp:
    """Return the typed op of a wire op; ``OpError`` if it is not one we know, or malformed."""
    cls = OPS.get(op.name) if isinstance(op.name, str) else None
    if cls is None:
        raise OpError(f"unknown operation {op.name!r} (plan from a newer version?)")
    if not isinstance(op.args, dict):
        raise OpError(f"{op.name}: arguments must be an object, not {show(op.args)}")
    known = _FIELDS[cls]
    names = _NAMES[cls]
    unknown = [k for k in op.args if k not in names]
    if unknown:
        raise OpError(f"{op.name}: unknown argument{'s' if len(unknown) > 1 else ''} "
                      + ", ".join(repr(k) for k in unknown))
    kwargs: dict[str, Any] = {}
    for f in known:
        if f.name in op.args:
            kwargs[f.name] = _convert(op.name, f, op.args[f.name])
        elif f.required:
            raise OpError(f"{op.name}: missing argument {f.name!r}")
    order = tuple(op.args)
    if order != tuple(f.name for f in known if f.name in op.args):
        kwargs["key_order"] = order
    typed = cls(**kwargs)
    try:
        typed.check()
    except (KeyError, TypeError, ValueError) as exc:
        raise OpError(f"{op.name}: malformed arguments ({type(exc).__name__}: {exc})") from None
    return typed


def _convert(name: str, f: _Field, value: object) -> object:
    try:
        return as_type(f.type, value)
    except Mismatch:
        raise OpError(f"{name}: argument {f.name!r} must be {describe(f.type)}, "
                      f"not {show(value)}") from None
