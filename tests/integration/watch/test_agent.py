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
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.agent import agent_env, bridge_yaml, confdir
from tests.support.host import REPO, Netns, sh, unique, wait_for
from tests.support.host import save as write
from tests.support.traffic import HOST_IP, client_of, fetch, serving

pytestmark = pytest.mark.root


# --------------------------------------------------------------------------- tests


def test_edit_is_applied_and_status_metrics_health_are_served(host_ns: Netns, agents: Any,
                                                                tmp_path: Any) -> None:
    d = confdir(tmp_path)
    f = os.path.join(d, "net.yaml")
    write(f, bridge_yaml("rtw0", 1400))
    agent = agents(host_ns, [d])
    agent.converged()
    assert host_ns.mtu("rtw0") == 1400

    write(f, bridge_yaml("rtw0", 1450))
    wait_for(lambda: host_ns.mtu("rtw0") == 1450, 10, what="mtu 1450")
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
                         capture_output=True, text=True, env=agent_env(), cwd=REPO, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "last pass: #" in out.stdout and d in out.stdout
    assert agent.stop() == 0


def test_invalid_edit_keeps_state_and_shows_the_error(host_ns: Netns, agents: Any,
                                                      tmp_path: Any) -> None:
    d = confdir(tmp_path)
    a, b = os.path.join(d, "a.yaml"), os.path.join(d, "b.yaml")
    write(a, bridge_yaml("rtw1", 1400))
    write(b, bridge_yaml("rtw2", 1400, cidr="10.78.0.0/24"))
    agent = agents(host_ns, [d])
    agent.converged()
    assert {"rtw1", "rtw2"} <= host_ns.bridges()

    # b.yaml broken: rtw2 must not be pruned, and the error names the file and line
    write(b, "version: 1\nbridges:\n  - name: rtw2\n    mtu: lots\n")
    doc = agent.wait_status(lambda d: d.get("config_error"), what="the config error")
    assert f"{b}:4" in doc["config_error"]["message"], doc["config_error"]
    out = subprocess.run([sys.executable, "-m", "reconciler", "status", "--addr", agent.addr],
                         capture_output=True, text=True, env=agent_env(), cwd=REPO, timeout=30)
    assert out.returncode == 1 and f"{b}:4" in out.stdout
    time.sleep(1.0)
    assert {"rtw1", "rtw2"} <= host_ns.bridges()
    assert any(f"{b}:4" in r["msg"] for r in agent.logs() if r["level"] == "error")

    # drift while the files are broken is still healed, against the last good state
    sh("ip", "-n", host_ns.name, "link", "del", "rtw2")
    wait_for(lambda: "rtw2" in host_ns.bridges(), 10, what="rtw2 healed")

    # a fix clears the error; deleting a file on purpose prunes what it declared
    write(b, bridge_yaml("rtw2", 1400, cidr="10.78.0.0/24"))
    agent.wait_status(lambda d: d.get("config_error") is None, what="the error to clear")
    os.unlink(b)
    wait_for(lambda: "rtw2" not in host_ns.bridges(), 10, what="rtw2 pruned")
    assert "rtw1" in host_ns.bridges()
    assert agent.stop() == 0


def test_git_checkout_of_another_commit_is_applied_once(host_ns: Netns, agents: Any,
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

    agent = agents(host_ns, [repo])
    doc = agent.converged()
    assert doc["revision"]["commit"] == first and doc["revision"]["dirty"] is False
    assert host_ns.mtu("rtg0") == 1400

    sh("git", "checkout", "-q", second, cwd=repo)
    wait_for(lambda: host_ns.mtu("rtg0") == 1450, 10, what="mtu 1450")
    agent.wait_status(lambda d: d["revision"]["commit"] == second, what="the new commit")
    time.sleep(1.5)  # let a second debounced pass happen if it were going to
    assert len(agent.passes("files changed")) == 1, agent.log_text()
    assert any(second[:12] in r["msg"] for r in agent.logs()), "the commit is in the logs"

    write(os.path.join(repo, "x0.yaml"), "version: 1\n# local edit\n")
    agent.wait_status(lambda d: d["revision"]["dirty"] is True, what="the dirty flag")
    assert agent.stop() == 0


def test_out_of_band_bridge_deletion_is_healed_quickly(host_ns: Netns, agents: Any,
                                                       tmp_path: Any) -> None:
    d = confdir(tmp_path)
    write(os.path.join(d, "a.yaml"), bridge_yaml("rtd0", 1400))
    agent = agents(host_ns, [d], "--interval", "3600")  # only the netlink event can heal it
    agent.converged()
    sh("ip", "-n", host_ns.name, "link", "del", "rtd0")
    t0 = time.monotonic()
    wait_for(lambda: host_ns.mtu("rtd0") == 1400, 5, every=0.01, what="the bridge back")
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


#: the mark shim in another manager's dropping FORWARD, as ``iptables -S`` prints it (SPEC §12)
SHIM = ("-m", "mark", "--mark", "0x2000/0x2000", "-m", "comment", "--comment",
        "reconciler:shim", "-j", "ACCEPT")
SHIM_TEXT = ('-A FORWARD -m mark --mark 0x2000/0x2000 -m comment --comment "reconciler:shim" '
             "-j ACCEPT")


def _mapped_yaml(bridge: str, alloc: str) -> str:
    """A bridge, its subnet, and one allocation mapping host port 8080 to its port 80."""
    return (bridge_yaml(bridge, 1500) + f"allocs:\n  - id: {alloc}\n    subnet: {bridge}-net\n"
            "    ports: [{host: 8080, to: 80}]\n")


def _normal(value: Any) -> Any:
    """``nft -j`` output without the handles a rebuild renumbers, set elements in order."""
    if isinstance(value, dict):
        return {k: sorted((_normal(e) for e in v), key=json.dumps)
                if k == "elem" and isinstance(v, list) else _normal(v)
                for k, v in value.items() if k != "handle"}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _table(host: Netns) -> Any:
    """Our table as ``nft -j list table inet reconciler`` prints it (None: there is none)."""
    out = sh("ip", "netns", "exec", host.name, "nft", "-j", "list", "table", "inet",
             "reconciler", check=False)
    if out.returncode != 0:
        return None
    return [_normal(i) for i in json.loads(out.stdout)["nftables"] if "metainfo" not in i]


@contextlib.contextmanager
def _stopped(agent: Any) -> Iterator[None]:
    """The agent stopped (SIGSTOP) while a test breaks the host and sees it broken: the
    kernel queues the events on its sockets, and it hears them once continued."""
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)


def _healed_by(agent: Any, after: int, reason: str) -> None:
    """Wait for a converged pass after ``after``; one of those passes, asked for by
    ``reason``, applied the heal."""
    agent.converged(after=after)
    try:  # the pass's log line may come after its status
        wait_for(lambda: [r for r in agent.passes(reason)
                          if r["pass_number"] > after and r.get("result") == "applied"],
                 5, what=f"a pass for {reason} that applied")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agent.log_text()}") from None


def test_iptables_legacy_drift_is_healed_by_the_periodic_resync(host_ns: Netns, agents: Any,
                                                                tmp_path: Any) -> None:
    """iptables-legacy notifies nobody: the shim taken from its dropping FORWARD comes back
    at the resync, and with it the traffic of the port map."""
    if shutil.which("iptables-legacy") is None:
        pytest.skip("needs iptables-legacy")
    d, alloc = confdir(tmp_path), unique("a")
    write(os.path.join(d, "a.yaml"), _mapped_yaml("rti0", alloc))
    host_ns.run("iptables-legacy", "-P", "FORWARD", "DROP")
    agent = agents(host_ns, [d], "--interval", "1", "--probe-interval", "off")
    agent.converged()
    assert SHIM_TEXT in host_ns.run("iptables-legacy", "-S", "FORWARD").stdout
    with client_of(host_ns) as client, serving(alloc, (80,)):
        assert fetch(client, HOST_IP, 8080) == "ok 80"
        n = _settled(agent)
        with _stopped(agent):
            host_ns.run("iptables-legacy", "-D", "FORWARD", *SHIM)
            assert fetch(client, HOST_IP, 8080, timeout=1) == ""  # the legacy DROP stops it
        _healed_by(agent, n, "resync")
        assert SHIM_TEXT in host_ns.run("iptables-legacy", "-S", "FORWARD").stdout
        assert fetch(client, HOST_IP, 8080) == "ok 80"
    assert agent.stop() == 0


def _settled(agent: Any) -> int:
    """Wait until the agent's pass count stops moving (echoes of its own changes done)."""
    counts: list[int] = []

    def quiet() -> bool:
        counts.append(agent.status()["pass_count"])
        return len(counts) > 10 and counts[-1] == counts[-11]

    wait_for(quiet, 10, every=0.1, what="passes to settle")
    return counts[-1]


#: what breaks our table, each heard as an nf_tables commit (SPEC §12)
TABLE_BREAKERS = (
    ("flush", "table", "inet", "reconciler"),
    ("delete", "element", "inet", "reconciler", "pm4_addr", "{ tcp . 8080 }"),
    ("flush", "ruleset"),
    ("delete", "table", "inet", "reconciler"),
)


def test_nftables_drift_is_healed_at_the_nf_tables_event(host_ns: Netns, agents: Any,
                                                         tmp_path: Any) -> None:
    """Our table broken (flushed, a port map's element deleted, the ruleset flushed, the
    table deleted) and, with iptables-nft, the shim's FORWARD made to drop or the shim
    deleted: the commit's notification asks for the pass, not the interval, and the
    table comes back as it was, traffic with it."""
    d, alloc = confdir(tmp_path), unique("a")
    write(os.path.join(d, "a.yaml"), _mapped_yaml("rtn0", alloc))
    # only an nf_tables event can heal it: no resync, no probe timer
    agent = agents(host_ns, [d], "--interval", "3600", "--probe-interval", "off")
    agent.converged()
    table = _table(host_ns)
    assert table and any("rtn0" in json.dumps(i) for i in table), table
    with client_of(host_ns) as client, serving(alloc, (80,)):
        assert fetch(client, HOST_IP, 8080) == "ok 80"
        for breaker in TABLE_BREAKERS:
            n = _settled(agent)  # no pass of its own under way that could heal it by chance
            with _stopped(agent):
                host_ns.run("nft", *breaker)
                assert _table(host_ns) != table, breaker
                assert fetch(client, HOST_IP, 8080, timeout=1) == "", breaker
            _healed_by(agent, n, "nftables drift")
            assert _table(host_ns) == table, breaker
            assert fetch(client, HOST_IP, 8080) == "ok 80", breaker
        if "nf_tables" in host_ns.run("iptables", "-V").stdout:
            # another manager's FORWARD starts dropping (dockerd's policy): the shim goes
            # there at once; then someone deletes the shim: back at once
            for breaker in (("-P", "FORWARD", "DROP"), ("-D", "FORWARD", *SHIM)):
                n = _settled(agent)
                with _stopped(agent):
                    host_ns.run("iptables", *breaker)
                    assert fetch(client, HOST_IP, 8080, timeout=1) == "", breaker
                _healed_by(agent, n, "nftables drift")
                assert SHIM_TEXT in host_ns.run("iptables", "-S", "FORWARD").stdout
                assert fetch(client, HOST_IP, 8080) == "ok 80", breaker
        # our own commits are heard too: their echo is a no-op pass, not a loop (other
        # events, a link's, may still ask for a pass: only nf_tables drift is counted)
        _settled(agent)
        heard = _drift_events(agent, "nftables")
        assert heard >= len(TABLE_BREAKERS), agent.get("/metrics")
        time.sleep(1.5)
        assert _drift_events(agent, "nftables") == heard, agent.log_text()
    assert agent.stop() == 0


def _drift_events(agent: Any, source: str) -> float:
    """The agent's count of drift events from ``source``, from its /metrics."""
    for line in (agent.get("/metrics") or "").splitlines():
        if line.startswith(f'reconciler_drift_events_total{{source="{source}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_sigterm_mid_pass_exits_0_and_the_next_run_converges(host_ns: Netns, agents: Any,
                                                             tmp_path: Any) -> None:
    d = confdir(tmp_path)
    n = 200
    lines = ["version: 1", "bridges:"] + [f"  - name: rts{i}" for i in range(n)]
    lines += ["subnets:"] + [f"  - {{name: s{i}, bridge: rts{i}, cidr: 10.90.{i}.0/24}}"
                             for i in range(n)]
    f = os.path.join(d, "many.yaml")
    write(f, "\n".join(lines) + "\n")
    agent = agents(host_ns, [d])
    wait_for(lambda: any("change(s) to apply" in r["msg"] for r in agent.logs()), 30,
             every=0.005, what="the first pass to start applying")
    wait_for(lambda: host_ns.bridges(), 10, every=0.005, what="the first bridge")
    rc = agent.stop(signal.SIGTERM)
    assert rc == 0, agent.log_text()
    made = len(host_ns.bridges())
    assert 0 < made < n, f"SIGTERM landed after the pass ({made} bridges)"
    results = [r for r in agent.logs() if "pass_number" in r]
    assert results and results[-1]["result"] == "interrupted", agent.log_text()

    r = host_ns.reconcile("apply", d)
    assert r.rc == 0, r.out + r.err
    r = host_ns.reconcile("plan", d)
    assert r.rc == 0 and "No changes." in r.out, r.out + r.err


def test_manual_apply_while_watching_is_serialised(host_ns: Netns, agents: Any,
                                                   tmp_path: Any) -> None:
    d = confdir(tmp_path)
    f = os.path.join(d, "a.yaml")
    write(f, bridge_yaml("rtl0", 1400))
    agent = agents(host_ns, [d])
    agent.converged()
    # between passes the agent does not hold the lock
    r = host_ns.reconcile("apply", "--lock-timeout", "0", d)
    assert r.rc == 0, r.out + r.err

    # someone else holds the lock: the agent's pass waits and changes nothing meanwhile
    os.makedirs(os.path.dirname(host_ns.lock_path()), exist_ok=True)
    fd = os.open(host_ns.lock_path(), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        write(f, bridge_yaml("rtl0", 1450))
        wait_for(lambda: any("waiting for the host lock" in r["msg"] for r in agent.logs()),
                 10, what="the agent to wait for the lock")
        time.sleep(0.5)
        assert host_ns.mtu("rtl0") == 1400
        # a manual apply queues behind it too
        manual = subprocess.Popen(
            [sys.executable, "-m", "reconciler", "--netns", host_ns.name, "apply",
             "--lock-timeout", "30", d], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=agent_env(), cwd=REPO)
        time.sleep(0.5)
        assert manual.poll() is None and host_ns.mtu("rtl0") == 1400
    finally:
        os.close(fd)
    out, _ = manual.communicate(timeout=60)
    assert manual.returncode == 0, out
    wait_for(lambda: host_ns.mtu("rtl0") == 1450, 10, what="mtu 1450")
    agent.converged()
    r = host_ns.reconcile("plan", d)
    assert r.rc == 0, r.out + r.err
    assert agent.stop() == 0


def test_sighup_reloads_and_fleet_filter_applies_only_our_share(host_ns: Netns, agents: Any,
                                                                tmp_path: Any) -> None:
    d = confdir(tmp_path)
    write(os.path.join(d, "web.yaml"), "hosts: ['web-*']\n" + bridge_yaml("rtweb", 1400))
    write(os.path.join(d, "db.yaml"),
          "hosts: ['db-*']\n" + bridge_yaml("rtdb", 1400, cidr="10.79.0.0/24"))
    agent = agents(host_ns, [d], "--hostname", "web-7")
    agent.converged()
    assert "rtweb" in host_ns.bridges() and "rtdb" not in host_ns.bridges()
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: agent.passes("SIGHUP"), 10, what="the SIGHUP pass")
    assert agent.stop(signal.SIGINT) == 0


def test_insecure_config_is_refused(host_ns: Netns, tmp_path: Any) -> None:
    d = confdir(tmp_path)
    f = os.path.join(d, "a.yaml")
    write(f, bridge_yaml("rtx0", 1400))
    os.chmod(f, 0o666)
    r = host_ns.reconcile("watch", d, "--status-addr", "off")
    assert r.rc == 1
    assert r.err.count("\n") == 1 and r.err.startswith("error: ")
    assert "writable by group or others" in r.err and "--allow-insecure-config" in r.err
    assert host_ns.bridges() == set()


def _docker_up() -> bool:
    try:
        return sh("docker", "info", "--format", "{{.ServerVersion}}", check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_alloc_veth_and_namespace_deletion_are_healed(host_ns: Netns, agents: Any,
                                                      tmp_path: Any) -> None:
    from reconciler.domain.ownership import alloc_veth_name

    d = confdir(tmp_path)
    alloc = f"{host_ns.name}-a"
    write(os.path.join(d, "a.yaml"), bridge_yaml("rta0", 1500)
          + f"allocs:\n  - id: {alloc}\n    subnet: rta0-net\n")
    veth = alloc_veth_name(alloc)
    agent = agents(host_ns, [d], "--interval", "3600")
    try:
        agent.converged()
        assert (host_ns.link(veth) or {}).get("master") == "rta0"

        sh("ip", "-n", host_ns.name, "link", "del", veth)
        wait_for(lambda: (host_ns.link(veth) or {}).get("master") == "rta0", 5, every=0.01,
                 what="the alloc's veth back")

        n = agent.status()["pass_count"]  # type: ignore[index]
        sh("ip", "netns", "del", alloc)  # unmount only: no netlink event for this
        wait_for(lambda: os.path.exists(f"/run/netns/{alloc}"), 5, every=0.01,
                 what="the alloc's namespace back")
        agent.converged(after=n)
        assert agent.stop() == 0
        r = host_ns.reconcile("plan", d)
        assert r.rc == 0, r.out + r.err
    finally:
        agent.kill()
        host_ns.reconcile("destroy", "--yes")
        sh("ip", "netns", "del", alloc, check=False)


@pytest.mark.docker
def test_docker_network_deletion_is_healed(host_ns: Netns, agents: Any, tmp_path: Any) -> None:
    if not _docker_up():
        pytest.skip("needs a running dockerd")
    d = confdir(tmp_path)
    net = f"{host_ns.name}-d"
    write(os.path.join(d, "a.yaml"), f"version: 1\ndocker_networks:\n  - name: {net}\n")
    agent = agents(host_ns, [d], "--interval", "3600")
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
        host_ns.reconcile("destroy", "--yes")
        sh("docker", "network", "rm", net, check=False)
