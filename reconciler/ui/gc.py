"""What `reconcile gc` prints: the removals and stale files as text or JSON, and its exit code.

Removals are shown as `plan` shows changes (``ui.render``: symbol, kind, name,
reason; ``-v`` adds the ops); the vantage and stale files follow as
``- file PATH: why``.
"""

from __future__ import annotations

from collections import Counter
from typing import TextIO

from reconciler.domain.plan import Plan
from reconciler.engine.gc import GcResult
from reconciler.ui.render import EXIT_CHANGES, EXIT_ERROR, EXIT_OK, emit_json, render_text


def exit_code(result: GcResult) -> int:
    """Return the exit code of ``--plan``: 0 nothing to collect, 2 something (or a killed run's
    journal pending), 1 an error; else 0 when everything went (and the host was found clean after),
    1 otherwise."""
    if not result.collected:
        if result.plan.errors:
            return EXIT_ERROR
        # a journal pending: what is listed is not the whole truth (as `plan` exits 2)
        return EXIT_CHANGES if result.anything or result.notes else EXIT_OK
    return EXIT_OK if result.ok else EXIT_ERROR


def counted(result: GcResult) -> str:
    """Count for people: ``2 objects (1 alloc, 1 veth) and 1 file``."""
    kinds = Counter(c.kind for c in result.plan.actionable)
    if result.vantage is not None:
        kinds["probe vantage"] += 1
    n, files = sum(kinds.values()), len(result.files)
    parts = ", ".join(f"{k} {kind}" for kind, k in sorted(kinds.items()))
    text = f"{n} object{'s' if n != 1 else ''}" + (f" ({parts})" if parts else "")
    return text + f" and {files} file{'s' if files != 1 else ''}"


def text(result: GcResult, *, colour: bool = False, verbose: bool = False) -> str:
    # the changes as `plan` shows them, without its summary line (and the blank before it)
    lines = render_text(Plan(result.plan.actionable), colour=colour,
                        verbose=verbose).splitlines()[:-2]
    if result.vantage is not None:
        lines.append(f"  - probe vantage {result.vantage}: left by a prober that is gone "
                     "(no prober holds its lock)")
    for f in result.files:
        lines.append(f"  - file {f.path}: {f.reason}")
    lines += [f"warning: {w}" for w in result.plan.warnings]
    lines += [f"error: {e}" for e in result.plan.errors]
    if lines:
        lines.append("")
    if not result.anything:
        lines.append("Nothing to collect.")
    elif not result.collected:
        lines.append(f"Gc: {counted(result)} to collect.")
    else:
        applied = sum(1 for o in result.outcomes if o.status == "applied")
        total = len(result.outcomes) + (result.vantage is not None)
        applied += result.vantage_removed
        lines.append(f"Collected: {applied} of {total} object(s), "
                     f"{len(result.removed)} of {len(result.files)} file(s).")
        if result.released:
            lines.append(f"Released the leases of {', '.join(result.released)} (no longer "
                         "declared).")
    return "\n".join(lines) + "\n"


def to_json(result: GcResult) -> dict[str, object]:
    plan = result.plan.to_json()
    return {
        "collected": result.collected,
        "changes": plan["changes"],
        "files": [f.to_json() for f in result.files],
        "probe_vantage": result.vantage,
        "warnings": plan["warnings"],
        "errors": plan["errors"],
        "outcomes": [{"kind": o.change.kind, "name": o.change.name, "status": o.status,
                      "error": o.error} for o in result.outcomes],
        "removed_files": [f.path for f in result.removed],
        "released_leases": list(result.released),
        "probe_vantage_removed": result.vantage_removed,
        "residual": result.residual.to_json()["changes"] if result.residual else None,
        "ok": result.ok if result.collected else not result.plan.errors,
        "notes": result.notes,
        "journals": result.finished,
    }


def write_json(result: GcResult, out: TextIO) -> None:
    emit_json(to_json(result), out)
