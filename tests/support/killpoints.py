"""`reconcile` that SIGKILLs itself at a chosen step: test-only, kept out of the package.

``python -m tests.support.killpoints SPEC [reconcile arguments...]`` runs the
real CLI in this process and kills it with SIGKILL (``kill -9``: no handler, no
``finally``) right after the Nth successful call of one step. SPEC is
``WHAT:N[:before]``; WHAT is

* a Docker API call of the SDK's low-level client (``disconnect``, ``remove``,
  ``create``, ``connect``: ``APIClient.disconnect_container_from_network`` …), so
  the kill lands between two daemon requests of one ``docker.replace``;
* or an op name (``link.delete``, ``alloc.attach`` …), counted at the op gate
  (``HostOps.run``), as ``faults.py`` does.

``:before`` kills just before the Nth call instead of after it. The hooks sit at
the boundary the reconciler cannot see (the SDK and the op gate), so the same
SPEC means the same instant with or without a journal.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from reconciler.domain.plan import Op
from reconciler.engine.hostops import HostOps

DOCKER_CALLS = {"disconnect": "disconnect_container_from_network", "remove": "remove_network",
                "create": "create_network", "connect": "connect_container_to_network"}


def parse(spec: str) -> tuple[str, int, bool]:
    what, _, rest = spec.partition(":")
    nth, _, when = rest.partition(":")
    if not nth.isdigit() or when not in ("", "before"):
        raise SystemExit(f"killpoints: {spec!r} is not WHAT:N[:before]")
    return what, int(nth), when == "before"


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(spec: str) -> None:
    """Wrap the step SPEC names so the Nth call of it is the last thing this process does."""
    what, nth, before = parse(spec)
    counts: Counter[str] = Counter()

    def counted(call: Callable[[], Any]) -> Any:
        counts[what] += 1
        if before and counts[what] == nth:
            _die()
        result = call()
        if not before and counts[what] == nth:
            _die()
        return result

    if what in DOCKER_CALLS:
        from docker.api.client import APIClient  # noqa: PLC0415 (only for Docker kill points)

        method = DOCKER_CALLS[what]
        real = getattr(APIClient, method)

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            return counted(lambda: real(self, *args, **kwargs))

        setattr(APIClient, method, wrapped)
        return
    real_run = HostOps.run

    def run(self: HostOps, op: Op) -> None:
        if op.name != what:
            real_run(self, op)
            return
        counted(lambda: real_run(self, op))

    HostOps.run = run  # type: ignore[method-assign]


if __name__ == "__main__":
    install(sys.argv[1])
    del sys.argv[1]
    from reconciler.cli.entry import main

    raise SystemExit(main())
