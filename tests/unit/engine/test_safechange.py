"""Safe change without a host (engine/safechange, cli/safe): the pending record and its
refusals, what a window refuses, the reverter that keeps trying, the revert that finishes
journals first and counts only what it changed, and where the lines go."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from reconciler.cli import safe
from reconciler.domain.errors import ConfigError, LockedError, PreconditionError
from reconciler.domain.live import LiveState
from reconciler.domain.plan import Plan
from reconciler.engine import lock, safechange
from reconciler.planner.checkpoint import take
from reconciler.planner.context import PlanOptions
from tests.support.checkpoints import pending_record

SCOPE = "netns/x"


@pytest.fixture
def state(tmp_path: Any, monkeypatch: Any) -> str:
    """A state directory and a lock directory of the test's own, one scope."""
    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(lock, "LOCK_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(safechange, "docker_scope", lambda: SCOPE)
    monkeypatch.setenv(safechange.BOOT_ID_ENV, "b")
    return safechange.scope_dir(SCOPE)


def _pending(deadline: float, *, applied: bool = True, pid: int | None = None,
             token: str = "t") -> safechange.Pending:
    return safechange.Pending(SCOPE, token, deadline, time.time(), "b",
                              take(LiveState(host_id="1")), revision="sha256:abc",
                              reverter_pid=pid, applied=applied)


def _args(**kw: Any) -> argparse.Namespace:
    base = {"lock_timeout": 1.0, "output": "text", "confirm_within": None, "adopt": None,
            "hostname": None}
    return argparse.Namespace(**{**base, **kw})


class _Rec:
    """What ``revert`` uses of a Reconciler: the order of its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.runner = object()

    def finish_journals(self) -> list[str]:
        self.calls.append("finish_journals")
        return []

    def close_probes(self) -> None:
        self.calls.append("close_probes")


def test_adopt_under_a_window_is_refused_before_anything_runs() -> None:
    args = _args(confirm_within=60.0, adopt=["bridge/theirs"])
    with pytest.raises(ConfigError, match="--adopt cannot be used with --confirm-within"):
        safe.attach(_Rec(), args, None, PlanOptions(adopt=frozenset({"bridge/theirs"})))
    # a saved plan's --adopt (its options, not the command line) is refused the same way
    with pytest.raises(ConfigError, match="--adopt"):
        safe.attach(_Rec(), _args(confirm_within=60.0), None,
                    PlanOptions(adopt=frozenset({"bridge/theirs"})))
    assert safe.attach(_Rec(), _args(adopt=["bridge/theirs"]), None,
                       PlanOptions(adopt=frozenset({"bridge/theirs"}))) is None


@pytest.mark.parametrize("epoch", [float("inf"), float("-inf"), float("nan"), 1e20, -1e300])
def test_iso_is_total(epoch: float) -> None:
    assert isinstance(safechange.iso(epoch), str)


@pytest.mark.parametrize("bad", ["inf", "nan", "-inf", "Infinity"])
def test_a_record_with_a_deadline_that_is_no_time_is_one_line(state: str, bad: str) -> None:
    safechange._write(state, _pending(time.time() + 60))
    path = os.path.join(state, safechange.PENDING)
    with open(path) as fh:
        raw = json.load(fh)
    raw["deadline"] = bad
    with open(path, "w") as fh:
        json.dump(raw, fh)
    with pytest.raises(PreconditionError, match="move it away") as exc:
        safechange.pending(SCOPE)
    assert "\n" not in str(exc.value)


def test_a_record_far_in_the_future_refuses_in_one_line(state: str, monkeypatch: Any) -> None:
    """A record an older version wrote with a huge window: the refusal is a line, not an
    OverflowError from formatting its deadline."""
    monkeypatch.setattr(safechange, "reverter_alive", lambda _p: True)
    safechange._write(state, _pending(1e20))
    with pytest.raises(PreconditionError, match="pending until"):
        safe.guard(_Rec())  # type: ignore[arg-type]


def test_guard_says_the_revert_on_stderr_for_json(state: str, monkeypatch: Any,
                                                  capsys: Any) -> None:
    safechange._write(state, _pending(time.time() - 1))
    monkeypatch.setattr(safechange, "revert", lambda *_a, **_k: safechange.RevertResult(
        outcomes=[], residual=Plan(()), plans=[]))
    safe.guard(_Rec(), err=True)  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert out == "" and "nothing to restore" in err and "overdue" in err, (out, err)


def test_a_revert_finishes_the_journals_before_it_observes(state: str,
                                                           monkeypatch: Any) -> None:
    rec = _Rec()
    p = _pending(time.time() - 1)
    safechange._write(state, p)

    def observe(r: Any, _cp: Any) -> tuple[LiveState, None]:
        r.calls.append("observe")
        return LiveState(host_id="1"), None

    monkeypatch.setattr(safechange, "observe_for", observe)
    result = safechange.revert(rec, p, why="test")
    assert result.ok and rec.calls[:2] == ["finish_journals", "observe"], rec.calls


def test_a_revert_that_changed_nothing_is_not_counted(state: str, monkeypatch: Any) -> None:
    """kill -9 between the record and the first op: the overdue "revert" restores nothing;
    it removes the record but is no revert of the revision (watch would refuse it)."""
    p = _pending(time.time() - 1)
    safechange._write(state, p)
    monkeypatch.setattr(safechange, "observe_for",
                        lambda *_a: (LiveState(host_id="1"), None))
    result = safechange.revert(_Rec(), p, why="test")
    assert result.ok and result.changed == 0
    assert safechange.pending(SCOPE) is None
    assert safechange.revert_count(SCOPE) == (0, None)


def test_confirm_refuses_a_change_whose_apply_did_not_finish(state: str, monkeypatch: Any,
                                                             capsys: Any) -> None:
    monkeypatch.setattr(safe, "Reconciler", _Rec)
    monkeypatch.setattr(safechange, "reverter_alive", lambda _p: True)  # the apply's own
    safechange._write(state, _pending(time.time() + 60, applied=False, pid=os.getpid()))
    assert safe.cmd_confirm(_args()) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not finished" in err[0] and "revert" in err[0], err
    assert safechange.pending(SCOPE) is not None  # still pending: the reverter reverts it


def test_confirm_says_a_change_reverted_meanwhile(state: str, monkeypatch: Any,
                                                  capsys: Any) -> None:
    """The record was there when confirm started and is gone once it holds the lock: the
    reverter was first (not "nothing is pending")."""
    monkeypatch.setattr(safe, "Reconciler", _Rec)
    safechange._write(state, _pending(time.time() - 1))
    real_lock = safe.host_lock

    @contextlib.contextmanager
    def lock_after_revert(timeout: float = 60.0, poll: float = 0.1) -> Iterator[None]:
        os.unlink(os.path.join(state, safechange.PENDING))  # the reverter's revert
        with real_lock(timeout, poll):
            yield

    monkeypatch.setattr(safe, "host_lock", lock_after_revert)
    assert safe.cmd_confirm(_args()) == 1
    err = capsys.readouterr().err
    assert "reverted" in err and "nothing is pending" not in err, err


def test_confirm_while_the_revert_holds_the_lock_says_so(state: str, monkeypatch: Any,
                                                         capsys: Any) -> None:
    monkeypatch.setattr(safe, "Reconciler", _Rec)
    safechange._write(state, _pending(time.time() - 1))

    @contextlib.contextmanager
    def held(timeout: float = 60.0, poll: float = 0.1) -> Iterator[None]:
        raise LockedError("another reconcile (pid 1) is changing this host")
        yield  # pragma: no cover

    monkeypatch.setattr(safe, "host_lock", held)
    assert safe.cmd_confirm(_args()) == 1
    assert "being reverted" in capsys.readouterr().err


def test_a_failed_revert_names_the_file_to_move_away(state: str, capsys: Any) -> None:
    p = _pending(time.time() - 1)
    bad = safechange.RevertResult(residual=None)
    assert not safe._report(bad, p, "test")
    err = capsys.readouterr().err
    assert os.path.join(state, safechange.PENDING) in err and "move" in err, err


def test_the_reverter_waits_for_the_lock_and_tries_again_after_a_failed_revert(
        state: str, monkeypatch: Any) -> None:
    p = _pending(time.time() - 1)
    safechange._write(state, p)
    monkeypatch.setattr(safe, "Reconciler", _Rec)
    monkeypatch.setattr(safe, "_sleep", lambda _s: None, raising=False)
    events: list[str] = []
    real_lock = safe.host_lock

    @contextlib.contextmanager
    def flaky_lock(timeout: float = 60.0, poll: float = 0.1) -> Iterator[None]:
        if "locked" not in events:
            events.append("locked")
            raise LockedError("another reconcile (pid 1) is changing this host")
        with real_lock(timeout, poll):
            yield

    def revert(_rec: Any, current: safechange.Pending, *, why: str) -> Any:
        if "failed" not in events:
            events.append("failed")
            return safechange.RevertResult(residual=None)  # did not complete: stays pending
        if "docker" not in events:
            events.append("docker")
            raise PreconditionError("docker: the daemon is restarting")
        events.append("reverted")
        os.unlink(os.path.join(state, safechange.PENDING))
        return safechange.RevertResult(residual=Plan(()))

    monkeypatch.setattr(safe, "host_lock", flaky_lock)
    monkeypatch.setattr(safechange, "revert", revert)
    assert safe._reverter("t") == 0
    assert events == ["locked", "failed", "docker", "reverted"], events


def test_the_reverter_stops_when_the_record_goes(state: str, monkeypatch: Any) -> None:
    """A revert that keeps failing is retried while the record is there; moving the record
    away (the way out the error names) ends it."""
    safechange._write(state, _pending(time.time() - 1))
    monkeypatch.setattr(safe, "Reconciler", _Rec)
    tries: list[int] = []

    def revert(*_a: Any, **_k: Any) -> Any:
        tries.append(1)
        if len(tries) == 3:
            os.unlink(os.path.join(state, safechange.PENDING))
        return safechange.RevertResult(residual=None)

    monkeypatch.setattr(safe, "_sleep", lambda _s: None, raising=False)
    monkeypatch.setattr(safechange, "revert", revert)
    assert safe._reverter("t") == 1
    assert len(tries) == 3


def test_settle_respawns_a_reverter_that_died(state: str, monkeypatch: Any) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    p = _pending(time.time() + 60, applied=False, pid=dead.pid)
    safechange._write(state, p)
    spawned: list[str] = []

    def spawn(q: safechange.Pending) -> int:
        spawned.append(q.token)
        return os.getpid()

    monkeypatch.setattr(safechange, "spawn_reverter", spawn)
    w = safe.Window(_Rec(), _args(confirm_within=60.0), None)  # type: ignore[arg-type]
    w.pending = p

    class _Result:
        ok = True
        residual = None

    w.settle(_Result(), stopped=False)  # type: ignore[arg-type]
    now = safechange.pending(SCOPE)
    assert spawned == ["t"] and now is not None and now.reverter_pid == os.getpid()
    assert now.applied and w.outcome == "pending"


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read()


def test_a_live_reverter_is_not_respawned(state: str, monkeypatch: Any) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "t"])
    try:
        p = _pending(time.time() + 60, applied=False, pid=live.pid)
        assert safechange.reverter_alive(p)  # even while it is still being exec'd
        end = time.monotonic() + 10
        while not _cmdline(live.pid):
            assert time.monotonic() < end
            time.sleep(0.01)
        assert safechange.reverter_alive(p)
        assert not safechange.reverter_alive(_pending(time.time() + 60, pid=live.pid,
                                                      token="other"))
    finally:
        live.kill()
        live.wait()
    assert not safechange.reverter_alive(p)


def test_gc_runs_the_guard_under_its_lock_before_anything(state: str) -> None:
    from reconciler.engine.gc import Collector

    class _Nothing:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"gc touched {name} before the guard")

    called: list[str] = []

    def guard() -> None:
        called.append("guard")
        raise PreconditionError("a change is pending until then; nothing changed")

    c = Collector(_Nothing(), runner=_Nothing(), journals=_Nothing())  # type: ignore[arg-type]
    with pytest.raises(PreconditionError, match="pending"):
        c.collect(None, 1.0, before=guard)
    assert called == ["guard"]


def test_gc_is_refused_while_a_change_is_pending(state: str, monkeypatch: Any) -> None:
    from reconciler.cli import commands
    from reconciler.engine import gc

    safechange._write(state, _pending(time.time() + 60))
    collected: list[str] = []

    class _Collector:
        def __init__(self) -> None:
            self.observer, self.runner, self.stop = object(), object(), None

        def collect(self, _desired: Any, _timeout: float, before: Any = None) -> Any:
            if before is not None:
                before()
            collected.append("collected")
            raise AssertionError("gc collected during a pending window")

    monkeypatch.setattr(gc, "Collector", _Collector)
    args = _args(paths=[], dry_run=False, verbose=0)
    with pytest.raises(PreconditionError, match="pending until"):
        commands.cmd_gc(args)
    assert collected == []


def test_the_reverter_probes_only_the_files_of_the_change(state: str, tmp_path: Any) -> None:
    from reconciler.config.load import load

    cfg = tmp_path / "c.yaml"
    cfg.write_text("version: 1\n")
    desired = load([str(cfg)], hostname="h")
    probed: list[int] = []

    class _Prober:
        def probe(self, _desired: Any, request: Any = None) -> list[Any]:
            probed.append(1)
            return []

    p = safechange.Pending(SCOPE, "t", time.time() + 60, time.time(), "b",
                           take(LiveState(host_id="1")), files=desired.file_hashes,
                           probe={"external": False, "timeout": 1.0, "hostname": "h"},
                           applied=True)
    said: set[str] = set()
    prober: Any = _Prober()
    assert safe._holds(prober, p, said) and probed == [1]
    cfg.write_text("version: 1\n# a newer revision\n")
    assert safe._holds(prober, p, said) and probed == [1], "probed other files"
    assert said == {"files"}


def test_pending_is_overdue_after_its_deadline_or_a_reboot(monkeypatch: Any) -> None:
    monkeypatch.setenv(safechange.BOOT_ID_ENV, "boot-1")
    assert not pending_record(time.time() + 60, "boot-1").overdue
    assert pending_record(time.time() - 1, "boot-1").overdue
    assert pending_record(time.time() + 60, "boot-0").overdue
    line = safechange.refusal(pending_record(time.time() + 60, "boot-1"))
    assert "pending until 20" in line and "nothing changed" in line and "\n" not in line


def test_a_pending_record_round_trips_and_a_bad_one_is_one_line(tmp_path: Any,
                                                                monkeypatch: Any) -> None:
    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    p = pending_record(time.time() + 60, "b")
    directory = safechange.scope_dir("netns/x")
    safechange._write(directory, p)
    assert safechange.pending("netns/x") == p
    with open(os.path.join(directory, "pending.json"), "w") as fh:
        json.dump({"version": 1, "scope": "x"}, fh)
    with pytest.raises(PreconditionError, match="not a pending change this version can read"):
        safechange.pending("netns/x")


def test_reading_makes_no_state_directory(tmp_path: Any, monkeypatch: Any) -> None:
    """An apply without a window asks whether something is pending: that must not need a
    writable /var/lib (a read-only image), nor leave a directory behind."""
    root = tmp_path / "state"
    monkeypatch.setenv("RECONCILER_STATE_DIR", str(root))
    assert safechange.pending("host") is None
    assert safechange.revert_count("host") == (0, None)
    assert not root.exists()
