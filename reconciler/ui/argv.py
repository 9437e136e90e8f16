"""Command-line spellings that mean the same thing (stdlib only: the fast path uses it)."""

from __future__ import annotations

from reconciler.ui.optiontable import GLOBAL


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
        takes_value = GLOBAL.get(a, ("", ""))[1] == "value"  # not --netns=NAME
        i += 2 if takes_value else 1
    return out
