"""Conntrack entries through ctnetlink (NETLINK_NETFILTER), in-process: dump and delete.

Conntrack remembers where the first packet of a flow was sent: a datagram to a
host port keeps going to the allocation the DNAT rule chose when the flow began,
after the rule has moved to another allocation or gone (UDP has no end, so a
client that keeps its source port is never NATed again). The port-map planner
asks for the stale entries to go (``engine.hostops``, ``ConntrackDelete``); the
probes remove their own entries the same way.

One socket, opened in the network namespace the process is in (entries are per
namespace: a ``--netns`` run has entered its sandbox). A dump is one request per
family; each delete names the entry by its original tuple, zone and id, so an
entry that was replaced meanwhile by a new flow with the same tuple is left alone
(ENOENT: gone already, fine). Parsing is pure (:func:`parse_entry`) and tested on bytes.

See docs/decisions/013-clean-transitions.md.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from reconciler.domain.errors import DriverError
from reconciler.domain.live import LiveFlow
from reconciler.domain.ops import StaleMap
from reconciler.drivers.netlink.messages import ADDR_DUMP
from reconciler.drivers.netlink.parse import parse_addr
from reconciler.drivers.netlink.transport import Socket, netlink_error
from reconciler.drivers.netlink.wire import (
    HDR,
    NETLINK_NETFILTER,
    NFGENMSG,
    RTM_GETADDR,
    NlMsg,
    attr,
    nested,
    parse_attrs,
)

NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_GET = 1
IPCTNL_MSG_CT_DELETE = 2
CT_GET = NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_GET
CT_DELETE = NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_DELETE

BE16 = struct.Struct("!H")
BE32 = struct.Struct("!I")

CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_STATUS, CTA_PROTOINFO = 1, 2, 3, 4
CTA_ID, CTA_ZONE, CTA_FILTER = 12, 18, 25
CTA_FILTER_ORIG_FLAGS, CTA_FILTER_REPLY_FLAGS = 1, 2
#: CTA_FILTER_*_FLAGS bits (the kernel's CTA_FILTER_F_*, since Linux 5.8)
FILTER_IP_SRC, FILTER_PROTO_NUM, FILTER_PROTO_DST_PORT = 1 << 0, 1 << 3, 1 << 5
#: CTA_PROTOINFO > CTA_PROTOINFO_TCP > CTA_PROTOINFO_TCP_STATE (u8)
CTA_PROTOINFO_TCP, CTA_PROTOINFO_TCP_STATE = 1, 1
TCP_CONNTRACK_ESTABLISHED = 3
#: the entry's status bit: a reply was seen
IPS_SEEN_REPLY = 1 << 1
#: at most this many kernel-filtered dumps for one count of flows; more, one dump per
#: protocol, filtered here
FLOW_DUMPS = 16
#: at most this many ports of one protocol get a kernel-filtered dump each; more, one
#: dump of the protocol (a dump walks the whole table in the kernel, ~µs per entry)
PORT_DUMPS = 8
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
#: the ICMP and ICMPv6 "ports": echo id, type, code
CTA_PROTO_ICMP = (4, 5, 6)
CTA_PROTO_ICMPV6 = (7, 8, 9)

#: IP protocol numbers by the names port maps use
PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP}
_FAMILIES = {4: socket.AF_INET, 6: socket.AF_INET6}

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Tuple:
    """One direction of a flow: addresses, protocol number, ports (None for port-less ones);
    ``icmp`` (echo id, type, code) names an ICMP/ICMPv6 flow exactly in a delete (dumps
    leave it None)."""

    src: IPAddress
    dst: IPAddress
    proto: int
    sport: int | None
    dport: int | None
    icmp: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Entry:
    """A conntrack entry: what the first packet was (``orig``) and what replies look like.

    A DNATed flow's ``reply.src`` is where the rule sent it; ``orig.dst`` where the
    client sent it.
    """

    family: int  # 4 or 6
    orig: Tuple
    reply: Tuple
    zone: int
    id: int | None
    status: int
    #: TCP only: the conntrack state (``TCP_CONNTRACK_*``), None when not reported
    tcp_state: int | None = None

    @property
    def established(self) -> bool:
        """A flow that carries traffic: TCP in state ESTABLISHED, anything else answered."""
        if self.orig.proto == socket.IPPROTO_TCP:
            return self.tcp_state == TCP_CONNTRACK_ESTABLISHED
        return bool(self.status & IPS_SEEN_REPLY)


def _tcp_state(buf: bytes | None) -> int | None:
    tcp = parse_attrs(parse_attrs(buf or b"").get(CTA_PROTOINFO_TCP, b""))
    state = tcp.get(CTA_PROTOINFO_TCP_STATE)
    return state[0] if state else None


def _tuple(buf: bytes) -> Tuple | None:
    t = parse_attrs(buf)
    ip, proto = parse_attrs(t.get(CTA_TUPLE_IP, b"")), parse_attrs(t.get(CTA_TUPLE_PROTO, b""))
    if CTA_IP_V4_SRC in ip and CTA_IP_V4_DST in ip:
        src: IPAddress = ipaddress.IPv4Address(ip[CTA_IP_V4_SRC][:4])
        dst: IPAddress = ipaddress.IPv4Address(ip[CTA_IP_V4_DST][:4])
    elif CTA_IP_V6_SRC in ip and CTA_IP_V6_DST in ip:
        src = ipaddress.IPv6Address(ip[CTA_IP_V6_SRC][:16])
        dst = ipaddress.IPv6Address(ip[CTA_IP_V6_DST][:16])
    else:
        return None
    num = proto.get(CTA_PROTO_NUM)
    if not num:
        return None
    sport, dport = proto.get(CTA_PROTO_SRC_PORT), proto.get(CTA_PROTO_DST_PORT)
    return Tuple(src, dst, num[0], BE16.unpack(sport[:2])[0] if sport else None,
                 BE16.unpack(dport[:2])[0] if dport else None)


def parse_entry(raw: bytes) -> Entry | None:
    """Parse one IPCTNL_MSG_CT_NEW message of a dump (nlmsghdr included); None if not an entry."""
    if len(raw) < HDR.size + NFGENMSG.size:
        return None
    length = HDR.unpack_from(raw, 0)[0]
    family = NFGENMSG.unpack_from(raw, HDR.size)[0]
    attrs = parse_attrs(raw, HDR.size + NFGENMSG.size, min(length, len(raw)))
    orig = _tuple(attrs.get(CTA_TUPLE_ORIG, b""))
    reply = _tuple(attrs.get(CTA_TUPLE_REPLY, b""))
    version = {socket.AF_INET: 4, socket.AF_INET6: 6}.get(family)
    if orig is None or reply is None or version is None:
        return None
    zone = attrs.get(CTA_ZONE)
    ident = attrs.get(CTA_ID)
    status = attrs.get(CTA_STATUS)
    return Entry(version, orig, reply, BE16.unpack(zone[:2])[0] if zone else 0,
                 BE32.unpack(ident[:4])[0] if ident else None,
                 BE32.unpack(status[:4])[0] if status else 0,
                 _tcp_state(attrs.get(CTA_PROTOINFO)) if orig.proto == socket.IPPROTO_TCP
                 else None)


def dump_filter(proto: int | None = None, orig_dport: int | None = None,
                orig_src: IPAddress | None = None, reply_src: IPAddress | None = None) -> bytes:
    """Return the ``CTA_FILTER`` attributes of a dump (empty: every entry).

    Original-direction matches (protocol, its destination port, its source address) and
    the reply direction's source address; the kernel ANDs what it is given.
    """
    orig_flags, reply_flags = 0, 0
    body = b""
    orig: list[bytes] = []
    if orig_src is not None:
        orig.append(nested(CTA_TUPLE_IP, attr(CTA_IP_V4_SRC if orig_src.version == 4
                                              else CTA_IP_V6_SRC, orig_src.packed)))
        orig_flags |= FILTER_IP_SRC
    if proto is not None:
        match = attr(CTA_PROTO_NUM, bytes((proto,)))
        orig_flags |= FILTER_PROTO_NUM
        if orig_dport is not None:
            match += attr(CTA_PROTO_DST_PORT, BE16.pack(orig_dport))
            orig_flags |= FILTER_PROTO_DST_PORT
        orig.append(nested(CTA_TUPLE_PROTO, match))
    if orig:
        body += nested(CTA_TUPLE_ORIG, *orig)
    if reply_src is not None:
        body += nested(CTA_TUPLE_REPLY, nested(CTA_TUPLE_IP, attr(
            CTA_IP_V4_SRC if reply_src.version == 4 else CTA_IP_V6_SRC, reply_src.packed)))
        reply_flags |= FILTER_IP_SRC
    if not (orig_flags or reply_flags):
        return b""
    flags = attr(CTA_FILTER_ORIG_FLAGS, struct.pack("=I", orig_flags))
    if reply_flags:
        flags += attr(CTA_FILTER_REPLY_FLAGS, struct.pack("=I", reply_flags))
    return body + nested(CTA_FILTER, flags)


def _tuple_attr(kind: int, t: Tuple) -> bytes:
    v4 = t.src.version == 4
    ip = nested(CTA_TUPLE_IP,
                attr(CTA_IP_V4_SRC if v4 else CTA_IP_V6_SRC, t.src.packed),
                attr(CTA_IP_V4_DST if v4 else CTA_IP_V6_DST, t.dst.packed))
    proto = attr(CTA_PROTO_NUM, bytes((t.proto,)))
    if t.sport is not None:
        proto += attr(CTA_PROTO_SRC_PORT, BE16.pack(t.sport))
    if t.dport is not None:
        proto += attr(CTA_PROTO_DST_PORT, BE16.pack(t.dport))
    if t.icmp is not None:
        ident, kind_, code = CTA_PROTO_ICMP if t.proto == socket.IPPROTO_ICMP else CTA_PROTO_ICMPV6
        proto += (attr(ident, BE16.pack(t.icmp[0])) + attr(kind_, bytes((t.icmp[1],)))
                  + attr(code, bytes((t.icmp[2],))))
    return nested(kind, ip, nested(CTA_TUPLE_PROTO, proto))


def delete_request(entry: Entry) -> bytes:
    """Return the body of the IPCTNL_MSG_CT_DELETE that removes exactly ``entry``."""
    body = NFGENMSG.pack(_FAMILIES[entry.family], 0, 0) + _tuple_attr(CTA_TUPLE_ORIG, entry.orig)
    if entry.zone:
        body += attr(CTA_ZONE, BE16.pack(entry.zone))
    if entry.id is not None:
        body += attr(CTA_ID, BE32.pack(entry.id))
    return body


def delete_orig_request(orig: Tuple) -> bytes:
    """Return the body of the IPCTNL_MSG_CT_DELETE of the entry whose original tuple is ``orig``
    (zone 0, any id): for flows we made ourselves and know exactly."""
    family = _FAMILIES[orig.src.version]
    return NFGENMSG.pack(family, 0, 0) + _tuple_attr(CTA_TUPLE_ORIG, orig)


class Conntrack:
    """The conntrack table of the current network namespace."""

    def __init__(self) -> None:
        try:
            self._sock = Socket(NETLINK_NETFILTER)
        except OSError as e:
            raise DriverError(f"conntrack: cannot open a netfilter netlink socket: "
                              f"{e.strerror or e}") from None
        self._route: Socket | None = None  # rtnetlink, for the local addresses

    def close(self) -> None:
        self._sock.close()
        if self._route is not None:
            self._route.close()

    def dump(self, family: int, *, proto: str | None = None,
             orig_dport: int | None = None, orig_src: IPAddress | None = None,
             reply_src: IPAddress | None = None) -> list[Entry]:
        """Dump the entries of IP ``family`` (4 or 6), optionally of one protocol (and original
        destination port), or from one original source or reply source address.

        The kernel filters them (``CTA_FILTER``): parsing every entry of a busy table
        costs ~40 µs each here. A kernel that does not know the filter sends all;
        the same filter applies here too.
        """
        num = PROTOCOLS[proto] if proto is not None else None
        body = NFGENMSG.pack(_FAMILIES[family], 0, 0) + dump_filter(
            num, orig_dport, orig_src, reply_src)
        raw = self._sock.dump(CT_GET, body, f"conntrack: list IPv{family} entries")
        out = []
        for msg in raw:
            e = parse_entry(msg)
            if e is None or e.family != family:
                continue
            if ((num is None or e.orig.proto == num)
                    and (orig_dport is None or e.orig.dport == orig_dport)
                    and (orig_src is None or e.orig.src == orig_src)
                    and (reply_src is None or e.reply.src == reply_src)):
                out.append(e)
        return out

    def flows(self, family: int, addresses: Iterable[IPAddress],
              ports: Iterable[tuple[str, int]]) -> list[Entry]:
        """Return the TCP and UDP entries of ``family`` that one of ``addresses`` started or
        answers, or that go to one of the (protocol, original destination port) ``ports``;
        each once.

        Kernel-filtered dumps: two per address (original source, reply source: an entry
        DNATed to an allocation is answered by it), one per port; past ``FLOW_DUMPS`` of
        them, one dump per protocol filtered here (each dump walks the whole table in the
        kernel anyway).
        """
        wanted = sorted({a for a in addresses if a.version == family}, key=str)
        by_port = sorted(set(ports))
        keep: Callable[[Entry], bool]
        if 2 * len(wanted) + len(by_port) > FLOW_DUMPS:
            found = [e for p in sorted(PROTOCOLS) for e in self.dump(family, proto=p)]
            addrs, port_set = set(wanted), set(by_port)
            names = {v: k for k, v in PROTOCOLS.items()}

            def keep(e: Entry) -> bool:
                return (e.orig.src in addrs or e.reply.src in addrs
                        or (names.get(e.orig.proto, ""), e.orig.dport or 0) in port_set)
        else:
            found = [e for a in wanted for e in (*self.dump(family, orig_src=a),
                                                 *self.dump(family, reply_src=a))]
            found += [e for p, port in by_port for e in self.dump(family, proto=p,
                                                                  orig_dport=port)]

            def keep(e: Entry) -> bool:
                return e.orig.proto in PROTOCOLS.values()
        seen: dict[tuple[Tuple, int, int | None], Entry] = {}
        for e in found:
            if keep(e):
                seen.setdefault((e.orig, e.zone, e.id), e)
        return list(seen.values())

    def delete(self, entry: Entry) -> bool:
        """Delete one entry; False if it is gone already (expired, or replaced meanwhile)."""
        try:
            self._sock.request(CT_DELETE, 0, delete_request(entry),
                               f"conntrack: delete {describe(entry)}")
        except DriverError as e:
            if e.errno == errno.ENOENT:
                return False
            raise
        return True

    def delete_flows(self, origs: Iterable[Tuple]) -> int:
        """Delete the entries with exactly these original tuples (the probes' own flows);
        entries already gone are fine. Returns how many went."""
        codes = self._sock.request_many(CT_DELETE, 0, (delete_orig_request(o) for o in origs))
        bad = next((c for c in codes if c not in (0, errno.ENOENT)), None)
        if bad is not None:
            raise netlink_error(bad, "conntrack: delete a flow")
        return codes.count(0)

    def delete_matching(self, family: int, predicate: Callable[[Entry], bool], *,
                        protos: Iterable[str] | None = None,
                        ports: Iterable[tuple[str, int]] | None = None) -> list[Entry]:
        """Delete the entries of ``family`` that ``predicate`` picks, among those of
        ``protos`` or of (protocol, original destination port) ``ports``, or all."""
        dumps: list[tuple[str | None, int | None]] = [(None, None)]
        if ports is not None:
            wanted = sorted(set(ports))
            by_proto = {p for p, _ in wanted}
            dumps = [(p, None) for p in sorted(by_proto)
                     if sum(1 for q, _ in wanted if q == p) > PORT_DUMPS]
            dumps += [(p, port) for p, port in wanted if (p, None) not in dumps]
        elif protos is not None:
            dumps = [(p, None) for p in sorted(set(protos))]
        deleted = []
        for proto, port in dumps:
            for e in self.dump(family, proto=proto, orig_dport=port):
                if predicate(e) and self.delete(e):
                    deleted.append(e)
        return deleted

    def local_addresses(self) -> frozenset[IPAddress]:
        """Return the addresses of this namespace's links: what ``--dst-type LOCAL`` matches."""
        if self._route is None:
            self._route = Socket()
        msgs = self._route.dump(RTM_GETADDR, ADDR_DUMP, "conntrack: dump local addresses")
        return frozenset(parsed[1].address.ip for raw in msgs
                         if (parsed := parse_addr(NlMsg.decode(raw))) is not None)

    def delete_port_flows(self, family: int, maps: Sequence[StaleMap]) -> list[Entry]:
        """Delete the entries of flows to the host ports of ``maps`` their rules no longer
        send where conntrack does (:func:`stale_for`): a filtered dump per port (or per
        protocol, for many ports)."""
        local = self.local_addresses()
        return self.delete_matching(family, lambda e: any(stale_for(m, e, local) for m in maps),
                                    ports={(m.proto, m.port) for m in maps})


def stale_for(m: StaleMap, e: Entry, local: frozenset[IPAddress]) -> bool:
    """Tell whether entry ``e`` is a flow to map ``m``'s host port that its rule no longer sends
    there.

    Only flows to this host's own addresses (what the DNAT rules match: ``--dst-type
    LOCAL``; loopback included): a forwarded flow to a remote port of the same number
    (masqueraded containers, a service address DNATed by someone else) is none of ours.
    """
    dst = e.orig.dst
    if PROTOCOLS[m.proto] != e.orig.proto or e.orig.dport != m.port:
        return False
    to_map = dst == m.host_ip if m.host_ip is not None else (dst in local or dst.is_loopback)
    if not to_map:
        return False
    nated = (e.reply.src, e.reply.sport) != (dst, e.orig.dport)
    if e.orig.proto == socket.IPPROTO_TCP and not nated:
        # a TCP flow no DNAT of ours rewrote (a host service's, from before any map):
        # deleted, its next packet would be picked up as new and meet the map's DNAT
        return False
    return m.keep is None or (e.reply.src, e.reply.sport) != m.keep


def describe(entry: Entry) -> str:
    """Return ``udp 10.0.0.2:40000 -> 10.0.0.1:5353 (replies from 10.78.0.10:53)`` for logs."""
    name = {v: k for k, v in PROTOCOLS.items()}.get(entry.orig.proto, str(entry.orig.proto))

    def end(ip: IPAddress, port: int | None) -> str:
        host = str(ip) if ip.version == 4 else f"[{ip}]"
        return host if port is None else f"{host}:{port}"

    return (f"{name} {end(entry.orig.src, entry.orig.sport)} -> "
            f"{end(entry.orig.dst, entry.orig.dport)} "
            f"(replies from {end(entry.reply.src, entry.reply.sport)})")


def live_flow(entry: Entry) -> LiveFlow | None:
    """Return the domain value of a TCP or UDP entry (None for other protocols)."""
    names = {v: k for k, v in PROTOCOLS.items()}
    proto = names.get(entry.orig.proto)
    if proto is None:
        return None
    o, r = entry.orig, entry.reply
    return LiveFlow(entry.family, proto, str(o.src), o.sport or 0, str(o.dst), o.dport or 0,
                    str(r.src), r.sport or 0, entry.established)
