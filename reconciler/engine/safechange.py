"""Safe change (SPEC §8): a change applied under a deadline stays only if it is confirmed.

``apply --confirm-within`` records, before its first op runs, a checkpoint of the
owned state (``planner/checkpoint``) in ``<state dir>/<scope>/pending.json``
(``drivers/statedir``: fsync'd file and directory, 0700, never followed), with the
deadline, this boot's id, the hashes of the new files and the probes it was asked
for. A detached reverter (``reconcile revert --wait TOKEN``, its own session, stdio
to ``/dev/null``, a log in the state directory) then sleeps until the deadline,
probing every few seconds; ``reconcile confirm`` removes the record, which the
reverter sees and exits. At the deadline (or when the probes fail) it takes the host
lock and reverts: the restore plan of the checkpoint against the live state now, run
by the executor through ``HostOps`` like any plan, then verified by taking the
checkpoint again (the restore plan of that must be empty). Only then is the record
removed and the revert counted (``reverts.json``).

A record outlives everything the operator's session can lose: the CLI killed, the
reverter killed, the host rebooted (its boot id differs: overdue). Whoever runs next
reverts an overdue change first: the next ``apply``, the agent, ``reconcile revert
--if-overdue`` at boot. While a change is pending and not overdue every other change
is refused, naming the deadline.

See docs/decisions/025-safe-change-checkpoint.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import reconciler
from reconciler.domain import leases
from reconciler.domain.checkpoint import Checkpoint, CheckpointError, NetworkPoint
from reconciler.domain.errors import PreconditionError
from reconciler.domain.hints import command
from reconciler.domain.live import LiveState
from reconciler.domain.plan import Change, Plan
from reconciler.drivers import netns, procfs, statedir, sysctl
from reconciler.engine import leases as lease_store
from reconciler.engine.executor import Executor, Outcome
from reconciler.engine.handles import HostHandles
from reconciler.engine.observe import docker_scope
from reconciler.planner.checkpoint import (
    observation,
    postpone,
    restore_plan,
    sysctl_keys,
    take,
)

log = logging.getLogger("reconciler")

PENDING = "pending.json"
REVERTS = "reverts.json"
REVERTER_LOG = "reverter.log"
RECORD_VERSION = 1
#: a test seam: the boot id a process believes in (a "reboot" is a new value)
BOOT_ID_ENV = "RECONCILER_BOOT_ID"
#: how often the reverter looks for a confirm, and how often it probes
POLL = 0.1
PROBE_EVERY = 3.0
#: restore rounds before a revert gives up (a round re-plans from a fresh observation)
RESTORE_ROUNDS = 3


def current_boot_id() -> str:
    return os.environ.get(BOOT_ID_ENV) or statedir.boot_id()


def iso(epoch: float) -> str:
    """Write ``epoch`` as UTC ISO 8601; total: a time no ``time_t`` holds (a record an older
    version wrote with a huge window, or edited) is named, not an OverflowError that every
    later command would die of."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    except (OverflowError, ValueError, OSError):
        return f"(no time: {epoch!r})"


def _time(value: Any, what: str) -> float:
    """Read a record's epoch seconds: a finite number, else ValueError (the record is refused
    in one line)."""
    seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{what} {value!r} is not a time")
    return seconds


@dataclass(frozen=True)
class Pending:
    """A change applied under a deadline and not confirmed yet."""

    scope: str
    token: str
    deadline: float  # epoch seconds
    created: float
    boot_id: str
    checkpoint: Checkpoint
    files: tuple[tuple[str, str], ...] = ()
    revision: str | None = None
    #: the probes the change was applied with (None: --no-probe): the reverter repeats them
    probe: dict[str, Any] | None = None
    reverter_pid: int | None = None
    applied: bool = False  # the apply finished (the reverter probes only then)
    #: irreversible changes (deletions of namespaces processes hold) made at confirm
    postponed: tuple[Change, ...] = ()
    #: the lease table before the change (``engine/leases``), put back by a revert; None:
    #: not recorded (an earlier version, or a lease file that could not be read)
    leases: dict[str, dict[str, Any]] | None = None

    @property
    def overdue(self) -> bool:
        """Past its deadline, or recorded before a reboot (its window closed with it)."""
        return time.time() >= self.deadline or self.boot_id != current_boot_id()

    def describe(self) -> str:
        rev = f" (revision {self.revision})" if self.revision else ""
        return f"a change{rev} applied at {iso(self.created)} is pending until {iso(self.deadline)}"

    def to_json(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, "scope": self.scope, "token": self.token,
                "deadline": self.deadline, "created": self.created, "boot_id": self.boot_id,
                "files": [{"path": p, "sha256": h} for p, h in self.files],
                "revision": self.revision, "probe": self.probe,
                "reverter_pid": self.reverter_pid, "applied": self.applied,
                "postponed": [c.to_json() for c in self.postponed],
                "checkpoint": self.checkpoint.to_json(),
                **({"leases": leases.to_json(self.leases)} if self.leases is not None else {})}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> Pending:
        try:
            if raw.get("version") != RECORD_VERSION:
                raise ValueError(f"record version {raw.get('version')!r}")
            return cls(str(raw["scope"]), str(raw["token"]), _time(raw["deadline"], "deadline"),
                       _time(raw["created"], "created"), str(raw["boot_id"]),
                       Checkpoint.from_json(raw["checkpoint"]),
                       tuple((str(f["path"]), str(f["sha256"])) for f in raw["files"]),
                       raw.get("revision"), raw.get("probe"), raw.get("reverter_pid"),
                       bool(raw.get("applied", False)),
                       tuple(Change.from_json(c) for c in raw.get("postponed", [])),
                       leases.from_json(raw["leases"]) if "leases" in raw else None)
        except (AttributeError, KeyError, TypeError, ValueError, CheckpointError) as exc:
            raise PreconditionError(f"{where} is not a pending change this version can read "
                                    f"({exc}); move it away to go on") from None


def scope_dir(scope: str | None = None) -> str:
    return statedir.scope_dir(scope or docker_scope())


def _existing_dir(scope: str | None) -> str | None:
    """Return the scope's state directory, checked, if there is one: reading makes nothing (an
    apply without a window must not need a writable ``/var/lib``)."""
    scope = scope or docker_scope()
    path = os.path.join(statedir.state_root(), statedir.scope_dirname(scope))
    return scope_dir(scope) if os.path.lexists(path) else None


def pending(scope: str | None = None) -> Pending | None:
    """Return the change pending in ``scope`` (default: the one we act on), or None."""
    directory = _existing_dir(scope)
    if directory is None:
        return None
    raw = statedir.read_record(directory, PENDING)
    return None if raw is None else Pending.from_json(raw, os.path.join(directory, PENDING))


def refusal(p: Pending) -> str:
    return (f"{p.describe()}: `{command('confirm')}` keeps it, `{command('revert')}` undoes it; "
            "nothing changed")


def revert_count(scope: str | None = None) -> tuple[int, str | None]:
    """Count the reverts performed in ``scope``; return it and the revision of the last one
    reverted."""
    try:
        directory = _existing_dir(scope)
        raw = (statedir.read_record(directory, REVERTS) if directory else None) or {}
    except PreconditionError:
        return 0, None
    return int(raw.get("count", 0)), raw.get("last_revision")


# -- the checkpoint ---------------------------------------------------------------------------

def _docker_now(handles: HostHandles, scope: str) -> tuple[NetworkPoint, ...]:
    snap: tuple[NetworkPoint, ...] = handles.docker.snapshot(scope)
    return snap


def _with_sysctls(live: LiveState) -> LiveState:
    """Add to ``live`` the sysctls a checkpoint records that observation did not read."""
    extra = {k: v for k in sysctl_keys(live) if k not in live.sysctls
             and (v := sysctl.read(k)) is not None}
    return dataclasses.replace(live, sysctls={**live.sysctls, **extra}) if extra else live


def checkpoint_of(handles: HostHandles, live: LiveState, *, docker: bool) -> Checkpoint:
    """Take the checkpoint of ``live`` (an observation), with our Docker networks of this scope
    read from the daemon when ``docker``."""
    nets = _docker_now(handles, docker_scope()) if docker else None
    return take(_with_sysctls(live), nets)


def uses_docker(live: LiveState) -> bool:
    """Tell whether a checkpoint of ``live`` covers Docker: the observation saw the daemon (it
    does when networks are declared or we own some here)."""
    return live.docker is not None and live.docker.available


def record(live: LiveState, handles: HostHandles, *, deadline: float,
           files: Iterable[tuple[str, str]] = (), revision: str | None = None,
           probe: dict[str, Any] | None = None,
           postponed: tuple[Change, ...] = ()) -> Pending:
    """Write ``pending.json`` for a change about to be made on ``live``: before its first op.

    A record that cannot be written (ENOSPC, EROFS …) is one PreconditionError, and the
    caller must not start the change.
    """
    scope = docker_scope()
    directory = scope_dir(scope)
    cp = checkpoint_of(handles, live, docker=uses_docker(live))
    p = Pending(scope, secrets.token_hex(8), deadline, time.time(), current_boot_id(), cp,
                tuple(files), revision, probe, postponed=postponed,
                leases=dict(live.leases) if live.leases_problem is None else None)
    _write(directory, p)
    return p


def _write(directory: str, p: Pending) -> None:
    try:
        statedir.write_record(directory, PENDING, p.to_json())
    except OSError as exc:
        raise PreconditionError(
            f"cannot record the pending change in {directory}: {exc.strerror or exc}; "
            "nothing changed") from None


def update(p: Pending, **changes: Any) -> Pending:
    new = dataclasses.replace(p, **changes)
    _write(scope_dir(p.scope), new)
    return new


# -- confirm and revert ---------------------------------------------------------------------

def confirm(p: Pending, rec: Any = None) -> list[Outcome]:
    """Keep the change: the postponed changes are made (through ``rec``'s runner), then
    the record goes (the reverter sees that and exits). The postponed changes' outcomes
    (a failure is reported; the change stays confirmed, the next apply prunes again)."""
    outcomes: list[Outcome] = []
    if p.postponed and rec is not None:
        outcomes = Executor(rec.runner).execute(Plan(p.postponed))
    statedir.remove_record(scope_dir(p.scope), PENDING)
    return outcomes


@dataclass
class RevertResult:
    plans: list[Plan] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    residual: Plan | None = None
    seconds: float = 0.0

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    @property
    def ok(self) -> bool:
        # a conflict (something not ours in the way: planner/checkpoint) is never done
        return (not self.failed and self.residual is not None
                and not self.residual.has_changes and not self.residual.conflicts)

    @property
    def changed(self) -> int:
        return sum(1 for o in self.outcomes if o.status == "applied")


def observe_for(rec: Any, cp: Checkpoint) -> tuple[LiveState, tuple[NetworkPoint, ...] | None]:
    """Observe everything owned, as a checkpoint sees it: every owned namespace (an empty desired
    state lists all of them), our neighbour entries on the recorded bridges
    (``planner.checkpoint.observation``) and, if the checkpoint covers Docker, our
    networks."""
    live = _with_sysctls(rec.observe(observation(cp)))
    nets = _docker_now(rec.observer.handles, docker_scope()) if cp.docker is not None else None
    return live, nets


def live_leases(rec: Any) -> dict[str, Any] | None:
    """Read the lease table now through ``rec``'s observer (None: it cannot be read)."""
    got = rec.observer.observe_leases() if hasattr(rec.observer, "observe_leases") else {}
    return None if got.get("leases_problem") else got.get("leases")


def revert(rec: Any, p: Pending, *, why: str,
           on_outcome: Callable[[Outcome], None] | None = None) -> RevertResult:
    """Restore ``p``'s checkpoint and verify it; the caller holds the host lock.

    ``rec`` is an ``engine.reconcile.Reconciler`` (its observer and runner). The record
    is removed, and the revert counted, only when the verification found nothing left
    to restore: a revert that failed stays pending (overdue) for the next one.
    """
    t0 = time.monotonic()
    result = RevertResult()
    cp = p.checkpoint
    # a killed change's journals first: restored from a half-made state they would
    # survive the revert, and the next run's finish_journals would carry part of the
    # reverted change to its end again
    for line in rec.finish_journals():
        log.warning("revert: %s", line)
    if p.leases is not None and live_leases(rec) != p.leases:
        # the leases of the state restored, first: a revert cut short keeps them too
        lease_store.write(p.leases, p.scope)
        if hasattr(rec.observer, "forget_leases"):
            rec.observer.forget_leases()
    live, nets = observe_for(rec, cp)
    plan = restore_plan(cp, live, nets)
    for _round in range(RESTORE_ROUNDS):
        if not plan.has_changes:
            break
        result.plans.append(plan)
        outcomes = Executor(rec.runner, on_outcome=on_outcome).execute(plan)
        result.outcomes += outcomes
        if any(o.status == "failed" for o in outcomes):
            break
        live, nets = observe_for(rec, cp)
        plan = restore_plan(cp, live, nets)
    result.residual = plan
    result.seconds = time.monotonic() - t0
    if result.ok and not result.changed:
        # nothing to restore (killed before its first op): the record goes, but it was no
        # revert of the revision (``watch`` would refuse a revision that never ran)
        statedir.remove_record(scope_dir(p.scope), PENDING)
        log.info("the change applied at %s had changed nothing: nothing to restore (%s)",
                 iso(p.created), why)
    elif result.ok:
        directory = scope_dir(p.scope)
        statedir.remove_record(directory, PENDING)
        count, _last = revert_count(p.scope)
        try:
            statedir.write_record(directory, REVERTS, {
                "count": count + 1, "last_revision": p.revision, "last_at": time.time(),
                "last_reason": why, "last_files": [list(f) for f in p.files]})
        except OSError as exc:
            log.warning("revert: not counted (%s)", exc.strerror or exc)
        log.info("reverted the change applied at %s (%s) in %.2fs", iso(p.created), why,
                 result.seconds)
    return result


def residual_line(plan: Plan) -> str:
    parts = [f"{c.kind} {c.name}: {c.reason}" for c in (*plan.conflicts, *plan.actionable)][:5]
    return "the restored state still differs from the checkpoint: " + "; ".join(parts)


# -- the detached reverter ------------------------------------------------------------------

def spawn_reverter(p: Pending) -> int:
    """Start ``reconcile revert --wait TOKEN`` in a session of its own (so the operator's
    session ending, a SIGHUP or a ``kill`` of the CLI's process group leave it), in this
    network namespace (it inherits it), logging to the state directory. Its pid."""
    directory = scope_dir(p.scope)
    fd = os.open(os.path.join(directory, REVERTER_LOG),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    # the same code as this process, wherever it was imported from (a checkout, a venv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(reconciler.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here, *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        proc = subprocess.Popen(  # noqa: S603 (our own interpreter and module)
            [sys.executable, "-m", "reconciler", "revert", "--wait", p.token],
            stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True,
            close_fds=True, cwd="/", env=env)
    finally:
        os.close(fd)
    return proc.pid


def held_namespaces(plan: Plan) -> set[str]:
    """Find the allocation namespaces ``plan`` deletes that processes are in (not this one)."""
    names = [c.name for c in plan.actionable if c.kind == "alloc" and c.action.value == "delete"]
    if not names:
        return set()
    members = procfs.netns_members()
    held = set()
    for name in names:
        try:
            inode = netns.namespace_inode(name)
        except OSError:
            continue
        if inode is not None and any(pid != os.getpid() for pid in members.get(inode, ())):
            held.add(name)
    return held


def begin(live: LiveState | None, handles: HostHandles, plan: Plan, *, seconds: float,
          probe: Any = None, hostname: str | None = None,
          revision: str | None = None) -> tuple[Pending, Plan]:
    """Begin a change made under a window, before its first op: postpone what cannot be
    undone, record the checkpoint of ``live`` (the plan's observation) and start the
    reverter; the record and the plan to run. ``probe``: the ``ProbeRequest`` the change
    is applied with (None: not probed). PreconditionError (nothing changed, no record
    left) when either fails."""
    if live is None:
        raise PreconditionError("no observation to checkpoint; nothing changed")
    plan, postponed = postpone(plan, held_namespaces(plan))
    request = None if probe is None else {"external": bool(probe.external),
                                          "timeout": float(probe.timeout),
                                          "hostname": hostname}
    p = record(live, handles, deadline=time.time() + seconds, files=plan.files,
               probe=request, revision=revision, postponed=postponed)
    try:
        pid = spawn_reverter(p)
    except OSError as exc:
        confirm(p)  # nothing changed yet: no record may stay behind
        raise PreconditionError(f"cannot start the reverter: {exc.strerror or exc}; "
                                "nothing changed") from None
    return update(p, reverter_pid=pid), plan


def started(p: Pending, seconds: float) -> Pending:
    """Mark the change made: its window of ``seconds`` starts now (a kill before this point
    leaves the deadline counted from the record, which is earlier), and the reverter may
    probe it."""
    return update(p, applied=True, deadline=time.time() + seconds)


def wait(token: str, *, probe: Callable[[Pending], bool] | None = None,
         ready: Callable[[Pending], None] | None = None,
         sleep: Callable[[float], None] = time.sleep) -> Pending | None:
    """Sleep until the pending change ``token`` is due: its deadline passed, or ``probe``
    (asked every ``PROBE_EVERY`` seconds once the apply finished) says the change does not
    hold. ``ready`` is called once when the apply has finished. The record then (to be
    reverted under the lock), or None when it was confirmed, reverted or replaced
    meanwhile."""
    next_probe = time.monotonic() + PROBE_EVERY
    path = os.path.join(scope_dir(), PENDING)
    seen: tuple[int, int, int] | None = None
    p: Pending | None = None
    while True:
        # read again only when the file changed (a big host's checkpoint is large)
        try:
            st = os.stat(path)
            stamp: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != seen or p is None:
            try:
                p = pending()
            except PreconditionError as exc:
                log.error("reverter: %s", exc)
                return None
            seen = stamp
        if p is None or p.token != token:
            return None
        if p.overdue:
            return p
        if ready is not None and p.applied:
            ready(p)
            ready = None
        if probe is not None and p.applied and time.monotonic() >= next_probe:
            if not probe(p):
                log.warning("reverter: the probes failed; reverting before the deadline")
                return p
            next_probe = time.monotonic() + PROBE_EVERY
        sleep(max(0.01, min(POLL, p.deadline - time.time())))


def reverter_alive(p: Pending) -> bool:
    """Tell whether ``p``'s reverter runs: its pid is a live process (not a zombie) whose
    command line names ``p``'s token (a pid reused by another process is not it)."""
    if not p.reverter_pid:
        return False
    try:
        pid = int(p.reverter_pid)
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rpartition(b") ")[2][:1]
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except (OSError, ValueError):
        return False
    if state in (b"Z", b"X", b""):
        return False
    # an empty command line: the process is still being exec'd (just spawned)
    return argv == [b""] or p.token.encode() in argv


def abandoned(p: Pending) -> bool:
    """Tell whether ``p`` was left by a change killed before its first op: no reverter was ever
    recorded for it and its apply never finished.

    Meaningful under the host lock only: :func:`begin` holds it from writing the record
    to recording the reverter's pid, and the ops come after that, so a record without a
    pid that the lock's next holder finds is one whose change never started (a kill
    between the record and the spawn). Nothing to revert: the caller drops it
    (:func:`drop`) instead of refusing every change until its deadline.
    """
    return p.reverter_pid is None and not p.applied


def drop(p: Pending) -> None:
    """Remove the record of a change that never started (:func:`abandoned`); the caller holds
    the host lock."""
    statedir.remove_record(scope_dir(p.scope), PENDING)
    log.warning("dropped the pending change recorded at %s: its apply was killed before its "
                "first change (nothing to revert)", iso(p.created))


def respawn_if_dead(p: Pending) -> Pending:
    """Return ``p``, with a new reverter if its own is gone (killed, crashed): without one nothing
    reverts on a host no agent watches. The caller holds the host lock (the record is
    written again), or knows that nobody else writes it now."""
    if reverter_alive(p):
        return p
    log.warning("the reverter (pid %s) of the pending change is gone; starting a new one",
                p.reverter_pid)
    try:
        pid = spawn_reverter(p)
    except OSError as exc:
        log.error("cannot start a reverter: %s", exc.strerror or exc)
        return p
    return update(p, reverter_pid=pid)


def still_pending(token: str) -> Pending | None:
    """Return the record ``token`` under the lock if it is still there."""
    p = pending()
    return p if p is not None and p.token == token else None
