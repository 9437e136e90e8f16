"""The fleet (SPEC §10) with real tools: promtool, a Prometheus server, real agents.

- the shipped alert rules pass `promtool check rules`, and `promtool test rules` with
  series written here proves each alert fires when it should and not otherwise (and a
  rule file with a wrong threshold fails those tests: they can fail);
- `/metrics` of a running agent passes `promtool check metrics`, and every metric the
  rules name is one the agent exports (or one the safe-change seam adds);
- a real Prometheus server on 127.0.0.1 (its own port and storage) scrapes a running
  agent in a sandbox and evaluates the shipped rules to firing after an injected
  failure;
- `/readyz` of real agents on real git checkouts, and a rollout driven the way a
  DaemonSet with maxUnavailable 1 drives it stops at the first host a bad commit
  breaks, while the hosts after it keep the old revision, ready.

Every namespace is a throwaway one of its own (conftest.host_ns); Prometheus and the
agents are stopped in a finally, killed if they do not stop; all traffic is loopback.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from tests.support.agent import Agent, agent_env, free_port
from tests.support.host import REPO, Netns, sh, unique, wait_for

RULES = os.path.join(REPO, "examples", "prometheus", "reconciler-alerts.yaml")
#: metrics the rules may name that a helper of safe change adds (the agreed seam), and
#: Prometheus's own
SEAM = {"reconciler_reverts_total", "reconciler_pending_change", "up"}


def tool(name: str) -> str:
    """The path of a Prometheus tool; CI installs them (scripts/install.sh --test)."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed: scripts/install.sh --test installs "
                        "Debian's prometheus package")
        pytest.skip(f"{name} not installed (apt-get install prometheus)")
    return path


def _rules() -> dict[str, Any]:
    with open(RULES) as fh:
        doc: dict[str, Any] = yaml.safe_load(fh)
    return doc


def _alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in _rules()["groups"] for r in g["rules"]}


# --------------------------------------------------------------------------- promtool


def test_promtool_checks_the_shipped_rules() -> None:
    p = subprocess.run([tool("promtool"), "check", "rules", RULES], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in p.stdout, p.stdout


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    lab = ",".join(f'{k}="{v}"' for k, v in sorted({"job": "reconciler", **labels}.items()))
    return {"series": f"{name}{{{lab}}}", "values": values}


def _expand(template: str, labels: dict[str, str], value: str) -> str:
    """The annotation as Prometheus renders it, for the few template forms the rules use
    (so that a broken template fails the test too)."""
    out = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)
    return re.sub(r"\{\{ \$value( \| humanizeDuration)? \}\}", value, out)


def _firing(name: str, at: str, *alerts: dict[str, str], value: str = "") -> dict[str, Any]:
    """``name`` fires at ``at`` for exactly these label sets; ``value``: how the alert's
    value reads in its annotations."""
    rule = _alerts()[name]
    severity = rule["labels"]["severity"]
    return {"eval_time": at, "alertname": name, "exp_alerts": [
        {"exp_labels": {"severity": severity, **a},
         "exp_annotations": {k: _expand(v, a, value) for k, v in rule["annotations"].items()}}
        for a in alerts]}


H1 = {"job": "reconciler", "instance": "h1:9477"}
H2 = {"job": "reconciler", "instance": "h2:9477"}

#: one minute per sample; h1 is the host that goes wrong, h2 (and h3) the ones that do not
UNIT_TESTS = {
    "input_series": [
        _series("up", "1 1 0x20", instance="h1:9477"),
        _series("up", "1x22", instance="h2:9477"),
        _series("reconciler_ready", "1 1 0x20", instance="h1:9477"),
        _series("reconciler_ready", "0 0 1x20", instance="h2:9477"),  # ready after start
        # converged once at minute 1, never again; h2 converges every minute
        _series("reconciler_last_success_timestamp_seconds", "0 60x40", instance="h1:9477"),
        _series("reconciler_last_success_timestamp_seconds", "0+60x40", instance="h2:9477"),
        _series("reconciler_probe_failures", "0 0 1x20", instance="h1:9477", alloc="web",
                path="gateway"),
        _series("reconciler_probe_failures", "0 0 1x20", instance="h1:9477", alloc="web",
                path="hairpin"),
        _series("reconciler_probe_failures", "0 1 0x20", instance="h2:9477", alloc="db",
                path="host"),  # a blip, gone in a minute: no alert
        _series("reconciler_reverts_total", "0 0 0 1x40", instance="h1:9477"),
        _series("reconciler_reverts_total", "0x40", instance="h2:9477"),
        _series("reconciler_address_overlaps", "0 2x20", instance="h1:9477"),
        _series("reconciler_address_overlaps", "0x20", instance="h2:9477"),
        # h2 moves to a commit an hour newer at minute 5; h1 stays; h3 is no git checkout
        _series("reconciler_revision_timestamp_seconds", "1700000000x60", instance="h1:9477"),
        _series("reconciler_revision_timestamp_seconds", "1700000000x4 1700003600x55",
                instance="h2:9477"),
        _series("reconciler_revision_timestamp_seconds", "0x60", instance="h3:9477"),
    ],
    "alert_rule_test": [
        {"eval_time": "5m", "alertname": "ReconcilerAgentDown", "exp_alerts": []},
        _firing("ReconcilerAgentDown", "8m", H1),
        {"eval_time": "9m", "alertname": "ReconcilerNotReady", "exp_alerts": []},
        _firing("ReconcilerNotReady", "13m", H1),
        {"eval_time": "15m", "alertname": "ReconcilerDriftNotHealed", "exp_alerts": []},
        _firing("ReconcilerDriftNotHealed", "25m", H1, value="24m 0s"),
        {"eval_time": "5m", "alertname": "ReconcilerProbesFailing", "exp_alerts": []},
        _firing("ReconcilerProbesFailing", "8m", {**H1, "alloc": "web"}, value="2"),
        {"eval_time": "2m", "alertname": "ReconcilerReverted", "exp_alerts": []},
        _firing("ReconcilerReverted", "4m", H1),
        _firing("ReconcilerReverted", "30m", H1),
        {"eval_time": "40m", "alertname": "ReconcilerReverted", "exp_alerts": []},
        {"eval_time": "4m", "alertname": "ReconcilerAddressOverlap", "exp_alerts": []},
        _firing("ReconcilerAddressOverlap", "7m", H1, value="2"),
        {"eval_time": "20m", "alertname": "ReconcilerRevisionBehindFleet", "exp_alerts": []},
        _firing("ReconcilerRevisionBehindFleet", "40m", H1, value="1h 0m 0s"),
    ],
}


def _promtool_test(tmp_path: Any, rules: str) -> subprocess.CompletedProcess[str]:
    tests = dict(UNIT_TESTS, interval="1m")
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [rules], "evaluation_interval": "1m",
                                    "tests": [tests]}, sort_keys=False))
    return subprocess.run([tool("promtool"), "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=120)


def test_promtool_unit_tests_every_alert(tmp_path: Any) -> None:
    tested = {t["alertname"] for t in UNIT_TESTS["alert_rule_test"]}  # type: ignore[index]
    assert tested == set(_alerts()), "every shipped alert has a case here"
    p = _promtool_test(tmp_path, RULES)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout, p.stdout


@pytest.mark.parametrize(("old", "new", "alert"), [
    ("> 1800", "> 7200", "ReconcilerRevisionBehindFleet"),  # an hour behind would pass
    ("reconciler_ready == 0", "reconciler_ready < 0", "ReconcilerNotReady"),
    ("sum by (job, instance, alloc)", "sum by (job, instance, alloc, path)",
     "ReconcilerProbesFailing"),  # one alert per path would be noisier and differently labelled
])
def test_the_rule_tests_catch_a_wrong_rule(tmp_path: Any, old: str, new: str,
                                           alert: str) -> None:
    with open(RULES) as fh:
        text = fh.read()
    assert old in text
    broken = tmp_path / "broken.yaml"
    broken.write_text(text.replace(old, new))
    p = _promtool_test(tmp_path, str(broken))
    assert p.returncode != 0 and alert in p.stdout + p.stderr, p.stdout + p.stderr


# --------------------------------------------------------------------------- a running agent


def bridge_file(name: str, cidr: str) -> str:
    return (f"version: 1\nbridges:\n  - name: {name}\n"
            f"subnets:\n  - name: {name}-net\n    bridge: {name}\n    cidr: {cidr}\n")


def confdir(tmp_path: Any) -> str:
    d = os.path.join(str(tmp_path), "conf")
    os.makedirs(d, mode=0o755, exist_ok=True)
    os.chmod(str(tmp_path), 0o755)
    os.chmod(d, 0o755)
    return d


def put(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o644)


def foreign_link(host: Netns) -> str:
    """A veth pair in the host that is not ours (someone's VPN or LAN link), up."""
    name = unique("v")
    sh("ip", "-n", host.name, "link", "add", name, "type", "veth", "peer", "name", name + "p")
    sh("ip", "-n", host.name, "link", "set", name, "up")
    sh("ip", "-n", host.name, "link", "set", name + "p", "up")
    return name


def a_cidr() -> str:
    return f"10.{random.randint(100, 199)}.{random.randint(0, 255)}.0/24"


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    started: list[Agent] = []

    def start(host: Netns, paths: list[str], *extra: str) -> Agent:
        a = Agent(host, paths, *extra)  # type: ignore[arg-type]
        started.append(a)
        return a

    try:
        yield start
    finally:
        for a in started:
            a.kill()


def get(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as exc:
        return 0, str(exc)


def metric_names(text: str) -> set[str]:
    """Names of the samples, and of the families declared (a labelled gauge with no
    child yet, e.g. no probe failing, has only its ``# TYPE`` line)."""
    names = set()
    for ln in text.splitlines():
        if ln.startswith("# TYPE "):
            names.add(ln.split()[2])
        elif ln and not ln.startswith("#"):
            names.add(ln.split("{", 1)[0].split(" ", 1)[0])
    return names


@pytest.mark.root
def test_metrics_of_a_running_agent_pass_promtool_check_metrics(host_ns: Netns, agents: Any,
                                                                tmp_path: Any) -> None:
    d = confdir(tmp_path)
    put(os.path.join(d, "net.yaml"), bridge_file(unique("b")[-12:], a_cidr()))
    agent = agents(host_ns, [d], "--interval", "3600")
    agent.converged()
    code, body = get(f"http://{agent.addr}/metrics")
    assert code == 200
    p = subprocess.run([tool("promtool"), "check", "metrics"], input=body, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr
    exported = metric_names(body)
    assert {"reconciler_ready", "reconciler_revision_timestamp_seconds"} <= exported
    named = {tok for r in _alerts().values()
             for tok in re.findall(r"\b(?:reconciler_\w+|up)\b", r["expr"])}
    assert named - SEAM <= exported, f"rules name metrics the agent lacks: {named - exported}"
    assert agent.stop() == 0


class Prometheus:
    """A real Prometheus server on 127.0.0.1 (its own port, storage in tmp) with the
    shipped rules, every ``for:`` cut to 0s so that a test need not wait minutes; the
    expressions are the shipped ones, unchanged."""

    def __init__(self, tmp_path: Any, targets: list[str]) -> None:
        rules = _rules()
        for g in rules["groups"]:
            for r in g["rules"]:
                r["for"] = "0s"
        os.makedirs(tmp_path / "prom", exist_ok=True)
        (tmp_path / "prom" / "rules.yaml").write_text(yaml.safe_dump(rules))
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                             "scrape_timeout": "1s"},
                  "rule_files": [str(tmp_path / "prom" / "rules.yaml")],
                  "scrape_configs": [{"job_name": "reconciler",
                                      "static_configs": [{"targets": targets}]}]}
        cfg = tmp_path / "prom" / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        check = subprocess.run([tool("promtool"), "check", "config", str(cfg)],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp_path / "prom" / "log", "w+")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={cfg}",
             f"--storage.tsdb.path={tmp_path / 'prom' / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def logs(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def api(self, path: str) -> Any:
        assert self.proc.poll() is None, f"prometheus exited:\n{self.logs()}"
        code, body = get(self.base + path)
        if code != 200:
            return None
        return json.loads(body)["data"]

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for(lambda: self.proc.poll() is None and get(self.base + "/-/ready")[0] == 200,
                 timeout, every=0.2, what="prometheus ready")

    def firing(self) -> set[str]:
        data = self.api("/api/v1/alerts") or {"alerts": []}
        return {a["labels"]["alertname"] for a in data["alerts"] if a["state"] == "firing"}

    def value(self, query: str) -> float | None:
        data = self.api("/api/v1/query?query=" + urllib.request.quote(query))
        if not data or not data["result"]:
            return None
        return float(data["result"][0]["value"][1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.mark.root
def test_a_real_prometheus_fires_the_shipped_rules_after_an_injected_failure(
        host_ns: Netns, agents: Any, tmp_path: Any) -> None:
    d = confdir(tmp_path)
    br, cidr = unique("b")[-12:], a_cidr()
    put(os.path.join(d, "net.yaml"), bridge_file(br, cidr))
    agent = agents(host_ns, [d], "--interval", "3600")
    agent.converged()
    wait_for(lambda: get(f"http://{agent.addr}/readyz")[0] == 200, 15, what="ready")
    prom = Prometheus(tmp_path, [agent.addr])
    try:
        prom.wait_ready()
        # scraped, evaluated, nothing firing while the host is good
        wait_for(lambda: prom.value('reconciler_ready{job="reconciler"}') == 1.0, 60,
                 every=0.5, what="prometheus to scrape a ready agent")
        wait_for(lambda: prom.value("ALERTS") is None or not prom.firing(), 30, every=0.5,
                 what="no alert firing on a good host")
        time.sleep(3)  # three more evaluations
        assert prom.firing() == set(), prom.firing()

        # the failure: someone's route into the prefix the reconciler owns (a VPN, a LAN)
        link = foreign_link(host_ns)
        half = str(next(ipaddress.IPv4Network(cidr).subnets(new_prefix=25)))
        sh("ip", "-n", host_ns.name, "route", "add", half, "dev", link)
        agent.proc.send_signal(signal.SIGHUP)  # a pass now, not at the next resync
        # SPEC §11: a conflicting resource is blocked, and readiness names it and why
        agent.wait_status(lambda s: (s.get("last_pass") or {}).get("result") == "blocked",
                          what="the pass to see the conflict")
        code, reason = get(f"http://{agent.addr}/readyz")
        assert code == 503 and "blocked" in reason and f"subnet/{br}-net" in reason \
            and f"overlaps route {half}" in reason, reason
        want = {"ReconcilerAddressOverlap", "ReconcilerNotReady"}
        try:
            wait_for(lambda: want <= prom.firing(), 60, every=0.5, what="the alerts to fire")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: firing {prom.firing()}\n{prom.logs()}") from None
        assert prom.firing() == want, prom.firing()  # and nothing else

        # gone again: the next pass converges, the alerts resolve
        sh("ip", "-n", host_ns.name, "route", "del", half, "dev", link)
        agent.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: get(f"http://{agent.addr}/readyz")[0] == 200, 30, what="ready again")
        wait_for(lambda: not prom.firing(), 60, every=0.5, what="the alerts to resolve")
    finally:
        prom.stop()
        assert agent.stop() == 0


# --------------------------------------------------------------------------- readiness, rollout


GIT = ("git", "-c", "user.name=t", "-c", "user.email=t@example.invalid",
       "-c", "commit.gpgsign=false")


def commit(repo: str, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        put(os.path.join(repo, name), text)
    subprocess.run([*GIT, "add", "-A"], cwd=repo, check=True, timeout=30)
    subprocess.run([*GIT, "commit", "-q", "-m", message], cwd=repo, check=True, timeout=30)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, timeout=30,
                          capture_output=True, text=True).stdout.strip()


def checkout(repo: str, rev: str) -> None:
    subprocess.run(["git", "checkout", "-q", rev], cwd=repo, check=True, timeout=30)


def status_json(agent: Agent) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "reconciler", "status", "--addr", agent.addr,
                        "--output", "json"], capture_output=True, text=True, timeout=30,
                       env=agent_env(), cwd=REPO)
    doc: dict[str, Any] = json.loads(p.stdout)
    return doc


@pytest.mark.root
def test_readyz_of_a_real_agent_follows_its_pinned_revision(host_ns: Netns, agents: Any,
                                                            tmp_path: Any) -> None:
    repo = confdir(tmp_path)
    subprocess.run([*GIT, "init", "-q", "-b", "main"], cwd=repo, check=True, timeout=30)
    br = unique("b")[-12:]
    good = commit(repo, {"net.yaml": bridge_file(br, a_cidr())}, "good")
    other = commit(repo, {"net.yaml": bridge_file(br, a_cidr()).replace(
        f"name: {br}\n", f"name: {br}\n    mtu: 1400\n", 1)}, "other")
    checkout(repo, good)
    agent = agents(host_ns, [repo], "--interval", "3600", "--expect-revision", good[:12])
    agent.converged()
    wait_for(lambda: get(f"http://{agent.addr}/readyz")[0] == 200, 15, what="ready")
    code, body = get(f"http://{agent.addr}/readyz")
    assert body.startswith(f"ready: {good[:12]} converged in pass #"), body
    doc = status_json(agent)  # the same verdict in the status document
    assert doc["ready"]["ready"] is True
    assert doc["ready"]["reason"].startswith(f"ready: {good[:12]} converged in pass #")
    assert doc["expected_revision"] == good[:12] and doc["revision"]["commit"] == good

    checkout(repo, other)  # moved behind the rollout's back: refused, not applied
    agent.wait_status(lambda s: s.get("config_error"), what="the refusal")
    code, body = get(f"http://{agent.addr}/readyz")
    assert code == 503 and body.strip() == (
        f"desired state at {other[:12]} not taken: revision {other[:12]} is not the expected "
        f"{good[:12]} (--expect-revision): refusing it; a new revision is a new rollout"), body
    assert get(f"http://{agent.addr}/healthz") == (200, "ok\n")  # alive: no restart loop
    link = host_ns.link(br)
    assert link is not None and link["mtu"] == 1500  # the other commit's 1400 never applied
    assert agent.stop() == 0


def quiet(agent: Agent, still: float = 1.0, timeout: float = 20.0) -> None:
    """Wait until the agent ran no pass for ``still`` seconds."""
    seen = {"count": -1, "since": time.monotonic()}

    def settled() -> bool:
        count = (agent.status() or {}).get("pass_count")
        if count != seen["count"]:
            seen.update(count=count, since=time.monotonic())
        return time.monotonic() - seen["since"] >= still

    wait_for(settled, timeout, every=0.1, what="the agent to be quiet")


@pytest.mark.root
def test_readyz_waits_for_the_pass_at_a_new_revision(host_ns: Netns, agents: Any,
                                                     tmp_path: Any) -> None:
    """The files move to a new commit while the host lock is held by someone else (the test),
    so the agent's pass at that commit starts, shows the commit, and cannot finish: /readyz
    must say 503 all that time (a rollout would otherwise move on to the next host), and 200
    only once that pass converged — checked against the bridge's MTU as `ip -j` shows it."""
    from reconciler.engine.lock import LOCK_DIR

    repo = confdir(tmp_path)
    subprocess.run([*GIT, "init", "-q", "-b", "main"], cwd=repo, check=True, timeout=30)
    br, cidr = unique("b")[-12:], a_cidr()
    one = commit(repo, {"net.yaml": bridge_file(br, cidr)}, "one")
    two = commit(repo, {"net.yaml": bridge_file(br, cidr).replace(
        f"name: {br}\n", f"name: {br}\n    mtu: 1400\n", 1)}, "two: mtu 1400")
    checkout(repo, one)
    agent = agents(host_ns, [repo], "--interval", "3600")
    first = agent.converged()
    wait_for(lambda: get(f"http://{agent.addr}/readyz")[0] == 200, 15, what="ready")
    code, body = get(f"http://{agent.addr}/readyz")
    assert body.startswith(f"ready: {one[:12]} converged in pass #"), body
    link = host_ns.link(br)
    assert link is not None and link["mtu"] == 1500
    quiet(agent)  # the echoes of the first apply are done: the next pass is the checkout's

    lock = os.path.join(LOCK_DIR, f"netns-{os.stat(f'/run/netns/{host_ns.name}').st_ino}.lock")
    os.makedirs(LOCK_DIR, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        checkout(repo, two)
        wait_for(lambda: any("waiting for the host lock" in str(r.get("msg"))
                             for r in agent.logs()), 15, what="the pass at two to wait")
        # (an echo of our own changes may have run a no-op pass at `one` after the first)
        waiting = re.compile(rf"the pass at {two[:12]} has not finished yet \(pass #(\d+) "
                             rf"was at {one[:12]}\)")
        for _ in range(5):  # asked again and again while that pass waits: never ready
            code, body = get(f"http://{agent.addr}/readyz")
            m = waiting.fullmatch(body.strip())
            assert code == 503 and m, (body, agent.status())
            assert int(m.group(1)) >= first["last_pass"]["number"]
            time.sleep(0.2)
        doc = status_json(agent)
        assert doc["ready"]["ready"] is False
        assert doc["revision"]["commit"] == two, doc  # the pass at `two` runs ...
        assert doc["last_pass"]["revision"]["commit"] == one, doc  # ... `one`'s finished
        link = host_ns.link(br)
        assert link is not None and link["mtu"] == 1500  # nothing of `two` applied yet
    finally:
        os.close(fd)  # releases the lock: the pass goes on
    wait_for(lambda: get(f"http://{agent.addr}/readyz")[0] == 200, 30, what="ready at two")
    code, body = get(f"http://{agent.addr}/readyz")
    assert body.startswith(f"ready: {two[:12]} converged in pass #"), body
    link = host_ns.link(br)
    assert link is not None and link["mtu"] == 1400
    assert agent.stop() == 0


def _rollout(hosts: list[tuple[Netns, str]], rev: str, agents: Any,
             running: dict[str, Agent], deadline: float) -> list[str]:
    """What a DaemonSet with maxUnavailable 1 does: replace one host's agent by one that
    expects ``rev`` (git-sync checks it out first), wait for /readyz, only then the next.
    Returns the hosts done; stops at the first that does not get ready in time."""
    done = []
    for host, repo in hosts:
        assert running[host.name].stop() == 0
        checkout(repo, rev)
        a = agents(host, [repo], "--interval", "3600", "--probe-interval", "off",
                   "--expect-revision", rev)
        running[host.name] = a
        try:
            wait_for(lambda a=a: get(f"http://{a.addr}/readyz")[0] == 200, deadline,
                     every=0.2, what="ready")
        except AssertionError:
            return done
        done.append(host.name)
    return done


@pytest.fixture
def three_hosts() -> Iterator[list[Netns]]:
    names = [unique(f"h{i}") for i in range(3)]
    inodes = []
    try:
        for n in names:
            sh("ip", "netns", "add", n)
            sh("ip", "-n", n, "link", "set", "lo", "up")
            inodes.append(os.stat(f"/run/netns/{n}").st_ino)
        yield [Netns(n) for n in names]
    finally:
        from tests.support.host import forget_run_files

        for n in names:
            sh("ip", "netns", "del", n, check=False)
        for i in inodes:
            forget_run_files(i)


@pytest.mark.root
def test_a_bad_commit_stops_the_rollout_at_the_first_host(three_hosts: list[Netns],
                                                          agents: Any, tmp_path: Any) -> None:
    """Three hosts, one repo (a clone per host, as git-sync makes). The new commit moves the
    subnet onto a prefix that the first host routes elsewhere (someone's VPN): there the
    pass conflicts, the host is not ready, and the rollout goes no further — the other
    two keep the old revision, converged and ready."""
    origin = confdir(tmp_path)
    subprocess.run([*GIT, "init", "-q", "-b", "main"], cwd=origin, check=True, timeout=30)
    br = unique("b")[-12:]
    old_cidr, new_cidr = a_cidr(), a_cidr()
    while ipaddress.ip_network(new_cidr).overlaps(ipaddress.ip_network(old_cidr)):
        new_cidr = a_cidr()
    old = commit(origin, {"net.yaml": bridge_file(br, old_cidr)}, "old")
    new = commit(origin, {"net.yaml": bridge_file(br, new_cidr)}, "new: renumber")
    hosts = []
    running: dict[str, Agent] = {}
    for i, h in enumerate(three_hosts):
        clone = os.path.join(str(tmp_path), f"clone{i}")
        subprocess.run(["git", "clone", "-q", origin, clone], check=True, timeout=60)
        os.chmod(clone, 0o755)
        checkout(clone, old)
        hosts.append((h, clone))
        running[h.name] = agents(h, [clone], "--interval", "3600", "--probe-interval", "off",
                                 "--expect-revision", old)
    for h, _ in hosts:
        running[h.name].converged()
    first = hosts[0][0]
    sh("ip", "-n", first.name, "route", "add", new_cidr, "dev", foreign_link(first))

    done = _rollout(hosts, new, agents, running, deadline=15)
    assert done == [], done  # stopped at the first host
    a = running[first.name]
    code, reason = get(f"http://{a.addr}/readyz")
    # SPEC §11: the conflicting subnet is blocked; readiness names it and the foreign route
    assert code == 503 and "blocked" in reason and f"subnet/{br}-net" in reason \
        and f"overlaps route {new_cidr}" in reason, reason
    addrs = first.addrs(br)
    assert not any(ipaddress.ip_interface(x) in ipaddress.ip_network(new_cidr)
                   for x in addrs), addrs  # nothing of the new revision was applied there
    for h, _ in hosts[1:]:  # untouched by the rollout: old revision, ready
        doc = running[h.name].status() or {}
        assert doc["revision"]["commit"] == old and doc["ready"]["ready"] is True, doc
        assert get(f"http://{running[h.name].addr}/readyz")[0] == 200
    for a in running.values():
        assert a.stop() == 0
