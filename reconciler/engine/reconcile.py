"""The reconcile loop: observe -> plan -> execute -> verify, shared by the CLI and watch.

See docs/decisions/032-probes-in-apply-and-watch.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from reconciler.domain.errors import ConflictError, PreconditionError, StalePlanError
from reconciler.domain.live import LiveState
from reconciler.domain.model import DesiredState
from reconciler.domain.ops import AddrAdd, AllocConfigure, FirewallNft, NetnsCreate, decode
from reconciler.domain.ownership import alloc_ns_alias
from reconciler.domain.plan import Action, Blocked, Change, Plan
from reconciler.domain.probes import VANTAGE_NETS, ProbeResult
from reconciler.drivers import firewalld, iptables, netns, nsfs
from reconciler.engine import finish, impact
from reconciler.engine.executor import ChangeJournal, Executor, OpRunner, Outcome
from reconciler.engine.finish import finish_journals, touched_host
from reconciler.engine.handles import HostHandles
from reconciler.engine.hostops import HostOps
from reconciler.engine.journal import describe
from reconciler.engine.leases import LeaseFile, LeaseStore
from reconciler.engine.observe import Observer, docker_scope
from reconciler.engine.probes import Prober, probe_targets
from reconciler.planner import blocking, make_plan
from reconciler.planner.checkpoint import without_postponed
from reconciler.planner.context import PlanOptions

log = logging.getLogger("reconciler")

VERIFY_ATTEMPTS = 5
VERIFY_DELAYS = (0.1, 0.3, 0.6, 1.0)


@dataclass(frozen=True)
class ProbeRequest:
    """How apply proves the dataplane of what it changed (SPEC §7).

    ``external``: also from the vantage namespace that stands in for another host
    (PREROUTING and FORWARD); ``timeout``: how long each probe waits for its packet.
    """

    external: bool = False
    timeout: float = 1.0


class ProbeRunner(Protocol):
    """What runs probes: ``engine.probes.Prober``, or a fake in unit tests."""

    def run(self, desired: DesiredState, live: LiveState, *,
            allocs: Collection[str] | None = None, external: bool = False,
            timeout: float = 1.0) -> list[ProbeResult]: ...

    def close(self) -> None: ...


def probe_failures(results: Sequence[ProbeResult]) -> list[ProbeResult]:
    """Return the probes that did not hold: a skipped path (it cannot exist here) is no failure."""
    return [r for r in results if not r.ok and not r.skipped]


@dataclass
class ApplyResult:
    plan: Plan
    outcomes: list[Outcome] = field(default_factory=list)
    residual: Plan | None = None
    #: what the probes after a converged apply found (only the allocations it changed)
    probes: list[ProbeResult] = field(default_factory=list)
    #: the wall time those probes took
    probe_seconds: float = 0.0

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    @property
    def probe_failures(self) -> list[ProbeResult]:
        return probe_failures(self.probes)

    @property
    def blocked(self) -> list[Blocked]:
        """What could not converge: the plan's blocked resources, then each change that failed
        or was skipped because one it needs failed (SPEC §11)."""
        out = list(self.plan.blocked)
        for o in self.outcomes:
            if o.status == "failed":
                out.append(Blocked(o.change.kind, o.change.name, f"failed: {o.error}"))
            elif o.status == "skipped" and o.error:
                out.append(Blocked(o.change.kind, o.change.name, o.error))
        return out

    @property
    def ok(self) -> bool:
        return not self.failed and (self.residual is None or not self.residual.has_changes) \
            and not self.plan.errors and not self.probe_failures and not self.plan.blocked


class Reconciler:
    """Observe, plan, apply and verify against one host (the current network namespace)."""

    def __init__(self, observer: Observer | None = None, *, runner: OpRunner | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 stop: threading.Event | None = None,
                 prober: Callable[[HostHandles], ProbeRunner] = Prober,
                 leases: LeaseStore | None = None) -> None:
        """``runner`` performs the ops (default: ``HostOps`` over the observer's drivers);
        ``prober`` makes what runs probes, on first use, over the same drivers; ``leases``
        keeps the lease table (default, with ``HostOps``: the scope's lease file; with
        another runner and none given, leases are planned but not kept)."""
        self.observer = observer or Observer()
        self.runner = runner if runner is not None else HostOps(self.observer.handles)
        self.leases: LeaseStore | None = leases if leases is not None else (
            LeaseFile(docker_scope) if isinstance(self.runner, HostOps) else None)
        self.sleep = sleep
        self.stop = stop or threading.Event()
        self._make_prober = prober
        self._prober: ProbeRunner | None = None
        #: the last observation (the agent's address-space alarm reads owned Docker networks)
        self.last_live: LiveState | None = None

    def observe(self, desired: DesiredState) -> LiveState:
        self.last_live = self.observer.observe(desired)
        return self.last_live

    def plan(self, desired: DesiredState, options: PlanOptions) -> Plan:
        live = self.observe(desired)
        plan = make_plan(desired, live, options, desired.file_hashes)
        # the flows of what it disrupts, read only when it disrupts something
        plan, self.last_live = impact.count_flows(plan, live, self.observer.handles)
        # also when nothing is to change: a bridge taken out of firewalld's zones leaves the
        # rules as they were and the allocations' own traffic rejected
        problem = firewalld.bridges_problem(subnet_bridges(desired))
        if problem is not None:
            plan = dataclasses.replace(plan, errors=(*plan.errors, problem))
        # a plan read through a mount namespace that hides live allocations is wrong
        problem = netns.hidden_namespaces_problem(c.name for c in plan.changes
                                                  if c.kind == "alloc")
        if problem is not None:
            plan = dataclasses.replace(plan, errors=(*plan.errors, problem))
        return plan

    def apply(self, desired: DesiredState, options: PlanOptions, *,
              saved: Plan | None = None,
              on_outcome: Callable[[Outcome], None] | None = None,
              probe: ProbeRequest | None = None,
              max_disruption: int | None = None,
              before_changes: Callable[[Plan], Plan | None] | None = None,
              on_plan: Callable[[Plan], None] | None = None,
              hold: Mapping[str, str] | None = None,
              keep_leases: bool = True) -> ApplyResult:
        """Plan and execute; the caller holds the host lock.

        ``hold`` ("kind/name" -> why): resources not to touch in this run (the agent's
        per-resource backoff): their changes, and those that need them, are blocked
        (``planner.blocking.hold_back``) and left out of the verification.

        ``before_changes`` runs after the preflight checks and before the first op of a
        plan with changes (``engine/safechange`` records its checkpoint there: an error
        it raises means nothing changed); a plan it returns is run instead (irreversible
        deletions postponed).

        With ``probe``, a run that converged then probes the allocations its changes
        touched (``probe_targets``) against the verified observation: configuration
        that matches is not yet traffic that flows. With ``max_disruption``, a plan
        that disrupts more items than that is refused before any change
        (``engine.impact.DisruptionError``).

        A change a killed run left half done (its journal) is finished first: the plan
        reads the live state, and a half-made replace or adopt would plan wrong. So a
        refusal after that (a stale saved plan, a conflict, ``max_disruption``, the
        preflight) says that it finished one first, not that nothing changed.
        ``on_plan`` hears the plan about to be executed and ``on_outcome`` each change
        done (the CLI's progress line).

        The plan's lease table is saved before its first op (SPEC §11), also when nothing
        is to change (the first run of a version with leases records the live values);
        ``keep_leases`` false (``destroy``) saves none: what is destroyed keeps its leases.
        """
        finished = [line for line in self.finish_journals() if touched_host(line)]
        plan = blocking.hold_back(self.plan(desired, options), hold or {})
        result = ApplyResult(plan)
        with _refusals_after(finished):
            refuse(plan, saved, max_disruption)
            if not plan.has_changes:
                if keep_leases:
                    self.save_leases(plan)
                return result
            preflight(plan, subnet_bridges(desired))
        postponed: list[str] = []
        if before_changes is not None:
            run = before_changes(plan) or plan
            # deletions it postponed (a namespace processes hold, deleted at the confirm)
            # stay in the residual: what was changed is probed all the same
            ran = {c.address: c for c in run.changes}
            postponed = [c.name for c in plan.actionable if ran.get(c.address) != c
                         and c.kind == "alloc" and c.action is Action.DELETE]
            plan = result.plan = run
        if keep_leases:  # after the checkpoint: it records the leases from before
            self.save_leases(plan)
        if isinstance(self.runner, HostOps):
            self.runner.new_pass()
        if on_plan is not None:
            on_plan(plan)
        result.outcomes = Executor(self.runner, stop=self.stop, sleep=self.sleep,
                                   on_outcome=on_outcome,
                                   journal=self._journal_of(options)).execute(plan)
        if result.failed or self.stop.is_set():
            return result
        result.residual = self.verify(desired, options, postponed,
                                      skip={b.address for b in plan.blocked})
        if probe is not None and not result.residual.has_changes and not self.stop.is_set():
            targets = probe_targets(plan, desired)
            if targets and self.last_live is not None:
                t0 = time.perf_counter()
                result.probes = self.probe(desired, self.last_live, allocs=targets,
                                           request=probe)
                result.probe_seconds = time.perf_counter() - t0
        return result

    def leases_to_save(self, plan: Plan) -> bool:
        """Tell whether ``plan``'s lease table differs from the one observed (``last_live``)."""
        return self.leases is not None and self.last_live is not None and (
            plan.leases != self.last_live.leases or self.last_live.leases_problem is not None)

    def save_leases(self, plan: Plan) -> None:
        """Save ``plan``'s lease table when it differs from the one observed (``last_live``);
        a PreconditionError (a full disk …) comes before any op."""
        if self.leases is not None and self.last_live is not None and self.leases_to_save(plan):
            self.leases.save(plan.leases)
            if isinstance(self.observer, Observer):
                self.observer.forget_leases()
            self.last_live = dataclasses.replace(self.last_live, leases=dict(plan.leases),
                                                 leases_problem=None)

    def journals_pending(self) -> bool:
        """Tell whether a killed run left a journalled change to finish (no file is read)."""
        return isinstance(self.runner, HostOps) and bool(self.runner.journals.names())

    def journal_notes(self) -> list[str]:
        """Return one line per change a killed run left half done, for ``plan`` (nothing is read
        but the directory: planning changes nothing, so it cannot finish them)."""
        if not isinstance(self.runner, HostOps):
            return []
        try:
            return [describe(n) for n in self.runner.journals.names()]
        except PreconditionError as exc:  # the plan itself stands: say why it may not be all
            return [f"journals not checked: {exc}"]

    def finish_journals(self) -> list[str]:
        """Finish the changes killed runs left half done (``engine/finish.py``); the caller
        holds the host lock. The lines said, also logged."""
        if not isinstance(self.runner, HostOps):
            return []
        return finish_journals(self.runner)

    def _journal_of(self, options: PlanOptions
                    ) -> Callable[[Change], ChangeJournal | None] | None:
        if not isinstance(self.runner, HostOps):
            return None
        journals = self.runner.journals

        def begin(change: Change) -> ChangeJournal | None:
            return journals.for_change(change, adopt=f"{change.kind}/{change.name}"
                                       in options.adopt)

        return begin

    def probe(self, desired: DesiredState, live: LiveState | None = None, *,
              allocs: Collection[str] | None = None,
              request: ProbeRequest | None = None) -> list[ProbeResult]:
        """Probe ``allocs`` (None: every declared one) from inside the host; changes nothing
        the plan sees. ``live`` defaults to a fresh observation."""
        request = request or ProbeRequest()
        if live is None:
            live = self.observe(desired)
        if self._prober is None:
            self._prober = self._make_prober(self.observer.handles)
        return self._prober.run(desired, live, allocs=allocs, external=request.external,
                                timeout=request.timeout)

    def close_probes(self) -> None:
        """Remove what probing keeps between runs (the external vantage namespace)."""
        if self._prober is not None:
            prober, self._prober = self._prober, None
            prober.close()

    def verify(self, desired: DesiredState, options: PlanOptions,
               postponed: Collection[str] = (), *, skip: Collection[str] = ()) -> Plan:
        """Observe again until nothing is left to do, with a short bounded wait for the kernel;
        the deletions of the ``postponed`` allocations and the changes of the blocked
        resources in ``skip`` ("kind/name") are not waited for (nor returned)."""
        def residual() -> Plan:
            found = blocking.without(make_plan(desired, self.observe(desired), options), skip)
            return without_postponed(found, postponed) if postponed else found

        left = residual()
        for delay in VERIFY_DELAYS[: VERIFY_ATTEMPTS - 1]:
            if not left.has_changes:
                break
            self.sleep(delay)
            left = residual()
        return left


def refuse(plan: Plan, saved: Plan | None, max_disruption: int | None) -> None:
    """Refuse ``plan`` before any change: not the ``saved`` plan (stale), more disruption than
    ``max_disruption`` (of its executable changes). Blocked resources refuse nothing."""
    if saved is not None:
        if dict(saved.files) != dict(plan.files):
            raise StalePlanError("the saved plan is stale: the desired-state files changed "
                                 "since it was made; run plan again")
        if not saved.same_work(plan):
            if saved.live_fingerprint == plan.live_fingerprint:
                # the same files and the same live state: the planner that made it
                # decides otherwise (another version, e.g. before MACs were derived)
                raise StalePlanError("the saved plan is stale: it was made by another "
                                     "version of the reconciler, which plans other work "
                                     "for the same files and live state; run plan again")
            raise StalePlanError("the saved plan is stale: the live state changed since it "
                                 "was made; run plan again")
    # a blocked resource (a conflict, a refused replace) blocks only itself and what depends
    # on it: the rest is applied, and the run says what is blocked (SPEC §11)
    impact.check(plan, max_disruption)


def blocked_error(blocked: Sequence[Blocked]) -> ConflictError:
    """Say what could not converge: one line, then one per blocked resource with its reason."""
    lines = [f"{len(blocked)} resource(s) blocked: not changed in this run (the rest of the "
             "plan was applied)"]
    lines += [f"{b.kind} {b.name}: {b.reason}" for b in blocked]
    return ConflictError("\n".join(lines))


@contextlib.contextmanager
def _refusals_after(finished: Sequence[str]) -> Iterator[None]:
    """Word the refusals (the errors ``refuse`` and ``preflight`` raise) for a run that
    ``finished`` interrupted changes before it (``after_finishing``)."""
    try:
        yield
    except impact.DisruptionError as exc:
        if not finished:
            raise
        raise impact.DisruptionError(after_finishing(str(exc), finished), exc.plan) from None
    except (StalePlanError, ConflictError, PreconditionError) as exc:
        if not finished:
            raise
        raise type(exc)(after_finishing(str(exc), finished)) from None


def after_finishing(message: str, finished: Sequence[str]) -> str:
    """Reword a refusal's ``message`` once this run ``finished`` interrupted changes (the lines
    ``finish_journals`` said) before planning: its "nothing changed" would be false."""
    first, nl, rest = message.partition("\n")
    more = f"; and {len(finished) - 1} more" if len(finished) > 1 else ""
    done = "finished" if any(finish.finished(line) for line in finished) else "tried to finish"
    said = f"nothing else changed, but it {done} an interrupted change first ({finished[0]}{more})"
    for claim in (", nothing changed", "; nothing changed"):
        if first.endswith(claim):
            first = first[: -len(claim)]
            break
    return f"{first}; {said}{nl}{rest}"


def subnet_bridges(desired: DesiredState) -> list[str]:
    return sorted({s.bridge for s in desired.subnets.values()})


def preflight(plan: Plan, subnet_bridges: Sequence[str] = ()) -> None:
    """Refuse, before changing anything, a plan that could only half work here.

    Under ``ip netns exec`` (a private, slave mount namespace) the namespaces we
    would create vanish with the process: refuse up front (one line, exit 1)
    rather than fail midway after bridges and rules were already changed. Where
    /run/netns was bound in without its submounts, the allocations it touches
    were read as gone (``netns.hidden_namespaces``): refuse too.

    Kernels before 5.18 silently drop the IFA_PROTO tag that proves an address is
    ours: from the next run on our own gateways would look foreign. Refuse.
    """
    if any(op.name in (AddrAdd.NAME, AllocConfigure.NAME) for c in plan.actionable
           for op in c.ops):
        problem = kernel_problem(os.uname().release)
        if problem is not None:
            raise PreconditionError(problem)
    if any(op.name == NetnsCreate.NAME for c in plan.actionable for op in c.ops):
        problem = netns.private_mount_namespace_problem()
        if problem is not None:
            raise PreconditionError(problem)
    # a mount namespace whose /run/netns hides the namespaces mounted before it (``mount
    # --bind``): the allocations the plan touches were read as gone
    problem = netns.hidden_namespaces_problem(
        (c.name for c in plan.actionable if c.kind == "alloc"),
        marked=alloc_ns_alias(str(nsfs.current_inode())))
    if problem is not None:
        raise PreconditionError(problem)
    families = {family for c in plan.actionable for op in c.ops
                if op.name == FirewallNft.NAME and isinstance(typed := decode(op), FirewallNft)
                for family, script in ((4, typed.cleanup4), (6, typed.cleanup6)) if script}
    for family in sorted(families):
        # our rules in one iptables backend, Docker's in the other: neither sees the other's
        problem = iptables.check_backend_mismatch(family)
        if problem is not None:
            raise PreconditionError(problem)
    # firewalld's own reject outranks any ACCEPT of ours: the bridges must be in its zones
    problem = firewalld.bridges_problem(subnet_bridges)
    if problem is not None:
        raise PreconditionError(problem)


MIN_KERNEL = (5, 18)


def kernel_problem(release: str) -> str | None:
    """Return why this kernel cannot carry our address ownership tag, or None (pure)."""
    try:
        major, minor = (int(x) for x in release.split("-", 1)[0].split(".")[:2])
    except ValueError:
        return None  # an unusual version string: let the kernel speak for itself
    if (major, minor) >= MIN_KERNEL:
        return None
    return (f"kernel {release} is older than {MIN_KERNEL[0]}.{MIN_KERNEL[1]}: it drops the "
            "address protocol tag (IFA_PROTO) that marks addresses the reconciler owns, so "
            "its own addresses would look foreign on the next run; upgrade the kernel")


def conflicts_line(reasons: Sequence[str]) -> str:
    """Say ``N conflict(s) with …``: objects the reconciler does not own, or — when every one
    is a prefix on the probes' reserved /30 or /126 and nothing else — that reservation
    (nothing foreign is in the way then, and saying so would send people looking for it)."""
    parts = [p for r in reasons for p in r.split("; ")]
    if parts and all(any(p.endswith("overlaps " + why) for _net, why in VANTAGE_NETS)
                     for p in parts):
        return f"{len(reasons)} conflict(s) with the prefix reserved for the probes' vantage"
    return f"{len(reasons)} conflict(s) with objects the reconciler does not own"
