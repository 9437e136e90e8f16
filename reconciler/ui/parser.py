"""The `reconcile` argument parser: every command, option and help text.

Commands are named by ``set_defaults(command=NAME)``; ``reconciler.cli.commands``
maps names to what runs them, so the parser knows no command's code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, Literal

from reconciler import __version__
from reconciler.domain.leases import KINDS as LEASE_KINDS
from reconciler.ui.render import EXIT_ERROR

#: shells ``reconcile completion`` writes a script for
SHELLS = ("bash", "zsh")

#: what completes an argument's values (``ui.completion`` tells shtab): file names, or the
#: names under /run/netns
Completes = Literal["files", "netns"]
Marker = Callable[[argparse.Action, Completes], None]


def _unmarked(_action: argparse.Action, _what: Completes) -> None:
    """Mark nothing: plain runs need no completion hints (and so do not import shtab)."""


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration(text: str) -> float:
    """Parse ``DURATION`` values: seconds (``90``, ``1.5``) or with a unit (``250ms``, ``30s``,
    ``5m``, ``1h``); positive and finite. An argparse ``type``: a bad one is a usage error."""
    value = text.strip().lower()
    unit = next((u for u in ("ms", "s", "m", "h") if value.endswith(u)), "")
    try:
        seconds = float(value[: len(value) - len(unit)]) * _UNITS.get(unit, 1.0)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: give seconds or a number with ms, s, m or h "
            "(e.g. 30s, 5m)")
    return seconds


#: the longest confirm window: a deadline must stay a time (``iso``, ``time_t``) and a
#: window longer than a week is a forgotten change, not a safety net
MAX_WINDOW = 7 * 86400.0


def window(text: str) -> float:
    """Parse ``--confirm-within``: a :func:`duration` of at most :data:`MAX_WINDOW` (a usage
    error beyond: ``1e20`` once made every later apply crash formatting its deadline)."""
    seconds = duration(text)
    if seconds > MAX_WINDOW:
        raise argparse.ArgumentTypeError(
            f"{text!r} is too long a window: at most 7 days (168h)")
    return seconds


def _interval_or_off(text: str) -> float | None:
    return None if text.strip().lower() in ("off", "0") else duration(text)


def _probe_options(sp: argparse.ArgumentParser, no_probe: str) -> None:
    """Add the probe options `apply`, `verify` and `watch` share (SPEC §7)."""
    sp.add_argument("--no-probe", action="store_true", help=no_probe)
    sp.add_argument("--probe-external", action=argparse.BooleanOptionalAction, default=None,
                    help="also probe from a vantage namespace of ours that stands in for "
                         "another host, so PREROUTING and FORWARD are crossed (default: on "
                         "with --netns, a sandbox, off on the host itself)")
    sp.add_argument("--probe-timeout", type=duration, default=1.0, metavar="DURATION",
                    help="how long each probe waits for its packet (default 1s)")

def _probes_shown(sp: argparse.ArgumentParser) -> None:
    """Add `--probes`, what `apply --output json` lists of the probes (`verify` lists all:
    they are what it is for)."""
    sp.add_argument("--probes", choices=("failed", "all"), default="failed",
                    help="which probe results --output json lists: the ones that failed "
                         "(default; the counts cover all) or all of them")


def _count(text: str) -> int:
    """Parse a whole number of items, 0 or more (an argparse ``type``)."""
    try:
        value = int(text.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of items (0 or more)")
    return value


def _max_disruption(sp: argparse.ArgumentParser, refused: str) -> None:
    """Add `--max-disruption`, shared by `plan`, `apply` and `watch` (SPEC §8)."""
    sp.add_argument("--max-disruption", type=_count, default=None, metavar="N",
                    help="refuse a plan whose impact lists more than N items (allocations "
                         "losing connectivity, containers disconnected, port maps closed or "
                         f"moved): {refused}")


#: how an option reads the command line, as the stdlib-only fast path needs to know it:
#: "value" takes the next argument (or ``=VALUE``), "count" adds one, "true" sets True,
#: "const:X" sets X
OptionTable = dict[str, tuple[str, str]]

_HOW = {None: "value", "store": "value", "append": "value", "count": "count",
        "store_true": "true"}


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 1: exit 2 means "changes present" in this tool. Each parser keeps
    the table of its options (:data:`OptionTable`) as they are added."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.table: OptionTable = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        kind = kwargs.get("action")
        how = f"const:{kwargs['const']}" if kind == "store_const" else \
            _HOW.get(kind) if isinstance(kind, str | None) and "nargs" not in kwargs else None
        if how is not None:
            dest = "verbose" if action.dest == _MORE_VERBOSE else action.dest
            self.table.update({flag: (dest, how) for flag in action.option_strings})
        return action

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR)


#: the dest the subcommands' ``-v`` counts into: added to the main parser's count after
#: parsing, so that ``reconcile -v plan -v`` is ``-vv``
_MORE_VERBOSE = "more_verbose"

#: the commands whose ``--output json`` exists (the others print text only)
JSON_COMMANDS = ("plan", "apply", "verify", "watch", "destroy", "gc", "show", "status")


class _Main(_Parser):
    """The `reconcile` parser: global options before and after the command add up."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.commands: dict[str, _Parser] = {}
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, rest = super().parse_known_args(args, namespace)
        parsed.verbose += getattr(parsed, _MORE_VERBOSE, 0)
        if hasattr(parsed, _MORE_VERBOSE):
            delattr(parsed, _MORE_VERBOSE)
        command = getattr(parsed, "command", None)
        if parsed.output != "text" and command is not None and command not in JSON_COMMANDS:
            self.error(f"`{command}` has no --output {parsed.output}: it prints text only")
        return parsed, rest


def _global_options(p: argparse.ArgumentParser, mark: Marker, *, sub: bool) -> None:
    """Add the options every command takes, before it (``sub`` False: their defaults) or
    after it (``sub``: no defaults, so that ``reconcile --netns S plan`` keeps S: a
    subparser's default would overwrite the main parser's value with None, and the command
    would act on the host)."""
    unset: Any = argparse.SUPPRESS

    def default(value: object) -> Any:
        return unset if sub else value

    netns = p.add_argument("--netns", metavar="NAME", default=default(None),
                           help="act inside /run/netns/NAME (like nsenter --net=/run/netns/NAME)")
    mark(netns, "netns")
    p.add_argument("-v", "--verbose", action="count", default=default(0),
                   dest=_MORE_VERBOSE if sub else "verbose",
                   help="more detail (the ops of each change; debug logs with -vv)")
    p.add_argument("--output", choices=("text", "json"), default=default("text"),
                   help="text for people (default) or json for programs")
    p.add_argument("--color", choices=("auto", "always", "never"), default=default("auto"),
                   help="colour the plan (default auto: when stdout is a terminal and "
                        "NO_COLOR is unset)")
    p.add_argument("--no-color", dest="color", action="store_const", const="never",
                   default=unset, help="no colour (as --color never)")
    p.add_argument("--compact", action="store_true", default=default(False),
                   help="text output as counts only, for CI logs: what each action does to "
                        "how many of each kind, errors and conflicts, the summary")


def _lease_address(text: str) -> str:
    """Check ``KIND/ID`` of ``release`` (a usage error, exit 2, otherwise)."""
    kind, _, name = text.partition("/")
    if kind not in LEASE_KINDS or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: want KIND/ID, KIND one of "
                                         f"{', '.join(LEASE_KINDS)} (alloc/web)")
    return text


def build_parser(mark: Marker = _unmarked) -> argparse.ArgumentParser:
    """Build the parser; ``mark`` is told which arguments complete as files or namespace names."""
    p = _Main(
        prog="reconcile",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Declarative reconciler for Linux host networking: bridges, subnets,\n"
                    "network-namespace allocations with port maps, and Docker networks,\n"
                    "kept in YAML files (a directory is read as all its *.yaml files).",
        epilog="examples:\n"
               "  reconcile validate examples/quickstart.yaml     check a file, touch nothing\n"
               "  reconcile --netns sandbox plan examples/fleet/  what would change in a sandbox\n"
               "  reconcile apply /etc/reconciler                 change this host, then verify\n"
               "  reconcile verify /etc/reconciler                config matches, packets flow?\n"
               "  reconcile watch /etc/reconciler                 keep this host converged\n"
               "\n"
               "Global options (--netns, -v, --output, --color, --no-color, --compact) go\n"
               "before or after COMMAND; `reconcile COMMAND --help` shows the rest.\n"
               "Exit codes: 0 success or no changes, 2 changes present (plan), 1 error\n"
               "(verify: 1 when the config differs or a probe fails).")
    p.add_argument("--version", action="version", version=f"reconcile {__version__}",
                   help="print the version and exit")
    _global_options(p, mark, sub=False)
    commands = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser,
                                title="commands")

    class _Commands:
        """``add_parser`` that gives every command the global options too."""

        @staticmethod
        def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
            sp: _Parser = commands.add_parser(name, **kw)
            _global_options(sp, mark, sub=True)
            p.commands[name] = sp
            return sp

    sub = _Commands()

    def common(sp: argparse.ArgumentParser, *, paths: bool = True) -> None:
        if paths:
            files = sp.add_argument("paths", nargs="+", metavar="PATH",
                                    help="desired-state files or directories")
            mark(files, "files")
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
    paths = sp.add_argument("paths", nargs="+", metavar="PATH",
                            help="desired-state files or directories")
    mark(paths, "files")
    sp.add_argument("--hostname", metavar="NAME",
                    help="show the view of this host (files' hosts: patterns)")

    sp = sub.add_parser(
        "plan", help="show what apply would change (exit 0 none, 2 changes)",
        description="Observe the host, compare it with the files and print the plan: "
                    "+ create, ~ update, - delete, -/+ replace, ! conflict. Changes nothing. "
                    "Exit 0 when there is nothing to do, 2 when there are changes, 1 on error "
                    "or conflict.")
    common(sp)
    out = sp.add_argument("--out", metavar="FILE",
                          help="also save the plan as JSON; `apply FILE` applies exactly it "
                               "and refuses if the host changed meanwhile")
    mark(out, "files")
    sp.add_argument("--no-agent", action="store_true",
                    help="plan in this process even when a running `reconcile watch` could "
                         "answer (same output; RECONCILER_AGENT=off does the same)")
    sp.add_argument("--force-replace", action="store_true",
                    help="plan as `apply --force-replace` would: Docker networks with "
                         "containers attached are replaced (the impact names the containers)")
    _max_disruption(sp, "the plan is printed and the command exits 1")

    sp = sub.add_parser(
        "apply", help="plan, change the host, verify",
        description="Plan, apply the changes in dependency order, then observe again and "
                    "fail if anything is still different. PATH may also be one plan saved "
                    "with `plan --out`. Takes the host lock (shared with destroy and watch).")
    common(sp)
    sp.add_argument("--dry-run", action="store_true", help="plan only (same as `plan`)")
    sp.add_argument("--yes", action="store_true",
                    help="do not ask: on a terminal, apply shows a plan that deletes, replaces "
                         "or disrupts anything and asks first (without a terminal, and for a "
                         "saved plan, it never asks)")
    sp.add_argument("--lock-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for another writer to finish (default 60)")
    sp.add_argument("--force-replace", action="store_true",
                    help="allow replacing Docker networks that have containers attached "
                         "(they are disconnected and reconnected with the same addresses)")
    sp.add_argument("--confirm-within", type=window, metavar="DURATION",
                    help="keep the change only if `reconcile confirm` comes within DURATION "
                         "(90s, 5m, or seconds) and the probes hold; otherwise a detached "
                         "reverter restores the owned state from before it "
                         "(docs/safe-change.md)")
    _probe_options(sp, "do not probe after applying (the configuration is still verified)")
    _probes_shown(sp)
    _max_disruption(sp, "nothing is changed, exit 1")

    sp = sub.add_parser(
        "confirm", help="keep the change pending since `apply --confirm-within`",
        description="Keep the pending change: its reverter stops. Exit 1 when nothing is "
                    "pending or its deadline passed (the change is then reverted).")
    sp.add_argument("--lock-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for another writer to finish (default 60)")

    sp = sub.add_parser(
        "revert", help="undo the pending change now (restore the owned state before it)",
        description="Restore the owned state recorded before the pending change (`apply "
                    "--confirm-within`) and verify it. Exit 1 when nothing is pending. With "
                    "--if-overdue (the boot-time unit), only a change whose deadline passed "
                    "or that was applied before a reboot; nothing to do is exit 0.")
    sp.add_argument("--if-overdue", action="store_true",
                    help="only an overdue change (deadline passed, or a reboot since)")
    sp.add_argument("--lock-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for another writer to finish (default 60)")
    sp.add_argument("--wait", metavar="TOKEN", help=argparse.SUPPRESS)

    sp = sub.add_parser(
        "release", help="forget the leases of a resource: its next apply picks afresh",
        description="Forget what the reconciler picked for KIND/ID and recorded as its leases "
                    "(addresses, MAC, auto host ports, auto prefixes: docs/lifetime.md), so "
                    "that values no longer live are picked afresh by the next apply. KIND is "
                    "alloc, bridge, subnet or docker_network. Changes nothing on the host. "
                    "Takes the host lock. Exit 0 also when it had none.")
    sp.add_argument("address", metavar="KIND/ID", type=_lease_address,
                    help="the resource, as plans name it: alloc/web, subnet/apps")
    sp.add_argument("--lock-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for another writer to finish (default 60)")

    sp = sub.add_parser(
        "verify", help="check the host holds: config matches and packets flow (exit 0/1)",
        description="Compare the host with the files (as plan does) and probe every "
                    "allocation from inside the host: its gateway answers, and each port map "
                    "reaches it from the host address, 127.0.0.1 where allowed, itself "
                    "(hairpin) and, with --probe-external, another host. Changes nothing. "
                    "Exit 0 when the config matches and every probe holds, 1 otherwise; the "
                    "output says which failed.")
    common(sp)
    _probe_options(sp, "compare the configuration only")

    sp = sub.add_parser(
        "destroy", help="remove everything the reconciler manages on this host",
        description="Remove every object the reconciler owns on this host (or in --netns "
                    "NAME): owned links, addresses, allocation namespaces, the nftables "
                    "table inet reconciler with its mark shim rules, and owned Docker "
                    "networks. Objects it did not create are kept.")
    sp.add_argument("--dry-run", action="store_true", help="show what would be removed")
    sp.add_argument("--yes", action="store_true",
                    help="do not ask: needed without a terminal (scripts, cron, CI), where "
                         "no one can answer; on a terminal destroy shows what it removes "
                         "and asks")
    sp.add_argument("--lock-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for another writer to finish (default 60)")

    sp = sub.add_parser(
        "gc", help="remove leftovers: broken halves, stale files (with PATH: also what no "
                   "file declares)",
        description="Remove what the reconciler owns and nothing uses: veths whose allocation "
                    "namespace is gone, allocation namespaces without their veth, the entries "
                    "of our nftables table for allocations that are gone, and stale lock, "
                    "socket and temporary files. With PATH, also every owned object (Docker "
                    "networks of this scope included) that the files no longer declare, as a "
                    "prune would. "
                    "Never creates or changes anything, and never touches objects without "
                    "the reconciler's mark. Takes the host lock when it removes. Exit 0 "
                    "when done (--plan: nothing to collect), 2 with --plan and something to "
                    "collect, 1 on error.")
    gc_paths = sp.add_argument("paths", nargs="*", metavar="PATH",
                               help="desired-state files or directories (optional)")
    mark(gc_paths, "files")
    sp.add_argument("--plan", "--dry-run", dest="dry_run", action="store_true",
                    help="only report what would be collected")
    sp.add_argument("--hostname", metavar="NAME",
                    help="the name matched against files' hosts: patterns (default: this "
                         "host's name)")
    sp.add_argument("--lock-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for another writer to finish (default 60)")

    sp = sub.add_parser(
        "show", help="show the live state of managed objects",
        description="Print what the reconciler owns on this host right now, read from the "
                    "kernel, iptables and Docker (no files needed).")

    sp = sub.add_parser(
        "graph", help="the topology as Graphviz DOT (pipe it to `dot -Tpng`)",
        description="Print bridges, subnets, allocations (addresses, MAC, port maps) and "
                    "Docker networks with their containers as a Graphviz DOT graph: "
                    "`reconcile graph PATH | dot -Tpng > topology.png`. Without PATH: what "
                    "the reconciler owns on this host; with PATH: the files and the host "
                    "together (dashed: declared, not on the host yet; dotted: on the host, "
                    "in no file). Changes nothing.")
    files = sp.add_argument("paths", nargs="*", metavar="PATH",
                            help="desired-state files or directories (none: the host only)")
    mark(files, "files")
    sp.add_argument("--plan", action="store_true",
                    help="colour what apply would create, update, replace or delete, with "
                         "the plan's symbols in a legend (needs PATH)")
    sp.add_argument("--no-prune", action="store_true",
                    help="plan as `apply --no-prune` would (owned objects no file declares "
                         "are kept)")
    sp.add_argument("--hostname", metavar="NAME",
                    help="the name matched against files' hosts: patterns (default: this "
                         "host's name)")
    sp.add_argument("--adopt", action="append", metavar="KIND/NAME",
                    help="plan as `apply --adopt KIND/NAME` would; repeatable")

    sp = sub.add_parser(
        "watch", help="keep this host converged: follow file changes and drift",
        description="Run as an agent: reconcile now, then again whenever the files change "
                    "(debounced), on drift reported by netlink or Docker events, and every "
                    "--interval. An invalid edit keeps the last good state. SIGHUP reloads, "
                    "SIGTERM finishes the current action and exits. Status and metrics are "
                    "served on --status-addr.")
    common(sp)
    sp.add_argument("--interval", type=float, default=60.0, metavar="SECONDS",
                    help="full resync period, covers drift no event reports, e.g. "
                         "iptables-legacy rules (default 60)")
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
    sp.add_argument("--probe-interval", type=_interval_or_off, default=30.0,
                    metavar="DURATION",
                    help="probe every allocation this often, apart from the resync; a "
                         "failure the reconciler owns starts a pass, others are reported "
                         "(default 30s; 'off': only after applying)")
    sp.add_argument("--expect-revision", metavar="COMMIT",
                    help="apply only the files of this git commit (an id, 7-40 hex digits): "
                         "any other checkout, or local changes, is refused and the agent is "
                         "not ready (/readyz); a fleet rollout pins the commit so that a new "
                         "one is a new rollout")
    _probe_options(sp, "never probe: neither after applying nor every --probe-interval")
    _max_disruption(sp, "the pass changes nothing and fails (logs and status say why)")
    sp.add_argument("--confirm-within", type=window, metavar="DURATION",
                    help="apply each new revision of the files under a window: the agent "
                         "confirms it itself when its probes held for DURATION and reverts "
                         "it when they fail; a reverted revision is not applied again until "
                         "the files change (docs/safe-change.md)")
    sp.set_defaults(prepare=True)

    sp = sub.add_parser(
        "status", help="show the status of the running watch agent",
        description="Ask the running `reconcile watch` of this network namespace (or of "
                    "--netns NAME) for its status: on its root-only socket under "
                    "/run/reconciler, else over HTTP on --addr, believed only from a "
                    "listener of root's. Exit 0 when its last pass converged and its files "
                    "load, 1 otherwise.")
    sp.add_argument("--addr", default=None, metavar="HOST:PORT",
                    help="ask the agent's --status-addr over HTTP (default: its root-only "
                         "socket, else 127.0.0.1:9477)")
    sp.add_argument("--probe", choices=("readyz", "healthz"),
                    help="print the agent's /readyz (or /healthz) answer and exit 0 only when "
                         "it is 200: a rollout engine's exec check that no local user can "
                         "answer in the agent's name")
    sp.set_defaults(enters_netns=False)

    sp = sub.add_parser(
        "completion", help="print a shell completion script (bash or zsh)",
        description="Print a completion script for SHELL. bash: `reconcile completion bash "
                    "> /etc/bash_completion.d/reconcile`; zsh: `reconcile completion zsh > "
                    "\"${fpath[1]}/_reconcile\"`, or `source <(reconcile completion zsh)`.")
    sp.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash or zsh")
    sp.set_defaults(enters_netns=False)
    return p





def option_table() -> dict[str, OptionTable]:
    """Return the options of `reconcile` (``global``) and of `reconcile plan` (``plan``, the
    global ones included): what ``scripts/gen-option-table.py`` writes into
    ``ui/optiontable.py`` for the fast path of ``cli.entry``."""
    p = build_parser()
    assert isinstance(p, _Main)
    return {"global": dict(sorted(p.table.items())),
            "plan": dict(sorted(p.commands["plan"].table.items()))}
