"""A killed reverter is replaced, and a revert takes the neighbour entries it must.

Read with ``ip``, ``iptables`` and the state directory's files, never our observer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.allocs import subnet_config as _config
from tests.support.host import Netns, sh, unique

pytestmark = pytest.mark.root




# ------------------------------------------------------------------ item 6: the reverter


def _scope_dir(host: Netns) -> str:
    return os.path.join(os.environ["RECONCILER_STATE_DIR"], f"netns-{host.name}")


def _pending(host: Netns) -> dict[str, Any] | None:
    try:
        with open(os.path.join(_scope_dir(host), "pending.json")) as fh:
            rec: dict[str, Any] = json.load(fh)
            return rec
    except FileNotFoundError:
        return None


def _alive(pid: int | None) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(") ")[2][:1] not in ("Z", "X", "")
    except (FileNotFoundError, TypeError):
        return False


def _wait(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def box(host_ns: Netns) -> Iterator[Netns]:
    """``host_ns``; at the end no reverter of it left running, no record left behind."""
    try:
        yield host_ns
    finally:
        rec = _pending(host_ns)
        if rec is not None and _alive(rec.get("reverter_pid")):
            os.kill(rec["reverter_pid"], signal.SIGKILL)
        sh("rm", "-rf", _scope_dir(host_ns))


def test_a_killed_reverter_is_replaced_by_the_next_command(box: Netns, tmp_path: Any) -> None:
    """The reverter is SIGKILLed inside the window: the next command that reads the scope
    (here an apply, refused because the change is pending) starts another one, which reverts
    at the deadline without anyone taking the lock."""
    a, b, bridge = unique("r") + "-a", unique("r") + "-b", unique("b")
    base = _config(tmp_path, bridge, "10.234.0.0/24", [{"id": a}], "base.yaml")
    more = _config(tmp_path, bridge, "10.234.0.0/24", [{"id": a}, {"id": b}], "more.yaml")
    assert box.reconcile("apply", "--no-probe", base).rc == 0
    r = box.reconcile("apply", "--no-probe", more, "--confirm-within", "5s")
    assert r.rc == 0, r.all
    rec = _pending(box)
    assert rec is not None and _alive(rec["reverter_pid"])
    os.kill(rec["reverter_pid"], signal.SIGKILL)
    _wait(lambda: not _alive(rec["reverter_pid"]), 10, "the reverter's death")
    refused = box.reconcile("apply", "--no-probe", base)
    assert refused.rc == 1 and "pending until" in refused.err, refused.all
    now = _pending(box)
    assert now is not None and now["reverter_pid"] != rec["reverter_pid"], now
    assert _alive(now["reverter_pid"]), "no reverter runs for the pending change"
    _wait(lambda: _pending(box) is None, rec["deadline"] - time.time() + 30, "the revert")
    assert not os.path.exists(f"/run/netns/{b}") and os.path.exists(f"/run/netns/{a}")
    assert box.reconcile("plan", "--no-agent", base).rc == 0  # its neighbour entries too


#: in the sandbox's network namespace: record a pending change as `apply --confirm-within`
#: does before its first op, and die (killed before it could start the reverter)
RECORD_ONLY = r"""
import time
from reconciler.domain.model import DesiredState
from reconciler.engine import safechange
from reconciler.engine.reconcile import Reconciler
rec = Reconciler()
safechange.record(rec.observe(DesiredState()), rec.observer.handles, deadline=time.time() + 600)
"""


def test_a_record_whose_apply_died_before_its_reverter_refuses_nothing(
        box: Netns, tmp_path: Any) -> None:
    """A CLI killed between writing ``pending.json`` and starting the reverter made no change:
    the next command that takes the lock finds it so and drops the record at once, instead
    of refusing every change for the whole window."""
    a, bridge = unique("r") + "-a", unique("b")
    base = _config(tmp_path, bridge, "10.235.0.0/24", [{"id": a}])
    assert box.reconcile("apply", "--no-probe", base).rc == 0
    sh("nsenter", f"--net=/run/netns/{box.name}", sys.executable, "-c", RECORD_ONLY)
    rec = _pending(box)
    assert rec is not None and rec["reverter_pid"] is None, rec
    r = box.reconcile("apply", "--no-probe", base)
    assert r.rc == 0, r.all
    assert "before its first change" in r.err, r.all
    assert _pending(box) is None


# ------------------------------------------------------------------ gap: a revert's neighbours


def test_a_revert_of_an_added_allocation_takes_its_neighbour_entries(
        box: Netns, tmp_path: Any) -> None:
    """The change added an allocation (its bridge-side neighbour entries seeded with it):
    after `revert`, none of them is left, so plan and verify are clean at once."""
    a, b, bridge = unique("n") + "-a", unique("n") + "-b", unique("b")
    base = _config(tmp_path, bridge, "10.238.0.0/24", [{"id": a, "address": "10.238.0.10"}],
                   "base.yaml")
    more = _config(tmp_path, bridge, "10.238.0.0/24", [{"id": a, "address": "10.238.0.10"},
                                                       {"id": b, "address": "10.238.0.11"}],
                   "more.yaml")
    assert box.reconcile("apply", "--no-probe", base).rc == 0
    assert box.reconcile("apply", "--no-probe", more, "--confirm-within", "5m").rc == 0
    neigh = sh("ip", "-n", box.name, "neigh", "show", "dev", bridge).stdout
    assert "10.238.0.11 " in neigh, neigh  # seeded with the allocation
    r = box.reconcile("revert")
    assert r.rc == 0, r.all
    neigh = sh("ip", "-n", box.name, "neigh", "show", "dev", bridge).stdout
    assert "10.238.0.11 " not in neigh, neigh
    plan = box.reconcile("plan", "--no-agent", base)
    assert plan.rc == 0, plan.all
    verify = box.reconcile("verify", base)
    assert verify.rc == 0, verify.all

