"""Session set-up for every test: where temporary files and the reconciler's state go.

Fixtures of the real-kernel tests (the sandbox host, its leak check, Docker) are in
``tests/integration/conftest.py``; the unit tests' tripwire in ``tests/unit/conftest.py``;
helpers in ``tests/support/``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.support import cli, imagebuild
from tests.support.forkserver import SERVER
from tests.support.host import SESSION, is_root

#: where pytest's tmp_path directories go when /tmp is the default: the watch agent refuses
#: desired-state files under a directory others can write (the sticky /tmp included), so the
#: tests keep theirs in one only root can write
TRUSTED_TEMPROOT = "/var/lib/reconciler-tests"


def pytest_configure(config: pytest.Config) -> None:
    if is_root() and not os.environ.get("PYTEST_DEBUG_TEMPROOT") and \
            config.option.basetemp is None:
        os.makedirs(TRUSTED_TEMPROOT, mode=0o700, exist_ok=True)
        os.chmod(TRUSTED_TEMPROOT, 0o700)
        os.environ["PYTEST_DEBUG_TEMPROOT"] = TRUSTED_TEMPROOT
    if is_root() and not os.environ.get("RECONCILER_STATE_DIR"):
        # pending changes and journals of this run's sandboxes: never the host's own
        os.makedirs(TRUSTED_TEMPROOT, mode=0o700, exist_ok=True)
        os.environ["RECONCILER_STATE_DIR"] = os.path.join(TRUSTED_TEMPROOT, f"state-{SESSION}")
        config.add_cleanup(lambda: shutil.rmtree(os.environ["RECONCILER_STATE_DIR"],
                                                 ignore_errors=True))


def pytest_collection_finish(session: pytest.Session) -> None:
    """RECONCILER_TEST_IMAGE=1: build the container image while the other tests run, if
    a selected test needs it (tests/support/imagebuild.py)."""
    if imagebuild.wanted() and is_root() and not session.config.option.collectonly and \
            any("image" in getattr(item, "fixturenames", ()) for item in session.items):
        imagebuild.BUILD.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    SERVER.stop()  # the fork server of tests/support/cli.py, if the session started one
    imagebuild.BUILD.stop()


@pytest.fixture(autouse=True)
def real_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``real_process`` runs its ``reconcile(...)`` as real subprocesses."""
    cli.REAL_PROCESS["on"] = request.node.get_closest_marker("real_process") is not None
    try:
        yield
    finally:
        cli.REAL_PROCESS["on"] = False
