"""The agent as a process: signals, the status and plan servers around the loop, ``run``."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from reconciler.agent.loop import Agent
from reconciler.agent.passes import PassReport, WatchOptions
from reconciler.agent.planview.server import PlanServer
from reconciler.agent.status import StatusServer, TcpStatus, bind, bind_unix
from reconciler.agent.statusclient import socket_path
from reconciler.domain.errors import DriverError, PreconditionError
from reconciler.domain.hints import command
from reconciler.drivers import netns
from reconciler.drivers.nsfs import current_inode

log = logging.getLogger("reconciler.watch")


def install_signals(agent: Agent) -> None:
    # A Python signal handler runs in the main thread between two bytecodes, possibly while
    # that thread holds the status board's or the trigger's lock: taking them here would
    # deadlock (or, with a re-entrant lock, mutate state mid-iteration). Only the stop event
    # is set directly (lock-free); everything else runs on a short-lived thread.
    def later(fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, name="signal", daemon=True).start()

    def terminate(signum: int, _frame: FrameType | None) -> None:
        if not agent.stop.is_set():
            log.info("%s: finishing the current change, then exiting",
                     signal.Signals(signum).name)
        agent.stop.set()

        def wind_down() -> None:
            agent.board.update(state="stopping")
            agent.trigger.wake()

        later(wind_down)

    def hup(_signum: int, _frame: FrameType | None) -> None:
        later(agent.reload)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    signal.signal(signal.SIGHUP, hup)


def _start_plan_server(agent: Agent) -> Any:
    """Serve `reconcile plan` from this agent; a failure only costs clients speed."""
    plans = PlanServer(agent.stop, on_answer=lambda result: agent.metrics.plan_requests.labels(
        result=result).inc())
    try:
        started = plans.start()
    except OSError as exc:
        need = (": NETLINK_LISTEN_ALL_NSID needs CAP_NET_BROADCAST (docker run --cap-add "
                "NET_BROADCAST)" if exc.errno == errno.EPERM else "")
        log.warning("not answering `reconcile plan` (%s%s); clients plan in-process", exc, need)
        plans.close()
        return None
    if started:
        def warm(report: PassReport) -> None:
            if report.converged:
                plans.warm(agent.options.paths, agent.options.hostname)

        agent.after_pass = warm
    src = agent.board.get("event_sources") or {}
    src["plan_server"] = plans.path if started else "another agent answers"
    agent.board.update(event_sources=src)
    return plans if started else None


#: the longest wait between two tries to bind a taken ``--status-addr``
TCP_RETRY_CAP = 60.0


class TcpRetry:
    """Bind the ``--status-addr`` that was taken when the agent started, again and again on a
    backoff (1 s doubling to a minute), in the namespace it belongs to; serve it once bound.
    Meanwhile ``/status`` and ``/readyz`` are on the root-only socket."""

    def __init__(self, tcp: TcpStatus, serve: Callable[[socket.socket], None],
                 stop: threading.Event) -> None:
        self.tcp = tcp
        self.serve = serve
        self.stop = stop
        self.tries = 0
        self._thread = threading.Thread(target=self._run, name="status-bind", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        delay = 1.0
        while not self.stop.wait(delay):
            self.tries += 1
            try:
                if self.tcp.home is not None:
                    with netns.enter(self.tcp.home):  # this thread only, and back
                        sock = bind(self.tcp.addr)
                else:
                    sock = bind(self.tcp.addr)
            except (PreconditionError, DriverError) as exc:
                log.debug("status on %s: still unavailable (%s)", self.tcp.addr, exc)
                delay = min(TCP_RETRY_CAP, delay * 2)
                continue
            if self.stop.is_set():
                sock.close()
                return
            self.serve(sock)
            log.info("status on http://%s/status: bound after %d tries", self.tcp.addr,
                     self.tries)
            return

    def join(self) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def _unix_server(agent: Agent) -> StatusServer | None:
    """Serve the whole status (and ``/readyz``) on the root-only socket; None when it cannot
    be (another agent of this namespace serves it, the run directory is refused)."""
    path = socket_path(current_inode())
    try:
        sock = bind_unix(path)
    except (OSError, PreconditionError) as exc:
        log.warning("status not served on %s: %s", path, exc)
        return None
    return StatusServer(sock, agent.board, agent.metrics, agent.healthy, ready=agent.ready,
                        private=True)


def _forget(server: StatusServer | None) -> None:
    """Close ``server`` and, for the unix socket, remove its file while it is still ours."""
    if server is None:
        return
    path = server.address if server.sock.family == socket.AF_UNIX else None
    server.close()
    if path:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)


def run(options: WatchOptions, tcp: TcpStatus | None) -> int:
    """Run the agent until SIGTERM/SIGINT; 0 on a clean stop."""
    agent = Agent(options)
    servers: list[StatusServer] = []
    lock = threading.Lock()

    def serve(sock: socket.socket) -> None:
        server = StatusServer(sock, agent.board, agent.metrics, agent.healthy,
                              ready=agent.ready)
        with lock:
            servers.append(server)
        server.start()
        agent.board.update(status_endpoints=dict(agent.board.get("status_endpoints") or {},
                                                 tcp=server.address))

    install_signals(agent)
    plans = None
    retry = None
    unix = None
    try:
        agent.start_sources()
        if options.plan_server:
            plans = _start_plan_server(agent)
        unix = _unix_server(agent)
        endpoints: dict[str, str] = {}
        if unix is not None:
            unix.start()
            endpoints["unix"] = unix.address
        if tcp is not None and tcp.sock is not None:
            endpoints["tcp"] = tcp.addr
        elif tcp is not None:
            endpoints["tcp"] = f"unavailable: {tcp.error}"
        agent.board.update(status_endpoints=endpoints)
        if tcp is not None and tcp.sock is not None:
            serve(tcp.sock)
            log.info("status on http://%s/status (metrics /metrics, health /healthz, "
                     "readiness /readyz)", servers[0].address)
        elif tcp is not None:
            log.warning("%s; starting without it: status and readiness on %s (root only, "
                        f"`{command('status')}`), the address tried again on a backoff",
                        tcp.error, endpoints.get("unix", "no socket"))
            retry = TcpRetry(tcp, serve, agent.stop)
            retry.start()
        log.info("watching %s (interval %gs, debounce %gs)", " ".join(options.paths),
                 options.interval, options.debounce)
        agent.run()
    finally:
        agent.stop.set()
        if retry is not None:
            retry.join()
        with lock:
            for server in servers:
                server.close()
        _forget(unix)
        if tcp is not None and tcp.home is not None:
            os.close(tcp.home)
        if plans is not None:
            plans.close()
        agent.close()
    log.info("stopped after %d pass(es)", agent.pass_count)
    return 0
