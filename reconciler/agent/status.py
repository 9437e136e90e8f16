"""What the watch agent tells operators: a status document, Prometheus metrics, health.

The agent serves them over HTTP on loopback (``--status-addr``); ``reconcile
status`` fetches and prints the status document. The listening socket is made
before ``--netns`` moves the process, so the endpoint lives in the namespace the
operator started the agent from.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import ipaddress
import json
import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from reconciler.agent.logs import RateLimit
from reconciler.agent.readiness import Verdict
from reconciler.agent.statusclient import fetch as fetch  # (re-exported: tests, callers)
from reconciler.agent.statusclient import healthy_doc as healthy_doc
from reconciler.agent.statusclient import parse_addr
from reconciler.agent.statusclient import render as render
from reconciler.domain.errors import PreconditionError
from reconciler.drivers import rundir

log = logging.getLogger("reconciler.status")
#: everything the status servers log is what a client caused: 20 lines at once, then one a
#: second, for all clients of all servers together (each client also gets at most one a
#: second of its own: ``StatusServer._note``)
CLIENT_LINES = RateLimit(rate=1.0, burst=20)
log.addFilter(CLIENT_LINES)


class Metrics:
    """The agent's Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.passes = Counter("reconciler_passes", "Reconcile passes run, by result",
                              ["result"], registry=r)
        self.changes = Counter("reconciler_changes_applied",
                               "Changes applied to the host", registry=r)
        self.failures = Counter("reconciler_pass_failures",
                                "Passes that failed (errors, residual diff, lock timeout)",
                                registry=r)
        self.drift_events = Counter("reconciler_drift_events",
                                    "Relevant drift events seen, by source", ["source"],
                                    registry=r)
        self.config_errors = Counter("reconciler_config_errors",
                                     "Loads of the desired-state files that failed", registry=r)
        self.duration = Histogram("reconciler_pass_duration_seconds", "Duration of a pass",
                                  buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60),
                                  registry=r)
        self.config_valid = Gauge("reconciler_config_valid",
                                  "1 when the files loaded cleanly at the last pass", registry=r)
        self.plan_requests = Counter("reconciler_plan_requests",
                                     "`reconcile plan` requests answered by this agent, by "
                                     "result: cached (nothing it keeps changed), refreshed "
                                     "(changed parts read again), observed (the whole host "
                                     "read again), declined (the client planned itself)",
                                     ["result"], registry=r)
        self.address_overlaps = Gauge("reconciler_address_overlaps",
                                      "Foreign addresses and routes on the host that overlap "
                                      "a prefix the reconciler owns, now (each pair once)",
                                      registry=r)
        self.probe_failures = Gauge("reconciler_probe_failures",
                                    "Probes failing now, by allocation and path (gateway, "
                                    "host, localhost, hairpin, external, direct)",
                                    ["alloc", "path"], registry=r)
        self.status_refused = Counter("reconciler_status_connections_refused",
                                      "Status server connections closed unanswered (idle "
                                      "too long, too many open, malformed)", registry=r)
        self.last_success = Gauge("reconciler_last_success_timestamp_seconds",
                                  "Unix time of the last pass that converged", registry=r)
        self.ready = Gauge("reconciler_ready",
                           "1 when /readyz answers 200: the last pass at the current revision "
                           "converged and its probes hold", registry=r)
        self.revision_time = Gauge("reconciler_revision_timestamp_seconds",
                                   "Commit time (Unix) of the revision whose files the agent "
                                   "converges to; 0 when they are not in a git checkout",
                                   registry=r)
        self.pending_change = Gauge("reconciler_pending_change",
                                    "1 while a change applied under a confirm window is "
                                    "pending (not confirmed, not reverted)", registry=r)
        self.blocked = Gauge("reconciler_blocked_resources",
                             "Resources that cannot converge now (a conflict, a refused "
                             "replace, a failed op), with what depends on them; everything "
                             "else is still healed", registry=r)
        self.reverts = Counter("reconciler_reverts", "Pending changes reverted (deadline, "
                               "failed probes, reboot, `reconcile revert`)", registry=r)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


class StatusBoard:
    """The status document, updated by the watch loop and read by the HTTP threads."""

    def __init__(self, **initial: Any) -> None:
        self._lock = threading.Lock()
        self._doc: dict[str, Any] = dict(initial)

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._doc.update(copy.deepcopy(fields))

    def get(self, key: str) -> Any:
        with self._lock:
            return copy.deepcopy(self._doc.get(key))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._doc)


def bind(addr: str) -> socket.socket:
    """Open a listening TCP socket for the status server (made before entering --netns)."""
    host, port = parse_addr(addr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)  # a flood of connects must not make a real client wait for SYN retries
        if not ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
            log.warning(
                "status and metrics on %s are reachable beyond this host and have no "
                "authentication (they show paths, errors and the revision); the default is "
                "127.0.0.1:9477", addr)
    except OSError as exc:
        sock.close()
        raise PreconditionError(f"--status-addr {addr}: cannot listen: {exc.strerror or exc}; "
                                "choose another address or --status-addr off") from None
    return sock


@dataclass
class TcpStatus:
    """The ``--status-addr`` listener: its socket, or why it could not be bound (yet) and the
    network namespace to bind it in (the operator's, not the one ``--netns`` enters)."""

    addr: str
    sock: socket.socket | None = None
    error: str | None = None
    #: an fd of the namespace the address belongs to, for the retries
    home: int | None = None


def prepare_tcp(addr: str) -> TcpStatus:
    """Bind ``addr`` now (before ``--netns`` moves the process); when that fails the agent
    starts all the same and binds it later (``process``): a local user who took the
    address first must not keep the agent from healing the host. A malformed address is
    a usage error (ConfigError)."""
    parse_addr(addr)
    try:
        return TcpStatus(addr, bind(addr))
    except PreconditionError as exc:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        return TcpStatus(addr, None, str(exc), home)


def bind_unix(path: str) -> socket.socket:
    """Open the root-only status socket ``path`` (0600, in the 0700 run directory); OSError
    when another agent serves it (it answers) or it cannot be made.

    Unlike the TCP address, nobody but root can take it first: the run directory is root's
    and refused when it is not (``rundir.ensure_dir``)."""
    rundir.ensure_dir(os.path.dirname(path))
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except FileNotFoundError:
        pass
    except OSError:  # refused: a dead agent's socket (or not a socket: refused by unlink)
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket of ours") from None
        os.unlink(path)
    else:
        raise OSError(errno.EADDRINUSE, f"another agent serves {path}")
    finally:
        probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        old = os.umask(0o177)  # 0600 from the first instant
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        sock.listen(16)
    except BaseException:
        sock.close()
        raise
    return sock


#: HTTP reason phrases of the codes the status server answers with
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}


class _Conn:
    """One client connection: what it sent so far, what we still have to send, its deadline."""

    __slots__ = ("deadline", "out", "peer", "request", "sock")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.request = bytearray()
        self.out: bytes | None = None
        self.deadline = deadline


class StatusServer:
    """``/status`` (JSON), ``/metrics`` (Prometheus text), ``/healthz`` (the loop is alive)
    and ``/readyz`` (this host is good at its revision: ``agent/readiness``) on a pre-bound
    socket.

    One thread and a selector, not a thread per connection: anyone on the host can
    connect to loopback, and 4000 idle connections must not become 4000 threads, nor
    use up the agent's file descriptors (then passes fail and drift goes unhealed).
    A client has ``REQUEST_TIMEOUT`` seconds to send its request and as long again to
    read the answer; at most ``MAX_CONNECTIONS`` are open at once, and a new one
    pushes out the oldest that has not finished its request, so a flood of idle
    connections cannot keep `/healthz` from answering. What a client causes is
    logged as one line (at most one a second per peer, with a count), never a
    traceback; all clients together get 20 lines, then one a second (``CLIENT_LINES``:
    another 127.x source per connection is another peer), and the count of what was
    held back is said.
    """

    MAX_CONNECTIONS = 64
    REQUEST_TIMEOUT = 5.0
    MAX_REQUEST = 8192

    def __init__(self, sock: socket.socket, board: StatusBoard, metrics: Metrics,
                 healthy: Callable[[], tuple[bool, str]], *,
                 ready: Callable[[], Verdict] | None = None,
                 clock: Callable[[], float] = time.monotonic, private: bool = False) -> None:
        def status() -> tuple[int, str, bytes]:
            doc = board.snapshot()
            if not private:
                doc = public_view(doc)
            if ready is not None:
                doc["ready"] = ready().to_json()
            return 200, "application/json", json.dumps(doc, indent=2).encode() + b"\n"

        self.routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/status": status,
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, metrics.render()),
            "/healthz": lambda: _health(healthy),
        }
        if ready is not None:
            self.routes["/readyz"] = lambda: _health(lambda: _pair(ready()))
        self.sock = sock
        self.metrics = metrics
        self.clock = clock
        sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[socket.socket, _Conn] = {}  # insertion order: oldest first
        self._stop = threading.Event()
        self._noted: dict[str, tuple[float, int]] = {}  # peer -> (last line, refused since)
        self._thread = threading.Thread(target=self._serve, name="status-http", daemon=True)

    @property
    def address(self) -> str:
        name = self.sock.getsockname()
        if isinstance(name, str):  # the root-only unix socket
            return name
        host, port = name[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for conn in list(self._conns.values()):
            self._drop(conn)
        with contextlib.suppress(OSError, KeyError, ValueError):
            self._sel.unregister(self.sock)
        self.sock.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the loop --------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._sel.select(timeout=0.25)
            except OSError as exc:  # never expected; do not spin
                log.warning("status server: select: %s", exc)
                self._stop.wait(0.25)
                continue
            for key, mask in events:
                if key.data is None:
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(64)
                else:
                    self._io(key.data, mask)
            self._expire()
            held = CLIENT_LINES.flush()
            if held:
                log.warning("status server: %d more line(s) about clients suppressed (log rate "
                            "limit)", held)

    def _accept(self) -> None:
        for _ in range(256):  # then serve the others: a flood must not starve them
            try:
                client, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: free one and go on later
                self._note("-", f"cannot accept ({exc.strerror or exc})")
                oldest = next(iter(self._conns.values()), None)
                if oldest is not None:
                    self._drop(oldest)
                return
            client.setblocking(False)
            peer = str(addr[0]) if isinstance(addr, tuple) else "-"
            if len(self._conns) >= self.MAX_CONNECTIONS:
                idle = next((c for c in self._conns.values() if c.out is None), None)
                if idle is None:  # all are being answered: the newcomer waits its turn
                    self._refuse(client, peer, "too many connections")
                    continue
                self._refuse(idle.sock, idle.peer, f"more than {self.MAX_CONNECTIONS} open, "
                                                   "the oldest idle one closed", conn=idle)
            conn = _Conn(client, peer, self.clock() + self.REQUEST_TIMEOUT)
            self._conns[client] = conn
            self._sel.register(client, selectors.EVENT_READ, conn)

    def _io(self, conn: _Conn, mask: int) -> None:
        try:
            if conn.out is None and mask & selectors.EVENT_READ:
                data = conn.sock.recv(4096)
                if not data:
                    self._drop(conn)
                    return
                conn.request += data
                if len(conn.request) > self.MAX_REQUEST:
                    self._note(conn.peer, "request too large")
                    self._answer(conn, 431, "text/plain", b"request too large\n")
                elif b"\r\n\r\n" in conn.request or b"\n\n" in conn.request:
                    self._answer(conn, *self._route(conn))
            elif conn.out is not None and mask & selectors.EVENT_WRITE:
                sent = conn.sock.send(conn.out)
                conn.out = conn.out[sent:]
                if not conn.out:
                    self._drop(conn)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by the client: nothing to tell anyone
            self._drop(conn)

    def _route(self, conn: _Conn) -> tuple[int, str, bytes, bool]:
        line = bytes(conn.request).split(b"\n", 1)[0].decode("latin-1").strip()
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self._note(conn.peer, "malformed request")
            return 400, "text/plain", b"bad request\n", False
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"GET only\n", method == "HEAD"
        route = self.routes.get(target.split("?", 1)[0].rstrip("/") or "/")
        if route is None:
            return 404, "text/plain", b"not found\n", method == "HEAD"
        try:
            code, ctype, body = route()
        except Exception as exc:  # a bug of ours: one line, the agent goes on
            log.warning("status server: %s failed: %s: %s", target[:64], type(exc).__name__, exc)
            return 500, "text/plain", b"internal error\n", method == "HEAD"
        return code, ctype, body, method == "HEAD"

    def _answer(self, conn: _Conn, code: int, ctype: str, body: bytes,
                head_only: bool = False) -> None:
        head = (f"HTTP/1.0 {code} {_REASONS.get(code, 'Unknown')}\r\nServer: reconciler\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        conn.out = head if head_only else head + body
        conn.deadline = self.clock() + self.REQUEST_TIMEOUT
        self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)

    def _expire(self) -> None:
        now = self.clock()
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            what = "did not send a request" if conn.out is None else "did not read the answer"
            self._refuse(conn.sock, conn.peer,
                         f"{what} within {self.REQUEST_TIMEOUT:g}s", conn=conn)

    def _refuse(self, sock: socket.socket, peer: str, why: str, conn: _Conn | None = None) -> None:
        self.metrics.status_refused.inc()
        self._note(peer, why)
        if conn is not None:
            self._drop(conn)
        else:
            with contextlib.suppress(OSError):
                sock.close()

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        with contextlib.suppress(OSError, KeyError, ValueError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _note(self, peer: str, why: str) -> None:
        """Log one line per refused client: at most one a second per peer, with a count."""
        now = self.clock()
        last, since = self._noted.get(peer, (-1e9, 0))
        if now - last < 1.0:
            self._noted[peer] = (last, since + 1)
            return
        more = f" (and {since} more since the last line)" if since else ""
        log.warning("status server: closed a connection from %s: %s%s", peer, why, more)
        self._noted[peer] = (now, 0)
        if len(self._noted) > 1024:  # peers come and go: keep the table small
            self._noted = {peer: self._noted[peer]}


def public_view(doc: dict[str, Any]) -> dict[str, Any]:
    """Return the status document as anyone on the host may read it: a config error says
    where (file:line:col, the key path) and what, never a value of the files, which may be
    root's alone (its whole text, ``detail``, is for the root-only socket)."""
    cfg = doc.get("config_error")
    if isinstance(cfg, dict) and "detail" in cfg:
        doc = dict(doc, config_error={k: v for k, v in cfg.items() if k != "detail"})
    return doc


def _pair(v: Verdict) -> tuple[bool, str]:
    return v.ready, v.reason


def _health(healthy: Callable[[], tuple[bool, str]]) -> tuple[int, str, bytes]:
    ok, why = healthy()
    return (200 if ok else 503), "text/plain", (why + "\n").encode()
