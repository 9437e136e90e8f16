"""A local user without root, and an agent watched the way that user can see it.

``nobody`` runs code with the system Python; ``Watch`` runs ``reconcile watch`` in a test's
namespace with its status on a loopback port of its own, and reads that status over HTTP
as anyone could.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from tests.support.agent import free_port
from tests.support.host import REPO, Netns

#: the unprivileged user of the tests
NOBODY = 65534
PUBLIC_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def as_nobody(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with the system Python as the unprivileged user nobody."""
    return subprocess.run([PUBLIC_PYTHON, "-c", code, *args], user=NOBODY, group=NOBODY,
                          capture_output=True, text=True, timeout=60, cwd="/")



class Watch:
    """A `reconcile watch` of ``paths`` in namespace ``ns`` with status on loopback."""

    def __init__(self, ns: Netns, *paths: str, extra: tuple[str, ...] = (),
                 addr: str | None = None) -> None:
        self.addr = addr or f"127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reconciler", "--netns", ns.name, "watch", *paths,
             "--status-addr", self.addr, "--log-format", "json", "--no-docker-events",
             "--interval", "2", "--debounce", "0.1", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def get(self, path: str = "/status", timeout: float = 2.0) -> tuple[int, str] | None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://{self.addr}{path}", timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except OSError:
            return None

    def status(self) -> dict[str, Any]:
        got = self.get()
        return json.loads(got[1]) if got and got[0] == 200 else {}

    def wait(self, predicate: Any, timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"the agent exited ({self.proc.returncode}) waiting for "
                                     f"{what}: {self.output()}")
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out waiting for {what}: {self.status()}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def converged(self, timeout: float = 60) -> None:
        self.wait(lambda: (self.status().get("last_pass") or {}).get("result") in
                  ("ok", "applied"), timeout, "a converged pass")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.output()

    def output(self) -> str:
        if self.proc.poll() is not None:
            self._reader.join(timeout=10)
        return "".join(self.lines)
