"""`reconcile status`: ask the running agent, and only the agent, for its status.

The agent serves its status document twice: on a unix socket only root can open
(``/run/reconciler/status-<netns inode>.sock``, the whole document), and over HTTP on
``--status-addr`` (loopback by default, for Prometheus and the rollout engines' checks,
without what only root may read). Any local user can bind that address before the agent
does, and then answer in its name: so the client asks the root-only socket first, and
over TCP believes an answer only from a listener of root's (or of our own user), found
in /proc/net/tcp. Every answer is read up to ``MAX_ANSWER`` bytes within one deadline,
must be a JSON object, and is printed with its control characters escaped: whoever
answers cannot make the client use gigabytes, crash, or drive the terminal.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from typing import Any

from reconciler.domain.errors import ConfigError, ReconcilerError
from reconciler.domain.hints import command
from reconciler.drivers import procfs, rundir

DEFAULT_ADDR = "127.0.0.1:9477"

#: the most a status answer may hold (a host with thousands of failing probes is ~1 MiB)
MAX_ANSWER = 16 * 1024 * 1024


def socket_path(netns_inode: int) -> str:
    """Name the root-only status socket of the agent acting on the namespace ``netns_inode``."""
    return os.path.join(rundir.RUN_DIR, f"status-{netns_inode}.sock")


def parse_addr(addr: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[V6]:PORT`` for IPv6) -> (host, port); ConfigError when malformed."""
    text = addr.strip()
    if text.startswith("http://"):
        text = text[len("http://"):].rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"bad address {addr!r}: expected HOST:PORT, e.g. {DEFAULT_ADDR}")
    return host.strip("[]"), int(port)




def _wildcards(host: str) -> set[str]:
    """Return the listening addresses a connection to ``host`` may reach: ``host`` itself, its
    family's wildcard and, for IPv4, a dual-stack IPv6 socket's."""
    ip = ipaddress.ip_address(host)
    if ip.version == 4:
        return {str(ip), "0.0.0.0", "::", f"::ffff:{ip}"}
    return {str(ip), "::"}


def listener_problem(host: str, port: int) -> str | None:
    """Return why what listens on ``host:port`` here is not the agent (a listener of another
    user's, or none), or None when every listener a connection could reach is root's or
    ours.

    A local user who bound the address before the agent answers in its name; the kernel
    keeps a port bound by root from anyone else (no other user may join its reuseport
    group), so an owner checked here is the owner connected to after.
    """
    try:
        ips = _wildcards(host)
    except ValueError:
        return f"{host} is not an IP address: its listener cannot be checked"
    mine = (0, os.geteuid())
    found = [(addr, uid, inode) for addr, uid, inode in procfs.tcp_listeners(port)
             if addr in ips]
    if not found:
        return None  # nobody listens: the connection says so
    for addr, uid, inode in found:
        if uid not in mine:
            holders = ", ".join(f"pid {pid} {procfs.process_name(pid)}"
                                for pid in procfs.socket_holders(inode)) or "pid unknown"
            return (f"{addr}:{port} is held by uid {uid} ({holders}), not by the watch agent; "
                    "its answer is not believed")
    return None


def http_get(target: str | tuple[str, int], path: str,
             timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``path`` from a unix socket path or a (host, port); (HTTP code, body).

    One deadline for the whole exchange, at most ``MAX_ANSWER`` bytes read; OSError or
    ValueError (said in one line) otherwise.
    """
    deadline = time.monotonic() + timeout
    if isinstance(target, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        host = "localhost"
    else:
        family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        host = f"[{target[0]}]" if ":" in target[0] else target[0]
    with sock:
        sock.settimeout(timeout)
        sock.connect(target)
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                     .encode())
        data = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole answer within {timeout:g}s")
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_ANSWER:
                raise ValueError(f"answer larger than {MAX_ANSWER // (1024 * 1024)} MiB")
    head, sep, body = bytes(data).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/") \
            or not status[1].isdigit():
        raise ValueError("not an HTTP answer")
    return int(status[1]), body


def where_to_ask(addr: str | None, netns_inode: int) -> str | tuple[str, int]:
    """Choose where to ask: the agent's root-only socket for this namespace when it is there
    and no ``--addr`` was given, else ``--addr`` (or the default) over TCP, once its listener
    is checked (ReconcilerError naming who holds it otherwise)."""
    if addr is None:
        path = socket_path(netns_inode)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
                s.settimeout(2.0)
                s.connect(path)
            return path
        except OSError:
            pass  # none (an agent of a version before it, or none at all): over TCP
    text = addr if addr is not None else DEFAULT_ADDR
    host, port = parse_addr(text)
    problem = listener_problem(host, port)
    if problem is not None:
        raise ReconcilerError(f"the status address {text}: {problem} (run `{command('status')}` "
                              "as root on the agent's host: it asks the agent's own socket)")
    return host, port


def _describe(target: str | tuple[str, int]) -> str:
    if isinstance(target, str):
        return target
    host, port = target
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def fetch_from(target: str | tuple[str, int], timeout: float = 5.0) -> dict[str, Any]:
    """Fetch the status document from ``target``; one-line ReconcilerError when it cannot."""
    where = _describe(target)
    try:
        code, body = http_get(target, "/status", timeout)
    except (TimeoutError, ValueError) as exc:  # something answered, not as the agent does
        raise ReconcilerError(f"bad answer from the watch agent at {where}: {exc}") from None
    except OSError as exc:
        raise ReconcilerError(f"cannot reach the watch agent at {where}: "
                              f"{exc.strerror or exc} (is `{command('watch')}` running with this "
                              "--status-addr?)") from None
    try:
        doc = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):
        doc = None
    if code != 200 or not isinstance(doc, dict):
        what = "not a JSON object" if not isinstance(doc, dict) else "a JSON object"
        raise ReconcilerError(f"bad answer from the watch agent at {where}: HTTP {code}, "
                              f"{what}")
    return doc


def fetch(addr: str, timeout: float = 5.0) -> dict[str, Any]:
    """Fetch GET /status over TCP from ``addr`` (HOST:PORT), its listener checked first."""
    return fetch_from(where_to_ask(addr, 0), timeout)


def escape(text: str) -> str:
    """Escape control characters (ESC above all) and other unprintable ones as ``\\x..``/
    ``\\u....``: what an answer holds is printed, never obeyed by the terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else
                   (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
                   for ch in text)


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
    """Render the status document as a few lines for people, each control character of the
    answer escaped; ReconcilerError for a document of another shape (whoever answered)."""
    try:
        text = _render(doc, time.time() if now is None else now)
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as exc:
        raise ReconcilerError("bad answer from the watch agent: not a status document "
                              f"({type(exc).__name__})") from None
    return "".join(escape(line) + "\n" for line in text.splitlines())


def _render(doc: dict[str, Any], now: float) -> str:
    lines = []
    rev = doc.get("revision") or {}
    commit = rev.get("commit")
    where = f"commit {commit[:12]}{' (dirty)' if rev.get('dirty') else ''}" if commit \
        else f"files sha256 {str(rev.get('files_sha256', ''))[:12] or '-'}"
    lines.append(f"agent: pid {doc.get('pid')} on {doc.get('hostname')}, {doc.get('state')}, "
                 f"up since {_ago(doc.get('started_at'), now)}")
    lines.append(f"desired: {' '.join(doc.get('paths', []))} at {where}"
                 + (f" (expected {doc['expected_revision']})" if doc.get("expected_revision")
                    else ""))
    counts = doc.get("desired") or {}
    if counts:
        lines.append("         " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    ready = doc.get("ready")
    if ready:  # the /readyz verdict; its reason of a ready agent starts with "ready:"
        lines.append(str(ready.get("reason")) if ready.get("ready")
                     else f"not ready: {ready.get('reason')}")
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
    stuck = doc.get("blocked") or []
    if stuck:  # each is also in the errors below, with its reason
        lines.append(f"blocked: {len(stuck)} resource(s); everything else is healed")
    for e in doc.get("errors") or []:
        lines.append(f"  {e.get('resource')}: {e.get('error')}")
    probes = doc.get("probes") or {}
    if probes:
        lines.append(f"probes: {probes.get('held', 0)} held, {probes.get('failed', 0)} failed, "
                     f"{probes.get('skipped', 0)} skipped (last {_ago(probes.get('at'), now)})")
        for f in probes.get("failures") or []:
            port = "" if f.get("port") is None else f" {f.get('port')}"
            lines.append(f"  alloc {f.get('alloc')} path {f.get('path')} "
                         f"({f.get('proto')}{port}): {f.get('cause') or 'no cause found'} "
                         f"(since {_ago(f.get('since'), now)})")
    pending = doc.get("pending")
    if pending:
        rev = f" of revision {pending['revision']}" if pending.get("revision") else ""
        lines.append(f"pending: a change{rev} until {pending.get('deadline')} "
                     f"(`{command('confirm')}` keeps it, `{command('revert')}` undoes it)")
    if doc.get("reverted_revision"):
        lines.append(f"reverted: revision {doc['reverted_revision']} (not applied again "
                     "until the files change)")
    overlaps = doc.get("address_overlaps") or []
    if overlaps:
        lines.append(f"address overlaps: {len(overlaps)} (foreign, left alone):")
        lines.extend(f"  {o.get('foreign')} overlaps owned {o.get('owned')} "
                     f"(since {_ago(o.get('since'), now)})" for o in overlaps)
    cfg = doc.get("config_error")
    if cfg:
        lines.append(f"config error (keeping the last good desired state) since "
                     f"{_ago(cfg.get('since'), now)}:")
        lines.extend(f"  {ln}" for ln in str(cfg.get("detail") or cfg.get("message", ""))
                     .splitlines())
    return "\n".join(lines) + "\n"


def healthy_doc(doc: dict[str, Any]) -> bool:
    """Return True when the last pass converged, the files load cleanly and no probe fails."""
    last = doc.get("last_pass") or {}
    return (not doc.get("config_error") and last.get("result") in ("ok", "applied")
            and not doc.get("errors") and not (doc.get("probes") or {}).get("failed"))
