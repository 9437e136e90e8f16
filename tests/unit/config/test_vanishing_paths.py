"""A path that vanishes while it is read is one config error, never a crash.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any

import pytest

from reconciler.agent.files import FileWatcher
from reconciler.cli.apply import is_saved_plan
from reconciler.cli.commands import main as cli_main
from reconciler.config import paths as config_paths
from reconciler.domain.errors import ConfigError

# ----------------------------------------------------------------- a vanishing directory


def _vanishing_listdir(monkeypatch: pytest.MonkeyPatch, victim: str) -> None:
    """Make ``os.listdir`` of the config loader remove ``victim`` first: what `rm -rf` does
    between the loader's look at the path and its listing."""
    real = os.listdir

    def listdir(path: Any = ".") -> list[str]:
        if os.path.abspath(str(path)) == os.path.abspath(victim):
            shutil.rmtree(victim, ignore_errors=True)
        return real(path)

    monkeypatch.setattr(config_paths.os, "listdir", listdir)


def test_a_directory_that_vanishes_while_listed_is_one_config_error(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "a.yaml").write_text("version: 1\n")
    _vanishing_listdir(monkeypatch, str(conf))
    with pytest.raises(ConfigError) as exc:
        config_paths.expand_paths([str(conf)])
    assert str(exc.value) == f"{conf}: no such file or directory"


def test_validate_of_a_vanishing_directory_is_one_error_line(tmp_path, monkeypatch, capsys):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "a.yaml").write_text("version: 1\n")
    _vanishing_listdir(monkeypatch, str(conf))
    rc = cli_main(["validate", str(conf)])
    err = capsys.readouterr().err
    assert rc == 1 and err == f"error: {conf}: no such file or directory\n", err


def test_a_saved_plan_that_vanishes_while_looked_at_is_no_saved_plan(tmp_path, monkeypatch):
    gone = str(tmp_path / "plan.json")
    monkeypatch.setattr(os.path, "isfile", lambda _p: True)  # there when looked at
    assert is_saved_plan([gone]) is False


def test_a_watched_directory_made_again_is_watched_again(tmp_path):
    """The watch on a directory dies with it: the one made in its place is watched anew (its
    return, seen in the parent, asks for a pass too)."""
    conf = tmp_path / "conf"
    conf.mkdir()
    heard: list[str] = []
    event = threading.Event()

    def on_change(path: str) -> None:
        heard.append(path)
        event.set()

    watcher = FileWatcher([str(conf)], on_change)
    watcher.start()
    try:
        shutil.rmtree(conf)
        conf.mkdir()
        assert event.wait(10), "the directory's return asked for nothing"
        watcher.ensure()  # what the pass it asked for does first
        heard.clear()
        event.clear()
        (conf / "a.yaml").write_text("version: 1\n")
        deadline = time.monotonic() + 10
        while str(conf / "a.yaml") not in heard and time.monotonic() < deadline:
            event.wait(0.5)
            event.clear()
        assert str(conf / "a.yaml") in heard, f"not heard in the new directory: {heard}"
    finally:
        watcher.close()


