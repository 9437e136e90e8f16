"""What the watch agent tells operators: a status document, Prometheus metrics, health.

The agent serves them over HTTP on loopback (``--status-addr``); ``reconcile
status`` fetches and prints the status document. The listening socket is made
before ``--netns`` moves the process, so the endpoint lives in the namespace the
operator started the agent from.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from reconciler.domain.errors import ConfigError, PreconditionError, ReconcilerError

DEFAULT_ADDR = "127.0.0.1:9477"


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
        self.last_success = Gauge("reconciler_last_success_timestamp_seconds",
                                  "Unix time of the last pass that converged", registry=r)

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


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for IPv6) -> (host, port); ConfigError when malformed."""
    text = addr.strip()
    if text.startswith("http://"):
        text = text[len("http://"):].rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"bad address {addr!r}: expected HOST:PORT, e.g. {DEFAULT_ADDR}")
    return host.strip("[]"), int(port)


def bind(addr: str) -> socket.socket:
    """A listening TCP socket for the status server (made before entering --netns)."""
    host, port = parse_addr(addr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(16)
        if not ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
            logging.getLogger("reconciler.status").warning(
                "status and metrics on %s are reachable beyond this host and have no "
                "authentication (they show paths, errors and the revision); the default is "
                "127.0.0.1:9477", addr)
    except OSError as exc:
        sock.close()
        raise PreconditionError(f"--status-addr {addr}: cannot listen: {exc.strerror or exc}; "
                                "choose another address or --status-addr off") from None
    return sock


class StatusServer:
    """``/status`` (JSON), ``/metrics`` (Prometheus text), ``/healthz`` on a pre-bound socket."""

    def __init__(self, sock: socket.socket, board: StatusBoard, metrics: Metrics,
                 healthy: Callable[[], tuple[bool, str]]) -> None:
        routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/status": lambda: (200, "application/json",
                                json.dumps(board.snapshot(), indent=2).encode() + b"\n"),
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, metrics.render()),
            "/healthz": lambda: _health(healthy),
        }

        class Handler(BaseHTTPRequestHandler):
            server_version = "reconciler"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                route = routes.get(self.path.split("?", 1)[0].rstrip("/") or "/")
                code, ctype, body = route() if route else (404, "text/plain", b"not found\n")
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # operators poll these; do not fill the journal

        self.httpd = ThreadingHTTPServer(sock.getsockname()[:2], Handler,
                                         bind_and_activate=False)
        self.httpd.socket.close()
        self.httpd.socket = sock
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="status-http",
                                        kwargs={"poll_interval": 0.2}, daemon=True)

    @property
    def address(self) -> str:
        host, port = self.httpd.socket.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _health(healthy: Callable[[], tuple[bool, str]]) -> tuple[int, str, bytes]:
    ok, why = healthy()
    return (200 if ok else 503), "text/plain", (why + "\n").encode()


# --------------------------------------------------------------------------- client


def fetch(addr: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET /status from a running agent; one-line ReconcilerError when it cannot."""
    host, port = parse_addr(addr)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/status"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        with opener.open(url, timeout=timeout) as resp:
            doc: dict[str, Any] = json.loads(resp.read().decode())
            return doc
    except urllib.error.URLError as exc:
        reason = getattr(exc, "reason", exc)
        why = getattr(reason, "strerror", None) or str(reason)
        raise ReconcilerError(f"cannot reach the watch agent at {url}: {why} "
                              "(is `reconcile watch` running with this --status-addr?)") from None
    except (OSError, ValueError) as exc:
        raise ReconcilerError(f"bad answer from the watch agent at {url}: {exc}") from None


def _ago(ts: float | None, now: float) -> str:
    if not ts:
        return "never"
    d = max(0.0, now - ts)
    if d < 120:
        return f"{d:.0f}s ago"
    if d < 7200:
        return f"{d / 60:.0f}m ago"
    return f"{d / 3600:.1f}h ago"


def render(doc: dict[str, Any], now: float | None = None) -> str:
    """The status document as a few lines for people."""
    now = time.time() if now is None else now
    lines = []
    rev = doc.get("revision") or {}
    commit = rev.get("commit")
    where = f"commit {commit[:12]}{' (dirty)' if rev.get('dirty') else ''}" if commit \
        else f"files sha256 {str(rev.get('files_sha256', ''))[:12] or '-'}"
    lines.append(f"agent: pid {doc.get('pid')} on {doc.get('hostname')}, {doc.get('state')}, "
                 f"up since {_ago(doc.get('started_at'), now)}")
    lines.append(f"desired: {' '.join(doc.get('paths', []))} at {where}")
    counts = doc.get("desired") or {}
    if counts:
        lines.append("         " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    last = doc.get("last_pass") or {}
    if last:
        ch = last.get("changes") or {}
        lines.append(f"last pass: #{last.get('number')} {last.get('result')} "
                     f"{_ago(last.get('finished_at'), now)} in "
                     f"{last.get('duration_seconds', 0):.2f}s "
                     f"({ch.get('applied', 0)} applied, {ch.get('failed', 0)} failed, "
                     f"{ch.get('skipped', 0)} skipped; "
                     f"because: {', '.join(last.get('reasons', [])) or '-'})")
        if last.get("error"):
            lines.append(f"  error: {last['error']}")
    else:
        lines.append("last pass: none yet")
    lines.append(f"passes: {doc.get('pass_count', 0)}; last converged "
                 f"{_ago(doc.get('last_success_at'), now)}; consecutive failures "
                 f"{doc.get('consecutive_failures', 0)}")
    for e in doc.get("errors") or []:
        lines.append(f"  {e.get('resource')}: {e.get('error')}")
    overlaps = doc.get("address_overlaps") or []
    if overlaps:
        lines.append(f"address overlaps: {len(overlaps)} (foreign, left alone):")
        lines.extend(f"  {o.get('foreign')} overlaps owned {o.get('owned')} "
                     f"(since {_ago(o.get('since'), now)})" for o in overlaps)
    cfg = doc.get("config_error")
    if cfg:
        lines.append(f"config error (keeping the last good desired state) since "
                     f"{_ago(cfg.get('since'), now)}:")
        lines.extend(f"  {ln}" for ln in str(cfg.get("message", "")).splitlines())
    return "\n".join(lines) + "\n"


def healthy_doc(doc: dict[str, Any]) -> bool:
    """True when the last pass converged and the files load cleanly."""
    last = doc.get("last_pass") or {}
    return (not doc.get("config_error") and last.get("result") in ("ok", "applied")
            and not doc.get("errors"))
