"""What commands print and exit with: plans as text or JSON, colour, exit codes.

The plan agent answers `reconcile plan` with exactly this text, so the CLI
and the agent share it. Lines, groups and elision: ``ui.scale``
(docs/decisions/050-output-that-scales.md).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections import Counter
from typing import TextIO

from reconciler.domain.errors import VerifyError
from reconciler.domain.plan import Action, AttrChange, Change, Json, Plan, impact_detail
from reconciler.ui import impact, scale

EXIT_OK, EXIT_ERROR, EXIT_CHANGES = 0, 1, 2


def colour(args: argparse.Namespace) -> bool:
    if args.color == "always":
        return True
    if args.color == "never" or os.environ.get("NO_COLOR"):
        return False
    return sys.stdout.isatty()


def plan_text(plan: Plan, output: str, *, colour: bool, verbose: bool,
              compact: bool = False) -> str:
    """Return what `plan` prints (the plan agent answers with exactly this too)."""
    if output == "json":
        buf = io.StringIO()
        write_json(plan, buf)
        return buf.getvalue()
    return render_text(plan, colour=colour, verbose=verbose, compact=compact)


def plan_exit(plan: Plan) -> int:
    if plan.conflicts or plan.errors:
        return EXIT_ERROR
    return EXIT_CHANGES if plan.has_changes else EXIT_OK


_COLOURS = {
    Action.CREATE: "\033[32m", Action.UPDATE: "\033[33m", Action.DELETE: "\033[31m",
    Action.REPLACE: "\033[35m", Action.CONFLICT: "\033[1;31m",
}


_RESET = "\033[0m"


def _fmt(value: Json) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _attr_line(c: Change, a: AttrChange) -> str:
    """One attribute: ``mtu: 1500 -> 1400``; a port map edit as the maps it takes away and
    the ones it makes (``ports: 8080/tcp->80 => 8082/tcp->80``); lists elided to fit."""
    head = f"      {a.field}"
    if a.before is None and a.after is not None and c.action is Action.CREATE:
        return head + " = " + scale.fit(_fmt(a.after), scale.WIDTH - len(head) - 3)
    if a.field == "ports" and isinstance(a.before, list) and isinstance(a.after, list):
        gone = [m for m in a.before if m not in a.after]
        new = [m for m in a.after if m not in a.before]
        room = (scale.WIDTH - len(head) - 6) // 2
        return (f"{head}: {scale.fit(', '.join(gone) or '(none)', room)} => "
                f"{scale.fit(', '.join(new) or '(none)', room)}")
    before, after = _fmt(a.before), _fmt(a.after)
    room = scale.WIDTH - len(head) - 6
    if len(before) + len(after) > room:
        half = max(room // 2, room - min(len(before), len(after)))
        before = scale.fit(before, min(half, room - min(len(after), room // 2)))
        after = scale.fit(after, room - len(before))
    return f"{head}: {before} -> {after}"


def _head(sym: str, what: str, reason: str, action: Action, colour: bool) -> str:
    head = f"{sym:>3} {what}"
    if reason:
        head += ": " + scale.fit(reason, scale.WIDTH - len(head) - 2)
    if colour and action in _COLOURS:
        head = f"{_COLOURS[action]}{head}{_RESET}"
    return head


def _impact_lines(c: Change, verbose: bool) -> list[str]:
    lines = [scale.fit(line) for line in impact.change_lines(c)]
    if verbose or len(lines) <= scale.IMPACT_SHOWN + 1:
        return lines
    rest = c.impact[scale.IMPACT_SHOWN:]
    return [*lines[:scale.IMPACT_SHOWN],
            f"      impact: … and {len(rest)} more ({impact_detail(rest)}; -v lists each)"]


def _change_lines(c: Change, *, colour: bool, verbose: bool,
                  shared: frozenset[str]) -> list[str]:
    lines = [_head(c.action.symbol, f"{c.kind} {c.name}", c.reason, c.action, colour)]
    lines += [_attr_line(c, a) for a in c.attrs]
    lines += [scale.fit(f"      warning: {w}") for w in c.warnings if w not in shared]
    lines += _impact_lines(c, verbose)
    if c.source:
        lines.append(scale.fit(f"      # {c.source}"))
    if verbose:
        lines += [scale.fit(f"      > {o.describe()}") for o in c.ops]
    return lines


def _group_lines(g: scale.Group, *, colour: bool, shared: frozenset[str]) -> list[str]:
    c = g.first
    lines = [_head(c.action.symbol, g.head(), c.reason, c.action, colour)]
    lines += [_attr_line(c, a) for a in c.attrs]
    lines += [scale.fit(f"      warning: {w}") for w in c.warnings if w not in shared]
    for i in c.impact:  # the same for each, but for its addresses (-v, JSON)
        flows = impact.flows_phrase(i.flows)
        lines.append(scale.fit(f"      impact: {scale.plural(i.type, len(g.changes))}: "
                               f"{i.effect}" + (f"; {flows}" if flows else "")))
    lines.append(scale.fit(f"      {c.kind}s: {scale.names([x.name for x in g.changes])}"
                           + (" (-v lists each)" if len(g.changes) > scale.NAMES_SHOWN else "")))
    return lines


def _shared_warnings(changes: list[Change]) -> dict[str, list[str]]:
    """The warnings said under more than one change: said once, after the changes, with the
    resources they apply to."""
    who: dict[str, list[str]] = {}
    for c in changes:
        for w in dict.fromkeys(c.warnings):
            who.setdefault(w, []).append(f"{c.kind} {c.name}")
    return {w: names for w, names in who.items() if len(names) > 1}


def summary_line(plan: Plan) -> str:
    """Sum up the plan: ``Plan: 1 to create, … (3 unchanged).`` or ``No changes. …``."""
    s = plan.summary()
    if plan.has_changes or s["conflict"]:
        summary = (f"Plan: {s['create']} to create, {s['update']} to update, "
                   f"{s['replace']} to replace, {s['delete']} to delete")
        if s["conflict"]:
            summary += f", {s['conflict']} conflict{'s' if s['conflict'] != 1 else ''}"
        return summary + f" ({s['unchanged']} unchanged)."
    return f"No changes. {s['unchanged']} resources match the desired state."


def render_text(plan: Plan, *, colour: bool = False, verbose: bool = False,
                compact: bool = False) -> str:
    """Render Terraform-style text: one block per change (identical changes to many
    resources as one, with a count, unless ``verbose``), then a summary line; no line
    over :data:`scale.WIDTH`. ``compact``: counts only (:func:`render_compact`)."""
    if compact:
        return render_compact(plan)
    lines: list[str] = []
    changes = [c for c in plan.changes if c.action is not Action.NOOP]
    shared = {} if verbose else _shared_warnings(changes)
    for b in scale.blocks(changes, group=not verbose):
        if isinstance(b, scale.Group):
            lines += _group_lines(b, colour=colour, shared=frozenset(shared))
        else:
            lines += _change_lines(b, colour=colour, verbose=verbose,
                                   shared=frozenset(shared))
    for w, who in shared.items():
        lines.append(scale.fit(f"warning ({scale.names(who)}): {w}"))
    lines += scale.warning_lines(plan.warnings)
    lines += scale.warning_lines(plan.errors, "error", whole=True)
    if lines:
        lines.append("")
    disrupted = impact.summary(plan)
    if disrupted is not None:
        lines.append(disrupted)
    lines.append(summary_line(plan))
    return "\n".join(lines) + "\n"


def render_compact(plan: Plan) -> str:
    """Render the plan for CI logs: per action, how many of each kind; warnings counted;
    errors and conflicts each on a line (they stop the apply); the impact and summary."""
    lines = []
    for action in (Action.CREATE, Action.UPDATE, Action.REPLACE, Action.DELETE):
        kinds = Counter(c.kind for c in plan.changes if c.action is action)
        if kinds:
            lines.append(scale.fit(f"{action.symbol:>3} " + ", ".join(
                scale.plural(k, n) for k, n in sorted(kinds.items()))))
    for c in plan.conflicts:
        lines.append(_head(c.action.symbol, f"{c.kind} {c.name}", c.reason, c.action, False))
    warned = len(plan.warnings) + sum(len(c.warnings) for c in plan.actionable)
    if warned:
        lines.append(f"warnings: {warned} (the full plan lists them)")
    lines += scale.warning_lines(plan.errors, "error", whole=True)
    disrupted = impact.summary(plan)
    if disrupted is not None:
        lines.append(disrupted)
    lines.append(summary_line(plan))
    return "\n".join(lines) + "\n"


def emit_json(doc: object, out: TextIO | None = None) -> None:
    """Write ``doc`` as indented JSON and a newline, in one write (``json.dump`` writes each
    token on its own: 340,000 writes, ~0.25 s, for an apply of 500 with its probes), to
    ``out`` or the ``sys.stdout`` of the moment (a redirected one too)."""
    (out if out is not None else sys.stdout).write(json.dumps(doc, indent=2) + "\n")


def write_json(plan: Plan, out: TextIO | None = None) -> None:
    emit_json(plan.to_json(), out)



def residual_error(residual: Plan) -> VerifyError:
    """Say what is still different after an apply, as the error commands and the agent report."""
    return VerifyError("apply finished but the host still differs from the desired state:\n"
                       + render_text(residual).rstrip())
