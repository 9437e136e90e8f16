"""The agent's scheduling on a fake clock: coalesced requests, debounce, backoff, resync,
and the trigger a waiting loop is woken by."""

from __future__ import annotations

import threading

import pytest

from reconciler.agent.schedule import Scheduler, Trigger


def test_requests_coalesce_into_one_pass() -> None:
    s = Scheduler()
    s.request("netlink drift", 10.0, delay=0.1)
    s.request("netlink drift", 10.05, delay=0.1)
    s.request("netlink drift", 10.08, delay=0.1)
    assert s.next_due() == pytest.approx(10.1)  # not pushed back: drift heals promptly
    assert s.take(10.09) == []
    assert s.take(10.1) == ["netlink drift"]
    assert s.take(10.2) == [] and s.next_due() is None


def test_file_debounce_is_trailing_and_capped() -> None:
    s = Scheduler(max_wait=5.0)
    s.request("files changed", 0.0, delay=0.5, trailing=True)
    for t in (0.3, 0.6, 0.9):  # a git checkout writing file after file
        s.request("files changed", t, delay=0.5, trailing=True)
    assert s.next_due() == pytest.approx(1.4)
    assert s.take(1.3) == []
    assert s.take(1.4) == ["files changed"]
    # a writer that never stops still gets a pass after max_wait
    t = 10.0
    s.request("files changed", t, delay=0.5, trailing=True)
    while t < 20:
        t += 0.2
        s.request("files changed", t, delay=0.5, trailing=True)
    assert s.next_due() == pytest.approx(15.0)


def test_take_leaves_requests_not_yet_due() -> None:
    s = Scheduler()
    s.request("startup", 0.0)
    s.request("files changed", 0.0, delay=0.5, trailing=True)
    assert s.take(0.0) == ["startup"]
    assert s.pending() == ["files changed"]


def test_backoff_doubles_to_a_cap_and_resets() -> None:
    s = Scheduler(backoff_base=1.0, backoff_cap=8.0)
    delays = [s.record(False, 100.0) for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert s.failures == 6
    s.record(True, 200.0)
    assert s.failures == 0 and s.backoff_until == 0.0 and "retry" not in s.pending()
    assert s.record(False, 300.0) == 1.0


def test_drift_waits_out_backoff_but_operator_actions_do_not() -> None:
    s = Scheduler(backoff_base=4.0)
    s.record(False, 0.0)  # retry at 4.0
    s.request("netlink drift", 1.0, delay=0.1)
    assert s.take(1.1) == []  # an echo of a failing pass must not spin
    assert s.next_due() == pytest.approx(4.0)
    s.request("files changed", 1.0, delay=0.5, trailing=True, bypass_backoff=True)
    assert s.take(1.5) == ["files changed"]
    assert s.take(4.0) == ["netlink drift", "retry"]


def test_resync_is_rearmed_not_accumulated() -> None:
    s = Scheduler()
    s.set_resync(0.0, 60.0)
    s.set_resync(30.0, 60.0)
    assert s.next_due() == pytest.approx(90.0)
    assert s.take(60.0) == []
    assert s.take(90.0) == ["resync"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trigger_wait_returns_due_reasons_and_stops() -> None:
    clock = FakeClock()
    stop = threading.Event()
    t = Trigger(Scheduler(), stop, clock)
    t.request("startup")
    assert t.wait() == ["startup"]
    t.request("netlink drift", delay=0.1)
    clock.now = 0.1
    assert t.wait() == ["netlink drift"]
    stop.set()
    t.request("netlink drift")
    assert t.wait() is None


def test_trigger_wakes_a_waiting_loop_from_another_thread() -> None:
    stop = threading.Event()
    t = Trigger(Scheduler(), stop)
    got: list[list[str] | None] = []
    th = threading.Thread(target=lambda: got.append(t.wait(max_sleep=5.0)))
    th.start()
    t.request("SIGHUP", bypass_backoff=True)
    th.join(2.0)
    assert got == [["SIGHUP"]]
