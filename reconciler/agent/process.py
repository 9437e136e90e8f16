"""The agent as a process: signals, the status and plan servers around the loop, ``run``."""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from reconciler.agent.loop import Agent
from reconciler.agent.passes import PassReport, WatchOptions
from reconciler.agent.planview.server import PlanServer
from reconciler.agent.status import StatusServer

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
        log.warning("not answering `reconcile plan` (%s); clients plan in-process", exc)
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


def run(options: WatchOptions, status_socket: socket.socket | None) -> int:
    """Run the agent until SIGTERM/SIGINT; 0 on a clean stop."""
    agent = Agent(options)
    server = None
    if status_socket is not None:
        server = StatusServer(status_socket, agent.board, agent.metrics, agent.healthy,
                              ready=agent.ready)
    install_signals(agent)
    plans = None
    try:
        agent.start_sources()
        if options.plan_server:
            plans = _start_plan_server(agent)
        if server is not None:
            server.start()
            log.info("status on http://%s/status (metrics /metrics, health /healthz, "
                     "readiness /readyz)",
                     server.address)
        log.info("watching %s (interval %gs, debounce %gs)", " ".join(options.paths),
                 options.interval, options.debounce)
        agent.run()
    finally:
        agent.stop.set()
        if server is not None:
            server.close()
        if plans is not None:
            plans.close()
        agent.close()
    log.info("stopped after %d pass(es)", agent.pass_count)
    return 0

