"""The watch agent's probes: after a pass and on their own timer (SPEC §7).

A probe failure is drift: when its cause is one a pass owns (``ProbeResult.ours``)
one pass is asked for to heal it, and the allocation is probed again after it;
otherwise — or when that pass did not heal it — it is reported: a log line,
``probes`` in the status, the gauge ``reconciler_probe_failures{alloc,path}``.

``AgentProbes`` is the part of ``loop.Agent`` that runs them and folds their
results in; the state it reads and keeps is the agent's own (declared here,
set up in ``Agent.__init__``).

See docs/decisions/032-probes-in-apply-and-watch.md.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from reconciler.agent.passes import (
    PROBE,
    PROBE_HEAL,
    PassReport,
    ProbeKey,
    WatchOptions,
    probe_failed,
    probe_key,
    probe_order,
)
from reconciler.agent.readiness import same_state
from reconciler.agent.schedule import Trigger
from reconciler.agent.status import Metrics, StatusBoard
from reconciler.domain.errors import LockedError, ReconcilerError
from reconciler.domain.model import DesiredState
from reconciler.domain.probes import ProbeResult
from reconciler.engine.lock import host_lock
from reconciler.engine.reconcile import Reconciler
from reconciler.ui.probes import where

log = logging.getLogger("reconciler.watch")


class AgentProbes:
    """Run the agent's probes and fold their results into its state, status and metrics."""

    options: WatchOptions
    clock: Callable[[], float]
    wall: Callable[[], float]
    metrics: Metrics
    board: StatusBoard
    trigger: Trigger
    reconciler: Reconciler
    good: DesiredState | None
    good_revision: dict[str, Any] | None
    probe_results: dict[ProbeKey, ProbeResult]
    _failing_since: dict[ProbeKey, float]
    _heal_asked: set[ProbeKey]
    _probe_labels: set[tuple[str, str]]
    _probe_took: float
    _probes_revision: dict[str, Any] | None

    def after_probes(self, reasons: list[str], report: PassReport) -> None:
        """Probe after a pass: what its apply probed; at startup (and when the probe timer came with
        other reasons) a probe of every allocation; after a heal pass, of those that failed."""
        if self.options.probe is None or self.good is None:
            return
        if report.result not in ("ok", "applied", "drift"):
            return  # what failed is reported as such; probes wait for the next timer
        heal = PROBE_HEAL in reasons
        # at a revision the results are not of (the first converged pass, new files) every
        # allocation: what the apply probed, or nothing when it changed nothing, would leave
        # the others' results of the old revision (or none), and readiness waits for these
        fresh = not same_state(self._probes_revision, self.good_revision)
        if PROBE in reasons or "startup" in reasons or fresh:
            results = self._probe(self.reconciler.last_live, None)
            if results is not None:
                self.take_probes(results, everything=True, after_heal=heal)
            return
        targets = {k[0] for k in self._failing_since} if heal else set()
        results = report.probes
        if targets:
            probed = self._probe(self.reconciler.last_live, targets)
            if probed is not None:  # with what the pass's apply probed of the others
                results = [r for r in results if r.alloc not in targets] + probed
        if results or heal:
            self.take_probes(results, after_heal=heal)

    def probe_run(self) -> None:
        """Run the probe timer: every allocation against a fresh observation, without a pass (a
        failure the reconciler owns asks for one).

        Under the host lock, taken without waiting: a CLI ``apply`` in the middle of its
        changes would show transient failures (and ask for passes that heal nothing), so
        while somebody else holds it the run is skipped; the next timer tries again.
        """
        if self.options.probe is None or self.good is None:
            return
        try:
            with host_lock(0):
                results = self._probe(None, None)
        except LockedError:
            log.debug("probe run skipped: another reconcile holds the host lock")
            return
        except ReconcilerError as exc:  # the lock itself (its directory, its file)
            log.warning("probes not run: %s", exc)
            return
        if results is not None:
            self.take_probes(results, everything=True)

    def _probe(self, live: Any, allocs: set[str] | None) -> list[ProbeResult] | None:
        assert self.good is not None
        # a blocked allocation is reported as blocked (status), not probed as failing
        stuck = {b["resource"].partition("/")[2] for b in self.board.get("blocked") or ()
                 if b["resource"].startswith("alloc/")}
        if stuck:
            allocs = set(self.good.allocs if allocs is None else allocs) - stuck
        t0 = self.clock()
        try:
            results = self.reconciler.probe(self.good, live, allocs=allocs,
                                            request=self.options.probe)
        except (ReconcilerError, OSError) as exc:
            log.warning("probes not run: %s", exc)
            return None
        except Exception:  # a bug in probing must not stop the loop that heals
            log.exception("probes: internal error")
            return None
        self._probe_took = self.clock() - t0
        log.debug("probed %s in %.3fs: %d probe(s)", "every allocation" if allocs is None
                  else ", ".join(sorted(allocs)), self._probe_took, len(results))
        return results

    def take_probes(self, results: list[ProbeResult], *, everything: bool = False,
                    after_heal: bool = False) -> None:
        """Fold probe results into the current state: logs for what starts or stops failing,
        the status, the gauge; a heal pass for new failures a pass owns."""
        assert self.good is not None
        now = self.wall()
        before = self.probe_results
        if everything:
            self.probe_results = {}
        else:
            probed = {r.alloc for r in results}
            self.probe_results = {k: r for k, r in self.probe_results.items()
                                  if k[0] not in probed}
        self.probe_results.update((probe_key(r), r) for r in results)
        declared = set(self.good.allocs)
        self.probe_results = {k: r for k, r in self.probe_results.items() if k[0] in declared}
        failing = {k for k, r in self.probe_results.items() if probe_failed(r)}
        heal = {k for k in failing if self.probe_results[k].ours and k not in self._heal_asked}
        healing = bool(heal) and not self.options.dry_run
        for k in sorted(failing - set(self._failing_since), key=probe_order):
            r = self.probe_results[k]
            log.warning("probe failed: %s: %s%s", where(r), r.cause or "no cause found",
                        "; the reconciler owns this: running a pass" if k in heal and healing
                        else "")
        if after_heal:
            for k in sorted(failing & self._heal_asked, key=probe_order):
                r = self.probe_results[k]
                log.warning("probe still fails after a pass: %s: %s; reported, no further "
                            "pass until it clears", where(r), r.cause or "no cause found")
        for k in sorted(set(self._failing_since) - failing, key=probe_order):
            log.info("probe holds again: %s", where(before[k]))
        self._failing_since = {k: self._failing_since.get(k, now) for k in failing}
        self._heal_asked &= failing
        if healing:
            self._heal_asked |= heal
            self.trigger.request(PROBE_HEAL)
        counts = Counter((k[0], k[1]) for k in failing)
        for alloc, path in self._probe_labels - set(counts):
            self.metrics.probe_failures.remove(alloc, path)
        for (alloc, path), n in counts.items():
            self.metrics.probe_failures.labels(alloc=alloc, path=path).set(n)
        self._probe_labels = set(counts)
        current = list(self.probe_results.values())
        self._probes_revision = self.good_revision
        self.board.update(probes={
            "at": now, "revision": self.good_revision, "probed": len(results),
            "duration_seconds": round(self._probe_took, 4),
            "held": sum(1 for r in current if r.ok and not r.skipped),
            "failed": len(failing), "skipped": sum(1 for r in current if r.skipped),
            "failures": [{**self.probe_results[k].to_json(), "ours": self.probe_results[k].ours,
                          "since": self._failing_since[k]}
                         for k in sorted(failing, key=probe_order)]})
