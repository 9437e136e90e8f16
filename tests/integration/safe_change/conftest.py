"""The safe-change sandbox: ``host_ns`` with no reverter or record left behind it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tests.support.host import Netns, sh
from tests.support.safechange import alive, pending_record, scope_dir, wait_gone

pytestmark = pytest.mark.root


@pytest.fixture
def box(host_ns: Netns) -> Iterator[Netns]:
    """``host_ns``, and at the end no reverter of it left running and no record left (so
    its teardown's destroy is not refused)."""
    try:
        yield host_ns
    finally:
        rec = pending_record(host_ns)
        if rec is not None and rec.get("reverter_pid") and alive(rec["reverter_pid"]):
            os.kill(rec["reverter_pid"], signal.SIGKILL)
            wait_gone(rec["reverter_pid"])
        sh("rm", "-rf", scope_dir(host_ns))
