"""The watch agent's side of safe change (SPEC §8): pending changes, overdue reverts and
`watch --confirm-within`.

Every pass asks :meth:`SafeWatch.gate` first. A change pending past its deadline (or
from before a reboot) is reverted there, before anything else. A change an operator
applied under a window (`apply --confirm-within`) holds the agent back until it is
confirmed or reverted: the pass reports ``pending`` and changes nothing. With
``--confirm-within`` the agent applies each new revision of its files the same way: the
checkpoint and a detached reverter (``engine/safechange``) first, then the change; the
reverter's probes revert it as soon as they fail, and when the window has passed with
the change still pending the agent probes once more and confirms it itself. The
reverter's own deadline is a grace period later, so an agent that died meanwhile leaves
a change that is reverted, not one that stays unconfirmed. A reverted revision is not
applied again until the files change.

The gate is asked before the pass plans, without the host lock held across planning; an
operator's `apply --confirm-within` can take the lock and make its change in between. So
every apply of the agent, window or not, checks again under its own lock, just before its
first op (``hook``): a change pending then holds the pass back (``HeldBack``, the pass
reports ``pending``) and nothing is changed over it.

The confirm probes what the agent applied (the desired state it kept from that pass), never
the files as they are when the window ends (a newer revision the host does not have yet),
and only when that state's files are the ones the record names (their sha256): otherwise
nothing is probed, the log says so, the agent does not confirm and the reverter's deadline
decides.

A change the agent does not own (an operator's, or its own from before a restart: a stop
of the unit kills the reverter with the agent, see examples/systemd/reconciler.service)
is reverted by the agent's first pass past its deadline: a held pass asks for one then.

A pending change whose reverter is gone (killed) gets a new one at the agent's next
pass, and one whose apply was killed before its first op (no reverter was ever
recorded) is dropped: it changed nothing.

Published in the status document (``pending``, ``reverted_revision``) and the metrics
``reconciler_pending_change`` and ``reconciler_reverts_total``.

See docs/decisions/026-safe-change-refusals-and-reverter.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from reconciler.domain.errors import ReconcilerError
from reconciler.domain.model import DesiredState
from reconciler.domain.plan import Plan
from reconciler.engine import safechange
from reconciler.engine.reconcile import ApplyResult, ProbeRequest, Reconciler, probe_failures
from reconciler.planner.checkpoint import without_postponed

log = logging.getLogger("reconciler.watch")

#: how much later than the agent's own confirm the reverter's deadline is
GRACE = 10.0


class HeldBack(ReconcilerError):
    """A change pending (its window open) when the agent's apply was about to make its
    first change: nothing was changed, the pass is ``pending``."""


class SafeWatch:
    def __init__(self, window: float | None, board: Any, metrics: Any,
                 probe: ProbeRequest | None, hostname: str | None,
                 wall: Callable[[], float] = time.time) -> None:
        self.window = window
        self.board = board
        self.metrics = metrics
        self.probe = probe
        self.hostname = hostname
        self.wall = wall
        #: the agent's own pending change: its token, and when the agent confirms it
        self.own: safechange.Pending | None = None
        self.confirm_at: float | None = None
        #: the desired state the agent's own pending change applied (what its confirm probes)
        self.own_desired: DesiredState | None = None
        #: the deadline (epoch) of the change that held the last pass back, when it is not
        #: the agent's own: the agent asks for a pass then, to revert it if still pending
        self.held_until: float | None = None
        #: the tokens whose confirm was skipped (files not the record's): said once each
        self._unprobed: set[str] = set()
        #: the revision applied last (a new one is what a window is for)
        self.applied_revision: str | None = None
        self._counted = safechange.revert_count()[0]
        #: whether the status shows a pending change (published last)
        self._shown = False
        self.publish()

    # -- status ------------------------------------------------------------------------

    def publish(self, p: safechange.Pending | None = None, *, read: bool = True) -> None:
        if read:
            try:
                p = safechange.pending()
            except ReconcilerError as exc:
                log.error("pending change unreadable: %s", exc)
                p = None
        count, last = safechange.revert_count()
        if count > self._counted:
            self.metrics.reverts.inc(count - self._counted)
            self._counted = count
        self._shown = p is not None
        self.metrics.pending_change.set(1 if p is not None else 0)
        self.board.update(
            pending=None if p is None else {"deadline": safechange.iso(p.deadline),
                                            "revision": p.revision},
            reverted_revision=last)

    # -- each pass ---------------------------------------------------------------------

    def gate(self, rec: Reconciler, desired: DesiredState, revision: str | None,
             lock: Callable[[], AbstractContextManager[None]]) -> str | None:
        """Gate a pass before it plans: revert what is overdue, confirm the agent's own change when
        its window has passed; a line saying why the pass must not change anything, or
        None."""
        self.held_until = None
        p = safechange.pending()
        if p is not None:
            with lock():
                p = safechange.pending()
                if p is not None and safechange.abandoned(p):
                    safechange.drop(p)  # killed before its first op: nothing to revert
                    p = None
                elif p is not None and p.overdue:
                    self._revert(rec, p, "overdue")
                    p = None
                elif p is not None and self._due(p):
                    holds = self._holds(rec, p)
                    if holds is None:
                        pass  # not probed (logged): left to the reverter's deadline
                    elif holds:
                        for o in safechange.confirm(p, rec):
                            if o.status == "failed":
                                log.error("postponed %s: %s", o.change.address, o.error)
                        log.info("confirmed revision %s: its probes held for the whole "
                                 "window", p.revision)
                        self.own, self.confirm_at, p = None, None, None
                        self.own_desired = None
                    else:
                        self._revert(rec, p, "probes failed")
                        p = None
                elif p is not None:
                    # its reverter killed: without one nothing probes it, and nothing
                    # reverts it at its deadline unless a pass runs then
                    p = safechange.respawn_if_dead(p)
            self.publish()
            if p is not None:
                if self.own is not None and p.token == self.own.token:
                    return (f"revision {p.revision} is in its confirm window until "
                            f"{safechange.iso(self.confirm_at or p.deadline)}")
                self.held_until = p.deadline
                return safechange.refusal(p)
        elif self.own is not None:
            self.own = self.confirm_at = None  # confirmed or reverted by someone else
            self.own_desired = None
            self.publish()
        elif self._shown:
            # gone since it was shown (its reverter undid it at the deadline, or an operator
            # confirmed or reverted it): the status and /readyz must stop saying it waits
            self.publish(None, read=False)
        _count, last = safechange.revert_count()
        if self.window is not None and revision is not None and revision == last:
            return (f"revision {revision} was reverted; it is not applied again until the "
                    "files change")
        return None

    def hook(self, rec: Reconciler, revision: str | None,
             desired: DesiredState) -> Callable[[Plan], Plan]:
        """Return what runs before the first op of this pass's change, under the apply's host lock:
        the check that no change is pending (one may have started since ``gate``), then,
        with a window and a new revision, the checkpoint and the reverter."""
        window = self.window
        begin = window is not None and revision is not None \
            and revision != self.applied_revision

        def before_changes(plan: Plan) -> Plan:
            pending = safechange.pending()
            if pending is not None:  # an operator's apply got in between
                self.publish(pending, read=False)
                self.held_until = pending.deadline
                raise HeldBack(safechange.refusal(pending))
            if not begin:
                return plan
            assert window is not None
            self.own, plan = safechange.begin(rec.last_live, rec.observer.handles, plan,
                                              seconds=window + GRACE, probe=self.probe,
                                              hostname=self.hostname, revision=revision)
            self.own_desired = desired
            self.publish(self.own, read=False)
            return plan

        return before_changes

    def after(self, rec: Reconciler, result: ApplyResult, revision: str | None,
              request: Callable[[str, float], None]) -> None:
        """Start the window after this pass's apply, still under its host lock (and ask
        for the pass that confirms), or revert at once when the change did not hold."""
        own = self.own
        if own is None or self.confirm_at is not None:
            if result.ok:
                self.applied_revision = revision
            return
        if own.postponed and result.residual is not None:
            result.residual = without_postponed(result.residual,
                                                (c.name for c in own.postponed))
        current = safechange.still_pending(own.token)
        if current is None:  # its reverter was first (the apply outlasted the window)
            self.own = self.own_desired = None
            self.publish()
            return
        if not result.ok:
            self.own = self.own_desired = None
            self._revert(rec, current, "the apply did not hold")
            self.publish()
            return
        assert self.window is not None
        self.own = safechange.started(current, self.window + GRACE)
        self.confirm_at = self.wall() + self.window
        self.applied_revision = revision
        log.info("revision %s applied; confirming it at %s if its probes hold", revision,
                 safechange.iso(self.confirm_at))
        request("confirm window", self.window)
        self.publish(self.own, read=False)

    def _due(self, p: safechange.Pending) -> bool:
        """Tell whether ``p`` is the agent's own change and its window has passed."""
        return (self.own is not None and p.token == self.own.token
                and self.confirm_at is not None and self.wall() >= self.confirm_at)

    def _holds(self, rec: Reconciler, p: safechange.Pending) -> bool | None:
        """Tell whether the probes of what the pending change ``p`` applied hold; None when they
        cannot be run on it: the state the agent kept is not of the record's files."""
        if self.probe is None:
            return True
        desired = self.own_desired
        if desired is None or tuple(desired.file_hashes) != tuple(p.files):
            if p.token not in self._unprobed:
                self._unprobed.add(p.token)
                log.warning("%s: not probed and not confirmed: the files it was applied "
                            "from are not the ones its record names (sha256); its "
                            "reverter's deadline decides", p.describe())
            return None
        return not probe_failures(rec.probe(desired, request=self.probe))

    def _revert(self, rec: Reconciler, p: safechange.Pending, why: str) -> None:
        log.warning("reverting %s (%s)", p.describe(), why)
        result = safechange.revert(rec, p, why=why)
        if result.ok:
            log.info("reverted in %.2fs: %d change(s) restored", result.seconds, result.changed)
        else:
            detail = (safechange.residual_line(result.residual) if result.residual is not None
                      and (result.residual.has_changes or result.residual.conflicts) else
                      "; ".join(f"{o.change.address}: {o.error}" for o in result.failed[:3]))
            raise ReconcilerError(f"the revert of {p.describe()} did not complete: {detail}")
        if self.own is not None and p.token == self.own.token:
            self.own = self.confirm_at = None
            self.own_desired = None
