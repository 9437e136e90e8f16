"""`reconcile` with driver faults injected at the op gate: test-only, kept out of the package.

``python -m tests.support.faults SPEC [reconcile arguments...]`` runs the
real CLI in this process with ``HostOps.run`` wrapped. SPEC
``alloc.attach:3,netns.create:1:EBUSY``: the 3rd ``alloc.attach`` op of the
process fails as the kernel's EPERM would (a ``DriverError``), the 1st
``netns.create`` as EBUSY would (a ``TemporaryError``, so the executor retries
it). Used by test_faults.py, which needs a real ``reconcile`` process: one
that fails midway, reports and exits, for the next run to converge.
``alloc.attach:2:SIGKILL`` instead kills the process (``kill -9``) just before its
2nd ``alloc.attach``: what a crash mid-apply leaves behind (test_gc.py).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections import Counter

from reconciler.domain.errors import DriverError, TemporaryError
from reconciler.domain.plan import Op
from reconciler.engine.hostops import HostOps


def parse(spec: str) -> dict[tuple[str, int], int]:
    """``{(op name, nth): errno}`` of a SPEC (see the module docstring)."""
    faults = {}
    for item in spec.split(","):
        name, _, rest = item.strip().partition(":")
        nth, _, code = rest.partition(":")
        if not nth.isdigit():
            raise SystemExit(f"faults: {item!r} is not OP:N[:ERRNO]")
        faults[(name, int(nth))] = KILL if code == "SIGKILL" else \
            getattr(errno, code or "EPERM", errno.EPERM)
    return faults


#: the "errno" of a fault that is a kill -9 of the process
KILL = -signal.SIGKILL


def install(spec: str) -> None:
    """Wrap ``HostOps.run`` so the ops named in SPEC fail the way SPEC says."""
    faults = parse(spec)
    counts: Counter[str] = Counter()
    real = HostOps.run

    def run(self: HostOps, op: Op) -> None:
        counts[op.name] += 1
        n = counts[op.name]
        code = faults.get((op.name, n))
        if code == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        if code is not None:
            msg = f"{op.name}: {os.strerror(code)} (injected fault {n})"
            exc = TemporaryError(msg) if code == errno.EBUSY else DriverError(msg)
            exc.errno = code
            raise exc
        real(self, op)

    HostOps.run = run  # type: ignore[method-assign]


if __name__ == "__main__":
    install(sys.argv[1])
    del sys.argv[1]
    from reconciler.cli.entry import main

    raise SystemExit(main())
