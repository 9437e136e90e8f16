"""Readiness (`/readyz`, SPEC §10): the verdict, the agent that feeds it, the HTTP answer.

The engines that roll a revision out (a DaemonSet with maxUnavailable, a Nomad system
job with max_parallel) take the next host only when this one answers 200, so every
reason to answer 503 is pinned here on a fake reconciler; the real agent on a real
kernel is tests/integration/fleet/test_fleet.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from reconciler.agent import loop as loop_mod
from reconciler.agent import status
from reconciler.agent.loop import Agent
from reconciler.agent.passes import WatchOptions
from reconciler.agent.readiness import judge, same_revision
from reconciler.domain.probes import ProbeResult
from reconciler.engine import lock as lock_mod
from tests.support.agentfake import BR, FakeReconciler, replace_file, run_pass
from tests.support.host import REPO

REV_A = {"commit": "a" * 40, "dirty": False, "files_sha256": "f" * 64}
REV_B = {"commit": "b" * 40, "dirty": False, "files_sha256": "e" * 64}
GOOD = {"state": "running", "revision": REV_A,
        "config_error": None, "errors": [], "desired": {"allocs": 1},
        "last_pass": {"number": 3, "result": "ok", "error": None, "revision": REV_A},
        "probes": {"held": 2, "failed": 0, "failures": [], "revision": REV_A}}


def _with(**changes: Any) -> dict[str, Any]:
    return {**GOOD, **changes}


def test_a_converged_probed_pass_is_ready() -> None:
    v = judge(GOOD, probing=True)
    assert v.ready and v.reason == "ready: aaaaaaaaaaaa converged in pass #3, 2 probe(s) hold"


@pytest.mark.parametrize(("doc", "reason"), [
    (_with(state="starting", last_pass=None), "no pass has finished yet"),
    (_with(state="stopping"), "the agent is stopping"),
    (_with(config_error={"message": "/etc/r/a.yaml:3:5: bad\nmore", "since": 1,
                         "revision": {"commit": "b" * 40}}),
     "desired state at bbbbbbbbbbbb not taken: /etc/r/a.yaml:3:5: bad"),
    (_with(last_pass={"number": 4, "result": "failed", "error": "2 change(s) failed: x",
                      "revision": REV_A}),
     "pass #4 failed: 2 change(s) failed: x"),
    (_with(last_pass={"number": 4, "result": "failed", "error": "1 conflict(s) ...",
                      "revision": REV_A},
           errors=[{"resource": "subnet/net", "error": "conflict: 10.1.0.0/24 overlaps route "
                    "10.1.0.0/25 on tun0\nmore"}]),
     "pass #4 failed: subnet/net: conflict: 10.1.0.0/24 overlaps route 10.1.0.0/25 on tun0"),
    (_with(last_pass={"number": 4, "result": "drift", "error": None, "revision": REV_A},
           errors=[{"resource": "bridge/br0", "error": "differs"}]),
     "pass #4 found 1 difference(s) and --dry-run changes nothing"),
    (_with(last_pass={"number": 4, "result": "interrupted", "error": "stopped: 1 skipped",
                      "revision": REV_A}),
     "pass #4 interrupted: stopped: 1 skipped"),
    # the files moved on: the last pass that finished converged the old revision, and the
    # one at the new revision is still running (the loop sets `revision` when it starts)
    (_with(revision=REV_B),
     "the pass at bbbbbbbbbbbb has not finished yet (pass #3 was at aaaaaaaaaaaa)"),
    # a local edit of the same commit is another revision too (only the digest differs)
    (_with(revision={**REV_A, "dirty": True, "files_sha256": "d" * 64}),
     "the pass at aaaaaaaaaaaa-dirty-dddddddd has not finished yet (pass #3 was at "
     "aaaaaaaaaaaa)"),
    (_with(last_pass={"number": 3, "result": "ok", "error": None}),  # at no known revision
     "the pass at aaaaaaaaaaaa has not finished yet (pass #3 was at ?)"),
    # converged at the new revision, the probes that hold are the old revision's
    (_with(revision=REV_B, last_pass={"number": 4, "result": "ok", "revision": REV_B}),
     "pass #4 converged; its probes have not run yet"),
    (_with(probes={"held": 2, "failed": 0, "failures": []}),  # probes at no known revision
     "pass #3 converged; its probes have not run yet"),
    (_with(errors=[{"resource": "plan", "error": "warning-turned-error"}]),
     "pass #3: plan: warning-turned-error"),
    (_with(probes=None), "pass #3 converged; its probes have not run yet"),
    (_with(probes={"held": 1, "failed": 1, "revision": REV_A, "failures": [
        {"alloc": "web", "path": "gateway", "cause": "no route to 10.0.0.1"}]}),
     "1 probe(s) failing: alloc web path gateway: no route to 10.0.0.1"),
    # the seam with safe change (helper "revert"): these keys, absent = null
    (_with(pending={"deadline": "2026-12-01T14:00:00Z", "revision": "a" * 40}),
     "a change waits for confirmation (it is reverted unless confirmed by "
     "2026-12-01T14:00:00Z)"),
    (_with(reverted_revision="a" * 40),
     "revision aaaaaaaaaaaa was reverted on this host; roll out another revision"),
])
def test_every_reason_to_be_not_ready_is_one_line(doc: dict[str, Any], reason: str) -> None:
    v = judge(doc, probing=True)
    assert not v.ready and v.reason == reason and "\n" not in v.reason


def test_what_does_not_make_it_unready() -> None:
    assert judge(_with(probes=None), probing=False).ready  # --no-probe: nothing to wait for
    assert judge(_with(probes=None, desired={"allocs": 0}), probing=True).ready
    assert judge(_with(reverted_revision="c" * 40), probing=True).ready  # another revision
    assert judge(_with(pending=None, reverted_revision=None), probing=True).ready
    assert judge(_with(last_pass={"number": 5, "result": "applied", "revision": REV_A}),
                 probing=True).ready
    # the same revision read again (a resync) is the same: compared by commit, dirty flag
    # and the files' digest, not by the other keys
    assert judge(_with(revision={**REV_A, "committed_at": 1700000000, "toplevel": "/r"}),
                 probing=True).ready
    # failures an old revision's probes found do not count once no allocation is declared
    stale = {"held": 0, "failed": 1, "revision": REV_A,
             "failures": [{"alloc": "gone", "path": "gateway", "cause": "x"}]}
    assert judge(_with(revision=REV_B, desired={"allocs": 0}, probes=stale,
                       last_pass={"number": 4, "result": "ok", "revision": REV_B}),
                 probing=True).ready
    v = judge(GOOD, probing=True, alive=(False, "loop stuck for 300s"))
    assert not v.ready and v.reason == "the agent is not alive: loop stuck for 300s"


def test_same_revision_accepts_the_names_people_use() -> None:
    rev = {"commit": "0123456789abcdef0123456789abcdef01234567", "files_sha256": "e" * 64}
    for name in (rev["commit"], "0123456", "0123456789AB", "0123456789ab"):
        assert same_revision(rev, name), name
    for name in ("012345", "1123456789ab", "", "sha256:" + "e" * 64):
        assert not same_revision(rev, name), name
    files = {"files_sha256": "e" * 64}
    assert same_revision(files, "sha256:eeeeeeeeeeee") and same_revision(files, "e" * 64)
    assert not same_revision(files, "eeeeeee") and not same_revision(None, "x")


# --------------------------------------------------------------------------- the agent


def _git(repo: Any, *args: str, when: int | None = None) -> str:
    env = dict(os.environ)
    if when is not None:  # the commit time (%ct), which the revision gauge shows
        env["GIT_COMMITTER_DATE"] = f"@{when} +0000"
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid",
                           "-c", "commit.gpgsign=false", *args], cwd=repo, check=True,
                          capture_output=True, text=True, timeout=30, env=env).stdout.strip()


@pytest.fixture
def repo_agent(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An agent on a real git checkout (two commits) with a fake reconciler."""
    monkeypatch.setattr(lock_mod, "LOCK_DIR", str(tmp_path / "lock"))
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    replace_file(repo / "a.yaml", BR.format(name="br0", mtu=1400))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one", when=1700000000)
    first = _git(repo, "rev-parse", "HEAD")
    replace_file(repo / "a.yaml", BR.format(name="br0", mtu=1450))
    _git(repo, "commit", "-q", "-am", "two", when=1700000600)
    second = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", first)
    fakes: list[FakeReconciler] = []

    def make(stop: threading.Event) -> Any:
        fakes.append(FakeReconciler(stop))
        return fakes[-1]

    def build(**opts: Any) -> Agent:
        return Agent(WatchOptions(paths=(str(repo),), hostname="h", **opts),
                     reconciler_factory=make)

    return build, repo, first, second, fakes


def _metric(agent: Agent, name: str) -> float:
    for metric in agent.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name:
                return float(s.value)
    raise AssertionError(f"no sample {name}")


def test_ready_after_the_first_converged_pass(repo_agent: Any) -> None:
    build, repo, first, second, fakes = repo_agent
    agent = build(probe=None)
    v = agent.ready()
    assert not v.ready and v.reason == "no pass has finished yet"
    assert _metric(agent, "reconciler_ready") == 0.0
    agent.board.update(state="running")
    assert agent.run_pass(["startup"]).result == "applied"
    assert agent.ready().ready, agent.ready()
    assert _metric(agent, "reconciler_ready") == 1.0
    # the revision's commit time, which the fleet's alert compares (hashes have no order)
    assert _metric(agent, "reconciler_revision_timestamp_seconds") == 1700000000.0
    assert agent.board.get("revision")["committed_at"] == 1700000000
    _git(repo, "checkout", "-q", second)
    agent.run_pass(["files changed"])
    assert _metric(agent, "reconciler_revision_timestamp_seconds") == 1700000600.0
    fakes[-1].fail_apply = True
    replace_file(repo / "a.yaml", BR.format(name="br0", mtu=1500))  # dirty, and it cannot apply
    agent.run_pass(["files changed"])
    v = agent.ready()
    assert not v.ready and v.reason == "pass #3: 1 resource(s) blocked: bridge/br0: failed: EPERM", v
    assert _metric(agent, "reconciler_ready") == 0.0


def test_expect_revision_refuses_any_other_checkout(repo_agent: Any) -> None:
    build, repo, first, second, fakes = repo_agent
    agent = build(probe=None, expect_revision=second[:12])
    agent.board.update(state="running")
    r = agent.run_pass(["startup"])
    assert r.result == "config-error" and fakes[-1].applied == []  # the files are not read
    v = agent.ready()
    assert not v.ready
    assert v.reason == (f"desired state at {first[:12]} not taken: revision {first[:12]} is not "
                        f"the expected {second[:12]} (--expect-revision): refusing it; a new "
                        "revision is a new rollout"), v
    assert agent.board.get("expected_revision") == second[:12]
    _git(repo, "checkout", "-q", second)
    assert agent.run_pass(["files changed"]).result == "applied"
    assert fakes[-1].live_mtu == {"br0": 1450} and agent.ready().ready
    # a local edit is not exactly that revision: refused, the last good state is kept
    replace_file(repo / "a.yaml", BR.format(name="br0", mtu=9000))
    assert agent.run_pass(["files changed"]).result == "ok"
    assert fakes[-1].live_mtu == {"br0": 1450}
    v = agent.ready()
    assert not v.ready and "has local changes, so it is not exactly the expected" in v.reason
    # and a checkout moved back by hand is refused too (a moving branch would do this)
    _git(repo, "checkout", "-q", "--", "a.yaml")
    _git(repo, "checkout", "-q", first)
    agent.run_pass(["files changed"])
    assert fakes[-1].live_mtu == {"br0": 1450} and not agent.ready().ready


def test_expect_revision_outside_git_is_refused(tmp_path: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lock_mod, "LOCK_DIR", str(tmp_path / "lock"))
    conf = tmp_path / "conf"
    conf.mkdir()
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    agent = Agent(WatchOptions(paths=(str(conf),), hostname="h", probe=None,
                               expect_revision="0123456"),
                  reconciler_factory=FakeReconciler)
    assert agent.run_pass(["startup"]).result == "config-error"
    assert "the files are not in a git checkout" in agent.ready().reason
    assert _metric(agent, "reconciler_revision_timestamp_seconds") == 0.0


def test_not_ready_at_a_new_revision_until_a_pass_at_it_finished(repo_agent: Any) -> None:
    """The loop shows the new revision when its pass starts; the pass that finished before
    converged the old one, so /readyz must wait for this one (a rollout would otherwise
    take the next host while this one is still applying, or about to fail)."""
    build, repo, first, second, fakes = repo_agent
    agent = build(probe=None)
    agent.board.update(state="running")
    assert agent.run_pass(["startup"]).result == "applied"
    assert agent.ready().ready
    rec = fakes[-1]
    real = rec.apply
    during: list[Any] = []

    def apply(*args: Any, **kwargs: Any) -> Any:  # what /readyz answers while it applies
        during.append((agent.ready(), agent.board.get("revision")["commit"]))
        return real(*args, **kwargs)

    rec.apply = apply  # type: ignore[method-assign]
    _git(repo, "checkout", "-q", second)
    assert agent.run_pass(["files changed"]).result == "applied"
    assert rec.live_mtu == {"br0": 1450} and len(during) == 1
    verdict, shown = during[0]
    assert shown == second  # the status shows the revision being applied ...
    assert not verdict.ready and verdict.reason == (  # ... and that it is not done yet
        f"the pass at {second[:12]} has not finished yet (pass #1 was at {first[:12]})")
    v = agent.ready()
    assert v.ready and v.reason == f"ready: {second[:12]} converged in pass #2", v
    assert agent.board.get("last_pass")["revision"]["commit"] == second
    # a pass at the new revision that fails is not ready either, with its own reason
    rec.fail_apply = True
    _git(repo, "checkout", "-q", first)
    agent.run_pass(["files changed"])
    v = agent.ready()
    assert not v.ready and v.reason == "pass #3: 1 resource(s) blocked: bridge/br0: failed: EPERM", v


def _checkout_while_loading(monkeypatch: pytest.MonkeyPatch, repo: Any, rev: str) -> None:
    """The agent's next read of HEAD is followed by a checkout of ``rev`` before it reads
    the files: what a pass already under way (a drift echo, a resync) meets when git-sync
    or a deploy tool checks another commit out at that moment."""
    real = loop_mod.git_revision
    done: list[bool] = []

    def racing(paths: Any) -> Any:
        head = real(paths)
        if not done:
            done.append(True)
            _git(repo, "checkout", "-q", rev)
        return head

    monkeypatch.setattr(loop_mod, "git_revision", racing)


def test_a_checkout_under_way_is_not_taken_as_the_old_commit(
        repo_agent: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    build, repo, first, second, fakes = repo_agent
    agent = build(probe=None)
    agent.board.update(state="running")
    assert agent.run_pass(["startup"]).result == "applied"
    _checkout_while_loading(monkeypatch, repo, second)
    assert agent.run_pass(["resync"]).result == "applied"
    assert fakes[-1].live_mtu == {"br0": 1450}  # the second commit's files ...
    doc = agent.board.snapshot()  # ... are shown as the second commit's
    assert doc["revision"]["commit"] == doc["last_pass"]["revision"]["commit"] == second
    assert agent.ready().reason == f"ready: {second[:12]} converged in pass #2"


def test_a_checkout_under_way_does_not_slip_past_expect_revision(
        repo_agent: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    build, repo, first, second, fakes = repo_agent
    agent = build(probe=None, expect_revision=first[:12])
    agent.board.update(state="running")
    assert agent.run_pass(["startup"]).result == "applied" and agent.ready().ready
    _checkout_while_loading(monkeypatch, repo, second)
    agent.run_pass(["resync"])
    assert fakes[-1].live_mtu == {"br0": 1400}  # never the other commit's files
    v = agent.ready()
    assert not v.ready and v.reason.startswith(
        f"desired state at {second[:12]} not taken: revision {second[:12]} is not the "
        f"expected {first[:12]}"), v


def test_probes_of_an_older_revision_do_not_make_a_new_one_ready(
        probing_agent: Any, tmp_path: Any) -> None:  # noqa: F811 (the fixture)
    build, broken, prober = probing_agent
    agent = build()
    agent.board.update(state="running")
    run_pass(agent, "startup")
    assert agent.ready().ready
    files = tmp_path / "conf" / "a.yaml"  # probing_agent's files
    files.write_text(files.read_text().replace("{name: br0}", "{name: br0, mtu: 1400}"))
    report = agent.run_pass(["files changed"])  # converges, changes nothing, probes nothing
    assert report.result == "ok"
    v = agent.ready()
    assert not v.ready and v.reason == "pass #2 converged; its probes have not run yet", v
    calls = len(prober.calls)
    agent.after_probes(["files changed"], report)
    assert [c[0] for c in prober.calls[calls:]] == [None]  # every allocation, once
    doc = agent.board.snapshot()
    assert doc["probes"]["revision"] == doc["revision"] == doc["last_pass"]["revision"]
    assert agent.ready().ready, agent.ready()
    # at the same revision a pass probes only what its apply changed: here nothing
    calls = len(prober.calls)
    run_pass(agent, "resync")
    assert len(prober.calls) == calls and agent.ready().ready


def test_probes_gate_readiness(probing_agent: Any) -> None:  # noqa: F811 (the fixture)
    build, broken, prober = probing_agent
    agent = build()
    agent.board.update(state="running")
    report = agent.run_pass(["startup"])
    assert report.result == "ok"
    v = agent.ready()
    assert not v.ready and v.reason == "pass #1 converged; its probes have not run yet"
    agent.after_probes(["startup"], report)
    assert agent.ready().ready
    broken["a1"] = ProbeResult("a1", "host", "tcp", 8080, False, cause="a foreign DROP")
    run_pass(agent, "probe")
    v = agent.ready()
    assert not v.ready and v.reason == "1 probe(s) failing: alloc a1 path host: a foreign DROP"


# --------------------------------------------------------------------------- HTTP


def _get(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_readyz_answers_200_or_503_with_the_reason_and_healthz_is_unchanged(
        repo_agent: Any) -> None:
    build, repo, first, second, fakes = repo_agent
    agent = build(probe=None)
    sock = status.bind("127.0.0.1:0")
    srv = status.StatusServer(sock, agent.board, agent.metrics, agent.healthy,
                              ready=agent.ready)
    srv.start()
    base = f"http://{srv.address}"
    try:
        assert _get(base + "/readyz") == (503, "no pass has finished yet\n")
        assert _get(base + "/healthz") == (200, "ok\n")  # alive, not ready: the loop runs
        agent.board.update(state="running")
        agent.run_pass(["startup"])
        code, body = _get(base + "/readyz")
        assert code == 200 and body == f"ready: {first[:12]} converged in pass #1\n"
        doc = status.fetch(srv.address)
        assert doc["ready"] == {"ready": True, "reason": body.strip()}
        assert "reconciler_ready 1.0" in _get(base + "/metrics")[1]
        agent.board.update(pending={"deadline": "2026-12-01T14:00:00Z", "revision": None})
        code, body = _get(base + "/readyz")
        assert code == 503 and body.startswith("a change waits for confirmation")
        assert _get(base + "/readyz?verbose")[0] == 503
        assert "not ready: a change waits" in status.render(status.fetch(srv.address))
    finally:
        srv.close()


def test_expect_revision_must_be_a_commit_id(tmp_path: Any) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", "reconciler", "watch", str(conf),
                        "--status-addr", "off", "--expect-revision", "main"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        "error: --expect-revision 'main': expected a commit id (7 to 40 hex digits), not a "
        "branch or tag: a moving name would gate nothing"], p.stderr
