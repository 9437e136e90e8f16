"""A real ``reconcile watch`` agent of a sandbox, and what tests ask of it.

The ``agents`` fixture (``tests/integration/conftest.py``) starts them and stops every
one when the test ends. Tests wait on the agent's own status (``pass_count``,
``last_pass``) rather than sleeping.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from typing import Any, Protocol

from tests.support.cli import Result, reconcile
from tests.support.host import REPO, Netns, wait_for, write


def agent_env() -> dict[str, str]:
    """Return the environment of an agent: this tree's package first.

    Read at each start, never at import: the initial conftests import this module before
    ``pytest_configure`` gives the run its state directory, and an agent without it would
    keep its journals and leases in the machine's own /var/lib/reconciler.
    """
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


class Named(Protocol):
    name: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def confdir(tmp_path: Any) -> str:
    """A desired-state directory the agent accepts (0755, under the trusted temp root)."""
    d = os.path.join(str(tmp_path), "conf")
    os.makedirs(d, mode=0o755, exist_ok=True)
    os.chmod(d, 0o755)
    return d


def bridge_yaml(name: str, mtu: int, cidr: str = "10.77.0.0/24") -> str:
    return (f"version: 1\nbridges:\n  - name: {name}\n    mtu: {mtu}\n"
            f"subnets:\n  - name: {name}-net\n    bridge: {name}\n    cidr: {cidr}\n")


class Agent:
    """One `reconcile watch` process; its log (JSON lines) is collected by a thread."""

    def __init__(self, host: Named, paths: list[str], *extra: str) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "reconciler", "--netns", host.name, "watch", *paths,
               "--status-addr", self.addr, "--log-format", "json", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=agent_env(), cwd=REPO, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def logs(self) -> list[dict[str, Any]]:
        out = []
        for ln in list(self.lines):
            with contextlib.suppress(ValueError):
                out.append(json.loads(ln))
        return out

    def log_text(self) -> str:
        return "\n".join(self.lines)

    def get(self, path: str = "/status") -> Any:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://{self.addr}{path}", timeout=2) as r:
                body = r.read().decode()
                return json.loads(body) if path == "/status" else body
        except OSError:
            return None

    def status(self) -> dict[str, Any] | None:
        doc: dict[str, Any] | None = self.get("/status")
        return doc

    def wait_status(self, pred: Callable[[dict[str, Any]], Any], timeout: float = 15.0,
                    what: str = "status") -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            assert self.proc.poll() is None, f"agent exited early:\n{self.log_text()}"
            doc = self.status()
            return doc if doc is not None and pred(doc) else None

        try:
            result: dict[str, Any] = wait_for(check, timeout, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last status {self.status()}\n{self.log_text()}") \
                from None
        return result

    def converged(self, timeout: float = 15.0, after: int = 0) -> dict[str, Any]:
        """Wait until a pass numbered above ``after`` converged."""
        return self.wait_status(
            lambda d: (d.get("last_pass") or {}).get("result") in ("ok", "applied")
            and not d.get("errors") and d["pass_count"] > after, timeout,
            what="a converged pass")

    def passes(self, reason: str) -> list[dict[str, Any]]:
        return [r for r in self.logs() if "pass_number" in r and reason in r.get("reasons", [])]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)


def plan_counts(agent: Agent) -> dict[str, float]:
    """The agent's plan answers by result, from its /metrics."""
    text = agent.get("/metrics") or ""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("reconciler_plan_requests_total{"):
            result = line.split('result="')[1].split('"')[0]
            out[result] = float(line.rsplit(" ", 1)[1])
    return out


class PlanAgent:
    """A watch agent that declares nothing here and changes nothing: it only answers plans."""

    def __init__(self, host: Netns, tmp_path: Any) -> None:
        idle = write(tmp_path, "idle.yaml", "version: 1\nhosts: [no-such-host-anywhere]\n")
        os.chmod(idle, 0o644)
        os.chmod(str(tmp_path), 0o755)
        self.host = host
        # --dry-run: it never acts on what a test breaks (even --no-prune tidies up, e.g.
        # empty chains of its own), so both plans see the same host
        self.agent = Agent(host, [idle], "--no-prune", "--dry-run")  # type: ignore[arg-type]
        ino = os.stat(f"/run/netns/{host.name}").st_ino
        from reconciler.agent.planview.protocol import socket_path

        self.socket = socket_path(ino)
        wait_for(lambda: os.path.exists(self.socket) and self.agent.status(), 15,
                 what="the plan socket")

    def counts(self) -> dict[str, float]:
        return plan_counts(self.agent)

    def plan(self, *args: str, mode: str = "require") -> Result:
        return reconcile("plan", *args, netns=self.host.name, env={"RECONCILER_AGENT": mode})


#: the impact's flow counts move on their own (connections come and go between the two
#: plans compared): they are left out of the comparison, everything else must be equal
_FLOWS = re.compile(r"\b(?:\d+|no) established flows?\b")


def same_as_in_process(agent: PlanAgent, *args: str) -> Result:
    """Plan through the agent and in-process; both must print and exit the same (but for
    the impact's flow counts)."""
    ours = agent.plan(*args)
    local = reconcile("plan", "--no-agent", *args, netns=agent.host.name)
    assert "did not answer" not in ours.err, ours.err
    assert (ours.rc, _FLOWS.sub("N flows", ours.out)) == (
        local.rc, _FLOWS.sub("N flows", local.out)), \
        f"agent:\n{ours.all}\nin-process:\n{local.all}"
    return ours
