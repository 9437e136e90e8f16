"""One updating line on a terminal while apply (or a prune, or destroy) works for long.

An apply of thousands of allocations runs for tens of seconds; without a word people
wonder whether it hangs. The executor reports each change it finished
(``on_outcome``); this draws ``[done/total] what comes next`` on stderr, rewriting the
same line (``\\r`` and erase-to-end), at most every ``interval`` and only once the work
has run for ``delay`` (a short apply prints exactly what it printed before). It is only
ever made for a terminal: never on a pipe or a file, never with ``--output json``, and
the line is erased before the summary, so logs and pipes see none of it.

See docs/decisions/033-show-and-graph-read-the-host.md.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from reconciler.domain.plan import Change, Plan
from reconciler.engine.executor import Outcome

#: seconds of work before the line appears, and between two redraws
DELAY = 1.0
INTERVAL = 0.1
_ERASE = "\r\033[K"


def wanted(stream: TextIO, output: str, verbose: int) -> bool:
    """Tell whether the line is wanted: a terminal, text output, no log lines to interleave with
    (``-v`` logs each change)."""
    if output != "text" or verbose:
        return False
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # closed, or not a real stream
        return False


class Progress(logging.Filter):
    """The line itself; ``plan`` and ``outcome`` are the hooks of ``Reconciler.apply``.

    As a context manager it also erases the line before any log record is written (a
    warning of the executor's, a held namespace's holders) so the record starts on a
    clean line, and the next change draws the line again below it; on exit it erases the
    line for the summary.
    """

    def __init__(self, stream: TextIO | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 delay: float = DELAY, interval: float = INTERVAL) -> None:
        self.stream = stream if stream is not None else sys.stderr  # the one of the moment
        self.clock = clock
        self.delay = delay
        self.interval = interval
        super().__init__()
        self.start = clock()
        self.changes: tuple[Change, ...] = ()
        self.done = 0
        self.failed = 0
        self._drawn_at: float | None = None

    def plan(self, plan: Plan) -> None:
        """Take the plan about to be executed: its actionable changes are the total."""
        self.changes = plan.actionable
        self.done = self.failed = 0
        self._draw()

    def outcome(self, outcome: Outcome) -> None:
        self.done += 1
        if outcome.status == "failed":
            self.failed += 1
        self._draw()

    def line(self) -> str:
        """Return what the line says now (without the erase), e.g. ``[120/300] alloc web-120``."""
        total = len(self.changes)
        width = len(str(total))
        head = f"[{self.done:>{width}}/{total}]"
        if self.done < total:
            c = self.changes[self.done]
            what = f"{c.action.symbol.strip() or ' '} {c.kind} {c.name}"
        else:
            what = "verifying"
        failed = f" ({self.failed} failed)" if self.failed else ""
        return f"{head}{failed} {what}"

    def _draw(self) -> None:
        now = self.clock()
        if now - self.start < self.delay:
            return
        if self._drawn_at is not None and now - self._drawn_at < self.interval \
                and self.done < len(self.changes):
            return
        self._drawn_at = now
        columns = _columns(self.stream)
        text = self.line()
        if len(text) > columns - 1:
            text = text[: max(columns - 2, 1)] + "…"
        self.stream.write(_ERASE + text)
        self.stream.flush()

    def filter(self, record: logging.LogRecord) -> bool:
        """Tell whether to write a record; every handler of the root logger asks this before it
        writes: the line goes first (and is drawn again at the next change, whatever the
        interval)."""
        self.finish()
        return True

    def __enter__(self) -> Progress:
        for handler in logging.getLogger().handlers:
            handler.addFilter(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for handler in logging.getLogger().handlers:
            handler.removeFilter(self)
        self.finish()

    def finish(self) -> None:
        """Erase the line (if it was ever drawn) so the summary starts on a clean line."""
        if self._drawn_at is not None:
            self.stream.write(_ERASE)
            self.stream.flush()
            self._drawn_at = None


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80
