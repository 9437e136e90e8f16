"""The thin `plan` client of the entry point: which command lines it sends to the agent and
which it leaves to the CLI."""

from __future__ import annotations

import pytest

from reconciler.agent.planview.protocol import Unanswered
from reconciler.cli.entry import NotAPlan, PlanCall, answer
from reconciler.ui.argv import normalise_argv


def test_plain_plan_is_sent_with_its_paths() -> None:
    c = PlanCall(["plan", "a.yaml", "conf/"])
    assert c.paths == ["a.yaml", "conf/"] and c.rest == ["a.yaml", "conf/"]
    assert (c.netns, c.verbose, c.output, c.out, c.no_agent) == (None, 0, "text", None, False)


def test_global_and_plan_options_are_understood() -> None:
    c = PlanCall(["--netns", "sb", "-v", "--color=never", "plan", "--output", "json",
                  "--adopt", "bridge/b", "--no-prune", "--hostname=h1", "d/", "--out", "p.json"])
    assert (c.netns, c.verbose, c.color, c.output, c.out) == ("sb", 1, "never", "json", "p.json")
    assert c.paths == ["d/"]
    assert c.rest == ["--adopt", "bridge/b", "--no-prune", "--hostname=h1",
                      "d/", "--out", "p.json", "--output", "json"]
    assert PlanCall(["--netns=sb", "plan", "a"]).netns == "sb"


@pytest.mark.parametrize("argv", [
    ["--netns", "sb", "-v", "--output", "json", "--no-color", "plan", "d/"],
    ["plan", "--netns", "sb", "-v", "--output", "json", "--no-color", "d/"],
    ["plan", "d/", "--netns", "sb", "-v", "--output=json", "--color", "never"],
    ["--netns", "sb", "plan", "d/", "-v", "--output", "json", "--no-color"],
])
def test_global_options_are_read_before_and_after_plan(argv: list[str]) -> None:
    c = PlanCall(argv)
    assert (c.netns, c.verbose, c.color, c.output, c.paths) == ("sb", 1, "never", "json", ["d/"])
    assert c.rest == ["d/", "--output", "json"]  # the client's own, sent apart


@pytest.mark.parametrize("argv", [["-v", "plan", "-v", "d/"], ["plan", "-v", "d/", "--verbose"],
                                  ["plan", "-vv", "d/"]])
def test_verbose_adds_up_across_positions(argv: list[str]) -> None:
    with pytest.raises(Unanswered, match="-vv"):  # debug logs come from the planning process
        PlanCall(argv)


@pytest.mark.parametrize("argv", [
    ["apply", "a.yaml"],                  # another command
    ["-vv", "plan", "a.yaml"],            # debug logs come from the planning process
    ["plan", "--bogus", "a.yaml"],        # an option the client does not know
    ["plan", "--force-replace", "a"],     # one the agent does not answer
    ["plan", "--", "a"],                  # argparse reads what follows
    ["--color", "purple", "plan", "a"],   # the CLI words bad values
    ["plan", "--output"],                 # option without its value
    ["--netns"],                          # no command
    ["--version"],
])
def test_anything_unusual_is_left_to_the_cli(argv: list[str]) -> None:
    with pytest.raises(Unanswered):
        PlanCall(argv)


def test_option_values_that_look_like_options_are_left_to_argparse() -> None:
    with pytest.raises(Unanswered):  # argparse: "--out: expected one argument"
        PlanCall(["plan", "--out", "--no-prune", "d.yaml"])
    with pytest.raises(Unanswered):
        PlanCall(["--netns", "-v", "plan", "a"])


def test_a_path_named_plan_is_not_a_plan_command() -> None:
    with pytest.raises(NotAPlan):
        PlanCall(["validate", "plan"])
    with pytest.raises(NotAPlan):
        PlanCall(["--netns", "x"])


def test_not_a_plan_is_never_an_error_even_when_the_agent_is_required(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECONCILER_AGENT", "require")
    assert answer(["validate", "plan"]) is None


def test_no_agent_and_the_plan_alias() -> None:
    assert PlanCall(["plan", "--no-agent", "a"]).no_agent
    assert normalise_argv(["--netns", "x", "--plan", "a"]) == ["--netns", "x", "plan", "a"]
    assert normalise_argv(["apply", "--plan"]) == ["apply", "--plan"]


@pytest.mark.parametrize("name", ["../etc", "my ns", "", "a/b", "..", "x" * 256, "ü"])
def test_bad_namespace_names_are_left_to_the_cli(name: str) -> None:
    with pytest.raises(Unanswered):
        PlanCall(["--netns", name, "plan", "a"]).target_inode()
