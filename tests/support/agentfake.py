"""The watch agent's pass without a host: a fake Reconciler (plans one change until
applied), and the fake prober the probe-timer tests drive the agent with.

The fixtures that build an agent around them (``agent_env``, ``probing_agent``) are in
``tests/unit/agent/conftest.py``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from reconciler.agent.loop import Agent
from reconciler.agent.passes import PROBE, PassReport
from reconciler.domain.live import LiveState
from reconciler.domain.model import DesiredState
from reconciler.domain.plan import Action, Change, Plan
from reconciler.domain.probes import ProbeResult
from reconciler.engine.reconcile import ApplyResult, ProbeRequest


@dataclass
class FakeReconciler:
    """Plans one change until applied; the plan can be told to fail or conflict."""

    stop: threading.Event
    live_mtu: dict[str, int | None] = field(default_factory=dict)
    fail_apply: bool = False
    applied: list[str] = field(default_factory=list)
    last_live: Any = None
    #: interrupted changes a killed run left (their journals), finished by finish_journals
    journals: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def journals_pending(self) -> bool:
        return bool(self.journals)

    def leases_to_save(self, plan: Any) -> bool:
        return False  # no lease store here (tests/unit/planner/test_leases.py covers them)

    def save_leases(self, plan: Any) -> None:
        pass

    def finish_journals(self) -> list[str]:
        self.finished += self.journals
        self.journals = []
        return self.finished

    def _plan(self, desired: Any) -> Plan:
        changes = []
        for name, br in desired.bridges.items():
            if self.live_mtu.get(name, -1) != br.mtu:
                changes.append(Change("bridge", name, Action.UPDATE, "mtu differs"))
        for name in self.live_mtu:
            if name not in desired.bridges:
                changes.append(Change("bridge", name, Action.DELETE, "not declared"))
        return Plan(tuple(changes))

    def plan(self, desired: Any, options: Any) -> Plan:
        return self._plan(desired)

    def probe(self, desired: Any, live: Any = None, **_kw: Any) -> list[Any]:
        return []  # the probes' handling: tests/unit/agent/test_probe_surface.py

    def close_probes(self) -> None:
        pass

    def apply(self, desired: Any, options: Any, on_outcome: Any = None,
              probe: Any = None, max_disruption: Any = None,
              before_changes: Any = None, hold: Any = None) -> ApplyResult:
        from reconciler.engine.executor import Outcome
        from reconciler.planner.blocking import hold_back

        plan = hold_back(self._plan(desired), hold or {})
        if plan.has_changes and before_changes is not None:
            before_changes(plan)  # as the engine does: before the first op
        res = ApplyResult(plan)
        for c in plan.actionable:
            if self.fail_apply:
                res.outcomes.append(Outcome(c, "failed", "EPERM"))
                continue
            if c.action is Action.DELETE:
                del self.live_mtu[c.name]
            else:
                self.live_mtu[c.name] = desired.bridges[c.name].mtu
            self.applied.append(c.address)
            res.outcomes.append(Outcome(c, "applied"))
            if on_outcome:
                on_outcome(res.outcomes[-1])
        return res

    @property
    def observer(self) -> Any:
        class Ops:
            def close(self) -> None:
                pass

        class Obs:
            ops = Ops()

        return Obs()


def replace_file(path: Any, text: str) -> None:
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


BR = "version: 1\nbridges:\n  - name: {name}\n    mtu: {mtu}\n"


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


@dataclasses.dataclass
class ProbingReconciler:
    """What the agent needs of a Reconciler: converged passes and probes on demand."""

    stop: threading.Event
    prober: FakeProber
    last_live: Any = None
    applies: int = 0
    closed: int = 0

    def journals_pending(self) -> bool:
        return False  # no killed run left a change half done (test_loop checks one)

    def leases_to_save(self, plan: Any) -> bool:
        return False  # no lease store here (tests/unit/planner/test_leases.py covers them)

    def save_leases(self, plan: Any) -> None:
        pass

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


def run_pass(agent: Agent, *reasons: str) -> PassReport | None:
    """What ``Agent.run`` does with these reasons: the probe timer alone probes, no pass."""
    if list(reasons) == [PROBE]:
        agent.probe_run()
        return None
    report = agent.run_pass(list(reasons))
    agent.after_probes(list(reasons), report)
    return report
