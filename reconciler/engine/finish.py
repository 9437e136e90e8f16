"""Finish the changes a killed run left half done (their journals), before anything is planned.

``apply``, ``destroy``, ``gc`` and each ``watch`` pass call ``finish_journals`` under the
host lock first: a journal (``engine/journal.py``) still there means its change was
interrupted, and planning first would see only the half-made state — a
re-created network with no containers is "No changes", an adopted namespace
without ``eth0`` is "not ours". Each journal is carried to its end (or, for a
replace whose new network cannot be made, undone) and removed, and one line says
so. A journal that cannot be finished (a container gone, a namespace gone) says
what was left and is removed too: the next run does not try it again. Only a
temporary failure (the Docker daemon unreachable, a container that could not be
put back) or a ``StrandedError`` (containers off their network and another's
network of that name in the way) keeps it for the run after.

See docs/decisions/023-journals.md.
"""

from __future__ import annotations

import logging

from reconciler.domain.errors import ReconcilerError, StrandedError, TemporaryError
from reconciler.domain.plan import Op
from reconciler.engine.hostops import HostOps
from reconciler.engine.journal import ALLOC, DOCKER, BadJournal, Journal

log = logging.getLogger("reconciler")


#: how the lines about a journal that was left alone (nothing done) begin
LEFT_ALONE = "journal: "


#: how the lines about a journal that was tried but not finished say so (after its name)
NOT_FINISHED = ": could not finish an interrupted "


def finished(line: str) -> bool:
    """Tell whether a line ``finish_journals`` said reports a change carried to its end (or undone),
    not one it could not finish."""
    return touched_host(line) and NOT_FINISHED not in line


def touched_host(line: str) -> bool:
    """Tell whether a line ``finish_journals`` said is about a journal it acted on (the host may
    have changed), not one it left alone."""
    return not line.startswith(LEFT_ALONE)


def finish_journals(ops: HostOps) -> list[str]:
    """Finish every interrupted change of this scope; the lines said (also logged)."""
    lines = []
    for journal in ops.journals.pending():
        if isinstance(journal, BadJournal):
            line = f"{LEFT_ALONE}{journal}"
            log.error("%s", line)
            lines.append(line)
            continue
        if journal.kind == DOCKER:
            line = _finish_replace(ops, journal)
        elif journal.kind == ALLOC:
            line = _finish_ops(ops, journal)
        else:
            line = f"{LEFT_ALONE}{journal.path}: unknown kind {journal.kind!r}; left alone"
        log.warning("%s", line)
        lines.append(line)
    return lines


def _finish_replace(ops: HostOps, journal: Journal) -> str:
    what = f"docker network {journal.name}"
    try:
        result = ops.resume_docker_replace(journal)
    except (KeyError, TypeError, ValueError) as exc:
        return (f"{LEFT_ALONE}{journal.path}: not a replace this version can finish ({exc}); "
                "left alone")
    except (TemporaryError, StrandedError) as exc:
        why = _why(exc, what).removesuffix(" (journal kept)")
        return f"{what}{NOT_FINISHED}replace yet: {why}; kept for the next run"
    except ReconcilerError as exc:
        return f"{what}{NOT_FINISHED}replace: {_why(exc, what)}"
    for w in result.warnings:
        log.warning("%s", w)
    names = ", ".join(result.reconnected)
    line = (f"{what}: {'undid' if result.undone else 'finished'} an interrupted replace "
            f"(started by another run): {len(result.reconnected)} container(s) attached"
            + (f" ({names})" if names else ""))
    if result.gone:
        line += f"; {', '.join(result.gone)} gone meanwhile, not reconnected"
    return line


def _finish_ops(ops: HostOps, journal: Journal) -> str:
    what = f"{journal.kind} {journal.name}"
    doing = "adopt" if journal.body.get("adopt") else "heal"
    try:
        wire = [Op.from_json(raw) for raw in journal.body["ops"]]
        done = [int(s.split(":", 1)[1]) for s in journal.steps if s.startswith("op:")]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        return (f"{LEFT_ALONE}{journal.path}: not a change this version can finish ({exc}); "
                "left alone")
    start = max(done) + 1 if done else 0
    try:
        for i in range(start, len(wire)):
            ops.run(wire[i])
            journal.done(f"op:{i}")
    except TemporaryError as exc:
        return f"{what}{NOT_FINISHED}{doing} yet: {exc}; kept for the next run"
    except ReconcilerError as exc:
        journal.close()
        hint = f" (`apply --adopt {what.replace(' ', '/')}` takes it over)" if doing == "adopt" \
            else ""
        return f"{what}{NOT_FINISHED}{doing}: {exc}{hint}"
    journal.close()
    return (f"{what}: finished an interrupted {doing} (started by another run): "
            f"{len(wire) - start} of {len(wire)} step(s) left")


def _why(exc: Exception, what: str) -> str:
    """Strip from the driver's message the prefix the line already has."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    for prefix in (f"{what}: finish replace: ", f"{what}: replace: ", f"{what}: "):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text
