"""Fixtures of the agent's unit tests: an agent around a fake Reconciler (``agent_env``)
and one around a fake prober (``probing_agent``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from reconciler.agent.loop import Agent
from reconciler.agent.passes import WatchOptions
from reconciler.domain.probes import ProbeResult
from reconciler.engine import lock as lock_mod
from tests.support.agentfake import FakeProber, FakeReconciler, ProbingReconciler


@pytest.fixture
def agent_env(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(lock_mod, "LOCK_DIR", str(tmp_path / "lock"))
    monkeypatch.setattr("reconciler.agent.loop.git_revision", lambda paths: None)
    conf = tmp_path / "conf"
    conf.mkdir()
    fakes: list[FakeReconciler] = []

    def make(stop: threading.Event) -> Any:
        fakes.append(FakeReconciler(stop))
        return fakes[-1]

    agent = Agent(WatchOptions(paths=(str(conf),), hostname="web-1"),
                  reconciler_factory=make)
    return agent, conf, fakes[0]


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
