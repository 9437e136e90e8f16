"""Record how long each firewall transaction takes, for the benchmarks only.

Off unless ``RECONCILER_BENCH_FIREWALL_TIMES`` names a file: then every op whose
wire name starts with ``firewall.`` (the iptables-restore transaction today, the
nftables one after it: whichever backend the tree has) appends one JSON line,
``{"op": NAME, "seconds": S, "pid": P}``, to it. Nothing reads the file but
``bench/fw_change.py``; the figure is the time of the call into the driver.

See docs/decisions/052-firewall-figures-measured-from-outside.md.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

ENV = "RECONCILER_BENCH_FIREWALL_TIMES"
PREFIX = "firewall."


def timed(name: str, perform: Callable[[], None]) -> None:
    """Run ``perform``; when the bench asked for it and ``name`` is a firewall op, record it."""
    path = os.environ.get(ENV)
    if not path or not name.startswith(PREFIX):
        perform()
        return
    t0 = time.perf_counter()
    try:
        perform()
    finally:
        seconds = time.perf_counter() - t0
        line = json.dumps({"op": name, "seconds": seconds, "pid": os.getpid()}) + "\n"
        with open(path, "a") as fh:
            fh.write(line)
