"""Version, `python -m reconciler`, help text and the generated shell completion scripts."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import pytest

from reconciler import __version__
from reconciler.ui import parser as cli
from reconciler.ui.completion import script
from tests.support.host import REPO


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reconciler", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_version_matches_the_package_metadata():
    p = run("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"reconcile {__version__}"
    with open(os.path.join(REPO, "pyproject.toml")) as fh:
        assert f'version = "{__version__}"' in fh.read()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    raise AssertionError("no subcommands")


def test_every_subcommand_and_option_has_help():
    parser = cli.build_parser()
    missing = [f"reconcile {' '.join(a.option_strings)}" for a in parser._actions
               if not a.help and not isinstance(a, argparse._SubParsersAction)]
    for name, sp in _subparsers(parser).items():
        assert sp.description, f"reconcile {name} has no description"
        missing += [f"reconcile {name} {' '.join(a.option_strings) or a.dest}"
                    for a in sp._actions if not a.help]
    assert not missing, f"options without help: {missing}"


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["watch", "--help"],
                                  ["completion", "--help"]])
def test_help_exits_zero(args):
    p = run(*args)
    assert p.returncode == 0 and "usage: reconcile" in p.stdout and not p.stderr


def test_completion_scripts_mention_every_command_and_option():
    parser = cli.build_parser()
    commands = _subparsers(parser)
    for shell in ("bash", "zsh"):
        text = script(shell)
        for name, sp in commands.items():
            assert name in text
            for a in sp._actions:
                if a.help == argparse.SUPPRESS:
                    continue  # hidden on purpose (`revert --wait`: the detached reverter's)
                for f in a.option_strings:
                    assert f in text, (shell, name, f)
        for a in parser._actions:
            assert all(f in text for f in a.option_strings), (shell, a.option_strings)


BASH_CASES = [
    (["reconcile", ""], {"validate", "plan", "apply", "verify", "destroy", "show", "graph", "watch",
                         "status", "completion", "gc", "confirm", "revert", "release"}),
    (["reconcile", "gc", "--pl"], {"--plan"}),
    (["reconcile", "gc", "examples/quick"], {"examples/quickstart.yaml"}),
    (["reconcile", "verify", "--probe-e"], {"--probe-external"}),
    (["reconcile", "verify", "examples/quick"], {"examples/quickstart.yaml"}),
    (["reconcile", "pl"], {"plan"}),
    (["reconcile", "--netns", "x", "ap"], {"apply"}),
    (["reconcile", "plan", "--ou"], {"--output", "--out"}),
    (["reconcile", "plan", "--output", ""], {"text", "json"}),
    (["reconcile", "--color", "always", "apply", "--ad"], {"--adopt"}),
    (["reconcile", "completion", ""], {"bash", "zsh"}),
    (["reconcile", "watch", "--log-format", "j"], {"json"}),
    (["reconcile", "validate", "examples/quick"], {"examples/quickstart.yaml"}),
    (["reconcile", "plan", "--out", "examples/quick"], {"examples/quickstart.yaml"}),
    (["reconcile", "apply", "--dry-run", "examples/quick"], {"examples/quickstart.yaml"}),
]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize(("words", "expected"), BASH_CASES)
def test_bash_completion_completes(words, expected):
    p = run("completion", "bash")
    assert p.returncode == 0
    quoted = " ".join(f"'{w}'" for w in words)
    prog = (f"{p.stdout}\ncompopt() {{ :; }}\nCOMP_WORDS=({quoted}); "
            f"COMP_CWORD={len(words) - 1}; COMP_LINE=\"${{COMP_WORDS[*]}}\"; "
            "COMP_POINT=${#COMP_LINE}; _shtab_reconcile; printf '%s\\n' \"${COMPREPLY[@]}\"")
    out = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=30,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == expected


@pytest.mark.skipif(shutil.which("zsh") is None, reason="no zsh")
def test_zsh_completion_is_valid_zsh():
    p = run("completion", "zsh")
    assert p.returncode == 0 and p.stdout.startswith("#compdef reconcile\n")
    out = subprocess.run(["zsh", "-n"], input=p.stdout, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr


def test_completion_rejects_unknown_shell():
    p = run("completion", "fish")
    assert p.returncode == 1 and "invalid choice" in p.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completion_offers_network_namespace_names(tmp_path):
    """--netns completes the names under /run/netns (the preamble's _reconcile_netns)."""
    p = run("completion", "bash")
    fake = tmp_path / "netns"
    fake.mkdir()
    for name in ("blue", "green", "other"):
        (fake / name).touch()
    script_text = p.stdout.replace("ls /run/netns", f"ls {fake}")
    assert script_text != p.stdout, "the preamble no longer lists /run/netns"
    prog = (f"{script_text}\ncompopt() {{ :; }}\nCOMP_WORDS=(reconcile --netns g); "
            "COMP_CWORD=2; COMP_LINE=\"${COMP_WORDS[*]}\"; COMP_POINT=${#COMP_LINE}; "
            "_shtab_reconcile; printf '%s\\n' \"${COMPREPLY[@]}\"")
    out = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["green"]
