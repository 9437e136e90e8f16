"""Run a plan's ops through drivers, in plan order, turning failures into outcomes.

The plan is already ordered (deletes in reverse dependency order, then creates
and updates in dependency order, then sysctls and the firewall transaction).
Each op is idempotent. A ``TemporaryError`` is retried with bounded
exponential backoff; any other failure blocks the change and what needs it
(``Change.needs``: reported skipped, naming the failed one), and every
independent change still runs (SPEC §11); the next run converges from
wherever this one stopped.

See docs/decisions/043-partial-progress.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from reconciler.domain.errors import ReconcilerError, TemporaryError
from reconciler.domain.plan import AttrChange, Change, Op, Plan

log = logging.getLogger("reconciler.executor")

Status = Literal["applied", "failed", "skipped"]
MAX_ATTEMPTS = 4
MAX_DELAY = 2.0


class OpRunner(Protocol):
    def run(self, op: Op) -> None:
        """Perform one op; raise ReconcilerError (TemporaryError to be retried)."""


class ChangeJournal(Protocol):
    """A change's durable record of its progress (``engine/journal.Journal``)."""

    def done(self, step: str) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Outcome:
    change: Change
    status: Status
    error: str | None = None


def describe(change: Change) -> str:
    head = f"{change.kind} {change.name}: {change.action.value}"
    def attr(a: AttrChange) -> str:
        if a.after is None:  # a delete: say what goes
            return f"{a.field} {a.before}"
        return f"{a.field} {a.after}" + (f" (was {a.before})" if a.before is not None else "")

    if change.attrs:
        head += " " + ", ".join(attr(a) for a in change.attrs)
    return head


class Executor:
    def __init__(self, runner: OpRunner, *, stop: threading.Event | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 on_outcome: Callable[[Outcome], None] | None = None,
                 journal: Callable[[Change], ChangeJournal | None] | None = None) -> None:
        """``journal`` begins the journal of a change whose ops must not stop halfway
        unnoticed (None: it needs none); each op done is recorded in it, and it is closed
        when the last one is. A change that fails keeps its journal: the next run
        finishes it (``engine/finish.py``)."""
        self.runner = runner
        self.stop = stop or threading.Event()
        self.sleep = sleep
        self.on_outcome = on_outcome
        self.journal = journal

    def _run_op(self, op: Op) -> None:
        attempt = 0
        while True:
            attempt += 1
            try:
                self.runner.run(op)
                return
            except TemporaryError as exc:
                if attempt >= MAX_ATTEMPTS:
                    raise
                delay = min(MAX_DELAY, exc.delay * (2 ** (attempt - 1)))
                log.warning("%s: %s; retrying in %.1fs (attempt %d/%d)", op.name, exc, delay,
                            attempt + 1, MAX_ATTEMPTS)
                self.sleep(delay)

    def _run_change(self, change: Change) -> None:
        journal = self.journal(change) if self.journal is not None else None
        for i, op in enumerate(change.ops):
            self._run_op(op)
            if journal is not None:
                journal.done(f"op:{i}")
        if journal is not None:
            journal.close()

    def execute(self, plan: Plan) -> list[Outcome]:
        outcomes: list[Outcome] = []
        #: addresses of changes that failed, or were skipped for one that did
        failed: set[str] = set()
        for change in plan.actionable:
            waits = next((n for n in change.needs if n in failed), None)
            if self.stop.is_set():
                outcome = Outcome(change, "skipped")
            elif waits is not None:
                failed.add(change.address)
                outcome = Outcome(change, "skipped", f"blocked by {waits.replace('/', ' ', 1)}")
                log.warning("%s %s: skipped: blocked by %s", change.kind, change.name, waits)
            else:
                try:
                    self._run_change(change)
                    outcome = Outcome(change, "applied")
                    log.info("%s", describe(change))
                except ReconcilerError as exc:
                    failed.add(change.address)
                    outcome = Outcome(change, "failed", str(exc))
                    log.error("%s %s: %s failed: %s", change.kind, change.name,
                              change.action.value, exc)
            outcomes.append(outcome)
            if self.on_outcome is not None:
                self.on_outcome(outcome)
        return outcomes
