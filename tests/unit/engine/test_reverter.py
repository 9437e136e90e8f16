"""A missing reverter is started by whoever reads the scope next; a record that changed
nothing is dropped.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest

from reconciler.agent.safewatch import SafeWatch
from reconciler.cli import safe
from reconciler.domain.errors import PreconditionError
from reconciler.domain.live import (
    LiveState,
)
from reconciler.engine import lock, reconcile, safechange
from reconciler.planner.checkpoint import take

# ------------------------------------------------------------------ a killed reverter

SCOPE = "netns/x"


@pytest.fixture
def state(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A state and a lock directory of the test's own; what spawning a reverter would start
    (the tokens), never a process."""
    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(lock, "LOCK_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(safechange, "docker_scope", lambda: SCOPE)
    monkeypatch.setenv(safechange.BOOT_ID_ENV, "b")
    spawned: list[str] = []

    def spawn(p: safechange.Pending) -> int:
        spawned.append(p.token)
        return 4242

    monkeypatch.setattr(safechange, "spawn_reverter", spawn)
    monkeypatch.setattr(safechange, "reverter_alive", lambda p: p.reverter_pid == 4242)
    return spawned


def _record(*, applied: bool = True, pid: int | None = 999, overdue: bool = False) -> None:
    p = safechange.Pending(SCOPE, "t", time.time() + (-1 if overdue else 60), time.time(), "b",
                           take(LiveState(host_id="1")), reverter_pid=pid, applied=applied)
    safechange._write(safechange.scope_dir(SCOPE), p)


def test_a_command_refused_by_a_pending_change_starts_its_missing_reverter(
        state: list[str]) -> None:
    _record(pid=999)  # its reverter was killed
    with pytest.raises(PreconditionError, match="pending until"):
        safe.guard(reconcile.Reconciler.__new__(reconcile.Reconciler))
    now = safechange.pending(SCOPE)
    assert state == ["t"] and now is not None and now.reverter_pid == 4242
    with pytest.raises(PreconditionError, match="pending until"):
        safe.guard(reconcile.Reconciler.__new__(reconcile.Reconciler))
    assert state == ["t"]  # a live one is left alone


def test_a_record_whose_change_never_started_is_dropped_not_refused(state: list[str]) -> None:
    _record(applied=False, pid=None)  # killed between the record and the spawn
    safe.guard(reconcile.Reconciler.__new__(reconcile.Reconciler))
    assert safechange.pending(SCOPE) is None and state == []


def test_plan_starts_a_missing_reverter_when_the_lock_is_free(state: list[str],
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    _record(applied=False, pid=None)
    safe.tend()  # a change that never started is the next guard's to drop, not plan's
    assert state == [] and safechange.pending(SCOPE) is not None
    _record(pid=999)
    with lock.host_lock(1):  # someone is changing the host: not now
        safe.tend()
    assert state == []
    safe.tend()
    now = safechange.pending(SCOPE)
    assert state == ["t"] and now is not None and now.reverter_pid == 4242


class _Gauge:
    def set(self, _v: float) -> None:
        pass

    def inc(self, _v: float = 1.0) -> None:
        pass


class _Metrics:
    pending_change = reverts = _Gauge()


class _Board:
    def update(self, **_fields: object) -> None:
        pass


def test_the_agent_starts_a_missing_reverter_and_drops_a_change_that_never_started(
        state: list[str]) -> None:
    watch = SafeWatch(None, _Board(), _Metrics(), None, None)
    _record(pid=999)
    held = watch.gate(None, None, "rev", contextlib.nullcontext)  # type: ignore[arg-type]
    assert held is not None and "pending until" in held
    now = safechange.pending(SCOPE)
    assert state == ["t"] and now is not None and now.reverter_pid == 4242
    _record(applied=False, pid=None)
    assert watch.gate(None, None, "rev", contextlib.nullcontext) is None  # type: ignore[arg-type]
    assert safechange.pending(SCOPE) is None


