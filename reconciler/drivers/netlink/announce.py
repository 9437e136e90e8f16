"""Announcing an allocation's addresses from inside its namespace: gratuitous ARP and
unsolicited neighbour advertisements.

Whoever cached the old MAC of an address (the bridge's neighbour entry, the
gateway's ARP cache of a client on the segment) learns the new one at once
instead of after its entry times out (tens of seconds): a gratuitous ARP
request (sender = target = the address, broadcast; RFC 5227's announcement)
updates an existing ARP entry even where ``arp_accept`` is off, and an
unsolicited NA with the override flag (RFC 4861 7.2.6) an existing neighbour
entry. Besides, ``arp_notify`` and ``ndisc_notify`` are turned on for the
allocation's interface, so the kernel announces again on its own when the link
changes address or is told to notify peers.

The sockets must be made inside the namespace (a socket belongs to the
namespace of its creator) and are used once; :class:`Announcer` is made where
the caller already is inside (creating the namespace, or entering it anyway).
Neither socket receives: the packet socket is bound with protocol 0, the
ICMPv6 socket is closed right after sending.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
from collections.abc import Sequence
from typing import Self

ETH_P_ARP = 0x0806
ETH_P_IP = 0x0800
ARPHRD_ETHER = 1
ARPOP_REQUEST = 1
ND_NEIGHBOR_ADVERT = 136
ND_OPT_TARGET_LL_ADDR = 2
NA_FLAG_OVERRIDE = 0x20000000
BROADCAST = b"\xff" * 6
ALL_NODES = "ff02::1"

IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address
IPInterface = ipaddress.IPv4Interface | ipaddress.IPv6Interface

_ARP = struct.Struct("!HHBBH6s4s6s4s")  # htype ptype hlen plen op sha spa tha tpa
_NA = struct.Struct("!BBHI16sBB6s")  # type code cksum flags target; option type len lladdr


def enable_notify(ifname: str) -> None:
    """``arp_notify`` and ``ndisc_notify`` on for ``ifname`` (``default``: for links made
    later) of the namespace the calling thread is in (``/proc/sys/net`` is per namespace
    of whoever opens it). Missing files (no IPv6 here) are skipped."""
    for key in (f"ipv4/conf/{ifname}/arp_notify", f"ipv6/conf/{ifname}/ndisc_notify"):
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(f"/proc/sys/net/{key}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)


def arp_announcement(mac: bytes, ip: ipaddress.IPv4Address) -> bytes:
    """A broadcast ARP request for ``ip`` from ``ip`` (gratuitous), Ethernet header included."""
    arp = _ARP.pack(ARPHRD_ETHER, ETH_P_IP, 6, 4, ARPOP_REQUEST, mac, ip.packed,
                    b"\0" * 6, ip.packed)
    return BROADCAST + mac + struct.pack("!H", ETH_P_ARP) + arp


def neighbour_advert(mac: bytes, ip: ipaddress.IPv6Address) -> bytes:
    """An unsolicited NA for ``ip`` (override, target link-layer address option); the kernel
    computes the checksum of raw ICMPv6 sockets."""
    return _NA.pack(ND_NEIGHBOR_ADVERT, 0, 0, NA_FLAG_OVERRIDE, ip.packed,
                    ND_OPT_TARGET_LL_ADDR, 1, mac)


class Announcer:
    """The two sockets of one announcement, made in the namespace the thread is in."""

    def __init__(self) -> None:
        self._packet: socket.socket | None = socket.socket(socket.AF_PACKET, socket.SOCK_RAW,
                                                           0)
        self._icmp6: socket.socket | None = None
        if os.path.isdir("/proc/sys/net/ipv6"):
            try:
                self._icmp6 = socket.socket(socket.AF_INET6, socket.SOCK_RAW,
                                            socket.IPPROTO_ICMPV6)
            except OSError:
                self._packet.close()
                raise

    def close(self) -> None:
        for sock in (self._packet, self._icmp6):
            if sock is not None:
                sock.close()
        self._packet = self._icmp6 = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def announce(self, ifname: str, index: int, addrs: Sequence[IPInterface]) -> None:
        """One gratuitous ARP per IPv4 address, one unsolicited NA per IPv6 address, from
        ``ifname`` (up, the addresses on it). Raises OSError."""
        assert self._packet is not None, "announcer used after close"
        self._packet.bind((ifname, 0))
        mac = self._packet.getsockname()[4]  # eth0's address as the kernel has it
        configured = False
        for iface in addrs:
            if isinstance(iface.ip, ipaddress.IPv4Address):
                self._packet.send(arp_announcement(mac, iface.ip))
            elif self._icmp6 is not None:
                if not configured:
                    self._icmp6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
                    configured = True
                # the source address and the link of each NA (IPV6_PKTINFO): eth0 has no
                # link-local address, the NA comes from the address it announces
                info = iface.ip.packed + struct.pack("=I", index)
                self._icmp6.sendmsg([neighbour_advert(mac, iface.ip)],
                                    [(socket.IPPROTO_IPV6, socket.IPV6_PKTINFO, info)],
                                    0, (ALL_NODES, 0, 0, index))
