"""`reconcile gc`: observe, plan the removals (``planner.gc``), remove them under the host
lock, and sweep the stale files of the run and state directories.

The plan is made again under the lock before anything is removed, so a concurrent
apply that was half-way (a namespace made, its veth not yet) is never taken for a
leak: only what a dead run left is. After removing, the host is observed again
until the gc plan is empty (the kernel destroys namespaces, and so their veths,
asynchronously), as ``Reconciler.verify`` does for apply.

A change a killed run left half done (its journal, ``engine/journal.py``) is finished
first, under the lock, as ``apply`` does: planned before it, gc would take its halves
for leaks (the empty network of a replace killed after the create, a namespace whose
heal deleted its veth). One that cannot be finished yet stops gc before it removes
anything. ``gc --plan`` finishes nothing (it changes nothing): it names them, as
``plan`` does.

The stale files are the reconciler's own bookkeeping, not host objects, so they are
removed by the drivers of their directories (``drivers/rundir``, ``drivers/statedir``:
each re-checks a file just before removing it), not through ``HostOps``.

See docs/decisions/022-gc-is-the-planners-removals.md.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from reconciler.domain.errors import PreconditionError
from reconciler.domain.live import LiveState
from reconciler.domain.model import DesiredState
from reconciler.domain.plan import Plan
from reconciler.drivers import netns, procfs, rundir, statedir
from reconciler.engine import leases, probes
from reconciler.engine.executor import Executor, OpRunner, Outcome
from reconciler.engine.hostops import HostOps
from reconciler.engine.lock import host_lock
from reconciler.engine.observe import Observer, docker_scope
from reconciler.engine.reconcile import VERIFY_ATTEMPTS, VERIFY_DELAYS, Reconciler, preflight
from reconciler.planner import gc as planner_gc

FileKind = Literal["run", "state"]


@dataclass(frozen=True)
class StaleFile:
    """A file of ours nobody uses: under the run directory (a lock, a socket) or a
    record's temporary in this scope's state directory."""

    path: str
    where: FileKind
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "where": self.where, "reason": self.reason}


class JournalKeeper(Protocol):
    """What gc asks about the journals of killed runs (``Reconciler`` is one)."""

    def journal_notes(self) -> list[str]: ...

    def finish_journals(self) -> list[str]: ...


@dataclass
class GcResult:
    plan: Plan
    files: list[StaleFile]
    #: False for ``--plan``: nothing was removed
    collected: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    removed: list[StaleFile] = field(default_factory=list)
    #: what is still to collect after the removals (None: not looked again)
    residual: Plan | None = None
    #: the probes' external vantage namespace a prober that is gone left behind
    vantage: str | None = None
    vantage_removed: bool = False
    #: ``--plan``: the changes killed runs left half done, one line each (as ``plan``'s notes)
    notes: list[str] = field(default_factory=list)
    #: after collecting: what finishing them first said
    finished: list[str] = field(default_factory=list)
    #: with PATH: the resources (``KIND/NAME``) whose leases went with them
    released: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed and not self.plan.errors and (
            self.residual is None or not self.residual.has_changes) and (
            self.vantage is None or self.vantage_removed or not self.collected)

    @property
    def anything(self) -> bool:
        """Something to collect (or, after collecting, something that was)."""
        return self.plan.has_changes or bool(self.files) or self.vantage is not None


def holders(names: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Find the pids of the processes inside each named namespace (one scan of /proc), ours
    aside."""
    inodes: dict[str, int] = {}
    for name in names:
        try:
            ino = netns.namespace_inode(name)
        except OSError:
            continue
        if ino is not None:
            inodes[name] = ino
    if not inodes:
        return {}
    members = procfs.netns_members()
    me = os.getpid()
    return {name: pids for name, ino in inodes.items()
            if (pids := tuple(p for p in members.get(ino, ()) if p != me))}


def vantage_left(host_id: str) -> str | None:
    """Name the host's probe vantage when no prober holds its lock: a dead prober's leftover."""
    ns = probes.vantage_present(host_id)
    if ns is None or not rundir.lock_is_free(probes.vantage_lock_path(host_id)):
        return None
    return ns


def stale_files() -> list[StaleFile]:
    """List the stale files of the run directory and of this scope's state directory."""
    out = [StaleFile(p, "run", why) for p, why in rundir.stale_files()]
    out += [StaleFile(p, "state", why) for p, why in statedir.stale_temporaries(docker_scope())]
    return out


def remove_file(f: StaleFile) -> bool:
    return rundir.remove_stale(f.path) if f.where == "run" else statedir.remove_temporary(f.path)


class Collector:
    """Plans and performs `reconcile gc` against the current network namespace."""

    def __init__(self, observer: Observer | None = None, *, runner: OpRunner | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 stop: threading.Event | None = None,
                 who_holds: Callable[[Iterable[str]], Mapping[str, tuple[int, ...]]] = holders,
                 files: Callable[[], list[StaleFile]] = stale_files,
                 remove: Callable[[StaleFile], bool] = remove_file,
                 vantage: Callable[[str], str | None] = vantage_left,
                 remove_vantage: Callable[[str], bool] = probes.remove_unused_vantage,
                 journals: JournalKeeper | None = None) -> None:
        self.observer = observer or Observer()
        self.runner = runner if runner is not None else HostOps(self.observer.handles)
        self.sleep = sleep
        self.stop = stop or threading.Event()
        # the journals as apply finishes them (over the same drivers and runner)
        self._journals: JournalKeeper = journals if journals is not None else Reconciler(
            self.observer, runner=self.runner, sleep=sleep, stop=self.stop)
        self._who_holds = who_holds
        self._files = files
        self._remove = remove
        self._vantage = vantage
        self._remove_vantage = remove_vantage
        self.host_id = ""

    def plan(self, desired: DesiredState | None) -> Plan:
        """Plan the removals (``planner.gc.gc_plan``) of a fresh observation; change nothing."""
        live: LiveState = self.observer.observe(desired or DesiredState())
        self.host_id = live.host_id
        held = self._who_holds(planner_gc.broken_namespaces(live)) if desired is None else {}
        return planner_gc.gc_plan(live, desired, holders=held)

    def report(self, desired: DesiredState | None) -> GcResult:
        """Report what ``gc --plan`` would collect."""
        plan = self.plan(desired)
        return GcResult(plan, self._files(), vantage=self._vantage(self.host_id),
                        notes=self._journals.journal_notes())

    def collect(self, desired: DesiredState | None, lock_timeout: float = 60.0, *,
                before: Callable[[], None] | None = None) -> GcResult:
        """Remove what :meth:`plan` finds, under the host lock; then the stale files.
        ``before`` runs first under the lock (the CLI's safe-change guard: gc during a
        pending window is refused, an overdue change reverted first)."""
        with host_lock(lock_timeout):
            if before is not None:
                before()
            finished = self._journals.finish_journals()
            pending = self._journals.journal_notes()
            if pending:  # its halves are not leaks: gc waits for it, as nothing else would
                raise PreconditionError("\n".join(
                    ["gc: a change a killed run left half done could not be finished yet; "
                     "nothing collected (the next apply, destroy or gc tries it again)",
                     *pending]))
            result = GcResult(self.plan(desired), [], collected=True, finished=finished)
            if result.plan.has_changes:
                preflight(result.plan)
                if isinstance(self.runner, HostOps):
                    self.runner.new_pass()
                result.outcomes = Executor(self.runner, stop=self.stop,
                                           sleep=self.sleep).execute(result.plan)
                if not result.failed and not self.stop.is_set():
                    result.residual = self._verify(desired)
            if desired is not None and result.ok and isinstance(self.runner, HostOps):
                # what the files no longer declare leaves the desired state: its leases go
                result.released = leases.release_undeclared(declared_addresses(desired),
                                                            docker_scope())
            # before the files: removing the vantage takes its lock file with it
            result.vantage = None if self.stop.is_set() else self._vantage(self.host_id)
            if result.vantage is not None:
                result.vantage_removed = self._remove_vantage(self.host_id)
            # with the host lock held: our own lock file is in use, never taken for stale
            result.files = self._files()
            result.removed = [f for f in result.files
                              if not self.stop.is_set() and self._remove(f)]
        return result

    def _verify(self, desired: DesiredState | None) -> Plan:
        residual = self.plan(desired)
        for delay in VERIFY_DELAYS[: VERIFY_ATTEMPTS - 1]:
            if not residual.has_changes:
                break
            self.sleep(delay)
            residual = self.plan(desired)
        return residual


def declared_addresses(desired: DesiredState) -> set[str]:
    """Return ``KIND/NAME`` of every resource ``desired`` declares (their leases stay)."""
    return ({f"bridge/{n}" for n in desired.bridges} | {f"subnet/{n}" for n in desired.subnets}
            | {f"alloc/{n}" for n in desired.allocs}
            | {f"docker_network/{n}" for n in desired.docker_networks})
