"""Hints carry the options their scope needs (issue 27 item 4)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from reconciler.domain import hints


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    yield
    hints.set_netns(None)


def test_a_hint_on_the_host_is_the_bare_command() -> None:
    assert hints.command("confirm") == "reconcile confirm"
    assert hints.scope_options() == ""


def test_a_hint_in_a_sandbox_names_it() -> None:
    hints.set_netns("sb")
    assert hints.command("confirm") == "reconcile --netns sb confirm"
    assert hints.command("apply p.json", netns="other") == "reconcile --netns other apply p.json"


def test_the_cli_sets_the_scope_of_its_hints(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from reconciler.cli import commands

    monkeypatch.setattr(commands.netns, "enter_process_netns", lambda name: None)
    assert commands.main(["graph", "--plan", "--netns", "sb"]) == 1
    assert "reconcile --netns sb graph --plan PATH" in capsys.readouterr().err
