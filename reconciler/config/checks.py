"""Checks across resources that a schema cannot express: references, overlaps, clashes."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from typing import Any

from reconciler.config.build import Collector, defined_at
from reconciler.config.document import format_path
from reconciler.domain.errors import ConfigError

MAX_BRIDGE_PORTS = 1023  # the kernel's BR_MAX_PORTS (1024) less port number 0


def cross_checks(c: Collector) -> Iterator[ConfigError]:
    """Check resources against each other: references, overlaps, address and port clashes."""

    def err(kind: str, name: str, field: str, message: str) -> ConfigError:
        d = c.seen[(kind, name)]
        path = (*d.path, field)
        pos = d.doc.where(path)
        return ConfigError(message, file=d.doc.file, line=pos.line, col=pos.col,
                           key=format_path(path))

    for s in c.subnets.values():
        if s.bridge not in c.bridges:
            yield err("subnet", s.name, "bridge",
                      f"subnet {s.name!r}: bridge {s.bridge!r} is not declared")
    # overlapping prefixes: among subnets, and against docker networks' declared subnets
    # (``auto`` prefixes are picked at plan time, clear of everything else: not checked here)
    prefixes: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str, str, str]] = []
    for s in c.subnets.values():
        if s.auto is None:
            prefixes.append((s.cidr, "subnet", s.name, "cidr"))
        if s.auto6 is None and s.cidr6 is not None:
            prefixes.append((s.cidr6, "subnet", s.name, "cidr6"))
    for d in c.docker.values():
        if d.subnet is not None:
            prefixes.append((d.subnet, "docker network", d.name, "subnet"))
        if d.subnet6 is not None:
            prefixes.append((d.subnet6, "docker network", d.name, "subnet6"))
    ordered = sorted(prefixes, key=lambda p: (p[0].version, int(p[0].network_address)))
    for i, (net, kind, name, field) in enumerate(ordered):
        for onet, okind, oname, ofield in ordered[i + 1:]:
            if onet.version != net.version or \
                    int(onet.network_address) > int(net.broadcast_address):
                break
            yield err(okind, oname, ofield,
                      f"{okind} {oname!r}: {ofield} {onet} overlaps {kind} {name!r} {field} "
                      f"{net} at {defined_at(c, kind, name)}")
    # a Linux bridge takes at most 1023 ports ("Exchange full" at the 1024th veth)
    per_bridge: dict[str, list[str]] = {}
    for a in c.allocs.values():
        sn = c.subnets.get(a.subnet)
        if sn is not None:
            per_bridge.setdefault(sn.bridge, []).append(a.id)
    for bridge_name, ids in sorted(per_bridge.items()):
        if len(ids) > MAX_BRIDGE_PORTS and ("bridge", bridge_name) in c.seen:
            yield err("bridge", bridge_name, "name",
                      f"bridge {bridge_name!r}: {len(ids)} allocations, but a Linux bridge takes "
                      f"at most {MAX_BRIDGE_PORTS} ports; spread them over more bridges")
    # allocations: references, addresses, ports
    addresses: dict[ipaddress.IPv4Address | ipaddress.IPv6Address, str] = {}
    ports: dict[tuple[str, int], list[tuple[Any, str, int]]] = {}
    for a in c.allocs.values():
        sn = c.subnets.get(a.subnet)
        if sn is None:
            yield err("alloc", a.id, "subnet",
                      f"alloc {a.id!r}: subnet {a.subnet!r} is not declared")
            continue
        for field, given, auto in (("address", a.address, sn.auto),
                                   ("address6", a.address6, sn.auto6)):
            if given is not None and auto is not None:
                yield err("alloc", a.id, field,
                          f"alloc {a.id!r}: a fixed {field} needs a fixed prefix, but subnet "
                          f"{sn.name!r} has {'cidr' if field == 'address' else 'cidr6'}: auto "
                          "(leave it out: addresses are allocated and kept stable)")
        if sn.auto is not None or sn.auto6 is not None:
            pass  # the prefixes are picked at plan time: nothing to compare addresses with
        elif a.address is not None:
            if a.address not in sn.cidr or a.address in (sn.cidr.network_address,
                                                         sn.cidr.broadcast_address):
                yield err("alloc", a.id, "address",
                          f"alloc {a.id!r}: address {a.address} is not a host address of "
                          f"subnet {sn.name!r} ({sn.cidr})")
            elif a.address == sn.gateway:
                yield err("alloc", a.id, "address",
                          f"alloc {a.id!r}: address {a.address} is the gateway of "
                          f"subnet {sn.name!r}")
        if a.address6 is not None and sn.auto6 is None and sn.auto is None:
            if sn.cidr6 is None:
                yield err("alloc", a.id, "address6",
                          f"alloc {a.id!r}: address6 given but subnet {sn.name!r} has no cidr6")
            elif a.address6 not in sn.cidr6 or a.address6 in (sn.cidr6.network_address,
                                                             sn.gateway6):
                yield err("alloc", a.id, "address6",
                          f"alloc {a.id!r}: address6 {a.address6} is not a free host address "
                          f"of subnet {sn.name!r} ({sn.cidr6})")
        for addr, field in ((a.address, "address"), (a.address6, "address6")):
            if addr is None:
                continue
            if addr in addresses:
                holder = addresses[addr]
                yield err("alloc", a.id, field,
                          f"alloc {a.id!r}: {field} {addr} is already given to alloc {holder!r} "
                          f"at {defined_at(c, 'alloc', holder)}")
            else:
                addresses[addr] = a.id
        for i, p in enumerate(a.ports):
            if p.host_ip is not None and p.host_ip.version == 6 and sn.prefix6 is None:
                here = c.seen[("alloc", a.id)]
                pos = here.doc.where((*here.path, "ports", i, "host_ip"))
                yield ConfigError(f"alloc {a.id!r}: host_ip {p.host_ip} is IPv6 but subnet "
                                  f"{sn.name!r} has no cidr6", file=here.doc.file,
                                  line=pos.line, col=pos.col)
            inside = _declared_prefix_of(c, p.host_ip) if p.host_ip is not None else None
            if inside is not None:
                here = c.seen[("alloc", a.id)]
                pos = here.doc.where((*here.path, "ports", i, "host_ip"))
                kind, name, field, net = inside
                yield ConfigError(f"alloc {a.id!r}: host_ip {p.host_ip} is inside {kind} "
                                  f"{name!r} ({field} {net}, at {defined_at(c, kind, name)}): "
                                  "a port map publishes an address of the host, not one of a "
                                  "declared subnet", file=here.doc.file, line=pos.line,
                                  col=pos.col)
            if p.host is None:
                continue
            for proto in p.protocols:
                for (other_ip, other_id, other_i) in ports.get((proto, p.host), []):
                    if p.host_ip is None or other_ip is None or p.host_ip == other_ip:
                        here = c.seen[("alloc", a.id)]
                        pos = here.doc.where((*here.path, "ports", i))
                        yield ConfigError(
                            f"alloc {a.id!r}: host port {p.host}/{proto} is already mapped by "
                            f"alloc {other_id!r} (ports[{other_i}]) at "
                            f"{defined_at(c, 'alloc', other_id)}",
                            file=here.doc.file, line=pos.line, col=pos.col)
                        break
                ports.setdefault((proto, p.host), []).append((p.host_ip, a.id, i))



def _declared_prefix_of(c: Collector, ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
                        ) -> tuple[str, str, str, ipaddress.IPv4Network | ipaddress.IPv6Network] \
        | None:
    """Return the declared (fixed) subnet prefix holding ``ip``: (kind, name, field, prefix), or
    None.

    Its gateway is an address of the host, but DNAT on it would catch the subnet's own
    traffic to the gateway; every other address in it is an allocation's.
    """
    for s in c.subnets.values():
        for field, net in (("cidr", s.prefix), ("cidr6", s.prefix6)):
            if isinstance(net, ipaddress.IPv4Network | ipaddress.IPv6Network) and ip in net:
                return ("subnet", s.name, field, net)
    return None
