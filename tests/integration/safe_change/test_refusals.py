"""What a pending change refuses, against the real kernel: `--adopt` under a window, `gc`
(and the guard that reverts an overdue change first), `--output json` when an overdue
change is reverted first, `confirm` of a change whose apply was killed, and what a stopped
apply says.

The sandboxes and the independent view of the host are those of ``tests/support/safechange.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.support.host import Netns
from tests.support.safechange import (
    alive,
    apply_ok,
    diff,
    kill_apply_at_checkpoint,
    make_overdue,
    pending_record,
    reverts,
    setup_change,
    state,
    wait_gone,
)

pytestmark = pytest.mark.root


def _overdue_without_reverter(box: Netns, cfg: str) -> dict[str, Any]:
    """Apply ``cfg`` under a 1 s window, kill its reverter and move the deadline into the
    past (``make_overdue``): the next command is the one that must revert it."""
    apply_ok(box, cfg, "--confirm-within", "1s")
    rec = pending_record(box)
    assert rec is not None
    os.kill(rec["reverter_pid"], signal.SIGKILL)
    assert wait_gone(rec["reverter_pid"])
    rec = make_overdue(box)
    assert pending_record(box) is not None
    return rec


def test_adopt_under_a_window_is_refused_and_nothing_changes(box: Netns,
                                                             tmp_path: Any) -> None:
    _a, b, before, _extra = setup_change(box, tmp_path)
    r = box.reconcile("apply", b, "--adopt", "bridge/rsafe0x", "--confirm-within", "1m")
    lines = r.err.strip().splitlines()
    assert r.rc == 1 and len(lines) == 1, r.all
    assert "--adopt cannot be used with --confirm-within" in lines[0], r.err
    assert pending_record(box) is None
    assert not diff(state(box), before), diff(state(box), before)


def test_gc_is_refused_while_a_change_is_pending(box: Netns, tmp_path: Any) -> None:
    _a, b, _before, _extra = setup_change(box, tmp_path)
    apply_ok(box, b, "--confirm-within", "5m")
    changed = state(box)
    r = box.reconcile("gc")
    lines = r.err.strip().splitlines()
    assert r.rc == 1 and len(lines) == 1 and "pending until 20" in lines[0], r.all
    assert not diff(state(box), changed)
    assert box.reconcile("revert").rc == 0


def test_gc_reverts_an_overdue_change_first(box: Netns, tmp_path: Any) -> None:
    _a, b, before, _extra = setup_change(box, tmp_path)
    _overdue_without_reverter(box, b)
    r = box.reconcile("gc")
    assert r.rc == 0, r.all
    assert "reverting it first" in r.err and "Reverted" in r.out, r.all
    assert not diff(state(box), before), diff(state(box), before)
    assert pending_record(box) is None and reverts(box)["count"] == 1


def test_json_output_stays_one_document_when_an_overdue_change_is_reverted_first(
        box: Netns, tmp_path: Any) -> None:
    a, b, before, _extra = setup_change(box, tmp_path)
    _overdue_without_reverter(box, b)
    r = box.reconcile("apply", a, "--output", "json")
    assert r.rc == 0, r.all
    doc = json.loads(r.out)  # nothing before the document
    assert doc["ok"] is True and "Reverted" in r.err, r.all
    assert not diff(state(box), before), diff(state(box), before)


def test_confirm_refuses_a_change_whose_apply_was_killed(box: Netns, tmp_path: Any) -> None:
    """The CLI SIGKILLed right after it recorded the checkpoint: the record says the apply
    did not finish, and `confirm` must not keep a half-made change."""
    _a, b, before, _extra = setup_change(box, tmp_path)
    rec, _rc = kill_apply_at_checkpoint(box, b, "2m")
    assert alive(rec["reverter_pid"])
    c = box.reconcile("confirm")
    lines = c.err.strip().splitlines()
    assert c.rc == 1 and len(lines) == 1 and "not finished" in lines[0], c.all
    assert pending_record(box) is not None
    r = box.reconcile("revert")
    assert r.rc == 0, r.all
    assert not diff(state(box), before), diff(state(box), before)
    assert wait_gone(rec["reverter_pid"], 5.0)


def test_a_stopped_apply_says_until_when_its_change_is_pending(box: Netns,
                                                               tmp_path: Any) -> None:
    """SIGTERM once the checkpoint is recorded: the apply stops between ops, says until
    when the partial change is pending, and that change cannot be confirmed."""
    _a, b, before, _extra = setup_change(box, tmp_path)
    cmd = [sys.executable, "-m", "reconciler", "--netns", box.name, "apply", b,
           "--confirm-within", "2m"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 30
        while (rec := pending_record(box)) is None or not rec.get("reverter_pid"):
            assert time.monotonic() < end and proc.poll() is None, "no pending record"
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    assert "stopped by SIGTERM" in err and "pending until 20" in err, err
    assert "cannot be confirmed" in err, err
    c = box.reconcile("confirm")
    assert c.rc == 1 and "not finished" in c.err, c.all
    assert box.reconcile("revert").rc == 0
    assert not diff(state(box), before), diff(state(box), before)
