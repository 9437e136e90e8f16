"""The `reconcile` command line."""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from reconciler import __version__
from reconciler.errors import ConfigError, ReconcilerError
from reconciler.model import DesiredState
from reconciler.plan import Plan, render_text, write_json

EXIT_OK, EXIT_ERROR, EXIT_CHANGES = 0, 1, 2
log = logging.getLogger("reconciler")


def _colour(args: argparse.Namespace) -> bool:
    if args.color == "always":
        return True
    if args.color == "never" or os.environ.get("NO_COLOR"):
        return False
    return sys.stdout.isatty()


def _plan_options(args: argparse.Namespace) -> Any:
    from reconciler.planner import PlanOptions

    adopt = frozenset(args.adopt or ())
    kinds = ("bridge", "subnet", "alloc", "docker_network")
    for a in adopt:
        kind, _, name = a.partition("/")
        if kind not in kinds or not name:
            raise ConfigError(f"--adopt {a}: expected KIND/NAME with KIND one of "
                              f"{', '.join(kinds)} (e.g. bridge/nomad)")
    return PlanOptions(prune=not args.no_prune, adopt=adopt,
                       force_replace=getattr(args, "force_replace", False))


def _load(paths: Sequence[str], args: argparse.Namespace | None = None) -> DesiredState:
    from reconciler.loader import load

    return load(paths, hostname=getattr(args, "hostname", None))


def plan_text(plan: Plan, output: str, *, colour: bool, verbose: bool) -> str:
    """What `plan` prints (the plan agent answers with exactly this too)."""
    if output == "json":
        buf = io.StringIO()
        write_json(plan, buf)
        return buf.getvalue()
    return render_text(plan, colour=colour, verbose=verbose)


def _print_plan(plan: Plan, args: argparse.Namespace) -> None:
    sys.stdout.write(plan_text(plan, args.output, colour=_colour(args), verbose=args.verbose > 0))


def _plan_exit(plan: Plan) -> int:
    if plan.conflicts or plan.errors:
        return EXIT_ERROR
    return EXIT_CHANGES if plan.has_changes else EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    desired = _load(args.paths, args)
    print(f"{len(desired.files)} file(s) valid: {len(desired.bridges)} bridges, "
          f"{len(desired.subnets)} subnets, {len(desired.allocs)} allocs, "
          f"{len(desired.docker_networks)} docker networks")
    return EXIT_OK


def _is_saved_plan(paths: Sequence[str]) -> bool:
    if len(paths) != 1 or not os.path.isfile(paths[0]):
        return False
    with open(paths[0], "rb") as fh:
        head = fh.read(64).lstrip()
    # `plan --out` writes JSON that starts with its format version; a desired-state file in
    # YAML flow style (or JSON) starts with "{" too, but never like this
    return head.startswith(b'{\n  "format_version"') or head.startswith(b'{"format_version"')


def cmd_plan(args: argparse.Namespace) -> int:
    from reconciler.reconcile import Reconciler

    desired = _load(args.paths, args)
    out = None
    if args.out:  # before observing: a path we cannot write is a usage error, not a crash
        try:
            out = open(args.out, "w")  # noqa: SIM115 (closed below)
        except OSError as exc:
            raise ConfigError(f"cannot write the plan here: {exc.strerror}",
                              file=args.out) from None
    plan = Reconciler().plan(desired, _plan_options(args))
    _print_plan(plan, args)
    if out is not None:
        with out:
            write_json(plan, out)
        print(f"Saved the plan to {args.out}; `reconcile apply {args.out}` applies exactly it.",
              file=sys.stderr)
    return _plan_exit(plan)


def _load_saved(path: str) -> Plan:
    try:
        with open(path) as fh:
            return Plan.from_json(json.load(fh))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"not a saved plan: {exc}", file=path) from None


def _apply(args: argparse.Namespace, desired: DesiredState, options: Any,
           saved: Plan | None = None) -> int:
    from reconciler.lock import host_lock
    from reconciler.reconcile import Reconciler, residual_error

    rec = Reconciler()
    if args.dry_run:
        plan = rec.plan(desired, options)
        _print_plan(plan, args)
        return _plan_exit(plan)
    with host_lock(args.lock_timeout):
        result = rec.apply(desired, options, saved=saved)
    if args.output == "json":
        json.dump({"plan": result.plan.to_json(),
                   "outcomes": [{"kind": o.change.kind, "name": o.change.name,
                                 "action": o.change.action.value, "status": o.status,
                                 "error": o.error} for o in result.outcomes],
                   "residual": result.residual.to_json() if result.residual else None,
                   "ok": result.ok}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(result.plan, colour=_colour(args),
                                     verbose=args.verbose > 0))
        if result.outcomes:
            counts = {s: sum(1 for o in result.outcomes if o.status == s)
                      for s in ("applied", "failed", "skipped")}
            print(f"Apply: {counts['applied']} applied, {counts['failed']} failed, "
                  f"{counts['skipped']} skipped.")
            for o in result.failed:
                print(f"error: {o.change.kind} {o.change.name}: {o.error}", file=sys.stderr)
    if result.residual is not None and result.residual.has_changes:
        print(f"error: {residual_error(result.residual)}", file=sys.stderr)
    for e in result.plan.errors:
        print(f"error: {e}", file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_ERROR


def cmd_apply(args: argparse.Namespace) -> int:
    if _is_saved_plan(args.paths):
        saved = _load_saved(args.paths[0])
        files = [p for p, _h in saved.files]
        if not files:
            raise ConfigError("the saved plan names no desired-state files", file=args.paths[0])
        if args.no_prune or args.adopt or args.force_replace:
            raise ConfigError("apply of a saved plan uses the options it was planned with; "
                              "give --no-prune/--adopt/--force-replace to `plan --out`",
                              file=args.paths[0])
        from reconciler.planner import PlanOptions

        o = saved.options
        options = PlanOptions(prune=bool(o.get("prune", True)),
                              adopt=frozenset(o.get("adopt", ())),
                              force_replace=bool(o.get("force_replace", False)))
        return _apply(args, _load(files, args), options, saved)
    return _apply(args, _load(args.paths, args), _plan_options(args))


def cmd_destroy(args: argparse.Namespace) -> int:
    from reconciler.planner import PlanOptions

    return _apply(args, DesiredState(), PlanOptions(prune=True))


def cmd_show(args: argparse.Namespace) -> int:
    from reconciler.docker_logic import SCOPE_LABEL
    from reconciler.observe import Observer
    from reconciler.ownership import CHAIN_PREFIX

    live = Observer().observe(DesiredState())
    owned_links = {n: lk for n, lk in sorted(live.links.items()) if lk.owned}
    view: dict[str, Any] = {
        "links": [{"name": n, "kind": lk.kind, "mtu": lk.mtu, "up": lk.up, "master": lk.master,
                   "addresses": [str(a.address) for a in lk.addresses if a.owned]}
                  for n, lk in owned_links.items()],
        "firewall": {f"ipv{fam}": {f"{t}/{c}": list(r) for (t, c), r in sorted(fw.chains.items())
                                   if c.startswith(CHAIN_PREFIX)}
                     for fam, fw in ((4, live.firewall4), (6, live.firewall6))},
        "netns": sorted(live.netns),
        "docker_networks": [{"name": n.name, "id": n.id[:12], "subnets": list(n.subnets),
                             "scope": n.labels.get(SCOPE_LABEL)}
                            for n in (live.docker.networks if live.docker else ()) if n.owned],
    }
    if args.output == "json":
        json.dump(view, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    for lk in view["links"]:
        addrs = " ".join(lk["addresses"])
        master = f" master {lk['master']}" if lk["master"] else ""
        print(f"{lk['kind'] or 'link'} {lk['name']}: mtu {lk['mtu']} "
              f"{'up' if lk['up'] else 'down'}{master} {addrs}".rstrip())
    for fam, chains in view["firewall"].items():
        for chain, rules in chains.items():
            print(f"{fam} {chain}: {len(rules)} rules")
    for ns in view["netns"]:
        print(f"netns {ns}")
    for dn in view["docker_networks"]:
        scope = f" [scope {dn['scope']}]" if dn["scope"] else ""
        print(f"docker network {dn['name']} ({dn['id']}) {' '.join(dn['subnets'])}{scope}")
    if not any((view["links"], any(view["firewall"].values()), view["netns"],
                view["docker_networks"])):
        print("Nothing managed by the reconciler on this host.")
    return EXIT_OK


def _watch_prepare(args: argparse.Namespace) -> None:
    """Before --netns: bind the status socket where the operator is (loopback of the host)."""
    from reconciler.status import bind

    args.status_socket = None if args.status_addr in ("off", "") else bind(args.status_addr)


def cmd_watch(args: argparse.Namespace) -> int:
    from reconciler import watch
    from reconciler.paths import expand_paths

    for name in ("interval", "debounce", "lock_timeout", "max_backoff"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (name == "interval" and value <= 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    if not args.allow_insecure_config:
        watch.check_permissions(args.paths)
    expand_paths(args.paths)  # a missing path is a usage error, not something to wait for
    watch.configure_logging(args.log_format, args.verbose)
    options = watch.WatchOptions(
        paths=tuple(args.paths), plan=_plan_options(args), interval=args.interval,
        debounce=args.debounce, backoff_cap=args.max_backoff, lock_timeout=args.lock_timeout,
        hostname=args.hostname, docker_events=not args.no_docker_events,
        strict=not args.allow_insecure_config, plan_server=not args.no_plan_server,
        dry_run=args.dry_run)
    return watch.run(options, getattr(args, "status_socket", None))


def cmd_status(args: argparse.Namespace) -> int:
    from reconciler import status

    doc = status.fetch(args.addr)
    if args.output == "json":
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(status.render(doc))
    return EXIT_OK if status.healthy_doc(doc) else EXIT_ERROR


def cmd_completion(args: argparse.Namespace) -> int:
    from reconciler.completion import script

    sys.stdout.write(script(build_parser(), args.shell))
    return EXIT_OK


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 1: exit 2 means "changes present" in this tool."""

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="reconcile",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Declarative reconciler for Linux host networking: bridges, subnets,\n"
                    "network-namespace allocations with port maps, and Docker networks,\n"
                    "kept in YAML files (a directory is read as all its *.yaml files).",
        epilog="examples:\n"
               "  reconcile validate examples/quickstart.yaml     check a file, touch nothing\n"
               "  reconcile --netns sandbox plan examples/fleet/  what would change in a sandbox\n"
               "  reconcile apply /etc/reconciler                 change this host, then verify\n"
               "  reconcile watch /etc/reconciler                 keep this host converged\n"
               "\n"
               "Global options go before COMMAND; `reconcile COMMAND --help` shows the rest.\n"
               "Exit codes: 0 success or no changes, 2 changes present (plan), 1 error.")
    p.add_argument("--version", action="version", version=f"reconcile {__version__}",
                   help="print the version and exit")
    p.add_argument("--netns", metavar="NAME",
                   help="act inside /run/netns/NAME (like nsenter --net=/run/netns/NAME)")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more detail (the ops of each change; debug logs with -vv)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the plan (default auto: when stdout is a terminal and "
                        "NO_COLOR is unset)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser,
                           title="commands")

    def common(sp: argparse.ArgumentParser, *, paths: bool = True) -> None:
        if paths:
            sp.add_argument("paths", nargs="+", metavar="PATH",
                            help="desired-state files or directories")
        sp.add_argument("--output", choices=("text", "json"), default="text",
                        help="text for people (default) or json for programs")
        sp.add_argument("--no-prune", action="store_true",
                        help="keep owned objects that the files no longer declare")
        sp.add_argument("--hostname", metavar="NAME",
                        help="the name matched against files' hosts: patterns (default: this "
                             "host's name)")
        sp.add_argument("--adopt", action="append", metavar="KIND/NAME",
                        help="take over an existing object the reconciler did not create; "
                             "KIND is bridge, subnet, alloc or docker_network "
                             "(e.g. bridge/nomad); repeatable")

    sp = sub.add_parser(
        "validate", help="check files only (no host access)",
        description="Check desired-state files against the schema and for semantic errors "
                    "(references, overlaps, clashing ports). Reads no host state, needs no "
                    "root. Errors name file:line:col.")
    sp.add_argument("paths", nargs="+", metavar="PATH", help="desired-state files or directories")
    sp.add_argument("--hostname", metavar="NAME",
                    help="show the view of this host (files' hosts: patterns)")
    sp.set_defaults(fn=cmd_validate)

    sp = sub.add_parser(
        "plan", help="show what apply would change (exit 0 none, 2 changes)",
        description="Observe the host, compare it with the files and print the plan: "
                    "+ create, ~ update, - delete, -/+ replace, ! conflict. Changes nothing. "
                    "Exit 0 when there is nothing to do, 2 when there are changes, 1 on error "
                    "or conflict.")
    common(sp)
    sp.add_argument("--out", metavar="FILE",
                    help="also save the plan as JSON; `apply FILE` applies exactly it and "
                         "refuses if the host changed meanwhile")
    sp.add_argument("--no-agent", action="store_true",
                    help="plan in this process even when a running `reconcile watch` could "
                         "answer (same output; RECONCILER_AGENT=off does the same)")
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser(
        "apply", help="plan, change the host, verify",
        description="Plan, apply the changes in dependency order, then observe again and "
                    "fail if anything is still different. PATH may also be one plan saved "
                    "with `plan --out`. Takes the host lock (shared with destroy and watch).")
    common(sp)
    sp.add_argument("--dry-run", action="store_true", help="plan only (same as `plan`)")
    sp.add_argument("--lock-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for another writer to finish (default 60)")
    sp.add_argument("--force-replace", action="store_true",
                    help="allow replacing Docker networks that have containers attached "
                         "(they are disconnected and reconnected with the same addresses)")
    sp.set_defaults(fn=cmd_apply)

    sp = sub.add_parser(
        "destroy", help="remove everything the reconciler manages on this host",
        description="Remove every object the reconciler owns on this host (or in --netns "
                    "NAME): owned links, addresses, allocation namespaces, RECONCILER-* "
                    "chains and owned Docker networks. Objects it did not create are kept.")
    sp.add_argument("--output", choices=("text", "json"), default="text",
                    help="text for people (default) or json for programs")
    sp.add_argument("--dry-run", action="store_true", help="show what would be removed")
    sp.add_argument("--lock-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for another writer to finish (default 60)")
    sp.set_defaults(fn=cmd_destroy)

    sp = sub.add_parser(
        "show", help="show the live state of managed objects",
        description="Print what the reconciler owns on this host right now, read from the "
                    "kernel, iptables and Docker (no files needed).")
    sp.add_argument("--output", choices=("text", "json"), default="text",
                    help="text for people (default) or json for programs")
    sp.set_defaults(fn=cmd_show)

    sp = sub.add_parser(
        "watch", help="keep this host converged: follow file changes and drift",
        description="Run as an agent: reconcile now, then again whenever the files change "
                    "(debounced), on drift reported by netlink or Docker events, and every "
                    "--interval. An invalid edit keeps the last good state. SIGHUP reloads, "
                    "SIGTERM finishes the current action and exits. Status and metrics are "
                    "served on --status-addr.")
    common(sp)
    sp.add_argument("--interval", type=float, default=60.0, metavar="SECONDS",
                    help="full resync period, covers drift no event reports, e.g. iptables "
                         "(default 60)")
    sp.add_argument("--debounce", type=float, default=0.5, metavar="SECONDS",
                    help="wait for file changes to settle, e.g. during git pull (default 0.5)")
    sp.add_argument("--max-backoff", type=float, default=60.0, metavar="SECONDS",
                    help="cap of the retry delay after failed passes (default 60)")
    sp.add_argument("--lock-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for another writer before a pass fails (default 60)")
    sp.add_argument("--status-addr", default="127.0.0.1:9477", metavar="HOST:PORT",
                    help="serve /status, /metrics, /healthz here (default 127.0.0.1:9477; "
                         "'off' disables)")
    sp.add_argument("--log-format", choices=("text", "json"), default="text",
                    help="json: one object per line, for journald or a log shipper")
    sp.add_argument("--allow-insecure-config", action="store_true",
                    help="watch files or directories writable by group or others")
    sp.add_argument("--no-docker-events", action="store_true",
                    help="do not follow Docker events (the interval still heals)")
    sp.add_argument("--dry-run", action="store_true",
                    help="observe and report drift (status, metrics, logs: result \"drift\") "
                         "but change nothing; `reconcile plan` is still answered")
    sp.add_argument("--no-plan-server", action="store_true",
                    help="do not answer `reconcile plan` for this namespace (by default the "
                         "agent does, from its event-driven view: same output, much faster)")
    sp.set_defaults(fn=cmd_watch, prepare=_watch_prepare)

    sp = sub.add_parser(
        "status", help="show the status of the running watch agent",
        description="Ask a running `reconcile watch` for its status over HTTP. Exit 0 when "
                    "its last pass converged and its files load, 1 otherwise.")
    sp.add_argument("--addr", default="127.0.0.1:9477", metavar="HOST:PORT",
                    help="the agent's --status-addr (default 127.0.0.1:9477)")
    sp.add_argument("--output", choices=("text", "json"), default="text",
                    help="text for people (default) or json for programs")
    sp.set_defaults(fn=cmd_status, enters_netns=False)

    sp = sub.add_parser(
        "completion", help="print a shell completion script (bash or zsh)",
        description="Print a completion script for SHELL. bash: `reconcile completion bash "
                    "> /etc/bash_completion.d/reconcile`; zsh: `reconcile completion zsh > "
                    "\"${fpath[1]}/_reconcile\"`, or `source <(reconcile completion zsh)`.")
    sp.add_argument("shell", choices=("bash", "zsh"), metavar="SHELL", help="bash or zsh")
    sp.set_defaults(fn=cmd_completion, enters_netns=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from reconciler.planclient import normalise_argv

    args_list = normalise_argv(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(args_list)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose else
        logging.WARNING, format="%(levelname)s %(message)s", stream=sys.stderr)
    if not getattr(args, "fn", None):
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        if getattr(args, "prepare", None):
            args.prepare(args)
        if args.netns and getattr(args, "enters_netns", True):
            from reconciler.drivers import netns

            netns.enter_process_netns(args.netns)
        rc: int = args.fn(args)
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
        print(f"internal error: {type(exc).__name__}: {exc} (run with -vv for details)",
              file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
