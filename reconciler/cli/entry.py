"""The `reconcile` entry point, and its thin client for `plan`.

A running ``reconcile watch`` agent answers `reconcile plan` over a unix socket
(see ``reconciler.agent.planview``): it keeps one event-driven view of the host, so a no-op
plan costs an interpreter start and one round trip instead of reading every
namespace again. This module decides whether a command line can be answered
that way, sends it with the bytes of the files (read here, in the caller's
working directory and mount namespace) and prints the answer. Anything it is
unsure of -- another command, an option it does not know, no agent, an agent
of another code version or namespace, a file it cannot read, a plan with
errors -- goes to the normal in-process CLI instead, so the output is always
what ``reconcile --no-agent plan`` would print.

Start-up time is the point: stdlib only, nothing from the model or YAML.

See docs/decisions/007-start-up-costs.md.
See docs/decisions/028-plan-answered-by-the-agent.md.
"""

from __future__ import annotations

import os
import socket
import sys

from reconciler.agent.planview.protocol import (
    ACK,
    ACK_TIMEOUT,
    PROTOCOL,
    REPLY_TIMEOUT,
    Unanswered,
    code_id,
    current_env,
    peer_uid,
    recv_exact,
    recv_message,
    send_message,
    socket_path,
    tool_paths,
)
from reconciler.config.paths import expand_paths, read_bytes
from reconciler.domain.errors import ConfigError
from reconciler.domain.hints import command
from reconciler.drivers.nsfs import NETNS_RUN_DIR, current_inode, mount_ns_inode, name_ok
from reconciler.ui import optiontable
from reconciler.ui.argv import normalise_argv

TYPE_CHECKING = False  # not `typing`: start-up path


if TYPE_CHECKING:
    from collections.abc import Sequence


#: what the agent answers: the global options and these of `plan`'s (another, such as
#: --force-replace or --max-disruption, is planned in-process); tests/unit/cli checks that
#: each is an option of the parser's
ANSWERED = frozenset({"netns", "verbose", "output", "color", "no_agent", "out", "hostname",
                      "adopt", "no_prune", "compact"})

#: what the client reads itself and sends apart, not in the agent's argv
_OWN = frozenset({"netns", "verbose", "color", "output"})


class NotAPlan(Unanswered):
    """Not a `plan` command line at all (e.g. a path named "plan")."""


class PlanCall:
    """One `reconcile … plan …` command line, as far as the client needs to know it.

    Global options stand before or after `plan` (``ui/optiontable.py``, generated from the
    parser, says which take a value); anything the table does not know, or the agent does
    not answer, goes to the in-process CLI, whose argparse has the last word.
    """

    def __init__(self, argv: Sequence[str]) -> None:
        self.netns: str | None = None
        self.verbose = 0
        self.color = "auto"
        self.no_agent = False
        self.compact = False
        self.output = "text"
        self.out: str | None = None
        self.paths: list[str] = []
        self.rest: list[str] = []  # after "plan", for the agent's own parser
        args = list(argv)
        command = False
        i = 0
        while i < len(args):
            a = args[i]
            if a == "--":
                raise Unanswered("-- ends the options: argparse reads the rest")
            if not a.startswith("-") or a == "-":
                if command:
                    self.paths.append(a)
                    self.rest.append(a)
                elif a == "plan":
                    command = True
                else:
                    raise NotAPlan(f"not a plan command line ({a})")
                i += 1
                continue
            i = self._option(args, i, optiontable.PLAN if command else optiontable.GLOBAL,
                             command)
        if not command:
            raise NotAPlan("no command")
        if self.output != "text":  # given before or after `plan`: the agent's parser reads it
            self.rest += ["--output", self.output]
        if self.verbose > 1:
            raise Unanswered("-vv shows debug logs of the planning process itself")
        if self.color not in ("auto", "always", "never") or self.output not in ("text", "json"):
            raise Unanswered("the CLI reports bad option values")

    def _option(self, args: list[str], i: int, table: dict[str, tuple[str, str]],
                command: bool) -> int:
        """Read the option at ``args[i]``; the index after it (and its value)."""
        a = args[i]
        if a.startswith("-v") and set(a[1:]) == {"v"}:  # -v, -vv, -vvv
            self.verbose += len(a) - 1
            return i + 1
        name, eq, value = a.partition("=") if a.startswith("--") else (a, "", "")
        known = table.get(name)
        if known is None:
            if command:
                raise Unanswered(f"option the client does not know: {a}")
            raise NotAPlan(f"not a plan command line ({a})")  # --version, -h
        dest, how = known
        taken = [a]
        if how == "value":
            if not eq:
                if i + 1 >= len(args) or args[i + 1].startswith("-"):
                    raise Unanswered("option without a value")  # argparse's view too
                value = args[i + 1]
                taken.append(value)
        elif eq:
            raise Unanswered(f"{name} takes no value")
        if dest not in ANSWERED:
            raise Unanswered(f"the agent does not answer {name}")
        if dest == "netns":
            self.netns = value
        elif dest == "verbose":
            self.verbose += 1
        elif dest == "color":
            self.color = how.removeprefix("const:") if how.startswith("const:") else value
        elif dest == "output":
            self.output = value
        elif dest == "no_agent":
            self.no_agent = True
        elif dest == "compact":
            self.compact = True
        elif dest == "out":
            self.out = value
        if dest not in _OWN:
            self.rest += taken
        return i + len(taken)

    def colour(self) -> bool:
        if self.color == "always":
            return True
        if self.color == "never" or os.environ.get("NO_COLOR"):
            return False
        return sys.stdout.isatty()

    def target_inode(self) -> int:
        try:
            if self.netns is None:
                return current_inode()
            if not name_ok(self.netns):
                raise Unanswered("the CLI reports bad namespace names")
            return os.stat(os.path.join(NETNS_RUN_DIR, self.netns)).st_ino
        except OSError as exc:
            raise Unanswered(f"namespace: {exc}") from None


def ask_agent(call: PlanCall) -> dict[str, object]:
    """Send the plan to the agent of the target namespace; its reply (status "ok"), or raise."""
    net = call.target_inode()
    path = socket_path(net)
    if not os.path.exists(path):
        raise Unanswered(f"no agent socket at {path}")
    try:
        files = expand_paths(call.paths)
        blobs = [read_bytes(f) for f in files]
    except ConfigError as exc:
        raise Unanswered(f"the CLI reports file errors: {exc}") from None
    request = {
        "protocol": PROTOCOL, "code": code_id(), "argv": call.rest, "paths": call.paths,
        "files": [[f, os.path.abspath(f), len(b)] for f, b in zip(files, blobs, strict=True)],
        "verbose": call.verbose, "colour": call.colour(), "hostname": socket.gethostname(),
        "mnt": mount_ns_inode(), "net": net,
        "env": current_env(), "tools": tool_paths(),
    }
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(ACK_TIMEOUT)
        try:
            sock.connect(path)
            if peer_uid(sock) not in (0, os.geteuid()):
                raise Unanswered("the socket is not served by root")
            send_message(sock, request, blobs)
            sock.settimeout(ACK_TIMEOUT)  # a stopped or wedged agent: plan in-process instead
            if recv_exact(sock, 1) != ACK:
                raise Unanswered("the agent did not acknowledge")
            sock.settimeout(REPLY_TIMEOUT)
            reply = recv_message(sock)
        except (OSError, ValueError) as exc:
            raise Unanswered(f"agent: {exc}") from None
    finally:
        sock.close()
    if reply.get("status") != "ok":
        raise Unanswered(f"agent: {reply.get('why', 'declined')}")
    return reply


def answer(argv: list[str]) -> int | None:
    """Exit code of a plan the agent answered and this printed, or None: run the CLI."""
    mode = os.environ.get("RECONCILER_AGENT", "auto")
    try:
        call = PlanCall(argv)
        if call.no_agent or mode == "off":
            return None
        reply = ask_agent(call)
        # like the CLI: a --out path that cannot be written is an error before any output
        out = open(call.out, "w") if call.out is not None else None  # noqa: SIM115
    except NotAPlan:
        return None
    except (Unanswered, OSError) as exc:
        if mode == "require":  # tests and benchmarks: prove the agent answered
            print(f"error: the plan agent did not answer: {exc}", file=sys.stderr)
            return 1
        return None
    try:
        sys.stdout.write(str(reply.get("stdout", "")))
        sys.stdout.flush()
        if out is not None:
            try:
                with out:
                    out.write(str(reply.get("out_json", "")))
            except OSError as exc:  # ENOSPC, EDQUOT, EIO: as the CLI words it
                print(f"error: {call.out}: cannot write the plan here: {exc.strerror or exc}",
                      file=sys.stderr)
                return 1
            again = command(f"apply {call.out}", netns=call.netns)
            print(f"Saved the plan to {call.out}; `{again}` applies exactly it.",
                  file=sys.stderr)
    except BrokenPipeError:
        raise
    except Exception as exc:  # as the CLI words what is not a user error
        print(f"internal error: {type(exc).__name__}: {exc} (run with -vv for details)",
              file=sys.stderr)
        return 1
    rc = reply.get("rc")
    return rc if isinstance(rc, int) else 1


def main() -> int:
    # someone's rule or name we quote need not be UTF-8 (read with surrogateescape): said
    # as \x escapes, never an error, whatever encoding the locale gives stdout
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    argv = normalise_argv(sys.argv[1:])
    if "plan" in argv:
        try:
            rc = answer(argv)
        except BrokenPipeError:
            return 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        if rc is not None:
            return rc
    from reconciler.cli.commands import main as cli_main  # noqa: PLC0415 (the one back edge: it loads
    # everything (~0.1 s of imports) and only what the agent does not answer needs it

    return cli_main(argv, process=True)

