"""Probes: prove from inside the host that packets flow (SPEC §7).

``Prober.run`` asks the pure planner which probes exist and what each must find
(``planner.probes``), sends them all at once (``drivers.probe``), and for each
one that failed gathers the facts around it and lets the planner name the
cause. ``probe_targets`` says which allocations a plan touched ("what changed",
after apply); watch probes everything on its own interval.
"""

from __future__ import annotations

from collections.abc import Collection

from reconciler.domain.live import LiveState
from reconciler.domain.model import DesiredState
from reconciler.domain.ownership import probe_vantage_names
from reconciler.domain.plan import Plan
from reconciler.domain.probes import VANTAGE_HOST, ProbeResult, ProbeSpec, sort_key
from reconciler.drivers import probe as driver
from reconciler.engine.handles import HostHandles
from reconciler.planner import probes as plan_probes
from reconciler.planner.probes import Sighting, Vantage, classify

__all__ = ["Prober", "probe_targets"]


def probe_targets(plan: Plan, desired: DesiredState) -> set[str]:
    """Alloc ids a plan's changes touch (see ``planner.probes.probe_targets``)."""
    return plan_probes.probe_targets(plan, desired)


class Prober:
    """Runs probes through the host's drivers; ``close`` removes what it set up."""

    def __init__(self, handles: HostHandles) -> None:
        self.handles = handles
        self._vantage: tuple[str, str] | None = None  # (namespace, link) made by us

    def run(self, desired: DesiredState, live: LiveState, *,
            allocs: Collection[str] | None = None, external: bool = False,
            timeout: float = 1.0) -> list[ProbeResult]:
        """Probe the allocations named (every declared one for None); results in report order.

        ``live`` is the state after apply: targets are read from it. Changes nothing
        on the host but the external vantage namespace (made on the first run with
        ``external``, kept until :meth:`close`).
        """
        vantage = self._ensure_vantage(live.host_id) if external else None
        exclude = () if self._vantage is None else (self._vantage[1],)
        specs = plan_probes.probe_specs(desired, live, allocs=allocs, vantage=vantage,
                                        host_exclude=exclude)
        sendable = [s for s in specs if s.skipped is None]
        outcomes = iter(driver.run(sendable, timeout=timeout,
                                   external_ns=vantage.netns if vantage else None))
        results = []
        for s in specs:
            if s.skipped is not None:
                results.append(ProbeResult(s.alloc, s.path, s.proto, s.port, ok=True,
                                           skipped=True, cause=s.skipped, family=s.family))
            else:
                results.append(self._result(s, next(outcomes)))
        return sorted(results, key=sort_key)

    def _ensure_vantage(self, host_id: str) -> Vantage:
        if self._vantage is None:
            ns, link = probe_vantage_names(host_id)
            driver.create_vantage(ns, link)
            self._vantage = (ns, link)
        return Vantage(self._vantage[0], VANTAGE_HOST)

    def _result(self, s: ProbeSpec, o: driver.Outcome) -> ProbeResult:
        ok = o.reached == s.expect and o.error is None
        cause = None if ok else classify(s, Sighting(o.reached, o.answer, o.error))
        return ProbeResult(s.alloc, s.path, s.proto, s.port, ok=ok,
                           cause=None if cause is None else cause.line, ms=o.ms,
                           family=s.family, ours=cause is not None and cause.ours)

    def close(self) -> None:
        """Remove the external vantage namespace if this prober made one."""
        if self._vantage is not None:
            driver.remove_vantage(*self._vantage)
            self._vantage = None
