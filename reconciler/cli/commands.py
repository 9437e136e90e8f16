"""The `reconcile` commands, run in-process.

``reconciler.cli.entry`` hands over everything the plan agent does not answer.

Commands import what only they need inside themselves: `validate`, `status`
and `completion` start without the engine, the planner and the agent (~50 ms
of imports for the engine and planner, ~0.14 s for the agent's modules:
``python -X importtime``), and `watch` alone loads prometheus_client and
watchdog. tests/unit/project/test_layers.py checks what stays out.

See docs/decisions/007-start-up-costs.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

from reconciler.cli.apply import (
    cmd_apply,
    cmd_destroy,
    load_desired,
    print_plan,
    stop_on_signals,
    stopped,
)
from reconciler.config.load import NoFileForHost, load
from reconciler.config.paths import expand_paths
from reconciler.domain.errors import ConfigError, PreconditionError, ReconcilerError
from reconciler.domain.hints import command, set_netns
from reconciler.domain.model import DesiredState
from reconciler.drivers import netns, rundir
from reconciler.ui.argv import normalise_argv
from reconciler.ui.parser import build_parser
from reconciler.ui.render import (
    EXIT_CHANGES,
    EXIT_ERROR,
    EXIT_OK,
    colour,
    emit_json,
    plan_exit,
    render_text,
    write_json,
)

log = logging.getLogger("reconciler")


def cmd_validate(args: argparse.Namespace) -> int:
    # files only: a machine that checks a fleet's files is none of its hosts
    note = ""
    try:
        desired = load_desired(args.paths, args)
    except NoFileForHost as exc:
        desired = load(args.paths, hostname=exc.host, for_host=False)
        note = (f" (no file is for host {exc.host!r}: plan, apply and watch there refuse "
                "them)")
    print(f"{len(desired.files)} file(s) valid: {len(desired.bridges)} bridges, "
          f"{len(desired.subnets)} subnets, {len(desired.allocs)} allocs, "
          f"{len(desired.docker_networks)} docker networks{note}")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from reconciler.cli.safe import tend
    from reconciler.engine.impact import refusal
    from reconciler.engine.reconcile import Reconciler
    from reconciler.ui.options import plan_options

    desired = load_desired(args.paths, args)
    out = None
    if args.out:  # before observing: a path we cannot write is a usage error, not a crash
        try:
            out = open(args.out, "w")  # noqa: SIM115 (closed below)
        except OSError as exc:
            raise ConfigError(f"cannot write the plan here: {exc.strerror}",
                              file=args.out) from None
    rec = Reconciler()
    plan = rec.plan(desired, plan_options(args))
    print_plan(plan, args)
    notes = rec.journal_notes()  # "No changes" is not the whole truth then
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    tend()  # a pending change whose reverter is gone gets another
    if out is not None:
        try:
            with out:  # named: `apply` elsewhere says where it was made
                write_json(dataclasses.replace(plan, scope={**plan.scope, "netns": args.netns})
                           if args.netns and plan.scope else plan, out)
        except OSError as exc:  # ENOSPC, EDQUOT, EIO: at write or at close
            raise ConfigError(f"cannot write the plan here: {exc.strerror or exc}",
                              file=args.out) from None
        print(f"Saved the plan to {args.out}; `{command('apply ' + args.out)}` applies exactly "
              "it.",
              file=sys.stderr)
    refused = refusal(plan, args.max_disruption)
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return EXIT_ERROR
    return plan_exit(plan) or (EXIT_CHANGES if notes else EXIT_OK)


def cmd_confirm(args: argparse.Namespace) -> int:
    from reconciler.cli import safe

    return safe.cmd_confirm(args)


def cmd_revert(args: argparse.Namespace) -> int:
    from reconciler.cli import safe

    return safe.cmd_revert(args)


def cmd_release(args: argparse.Namespace) -> int:
    """Forget the leases of ``KIND/ID`` under the host lock; the host is not touched."""
    from reconciler.engine import leases
    from reconciler.engine.lock import host_lock
    from reconciler.engine.observe import docker_scope

    scope = docker_scope()
    with host_lock(args.lock_timeout):
        fields = leases.release(args.address, scope)
    if fields:
        print(f"Released {args.address}: {', '.join(fields)} (the next apply picks what is "
              "not live afresh).")
    else:
        print(f"{args.address} has no leases in {leases.path(scope)}: nothing released.")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """Compare the config and probe; change nothing (no host lock: it writes no state)."""
    from reconciler.engine.reconcile import (
        Reconciler,
        probe_failures,
    )
    from reconciler.ui import probes as probe_view
    from reconciler.ui.options import plan_options, probe_request

    desired = load_desired(args.paths, args)
    request = probe_request(args)
    rec = Reconciler()
    with stop_on_signals(rec.stop) as signals:
        try:
            plan = rec.plan(desired, plan_options(args))
            t0 = time.monotonic()
            # probe whatever the comparison found: a diff explains a failure, it does not
            # hide one
            # blocked allocations are reported as blocked, not probed as failing (SPEC §11)
            stuck = {b.name for b in plan.blocked if b.kind == "alloc"}
            results = [] if request is None or signals else rec.probe(
                desired, rec.last_live, request=request,
                allocs=[a for a in desired.allocs if a not in stuck] if stuck else None)
            took = time.monotonic() - t0
        finally:
            rec.close_probes()
    if signals:
        return stopped(signals)
    config_ok = not (plan.has_changes or plan.conflicts or plan.blocked or plan.errors)
    failures = probe_failures(results)
    ok = config_ok and not failures
    if args.output == "json":
        emit_json({"ok": ok,
                   "config": {"ok": config_ok,
                              "changes": [c.to_json() for c in (*plan.actionable,
                                                                *plan.conflicts)],
                              "blocked": [b.to_json() for b in plan.blocked]},
                   "probes": probe_view.to_json(results)})
        for e in plan.errors:  # not a change: said where people look, the JSON stays as it is
            print(f"error: {e}", file=sys.stderr)
        return EXIT_OK if ok else EXIT_ERROR
    if config_ok:
        print(f"Config: matches ({plan.summary()['unchanged']} resources).")
    else:
        print("Config: differs from the files:")
        sys.stdout.write(render_text(plan, colour=colour(args), verbose=args.verbose > 0,
                                     compact=getattr(args, "compact", False)))
    if request is None:
        print("Probes: not run (--no-probe).")
    else:
        sys.stdout.write(probe_view.text(results, verbose=args.verbose > 0, took=took))
    why = [w for w, bad in ((f"{len(plan.blocked)} resource(s) blocked", bool(plan.blocked)),
                            ("the config differs", plan.has_changes or bool(plan.errors)),
                            (f"{len(failures)} probe(s) failed", bool(failures))) if bad]
    print("Verify: ok." if ok else f"Verify: failed: {' and '.join(why)}.")
    return EXIT_OK if ok else EXIT_ERROR


def cmd_gc(args: argparse.Namespace) -> int:
    from reconciler.engine.gc import Collector
    from reconciler.ui import gc as gc_view

    desired = load_desired(args.paths, args) if args.paths else None
    collector = Collector()
    if args.dry_run:
        result = collector.report(desired)
    else:
        from reconciler.cli import safe
        from reconciler.engine.reconcile import Reconciler

        def guard() -> None:  # as apply: an overdue change is reverted first, a pending refuses
            safe.guard(Reconciler(collector.observer, runner=collector.runner),
                       err=args.output == "json")

        with stop_on_signals(collector.stop) as signals:
            result = collector.collect(desired, args.lock_timeout, before=guard)
        if signals:
            return stopped(signals)
    if args.output == "json":
        gc_view.write_json(result, sys.stdout)
    else:
        sys.stdout.write(gc_view.text(result, colour=colour(args), verbose=args.verbose > 0))
    for note in result.notes:  # as `plan` says them: what is listed is not all there is
        print(f"note: {note}", file=sys.stderr)
    for o in result.failed:
        print(f"error: {o.change.kind} {o.change.name}: {o.error}", file=sys.stderr)
    if result.residual is not None and result.residual.has_changes:
        left = ", ".join(c.address for c in result.residual.actionable)
        print(f"error: gc finished but these are still to collect: {left}", file=sys.stderr)
    if args.output == "json":
        for e in result.plan.errors:
            print(f"error: {e}", file=sys.stderr)
    return gc_view.exit_code(result)


def cmd_show(args: argparse.Namespace) -> int:
    from reconciler.engine.observe import Observer
    from reconciler.engine.probes import vantage_present
    from reconciler.ui import show

    live = Observer().observe(DesiredState())
    doc = show.view(live, vantage_present(live.host_id))
    if args.output == "json":
        emit_json(doc)
    else:
        sys.stdout.write(show.text(doc))
    return EXIT_OK


def cmd_graph(args: argparse.Namespace) -> int:
    """Print the topology as DOT on stdout (``ui.graph``); plans with files, changes nothing."""
    from reconciler.engine.reconcile import Reconciler
    from reconciler.ui import graph, topology
    from reconciler.ui.options import plan_options

    if args.plan and not args.paths:
        raise ConfigError("graph --plan needs the desired-state files: "
                          f"{command('graph --plan PATH…')}")
    rec = Reconciler()
    desired = load_desired(args.paths, args) if args.paths else None
    plan = rec.plan(desired, plan_options(args)) if desired is not None else None
    live = rec.last_live if desired is not None else rec.observe(DesiredState())
    assert live is not None
    title = ("plan: the files against this host" if args.plan else
             "the files and this host" if desired is not None else
             "what the reconciler owns on this host")
    sys.stdout.write(graph.dot(topology.live_topology(live), desired, plan,
                               actions=args.plan, title=title))
    for w in (plan.warnings if plan else ()):
        print(f"warning: {w}", file=sys.stderr)
    for e in (plan.errors if plan else ()):
        print(f"error: {e}", file=sys.stderr)
    return EXIT_OK


def _watch_prepare(args: argparse.Namespace) -> None:
    """Bind the status socket before --netns, where the operator is (loopback of the host);
    a taken address is bound later, the agent starts all the same (``agent.process``)."""
    from reconciler.agent.status import prepare_tcp

    args.status_socket = None if args.status_addr in ("off", "") else \
        prepare_tcp(args.status_addr)


def cmd_watch(args: argparse.Namespace) -> int:
    from reconciler.agent import passes, process
    from reconciler.agent.logs import configure_logging
    from reconciler.agent.revision import check_permissions
    from reconciler.ui.options import plan_options, probe_request

    for name in ("interval", "debounce", "lock_timeout", "max_backoff"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (name == "interval" and value <= 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    expect = args.expect_revision
    if expect is not None and not re.fullmatch(r"[0-9a-fA-F]{7,40}", expect):
        raise ConfigError(f"--expect-revision {expect!r}: expected a commit id (7 to 40 hex "
                          "digits), not a branch or tag: a moving name would gate nothing")
    if not args.allow_insecure_config:
        check_permissions(args.paths)
    expand_paths(args.paths)  # a missing path is a usage error, not something to wait for
    configure_logging(args.log_format, args.verbose)
    options = passes.WatchOptions(
        paths=tuple(args.paths), plan=plan_options(args), interval=args.interval,
        debounce=args.debounce, backoff_cap=args.max_backoff, lock_timeout=args.lock_timeout,
        hostname=args.hostname, docker_events=not args.no_docker_events,
        strict=not args.allow_insecure_config, plan_server=not args.no_plan_server,
        dry_run=args.dry_run, probe=probe_request(args), probe_interval=args.probe_interval,
        expect_revision=expect, max_disruption=args.max_disruption,
        confirm_within=args.confirm_within)
    return process.run(options, getattr(args, "status_socket", None))


def cmd_status(args: argparse.Namespace) -> int:
    from reconciler.agent import statusclient
    from reconciler.drivers.nsfs import current_inode

    try:
        inode = os.stat(netns.path_of(args.netns)).st_ino if args.netns else current_inode()
    except OSError as exc:
        raise PreconditionError(f"network namespace {args.netns}: {exc.strerror}") from None
    target = statusclient.where_to_ask(args.addr, inode)
    if args.probe is not None:  # the rollout engines' exec check: the code, the reason
        try:
            code, body = statusclient.http_get(target, f"/{args.probe}")
        except (OSError, ValueError) as exc:
            raise ReconcilerError(f"{args.probe}: no answer from the watch agent: "
                                  f"{statusclient.escape(str(exc))[:200]}") from None
        sys.stdout.write(statusclient.escape(body[:4096].decode("utf-8", "replace").strip())
                         + "\n")
        return EXIT_OK if code == 200 else EXIT_ERROR
    doc = statusclient.fetch_from(target)
    if args.output == "json":
        emit_json(doc)  # JSON escapes every control character
    else:
        sys.stdout.write(statusclient.render(doc))
    return EXIT_OK if statusclient.healthy_doc(doc) else EXIT_ERROR


def cmd_completion(args: argparse.Namespace) -> int:
    from reconciler.ui.completion import script

    sys.stdout.write(script(args.shell))
    return EXIT_OK


#: what runs each command of ``ui.parser`` (by its name)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "validate": cmd_validate, "plan": cmd_plan, "apply": cmd_apply, "verify": cmd_verify,
    "destroy": cmd_destroy, "show": cmd_show, "graph": cmd_graph, "watch": cmd_watch,
    "status": cmd_status, "completion": cmd_completion, "gc": cmd_gc, "confirm": cmd_confirm,
    "revert": cmd_revert, "release": cmd_release,
}
#: what runs before --netns moves the process (the status socket binds on the host)
PREPARE: dict[str, Callable[[argparse.Namespace], None]] = {"watch": _watch_prepare}


#: allocations between young-generation collections in a one-shot command (CPython: 700)
ONE_SHOT_GC_THRESHOLD = 20_000


def _one_shot_gc() -> None:
    """Collect cycles less often in a command that runs once and exits.

    What the imports made lives as long as the process: frozen, no collection walks it
    again. A bulk apply builds tens of thousands of small objects that are not garbage
    (ops, observations); at CPython's threshold of 700 allocations they were walked by
    ~160 collections, ~37 ms of an apply of 500. Cycles are still collected, less often.
    ``watch`` keeps the defaults: it runs for months.
    """
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(ONE_SHOT_GC_THRESHOLD, second, third)


def main(argv: Sequence[str] | None = None, *, process: bool = False) -> int:
    """Run the CLI; ``process``: this is the ``reconcile`` process itself (the entry point),
    not a caller that runs commands in its own process (tests, benchmarks)."""
    args_list = normalise_argv(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(args_list)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose else
        logging.WARNING, format="%(levelname)s %(message)s", stream=sys.stderr)
    command = COMMANDS.get(args.command)
    if command is None:
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    set_netns(args.netns)  # the hints it prints carry --netns NAME
    if process and args.command != "watch":
        _one_shot_gc()
    try:
        if getattr(args, "prepare", False):
            PREPARE[args.command](args)
        if args.netns and getattr(args, "enters_netns", True):
            netns.enter_process_netns(args.netns)
        rc: int = command(args)
        return rc
    except ReconcilerError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_ERROR
    except Exception as exc:  # a bug, not a user error: one line, details with -vv
        if args.verbose > 1:
            raise
        if isinstance(exc, OSError) and exc.errno in rundir.WRITE_ERRNOS:
            # a full disk, a read-only mount, a directory we may not write: the machine's
            # state, not a bug
            where = f"{exc.filename}: " if exc.filename else ""
            print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
            return EXIT_ERROR
        print(f"internal error: {type(exc).__name__}: {exc} (run with -vv for details)",
              file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())

