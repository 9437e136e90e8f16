"""How `plan`, `apply` and `destroy` run: load, print, stop on signals, apply.

``commands`` dispatches; the commands that change the host go through
``run_apply`` here (``apply``, ``destroy``; ``verify`` and ``gc`` share the
signal handling). As in ``commands`` (see its docstring), each command imports
inside itself what only it needs, so that the commands that do not need the
engine, the planner or the agent start without them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from reconciler.config.load import load
from reconciler.domain.errors import ConfigError, PreconditionError, StalePlanError
from reconciler.domain.hints import command
from reconciler.domain.model import DesiredState
from reconciler.domain.plan import Action, Plan
from reconciler.drivers.nsfs import NETNS_RUN_DIR, current_id
from reconciler.ui.render import (
    EXIT_ERROR,
    EXIT_OK,
    colour,
    emit_json,
    plan_exit,
    plan_text,
    render_text,
    residual_error,
    summary_line,
)


def load_desired(paths: Sequence[str], args: argparse.Namespace | None = None) -> DesiredState:
    """Load the desired state from ``paths`` for this host (``--hostname``, if given)."""
    return load(paths, hostname=getattr(args, "hostname", None))


def print_plan(plan: Plan, args: argparse.Namespace) -> None:
    """Print ``plan`` on stdout as ``--output`` asks."""
    sys.stdout.write(plan_text(plan, args.output, colour=colour(args), verbose=args.verbose > 0,
                               compact=getattr(args, "compact", False)))


def is_saved_plan(paths: Sequence[str]) -> bool:
    """Tell whether ``paths`` is one file that ``plan --out`` wrote."""
    if len(paths) != 1 or not os.path.isfile(paths[0]):
        return False
    try:
        with open(paths[0], "rb") as fh:
            head = fh.read(64).lstrip()
    except OSError:  # gone (or changed) since the look: the loader says what it is
        return False
    # `plan --out` writes JSON that starts with its format version; a desired-state file in
    # YAML flow style (or JSON) starts with "{" too, but never like this
    return head.startswith(b'{\n  "format_version"') or head.startswith(b'{"format_version"')


def load_saved(path: str) -> Plan:
    """Read a plan ``plan --out`` saved; ``ConfigError`` when it is none."""
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"not a saved plan: {exc}", file=path) from None
    if isinstance(raw, dict) and not isinstance(raw.get("options", {}), dict):
        # the options are checked one by one later (ui.options.saved_plan_options)
        raise ConfigError("not a usable saved plan: options must be a mapping of option "
                          "names to values", file=path)
    try:
        return Plan.from_json(raw)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"not a saved plan: {exc}", file=path) from None


def _where(scope_id: str, netns: str | None) -> str:
    """Name the network namespace of identity ``scope_id`` for people: by its --netns name
    (``netns``, else the one under /run/netns with its inode), or as the host's."""
    inode = scope_id.partition("-")[0]
    if netns is None:
        try:
            names = sorted(os.listdir(NETNS_RUN_DIR))
        except OSError:
            names = []
        for name in names:
            try:
                if str(os.stat(os.path.join(NETNS_RUN_DIR, name)).st_ino) == inode:
                    netns = name
                    break
            except OSError:
                continue
    if netns is not None:
        return f"network namespace {netns} (--netns {netns})"
    try:
        if str(os.stat("/proc/1/ns/net").st_ino) == inode:
            return "the host's network namespace (no --netns)"
    except OSError:
        pass
    return f"network namespace {scope_id} (gone, or unnamed)"


def refuse_other_scope(saved: Plan, path: str, netns: str | None) -> None:
    """Refuse a saved plan made in another network namespace, in one line naming both (it
    would otherwise read as "the live state changed", or worse, fit by chance)."""
    made = saved.scope.get("id")
    here = current_id()
    if not isinstance(made, str) or made == here:
        return  # a plan of a version before scopes were recorded: the fingerprint decides
    name = saved.scope.get("netns")
    there = _where(made, name if isinstance(name, str) else None)
    hint = (f" or run `{command('apply ' + path, netns=name)}`" if isinstance(name, str)
            else "")
    raise ConfigError(f"the saved plan was made in {there}, not in {_where(here, netns)}, "
                      f"where this runs: plan again here{hint}; nothing changed", file=path)


#: the signals that stop a command that probes, the way they stop ``watch``
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[list[int]]:
    """Turn SIGTERM, SIGINT and SIGHUP into the normal stop path, as ``watch`` does, so
    cleanup runs: with the default SIGTERM the process dies where it is and the probes'
    vantage stays behind.

    The handler only sets the stop event (``apply``'s executor stops after the op it is
    running and its probes are not started; ``verify`` does not start probing) and notes
    the signal: a run of probes already started ends by its own timeouts, then the
    ``finally`` blocks close the prober. Raising from the handler instead could leave the
    thread in an allocation's namespace (between ``setns`` and the switch back). The
    signals that came are the value; the command then says so and exits 1.
    """
    got: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        got.append(signum)
        stop.set()

    if threading.current_thread() is not threading.main_thread():
        yield got  # signals reach the main thread only (tests call commands from threads)
        return
    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def stopped(signals: list[int]) -> int:
    """Say which signal stopped the command; its exit code."""
    print(f"error: stopped by {signal.Signals(signals[0]).name}", file=sys.stderr)
    return EXIT_ERROR


def run_apply(args: argparse.Namespace, desired: DesiredState, options: Any,
              saved: Plan | None = None, *, shown: bool = False) -> int:
    """Apply ``desired`` (or ``saved``) under the host lock and report; the exit code.
    ``shown``: the plan was just printed, with the question: it is not printed again."""
    from reconciler.cli import safe
    from reconciler.engine.impact import DisruptionError, refusal
    from reconciler.engine.lock import host_lock
    from reconciler.engine.reconcile import Reconciler
    from reconciler.ui import probes as probe_view
    from reconciler.ui.options import probe_request
    from reconciler.ui.progress import Progress
    from reconciler.ui.progress import wanted as progress_wanted

    rec = Reconciler()
    if args.dry_run:
        plan = rec.plan(desired, options)
        print_plan(plan, args)
        refused = refusal(plan, getattr(args, "max_disruption", None))
        if refused is not None:
            print(f"error: {refused}", file=sys.stderr)
            return EXIT_ERROR
        return plan_exit(plan)
    # destroy has no probe options: it leaves nothing to probe
    request = probe_request(args) if hasattr(args, "no_probe") else None
    window = safe.attach(rec, args, request, options)
    line = Progress() if progress_wanted(sys.stderr, args.output, args.verbose) else None
    with stop_on_signals(rec.stop) as signals:
        try:
            with host_lock(args.lock_timeout), line or contextlib.nullcontext():
                # an overdue change is reverted first; a pending one refuses
                safe.guard(rec, err=args.output == "json")
                result = rec.apply(desired, options, saved=saved, probe=request,
                                   max_disruption=getattr(args, "max_disruption", None),
                                   before_changes=window.before_changes if window else None,
                                   on_plan=line.plan if line else None,
                                   on_outcome=line.outcome if line else None)
                if window is not None:
                    window.settle(result, stopped=bool(signals))
        except DisruptionError as exc:  # what it would have disrupted, then the one line
            print_plan(exc.plan, args)
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        finally:
            rec.close_probes()
    if args.output == "json":
        listed = getattr(args, "probes", "all")
        emit_json({"counts": _counts(result, probe_view.counts(result.probes)),
                   "ok": result.ok,
                   "plan": result.plan.to_json(),
                   "outcomes": [{"kind": o.change.kind, "name": o.change.name,
                                 "action": o.change.action.value, "status": o.status,
                                 "error": o.error} for o in result.outcomes],
                   "residual": result.residual.to_json() if result.residual else None,
                   "probes": probe_view.to_json(result.probes, listed),
                   "probes_listed": listed,
                   "probe_seconds": round(result.probe_seconds, 4)})
    else:
        if shown:  # the plan stands above the question: only what it comes to
            print(summary_line(result.plan))
        else:
            sys.stdout.write(render_text(result.plan, colour=colour(args),
                                         verbose=args.verbose > 0,
                                         compact=getattr(args, "compact", False)))
        if result.outcomes:
            counts = _counts(result, {})
            print(f"Apply: {counts['applied']} applied, {counts['failed']} failed, "
                  f"{counts['skipped']} skipped.")
            for o in result.failed:
                print(f"error: {o.change.kind} {o.change.name}: {o.error}", file=sys.stderr)
        if result.probes:
            print(probe_view.summary(result.probes, result.probe_seconds))
    if result.residual is not None and result.residual.has_changes:
        print(f"error: {residual_error(result.residual)}", file=sys.stderr)
    for e in result.plan.errors:
        print(f"error: {e}", file=sys.stderr)  # an error is one whole line
    for r in result.probe_failures:
        print(f"error: {probe_view.failure_line(r)}", file=sys.stderr)
    if signals:
        if window is not None:
            window.stopped()
        return stopped(signals)
    rc = EXIT_OK if result.ok else EXIT_ERROR
    return window.finish(result, rc) if window is not None else rc


def _counts(result: Any, probes: dict[str, int]) -> dict[str, Any]:
    """What an apply came to, first in its JSON: the plan's summary, the outcomes by status
    and the probes by result."""
    outcomes = {s: sum(1 for o in result.outcomes if o.status == s)
                for s in ("applied", "failed", "skipped")}
    return {**result.plan.summary(), **outcomes,
            **({"probes": probes} if probes else {})}


def cmd_apply(args: argparse.Namespace) -> int:
    from reconciler.ui.options import plan_options, saved_plan_options

    if is_saved_plan(args.paths):  # reviewed when it was saved: never asks
        saved = load_saved(args.paths[0])
        files = [p for p, _h in saved.files]
        if not files:
            raise ConfigError("the saved plan names no desired-state files", file=args.paths[0])
        if args.no_prune or args.adopt or args.force_replace:
            raise ConfigError("apply of a saved plan uses the options it was planned with; "
                              "give --no-prune/--adopt/--force-replace to `plan --out`",
                              file=args.paths[0])
        options = saved_plan_options(saved.options, file=args.paths[0])
        refuse_other_scope(saved, args.paths[0], args.netns)
        return run_apply(args, load_desired(files, args), options, saved)
    desired, options = load_desired(args.paths, args), plan_options(args)
    shown = None
    if not args.dry_run and not args.yes and interactive():
        go, shown, finished = _confirm_apply(args, desired, options)
        if not go:
            print("Apply cancelled; " + ("nothing was applied (an interrupted change was "
                                         "carried on first: see above)." if finished else
                                         "nothing changed."), file=sys.stderr)
            return EXIT_ERROR
    try:
        return run_apply(args, desired, options, shown, shown=shown is not None)
    except StalePlanError:
        if shown is None:
            raise
        raise StalePlanError("the host changed while apply was waiting for the answer; "
                             "nothing was applied: run apply again") from None


def cmd_destroy(args: argparse.Namespace) -> int:
    from reconciler.engine.probes import remove_unused_vantage
    from reconciler.planner.context import PlanOptions

    options = PlanOptions(prune=True)
    shown = None
    if not args.dry_run and not args.yes:
        if not interactive():  # cron, ssh without -t, CI: no one saw what goes
            raise PreconditionError(
                "destroy removes everything the reconciler manages here and no one is at a "
                "terminal to confirm it: give --yes (or --dry-run to see what it would "
                "remove); nothing was destroyed")
        shown, finished = _confirm_destroy(args, options)
        if shown is None:
            print("Destroy cancelled; " + ("nothing was destroyed (an interrupted change was "
                                           "carried on first: see above)." if finished else
                                           "nothing changed."), file=sys.stderr)
            return EXIT_ERROR
    try:
        rc = run_apply(args, DesiredState(), options, shown,
                       shown=shown is not None and shown.has_changes)
    except StalePlanError:
        if shown is None:
            raise
        raise StalePlanError("the host changed while destroy was waiting for the answer; "
                             "nothing was destroyed: run destroy again") from None
    if not args.dry_run and remove_unused_vantage() and args.output == "text":
        print("Removed the probes' external vantage (no prober uses it).")
    return rc


def interactive() -> bool:
    """Tell whether someone is at a terminal: ``apply`` and ``destroy`` ask them; a pipe, a file
    or /dev/null is a script."""
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except ValueError:  # closed
        return False


#: what ``destroy`` asks on a terminal, and the one answer that goes on (as Terraform)
DESTROY_QUESTION = ("Do you really want to destroy everything the reconciler manages here?\n"
                    "  There is no undo. Only 'yes' will be accepted to confirm.\n\n"
                    "  Enter a value: ")


#: what ``apply`` asks on a terminal when the plan deletes, replaces or disrupts (as Terraform)
APPLY_QUESTION = ("Do you want to perform these actions?\n"
                  "  The plan above deletes, replaces or disrupts what is listed. Only 'yes' "
                  "will be accepted to approve.\n\n"
                  "  Enter a value: ")


def destructive(plan: Plan) -> bool:
    """Tell whether ``plan`` deletes, replaces or disrupts anything: what ``apply`` asks
    about on a terminal (a plan that only creates or changes without impact goes on)."""
    return bool(plan.impacted) or any(c.action in (Action.DELETE, Action.REPLACE)
                                      for c in plan.actionable)


def _ask(question: str) -> bool:
    """Ask ``question`` on stderr; True for the one answer that goes on: ``yes``."""
    sys.stdout.flush()
    sys.stderr.write("\n" + question)
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if not answer.endswith("\n"):
        sys.stderr.write("\n")  # end of input: no answer is no
    return answer.strip() == "yes"


def _show(plan: Plan, args: argparse.Namespace) -> None:
    """Print the plan a question is about (on stderr with ``--output json``: stdout stays
    one JSON document, the result's)."""
    if args.output == "json":
        sys.stderr.write(plan_text(plan, "text", colour=colour(args), verbose=args.verbose > 0,
                                   compact=getattr(args, "compact", False)))
    else:
        print_plan(plan, args)


def _finish_journals(rec: Any, args: argparse.Namespace) -> bool:
    """Finish under the lock a change a killed run left half done (its journal), as ``apply``
    does first: a plan of the half-made state is what nobody can confirm (``apply`` then
    finds the host changed). Whether that touched the host."""
    from reconciler.engine.finish import touched_host
    from reconciler.engine.lock import host_lock

    if not rec.journals_pending():
        return False
    with host_lock(args.lock_timeout):
        return any(touched_host(line) for line in rec.finish_journals())


def _confirm_apply(args: argparse.Namespace, desired: DesiredState,
                   options: Any) -> tuple[bool, Plan | None, bool]:
    """Plan ``apply`` on a terminal and, when the plan deletes, replaces or disrupts
    anything, show it and ask. Whether to go on; the plan shown (None: nothing was asked,
    ``apply`` plans again itself, so that a change meanwhile is applied, not refused); and
    whether interrupted changes were finished first.

    The plan shown is the one applied: ``apply`` checks it against the live state again
    under the lock (as a saved plan), so what changed meanwhile is refused, not applied.
    """
    from reconciler.cli import safe
    from reconciler.engine.lock import host_lock
    from reconciler.engine.reconcile import Reconciler

    rec = Reconciler()
    finished = _finish_journals(rec, args)
    with host_lock(args.lock_timeout):  # a pending change refuses before anyone is asked
        safe.guard(rec, err=args.output == "json")
    plan = rec.plan(desired, options)
    if not destructive(plan) or plan.conflicts:
        return True, None, finished  # nothing to ask (a conflict: apply refuses it itself)
    _show(plan, args)
    if not _ask(APPLY_QUESTION):
        return False, None, finished
    return True, plan, finished


def _confirm_destroy(args: argparse.Namespace, options: Any) -> tuple[Plan | None, bool]:
    """Show what ``destroy`` removes and ask; the plan when confirmed (or nothing to do),
    and whether interrupted changes were finished first.

    The plan shown is the one applied: ``apply`` checks it against the live state again
    under the lock (as a saved plan), so what changed meanwhile is refused, not removed.
    A change a killed run left half done (its journal) is finished under the lock before
    the plan is made, as ``apply`` would do first: a plan of the half-made state would be
    what nobody can confirm (``apply`` then finds the host changed).
    """
    from reconciler.engine.reconcile import Reconciler

    rec = Reconciler()
    finished = _finish_journals(rec, args)
    plan = rec.plan(DesiredState(), options)
    _show(plan, args)
    if not plan.has_changes:
        return plan, finished
    return (plan if _ask(DESTROY_QUESTION) else None), finished
