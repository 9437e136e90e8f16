"""The container image of ``RECONCILER_TEST_IMAGE=1``, built while the other tests run.

``scripts/build-image.sh`` (debootstrap of a base where none exists, the wheels, ``docker
build``) took about a minute of CI's run, all of it in the set-up of the first test of
``tests/integration/packaging/test_image.py``, with nothing else running. The session
starts it once collection is over when a selected test uses the ``image`` fixture, and
that fixture waits for it; a session that did not start it (the module run on its own
with the variable set later, say) builds it there, as before.

The build runs on a copy of this checkout (what ``test_install.py`` copies): the wheel
build writes ``build/``, ``*.egg-info`` and ``wheelhouse/`` into its source tree, where
``test_wheel.py`` and ``test_install.py`` build too. See
docs/decisions/053-helpers-as-forks.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile

from tests.support.host import REPO

IMAGE = os.environ.get("RECONCILER_IMAGE", "reconciler:dev")
_SKIP = shutil.ignore_patterns(".git", "build", "dist", "wheelhouse", "*.egg-info",
                               "__pycache__", ".*_cache", ".hypothesis")


def wanted() -> bool:
    return os.environ.get("RECONCILER_TEST_IMAGE") == "1"


class Build:
    """One run of build-image.sh on a copy of the checkout, its output in a file."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = ""
        self.result: tuple[int, str] | None = None

    def start(self) -> None:
        if self.proc is not None or self.result is not None:
            return
        self.dir = tempfile.mkdtemp(prefix="rc-image-")
        src = os.path.join(self.dir, "src")
        shutil.copytree(REPO, src, ignore=_SKIP)
        with open(os.path.join(self.dir, "build.log"), "wb") as log:
            self.proc = subprocess.Popen(
                ["bash", os.path.join(src, "scripts", "build-image.sh")], cwd=src,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ, IMAGE=IMAGE), start_new_session=True)

    def wait(self, timeout: float = 900) -> tuple[int, str]:
        """Start it if no one did; (exit code, output) once it is over."""
        if self.result is None:
            self.start()
            assert self.proc is not None
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            with open(os.path.join(self.dir, "build.log"), errors="replace") as fh:
                self.result = rc, fh.read()
            self.stop()
        return self.result

    def stop(self) -> None:
        """Kill it if it still runs (the session ends), remove the copy."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its trap removes its rootfs
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""


BUILD = Build()
