"""The real agent: `python -m reconciler --netns NS watch ...` against the real kernel.

Each test makes its own throwaway network namespace (the "host"), starts the
agent as a subprocess with its status endpoint on a free loopback port, and
polls the kernel or /status with bounded timeouts. No agent survives a test:
it is stopped in a finally, killed if it does not stop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import forget_run_files

pytestmark = pytest.mark.root

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def sh(*args: str, check: bool = True, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=60,
                          cwd=cwd)


def reconcile(ns: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reconciler", "--netns", ns, *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV, cwd=REPO)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, every: float = 0.05,
             what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def write(path: str, text: str) -> None:
    """Save the way editors do: a temp file in the same directory, then rename."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def bridge_yaml(name: str, mtu: int, cidr: str = "10.77.0.0/24") -> str:
    return (f"version: 1\nbridges:\n  - name: {name}\n    mtu: {mtu}\n"
            f"subnets:\n  - name: {name}-net\n    bridge: {name}\n    cidr: {cidr}\n")


class Host:
    """A throwaway network namespace standing in for the host."""

    def __init__(self, name: str) -> None:
        self.name = name

    def link(self, name: str) -> dict[str, Any] | None:
        p = sh("ip", "-n", self.name, "-j", "-d", "link", "show", "dev", name, check=False)
        if p.returncode != 0 or not p.stdout.strip():
            return None
        links: list[dict[str, Any]] = json.loads(p.stdout)
        return links[0] if links else None

    def mtu(self, name: str) -> int | None:
        link = self.link(name)
        return int(link["mtu"]) if link else None

    def bridges(self) -> set[str]:
        out = sh("ip", "-n", self.name, "-j", "link", "show", "type", "bridge").stdout
        return {lk["ifname"] for lk in json.loads(out or "[]")}

    def lock_path(self) -> str:
        from reconciler.engine.lock import LOCK_DIR

        return os.path.join(LOCK_DIR, f"netns-{os.stat(f'/run/netns/{self.name}').st_ino}.lock")


@pytest.fixture
def host() -> Iterator[Host]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    name = f"rt-{secrets.token_hex(4)}"
    sh("ip", "netns", "add", name)
    inode = os.stat(f"/run/netns/{name}").st_ino
    try:
        sh("ip", "-n", name, "link", "set", "lo", "up")
        yield Host(name)
    finally:
        sh("ip", "netns", "del", name, check=False)
        forget_run_files(inode)


class Agent:
    """One `reconcile watch` process; its log (JSON lines) is collected by a thread."""

    def __init__(self, host: Host, paths: list[str], *extra: str) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "reconciler", "--netns", host.name, "watch", *paths,
               "--status-addr", self.addr, "--log-format", "json", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=ENV, cwd=REPO, start_new_session=True)
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


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    """Start agents; every one is stopped (or killed) when the test ends, pass or fail."""
    started: list[Agent] = []

    def start(host: Host, paths: list[str], *extra: str) -> Agent:
        a = Agent(host, paths, *extra)
        started.append(a)
        return a

    try:
        yield start
    finally:
        for a in started:
            a.kill()


def confdir(tmp_path: Any) -> str:
    d = os.path.join(str(tmp_path), "conf")
    os.makedirs(d, mode=0o755, exist_ok=True)
    os.chmod(d, 0o755)
    return d


# --------------------------------------------------------------------------- tests


def test_edit_is_applied_and_status_metrics_health_are_served(host: Host, agents: Any,
                                                                tmp_path: Any) -> None:
    d = confdir(tmp_path)
    f = os.path.join(d, "net.yaml")
    write(f, bridge_yaml("rtw0", 1400))
    agent = agents(host, [d])
    agent.converged()
    assert host.mtu("rtw0") == 1400

    write(f, bridge_yaml("rtw0", 1450))
    wait_for(lambda: host.mtu("rtw0") == 1450, 10, what="mtu 1450")
    doc = agent.wait_status(lambda d: "files changed" in (d["last_pass"] or {}).get("reasons", [])
                            or d["pass_count"] >= 3, what="the edit's pass")
    assert doc["revision"]["files_sha256"]
    assert doc["config_error"] is None and doc["state"] == "running"
    metrics = agent.get("/metrics")
    assert "reconciler_changes_applied_total" in metrics
    changes = [ln for ln in metrics.splitlines()
               if ln.startswith("reconciler_changes_applied_total")]
    assert float(changes[0].split()[-1]) >= 4
    assert agent.get("/healthz").strip() == "ok"

    out = subprocess.run([sys.executable, "-m", "reconciler", "status", "--addr", agent.addr],
                         capture_output=True, text=True, env=ENV, cwd=REPO, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "last pass: #" in out.stdout and d in out.stdout
    assert agent.stop() == 0


def test_invalid_edit_keeps_state_and_shows_the_error(host: Host, agents: Any,
                                                      tmp_path: Any) -> None:
    d = confdir(tmp_path)
    a, b = os.path.join(d, "a.yaml"), os.path.join(d, "b.yaml")
    write(a, bridge_yaml("rtw1", 1400))
    write(b, bridge_yaml("rtw2", 1400, cidr="10.78.0.0/24"))
    agent = agents(host, [d])
    agent.converged()
    assert {"rtw1", "rtw2"} <= host.bridges()

    # b.yaml broken: rtw2 must not be pruned, and the error names the file and line
    write(b, "version: 1\nbridges:\n  - name: rtw2\n    mtu: lots\n")
    doc = agent.wait_status(lambda d: d.get("config_error"), what="the config error")
    assert f"{b}:4" in doc["config_error"]["message"], doc["config_error"]
    out = subprocess.run([sys.executable, "-m", "reconciler", "status", "--addr", agent.addr],
                         capture_output=True, text=True, env=ENV, cwd=REPO, timeout=30)
    assert out.returncode == 1 and f"{b}:4" in out.stdout
    time.sleep(1.0)
    assert {"rtw1", "rtw2"} <= host.bridges()
    assert any(f"{b}:4" in r["msg"] for r in agent.logs() if r["level"] == "error")

    # drift while the files are broken is still healed, against the last good state
    sh("ip", "-n", host.name, "link", "del", "rtw2")
    wait_for(lambda: "rtw2" in host.bridges(), 10, what="rtw2 healed")

    # a fix clears the error; deleting a file on purpose prunes what it declared
    write(b, bridge_yaml("rtw2", 1400, cidr="10.78.0.0/24"))
    agent.wait_status(lambda d: d.get("config_error") is None, what="the error to clear")
    os.unlink(b)
    wait_for(lambda: "rtw2" not in host.bridges(), 10, what="rtw2 pruned")
    assert "rtw1" in host.bridges()
    assert agent.stop() == 0


def test_git_checkout_of_another_commit_is_applied_once(host: Host, agents: Any,
                                                        tmp_path: Any) -> None:
    repo = confdir(tmp_path)
    git = ("git", "-c", "user.name=t", "-c", "user.email=t@example.invalid",
           "-c", "commit.gpgsign=false")
    sh(*git, "init", "-q", "-b", "main", cwd=repo)
    write(os.path.join(repo, "a.yaml"), bridge_yaml("rtg0", 1400))
    for i in range(5):  # many files change at once on checkout
        write(os.path.join(repo, f"x{i}.yaml"), "version: 1\n")
    sh(*git, "add", ".", cwd=repo)
    sh(*git, "commit", "-q", "-m", "one", cwd=repo)
    first = sh("git", "rev-parse", "HEAD", cwd=repo).stdout.strip()
    write(os.path.join(repo, "a.yaml"), bridge_yaml("rtg0", 1450))
    for i in range(5):
        write(os.path.join(repo, f"x{i}.yaml"), f"version: 1\n# {i}\n")
    sh(*git, "commit", "-q", "-am", "two", cwd=repo)
    second = sh("git", "rev-parse", "HEAD", cwd=repo).stdout.strip()
    sh("git", "checkout", "-q", first, cwd=repo)

    agent = agents(host, [repo])
    doc = agent.converged()
    assert doc["revision"]["commit"] == first and doc["revision"]["dirty"] is False
    assert host.mtu("rtg0") == 1400

    sh("git", "checkout", "-q", second, cwd=repo)
    wait_for(lambda: host.mtu("rtg0") == 1450, 10, what="mtu 1450")
    agent.wait_status(lambda d: d["revision"]["commit"] == second, what="the new commit")
    time.sleep(1.5)  # let a second debounced pass happen if it were going to
    assert len(agent.passes("files changed")) == 1, agent.log_text()
    assert any(second[:12] in r["msg"] for r in agent.logs()), "the commit is in the logs"

    write(os.path.join(repo, "x0.yaml"), "version: 1\n# local edit\n")
    agent.wait_status(lambda d: d["revision"]["dirty"] is True, what="the dirty flag")
    assert agent.stop() == 0


def test_out_of_band_bridge_deletion_is_healed_quickly(host: Host, agents: Any,
                                                       tmp_path: Any) -> None:
    d = confdir(tmp_path)
    write(os.path.join(d, "a.yaml"), bridge_yaml("rtd0", 1400))
    agent = agents(host, [d], "--interval", "3600")  # only the netlink event can heal it
    agent.converged()
    sh("ip", "-n", host.name, "link", "del", "rtd0")
    t0 = time.monotonic()
    wait_for(lambda: host.mtu("rtd0") == 1400, 5, every=0.01, what="the bridge back")
    healed = time.monotonic() - t0
    assert healed < 2.0, f"healed in {healed:.2f}s"
    agent.wait_status(lambda d: d["pass_count"] >= 2, what="the healing pass")
    drift_lines = [ln for ln in agent.get("/metrics").splitlines()
                   if ln.startswith('reconciler_drift_events_total{source="netlink"}')]
    assert drift_lines and float(drift_lines[0].split()[-1]) >= 1
    # the echoes of our own changes cause at most a pass or two, then it is quiet
    counts: list[int] = []

    def quiet() -> bool:
        counts.append(agent.status()["pass_count"])  # type: ignore[index]
        return len(counts) > 10 and counts[-1] == counts[-11]

    wait_for(quiet, 10, every=0.1, what="passes to settle")
    time.sleep(1.5)
    assert agent.status()["pass_count"] == counts[-1]  # type: ignore[index]
    assert counts[-1] <= 5, agent.log_text()
    assert agent.stop() == 0


def test_iptables_drift_is_healed_by_the_periodic_resync(host: Host, agents: Any,
                                                         tmp_path: Any) -> None:
    d = confdir(tmp_path)
    write(os.path.join(d, "a.yaml"), bridge_yaml("rti0", 1400))
    agent = agents(host, [d], "--interval", "1")
    agent.converged()

    def forward_rules() -> str:
        return sh("ip", "netns", "exec", host.name, "iptables", "-S", "RECONCILER-FORWARD",
                  check=False).stdout

    assert "rti0" in forward_rules()
    sh("ip", "netns", "exec", host.name, "iptables", "-F", "RECONCILER-FORWARD")
    wait_for(lambda: "rti0" in forward_rules(), 10, what="the forward rule back")
    assert agent.stop() == 0


def _settled(agent: Any) -> int:
    """Wait until the agent's pass count stops moving (echoes of its own changes done)."""
    counts: list[int] = []

    def quiet() -> bool:
        counts.append(agent.status()["pass_count"])
        return len(counts) > 10 and counts[-1] == counts[-11]

    wait_for(quiet, 10, every=0.1, what="passes to settle")
    return counts[-1]


def test_iptables_nft_flush_is_healed_by_the_nftables_event(host: Host, agents: Any,
                                                            tmp_path: Any) -> None:
    """iptables-nft: the commit's notification asks for the pass, not the interval."""
    if "nf_tables" not in sh("ip", "netns", "exec", host.name, "iptables", "-V").stdout:
        pytest.skip("iptables is not the nf_tables backend here")
    d = confdir(tmp_path)
    write(os.path.join(d, "a.yaml"), bridge_yaml("rtn0", 1400))
    agent = agents(host, [d], "--interval", "3600")  # only an nf_tables event can heal it
    agent.converged()

    def forward_rules() -> str:
        return sh("ip", "netns", "exec", host.name, "iptables", "-S", "RECONCILER-FORWARD",
                  check=False).stdout

    for breaker in (("iptables", "-F", "RECONCILER-FORWARD"), ("nft", "flush", "ruleset")):
        n = _settled(agent)  # no pass of its own under way that could heal it by chance
        sh("ip", "netns", "exec", host.name, *breaker)
        assert "rtn0" not in forward_rules()
        wait_for(lambda: "rtn0" in forward_rules(), 10, every=0.02,
                 what=f"the forward rule back after {' '.join(breaker)}")
        agent.converged(after=n)
    healers = [r for r in agent.passes("nftables drift") if r.get("result") == "applied"]
    assert len(healers) >= 2, agent.log_text()
    # our own iptables-restore is heard too: its echo is a no-op pass, not a loop
    n = _settled(agent)
    time.sleep(1.5)
    assert agent.status()["pass_count"] == n, agent.log_text()  # type: ignore[index]
    assert agent.stop() == 0


def test_sigterm_mid_pass_exits_0_and_the_next_run_converges(host: Host, agents: Any,
                                                             tmp_path: Any) -> None:
    d = confdir(tmp_path)
    n = 200
    lines = ["version: 1", "bridges:"] + [f"  - name: rts{i}" for i in range(n)]
    lines += ["subnets:"] + [f"  - {{name: s{i}, bridge: rts{i}, cidr: 10.90.{i}.0/24}}"
                             for i in range(n)]
    f = os.path.join(d, "many.yaml")
    write(f, "\n".join(lines) + "\n")
    agent = agents(host, [d])
    wait_for(lambda: any("change(s) to apply" in r["msg"] for r in agent.logs()), 30,
             every=0.005, what="the first pass to start applying")
    wait_for(lambda: host.bridges(), 10, every=0.005, what="the first bridge")
    rc = agent.stop(signal.SIGTERM)
    assert rc == 0, agent.log_text()
    made = len(host.bridges())
    assert 0 < made < n, f"SIGTERM landed after the pass ({made} bridges)"
    results = [r for r in agent.logs() if "pass_number" in r]
    assert results and results[-1]["result"] == "interrupted", agent.log_text()

    r = reconcile(host.name, "apply", d)
    assert r.returncode == 0, r.stdout + r.stderr
    r = reconcile(host.name, "plan", d)
    assert r.returncode == 0 and "No changes." in r.stdout, r.stdout + r.stderr


def test_manual_apply_while_watching_is_serialised(host: Host, agents: Any,
                                                   tmp_path: Any) -> None:
    d = confdir(tmp_path)
    f = os.path.join(d, "a.yaml")
    write(f, bridge_yaml("rtl0", 1400))
    agent = agents(host, [d])
    agent.converged()
    # between passes the agent does not hold the lock
    r = reconcile(host.name, "apply", "--lock-timeout", "0", d)
    assert r.returncode == 0, r.stdout + r.stderr

    # someone else holds the lock: the agent's pass waits and changes nothing meanwhile
    os.makedirs(os.path.dirname(host.lock_path()), exist_ok=True)
    fd = os.open(host.lock_path(), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        write(f, bridge_yaml("rtl0", 1450))
        wait_for(lambda: any("waiting for the host lock" in r["msg"] for r in agent.logs()),
                 10, what="the agent to wait for the lock")
        time.sleep(0.5)
        assert host.mtu("rtl0") == 1400
        # a manual apply queues behind it too
        manual = subprocess.Popen(
            [sys.executable, "-m", "reconciler", "--netns", host.name, "apply",
             "--lock-timeout", "30", d], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=ENV, cwd=REPO)
        time.sleep(0.5)
        assert manual.poll() is None and host.mtu("rtl0") == 1400
    finally:
        os.close(fd)
    out, _ = manual.communicate(timeout=60)
    assert manual.returncode == 0, out
    wait_for(lambda: host.mtu("rtl0") == 1450, 10, what="mtu 1450")
    agent.converged()
    r = reconcile(host.name, "plan", d)
    assert r.returncode == 0, r.stdout + r.stderr
    assert agent.stop() == 0


def test_sighup_reloads_and_fleet_filter_applies_only_our_share(host: Host, agents: Any,
                                                                tmp_path: Any) -> None:
    d = confdir(tmp_path)
    write(os.path.join(d, "web.yaml"), "hosts: ['web-*']\n" + bridge_yaml("rtweb", 1400))
    write(os.path.join(d, "db.yaml"),
          "hosts: ['db-*']\n" + bridge_yaml("rtdb", 1400, cidr="10.79.0.0/24"))
    agent = agents(host, [d], "--hostname", "web-7")
    agent.converged()
    assert "rtweb" in host.bridges() and "rtdb" not in host.bridges()
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: agent.passes("SIGHUP"), 10, what="the SIGHUP pass")
    assert agent.stop(signal.SIGINT) == 0


def test_insecure_config_is_refused(host: Host, tmp_path: Any) -> None:
    d = confdir(tmp_path)
    f = os.path.join(d, "a.yaml")
    write(f, bridge_yaml("rtx0", 1400))
    os.chmod(f, 0o666)
    r = reconcile(host.name, "watch", d, "--status-addr", "off")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    assert "writable by group or others" in r.stderr and "--allow-insecure-config" in r.stderr
    assert host.bridges() == set()


def _docker_up() -> bool:
    try:
        return sh("docker", "info", "--format", "{{.ServerVersion}}", check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_alloc_veth_and_namespace_deletion_are_healed(host: Host, agents: Any,
                                                      tmp_path: Any) -> None:
    from reconciler.domain.ownership import alloc_veth_name

    d = confdir(tmp_path)
    alloc = f"{host.name}-a"
    write(os.path.join(d, "a.yaml"), bridge_yaml("rta0", 1500)
          + f"allocs:\n  - id: {alloc}\n    subnet: rta0-net\n")
    veth = alloc_veth_name(alloc)
    agent = agents(host, [d], "--interval", "3600")
    try:
        agent.converged()
        assert (host.link(veth) or {}).get("master") == "rta0"

        sh("ip", "-n", host.name, "link", "del", veth)
        wait_for(lambda: (host.link(veth) or {}).get("master") == "rta0", 5, every=0.01,
                 what="the alloc's veth back")

        n = agent.status()["pass_count"]  # type: ignore[index]
        sh("ip", "netns", "del", alloc)  # unmount only: no netlink event for this
        wait_for(lambda: os.path.exists(f"/run/netns/{alloc}"), 5, every=0.01,
                 what="the alloc's namespace back")
        agent.converged(after=n)
        assert agent.stop() == 0
        r = reconcile(host.name, "plan", d)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        agent.kill()
        reconcile(host.name, "destroy")
        sh("ip", "netns", "del", alloc, check=False)


@pytest.mark.docker
def test_docker_network_deletion_is_healed(host: Host, agents: Any, tmp_path: Any) -> None:
    if not _docker_up():
        pytest.skip("needs a running dockerd")
    d = confdir(tmp_path)
    net = f"{host.name}-d"
    write(os.path.join(d, "a.yaml"), f"version: 1\ndocker_networks:\n  - name: {net}\n")
    agent = agents(host, [d], "--interval", "3600")
    try:
        n = agent.converged(timeout=60)["pass_count"]
        sh("docker", "network", "rm", net)
        wait_for(lambda: sh("docker", "network", "inspect", net, check=False).returncode == 0,
                 15, every=0.05, what="the Docker network back")
        agent.converged(timeout=60, after=n)
        assert any("docker drift" in r.get("reasons", []) and r.get("result") == "applied"
                   for r in agent.logs()), agent.log_text()
        assert agent.stop() == 0
    finally:
        agent.kill()
        reconcile(host.name, "destroy")
        sh("docker", "network", "rm", net, check=False)
