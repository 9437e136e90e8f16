"""JSON output: one write, the same bytes as ``json.dump``, to the stdout of the moment."""

from __future__ import annotations

import contextlib
import io
import json

from reconciler.ui import render

DOC = {"ok": False, "probes": [{"alloc": "a", "ms": 1.25, "cause": None}], "ü": ["x", 2]}


def test_emit_json_writes_what_json_dump_wrote() -> None:
    old, new = io.StringIO(), io.StringIO()
    json.dump(DOC, old, indent=2)
    old.write("\n")
    render.emit_json(DOC, new)
    assert new.getvalue() == old.getvalue()


def test_emit_json_follows_a_redirected_stdout() -> None:
    """The default is the stdout at the call, not at import (a caller's redirect, capsys)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        render.emit_json(DOC)
    assert json.loads(buf.getvalue()) == DOC
