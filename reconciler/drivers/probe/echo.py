"""ICMP (and ICMPv6) echo: the gateway probes from inside an allocation."""

from __future__ import annotations

import socket
import struct

from reconciler.drivers.probe.capture import SO_TIMESTAMPNS

ICMP_ECHO, ICMP_ECHOREPLY = 8, 0
ICMP6_ECHO, ICMP6_ECHOREPLY = 128, 129
IP_MTU_DISCOVER, IP_PMTUDISC_DO = 10, 2
IPV6_DONTFRAG = 62


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return int(~total & 0xFFFF)


def echo_request(family: int, ident: int, seq: int, size: int = 0) -> bytes:
    """Build an ICMP (or ICMPv6) echo request with ``size`` bytes of payload."""
    payload = b"reconciler-probe"[:size].ljust(size, b"\0") if size else b""
    if family == 4:
        head = struct.pack("!BBHHH", ICMP_ECHO, 0, 0, ident, seq)
        return struct.pack("!BBHHH", ICMP_ECHO, 0, _checksum(head + payload), ident,
                           seq) + payload
    # the kernel fills in the ICMPv6 checksum (it covers the pseudo-header)
    return struct.pack("!BBHHH", ICMP6_ECHO, 0, 0, ident, seq) + payload


def parse_echo_reply(family: int, data: bytes) -> tuple[int, int] | None:
    """Parse (id, seq) of an echo reply (IPv4 raw sockets deliver the IP header too), or None."""
    if family == 4:
        if len(data) < 20:
            return None
        data = data[(data[0] & 0xF) * 4:]
        want = ICMP_ECHOREPLY
    else:
        want = ICMP6_ECHOREPLY
    if len(data) < 8 or data[0] != want:
        return None
    ident, seq = struct.unpack_from("!HH", data, 4)
    return ident, seq


def open_icmp(family: int) -> socket.socket:
    """Open a raw echo socket that never fragments (DF): a full-size echo finds a smaller MTU."""
    s = socket.socket(socket.AF_INET if family == 4 else socket.AF_INET6, socket.SOCK_RAW,
                      socket.IPPROTO_ICMP if family == 4 else socket.IPPROTO_ICMPV6)
    try:
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)  # replies timed by the kernel
        if family == 4:
            s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        else:
            s.setsockopt(socket.IPPROTO_IPV6, IPV6_DONTFRAG, 1)
    except OSError:
        s.close()
        raise
    return s


def echo_payload(family: int, size: int) -> int:
    """Return the payload bytes of an echo whose IP packet is ``size`` bytes long."""
    return max(0, size - (20 if family == 4 else 40) - 8)
