"""The plan agent's socket server: answers `reconcile plan` requests from the view.

The socket is ``/run/reconciler/plan-<netns inode>.sock``, mode 0600, one
server per namespace (an flock), answering root only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from reconciler.agent.planview.protocol import (
    ACK,
    MAX_REQUEST_FILE,
    PROTOCOL,
    code_id,
    current_env,
    peer_uid,
    recv_exact,
    recv_message,
    send_message,
    socket_path,
    tool_paths,
)
from reconciler.agent.planview.view import LiveView, build_view
from reconciler.config.load import load_sources
from reconciler.config.paths import expand_paths, read_bytes
from reconciler.domain.errors import ConfigError, ReconcilerError
from reconciler.domain.model import DesiredState
from reconciler.drivers import firewalld, rundir
from reconciler.drivers.nsfs import current_inode, mount_ns_inode
from reconciler.engine.journal import Journals
from reconciler.planner.context import PlanOptions
from reconciler.ui.options import plan_options
from reconciler.ui.parser import build_parser
from reconciler.ui.render import plan_exit, plan_text

log = logging.getLogger("reconciler.planserver")


class Declined(Exception):
    """This request is for the client's own CLI (the reason goes back to it)."""


class PlanServer:
    """Answers plan requests on the agent's unix socket, one at a time, in one thread."""

    def __init__(self, stop: threading.Event, *,
                 view_factory: Callable[[], LiveView] = build_view,
                 on_answer: Callable[[str], None] | None = None) -> None:
        self.stop = stop
        self.on_answer = on_answer or (lambda result: None)
        self.net = current_inode()
        self.mnt = mount_ns_inode()
        self.path = socket_path(self.net)
        self.code = code_id()
        self.env = current_env()
        self._view_factory = view_factory
        self.view: LiveView | None = None
        self._desired: dict[Any, DesiredState] = {}
        self._sock: socket.socket | None = None
        self._lock_fd: int | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._parser: Any = None
        self._warm: tuple[tuple[str, ...], str | None] | None = None
        self._warm_key: Any = None
        self.tools: dict[str, str | None] = {}
        #: the journals of interrupted changes in this scope (only their names are read)
        self.journals = Journals()

    def start(self) -> bool:
        """Bind and serve; False (logged) when another agent serves this namespace."""
        rundir.ensure_dir(rundir.RUN_DIR)
        lock_path = self.path[: -len(".sock")] + ".lock"
        while True:
            fd = rundir.open_file(lock_path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                log.warning("another agent already answers plans for this namespace (%s)",
                            self.path)
                return False
            try:
                if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # locked a file its last holder had already removed: take the new one
        self._lock_fd = fd
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale one: we hold the lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        sock.listen(16)
        sock.settimeout(0.5)
        self._sock = sock
        self.view = self._view_factory()
        self.tools = tool_paths()
        self._thread = threading.Thread(target=self._serve, name="plan-server", daemon=True)
        self._thread.start()
        log.info("answering `reconcile plan` on %s", self.path)
        return True

    def _serve(self) -> None:
        assert self._sock is not None
        try:
            while not (self.stop.is_set() or self._closed.is_set()):
                self._warm_up()
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError as exc:  # e.g. EMFILE: wait, do not die with the socket bound
                    log.warning("plan server: accept: %s", exc)
                    self._closed.wait(0.5)
                    continue
                with conn:
                    try:
                        self._handle(conn)
                    except Exception as exc:  # one bad request must not end the server
                        log.warning("plan request failed: %s: %s", type(exc).__name__, exc)
        finally:
            self._unbind()  # at once: clients must not wait for an answer that cannot come

    def warm(self, paths: tuple[str, ...], hostname: str | None) -> None:
        """Observe for these files when idle, so the first plan of them is answered fast.

        The agent calls this after its converged passes with its own files:
        `reconcile plan /etc/reconciler` on the host then finds the view ready.
        A view that serves other files (a client's) is left alone.
        """
        self._warm = (paths, hostname)

    def _warm_up(self) -> None:
        job, self._warm = self._warm, None
        if job is None or self.view is None:
            return
        paths, hostname = job
        try:
            files = expand_paths(paths)
            blobs = [read_bytes(f) for f in files]
            desired, key = self._load([(f, os.path.abspath(f)) for f in files], blobs,
                                      hostname if hostname is not None
                                      else socket.gethostname())
            # only into an empty view, or one that holds the agent's files: never evict
            # what a client plans with other files
            if self.view.live is None or self.view.key in (None, self._warm_key):
                if key != self.view.key or self.view.live is None:
                    self.view.plan(desired, key, PlanOptions())
                self._warm_key = key
        except Exception as exc:  # only speed is at stake
            log.debug("plan view warm-up: %s: %s", type(exc).__name__, exc)

    def _unbind(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(30.0)
        if peer_uid(conn) not in (0, os.geteuid()):
            send_message(conn, {"status": "declined", "why": "root only"})
            return
        request = recv_message(conn, limit=1 << 20)
        files = request.get("files")
        if not isinstance(files, list):
            raise ValueError("no file list")
        blobs = []
        for entry in files:
            size = int(entry[2])
            if not 0 <= size <= MAX_REQUEST_FILE:
                raise ValueError("file size out of range")
            blobs.append(recv_exact(conn, size))
        conn.sendall(ACK)
        try:
            reply = self.answer(request, blobs)
        except Declined as exc:
            reply = {"status": "declined", "why": str(exc)}
        self.on_answer(reply["view"] if reply["status"] == "ok" else "declined")
        send_message(conn, reply)

    def answer(self, request: dict[str, Any], blobs: list[bytes]) -> dict[str, Any]:
        """Return the reply to one request (status "ok"), or raise Declined."""
        expect = {"protocol": PROTOCOL, "code": self.code, "mnt": self.mnt,
                  "net": self.net, "env": self.env}
        for field, value in expect.items():
            if request.get(field) != value:
                raise Declined(f"the agent runs with another {field}")
        tools = tool_paths()
        if request.get("tools") != tools:
            raise Declined("the agent finds other iptables tools (PATH)")
        if firewalld.running():  # the in-process plan asks firewalld about zones: it answers
            raise Declined("firewalld runs here")
        try:  # the in-process plan notes each one and exits 2: a plan alone is not the truth
            pending = self.journals.names()
        except ReconcilerError as exc:
            raise Declined(f"the CLI reports this error: {exc}") from None
        if pending:
            raise Declined("a killed run left a change half done (a journal): the CLI says so")
        if tools != self.tools:  # e.g. update-alternatives switched the iptables backend
            assert self.view is not None
            self.view.close()
            with contextlib.suppress(Exception):
                self.view.observer.handles.close()
            self.view, self.tools = self._view_factory(), tools
        if self._parser is None:
            self._parser = build_parser()  # 3 ms: once
        parser = self._parser
        try:
            args = parser.parse_args(["plan", *request["argv"]])
        except SystemExit:
            raise Declined("the CLI reports usage errors") from None
        if list(args.paths) != request.get("paths"):
            raise Declined("paths parsed differently")
        try:
            options = plan_options(args)
            desired, key = self._load(
                [(str(e[0]), str(e[1])) for e in request["files"]], blobs,
                args.hostname if args.hostname is not None else str(request.get("hostname")))
        except ConfigError:
            raise Declined("the CLI reports configuration errors") from None
        assert self.view is not None
        try:
            plan, how = self.view.plan(desired, key, options)
        except ReconcilerError as exc:
            raise Declined(f"the CLI reports this error: {exc}") from None
        text = plan_text(plan, args.output, colour=bool(request.get("colour")),
                         verbose=int(request.get("verbose", 0)) > 0,
                         compact=getattr(args, "compact", False))
        reply: dict[str, Any] = {"status": "ok", "stdout": text, "rc": plan_exit(plan),
                                 "view": how}
        if args.out:
            reply["out_json"] = plan_text(plan, "json", colour=False, verbose=False)
        return reply

    def _load(self, entries: list[tuple[str, str]], blobs: list[bytes],
              host: str) -> tuple[DesiredState, Any]:
        """Return the desired state of these files ((name, absolute path) and bytes), and its
        key."""
        key = (tuple((n, a, hashlib.sha256(b).hexdigest())
                     for (n, a), b in zip(entries, blobs, strict=True)), host)
        desired = self._desired.get(key)
        if desired is None:
            desired = load_sources([(n, a, b) for (n, a), b in zip(entries, blobs, strict=True)],
                                   hostname=host)
            self._desired = {key: desired}  # the last one only: files change, memory must not grow
        return desired, key

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._unbind()
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path[: -len(".sock")] + ".lock")
            os.close(self._lock_fd)
        if self.view is not None:
            self.view.close()
            with contextlib.suppress(Exception):
                self.view.observer.handles.close()

