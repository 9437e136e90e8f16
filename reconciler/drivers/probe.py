"""Probe sockets: send every probe at once and watch for each one's arrival (SPEC §7).

One selector loop, no thread per probe. Every socket is opened first: one
``AF_PACKET`` capture in the host behind a classic BPF filter that passes only
TCP/UDP leaving a link from the reserved source ports
(``domain.probes.PROBE_PORTS``); for each allocation the calling thread enters
its namespace once (``netns.enter``) and makes there a raw ICMP/ICMPv6 socket
for the gateway echoes and the hairpin clients; then the host's clients (and the
external vantage's). Then all are sent (TCP connects, UDP datagrams, echoes), and
the loop polls until each probe has its answer or the timeout.

"Reached" is what the capture saw, never what the sender was told: a reset or
an ICMP error from a REJECT rule on the way looks to the sender just like the
allocation's own reset, and a UDP datagram gets no answer either way. A probe
reached when its packet — protocol, source port, the map's container port —
left the host through the allocation's veth, which hands it to ``eth0`` inside:
nothing of the host's can drop it after that point. One capture for all, not
one per ``eth0``: closing an ``AF_PACKET`` socket waits for an RCU grace period
(``synchronize_net``, ~12 ms here), which made a capture per allocation cost
2.5 s at 200 allocations.

Nothing is left behind: TCP sockets close with ``SO_LINGER`` 0 (a reset, no
TIME_WAIT), and each outcome names the conntrack entry its probe made in the
namespace we act on (``Outcome.flow``, its exact original tuple), which
``engine.probes`` deletes through the conntrack driver
(``drivers/netlink/conntrack.Conntrack.delete_flows``). Runs larger than the
file descriptors left under ``RLIMIT_NOFILE`` go in batches.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import json
import os
import resource
import secrets
import selectors
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reconciler.domain.errors import DriverError
from reconciler.domain.ownership import PROBE_VANTAGE_ALIAS, alloc_veth_name
from reconciler.domain.probes import (
    PROBE_PORTS,
    VANTAGE6_HOST,
    VANTAGE6_PEER,
    VANTAGE_HOST,
    VANTAGE_NET,
    VANTAGE_NET6,
    VANTAGE_PEER,
    ProbeSpec,
)
from reconciler.drivers import netns

ETH_P_ALL = 0x0003
SO_ATTACH_FILTER = 26
PACKET_OUTGOING = 4
ICMP_ECHO, ICMP_ECHOREPLY = 8, 0
ICMP6_ECHO, ICMP6_ECHOREPLY = 128, 129
IP_MTU_DISCOVER, IP_PMTUDISC_DO = 10, 2
IPV6_DONTFRAG = 62
#: after a UDP probe arrived, how long its socket stays open for the allocation's answer:
#: an answer that finds its conntrack entry deleted would make a new one
UDP_GRACE = 0.1
#: how long a probe that must NOT arrive ("direct" under isolation: ports) is watched for,
#: from its own send, once every probe that must arrive has concluded: at least this, and
#: at least NOT_REACHED_FACTOR times the slowest arrival of the run (a packet the rules let
#: through would take the same path as the external probes to the same allocations). The
#: arrivals are timed by the kernel's capture stamps: timed by when our loop read them, the
#: first probes of a burst of thousands looked as slow as the whole burst took to send, and
#: the margin grew with the number of allocations (0.7 s of a 1.5 s pass at N=500). Waiting
#: out the whole timeout instead cost a second per run whatever the number of allocations.
NOT_REACHED_MARGIN = 0.25
NOT_REACHED_FACTOR = 3.0


@dataclass
class Outcome:
    """What one probe saw. ``reached``: the packet arrived where it had to (the capture in
    the allocation's namespace, or the gateway's echo reply); ``answer``: what the sender
    was told (``connected``, ``refused``, ``timeout``, an errno's words), for the cause."""

    reached: bool = False
    answer: str | None = None
    ms: float = 0.0
    error: str | None = None  # the probe could not be sent (namespace gone, bind failed)
    #: the full-size echo with DF (``ProbeSpec.size``) came back; None: none was sent
    big: bool | None = None
    #: the conntrack entry it made in the namespace we act on, for the caller to delete
    flow: Flow | None = None


@dataclass
class _Probe:
    spec: ProbeSpec
    index: int
    outcome: Outcome = field(default_factory=Outcome)
    sock: socket.socket | None = None
    sport: int = 0
    ident: int = 0  # ICMP echo id
    sent: float = 0.0  # time.monotonic() of the send
    sent_wall: float = 0.0  # time.time() of the send: the capture's timestamps are wall time
    noticed: float = 0.0  # time.monotonic() when we read its arrival
    captured: bool = False
    answered: bool = False  # the sender's side is finished (connect done, echo or error)
    done: bool = False


# ------------------------------------------------------------------ classic BPF

# opcodes (linux/filter.h)
_LD_ABS, _LDB_ABS, _LDH_ABS, _LDH_IND, _LDXB_MSH = 0x20, 0x30, 0x28, 0x48, 0xB1
_SKF_AD_PKTTYPE = (-0x1000 + 4) & 0xFFFFFFFF  # SKF_AD_OFF + SKF_AD_PKTTYPE
_RSH_K, _JA, _JEQ_K, _JGE_K, _JGT_K, _JSET_K, _RET_K = 0x74, 0x05, 0x15, 0x35, 0x25, 0x45, 0x06

#: (label, opcode, k, jump if true, jump if false); jumps name labels, None: the next one
_Insn = tuple[str | None, int, int, str | None, str | None]


def _assemble(prog: Sequence[_Insn]) -> bytes:
    """Classic BPF from labelled instructions (jump offsets count from the next one)."""
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
    """A filter that passes IPv4/IPv6 TCP and UDP leaving a link from source ports lo..hi.

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
_CMSG_ROOM = socket.CMSG_SPACE(_TIMESPEC.size)
SOL_PACKET, PACKET_STATISTICS = 263, 6


def open_capture() -> socket.socket:
    """The capture of every link of the namespace the calling thread is in (filter first).

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
    """The SCM_TIMESTAMPNS of a received packet (wall-clock seconds), or None."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS and \
                len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            return float(sec + nsec / 1e9)
    return None


def capture_drops(s: socket.socket) -> int:
    """Packets the capture lost for want of buffer since the last call (PACKET_STATISTICS)."""
    try:
        _packets, drops = struct.unpack("II", s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    except OSError:
        return 0
    return int(drops)


def parse_l4(data: bytes) -> tuple[int, str, int, str, int, int] | None:
    """(family, src, sport, dst, dport, ip proto) of an IP packet with TCP/UDP, or None."""
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


# ------------------------------------------------------------------ ICMP echo


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return int(~total & 0xFFFF)


def echo_request(family: int, ident: int, seq: int, size: int = 0) -> bytes:
    """An ICMP (or ICMPv6) echo request with ``size`` bytes of payload."""
    payload = b"reconciler-probe"[:size].ljust(size, b"\0") if size else b""
    if family == 4:
        head = struct.pack("!BBHHH", ICMP_ECHO, 0, 0, ident, seq)
        return struct.pack("!BBHHH", ICMP_ECHO, 0, _checksum(head + payload), ident,
                           seq) + payload
    # the kernel fills in the ICMPv6 checksum (it covers the pseudo-header)
    return struct.pack("!BBHHH", ICMP6_ECHO, 0, 0, ident, seq) + payload


def parse_echo_reply(family: int, data: bytes) -> tuple[int, int] | None:
    """(id, seq) of an echo reply (IPv4 raw sockets deliver the IP header too), or None."""
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
    """A raw echo socket that never fragments (DF): a full-size echo finds a smaller MTU."""
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
    """Payload bytes of an echo whose IP packet is ``size`` bytes long."""
    return max(0, size - (20 if family == 4 else 40) - 8)


# ------------------------------------------------------------------ the flows the probes make

_TCP, _UDP, _ICMP, _ICMPV6 = 6, 17, 1, 58


@dataclass(frozen=True)
class Flow:
    """The original tuple of the conntrack entry a probe made in the namespace we act on:
    for TCP/UDP ``a``/``b`` are the source and destination ports, for an echo the ICMP id
    and type (code 0). Reported, not deleted here: the engine deletes them through the
    conntrack driver (drivers do not use each other)."""

    proto: int
    src: str
    dst: str
    a: int
    b: int


# ------------------------------------------------------------------ the run


def _errno_words(code: int) -> str:
    return {errno.ECONNREFUSED: "refused", errno.EHOSTUNREACH: "host unreachable",
            errno.ENETUNREACH: "network unreachable", errno.ETIMEDOUT: "timeout",
            errno.EACCES: "refused by a local rule (EACCES)",
            errno.EPERM: "refused by a local rule (EPERM)"}.get(code, os.strerror(code))


#: what the capture tells a probe's arrival by, apart from its source port: the allocation's
#: veth, the family, the IP protocol and the map's container port
_Dest = tuple[str, int, int, int]


class _Ports:
    """Source ports of the reserved range in turn, never one twice towards one destination.

    A run of more probes than the range holds (3000+ at 500 allocations with 2 maps) uses
    ports again. Two probes of one map (veth, family, protocol, container port) on the same
    port would be the same arrival to the capture, and the hairpin and localhost ones, both
    masqueraded to the gateway, would make one conntrack reply tuple: the kernel moves the
    later one to another source port, which the capture does not know. So a port is
    reused only towards another destination (at most a handful of probes share one). A
    port somebody else has bound is skipped by the caller (``_client``).
    """

    def __init__(self) -> None:
        self.lo, self.hi = PROBE_PORTS
        # a random start: two runs at once (verify beside the agent) rarely share a 4-tuple
        self.next = self.lo + secrets.randbelow(self.hi - self.lo + 1)
        self.used: dict[_Dest, set[int]] = {}

    def take(self, dest: _Dest) -> int:
        used = self.used.setdefault(dest, set())
        for _ in range(self.hi - self.lo + 1):
            port = self.next
            self.next = port + 1 if port < self.hi else self.lo
            if port not in used:
                used.add(port)
                return port
        raise OSError(errno.EADDRINUSE, "no free probe source port")


def _dest(spec: ProbeSpec) -> _Dest:
    return (alloc_veth_name(spec.alloc), spec.family, _TCP if spec.proto == "tcp" else _UDP,
            spec.to or 0)


def _client(spec: ProbeSpec, ports: _Ports) -> tuple[socket.socket, int]:
    """A client socket bound to a reserved source port (in the calling thread's namespace),
    one no other probe of the run towards the same destination (``_dest``) has."""
    fam = socket.AF_INET if spec.family == 4 else socket.AF_INET6
    kind = socket.SOCK_STREAM if spec.proto == "tcp" else socket.SOCK_DGRAM
    last: OSError | None = None
    for _ in range(16):
        s = socket.socket(fam, kind)
        try:
            s.setblocking(False)
            # same source port to other destinations at once: a 4-tuple is still unique
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if fam == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if kind == socket.SOCK_STREAM:
                # close = reset: no TIME_WAIT left by a probe
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            port = ports.take(_dest(spec))
            s.bind(("0.0.0.0" if fam == socket.AF_INET else "::", port))
            return s, port
        except OSError as e:
            s.close()
            if e.errno != errno.EADDRINUSE:
                raise
            last = e
    raise OSError(last.errno if last else errno.EADDRINUSE, "no free probe source port")


class ProbeRun:
    """One concurrent run of probes; use :func:`run` (it always closes what it opened)."""

    def __init__(self, specs: Sequence[ProbeSpec], *, external_ns: str | None = None) -> None:
        self.probes = [_Probe(s, i) for i, s in enumerate(specs)]
        self.external_ns = external_ns
        self.sel = selectors.DefaultSelector()
        self.sockets: list[socket.socket] = []
        self.ports = _Ports()
        self.ident = (os.getpid() ^ int(time.monotonic() * 1000)) & 0xFFFF
        #: the probes the capture decides, by (veth, family, ip proto, sport, dport)
        self.watch: dict[tuple[str, int, int, int, int], _Probe] = {}
        self.echo: dict[tuple[str, int, int], _Probe] = {}  # (alloc, family, seq)
        self.capture: socket.socket | None = None
        self.pending = len(self.probes)
        #: probes that must arrive and have not concluded yet; the slowest arrival (s)
        self.expected = sum(1 for p in self.probes if p.spec.expect)
        self.slowest = 0.0
        self.grace: list[_Probe] = []  # UDP probes that arrived, held open for an answer
        self.drops = 0

    # -- opening

    def _keep(self, s: socket.socket, data: tuple[object, ...] | None = None) -> None:
        self.sockets.append(s)
        if data is not None:
            self.sel.register(s, selectors.EVENT_READ, data)

    def open(self) -> None:
        if any(p.spec.proto != "icmp" for p in self.probes):
            try:
                self.capture = open_capture()
            except OSError as e:  # without it nothing can be seen arriving: say so
                for p in self.probes:
                    if p.spec.proto != "icmp":
                        self._fail(p, f"cannot watch for the probes' packets: {e}")
            else:
                self._keep(self.capture, ("capture",))
        inside: dict[str, list[_Probe]] = {}
        for p in self.probes:
            if p.spec.vantage == "alloc":
                inside.setdefault(p.spec.alloc, []).append(p)
        for alloc, probes in inside.items():
            try:
                with netns.enter(alloc):
                    self._open_alloc(alloc, probes)
            except (DriverError, OSError) as e:
                for p in probes:
                    self._fail(p, f"cannot probe from inside the allocation: {e}")
        outside = [p for p in self.probes if p.spec.vantage == "external"]
        if outside and self.external_ns is None:
            for p in outside:
                self._fail(p, "no external vantage namespace")
        elif outside:
            assert self.external_ns is not None
            try:
                with netns.enter(self.external_ns):
                    for p in outside:
                        self._open_client(p)
            except (DriverError, OSError) as e:
                for p in outside:
                    self._fail(p, f"external vantage namespace: {e}")
        for p in self.probes:
            if p.spec.vantage == "host":
                self._open_client(p)

    def _open_alloc(self, alloc: str, probes: list[_Probe]) -> None:
        icmp: dict[int, socket.socket] = {}
        for p in probes:
            if p.spec.proto != "icmp":
                self._open_client(p)
                continue
            if p.spec.family not in icmp:
                icmp[p.spec.family] = s = open_icmp(p.spec.family)
                self._keep(s, ("icmp", alloc, p.spec.family, s))
            p.sock = icmp[p.spec.family]
            self.echo[(alloc, p.spec.family, (2 * p.index) & 0xFFFF)] = p
            if p.spec.size:
                self.echo[(alloc, p.spec.family, (2 * p.index + 1) & 0xFFFF)] = p

    def _open_client(self, p: _Probe) -> None:
        if p.done:
            return
        try:
            s, p.sport = _client(p.spec, self.ports)
        except OSError as e:
            self._fail(p, f"cannot open the probe's socket: {e.strerror or e}")
            return
        p.sock = s
        self._keep(s)
        veth, family, proto, to = _dest(p.spec)
        self.watch[(veth, family, proto, p.sport, to)] = p

    def _fail(self, p: _Probe, error: str) -> None:
        if not p.done:
            p.outcome.error = error
            self._finish(p)

    def _finish(self, p: _Probe) -> None:
        if not p.done:
            p.done = True
            self.pending -= 1
            if p.spec.expect:
                self.expected -= 1

    # -- sending

    def send(self) -> None:
        # the probes that must NOT arrive first: each is watched for a margin from its own
        # send (``loop``), which has then mostly passed while the others are sent and answer
        for p in sorted(self.probes, key=lambda q: q.spec.expect):
            if p.done or p.sock is None:
                continue
            spec = p.spec
            p.sent = time.monotonic()
            p.sent_wall = time.time()
            try:
                if spec.proto == "icmp":
                    p.sock.sendto(echo_request(spec.family, self.ident, (2 * p.index) & 0xFFFF),
                                  (spec.dst, 0))
                    if spec.size:
                        p.outcome.big = False
                        # a send error of the full-size echo is its loss (a black hole the
                        # kernel already knows of), not the probe's answer
                        with contextlib.suppress(OSError):
                            p.sock.sendto(echo_request(spec.family, self.ident,
                                                       (2 * p.index + 1) & 0xFFFF,
                                                       echo_payload(spec.family, spec.size)),
                                          (spec.dst, 0))
                elif spec.proto == "tcp":
                    code = p.sock.connect_ex((spec.dst, spec.dport or 0))
                    if code not in (0, errno.EINPROGRESS):
                        self._answer(p, _errno_words(code))
                        continue
                    self.sel.register(p.sock, selectors.EVENT_WRITE, ("tcp", p))
                else:
                    p.sock.connect((spec.dst, spec.dport or 0))
                    p.sock.send(b"reconciler-probe\n")
                    self.sel.register(p.sock, selectors.EVENT_READ, ("udp", p))
            except OSError as e:
                self._answer(p, _errno_words(e.errno) if e.errno else str(e))
            finally:
                with contextlib.suppress(OSError):  # also when sending failed half-way
                    p.outcome.flow = self._flow(p)

    def _flow(self, p: _Probe) -> Flow | None:
        spec = p.spec
        if spec.proto == "icmp":
            if spec.src is None:
                return None
            return Flow(_ICMP if spec.family == 4 else _ICMPV6, spec.src, spec.dst, self.ident,
                        ICMP_ECHO if spec.family == 4 else ICMP6_ECHO)
        assert p.sock is not None
        src, sport = p.sock.getsockname()[:2]
        return Flow(_TCP if spec.proto == "tcp" else _UDP, src, spec.dst, sport,
                    spec.dport or 0)

    # -- the loop

    def _answer(self, p: _Probe, answer: str) -> None:
        """The sender is finished (connected, refused, an answer or an ICMP error)."""
        if p.answered or p.done:
            return
        p.answered = True
        p.outcome.answer = answer
        if not p.captured:
            # if the packet arrived, the capture has it queued by now: read it first
            self._drain()
        if not p.captured or p.spec.proto != "icmp":
            self._finish(p)

    def _arrived(self, p: _Probe, stamp: float | None = None) -> None:
        """``stamp``: the kernel's wall-clock time of the packet (the capture's), if any."""
        if p.captured:
            return
        p.captured = p.outcome.reached = True
        p.noticed = time.monotonic()
        took = p.noticed - p.sent
        if stamp is not None and p.sent_wall:
            # the kernel's latency; a wall clock that stepped meanwhile cannot make it
            # longer than what we saw, nor negative
            took = min(took, max(0.0, stamp - p.sent_wall))
        p.outcome.ms = took * 1000
        self.slowest = max(self.slowest, took)
        if (p.spec.proto == "icmp" and p.outcome.big is not False) or p.answered:
            self._finish(p)
        elif p.spec.proto == "udp":
            self.grace.append(p)
        # TCP: done once the connect finishes (a clean close), or at the timeout

    def _drain(self) -> None:
        if self.capture is None:
            return
        while True:
            try:
                data, ancdata, _flags, addr = self.capture.recvmsg(128, _CMSG_ROOM)
            except OSError:  # BlockingIOError: nothing more queued
                return
            parsed = parse_l4(data)
            if parsed is None:
                continue
            family, _src, sport, _dst, dport, proto = parsed
            p = self.watch.get((addr[0], family, proto, sport, dport))
            if p is not None and not p.done:
                self._arrived(p, capture_stamp(ancdata))

    def _echo(self, alloc: str, family: int, s: socket.socket) -> None:
        while True:
            try:
                raw, ancdata, _flags, _addr = s.recvmsg(2048, _CMSG_ROOM)
            except OSError:
                return
            reply = parse_echo_reply(family, raw)
            if reply is None or reply[0] != self.ident:
                continue
            p = self.echo.get((alloc, family, reply[1]))
            if p is None or p.done:
                continue
            if reply[1] & 1:
                p.outcome.big = True
                if p.captured:
                    self._finish(p)
            else:
                p.outcome.answer = "echo reply"
                self._arrived(p, capture_stamp(ancdata))

    def _event(self, data: tuple[Any, ...]) -> None:
        kind = data[0]
        if kind == "capture":
            self._drain()
        elif kind == "icmp":
            self._echo(data[1], data[2], data[3])
        elif kind == "tcp":
            p = data[1]
            self.sel.unregister(p.sock)
            code = p.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            self._answer(p, "connected" if code == 0 else _errno_words(code))
        else:  # udp: an answer, or an ICMP error the kernel turned into one
            p = data[1]
            try:
                p.sock.recv(512)
                answer = "answered"
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                answer = _errno_words(e.errno) if e.errno else str(e)
            self.sel.unregister(p.sock)
            self._answer(p, answer)

    def loop(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        negatives_only = self.expected == 0  # nothing to measure a margin by: the timeout
        while self.pending > 0:
            now = time.monotonic()
            if self.expected == 0 and not negatives_only:
                # only probes that must not arrive are left: watch them for a margin
                # after the last arrival instead of the whole timeout
                negatives_only = True
                margin = max(NOT_REACHED_MARGIN, NOT_REACHED_FACTOR * self.slowest)
                deadline = min(deadline, max((p.sent + margin for p in self.probes
                                              if not p.done and p.sent), default=now))
            if self.grace:
                held = [p for p in self.grace if not p.done]
                for p in held:
                    if now >= p.noticed + UDP_GRACE:
                        self._finish(p)
                self.grace = [p for p in held if not p.done]
            if self.pending <= 0 or now >= deadline:
                break
            wait = deadline - now
            if self.grace:
                wait = min(wait, UDP_GRACE / 4)
            for key, _ in self.sel.select(timeout=wait):
                self._event(key.data)
        self._drain()  # what arrived in the last moment still counts
        if self.capture is not None:
            self.drops = capture_drops(self.capture)
        now = time.monotonic()
        for p in self.probes:
            if p.outcome.error is None and p.outcome.answer is None:
                p.outcome.answer = "no answer" if p.captured else "timeout"
            if not p.outcome.reached and p.outcome.error is None and p.sent:
                p.outcome.ms = (now - p.sent) * 1000

    # -- closing

    def close(self) -> None:
        self.sel.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()
        self.sockets.clear()


# ------------------------------------------------------------------ diagnosis (failures only)

def save_counters(family: int, *, legacy: bool = False) -> str | None:
    """``iptables-save -c`` (``ip6tables-save -c``): every rule with its counters, or None.

    Only around a failed probe's re-run: which foreign rule's counter rose says which
    rule dropped it. The same tools as the iptables driver, read-only. ``legacy``: the
    iptables-legacy tables instead (``iptables-legacy-save -c``).
    """
    cmd = ("iptables" if family == 4 else "ip6tables") + ("-legacy" if legacy else "") + "-save"
    try:
        p = subprocess.run([cmd, "-c"], capture_output=True, text=True, timeout=30,
                           errors="surrogateescape", check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def netstat_counter(name: str, text: str | None = None) -> int:
    """A ``TcpExt``/``IpExt`` counter of this namespace's /proc/net/netstat (0 if absent)."""
    if text is None:
        try:
            with open("/proc/thread-self/net/netstat", encoding="ascii") as fh:
                text = fh.read()
        except OSError:
            return 0
    lines = text.splitlines()
    for head, values in zip(lines[::2], lines[1::2], strict=False):
        names, nums = head.split()[1:], values.split()[1:]
        if name in names and len(nums) == len(names):
            return int(nums[names.index(name)])
    return 0


# ------------------------------------------------------------------ the external vantage


def _ip(*args: str, batch: str) -> None:
    try:
        p = subprocess.run(["ip", *args, "-batch", "-"], input=batch, capture_output=True,
                           text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DriverError(f"probe vantage: ip: {e}") from None
    if p.returncode != 0:
        line = (p.stderr.strip().splitlines() or ["failed"])[-1]
        raise DriverError(f"probe vantage: ip {' '.join(args)}: {line}")


#: the vantage link's MACs (locally administered, fixed): both ends know each other without
#: ARP, which strict rp_filter on the host would also refuse to answer (arp_process checks the
#: sender's route) — the probe then shows the rp_filter drop, not a neighbour that never came
VANTAGE_HOST_MAC, VANTAGE_PEER_MAC = "02:72:63:70:00:01", "02:72:63:70:00:02"


def _mark_lo() -> None:
    """Inside the new vantage namespace, before it is mounted: ``lo`` carries the mark, so a
    namespace of that name is provably ours (or provably not) from outside."""
    _ip(batch=f'link set lo alias "{PROBE_VANTAGE_ALIAS}"\nlink set lo up\n')


def create_vantage(ns: str, link: str) -> None:
    """The external vantage: namespace ``ns`` joined to this one by the veth ``link``.

    The host end has ``VANTAGE_HOST``/30, the namespace's ``eth0`` ``VANTAGE_PEER``/30
    and a default route through the host, so its connections arrive the way another
    host's do (PREROUTING, FORWARD); the same in IPv6 with the /126 ``VANTAGE_NET6``
    (``_add_ipv6``). Neither end makes addresses of its own (``addrgenmode none``: no
    link-local address, so no DAD or router solicitation), the pair is ``nodad``
    (usable at once) and the neighbours are permanent entries: apart from the probes,
    only the kernel's MLD reports (from ``::``, for the pair's solicited-node groups)
    cross the link. Made with ``ip -batch`` runs: it is opt-in and
    made once per host, where the netlink driver has no veth without a bridge (its veths
    are made attached, as an allocation's, and this driver may not call it). The caller
    holds the vantage's lock exclusively and removed what was there (``remove_vantage``);
    a namespace of that name that is still there is not ours and is refused, never
    replaced. ``lo`` inside carries ``PROBE_VANTAGE_ALIAS`` before the namespace is
    mounted (``_mark_lo`` in ``netns.create``'s ``init``; ``ip`` forked from the thread
    inside the new namespace runs there).
    """
    try:
        made = netns.create(ns, file_mark=PROBE_VANTAGE_ALIAS, init=_mark_lo)
    except DriverError as e:
        raise DriverError(f"probe vantage: {e}") from None
    if not made:
        raise DriverError(f"probe vantage: the namespace {ns} exists and is not ours")
    try:
        _ip(batch="\n".join((
            f"link add {link} address {VANTAGE_HOST_MAC} type veth peer name eth0 "
            f"address {VANTAGE_PEER_MAC} netns {ns}",
            f"link set {link} addrgenmode none",
            f'link set {link} alias "{PROBE_VANTAGE_ALIAS}"',
            f"addr add {VANTAGE_HOST}/{VANTAGE_NET.prefixlen} dev {link}",
            f"neigh replace {VANTAGE_PEER} lladdr {VANTAGE_PEER_MAC} dev {link} nud permanent",
            f"link set {link} up", "")))
        _ip("-n", ns, batch="\n".join((
            "link set eth0 addrgenmode none",
            f"addr add {VANTAGE_PEER}/{VANTAGE_NET.prefixlen} dev eth0",
            f"neigh replace {VANTAGE_HOST} lladdr {VANTAGE_HOST_MAC} dev eth0 nud permanent",
            "link set eth0 up", f"route add default via {VANTAGE_HOST}", "")))
    except DriverError:
        remove_vantage(ns, link)
        raise
    with contextlib.suppress(DriverError):
        _add_ipv6(ns, link)


def _add_ipv6(ns: str, link: str) -> None:
    """The vantage link's IPv6 pair, after its IPv4 side: a host without IPv6 (or with it
    disabled on new links) keeps an IPv4 vantage, and its IPv6 maps' external paths say
    why they are skipped (``vantage_ipv6_missing``) instead of every external probe failing."""
    if not os.path.isdir("/proc/sys/net/ipv6"):
        return
    _ip(batch="\n".join((
        f"addr add {VANTAGE6_HOST}/{VANTAGE_NET6.prefixlen} dev {link} nodad",
        f"neigh replace {VANTAGE6_PEER} lladdr {VANTAGE_PEER_MAC} dev {link} nud permanent",
        "")))
    _ip("-n", ns, batch="\n".join((
        f"addr add {VANTAGE6_PEER}/{VANTAGE_NET6.prefixlen} dev eth0 nodad",
        f"neigh replace {VANTAGE6_HOST} lladdr {VANTAGE_HOST_MAC} dev eth0 nud permanent",
        f"route add default via {VANTAGE6_HOST}", "")))


def vantage_ipv6_missing(link: str) -> str | None:
    """Why the vantage has no IPv6 pair to probe from, or None when it has: its host end
    carries ``VANTAGE6_HOST`` (one file read; the namespace's end failing shows as the
    probes' own failure, "network unreachable")."""
    why = _ipv6_unavailable(link)
    if why is not None:
        return why
    if not _has_ipv6_pair(link):
        return f"the external vantage link has no IPv6 address ({VANTAGE6_HOST} is not on {link})"
    return None


def vantage_lacks_ipv6_pair(link: str) -> bool:
    """The link could carry the IPv6 pair and does not: a vantage made by a version before
    the pair, or one whose pair someone removed (made again, see ``VantageLease``)."""
    return _ipv6_unavailable(link) is None and not _has_ipv6_pair(link)


def _ipv6_unavailable(link: str) -> str | None:
    if not os.path.isdir("/proc/sys/net/ipv6"):
        return "no IPv6 in this kernel (the external vantage link has no IPv6 pair)"
    try:
        with open(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6", encoding="ascii") as fh:
            if fh.read().strip() == "1":
                return (f"IPv6 is disabled on the external vantage link "
                        f"(net.ipv6.conf.{link}.disable_ipv6=1)")
    except OSError:
        pass  # the link went meanwhile: the look for the pair says so
    return None


def _has_ipv6_pair(link: str) -> bool:
    """``VANTAGE6_HOST`` is on ``link`` here: a read of ``if_inet6`` (the namespace's IPv6
    addresses, one per line: hex address, index, prefix, scope, flags, name), not an ``ip``
    process per probe run."""
    want = ipaddress.IPv6Address(VANTAGE6_HOST).exploded.replace(":", "")
    try:
        with open("/proc/thread-self/net/if_inet6", encoding="ascii") as fh:
            rows = [line.split() for line in fh]
    except OSError:
        return False
    return any(len(r) == 6 and r[0] == want and r[5] == link for r in rows)


def _json(*args: str) -> list[dict[str, Any]] | None:
    """What ``ip ARGS`` (with ``-j``) prints, parsed; None when it fails."""
    try:
        p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                           check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    try:
        out = json.loads(p.stdout or "[]")
    except ValueError:
        return None
    return out if isinstance(out, list) else None


def _alias(*args: str) -> str | None:
    """``ifalias`` of one link (``ip -j link show``), "" when it has none, None if absent."""
    links = _json(*args)
    if links is None:
        return None
    return str(links[0].get("ifalias", "")) if links else None


def namespace_mark(ns: str) -> str | None:
    """The mark of the namespace ``ns``: its ``lo`` alias when it is a live namespace, the
    file's tag when it is an empty file (a crash between unmount and unlink), None when
    there is no such namespace; "" when it carries none."""
    try:
        if not netns.is_namespace_mount(ns):
            return netns.file_mark(ns) or ""
    except (OSError, DriverError):
        return None
    return _alias("-n", ns, "-j", "link", "show", "dev", "lo") or ""


def link_mark(link: str) -> str | None:
    """The alias of the host link ``link`` ("" when none), None when there is no such link."""
    return _alias("-j", "link", "show", "dev", link)


def vantage_state(ns: str, link: str) -> str:
    """``ready`` (both parts there and marked ours), ``absent`` (neither there), ``foreign``
    (a part of that name is there and not ours), else ``partial`` (ours, half there)."""
    ns_mark, link_mk = namespace_mark(ns), link_mark(link)
    if (ns_mark is not None and ns_mark != PROBE_VANTAGE_ALIAS) or \
            (link_mk is not None and link_mk != PROBE_VANTAGE_ALIAS):
        return "foreign"
    if ns_mark is None and link_mk is None:
        return "absent"
    if ns_mark is not None and link_mk is not None and netns.is_namespace_mount(ns):
        return "ready"
    return "partial"


def remove_vantage(ns: str, link: str) -> None:
    """Remove the vantage: the veth first (at once; the namespace's own teardown is
    asynchronous), then the namespace — each only when it carries the vantage's mark
    (``PROBE_VANTAGE_ALIAS``): a link or namespace of that name that is somebody else's
    stays. Absent parts are fine."""
    if link_mark(link) == PROBE_VANTAGE_ALIAS:
        with contextlib.suppress(DriverError):  # gone meanwhile: nothing to remove
            _ip(batch=f"link del {link}\n")
    if namespace_mark(ns) == PROBE_VANTAGE_ALIAS:
        with contextlib.suppress(DriverError, OSError):
            netns.delete(ns)


def run(specs: Sequence[ProbeSpec], *, timeout: float = 1.0,
        external_ns: str | None = None,
        forget: Callable[[list[Flow]], object] | None = None) -> list[Outcome]:
    """Send every probe at once and wait (at most ``timeout``) for each; outcomes in order.

    Runs in the namespace of the calling thread ("the host"); allocation namespaces are
    ``/run/netns/<alloc id>``. Leaves no socket or TIME_WAIT behind; the conntrack entries
    the probes made (``Outcome.flow``) go to ``forget`` after each batch's sockets are
    closed, also when the batch failed half-way: the caller deletes them.
    """
    out: list[Outcome] = []
    batch = fd_budget()
    for i in range(0, len(specs), batch):
        r = ProbeRun(specs[i:i + batch], external_ns=external_ns)
        try:
            r.open()
            r.send()
            r.loop(timeout)
        finally:
            r.close()
            if forget is not None:
                forget([p.outcome.flow for p in r.probes if p.outcome.flow is not None])
        out += [p.outcome for p in r.probes]
    return out


def fd_budget(margin: int = 64) -> int:
    """How many probes one batch may hold open (about a descriptor each) under the soft
    ``RLIMIT_NOFILE`` (systemd's default is 1024), keeping ``margin`` for everything else."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 256
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, soft - used - margin)
