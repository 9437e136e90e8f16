"""The probe surface: apply probes what it changed, `verify`'s options and output, the
watch agent's handling of probe failures (heal once when ours, report otherwise).

The prober is faked at our own boundary (``Reconciler(prober=...)``); the real probes
are tested against the kernel in tests/integration/test_probes.py and test_breakage.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import threading
import time
from collections.abc import Collection
from typing import Any

import pytest

from reconciler.agent.loop import Agent
from reconciler.agent.passes import PROBE, PROBE_HEAL, PassReport, WatchOptions
from reconciler.agent.status import healthy_doc, render
from reconciler.domain.live import LiveState
from reconciler.domain.model import DesiredState
from reconciler.domain.probes import ProbeResult
from reconciler.engine.reconcile import ProbeRequest, Reconciler
from reconciler.planner import PlanOptions
from reconciler.ui import probes as view
from reconciler.ui.options import probe_request
from reconciler.ui.parser import build_parser, duration

from .fakehost import FakeHost
from .test_allocs_planner import alloc, port, state


class FakeProber:
    """Answers every probe with what ``answer`` says; remembers what it was asked."""

    def __init__(self, answer: Any = None) -> None:
        self.calls: list[tuple[Collection[str] | None, bool, float]] = []
        self.answer = answer or (lambda a: [ProbeResult(a, "gateway", "icmp", None, True)])
        self.closed = 0

    def run(self, desired: DesiredState, live: LiveState, *,
            allocs: Collection[str] | None = None, external: bool = False,
            timeout: float = 1.0) -> list[ProbeResult]:
        self.calls.append((None if allocs is None else set(allocs), external, timeout))
        names = sorted(desired.allocs) if allocs is None else sorted(allocs)
        return [r for a in names for r in self.answer(a)]

    def close(self) -> None:
        self.closed += 1


def _rec(host: FakeHost, prober: FakeProber) -> Reconciler:
    return Reconciler(host, runner=host, sleep=lambda _s: None,  # type: ignore[arg-type]
                      prober=lambda _handles: prober)


# --------------------------------------------------------------------------- apply


def test_apply_probes_only_what_it_changed_and_only_after_converging() -> None:
    host, prober = FakeHost(), FakeProber()
    rec = _rec(host, prober)
    first = state(alloc("a1", port(8080, 80)))
    result = rec.apply(first, PlanOptions(), probe=ProbeRequest(external=True, timeout=0.5))
    assert result.ok and [r.alloc for r in result.probes] == ["a1"]
    assert prober.calls == [({"a1"}, True, 0.5)]
    # a second allocation: only it is probed; nothing to change: nothing probed
    second = state(alloc("a1", port(8080, 80)), alloc("a2"))
    result = rec.apply(second, PlanOptions(), probe=ProbeRequest())
    assert result.ok and prober.calls[-1][0] == {"a2"}
    calls = len(prober.calls)
    result = rec.apply(second, PlanOptions(), probe=ProbeRequest())
    assert result.ok and not result.probes and len(prober.calls) == calls
    # without a request (the library default, unit tests, destroy) nothing is probed
    rec.apply(state(alloc("a3")), PlanOptions())
    assert len(prober.calls) == calls


def test_a_failed_probe_fails_the_apply_a_skipped_one_does_not() -> None:
    def answer(a: str) -> list[ProbeResult]:
        return [ProbeResult(a, "gateway", "icmp", None, True),
                ProbeResult(a, "host", "tcp", 8080, False, skipped=True,
                            cause="no host address"),
                ProbeResult(a, "hairpin", "tcp", 8080, a != "bad",
                            cause=None if a != "bad" else "hairpin off on vethX")]

    host, prober = FakeHost(), FakeProber(answer)
    good = _rec(host, prober).apply(state(alloc("good", port(8080, 80))), PlanOptions(),
                                    probe=ProbeRequest())
    assert good.ok and not good.probe_failures
    bad = _rec(FakeHost(), prober).apply(state(alloc("bad", port(8080, 80))), PlanOptions(),
                                         probe=ProbeRequest())
    assert not bad.ok and not bad.failed and bad.residual is not None
    assert [view.failure_line(r) for r in bad.probe_failures] == [
        "probe failed: alloc bad path hairpin (tcp 8080): hairpin off on vethX"]


def test_close_probes_closes_the_prober_once_and_a_new_one_is_made_after() -> None:
    host, prober = FakeHost(), FakeProber()
    made: list[FakeProber] = []

    def make(_handles: Any) -> FakeProber:
        made.append(prober)
        return prober

    rec = Reconciler(host, runner=host, sleep=lambda _s: None,  # type: ignore[arg-type]
                     prober=make)
    rec.close_probes()  # nothing made yet: nothing to close
    assert prober.closed == 0
    rec.probe(state(alloc("a1")))
    rec.probe(state(alloc("a1")))
    assert len(made) == 1
    rec.close_probes()
    rec.close_probes()
    assert prober.closed == 1
    rec.probe(state(alloc("a1")))
    assert len(made) == 2


# --------------------------------------------------------------------------- options, output


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 30.0), ("1.5", 1.5), ("250ms", 0.25), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0),
    (" 2S ", 2.0)])
def test_durations(text: str, seconds: float) -> None:
    assert duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "0", "-1s", "abc", "5d", "nan", "inf", "1e999s", "ms"])
def test_bad_durations_are_usage_errors(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        duration(text)
    with pytest.raises(SystemExit) as exc:
        _args("apply", "f.yaml", f"--probe-timeout={text}")
    assert exc.value.code == 1  # exit 2 means "changes present" in this tool
    assert "is not a duration" in capsys.readouterr().err


def test_external_vantage_is_on_in_a_sandbox_and_off_on_the_host() -> None:
    assert probe_request(_args("apply", "f.yaml")) == ProbeRequest(external=False)
    assert probe_request(_args("--netns", "box", "apply", "f.yaml")) == \
        ProbeRequest(external=True)
    assert probe_request(_args("--netns", "box", "verify", "f.yaml",
                               "--no-probe-external")) == ProbeRequest(external=False)
    assert probe_request(_args("verify", "f.yaml", "--probe-external",
                               "--probe-timeout", "300ms")) == \
        ProbeRequest(external=True, timeout=0.3)
    assert probe_request(_args("apply", "f.yaml", "--no-probe")) is None
    assert probe_request(_args("watch", "d", "--no-probe")) is None


def test_watch_probe_interval() -> None:
    assert _args("watch", "d").probe_interval == 30.0
    assert _args("watch", "d", "--probe-interval", "2m").probe_interval == 120.0
    assert _args("watch", "d", "--probe-interval", "off").probe_interval is None


def test_summary_and_lines() -> None:
    results = [
        ProbeResult("a", "gateway", "icmp", None, True, ms=0.4),
        ProbeResult("a", "host", "tcp", 80, False, skipped=True, cause="no host address"),
        ProbeResult("a", "hairpin", "udp", 53, False, cause="a foreign DROP in filter FORWARD",
                    family=6),
    ]
    out = view.text(results, took=0.0123)
    assert out.splitlines() == [
        "probe failed: alloc a path hairpin (udp 53, ipv6): a foreign DROP in filter FORWARD",
        "Probes: 1 held, 1 failed, 1 skipped (no host address) in 12 ms."]
    verbose = view.text(results, verbose=True).splitlines()
    assert verbose[0] == "probe alloc a path gateway (icmp): held in 0.4 ms"
    assert verbose[1] == "probe alloc a path host (tcp 80): skipped: no host address"
    assert view.to_json(results)[2] == {
        "alloc": "a", "path": "hairpin", "proto": "udp", "port": 53, "ok": False,
        "skipped": False, "cause": "a foreign DROP in filter FORWARD", "ms": 0.0, "family": 6}


# --------------------------------------------------------------------------- the agent


@dataclasses.dataclass
class ProbingReconciler:
    """What the agent needs of a Reconciler: converged passes and probes on demand."""

    stop: threading.Event
    prober: FakeProber
    last_live: Any = None
    applies: int = 0
    closed: int = 0

    def journals_pending(self) -> bool:
        return False  # no killed run left a change half done (test_watch_logic checks one)

    def plan(self, desired: Any, options: Any) -> Any:
        from reconciler.domain.plan import Plan  # noqa: PLC0415 (test helper)

        return Plan()

    def probe(self, desired: Any, live: Any = None, *, allocs: Any = None,
              request: ProbeRequest | None = None) -> list[ProbeResult]:
        request = request or ProbeRequest()
        return self.prober.run(desired, live, allocs=allocs, external=request.external,
                               timeout=request.timeout)

    def close_probes(self) -> None:
        self.closed += 1


@pytest.fixture
def probing_agent(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr("reconciler.agent.loop.git_revision", lambda paths: None)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "a.yaml").write_text(
        "version: 1\nbridges: [{name: br0}]\n"
        "subnets: [{name: net, bridge: br0, cidr: 10.9.0.0/24}]\n"
        "allocs:\n  - {id: a1, subnet: net, ports: [{host: 8080, to: 80}]}\n"
        "  - {id: a2, subnet: net}\n")
    broken: dict[str, ProbeResult] = {}

    def answer(a: str) -> list[ProbeResult]:
        ok = [ProbeResult(a, "gateway", "icmp", None, True)]
        return [broken[a]] if a in broken else ok

    prober = FakeProber(answer)
    made: list[ProbingReconciler] = []

    def make(stop: threading.Event) -> Any:
        made.append(ProbingReconciler(stop, prober))
        return made[-1]

    def build(**opts: Any) -> Agent:
        return Agent(WatchOptions(paths=(str(conf),), hostname="h", **opts),
                     reconciler_factory=make)

    return build, broken, prober


def _pass(agent: Agent, *reasons: str) -> PassReport | None:
    """What ``Agent.run`` does with these reasons: the probe timer alone probes, no pass."""
    if list(reasons) == [PROBE]:
        agent.probe_run()
        return None
    report = agent.run_pass(list(reasons))
    agent.after_probes(list(reasons), report)
    return report


def _gauge(agent: Agent) -> dict[tuple[str, str], float]:
    out = {}
    for metric in agent.metrics.registry.collect():
        if metric.name == "reconciler_probe_failures":
            for s in metric.samples:
                out[(s.labels["alloc"], s.labels["path"])] = s.value
    return out


def test_probe_timer_probes_everything_and_reports_a_foreign_cause(
        probing_agent: Any, caplog: pytest.LogCaptureFixture) -> None:
    build, broken, prober = probing_agent
    agent = build()
    report = _pass(agent, "startup")
    assert report is not None and report.result == "ok"
    assert prober.calls[-1][0] is None  # every allocation
    assert agent.board.get("probes")["held"] == 2 and not _gauge(agent)
    broken["a1"] = ProbeResult("a1", "host", "tcp", 8080, False,
                               cause="a foreign DROP in filter FORWARD (-j DROP)")
    caplog.set_level(logging.INFO, logger="reconciler.watch")
    _pass(agent, PROBE)
    assert _gauge(agent) == {("a1", "host"): 1.0}
    doc = agent.board.snapshot()
    assert doc["probes"]["failed"] == 1
    assert doc["probes"]["failures"][0]["cause"].startswith("a foreign DROP")
    assert not doc["probes"]["failures"][0]["ours"]
    assert not healthy_doc(doc) and "alloc a1 path host (tcp 8080): a foreign DROP" in render(doc)
    assert "probe failed: alloc a1 path host (tcp 8080): a foreign DROP" in caplog.text
    assert PROBE_HEAL not in agent.scheduler.pending()  # not ours: reported, no pass
    # the same failure again: no new log line; then it clears: the gauge's label goes
    caplog.clear()
    _pass(agent, PROBE)
    assert "probe failed" not in caplog.text
    del broken["a1"]
    _pass(agent, PROBE)
    assert _gauge(agent) == {} and "probe holds again: alloc a1 path host" in caplog.text
    assert healthy_doc(agent.board.snapshot())


def test_a_failure_we_own_asks_for_one_pass_then_is_reported(
        probing_agent: Any, caplog: pytest.LogCaptureFixture) -> None:
    build, broken, prober = probing_agent
    agent = build()
    _pass(agent, "startup")
    broken["a2"] = ProbeResult("a2", "gateway", "icmp", None, False,
                               cause="no route to 10.9.0.3", ours=True)
    _pass(agent, PROBE)
    assert PROBE_HEAL in agent.scheduler.pending()
    assert "running a pass" in caplog.text
    agent.scheduler.take(float("inf"))
    # the heal pass probes the failing allocations only; still failing: reported, no loop
    _pass(agent, PROBE_HEAL)
    assert prober.calls[-1][0] == {"a2"}
    assert PROBE_HEAL not in agent.scheduler.pending()
    assert "still fails after a pass" in caplog.text
    _pass(agent, PROBE)
    assert PROBE_HEAL not in agent.scheduler.pending()
    # healed, then broken again: a new episode asks for a pass again
    del broken["a2"]
    _pass(agent, PROBE)
    broken["a2"] = ProbeResult("a2", "gateway", "icmp", None, False, cause="x", ours=True)
    _pass(agent, PROBE)
    assert PROBE_HEAL in agent.scheduler.pending()


def test_dry_run_reports_a_failure_we_own_without_a_pass(probing_agent: Any) -> None:
    build, broken, _prober = probing_agent
    agent = build(dry_run=True)
    broken["a1"] = ProbeResult("a1", "gateway", "icmp", None, False, cause="x", ours=True)
    _pass(agent, "startup")
    assert _gauge(agent) == {("a1", "gateway"): 1.0}
    assert PROBE_HEAL not in agent.scheduler.pending()


def test_no_probe_means_no_probes(probing_agent: Any) -> None:
    build, _broken, prober = probing_agent
    agent = build(probe=None)
    _pass(agent, "startup")
    _pass(agent, PROBE)
    assert prober.calls == [] and agent.board.get("probes") is None


def test_results_of_undeclared_allocations_are_dropped(probing_agent: Any) -> None:
    build, broken, _prober = probing_agent
    agent = build()
    broken["gone"] = ProbeResult("gone", "gateway", "icmp", None, False, cause="x")
    _pass(agent, "startup")
    agent.take_probes([broken["gone"]])
    assert _gauge(agent) == {} and agent.board.get("probes")["failed"] == 0


def test_the_probe_timer_alone_runs_no_pass(probing_agent: Any) -> None:
    build, _broken, prober = probing_agent
    agent = build()
    _pass(agent, "startup")
    passes = agent.pass_count
    agent.probe_run()
    assert agent.pass_count == passes and prober.calls[-1][0] is None
    assert agent.board.get("probes")["probed"] == 2


def test_what_a_pass_applied_and_probed_is_taken_in(probing_agent: Any) -> None:
    build, _broken, prober = probing_agent
    agent = build()
    _pass(agent, "startup")
    calls = len(prober.calls)
    report = agent.run_pass(["files changed"])
    report.probes = [ProbeResult("a1", "hairpin", "tcp", 8080, False, cause="hairpin is off",
                                 ours=True)]
    agent.after_probes(["files changed"], report)
    assert len(prober.calls) == calls  # the pass's own probes: nothing probed again
    assert _gauge(agent) == {("a1", "hairpin"): 1.0}
    assert PROBE_HEAL in agent.scheduler.pending()
    # a failed pass: its probes (none) are not taken as "everything holds"
    failed = PassReport(99, ["files changed"], "failed", 0.0, 0.0, 0.0)
    agent.after_probes(["files changed"], failed)
    assert _gauge(agent) == {("a1", "hairpin"): 1.0}


def test_the_loop_runs_the_probe_timer_apart_from_passes(probing_agent: Any) -> None:
    """``Agent.run``: the startup pass probes everything and arms the timer; then the timer
    alone probes again and again, with no pass (the resync is an hour away)."""
    build, _broken, prober = probing_agent
    agent = build(probe_interval=0.05, interval=3600.0)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while len(prober.calls) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        agent.stop.set()
        agent.trigger.wake()
        thread.join(5)
    assert len(prober.calls) >= 4 and all(c[0] is None for c in prober.calls)
    assert agent.pass_count == 1
