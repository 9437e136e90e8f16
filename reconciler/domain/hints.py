"""How a hint spells a command: `reconcile` with the options its scope needs.

A hint is copied and run: in a sandbox (``--netns S``) a bare `reconcile confirm` would
confirm on the host. The CLI says once, at its start, which scope this process acts for
(:func:`set_netns`, from ``--netns``: the agent, the CLI and the detached reverter
alike); whatever words a hint asks :func:`command`. A process-wide setting, like the
locale: no I/O, stdlib only, so the pure planner and the fast path may word hints too.
"""

from __future__ import annotations

_netns: str | None = None


def set_netns(name: str | None) -> None:
    """Say which named namespace (``--netns``) this process acts for; None: where it runs."""
    global _netns
    _netns = name


def scope_options(netns: str | None = None) -> str:
    """Return the options that select the scope (``--netns NAME``), or an empty string."""
    name = netns if netns is not None else _netns
    return "" if name is None else f"--netns {name}"


def command(rest: str, *, netns: str | None = None) -> str:
    """Return ``reconcile [--netns NAME] REST``, the command line a hint gives (``netns``:
    this one rather than the process's)."""
    return " ".join(w for w in ("reconcile", scope_options(netns), rest) if w)
