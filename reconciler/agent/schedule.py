"""When passes run: requests coalesce, resyncs recur, failures back off.

``Scheduler`` is pure (tested with a fake clock); ``Trigger`` is its thread-safe face.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Request:
    due: float
    first: float
    bypass_backoff: bool


@dataclass
class Scheduler:
    """When the next pass should run. Pure: every method takes ``now``.

    Requests are keyed by reason; requesting again merges. ``trailing`` requests
    (file changes) move their due time to ``now + delay`` on every repeat, but
    never beyond ``first + max_wait``; others keep the earliest due time.
    """

    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    max_wait: float = 5.0
    failures: int = 0
    backoff_until: float = 0.0
    _pending: dict[str, _Request] = field(default_factory=dict)

    def request(self, reason: str, now: float, *, delay: float = 0.0, trailing: bool = False,
                bypass_backoff: bool = False) -> None:
        due = now + delay
        old = self._pending.get(reason)
        if old is None:
            self._pending[reason] = _Request(due, now, bypass_backoff)
            return
        if trailing:
            old.due = min(max(old.due, due), old.first + self.max_wait)
        else:
            old.due = min(old.due, due)
        old.bypass_backoff = old.bypass_backoff or bypass_backoff

    def set_resync(self, now: float, interval: float) -> None:
        """(Re)arm the periodic full resync ``interval`` seconds from now."""
        self.set_timer("resync", now, interval)

    def set_timer(self, reason: str, now: float, interval: float) -> None:
        """(Re)arm a periodic request (the resync, the probes) ``interval`` seconds from now."""
        self._pending[reason] = _Request(now + interval, now, False)

    def _effective(self, r: _Request) -> float:
        return r.due if r.bypass_backoff else max(r.due, self.backoff_until)

    def next_due(self) -> float | None:
        return min((self._effective(r) for r in self._pending.values()), default=None)

    def take(self, now: float) -> list[str]:
        """Take the reasons due now (removed); requests not yet due stay pending."""
        due = sorted(k for k, r in self._pending.items() if self._effective(r) <= now)
        for k in due:
            del self._pending[k]
        return due

    def pending(self) -> list[str]:
        return sorted(self._pending)

    def backoff_delay(self) -> float:
        return float(min(self.backoff_cap, self.backoff_base * 2.0 ** max(0, self.failures - 1)))

    def record(self, ok: bool, now: float) -> float:
        """Account for a finished pass; after a failure, schedule a retry. Returns its delay."""
        if ok:
            self.failures = 0
            self.backoff_until = 0.0
            self._pending.pop("retry", None)
            return 0.0
        self.failures += 1
        delay = self.backoff_delay()
        self.backoff_until = now + delay
        self.request("retry", now, delay=delay)
        return delay


class Trigger:
    """Thread-safe front of a :class:`Scheduler`: event sources call ``request``."""

    def __init__(self, scheduler: Scheduler, stop: threading.Event,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.stop = stop
        self.clock = clock
        self._cond = threading.Condition(threading.RLock())

    def request(self, reason: str, *, delay: float = 0.0, trailing: bool = False,
                bypass_backoff: bool = False) -> None:
        with self._cond:
            self.scheduler.request(reason, self.clock(), delay=delay, trailing=trailing,
                                   bypass_backoff=bypass_backoff)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def locked(self) -> threading.Condition:
        return self._cond

    def wait(self, max_sleep: float = 1.0) -> list[str] | None:
        """Block until a pass is due (its reasons) or stop is set (None)."""
        with self._cond:
            while not self.stop.is_set():
                now = self.clock()
                reasons = self.scheduler.take(now)
                if reasons:
                    return reasons
                nd = self.scheduler.next_due()
                timeout = max_sleep if nd is None else min(max_sleep, max(0.0, nd - now))
                self._cond.wait(timeout)
            return None

