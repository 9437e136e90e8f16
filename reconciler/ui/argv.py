"""Command-line spellings that mean the same thing (stdlib only: the fast path uses it)."""

from __future__ import annotations


def normalise_argv(argv: list[str]) -> list[str]:
    """Read `reconcile --plan PATH…` as `reconcile plan PATH…`."""
    out = list(argv)
    i = 0
    while i < len(out):
        a = out[i]
        if a == "--plan":
            out[i] = "plan"
            break
        if not a.startswith("-"):
            break
        i += 2 if a in ("--netns", "--color") else 1  # these take a value
    return out

