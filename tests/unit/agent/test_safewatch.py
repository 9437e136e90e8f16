"""The watch agent and pending changes (agent/safewatch), through whole passes: a change an
operator starts while the agent plans holds the agent's apply back, and the agent confirms
its own change by probing what it applied, not what the files say now."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from reconciler.agent.loop import Agent
from reconciler.agent.passes import WatchOptions
from reconciler.domain.plan import Plan
from reconciler.engine import lock as lock_mod
from reconciler.engine import safechange
from reconciler.engine.reconcile import ProbeRequest
from reconciler.planner.checkpoint import take
from tests.support.agentfake import BR, FakeReconciler, replace_file
from tests.support.checkpoints import live_host, pending_record


@dataclass
class GapReconciler(FakeReconciler):
    """FakeReconciler whose plan can run something (an operator's apply starting in the gap
    between the agent's gate and its apply), and whose probes say
    which desired state they were asked about."""

    during_plan: Any = None
    probed: list[Any] = field(default_factory=list)

    def _plan(self, desired: Any) -> Plan:
        return Plan(super()._plan(desired).changes, files=desired.file_hashes)

    def plan(self, desired: Any, options: Any) -> Plan:
        if self.during_plan is not None:
            self.during_plan()
            self.during_plan = None
        return self._plan(desired)

    def probe(self, desired: Any, live: Any = None, **_kw: Any) -> list[Any]:
        self.probed.append(desired)
        return []

    @property
    def observer(self) -> Any:
        class Obs:
            handles = None  # what safechange.begin is handed (faked here)

        return Obs()


class Wall:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(lock_mod, "LOCK_DIR", str(tmp_path / "lock"))
    monkeypatch.setattr("reconciler.agent.loop.git_revision", lambda paths: None)
    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv(safechange.BOOT_ID_ENV, "boot-1")
    monkeypatch.setattr(safechange, "docker_scope", lambda: "netns/x")
    conf = tmp_path / "conf"
    conf.mkdir()
    fakes: list[GapReconciler] = []

    def make(stop: threading.Event) -> Any:
        fakes.append(GapReconciler(stop))
        return fakes[-1]

    def agent(**options: Any) -> tuple[Agent, GapReconciler, Wall]:
        wall = Wall()
        a = Agent(WatchOptions(paths=(str(conf),), hostname="web-1", **options),
                  reconciler_factory=make, wall=wall)
        return a, fakes[-1], wall

    return agent, conf


def _begin(live: Any, handles: Any, plan: Plan, *, seconds: float, probe: Any,
           hostname: Any, revision: Any) -> tuple[safechange.Pending, Plan]:
    """safechange.begin without a reverter process: the record of the plan's files."""
    return _record("agent", seconds, plan.files, revision, applied=False), plan


def _record(token: str, seconds: float = 60.0, files: Any = (), revision: Any = None,
            applied: bool = True) -> safechange.Pending:
    p = safechange.Pending("netns/x", token, time.time() + seconds, time.time(), "boot-1",
                           take(live_host()), files=tuple(files), revision=revision,
                           applied=applied)
    safechange._write(safechange.scope_dir("netns/x"), p)
    return p


def test_an_operators_change_started_while_the_agent_plans_holds_its_apply(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """gate() saw nothing pending; an `apply --confirm-within` took the lock and made its
    change while the agent planned: the agent's apply, under the lock, must see it and
    leave the host alone (the pass is pending), without a window of its own too."""
    make, conf = env
    monkeypatch.setattr(safechange, "begin", _begin)
    for window in (None, 30.0):
        agent, rec, _wall = make(confirm_within=window)
        replace_file(conf / "a.yaml", BR.format(name=f"br{int(window or 0)}", mtu=1400))
        rec.during_plan = lambda: _record("operator")
        report = agent.run_pass(["files changed"])
        assert report.result == "pending", (window, report)
        assert "reconcile confirm" in str(report.error) and "nothing changed" in str(report.error)
        assert rec.applied == [] and rec.live_mtu == {}, window
        assert safechange.pending() is not None and safechange.pending().token == "operator"
        assert agent.safe.own is None
        safechange.confirm(safechange.pending())  # the operator confirms: the agent goes on
        assert agent.run_pass(["files changed"]).result == "applied"
        assert rec.live_mtu == {f"br{int(window or 0)}": 1400}


def test_the_agent_confirms_by_probing_what_it_applied_not_the_newer_files(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Revision A is applied under the agent's window; the files move on to B before the
    window ends: the confirm probes A (the record's files), never B, whose allocations the
    host does not have yet."""
    make, conf = env
    monkeypatch.setattr(safechange, "begin", _begin)
    agent, rec, wall = make(confirm_within=30.0, probe=ProbeRequest(),
                            probe_interval=None)
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    assert agent.run_pass(["startup"]).result == "applied"
    p = safechange.pending()
    assert p is not None and p.token == "agent" and p.files
    applied = rec.probed[-1] if rec.probed else None
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1450))  # revision B
    rec.probed.clear()
    wall.now += 31.0  # the window has passed
    report = agent.run_pass(["confirm window"])
    assert rec.probed, "the confirm ran no probes"
    assert all(d.file_hashes == p.files for d in rec.probed), \
        [d.bridges["br0"].mtu for d in rec.probed]
    assert all(d.bridges["br0"].mtu == 1400 for d in rec.probed)
    assert applied is None or applied.bridges["br0"].mtu == 1400
    # confirmed; B is then a new revision with a window of its own
    assert report.result == "applied" and rec.live_mtu == {"br0": 1450}
    assert safechange.pending() is not None and safechange.pending().revision != p.revision


def test_a_pending_change_whose_files_are_not_the_agents_is_not_probed(
        env: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The agent's own record names files that are not the ones it applied (the record was
    replaced in the meantime with the same token): no probe of the wrong files, no confirm
    on them; the log says so and the reverter's deadline decides."""
    make, conf = env

    def begin(live: Any, handles: Any, plan: Plan, *, seconds: float, probe: Any,
              hostname: Any, revision: Any) -> tuple[safechange.Pending, Plan]:
        return _record("agent", seconds, (("/elsewhere.yaml", "0" * 64),), revision,
                       applied=False), plan

    monkeypatch.setattr(safechange, "begin", begin)
    agent, rec, wall = make(confirm_within=30.0, probe=ProbeRequest(), probe_interval=None)
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    assert agent.run_pass(["startup"]).result == "applied"
    rec.probed.clear()
    wall.now += 31.0
    caplog.set_level("WARNING", logger="reconciler.watch")
    report = agent.run_pass(["confirm window"])
    assert rec.probed == [] and report.result == "pending"
    assert safechange.pending() is not None  # not confirmed
    assert "not probed" in caplog.text


def test_a_pass_held_by_a_change_asks_for_a_pass_at_its_deadline(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent held back by a change it does not own (an operator's, or its own from before
    a restart: a stop of the unit kills its reverter) reverts it at its deadline, not at the
    next resync (an hour later with --interval 3600)."""
    make, conf = env
    monkeypatch.setattr(safechange, "begin", _begin)
    for where in ("gate", "apply"):
        agent, rec, _wall = make(interval=3600.0)
        asked: list[tuple[str, float]] = []
        monkeypatch.setattr(agent.trigger, "request",
                            lambda why, delay=0.0, asked=asked, **_kw: asked.append((why, delay)))
        replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
        if where == "gate":
            _record("before-restart", 5.0)
        else:
            rec.during_plan = lambda: _record("operator", 5.0)
        assert agent.run_pass(["startup"]).result == "pending", where
        p = safechange.pending()
        assert p is not None
        due = [d for _why, d in asked if 0 < d - (p.deadline - time.time()) < 5]
        assert due, (where, asked)
        safechange.confirm(p)


class _Board:
    def __init__(self) -> None:
        self.doc: dict[str, Any] = {}

    def update(self, **fields: Any) -> None:
        self.doc.update(fields)


class _Gauge:
    def __init__(self) -> None:
        self.value = 0.0

    def set(self, v: float) -> None:
        self.value = v

    def inc(self, v: float = 1.0) -> None:
        self.value += v


class _Metrics:
    def __init__(self) -> None:
        self.pending_change, self.reverts = _Gauge(), _Gauge()


@pytest.fixture
def watch(tmp_path: Any, monkeypatch: Any) -> Any:
    from reconciler.agent.safewatch import SafeWatch

    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(safechange, "docker_scope", lambda: "netns/x")
    board, metrics = _Board(), _Metrics()
    return SafeWatch(30.0, board, metrics, None, None), board, metrics


def _lock() -> Any:
    import contextlib

    return contextlib.nullcontext()


def test_the_agent_is_held_back_by_an_operators_pending_change(watch: Any,
                                                             monkeypatch: Any) -> None:
    sw, board, metrics = watch
    monkeypatch.setenv(safechange.BOOT_ID_ENV, "b")
    assert board.doc == {"pending": None, "reverted_revision": None}
    monkeypatch.setattr(safechange, "reverter_alive", lambda _p: True)  # the operator's
    safechange._write(safechange.scope_dir("netns/x"), dataclasses.replace(
        pending_record(time.time() + 60, "b"), applied=True, reverter_pid=os.getpid()))
    held = sw.gate(None, None, "rev1", _lock)
    assert held is not None and "pending until" in held
    assert board.doc["pending"]["deadline"].endswith("Z") and metrics.pending_change.value == 1


def test_a_reverted_revision_is_not_applied_again_until_the_files_change(watch: Any) -> None:
    sw, board, metrics = watch
    statedir_dir = safechange.scope_dir("netns/x")
    from reconciler.drivers import statedir

    statedir.write_record(statedir_dir, safechange.REVERTS,
                          {"count": 1, "last_revision": "sha256:aaa"})
    assert "was reverted" in str(sw.gate(None, None, "sha256:aaa", _lock))
    assert sw.gate(None, None, "sha256:bbb", _lock) is None
    sw.publish()
    assert board.doc["reverted_revision"] == "sha256:aaa" and metrics.reverts.value == 1


def test_status_says_what_is_pending_and_what_was_reverted() -> None:
    from reconciler.agent.status import render

    text = render({"pending": {"deadline": "2026-12-01T14:27:57Z", "revision": "abc123"},
                   "reverted_revision": "sha256:0f0f", "paths": []})
    assert "pending: a change of revision abc123 until 2026-12-01T14:27:57Z" in text
    assert "reverted: revision sha256:0f0f" in text
    assert "pending" not in render({"pending": None, "reverted_revision": None, "paths": []})


def test_a_change_its_reverter_undid_is_no_longer_shown_pending(watch: Any,
                                                                monkeypatch: Any) -> None:
    """The agent showed an operator's pending change, then the change's own reverter undid it
    at the deadline before an agent pass did: the next pass finds no record, and the status
    (and /readyz) must stop saying a change waits for confirmation."""
    sw, board, metrics = watch
    monkeypatch.setenv(safechange.BOOT_ID_ENV, "b")
    monkeypatch.setattr(safechange, "reverter_alive", lambda _p: True)
    directory = safechange.scope_dir("netns/x")
    safechange._write(directory, dataclasses.replace(
        pending_record(time.time() + 60, "b"), applied=True, reverter_pid=os.getpid()))
    assert sw.gate(None, None, "rev1", _lock) is not None
    assert board.doc["pending"] is not None and metrics.pending_change.value == 1
    os.unlink(os.path.join(directory, safechange.PENDING))  # the reverter's revert, done
    assert sw.gate(None, None, "rev1", _lock) is None
    assert board.doc["pending"] is None and metrics.pending_change.value == 0
