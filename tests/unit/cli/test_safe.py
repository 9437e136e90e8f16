"""The safe-change commands of the CLI: `--confirm-within` and what they refuse."""

from __future__ import annotations

from typing import Any

import pytest

from reconciler.domain.errors import ConfigError
from reconciler.ui.options import plan_options
from reconciler.ui.parser import build_parser


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90.0), ("5m", 300.0), ("45", 45.0)])
def test_confirm_within_takes_a_duration(text: str, seconds: float) -> None:
    args = build_parser().parse_args(["apply", "x.yaml", "--confirm-within", text])
    assert args.confirm_within == seconds


@pytest.mark.parametrize("text", ["soon", "-5s", "0", ""])
def test_a_bad_confirm_within_is_a_usage_error(text: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["apply", "x.yaml", f"--confirm-within={text}"])
    assert exc.value.code == 1 and "is not a duration" in capsys.readouterr().err


def test_the_cli_refuses_adopt_with_a_window_in_one_line(tmp_path: Any, monkeypatch: Any,
                                                       capsys: Any) -> None:
    """Before the host is read (the unit tests' tripwires would make it an internal
    error), before anything is recorded."""
    from reconciler.cli import commands

    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "s"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("version: 1\n")
    rc = commands.main(["apply", str(cfg), "--adopt", "bridge/x", "--confirm-within", "1m"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: --adopt cannot be used with --confirm-within"), lines
    assert not (tmp_path / "s").exists()  # nothing recorded
    # watch is planned with the same options
    args = build_parser().parse_args(["watch", str(cfg), "--adopt", "bridge/x",
                                      "--confirm-within", "1m"])
    with pytest.raises(ConfigError, match="--adopt cannot be used with --confirm-within"):
        plan_options(args)


@pytest.mark.parametrize("text", ["1e20", "1e17", "1e300h", "604801", "inf", "nan"])
@pytest.mark.parametrize("command", ["apply", "watch"])
def test_a_window_longer_than_seven_days_is_a_usage_error(text: str, command: str,
                                                          capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "x.yaml", f"--confirm-within={text}"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "at most 7 days" in err or "is not a duration" in err, err


def test_a_window_of_seven_days_is_taken() -> None:
    args = build_parser().parse_args(["apply", "x.yaml", "--confirm-within", "168h"])
    assert args.confirm_within == 7 * 86400.0
