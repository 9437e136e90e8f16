"""The probes' capture: one ``AF_PACKET`` socket behind a classic BPF filter.

It passes only TCP/UDP leaving a link from the reserved source ports
(``domain.probes.PROBE_PORTS``), stamped by the kernel; ``parse_l4`` reads the
ports of what it caught. One capture for all allocations, not one per ``eth0``:
closing an ``AF_PACKET`` socket waits for an RCU grace period
(``synchronize_net``, ~12 ms here), which made a capture per allocation cost
2.5 s at 200 allocations.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import struct
from collections.abc import Sequence

from reconciler.domain.probes import PROBE_PORTS

ETH_P_ALL = 0x0003
SO_ATTACH_FILTER = 26
PACKET_OUTGOING = 4

# opcodes (linux/filter.h)
_LD_ABS, _LDB_ABS, _LDH_ABS, _LDH_IND, _LDXB_MSH = 0x20, 0x30, 0x28, 0x48, 0xB1
_SKF_AD_PKTTYPE = (-0x1000 + 4) & 0xFFFFFFFF  # SKF_AD_OFF + SKF_AD_PKTTYPE
_RSH_K, _JA, _JEQ_K, _JGE_K, _JGT_K, _JSET_K, _RET_K = 0x74, 0x05, 0x15, 0x35, 0x25, 0x45, 0x06

#: (label, opcode, k, jump if true, jump if false); jumps name labels, None: the next one
_Insn = tuple[str | None, int, int, str | None, str | None]


def _assemble(prog: Sequence[_Insn]) -> bytes:
    """Assemble classic BPF from labelled instructions (jump offsets count from the next one)."""
    at = {label: i for i, (label, *_rest) in enumerate(prog) if label}
    out = b""
    for i, (_label, code, k, jt, jf) in enumerate(prog):
        t = at[jt] - i - 1 if jt else 0
        f = at[jf] - i - 1 if jf else 0
        if code == _JA:
            k, t = t, 0
        out += struct.pack("HBBI", code, t, f, k)
    return out


def capture_filter(lo: int = PROBE_PORTS[0], hi: int = PROBE_PORTS[1]) -> bytes:
    """Build a filter that passes IPv4/IPv6 TCP and UDP leaving a link from source ports lo..hi.

    The socket is ``SOCK_DGRAM``: offset 0 is the IP header. IPv4 fragments after
    the first carry no ports and are dropped; IPv6 is matched without extension
    headers (the probes send none). It keeps the capture's queue to the probes'
    packets whatever else the host's links carry.
    """
    return _assemble((
        (None, _LD_ABS, _SKF_AD_PKTTYPE, None, None),                      # leaving a link
        (None, _JEQ_K, PACKET_OUTGOING, None, "drop"),
        (None, _LDB_ABS, 0, None, None), (None, _RSH_K, 4, None, None),   # A = IP version
        (None, _JEQ_K, 4, "v4", None), (None, _JEQ_K, 6, "v6", "drop"),
        ("v4", _LDB_ABS, 9, None, None),                                   # protocol
        (None, _JEQ_K, 6, "v4port", None), (None, _JEQ_K, 17, "v4port", "drop"),
        ("v4port", _LDH_ABS, 6, None, None), (None, _JSET_K, 0x1FFF, "drop", None),
        (None, _LDXB_MSH, 0, None, None), (None, _LDH_IND, 0, None, None),  # A = source port
        (None, _JA, 0, "check", None),
        ("v6", _LDB_ABS, 6, None, None),                                   # next header
        (None, _JEQ_K, 6, "v6port", None), (None, _JEQ_K, 17, "v6port", "drop"),
        ("v6port", _LDH_ABS, 40, None, None),
        ("check", _JGE_K, lo, None, "drop"), (None, _JGT_K, hi, "drop", None),
        (None, _RET_K, 0xFFFF, None, None),
        ("drop", _RET_K, 0, None, None),
    ))


_FILTER = capture_filter()
_FILTER_BUF = ctypes.create_string_buffer(_FILTER)
_FPROG = struct.pack("HL", len(_FILTER) // 8, ctypes.addressof(_FILTER_BUF))


#: the capture's receive buffer: every probe's packet is queued twice (it leaves the bridge
#: and the allocation's veth) and a run sends thousands at once
CAPTURE_BUFFER = 32 << 20
SO_RCVBUFFORCE = 33
#: the kernel stamps each captured packet with when it passed the link (SCM_TIMESTAMPNS,
#: wall time): a probe's latency is then the kernel's, not when our loop got round to it
SO_TIMESTAMPNS = SCM_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("qq")
#: room for one timestamp in a ``recvmsg`` (the capture's and the echo sockets')
CMSG_ROOM = socket.CMSG_SPACE(_TIMESPEC.size)
SOL_PACKET, PACKET_STATISTICS = 263, 6


def open_capture() -> socket.socket:
    """Open the capture of every link of the namespace the calling thread is in (filter first).

    Created bound to all links (``ETH_P_ALL``), so what arrived before the filter was
    attached is drained here.
    """
    s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, _FPROG)
        s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        s.setblocking(False)
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, CAPTURE_BUFFER)
        with contextlib.suppress(BlockingIOError):
            while True:
                s.recv(1)
    except OSError:
        s.close()
        raise
    return s


def capture_stamp(ancdata: Sequence[tuple[int, int, bytes]]) -> float | None:
    """Return the SCM_TIMESTAMPNS of a received packet (wall-clock seconds), or None."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS and \
                len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            return float(sec + nsec / 1e9)
    return None


def capture_drops(s: socket.socket) -> int:
    """Count the packets the capture lost for want of buffer since the last call
    (PACKET_STATISTICS)."""
    try:
        _packets, drops = struct.unpack("II", s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    except OSError:
        return 0
    return int(drops)


def parse_l4(data: bytes) -> tuple[int, str, int, str, int, int] | None:
    """Parse (family, src, sport, dst, dport, ip proto) of an IP packet with TCP/UDP, or None."""
    if len(data) < 1:
        return None
    version = data[0] >> 4
    if version == 4 and len(data) >= 20:
        ihl = (data[0] & 0xF) * 4
        if len(data) < ihl + 4:
            return None
        sport, dport = struct.unpack_from("!HH", data, ihl)
        return (4, socket.inet_ntop(socket.AF_INET, data[12:16]), sport,
                socket.inet_ntop(socket.AF_INET, data[16:20]), dport, data[9])
    if version == 6 and len(data) >= 44:
        sport, dport = struct.unpack_from("!HH", data, 40)
        return (6, socket.inet_ntop(socket.AF_INET6, data[8:24]), sport,
                socket.inet_ntop(socket.AF_INET6, data[24:40]), dport, data[6])
    return None

