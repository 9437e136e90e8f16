"""What commands print about probes: one line per probe that did not hold, a summary,
and the JSON that `verify --output json` and `apply --output json` carry.

Lines name the allocation, the path and the cause (SPEC §7), so an operator reading
one line knows where packets stop and why, without the rest of the output.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from reconciler.domain.probes import ProbeResult


def where(r: ProbeResult) -> str:
    """Say which probe, for people: ``alloc A path P (tcp 1080)``."""
    proto = r.proto if r.port is None else f"{r.proto} {r.port}"
    fam = "" if r.family == 4 else f", ipv{r.family}"
    return f"alloc {r.alloc} path {r.path} ({proto}{fam})"


def failed(r: ProbeResult) -> bool:
    return not r.ok and not r.skipped


def failure_line(r: ProbeResult) -> str:
    """Write one line for a probe that did not hold: where, and the cause it could see."""
    return f"probe failed: {where(r)}: {r.cause or 'no cause found'}"


def summary(results: Sequence[ProbeResult], took: float | None = None) -> str:
    """Sum up the probes: ``Probes: 10 held, 1 failed, 2 skipped (no host address) in 34 ms.``"""
    n_failed = sum(1 for r in results if failed(r))
    skipped = [r for r in results if r.skipped]
    held = len(results) - n_failed - len(skipped)
    text = f"Probes: {held} held, {n_failed} failed, {len(skipped)} skipped"
    if skipped:
        causes = Counter(r.cause or "cannot exist here" for r in skipped)
        text += " (" + "; ".join(f"{c}: {n}" if len(causes) > 1 else c
                                 for c, n in sorted(causes.items())) + ")"
    if took is not None:
        text += f" in {took * 1000:.0f} ms"
    return text + "."


def text(results: Sequence[ProbeResult], *, verbose: bool = False,
         took: float | None = None) -> str:
    """List every failure (every probe with ``verbose``), then the summary line."""
    lines = []
    for r in results:
        if failed(r):
            lines.append(failure_line(r))
        elif verbose:
            state = f"skipped: {r.cause}" if r.skipped else f"held in {r.ms:.1f} ms"
            lines.append(f"probe {where(r)}: {state}")
    lines.append(summary(results, took))
    return "\n".join(lines) + "\n"


def counts(results: Sequence[ProbeResult]) -> dict[str, int]:
    """Count the probes: ``{"total": 12, "held": 10, "failed": 1, "skipped": 1}``."""
    n_failed = sum(1 for r in results if failed(r))
    skipped = sum(1 for r in results if r.skipped)
    return {"total": len(results), "held": len(results) - n_failed - skipped,
            "failed": n_failed, "skipped": skipped}


def to_json(results: Sequence[ProbeResult], shown: str = "all") -> list[dict[str, object]]:
    """The probes' JSON: every result (``shown`` "all") or only those that failed
    ("failed": an apply of 320 allocations probes 9,000 times; the counts cover them all)."""
    return [r.to_json() for r in results if shown == "all" or failed(r)]
