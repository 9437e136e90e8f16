"""Shell completion scripts for `reconcile`, generated from the argument parser by shtab.

``reconcile completion bash`` / ``zsh`` print a script that completes the
subcommands, their options, the values of options with choices, network
namespace names for ``--netns`` (the preamble's ``_reconcile_netns``) and file
names for paths (``ui.parser`` marks which arguments take what). Derived from
the parser itself, so a new option is completed as soon as it exists.
"""

from __future__ import annotations

import argparse

import shtab

from reconciler.ui.parser import Completes, build_parser

_PREAMBLE = {
    "bash": (
        "# Install: reconcile completion bash > /etc/bash_completion.d/reconcile\n"
        "_reconcile_netns() {\n"
        "    compgen -W \"$(ls /run/netns 2>/dev/null)\" -- \"$1\"\n"
        "}\n"),
    "zsh": (
        "# Install: reconcile completion zsh > \"${fpath[1]}/_reconcile\"  (then restart zsh),\n"
        "# or for this shell only: source <(reconcile completion zsh)\n"
        "_reconcile_netns() {\n"
        "    local -a names\n"
        "    names=(/run/netns/*(N:t))\n"
        "    _describe -t netns 'network namespace' names\n"
        "}\n"),
}


_COMPLETERS = {"files": shtab.FILE,
               "netns": {"bash": "_reconcile_netns", "zsh": "_reconcile_netns"}}


def _mark(action: argparse.Action, what: Completes) -> None:
    action.complete = _COMPLETERS[what]  # type: ignore[attr-defined]  # shtab reads it


def script(shell: str) -> str:
    """Return the completion script for ``shell`` (one of :data:`SHELLS`)."""
    parser = build_parser(_mark)
    text: str = shtab.complete(parser, shell=shell, preamble=_PREAMBLE[shell])
    return text if text.endswith("\n") else text + "\n"
