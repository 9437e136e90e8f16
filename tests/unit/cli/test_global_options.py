"""Global options (--netns, -v, --output, --color, --no-color, --compact) before or after the command:
every command × every position, through the one parser and, for `plan`, the fast path."""

from __future__ import annotations

import pytest

from reconciler.agent.planview.protocol import Unanswered
from reconciler.cli.entry import PlanCall
from reconciler.ui.parser import JSON_COMMANDS, build_parser

#: each command with the arguments it needs
COMMANDS = {
    "validate": ["a.yaml"], "plan": ["a.yaml"], "apply": ["a.yaml"], "verify": ["a.yaml"],
    "watch": ["a.yaml"], "destroy": [], "gc": [], "show": [], "graph": [], "status": [],
    "completion": ["bash"], "confirm": [], "revert": [],
}

#: each global option as typed, and what it sets (dest: value)
OPTIONS = {
    "netns": (["--netns", "sb"], {"netns": "sb"}),
    "netns=": (["--netns=sb"], {"netns": "sb"}),
    "-v": (["-v"], {"verbose": 1}),
    "-vv": (["-vv"], {"verbose": 2}),
    "--verbose": (["--verbose"], {"verbose": 1}),
    "output": (["--output", "json"], {"output": "json"}),
    "color": (["--color", "always"], {"color": "always"}),
    "no-color": (["--no-color"], {"color": "never"}),
    "compact": (["--compact"], {"compact": True}),
}

#: where the option stands: before the command, right after it, after its arguments
POSITIONS = ("before", "after-command", "at-end")

DEFAULTS = {"netns": None, "verbose": 0, "output": "text", "color": "auto", "compact": False}


def _argv(command: str, option: list[str], position: str) -> list[str]:
    rest = COMMANDS[command]
    if position == "before":
        return [*option, command, *rest]
    if position == "after-command":
        return [command, *option, *rest]
    return [command, *rest, *option]


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_every_global_option_anywhere(command: str, option: str,
                                                           position: str) -> None:
    typed, sets = OPTIONS[option]
    argv = _argv(command, typed, position)
    if "output" in sets and command not in JSON_COMMANDS:
        with pytest.raises(SystemExit) as exc:  # a usage error: the command prints text only
            build_parser().parse_args(argv)
        assert exc.value.code == 1
        return
    args = build_parser().parse_args(argv)
    assert args.command == command
    for dest, default in DEFAULTS.items():
        assert getattr(args, dest) == sets.get(dest, default), (argv, dest)
    assert "more_verbose" not in vars(args)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("option", OPTIONS)
def test_the_fast_path_reads_plan_as_the_parser_does(option: str, position: str) -> None:
    typed, sets = OPTIONS[option]
    argv = _argv("plan", typed, position)
    args = build_parser().parse_args(argv)
    if args.verbose > 1:
        with pytest.raises(Unanswered):  # -vv: debug logs of the planning process itself
            PlanCall(argv)
        return
    call = PlanCall(argv)
    for dest in DEFAULTS:
        assert getattr(call, dest) == getattr(args, dest), (argv, dest)
    assert call.paths == args.paths


@pytest.mark.parametrize("argv", [
    ["-v", "plan", "-v", "a"], ["plan", "-v", "a", "-v"], ["-v", "apply", "a", "--verbose"],
    ["--verbose", "destroy", "-v"],
])
def test_verbose_counts_add_up_across_positions(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).verbose == 2


def test_the_last_netns_given_wins_and_none_is_never_set_by_a_default() -> None:
    p = build_parser()
    assert p.parse_args(["--netns", "a", "plan", "x"]).netns == "a"
    assert p.parse_args(["--netns", "a", "plan", "x", "--netns", "b"]).netns == "b"
    assert p.parse_args(["--output", "json", "plan", "x"]).output == "json"
    assert p.parse_args(["--no-color", "plan", "x", "--color", "always"]).color == "always"
