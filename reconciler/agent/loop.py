"""`reconcile watch`: the host agent that keeps this host converged.

Level-triggered, the controller-runtime way: file changes, netlink and Docker
events, SIGHUP and a periodic resync only *request* a pass; requests
coalesce; a pass loads the files, observes, plans, and — only when there is
something to do — takes the host lock, applies and verifies. A failed pass is
retried with exponential backoff (capped); drift events wait out the backoff,
operator actions (file edits, SIGHUP) do not.

An invalid edit never changes what we converge to: the last good desired state
is kept and the error is shown in logs and status. The host lock is held only
while applying, never between passes.

Probes (SPEC §7) prove that packets flow: an apply probes what it changed (a pass
that converges a revision the probe results are not of probes every allocation:
readiness counts only the current revision's), and every ``probe_interval`` (its
own timer, apart from the resync) a pass is followed by probes of every allocation.
A probe failure is drift: when its cause is one a pass owns (``ProbeResult.ours``)
one pass is asked for to heal it, and the allocation is probed again after it;
otherwise — or when that pass did not heal it — it is reported: a log line,
``probes`` in the status, the gauge ``reconciler_probe_failures{alloc,path}``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from reconciler import __version__
from reconciler.agent import blocked
from reconciler.agent.files import FileWatcher, watch_dirs
from reconciler.agent.passes import (
    DEADLINE,
    PROBE,
    QUIET_REASONS,
    RETRY_BLOCKED,
    PassReport,
    ProbeKey,
    WatchOptions,
    resource_errors,
)
from reconciler.agent.probing import AgentProbes
from reconciler.agent.readiness import Verdict, judge, same_state
from reconciler.agent.revision import (
    check_permissions,
    describe_revision,
    expected_problem,
    files_digest,
    git_revision,
)
from reconciler.agent.safewatch import HeldBack, SafeWatch
from reconciler.agent.schedule import Scheduler, Trigger
from reconciler.agent.sources import (
    DockerWatcher,
    NetlinkWatcher,
    NetnsDirWatcher,
    NftWatcher,
    OverlapAlarm,
    start_nft_watcher,
)
from reconciler.agent.status import Metrics, StatusBoard
from reconciler.config.load import load
from reconciler.config.paths import expand_paths
from reconciler.domain.errors import ConfigError, LockedError, PreconditionError, ReconcilerError
from reconciler.domain.model import DesiredState
from reconciler.domain.plan import Blocked
from reconciler.domain.probes import ProbeResult
from reconciler.drivers import rundir
from reconciler.drivers.nsfs import current_inode
from reconciler.engine.executor import Outcome
from reconciler.engine.impact import refusal
from reconciler.engine.lock import host_lock
from reconciler.engine.reconcile import Reconciler
from reconciler.planner.hostspace import LiveOverlap, owned_docker_prefixes

log = logging.getLogger("reconciler.watch")


def _default_reconciler(stop: threading.Event) -> Reconciler:
    def sleep(seconds: float) -> None:
        stop.wait(seconds)  # SIGTERM cuts verify waits and retry delays short

    return Reconciler(stop=stop, sleep=sleep)


class Agent(AgentProbes):
    """The watch loop. ``run()`` blocks until ``stop`` is set; call from the main thread."""

    def __init__(self, options: WatchOptions, *, stop: threading.Event | None = None,
                 board: StatusBoard | None = None, metrics: Metrics | None = None,
                 reconciler_factory: Callable[[threading.Event], Reconciler] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.options = options
        self.stop = stop or threading.Event()
        self.clock = clock
        self.wall = wall
        self.metrics = metrics or Metrics()
        self.hostname = options.hostname or socket.gethostname()
        self.board = board or StatusBoard()
        self.board.update(version=__version__, pid=os.getpid(), hostname=self.hostname,
                          paths=list(options.paths), state="starting", started_at=wall(),
                          pass_count=0, consecutive_failures=0, last_pass=None,
                          last_success_at=None, revision=None, errors=[], config_error=None,
                          desired=None, netns_inode=current_inode(),
                          event_sources={}, address_overlaps=[], blocked=[],
                          expected_revision=options.expect_revision)
        self.metrics.ready.set_function(lambda: 1.0 if self.ready().ready else 0.0)
        self.scheduler = Scheduler(backoff_base=options.backoff_base,
                                   backoff_cap=options.backoff_cap,
                                   max_wait=max(5.0, 10 * options.debounce))
        self.trigger = Trigger(self.scheduler, self.stop, clock)
        self.backoffs = blocked.Backoffs(options.backoff_base, options.backoff_cap)
        self._factory = reconciler_factory or _default_reconciler
        self.reconciler = self._factory(self.stop)
        self.good: DesiredState | None = None
        self.good_revision: dict[str, Any] | None = None
        self.pass_count = 0
        self.heartbeat = clock()
        self.files: FileWatcher | None = None
        self.netlink: Any = None
        self.netns_dir: Any = None
        self.nftables: NftWatcher | None = None
        self.docker: Any = None
        self.alarm: OverlapAlarm | None = None
        self._loaded_sig: tuple[str, str] | None = None
        #: the last load's error as anyone may read it: where and what, no value of the files
        self.config_error_public: str | None = None
        #: called with each pass's report (the plan server warms its view)
        self.after_pass: Callable[[PassReport], None] | None = None
        #: every probe's latest result, and since when each failing one fails (wall time)
        self.probe_results: dict[ProbeKey, ProbeResult] = {}
        self._failing_since: dict[ProbeKey, float] = {}
        #: failures a heal pass was asked for already (one per episode: a pass that cannot
        #: heal it must not run again and again)
        self._heal_asked: set[ProbeKey] = set()
        self._probe_labels: set[tuple[str, str]] = set()
        self._probe_took = 0.0
        #: the revision the probe results were taken at (readiness counts them only there)
        self._probes_revision: dict[str, Any] | None = None
        self.board.update(probes=None)
        self.safe = SafeWatch(options.confirm_within, self.board, self.metrics, options.probe,
                              self.hostname, wall)

    # -- event sources -------------------------------------------------------

    def on_file_change(self, path: str) -> None:
        log.debug("file changed: %s", path)
        self.trigger.request("files changed", delay=self.options.debounce, trailing=True,
                             bypass_backoff=True)

    def on_drift(self, source: str, reason: str) -> None:
        self.metrics.drift_events.labels(source=source).inc()
        log.debug("drift: %s", reason)
        self.trigger.request(f"{source} drift", delay=self.options.drift_debounce)

    def on_overlaps(self, found: list[LiveOverlap]) -> None:
        """Report the alarm's findings: foreign addresses and routes over owned prefixes, now."""
        now = self.wall()
        before = {(o["owned"], o["foreign"]): o["since"]
                  for o in self.board.get("address_overlaps") or []}
        current = []
        for o in found:
            key = (o.owned, o.foreign)
            if key not in before:
                log.warning("address overlap: %s overlaps %s, which the reconciler owns; "
                            "left alone (plans conflict until it is gone)", o.foreign, o.owned)
            current.append({"owned": o.owned, "foreign": o.foreign,
                            "since": before.get(key, now)})
        gone = set(before) - {(o.owned, o.foreign) for o in found}
        for owned, foreign in sorted(gone):
            log.info("address overlap gone: %s no longer overlaps %s", foreign, owned)
        self.metrics.address_overlaps.set(len(found))
        self.board.update(address_overlaps=current)

    def reload(self) -> None:
        """Reload now on SIGHUP, and forget the backoffs (an operator is looking)."""
        log.info("SIGHUP: reloading")
        self.backoffs.forget()
        with self.trigger.locked():
            self.scheduler.backoff_until = 0.0
        self.trigger.request("SIGHUP", bypass_backoff=True)

    def start_sources(self) -> None:
        self.files = FileWatcher(self.options.paths, self.on_file_change)
        self.files.start()
        sources: dict[str, str] = {"files": "watching " + ", ".join(watch_dirs(self.options.paths))}
        if self.options.netlink:
            try:
                alarm = OverlapAlarm(self.on_overlaps, self.stop)
                nl = NetlinkWatcher(lambda r: self.on_drift("netlink", r), self.stop,
                                    on_event=alarm.hear)
                nl.start()
                self.netlink = nl
                alarm.start()
                self.alarm = alarm
                sources["netlink"] = "listening"
            except OSError as exc:
                log.warning("netlink drift events unavailable (%s); relying on the interval", exc)
                sources["netlink"] = f"unavailable: {exc}"
        if self.options.netlink:
            self.nftables, sources["nftables"] = start_nft_watcher(
                lambda r: self.on_drift("nftables", r), self.stop)
            self.netns_dir = NetnsDirWatcher(lambda r: self.on_drift("netns", r),
                                             held=self._held_namespaces)
        self.board.update(event_sources=sources)

    def _update_sources(self, desired: DesiredState) -> None:
        names: set[str] = set(desired.bridges)
        if self.netlink is not None:
            self.netlink.set_names(names)
        if self.netns_dir is not None:
            self.netns_dir.set_names(desired.allocs)
        if desired.docker_networks and self.options.docker_events:
            if self.docker is None:
                self.docker = DockerWatcher(lambda r: self.on_drift("docker", r), self.stop)
            self.docker.set_names(desired.docker_networks)
            self.docker.start()
            src = self.board.get("event_sources") or {}
            src["docker"] = "connected" if self.docker.connected else "connecting"
            self.board.update(event_sources=src)
        elif self.docker is not None:
            self.docker.set_names(())

    def _held_namespaces(self) -> frozenset[str]:
        """Return the namespaces the observer keeps a socket into: undeclared ones of ours, too.

        With --no-prune or --dry-run those are not deleted by us; if someone else
        deletes one, the held socket keeps it (and its veth) alive until the next
        pass drops the socket, so its deletion must start a pass.
        """
        return self.reconciler.observer.handles.open_namespaces()

    def close(self) -> None:
        for src in (self.files, self.netlink, self.nftables, self.netns_dir, self.docker,
                    self.alarm):
            if src is not None:
                try:
                    src.close()
                except Exception as exc:  # shutting down: report, go on
                    log.debug("closing %s: %s", type(src).__name__, exc)
        try:
            self.reconciler.close_probes()
            self.reconciler.observer.handles.close()
        except Exception as exc:
            log.debug("closing drivers: %s", exc)

    # -- the loop ------------------------------------------------------------

    def run(self) -> None:
        self.board.update(state="running")
        self.trigger.request("startup", bypass_backoff=True)
        while True:
            self.heartbeat = self.clock()
            reasons = self.trigger.wait()
            if reasons is None:
                break
            if reasons == [PROBE]:  # the probe timer alone: probes, no pass
                self.probe_run()
                with self.trigger.locked():
                    self._arm_probes()
                continue
            report = self.run_pass(reasons)
            self._recheck_overlaps()
            self.after_probes(reasons, report)
            if self.after_pass is not None:
                self.after_pass(report)
            with self.trigger.locked():
                now = self.clock()
                if report.result == "failed":
                    delay = self.scheduler.record(False, now)
                    log.warning("pass %d failed; retrying in %.1fs", report.number, delay)
                elif report.result != "interrupted":
                    self.scheduler.record(report.result != "failed", now)
                self.scheduler.set_resync(now, self.options.interval)
                if PROBE in reasons or "startup" in reasons:
                    self._arm_probes()
            self.board.update(consecutive_failures=self.scheduler.failures)
            if self.stop.is_set():
                break
        self.board.update(state="stopped")

    def _arm_probes(self) -> None:
        """(Re)arm the probe timer, when there is one; the caller holds the trigger's lock."""
        if self.options.probe is not None and self.options.probe_interval is not None:
            self.scheduler.set_timer(PROBE, self.clock(), self.options.probe_interval)

    def _recheck_overlaps(self) -> None:
        """Let the alarm look again after a pass: what we own may have changed."""
        if self.alarm is None:
            return
        live = self.reconciler.last_live
        if live is not None:
            self.alarm.set_docker(*owned_docker_prefixes(live))
        self.alarm.poke()

    def healthy(self) -> tuple[bool, str]:
        if self.stop.is_set():
            return False, "stopping"
        stale = self.clock() - self.heartbeat
        limit = 2 * self.options.interval + 2 * self.options.lock_timeout + 60
        if stale > limit:
            return False, f"loop stuck for {stale:.0f}s"
        return True, "ok"

    def ready(self) -> Verdict:
        """Judge ``/readyz``: converged, verified and probed at the current revision (readiness)."""
        return judge(self.board.snapshot(), probing=self.options.probe is not None,
                     alive=self.healthy())

    @contextmanager
    def _host_lock(self) -> Iterator[None]:
        """Hold the host lock, waited for in small steps so that SIGTERM is not held up."""
        deadline = self.clock() + self.options.lock_timeout
        announced = False
        while True:
            stack = ExitStack()
            try:
                stack.enter_context(host_lock(0))
                break
            except LockedError as exc:
                if self.stop.is_set() or self.clock() >= deadline:
                    raise LockedError(f"{exc} (waited {self.options.lock_timeout:g}s)") from None
                if not announced:
                    log.info("waiting for the host lock: %s", exc)
                    announced = True
                self.stop.wait(0.1)
        with stack:
            yield

    def _revision(self) -> dict[str, Any]:
        """Return the checkout's commit (when in git) and the digest of the files as they are
        now."""
        rev = git_revision(self.options.paths) or {}
        try:
            files = expand_paths(self.options.paths)
        except (ConfigError, OSError):
            files = []
        rev["files_sha256"] = files_digest(files)
        return rev

    def _load(self) -> tuple[DesiredState | None, dict[str, Any], str | None]:
        """Load the files: (desired state, revision, None), or (None, revision, why not).

        Whatever the files' paths do meanwhile (removed, made again, swapped) is a reason
        not to load them now, never an exception out of the loop: the last good state is
        kept and reported, as for an invalid edit (SPEC §5).
        """
        rev = self._revision()
        self.config_error_public = None
        try:
            for _attempt in range(3):
                if self.options.expect_revision is not None:
                    problem = expected_problem(rev, self.options.expect_revision)
                    if problem is not None:
                        self.config_error_public = problem  # commit ids, no file's values
                        return None, rev, problem
                before = check_permissions(self.options.paths) if self.options.strict else ()
                desired = load(self.options.paths, hostname=self.hostname)
                # a symlink that flipped while we read could have pointed the read elsewhere:
                # what was checked before must be what is there after; and what was read
                # must be the revision read before it (a checkout under way between the two
                # would label one commit's files with another's id, and slip them past
                # --expect-revision)
                after = self._revision()
                if (not self.options.strict
                        or check_permissions(self.options.paths) == before) \
                        and same_state(after, rev):
                    break
                rev = after
            else:
                raise PreconditionError("the desired-state files kept moving while they were "
                                        "read (3 tries); trying again at the next pass")
        except ConfigError as exc:
            self.config_error_public = exc.public_text()
            return None, rev, str(exc)
        except PreconditionError as exc:  # paths, owners and modes: nothing of the files
            self.config_error_public = str(exc)
            return None, rev, str(exc)
        except OSError as exc:  # a look at a path that went meanwhile, in a check of ours
            where = f"{exc.filename}: " if exc.filename else ""
            self.config_error_public = f"{where}cannot read: {exc.strerror or exc}"
            return None, rev, self.config_error_public
        return desired, rev, None

    def run_pass(self, reasons: list[str]) -> PassReport:
        self.pass_count += 1
        n = self.pass_count
        t0, w0 = self.clock(), self.wall()
        report = PassReport(n, reasons, "ok", w0, w0, 0.0)
        desired, rev, config_error = self._load()
        if self.files is not None:  # a watched directory removed and made again: watch it
            self.files.ensure()
        if config_error is not None:
            self.metrics.config_errors.inc()
            self.metrics.config_valid.set(0)
            prev = self.board.get("config_error")
            same = prev is not None and prev.get("detail") == config_error
            since = prev["since"] if prev and same else w0
            # "message" never quotes the files (anyone may read /status on loopback);
            # "detail" is the whole error, for root (``status.public_view``)
            self.board.update(config_error={
                "message": self.config_error_public or config_error, "detail": config_error,
                "since": since, "revision": rev})
            if not same:
                keep = ("keeping the last good desired state"
                        f" ({describe_revision(self.good_revision)})"
                        if self.good_revision is not None else "nothing applied yet")
                for line in config_error.splitlines():
                    log.error("invalid desired state: %s", line)
                log.error("invalid desired state at %s; %s", describe_revision(rev), keep)
        else:
            assert desired is not None
            if self.board.get("config_error") is not None:
                log.info("desired state %s: config error cleared", describe_revision(rev))
            self.metrics.config_valid.set(1)
            sig = (describe_revision(rev), rev.get("files_sha256", ""))
            if sig != self._loaded_sig:
                log.info("desired state %s: %d bridges, %d subnets, %d allocs, "
                         "%d docker networks", describe_revision(rev), len(desired.bridges),
                         len(desired.subnets), len(desired.allocs), len(desired.docker_networks))
                self._loaded_sig = sig
            self.good, self.good_revision = desired, rev
            self.metrics.revision_time.set(rev.get("committed_at") or 0)
            self.board.update(config_error=None)
        if self.good is None:
            report.result = "config-error"
            report.error = "no valid desired state yet"
            return self._finish(report, t0)
        self._update_sources(self.good)
        # shown from now on; readiness waits for this report (its revision) to finish
        report.revision = self.good_revision
        self.board.update(revision=self.good_revision, desired={
            "bridges": len(self.good.bridges), "subnets": len(self.good.subnets),
            "allocs": len(self.good.allocs), "docker_networks": len(self.good.docker_networks)})
        try:
            self._reconcile(self.good, report)
        except ReconcilerError as exc:
            report.result = "failed"
            report.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if not report.errors:
                report.errors = [{"resource": "pass", "error": line}
                                 for line in str(exc).splitlines()[:20]]
        except Exception as exc:  # a bug or a broken socket: start over with fresh drivers
            report.result = "failed"
            if isinstance(exc, OSError) and exc.errno in rundir.WRITE_ERRNOS:
                # a full disk, a read-only mount: the machine's state, one line, no traceback
                report.error = f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror}"
            else:
                log.exception("pass %d: internal error", n)
                report.error = f"internal error: {type(exc).__name__}: {exc}"
            report.errors = [{"resource": "pass", "error": report.error}]
            try:
                self.reconciler.close_probes()
                self.reconciler.observer.handles.close()
            except Exception as close_exc:
                log.debug("closing drivers: %s", close_exc)
            self.reconciler = self._factory(self.stop)
        return self._finish(report, t0)

    def _reconcile(self, desired: DesiredState, report: PassReport) -> None:
        rec = self.reconciler
        if rec.journals_pending() and not self.options.dry_run:
            # a change a killed run left half done: the plan alone may not see it
            with self._host_lock():
                rec.finish_journals()
        revision = describe_revision(self.good_revision) if self.good_revision else None
        if not self.options.dry_run:
            held = self.safe.gate(rec, desired, revision, self._host_lock)
            if held is not None:  # a change in its window (ours or an operator's)
                self._held(report, held)
                return
        plan = rec.plan(desired, self.options.plan)
        if not plan.has_changes:
            if not self.options.dry_run and rec.leases_to_save(plan):
                with self._host_lock():  # values first seen live (an upgrade): recorded now
                    rec.save_leases(plan)
            if plan.errors:
                report.errors = [{"resource": "plan", "error": e} for e in plan.errors]
                raise ReconcilerError(plan.errors[0])
            self._blocked(report, plan.blocked)
            return
        if self.options.dry_run:
            report.result = "drift"
            report.errors = [{"resource": c.address,
                              "error": f"differs ({c.action.value}): {c.reason}"}
                             for c in plan.actionable[:50]]
            log.info("pass %d: %d change(s) pending; --dry-run: not applied", report.number,
                     len(plan.actionable))
            return
        refused = refusal(plan, self.options.max_disruption)
        if refused is not None:
            report.errors = [{"resource": "plan", "error": refused}] + [
                {"resource": f"{i.type}/{i.name}", "error": f"would be disrupted: {i.effect}"}
                for i in plan.impacted[:50]]
            raise ReconcilerError(refused)
        log.info("pass %d: %d change(s) to apply", report.number, len(plan.actionable))

        def on_outcome(o: Outcome) -> None:
            if o.status == "applied":
                self.metrics.changes.inc()

        # every apply checks again, under its lock, that no change went pending since the
        # gate (an operator's `apply --confirm-within` while this pass planned)
        hook = self.safe.hook(rec, revision, desired)
        with self._host_lock():
            try:
                result = rec.apply(desired, self.options.plan, on_outcome=on_outcome,
                                   probe=self.options.probe,
                                   max_disruption=self.options.max_disruption,
                                   before_changes=hook, hold=self.backoffs.held(self.clock()))
            except HeldBack as exc:
                self._held(report, str(exc))
                return
            # under the same lock: its reverter sees the window started, or the revert
            self.safe.after(rec, result, revision,
                            lambda why, delay: self.trigger.request(why, delay=delay))
        report.probes = list(result.probes)
        report.applied = sum(1 for o in result.outcomes if o.status == "applied")
        report.failed = len(result.failed)
        report.skipped = sum(1 for o in result.outcomes if o.status == "skipped")
        report.errors = resource_errors(result)
        if self.stop.is_set() and report.skipped:
            report.result = "interrupted"
            report.error = f"stopped: {report.skipped} change(s) skipped"
            return
        if result.plan.errors:
            raise ReconcilerError(result.plan.errors[0])
        report.result = "applied" if report.applied else "ok"
        # a failed op, a residual: that resource alone, on its own backoff (SPEC §11)
        self._blocked(report, blocked.after_apply(self.backoffs, result, self.clock()))

    def _blocked(self, report: PassReport, found: Sequence[Blocked]) -> None:
        """Show what is blocked (status, metric); ask for the pass that retries the first
        resource due again; a pass with anything blocked has not converged."""
        listed = blocked.status_list(found)
        self.board.update(blocked=listed)
        self.metrics.blocked.set(len(listed))
        if listed:
            report.result = "blocked"
            report.error = f"{len(listed)} resource(s) blocked: " + ", ".join(
                b["resource"] for b in listed[:5])
            report.errors = [e for e in report.errors if e["resource"] not in
                             {b["resource"] for b in listed}] + [
                {"resource": b["resource"], "error": "blocked: " + b["reason"]} for b in listed]
        due = self.backoffs.next_due()
        if due is not None:
            self.trigger.request(RETRY_BLOCKED, delay=max(0.0, due - self.clock()))

    def _held(self, report: PassReport, why: str) -> None:
        """Hold the pass back for a pending change; one that is not the agent's own is
        reverted at its deadline (the pass asked for then), not at the next resync."""
        report.result, report.error = "pending", why
        until = self.safe.held_until
        if until is not None:
            self.trigger.request(DEADLINE, delay=max(0.0, until - time.time()) + 0.5,
                                 bypass_backoff=True)

    def _finish(self, report: PassReport, t0: float) -> PassReport:
        report.duration = self.clock() - t0
        report.finished_at = self.wall()
        self.metrics.passes.labels(result=report.result).inc()
        self.metrics.duration.observe(report.duration)
        if report.result == "failed":
            self.metrics.failures.inc()
        if report.converged:
            self.metrics.last_success.set(report.finished_at)
            self.board.update(last_success_at=report.finished_at)
        rev = describe_revision(self.good_revision) if self.good_revision else "-"
        extra = {"pass_number": report.number, "revision": rev, "result": report.result,
                 "reasons": report.reasons, "duration_seconds": round(report.duration, 4)}
        msg = (f"pass {report.number} ({', '.join(report.reasons)}) at {rev}: {report.result}"
               f"{f', {report.applied} applied' if report.applied else ''}"
               f"{f', {report.failed} failed' if report.failed else ''}"
               f"{f', {report.skipped} skipped' if report.skipped else ''}"
               f" in {report.duration:.3f}s")
        if self.scheduler.failures and report.result in ("ok", "applied", "blocked"):
            log.info("pass %d: recovered after %d failed pass(es)", report.number,
                     self.scheduler.failures)
        if report.result == "failed":
            log.error("%s: %s", msg, report.error, extra=extra)
        elif report.result == "ok" and set(report.reasons) <= QUIET_REASONS:
            log.debug(msg, extra=extra)  # routine no-op passes: echoes of our changes, resyncs
        else:
            log.info(msg, extra=extra)
        self.board.update(
            pass_count=report.number,
            errors=report.errors if report.result != "config-error" else [],
            last_pass={"number": report.number, "reasons": report.reasons,
                       "result": report.result, "started_at": report.started_at,
                       "finished_at": report.finished_at, "revision": report.revision,
                       "duration_seconds": round(report.duration, 4),
                       "changes": {"applied": report.applied, "failed": report.failed,
                                   "skipped": report.skipped},
                       "error": report.error})
        return report
