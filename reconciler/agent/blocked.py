"""Keep each blocked resource's own retry backoff in watch (SPEC §11 "Partial progress").

A resource whose op failed, or that still differed after its apply (a workload flapping
its own ``eth0``), is held back on a backoff of its own: the passes in between leave it
alone and heal everything else, never backing the whole agent off for it. What the
planner blocks (a conflict, a refused replace) is planned again at every pass: planning
changes nothing, so that costs no retry.

See docs/decisions/043-partial-progress.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reconciler.domain.plan import Blocked


@dataclass
class _Entry:
    reason: str
    failures: int
    until: float


class Backoffs:
    """The per-resource backoffs: "kind/name" -> failures in a row and when to retry."""

    def __init__(self, base: float = 1.0, cap: float = 60.0) -> None:
        self.base, self.cap = base, cap
        self._entries: dict[str, _Entry] = {}

    def held(self, now: float) -> dict[str, str]:
        """Return the resources to leave alone in a pass starting ``now``, each with why."""
        return {a: f"retried in {e.until - now:.1f}s (failed {e.failures} time(s) in a row: "
                   f"{e.reason})" for a, e in self._entries.items() if e.until > now}

    def record(self, failed: Mapping[str, str], tried: Iterable[str], now: float) -> list[str]:
        """Count a pass: ``failed`` ("kind/name" -> why) failed again, ``tried`` were tried
        and held (they leave the table). Return the addresses that recovered."""
        for address, why in failed.items():
            e = self._entries.get(address)
            n = 1 if e is None else e.failures + 1
            delay = min(self.cap, self.base * 2.0 ** (n - 1))
            self._entries[address] = _Entry(why, n, now + delay)
        recovered = [a for a in tried if a in self._entries and a not in failed]
        for a in recovered:
            del self._entries[a]
        return recovered

    def next_due(self) -> float | None:
        """Return when the next held resource is due for its retry, or None."""
        return min((e.until for e in self._entries.values()), default=None)

    def forget(self) -> None:
        """Retry everything at the next pass (SIGHUP, a new revision)."""
        self._entries.clear()


def status_list(blocked: Iterable[Blocked]) -> list[dict[str, Any]]:
    """List blocked resources as the status shows them (once each, the first reason)."""
    seen: dict[str, dict[str, Any]] = {}
    for b in blocked:
        seen.setdefault(b.address, {"resource": b.address, "reason": b.reason, "by": b.by})
    return list(seen.values())


def after_apply(backoffs: Backoffs, result: Any, now: float) -> list[Blocked]:
    """Count an apply's failures on their own backoffs: each change that failed, or still
    differs after it (``result``: ``engine.reconcile.ApplyResult``), is held back from the
    next passes. Return everything blocked in it (the plan's too)."""
    failed = {f"{o.change.kind}/{o.change.name}": f"failed: {o.error or 'failed'}"
              for o in result.failed}
    if result.residual is not None:
        failed.update({c.address: "still differs after apply: " + (c.reason or c.action.value)
                       for c in result.residual.actionable})
    backoffs.record(failed, [c.address for c in result.plan.actionable], now)
    out = list(result.blocked)
    for address, why in failed.items():
        if not any(b.address == address for b in out):
            kind, _, name = address.partition("/")
            out.append(Blocked(kind, name, why))
    return out
