"""The probe surface: apply probes what it changed, `verify`'s options and output, the
watch agent's handling of probe failures (heal once when ours, report otherwise).

The prober is faked at our own boundary (``Reconciler(prober=...)``); the real probes
are tested against the kernel in tests/integration/probes/."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Any

import pytest

from reconciler.agent.loop import Agent
from reconciler.agent.passes import PROBE, PROBE_HEAL, PassReport
from reconciler.agent.status import healthy_doc, render
from reconciler.domain.probes import ProbeResult
from reconciler.engine import lock
from reconciler.engine.reconcile import ProbeRequest, Reconciler
from reconciler.planner import PlanOptions
from reconciler.ui import probes as view
from reconciler.ui.options import probe_request
from reconciler.ui.parser import build_parser, duration
from tests.support.agentfake import FakeProber, run_pass
from tests.support.fakehost import FakeHost
from tests.support.planning import alloc, port, state


def _rec(host: FakeHost, prober: FakeProber) -> Reconciler:
    return Reconciler(host, runner=host, sleep=lambda _s: None,  # type: ignore[arg-type]
                      prober=lambda _handles: prober)


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
    report = run_pass(agent, "startup")
    assert report is not None and report.result == "ok"
    assert prober.calls[-1][0] is None  # every allocation
    assert agent.board.get("probes")["held"] == 2 and not _gauge(agent)
    broken["a1"] = ProbeResult("a1", "host", "tcp", 8080, False,
                               cause="a foreign DROP in filter FORWARD (-j DROP)")
    caplog.set_level(logging.INFO, logger="reconciler.watch")
    run_pass(agent, PROBE)
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
    run_pass(agent, PROBE)
    assert "probe failed" not in caplog.text
    del broken["a1"]
    run_pass(agent, PROBE)
    assert _gauge(agent) == {} and "probe holds again: alloc a1 path host" in caplog.text
    assert healthy_doc(agent.board.snapshot())


def test_a_failure_we_own_asks_for_one_pass_then_is_reported(
        probing_agent: Any, caplog: pytest.LogCaptureFixture) -> None:
    build, broken, prober = probing_agent
    agent = build()
    run_pass(agent, "startup")
    broken["a2"] = ProbeResult("a2", "gateway", "icmp", None, False,
                               cause="no route to 10.9.0.3", ours=True)
    run_pass(agent, PROBE)
    assert PROBE_HEAL in agent.scheduler.pending()
    assert "running a pass" in caplog.text
    agent.scheduler.take(float("inf"))
    # the heal pass probes the failing allocations only; still failing: reported, no loop
    run_pass(agent, PROBE_HEAL)
    assert prober.calls[-1][0] == {"a2"}
    assert PROBE_HEAL not in agent.scheduler.pending()
    assert "still fails after a pass" in caplog.text
    run_pass(agent, PROBE)
    assert PROBE_HEAL not in agent.scheduler.pending()
    # healed, then broken again: a new episode asks for a pass again
    del broken["a2"]
    run_pass(agent, PROBE)
    broken["a2"] = ProbeResult("a2", "gateway", "icmp", None, False, cause="x", ours=True)
    run_pass(agent, PROBE)
    assert PROBE_HEAL in agent.scheduler.pending()


def test_dry_run_reports_a_failure_we_own_without_a_pass(probing_agent: Any) -> None:
    build, broken, _prober = probing_agent
    agent = build(dry_run=True)
    broken["a1"] = ProbeResult("a1", "gateway", "icmp", None, False, cause="x", ours=True)
    run_pass(agent, "startup")
    assert _gauge(agent) == {("a1", "gateway"): 1.0}
    assert PROBE_HEAL not in agent.scheduler.pending()


def test_no_probe_means_no_probes(probing_agent: Any) -> None:
    build, _broken, prober = probing_agent
    agent = build(probe=None)
    run_pass(agent, "startup")
    run_pass(agent, PROBE)
    assert prober.calls == [] and agent.board.get("probes") is None


def test_results_of_undeclared_allocations_are_dropped(probing_agent: Any) -> None:
    build, broken, _prober = probing_agent
    agent = build()
    broken["gone"] = ProbeResult("gone", "gateway", "icmp", None, False, cause="x")
    run_pass(agent, "startup")
    agent.take_probes([broken["gone"]])
    assert _gauge(agent) == {} and agent.board.get("probes")["failed"] == 0


def test_the_probe_timer_alone_runs_no_pass(probing_agent: Any) -> None:
    build, _broken, prober = probing_agent
    agent = build()
    run_pass(agent, "startup")
    passes = agent.pass_count
    agent.probe_run()
    assert agent.pass_count == passes and prober.calls[-1][0] is None
    assert agent.board.get("probes")["probed"] == 2


def test_what_a_pass_applied_and_probed_is_taken_in(probing_agent: Any) -> None:
    build, _broken, prober = probing_agent
    agent = build()
    run_pass(agent, "startup")
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


def test_the_probe_timer_skips_a_run_while_someone_holds_the_host_lock(
        probing_agent: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    build, _broken, prober = probing_agent
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    monkeypatch.setattr(lock, "LOCK_DIR", str(rundir))
    monkeypatch.setattr(lock, "lock_path", lambda: str(rundir / "netns-1.lock"))
    agent = build()
    agent.run_pass(["startup"])
    agent.probe_run()
    before = len(prober.calls)
    assert before >= 1
    caplog.set_level("DEBUG", logger="reconciler.watch")
    with lock.host_lock(1.0):
        agent.probe_run()
    assert len(prober.calls) == before, "probed while another held the host lock"
    assert "host lock" in caplog.text
    agent.probe_run()
    assert len(prober.calls) == before + 1
    assert PROBE  # the timer's reason the loop uses for these runs
