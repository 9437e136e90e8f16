"""Schema-valid documents → model values, with the checks of one value at a time."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from reconciler.config.document import Document, Path, clip, format_path
from reconciler.domain.errors import ConfigError, ConfigErrors
from reconciler.domain.model import (
    AddrRange,
    Alloc,
    AllocId,
    AutoPrefix,
    Bridge,
    BridgeName,
    DockerNetwork,
    DockerNetworkName,
    PortMap,
    Settings,
    Source,
    Subnet,
    SubnetName,
)
from reconciler.domain.ownership import reserved_link_name, reserved_netns_name

#: names /proc/sys/net/*/conf uses for itself: a link with these names would be ambiguous
RESERVED_IFNAMES = frozenset({"all", "default", ".", ".."})


_PREFIX_EXAMPLE = {4: "an IPv4 prefix like 172.26.64.0/20", 6: "an IPv6 prefix like fd00:a:b::/64"}


_OTHER_FIELDS = {4: "cidr6/subnet6 for IPv6", 6: "cidr/subnet for IPv4"}


def _prefix(doc: Document, path: Path, text: str,
            version: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise doc.error(path, f"{format_path(path)}: {clip(repr(text), 60)} is not "
                              f"{_PREFIX_EXAMPLE[version]}") from None
    if net.version != version:
        other = (f"pool{'6' if version == 4 else ''} for IPv{net.version}"
                 if path and str(path[-1]).startswith("pool") else _OTHER_FIELDS[version])
        raise doc.error(path, f"{format_path(path)}: {text} is IPv{net.version}; use {other}")
    if ipaddress.ip_interface(text).ip != net.network_address:
        raise doc.error(path, f"{format_path(path)}: {text} has host bits set; "
                              f"did you mean {net}?")
    return net


def _net4(doc: Document, path: Path, text: str) -> ipaddress.IPv4Network:
    net = _prefix(doc, path, text, 4)
    assert isinstance(net, ipaddress.IPv4Network)
    return net


def _net6(doc: Document, path: Path, text: str) -> ipaddress.IPv6Network:
    net = _prefix(doc, path, text, 6)
    assert isinstance(net, ipaddress.IPv6Network)
    return net


def _ip(doc: Document, path: Path, text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise doc.error(path, f"{format_path(path)}: {clip(repr(text), 60)} "
                              "is not an IP address") from None


@dataclass
class _Defined:
    doc: Document
    path: Path

    @property
    def source(self) -> Source:
        return self.doc.source(self.path)


class Collector:
    """Accumulates resources across files, with duplicate-identity detection."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []
        self.seen: dict[tuple[str, str], _Defined] = {}
        self.bridges: dict[BridgeName, Bridge] = {}
        self.subnets: dict[SubnetName, Subnet] = {}
        self.allocs: dict[AllocId, Alloc] = {}
        self.docker: dict[DockerNetworkName, DockerNetwork] = {}
        self.settings: Settings | None = None
        self.settings_at: _Defined | None = None

    def claim(self, kind: str, name: str, doc: Document, path: Path) -> bool:
        here = _Defined(doc, path)
        first = self.seen.get((kind, name))
        if first is not None:
            self.errors.append(doc.error(path, f"{kind} {name!r} is defined twice: at "
                                               f"{first.source} and {here.source}"))
            return False
        self.seen[(kind, name)] = here
        return True

    def guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except ConfigErrors as exc:
            self.errors.extend(exc.errors)
        except ConfigError as exc:
            self.errors.append(exc)


def _bridge(c: Collector, doc: Document, path: Path, raw: dict[str, Any]) -> None:
    name = raw["name"]
    if name in RESERVED_IFNAMES:
        raise doc.error((*path, "name"), f"{format_path((*path, 'name'))}: {name!r} is reserved "
                                         "by the kernel's /proc/sys/net and cannot name a link")
    if name.startswith("-"):
        raise doc.error((*path, "name"), f"{format_path((*path, 'name'))}: {name!r} starts with "
                                         "'-' and would read as an option to ip or iptables")
    reserved = reserved_link_name(name)
    if reserved is not None:
        raise doc.error((*path, "name"), f"{format_path((*path, 'name'))}: {name!r} is in a "
                                         f"pattern the reconciler reserves: {reserved}")
    if c.claim("bridge", name, doc, path):
        c.bridges[BridgeName(name)] = Bridge(BridgeName(name), raw.get("mtu"),
                                             raw.get("hairpin", True), doc.source(path))


AUTO = "auto"


_POOL_EXAMPLE = {4: "10.200.0.0/16", 6: "fd00:200::/48"}


_MAX_SIZE = {4: 30, 6: 126}


def _auto(doc: Document, path: Path, raw: dict[str, Any], key: str, pool_key: str,
          size_key: str, version: int) -> AutoPrefix | None:
    """Parse ``KEY: auto`` with its pool and size; None for a fixed prefix (which takes neither)."""
    if raw.get(key) != AUTO:
        extra = next((k for k in (pool_key, size_key) if k in raw), None)
        if extra is not None:
            what = f"{key} is {raw[key]}" if key in raw else f"there is no {key}"
            raise doc.error((*path, extra), f"{format_path((*path, extra))}: only used with "
                                            f"{key}: auto ({what})", key=True)
        return None
    if pool_key not in raw:
        raise doc.error((*path, key), f"{format_path((*path, key))}: auto needs {pool_key}, the "
                                      f"prefix to pick from (e.g. {pool_key}: "
                                      f"{_POOL_EXAMPLE[version]})")
    pool = _prefix(doc, (*path, pool_key), raw[pool_key], version)
    size = int(raw.get(size_key, 24 if version == 4 else 64))
    if size < pool.prefixlen:
        where = (*path, size_key) if size_key in raw else (*path, pool_key)
        raise doc.error(where, f"{format_path(where)}: a /{size} does not fit in {pool_key} "
                               f"{pool}; use {size_key}: {pool.prefixlen} or more")
    if size > _MAX_SIZE[version]:
        raise doc.error((*path, size_key), f"{format_path((*path, size_key))}: /{size} is too "
                                           f"small; use /{_MAX_SIZE[version]} or larger")
    return AutoPrefix(pool, size)


def _needs_fixed(doc: Document, path: Path, raw: dict[str, Any], key: str,
                 prefix_key: str) -> None:
    if key in raw:
        raise doc.error((*path, key), f"{format_path((*path, key))}: needs a fixed {prefix_key} "
                                      f"(with {prefix_key}: auto the prefix is only known at "
                                      "plan time; the gateway is its first host address)")


def _subnet(c: Collector, doc: Document, path: Path, raw: dict[str, Any]) -> None:
    name = raw["name"]
    auto = _auto(doc, path, raw, "cidr", "pool", "size", 4)
    auto6 = _auto(doc, path, raw, "cidr6", "pool6", "size6", 6)
    prefix: ipaddress.IPv4Network | AutoPrefix
    prefix6: ipaddress.IPv6Network | AutoPrefix | None = auto6
    gateway = gateway6 = None
    rng = None
    if auto is not None:
        _needs_fixed(doc, path, raw, "gateway", "cidr")
        _needs_fixed(doc, path, raw, "range", "cidr")
        prefix = auto
    else:
        cidr = _net4(doc, (*path, "cidr"), raw["cidr"])
        if cidr.prefixlen > 30:
            raise doc.error((*path, "cidr"), f"{format_path((*path, 'cidr'))}: /{cidr.prefixlen} "
                            "leaves no room for a gateway and allocations; use /30 or larger")
        prefix = cidr
        first = ipaddress.IPv4Address(cidr.network_address + 1)
        if "gateway" in raw:
            gw = _ip(doc, (*path, "gateway"), raw["gateway"])
            if not isinstance(gw, ipaddress.IPv4Address) or gw not in cidr or gw in (
                    cidr.network_address, cidr.broadcast_address):
                raise doc.error((*path, "gateway"), f"{format_path((*path, 'gateway'))}: {gw} "
                                                    f"is not a host address of {cidr}")
            gateway = gw
        if "range" in raw:
            rp = (*path, "range")
            start = _ip(doc, (*rp, "start"), raw["range"]["start"])
            end = _ip(doc, (*rp, "end"), raw["range"]["end"])
            for label, ip in (("start", start), ("end", end)):
                if not isinstance(ip, ipaddress.IPv4Address) or ip not in cidr or ip in (
                        cidr.network_address, cidr.broadcast_address):
                    raise doc.error((*rp, label), f"{format_path((*rp, label))}: {ip} is not a "
                                                  f"host address of {cidr}")
            assert isinstance(start, ipaddress.IPv4Address)
            assert isinstance(end, ipaddress.IPv4Address)
            if start > end:
                raise doc.error(rp, f"{format_path(rp)}: start {start} is after end {end}")
            if start == end == (gateway or first):
                raise doc.error(rp, f"{format_path(rp)}: holds only the gateway "
                                    f"{gateway or first}")
            rng = AddrRange(start, end)
    if auto6 is not None:
        _needs_fixed(doc, path, raw, "gateway6", "cidr6")
    elif "cidr6" in raw:
        cidr6 = _net6(doc, (*path, "cidr6"), raw["cidr6"])
        if cidr6.prefixlen > 126:
            raise doc.error((*path, "cidr6"), f"{format_path((*path, 'cidr6'))}: /{cidr6.prefixlen}"
                            " is too small; use /126 or larger")
        prefix6 = cidr6
        if "gateway6" in raw:
            gw6 = _ip(doc, (*path, "gateway6"), raw["gateway6"])
            if not isinstance(gw6, ipaddress.IPv6Address) or gw6 not in cidr6 or \
                    gw6 == cidr6.network_address:
                raise doc.error((*path, "gateway6"), f"{format_path((*path, 'gateway6'))}: "
                                                     f"{gw6} is not a host address of {cidr6}")
            gateway6 = gw6
    elif "gateway6" in raw:
        raise doc.error((*path, "gateway6"), f"{format_path((*path, 'gateway6'))}: needs cidr6")
    if c.claim("subnet", name, doc, path):
        c.subnets[SubnetName(name)] = Subnet(
            SubnetName(name), BridgeName(raw["bridge"]), prefix, gateway, prefix6, gateway6, rng,
            raw.get("masquerade", True), raw.get("isolation", "ports"), doc.source(path))


def _host_ip(doc: Document, path: Path,
             text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """Return a port map's host address; the unspecified address means every address (None)."""
    if "%" in text:
        raise doc.error(path, f"{format_path(path)}: {clip(repr(text), 60)}: zone ids are not "
                              "supported; give a global or loopback address")
    ip = _ip(doc, path, text)
    if ip.is_unspecified:
        return None
    if ip.is_multicast or ip.is_link_local:
        raise doc.error(path, f"{format_path(path)}: {ip} is a multicast or link-local address; "
                              "a port map needs an address of this host")
    if ip == ipaddress.IPv4Address("255.255.255.255"):
        raise doc.error(path, f"{format_path(path)}: {ip} is the broadcast address; a port map "
                              "needs an address of this host")
    if ip.version == 6 and ip.is_loopback:
        raise doc.error(path, f"{format_path(path)}: {ip}: IPv6 loopback cannot be forwarded to "
                              "an allocation (Linux has no route_localnet for IPv6); use "
                              "127.0.0.1")
    return ip


def _alloc(c: Collector, doc: Document, path: Path, raw: dict[str, Any]) -> None:
    aid = raw["id"]
    reserved = reserved_netns_name(aid)
    if reserved is not None:
        raise doc.error((*path, "id"), f"{format_path((*path, 'id'))}: {aid!r} is in a "
                                       f"pattern the reconciler reserves: {reserved}")
    address = address6 = None
    if "address" in raw:
        a = _ip(doc, (*path, "address"), raw["address"])
        if not isinstance(a, ipaddress.IPv4Address):
            raise doc.error((*path, "address"), f"{format_path((*path, 'address'))}: must be IPv4")
        address = a
    if "address6" in raw:
        a6 = _ip(doc, (*path, "address6"), raw["address6"])
        if not isinstance(a6, ipaddress.IPv6Address):
            raise doc.error((*path, "address6"), f"{format_path((*path, 'address6'))}: "
                                                 "must be IPv6")
        address6 = a6
    ports: list[PortMap] = []
    for i, p in enumerate(raw.get("ports", [])):
        pp = (*path, "ports", i)
        host_ip = _host_ip(doc, (*pp, "host_ip"), p["host_ip"]) if "host_ip" in p else None
        ports.append(PortMap(None if p["host"] == "auto" else int(p["host"]), int(p["to"]),
                             p.get("protocol", "tcp"), host_ip, bool(p.get("probe", True))))
    if c.claim("alloc", aid, doc, path):
        c.allocs[AllocId(aid)] = Alloc(AllocId(aid), SubnetName(raw["subnet"]), address,
                                       address6, tuple(ports), doc.source(path))


def _docker(c: Collector, doc: Document, path: Path, raw: dict[str, Any]) -> None:
    name = raw["name"]
    if name in ("bridge", "host", "none"):
        raise doc.error((*path, "name"), f"{format_path((*path, 'name'))}: {name!r} is one of "
                                         "Docker's own networks and cannot be managed")
    auto = _auto(doc, path, raw, "subnet", "pool", "size", 4)
    auto6 = _auto(doc, path, raw, "subnet6", "pool6", "size6", 6)
    subnet = _net4(doc, (*path, "subnet"), raw["subnet"]) \
        if "subnet" in raw and auto is None else None
    subnet6 = _net6(doc, (*path, "subnet6"), raw["subnet6"]) \
        if "subnet6" in raw and auto6 is None else None
    # the compiled schema check fills in defaults (ipv6: false): only an ipv6 the file
    # itself spells out can contradict subnet6
    ipv6 = raw.get("ipv6") if (*path, "ipv6") in doc.keys else None
    if "subnet6" in raw and ipv6 is False:
        raise doc.error((*path, "ipv6"), f"{format_path((*path, 'ipv6'))}: is false but subnet6 "
                                         "is given")
    labels = raw.get("labels", {})
    reserved = sorted(k for k in labels if k.startswith("io.reconciler."))
    if reserved:
        raise doc.error((*path, "labels", reserved[0]),
                        f"{format_path((*path, 'labels'))}: {reserved[0]!r}: labels under "
                        "'io.reconciler.' are the reconciler's own (ownership, scope)",
                        key=True)
    if c.claim("docker network", name, doc, path):
        c.docker[DockerNetworkName(name)] = DockerNetwork(
            DockerNetworkName(name), bool(ipv6) or "subnet6" in raw, subnet, subnet6,
            raw.get("mtu"), raw.get("masquerade", True), raw.get("internal", False),
            tuple(sorted(labels.items())), doc.source(path), auto, auto6,
            raw.get("replace", "refused") == "allowed")


def read_settings(c: Collector, doc: Document, raw: dict[str, Any]) -> None:
    here = _Defined(doc, ("settings",))
    if c.settings_at is not None:
        raise doc.error(("settings",), f"settings are defined twice: at {c.settings_at.source} "
                                       f"and {here.source}")
    c.settings_at = here
    rng = raw.get("auto_port_range")
    port_range = Settings().auto_port_range
    if rng is not None:
        if rng["start"] > rng["end"]:
            raise doc.error(("settings", "auto_port_range"),
                            "settings.auto_port_range: start is after end")
        port_range = (rng["start"], rng["end"])
    c.settings = Settings(auto_port_range=port_range)


SECTIONS = (("bridges", _bridge), ("subnets", _subnet), ("allocs", _alloc),
             ("docker_networks", _docker))


def defined_at(state: Collector, kind: str, name: str) -> Source:
    return state.seen[(kind, name)].source

