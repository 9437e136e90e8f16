"""The agent's logs: one JSON object per line, or plain text; a bound on what strangers can
make it write."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from reconciler.ui import scale


class TextLogFormatter(logging.Formatter):
    """``TIME LEVEL message``, each line fitted to :data:`scale.WIDTH` characters (lists
    elided with a count, SPEC §13); ``--log-format json`` keeps every character."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(scale.fit(line) for line in super().format(record).split("\n"))


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line (journald/Loki friendly)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("pass_number", "revision", "result", "reasons", "duration_seconds"):
            if hasattr(record, key):
                doc[key] = getattr(record, key)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(fmt: str, verbose: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(TextLogFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
    # watchdog logs every inotify event at debug: a log file next to the config would loop
    logging.getLogger("watchdog").setLevel(logging.WARNING)



class RateLimit(logging.Filter):
    """Let through at most ``burst`` records at once and ``rate`` a second after that, over every
    record of the logger it filters — whoever caused them, from whatever address.

    A per-address bound alone is no bound: one unprivileged process that used another
    127.x source per connection made the agent write 65,024 lines (10 MB) in 10 s. The
    first record let through after some were held back says how many; ``flush`` says it
    when no record comes (a flood that stopped).
    """

    def __init__(self, rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self._held = 0
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            self._refill()
            if self._tokens < 1.0:
                self._held += 1
                return False
            self._tokens -= 1.0
            held, self._held = self._held, 0
        if held:
            record.msg = (f"{record.getMessage()} ({held} more line(s) like these suppressed "
                          "before this one: log rate limit)")
            record.args = None
        return True

    def flush(self) -> int:
        """Return how many records were held back since the last one let through, when a line
        saying so may be written now (the count is then forgotten); 0 otherwise."""
        with self._lock:
            self._refill()
            if not self._held or self._tokens < 1.0:
                return 0
            held, self._held = self._held, 0
            return held
