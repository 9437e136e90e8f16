"""Guard rails (issue 15 item 4 and 6): what must never turn into a silent prune or a crash.

Host-free: the loader, saved-plan options and the planner on built live states.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from reconciler.cli import commands as cli
from reconciler.config.load import load
from reconciler.domain.errors import ConfigError

BRIDGE = "version: 1\nbridges: [{name: brx}]\n"


def write(tmp_path: Any, name: str, text: str) -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as fh:
        fh.write(text)
    return path


# ------------------------------------------------------------------ hosts: patterns


def test_files_all_for_other_hosts_are_an_error_naming_patterns_and_host(tmp_path: Any) -> None:
    write(tmp_path, "web.yaml", "hosts: ['web-*', 'edge-?']\n" + BRIDGE)
    write(tmp_path, "db.yaml", "hosts: ['db-*']\nversion: 1\nbridges: [{name: brd}]\n")
    with pytest.raises(ConfigError) as exc:
        load([str(tmp_path)], hostname="cache-1")
    msg = str(exc.value)
    assert "\n" not in msg
    assert "'cache-1'" in msg
    assert "web-*" in msg and "edge-?" in msg and "db-*" in msg
    assert "web.yaml" in msg and "db.yaml" in msg


def test_a_matching_file_with_empty_lists_empties_the_host_on_purpose(tmp_path: Any) -> None:
    write(tmp_path, "web.yaml", "hosts: ['web-*']\n" + BRIDGE)
    write(tmp_path, "cache.yaml", "version: 1\nhosts: ['cache-*']\nbridges: []\n")
    desired = load([str(tmp_path)], hostname="cache-1")
    assert not desired.bridges and not desired.allocs


def test_a_file_without_hosts_counts_as_matching(tmp_path: Any) -> None:
    write(tmp_path, "web.yaml", "hosts: ['web-*']\n" + BRIDGE)
    write(tmp_path, "all.yaml", "version: 1\n")
    assert load([str(tmp_path)], hostname="cache-1").bridges == {}


def test_validate_reports_but_accepts_files_for_other_hosts(tmp_path: Any,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """validate checks files (CI machines are no fleet members): a note, exit 0."""
    path = write(tmp_path, "web.yaml", "hosts: ['web-*']\n" + BRIDGE)
    assert cli.main(["validate", path, "--hostname", "db-1"]) == 0
    out = capsys.readouterr().out
    assert "1 file(s) valid" in out and "no file is for host 'db-1'" in out


def test_plan_of_files_for_other_hosts_is_one_error_line(tmp_path: Any,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """Refused before anything is observed: no host access needed to say it."""
    path = write(tmp_path, "web.yaml", "hosts: ['web-*']\n" + BRIDGE)
    for command in ("plan", "apply"):
        assert cli.main([command, path, "--hostname", "db-1"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and "web-*" in err, err


# ------------------------------------------------------------------ saved plans' options


def _saved(tmp_path: Any, options: Any) -> str:
    src = write(tmp_path, "a.yaml", BRIDGE)
    import hashlib

    with open(src, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    plan = {"format_version": 1, "changes": [], "summary": {}, "live_fingerprint": "x",
            "files": [{"path": src, "sha256": digest}], "warnings": [], "errors": [],
            "options": options}
    return write(tmp_path, "plan.json", json.dumps(plan, indent=2))


@pytest.mark.parametrize(("options", "named"), [
    ({"prune": True, "adopt": 5, "force_replace": False}, "options.adopt"),
    ({"prune": True, "adopt": ["nomad"], "force_replace": False}, "options.adopt"),
    ({"prune": True, "adopt": ["router/nomad"], "force_replace": False}, "options.adopt"),
    ({"prune": True, "adopt": [["bridge/x"]], "force_replace": False}, "options.adopt"),
    ({"prune": "yes", "adopt": [], "force_replace": False}, "options.prune"),
    ({"prune": True, "adopt": [], "force_replace": 1}, "options.force_replace"),
    ({"prune": True, "adopt": [], "force_replace": False, "tolerate": 3}, "options.tolerate"),
    (5, "options"),
    ([], "options"),
    ("prune", "options"),
])
def test_saved_plan_with_a_malformed_option_is_one_line_naming_file_and_option(
        tmp_path: Any, capsys: pytest.CaptureFixture[str], options: Any, named: str) -> None:
    path = _saved(tmp_path, options)
    assert cli.main(["apply", path]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: {path}: ") and named in err, err
    assert "internal error" not in err and "Traceback" not in err
