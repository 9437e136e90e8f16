"""`apply --confirm-within`, `reconcile confirm`, `reconcile revert` (SPEC §8): the command
side of ``engine/safechange``.

Every command that changes the host calls :func:`guard` under the host lock first: an
overdue pending change is reverted before anything else happens, a pending one refuses
the command with one line naming its deadline.

See docs/decisions/026-safe-change-refusals-and-reverter.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

from reconciler.agent.revision import describe_revision, files_digest, git_revision
from reconciler.config.load import load
from reconciler.domain.errors import LockedError, PreconditionError, ReconcilerError
from reconciler.domain.hints import command
from reconciler.domain.plan import Plan
from reconciler.engine import safechange
from reconciler.engine.lock import host_lock
from reconciler.engine.reconcile import ApplyResult, ProbeRequest, Reconciler, probe_failures
from reconciler.planner.checkpoint import without_postponed
from reconciler.planner.context import PlanOptions
from reconciler.ui.options import refuse_adopt_under_window
from reconciler.ui.render import EXIT_ERROR, EXIT_OK

log = logging.getLogger("reconciler")

#: how long the reverter waits for the host lock at a time, and its backoff between tries
#: (a test seam: ``_sleep``)
REVERTER_LOCK_WAIT = 120.0
REVERTER_BACKOFF = (1.0, 60.0)
_sleep = time.sleep


def _say(line: str, *, err: bool = False) -> None:
    print(line, file=sys.stderr if err else sys.stdout)


def _record_path(p: safechange.Pending) -> str:
    return os.path.join(safechange.scope_dir(p.scope), safechange.PENDING)


def _report(result: safechange.RevertResult, p: safechange.Pending, why: str, *,
            err: bool = False) -> bool:
    """Say how a revert went (``err``: its success too goes to stderr, as with ``--output
    json``, whose stdout is one JSON document); whether it completed."""
    if result.ok and not result.changed:
        _say(f"The change applied at {safechange.iso(p.created)} had changed nothing ({why}): "
             "nothing to restore; it is no longer pending.", err=err)
        return True
    if result.ok:
        _say(f"Reverted the change applied at {safechange.iso(p.created)} ({why}): "
             f"{result.changed} change(s) restored in {result.seconds:.1f}s, nothing left "
             "to restore.", err=err)
        return True
    for o in result.failed:
        _say(f"error: revert: {o.change.kind} {o.change.name}: {o.error}", err=True)
    if result.residual is not None and (result.residual.has_changes
                                         or result.residual.conflicts):
        _say(f"error: revert: {safechange.residual_line(result.residual)}", err=True)
    _say("error: the revert did not complete; the change stays pending (overdue): "
         f"`{command('revert')}` tries again; to give up on it (keeping the host as it is now), "
         f"move {_record_path(p)} away", err=True)
    return False


def _revision(files: list[str]) -> str | None:
    """Return the revision of the files as the agent names it (a git commit, or their digest), so
    that a revision reverted here is one the agent will not apply again either."""
    if not files:
        return None
    rev = git_revision(files) or {}
    rev["files_sha256"] = files_digest(files)
    return describe_revision(rev)


def guard(rec: Reconciler, *, err: bool = False) -> None:
    """Guard a change under the host lock: revert an overdue pending change first; refuse
    while one is pending (PreconditionError, one line), after starting a reverter for it
    if its own is gone (nothing else would revert it on a host no agent watches); drop the
    record of a change killed before its first op (it changed nothing). ``err``: every
    line to stderr (``--output json``)."""
    p = safechange.pending()
    if p is None:
        return
    if safechange.abandoned(p):
        safechange.drop(p)
        return
    if not p.overdue:
        safechange.respawn_if_dead(p)
        raise PreconditionError(safechange.refusal(p))
    why = "overdue: " + ("applied before a reboot" if p.boot_id != safechange.current_boot_id()
                         else f"its deadline {safechange.iso(p.deadline)} passed")
    _say(f"A change is overdue; reverting it first ({why}).", err=True)
    if not _report(safechange.revert(rec, p, why=why), p, why, err=err):
        raise PreconditionError("the overdue change could not be reverted; nothing else "
                                "was changed")


class Window:
    """One `apply --confirm-within`: records the checkpoint before the first op, starts
    the reverter, and afterwards says what to do (or reverts at once when the change did
    not hold)."""

    def __init__(self, rec: Reconciler, args: argparse.Namespace,
                 request: ProbeRequest | None) -> None:
        self.rec = rec
        self.seconds: float = args.confirm_within
        self.hostname = getattr(args, "hostname", None)
        self.request = request
        self.pending: safechange.Pending | None = None
        self.err = args.output == "json"
        #: what ``settle`` found: pending (the window runs), reverted, gone (the reverter
        #: was first), None (not settled)
        self.outcome: str | None = None
        self.reverted: safechange.RevertResult | None = None

    def before_changes(self, plan: Plan) -> Plan:
        if plan.blocked:
            # a window is all or nothing: a change only partly made cannot be confirmed whole
            listed = "; ".join(f"{b.kind} {b.name}: {b.reason}" for b in plan.blocked[:3])
            more = f"; and {len(plan.blocked) - 3} more" if len(plan.blocked) > 3 else ""
            raise PreconditionError(
                f"apply --confirm-within refuses a plan with {len(plan.blocked)} blocked "
                f"resource(s); nothing changed ({listed}{more}): resolve them, or apply "
                "without a window")
        self.pending, plan = safechange.begin(self.rec.last_live, self.rec.observer.handles,
                                              plan, seconds=self.seconds, probe=self.request,
                                              hostname=self.hostname,
                                              revision=_revision([p for p, _h in plan.files]))
        return plan

    def settle(self, result: ApplyResult, stopped: bool) -> None:
        """Settle the window, still under the apply's host lock: start the window of a change that
        held, or revert at once one that did not. Under the same lock, so the reverter (waiting for
        it since the record's own deadline, counted before the apply) sees either."""
        p = self.pending
        if p is None or stopped:  # stopped by a signal: the reverter reverts at its deadline
            return
        if self.pending is not None and self.pending.postponed and result.residual:
            result.residual = without_postponed(result.residual,
                                                (c.name for c in self.pending.postponed))
        current = safechange.still_pending(p.token)
        if current is None:
            self.outcome = "gone"
        elif not result.ok:
            self.outcome = "reverted"
            self.reverted = safechange.revert(self.rec, current, why="the apply did not hold")
        else:
            self.outcome = "pending"
            # a reverter killed meanwhile (or that died) would leave nothing to revert on
            # a host no agent watches: start another before the window opens
            self.pending = safechange.started(safechange.respawn_if_dead(current),
                                              self.seconds)

    def stopped(self) -> None:
        """Say the change stays pending after a signal stopped the apply: partly made, until
        the record's deadline (counted from before the apply); say so."""
        p = self.pending
        try:
            if p is None or safechange.still_pending(p.token) is None:
                return
        except ReconcilerError:
            return
        _say(f"The stopped change is pending until {safechange.iso(p.deadline)}: it is "
             f"reverted then (it cannot be confirmed; `{command('revert')}` reverts it now).",
             err=True)

    def finish(self, result: ApplyResult, rc: int) -> int:
        p = self.pending
        if p is None:
            _say("Nothing changed: nothing to confirm.", err=self.err)
            return rc
        if self.outcome == "gone":
            _say("error: the pending change was reverted meanwhile (its deadline passed while "
                 "it was being applied)", err=True)
            return EXIT_ERROR
        if self.outcome == "reverted" and self.reverted is not None:
            why = "the apply did not hold"
            _say(f"The change did not hold; reverted it ({why}).", err=True)
            _report(self.reverted, p, why, err=self.err)
            return EXIT_ERROR
        if self.outcome != "pending" or rc != EXIT_OK:
            return EXIT_ERROR
        _say(f"Pending until {safechange.iso(p.deadline)} ({self.seconds:g}s): run "
             f"`{command('confirm')}` to keep the change; without it (or if the probes fail) "
             f"it is reverted then (`{command('revert')}` reverts now).", err=self.err)
        return rc


def tend() -> None:
    """Start a reverter for a pending change whose own is gone, from a command that only reads
    (``plan``): under the host lock if it is free at once (the record is written again,
    and only under it), else not at all (its holder is changing the host: ``guard``
    tends it, or the reverter reverts). A change killed before its first op is left to
    the next ``guard``, which drops it."""
    try:
        p = safechange.pending()
    except PreconditionError:
        return
    if p is None or safechange.reverter_alive(p) or safechange.abandoned(p):
        return
    try:
        with host_lock(0):
            p = safechange.pending()
            if p is not None and not safechange.abandoned(p):
                safechange.respawn_if_dead(p)
    except (LockedError, PreconditionError) as exc:
        log.debug("pending change not tended: %s", exc)


def cmd_confirm(args: argparse.Namespace) -> int:
    rec = Reconciler()
    try:
        seen = safechange.pending()
    except PreconditionError:
        seen = None  # said again, under the lock
    try:
        with host_lock(args.lock_timeout):
            return _confirm(rec, seen)
    except LockedError:
        if seen is None:
            raise
        if not seen.applied and not seen.overdue:
            _say(f"error: {seen.describe()}, but its apply is still running: confirm it once "
                 "the apply has finished", err=True)
        else:  # what holds the lock that long over a pending change is its revert
            _say(f"error: too late: {seen.describe()} and it is being reverted", err=True)
        return EXIT_ERROR


def _confirm(rec: Reconciler, seen: safechange.Pending | None) -> int:
    """Confirm under the host lock; ``seen``: the record before the lock was taken."""
    p = safechange.pending()
    if p is None:
        if seen is not None:
            what = ("reverted meanwhile (its deadline passed)" if seen.overdue
                    else "confirmed or reverted meanwhile")
            _say(f"error: the pending change was {what}: nothing to confirm", err=True)
            return EXIT_ERROR
        _say("error: nothing is pending: no change waits for a confirm", err=True)
        return EXIT_ERROR
    if safechange.abandoned(p):
        safechange.drop(p)
        _say("error: nothing to confirm: the pending change was killed before its first "
             "change", err=True)
        return EXIT_ERROR
    if not p.applied and not p.overdue:
        safechange.respawn_if_dead(p)
        _say(f"error: {p.describe()}, but its apply has not finished (it runs, or it was "
             f"stopped or killed): `{command('revert')}` undoes it now, or wait for the apply; "
             "only a change applied whole can be confirmed", err=True)
        return EXIT_ERROR
    if p.overdue:
        why = f"confirmed after its deadline {safechange.iso(p.deadline)}"
        if p.boot_id != safechange.current_boot_id():
            why = "applied before a reboot"
        _say(f"error: too late: {p.describe()} and is overdue ({why}); reverting it",
             err=True)
        _report(safechange.revert(rec, p, why=why), p, why)
        return EXIT_ERROR
    outcomes = safechange.confirm(p, rec)
    _say(f"Confirmed: the change applied at {safechange.iso(p.created)} stays.")
    failed = [o for o in outcomes if o.status == "failed"]
    for o in outcomes:
        if o.status == "applied":
            _say(f"Made the postponed change: {o.change.kind} {o.change.name}: deleted.")
    for o in failed:
        _say(f"error: postponed {o.change.kind} {o.change.name}: {o.error}", err=True)
    return EXIT_ERROR if failed else EXIT_OK


def cmd_revert(args: argparse.Namespace) -> int:
    if args.wait:
        return _reverter(args.wait)
    rec = Reconciler()
    with host_lock(args.lock_timeout):
        p = safechange.pending()
        if p is None:
            if args.if_overdue:
                return EXIT_OK
            _say("error: nothing is pending: no change to revert", err=True)
            return EXIT_ERROR
        if args.if_overdue and not p.overdue:
            _say(f"Not overdue: {p.describe()}.")
            return EXIT_OK
        why = "reconcile revert"
        if p.boot_id != safechange.current_boot_id():
            why = "applied before a reboot"
        elif p.overdue:
            why = f"its deadline {safechange.iso(p.deadline)} passed"
        return EXIT_OK if _report(safechange.revert(rec, p, why=why), p, why) else EXIT_ERROR


def _holds(prober: Reconciler, p: safechange.Pending, said: set[str]) -> bool:
    """Run the reverter's probes of ``p``: False when they fail. Only the change's own files
    are probed: files whose hashes differ from the record's (edited since, or a newer
    revision) are not the pending change, and are skipped (said once in the log; the
    deadline still reverts)."""
    if p.probe is None:
        return True
    try:
        desired = load([path for path, _h in p.files], hostname=p.probe.get("hostname"))
        if sorted(desired.file_hashes) != sorted(p.files):
            if "files" not in said:
                said.add("files")
                log.warning("reverter: the files changed since the change was applied; "
                            "their probes are skipped (the deadline still reverts)")
            return True
        with host_lock(0):
            results = prober.probe(desired, request=ProbeRequest(
                external=bool(p.probe.get("external")),
                timeout=float(p.probe.get("timeout", 1.0))))
    except LockedError:
        return True  # someone is changing the host: probe on the next round
    except ReconcilerError as exc:
        log.warning("reverter: probes not run: %s", exc)
        return True
    failed = probe_failures(results)
    for r in failed[:5]:
        log.warning("reverter: probe failed: %s %s", r.alloc, r.path)
    return not failed


def _reverter(token: str) -> int:
    """Run the detached reverter of one pending change (``spawn_reverter``)."""
    logging.basicConfig(level=logging.INFO, force=True, stream=sys.stderr,
                        format="%(asctime)s reverter %(levelname)s %(message)s")
    prober = Reconciler()

    said: set[str] = set()

    def holds(p: safechange.Pending) -> bool:
        return _holds(prober, p, said)

    rec = Reconciler()

    def warm(p: safechange.Pending) -> None:
        # read the host once while waiting: the sockets into the namespaces, the iptables
        # and Docker clients are open and their imports done when the revert is due
        try:
            safechange.observe_for(rec, p.checkpoint)
        except ReconcilerError as exc:
            log.debug("reverter: warm-up observation: %s", exc)

    # as long as the record of this token is there, this is what reverts it (on a host no
    # agent watches, nothing else will): a lock held past the deadline (a slow apply), a
    # daemon restarting, a revert that failed or left a residual are waited out and tried
    # again with a backoff; the record going (confirmed, reverted, moved away) ends it
    delay, cap = REVERTER_BACKOFF
    failed = False
    try:
        while True:
            try:
                p = safechange.wait(token, probe=holds, ready=warm)
                if p is None:
                    log.info("reverter: the change was confirmed (or reverted); exiting")
                    return EXIT_ERROR if failed else EXIT_OK
                why = "probes failed" if not p.overdue else (
                    "applied before a reboot" if p.boot_id != safechange.current_boot_id()
                    else f"its deadline {safechange.iso(p.deadline)} passed")
                with host_lock(REVERTER_LOCK_WAIT, poll=0.02):
                    current = safechange.still_pending(token)
                    if current is None:
                        return EXIT_ERROR if failed else EXIT_OK
                    if p.overdue and not current.overdue:
                        continue  # the apply finished meanwhile: its window starts now
                    result = safechange.revert(rec, current, why=why)
                if _report(result, current, why):
                    return EXIT_OK
                failed = True
                log.warning("reverter: the revert did not complete; trying again in %gs",
                            delay)
            except LockedError as exc:
                log.warning("reverter: %s; still waiting for the host lock", exc)
            except ReconcilerError as exc:
                failed = True
                log.warning("reverter: %s; trying again in %gs", exc, delay)
            _sleep(delay)
            delay = min(cap, delay * 2)
    finally:
        prober.close_probes()


def attach(rec: Reconciler, args: argparse.Namespace, request: Any,
           options: PlanOptions | None = None) -> Window | None:
    """Return the window of `apply --confirm-within`, or None; ``options``: what the change is
    planned with (``--adopt`` is refused under a window)."""
    seconds = getattr(args, "confirm_within", None)
    if seconds is None:
        return None
    refuse_adopt_under_window(options or PlanOptions(adopt=frozenset(args.adopt or ())),
                              seconds)
    return Window(rec, args, request)
