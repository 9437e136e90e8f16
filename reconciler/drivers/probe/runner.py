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

See docs/decisions/031-probes-capture-decides.md.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import secrets
import selectors
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reconciler.domain.errors import DriverError
from reconciler.domain.ownership import alloc_veth_name
from reconciler.domain.probes import PROBE_PORTS, ProbeSpec
from reconciler.drivers import netns
from reconciler.drivers.probe.capture import (
    CMSG_ROOM,
    capture_drops,
    capture_stamp,
    open_capture,
    parse_l4,
)
from reconciler.drivers.probe.echo import (
    ICMP6_ECHO,
    ICMP_ECHO,
    echo_payload,
    echo_request,
    open_icmp,
    parse_echo_reply,
)

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
    """Open a client socket bound to a reserved source port (in the calling thread's namespace),
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
        """Record that the sender is finished (connected, refused, an answer or an ICMP error)."""
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
        """Note a probe's arrival; ``stamp``: the kernel's wall-clock time of the packet (the
        capture's), if any."""
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
                data, ancdata, _flags, addr = self.capture.recvmsg(128, CMSG_ROOM)
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
                raw, ancdata, _flags, _addr = s.recvmsg(2048, CMSG_ROOM)
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
    """Count how many probes one batch may hold open (about a descriptor each) under the soft
    ``RLIMIT_NOFILE`` (systemd's default is 1024), keeping ``margin`` for everything else."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 256
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, soft - used - margin)
