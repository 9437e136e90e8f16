"""What the watch agent is given and what each of its passes reports.

``WatchOptions`` are the agent's settings (``reconcile watch``'s flags);
``PassReport`` is one pass's outcome, as the status and the logs show it; the
pass reasons name why a pass ran; probe keys identify one probe path across
runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reconciler.domain.plan import Change
from reconciler.domain.probes import ProbeResult
from reconciler.engine.reconcile import ProbeRequest
from reconciler.planner.context import PlanOptions

#: the pass reasons of the probe timer, and of a pass asked for by a probe failure we own
PROBE, PROBE_HEAL = "probe", "probe failure"
#: the pass reason of a pending change's deadline (it is reverted then if still pending)
DEADLINE = "pending deadline"
#: the pass that retries a blocked resource whose own backoff ran out (``agent/blocked``)
RETRY_BLOCKED = "blocked retry"
#: reasons whose no-op passes are logged at debug level only
QUIET_REASONS = frozenset({"resync", "retry", "netlink drift", "netns drift", "docker drift",
                           "nftables drift", PROBE})


@dataclass(frozen=True)
class WatchOptions:
    """The agent's settings: ``reconcile watch``'s flags."""

    paths: tuple[str, ...]
    plan: PlanOptions = PlanOptions()
    interval: float = 60.0
    debounce: float = 0.5
    drift_debounce: float = 0.1
    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    lock_timeout: float = 60.0
    hostname: str | None = None
    netlink: bool = True
    docker_events: bool = True
    #: refuse config writable by group/others at every load, not only at start
    strict: bool = True
    #: answer `reconcile plan` of this namespace on a unix socket (planserver)
    plan_server: bool = True
    #: observe and report drift, never change the host
    dry_run: bool = False
    #: how to probe (after applying, and every probe_interval); None: never
    probe: ProbeRequest | None = ProbeRequest()
    #: seconds between probes of every allocation; None: only after applying
    probe_interval: float | None = 30.0
    #: the only commit whose files may be applied (``--expect-revision``); None: any
    expect_revision: str | None = None
    #: refuse a pass whose plan disrupts more items than this (``--max-disruption``)
    max_disruption: int | None = None
    #: apply each new revision under a window of this many seconds (``agent/safewatch``)
    confirm_within: float | None = None


@dataclass
class PassReport:
    """One pass's outcome, as the status and the logs show it."""

    number: int
    reasons: list[str]
    #: ok | applied | drift (--dry-run) | failed | config-error | interrupted | pending (a
    #: change in its confirm window holds the agent back)
    result: str
    started_at: float
    finished_at: float
    duration: float
    applied: int = 0
    failed: int = 0
    skipped: int = 0
    error: str | None = None
    errors: list[dict[str, str]] = field(default_factory=list)
    #: what the apply of this pass probed (the allocations it changed)
    probes: list[ProbeResult] = field(default_factory=list)
    #: the revision whose desired state this pass converged to (None: none valid yet);
    #: readiness counts a pass only at the current revision
    revision: dict[str, Any] | None = None

    @property
    def converged(self) -> bool:
        return self.result in ("ok", "applied")


ProbeKey = tuple[str, str, str, int | None, int]


def probe_key(r: ProbeResult) -> ProbeKey:
    return (r.alloc, r.path, r.proto, r.port, r.family)


def probe_order(k: ProbeKey) -> tuple[str, str, str, int, int]:
    """Order keys stably (a gateway's port is None)."""
    return (k[0], k[1], k[2], -1 if k[3] is None else k[3], k[4])


def probe_failed(r: ProbeResult) -> bool:
    return not r.ok and not r.skipped


def resource_errors(result: Any) -> list[dict[str, str]]:
    out = [{"resource": f"{o.change.kind}/{o.change.name}", "error": o.error or "failed"}
           for o in result.failed]
    out += [{"resource": "plan", "error": e} for e in result.plan.errors]
    if result.residual is not None and result.residual.has_changes:
        out += [{"resource": c.address, "error": "still differs after apply: "
                 + (c.reason or c.action.value)} for c in result.residual.actionable]
    return out


def adopt_hint(c: Change) -> str:
    """Say how to take the object over, unless the reason says it already or adopting cannot
    help (an overlap in the address space is someone else's address or route)."""
    if "--adopt" in c.reason or " overlaps " in c.reason:
        return ""
    return f" (adopt with --adopt {c.kind}/{c.name})"
