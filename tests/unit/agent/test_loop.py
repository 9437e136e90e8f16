"""The watch agent's pass, driven with a fake Reconciler: last good state on an invalid
edit, pruning, dry run, the fleet filter, backoff, the host lock, interrupted changes,
and the overlap report."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import pytest

from reconciler.agent import status
from reconciler.domain.errors import ReconcilerError
from tests.support.agentfake import BR, replace_file


def test_pass_applies_then_keeps_last_good_on_invalid_edit(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    r = agent.run_pass(["startup"])
    assert r.result == "applied" and rec.live_mtu == {"br0": 1400}
    replace_file(conf / "a.yaml", "version: 1\nbridges:\n  - name: br0\n    mtu: [\n")
    r = agent.run_pass(["files changed"])
    assert r.result == "ok"  # still converging to the last good state
    doc = agent.board.snapshot()
    assert doc["config_error"]["message"].startswith(str(conf / "a.yaml") + ":")
    assert rec.live_mtu == {"br0": 1400}
    rec.live_mtu.clear()  # drift while the files are broken is still healed
    assert agent.run_pass(["netlink drift"]).result == "applied"
    assert rec.live_mtu == {"br0": 1400}
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1450))
    assert agent.run_pass(["files changed"]).result == "applied"
    assert rec.live_mtu == {"br0": 1450}
    assert agent.board.snapshot()["config_error"] is None


def test_config_made_writable_later_is_refused_like_an_invalid_edit(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    agent.run_pass(["startup"])
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=9000))
    os.chmod(conf / "a.yaml", 0o666)
    agent.run_pass(["files changed"])
    assert rec.live_mtu == {"br0": 1400}
    assert "writable by group or others" in agent.board.snapshot()["config_error"]["message"]


def test_deleting_a_file_prunes_what_it_declared(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    replace_file(conf / "b.yaml", BR.format(name="br1", mtu=1400))
    agent.run_pass(["startup"])
    assert set(rec.live_mtu) == {"br0", "br1"}
    os.unlink(conf / "b.yaml")
    assert agent.run_pass(["files changed"]).result == "applied"
    assert set(rec.live_mtu) == {"br0"}


def test_dry_run_reports_drift_and_changes_nothing(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    agent.options = dataclasses.replace(agent.options, dry_run=True)
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    r = agent.run_pass(["startup"])
    assert r.result == "drift" and rec.applied == [] and rec.live_mtu == {}
    assert not r.converged
    assert r.errors and r.errors[0]["resource"] == "bridge/br0", r.errors
    assert 'reconciler_passes_total{result="drift"} 1.0' in agent.metrics.render().decode()


def test_no_valid_state_yet_applies_nothing(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    replace_file(conf / "a.yaml", "version: 2\n")
    r = agent.run_pass(["startup"])
    assert r.result == "config-error" and rec.applied == []
    assert agent.board.snapshot()["config_error"]["message"]


def test_fleet_filter_by_hostname(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    replace_file(conf / "web.yaml", "hosts: ['web-*']\n" + BR.format(name="brweb", mtu=1400))
    replace_file(conf / "db.yaml", "hosts: ['db-*']\n" + BR.format(name="brdb", mtu=1400))
    agent.run_pass(["startup"])
    assert set(rec.live_mtu) == {"brweb"}


def test_failed_pass_reports_resource_errors_and_backs_off(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    rec.fail_apply = True
    r = agent.run_pass(["startup"])
    # a failed op blocks its resource alone, on a backoff of its own (SPEC §11): the
    # pass is not a failure that backs the whole agent off
    assert r.result == "blocked"
    assert r.errors == [{"resource": "bridge/br0", "error": "blocked: failed: EPERM"}]
    assert agent.board.snapshot()["errors"] == r.errors
    assert agent.board.snapshot()["blocked"] == [
        {"resource": "bridge/br0", "reason": "failed: EPERM", "by": None}]
    assert b"reconciler_blocked_resources 1.0" in agent.metrics.render()
    held = agent.backoffs.held(agent.clock())
    assert list(held) == ["bridge/br0"] and "failed 1 time(s)" in held["bridge/br0"]
    # the next pass leaves it alone until its backoff runs out, then tries it again
    rec.fail_apply = False
    again = agent.run_pass(["netlink drift"])
    assert again.result == "blocked" and rec.applied == [], again
    agent.backoffs.forget()
    assert agent.run_pass(["blocked retry"]).result == "applied"
    assert agent.board.snapshot()["blocked"] == []
    assert b"reconciler_blocked_resources 0.0" in agent.metrics.render()


def test_host_lock_is_taken_only_when_there_is_work(agent_env: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    agent, conf, rec = agent_env
    taken: list[int] = []
    real = agent._host_lock

    def spy() -> Any:
        taken.append(1)
        return real()

    monkeypatch.setattr(agent, "_host_lock", spy)
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    agent.run_pass(["startup"])
    agent.run_pass(["resync"])
    agent.run_pass(["netlink drift"])
    assert taken == [1]


def test_a_pass_finishes_interrupted_changes_under_the_lock_even_with_nothing_to_plan(
        agent_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replace killed after the network was re-created plans as "no changes": the pass
    must finish its journal anyway (under the host lock), and a --dry-run agent must not."""
    agent, conf, rec = agent_env
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    agent.run_pass(["startup"])
    taken: list[int] = []
    real = agent._host_lock

    def spy() -> Any:
        taken.append(len(rec.journals))
        return real()

    monkeypatch.setattr(agent, "_host_lock", spy)
    rec.journals = ["docker_network/n"]
    agent.options = dataclasses.replace(agent.options, dry_run=True)
    agent.run_pass(["resync"])
    assert rec.finished == [] and taken == []
    agent.options = dataclasses.replace(agent.options, dry_run=False)
    report = agent.run_pass(["docker drift"])
    assert rec.finished == ["docker_network/n"] and taken == [1]
    assert report.result == "ok"


def test_overlap_reports_reach_log_status_and_metric(agent_env: Any, caplog: Any) -> None:
    from reconciler.planner.hostspace import LiveOverlap

    agent, _conf, _fake = agent_env
    o = LiveOverlap("10.66.0.0/24 on br0", "route 10.66.0.0/25 on tun0")
    with caplog.at_level("INFO", logger="reconciler.watch"):
        agent.on_overlaps([o])
        agent.on_overlaps([o])  # the same again: no second warning, the same "since"
        first = agent.board.get("address_overlaps")
        agent.on_overlaps([])
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "route 10.66.0.0/25 on tun0 overlaps 10.66.0.0/24 on br0" \
        in warned[0].getMessage()
    assert [(d["owned"], d["foreign"]) for d in first] == [(o.owned, o.foreign)]
    assert any("no longer overlaps" in r.getMessage() for r in caplog.records)
    assert agent.board.get("address_overlaps") == []
    assert b"reconciler_address_overlaps 0.0" in agent.metrics.render()
    text = status.render({"address_overlaps": first, "last_pass": {}}, now=first[0]["since"] + 3)
    assert "address overlaps: 1 (foreign, left alone):" in text
    assert "route 10.66.0.0/25 on tun0 overlaps owned 10.66.0.0/24 on br0 (since 3s ago)" in text


def test_recovery_and_a_cleared_config_error_each_say_so_once(
        agent_env: Any, caplog: pytest.LogCaptureFixture) -> None:
    agent, conf, rec = agent_env
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    real = rec.plan

    def broken(desired: Any, options: Any) -> Any:
        raise ReconcilerError("the host cannot be read")

    rec.plan = broken
    assert agent.run_pass(["startup"]).result == "failed"
    agent.scheduler.record(False, 0.0)  # as the loop does after a failed pass
    agent.scheduler.record(False, 0.0)
    rec.plan = real
    with caplog.at_level(logging.INFO, logger="reconciler.watch"):
        assert agent.run_pass(["retry"]).result == "applied"
    said = [r.getMessage() for r in caplog.records]
    assert said.count("pass 2: recovered after 2 failed pass(es)") == 1, said
    agent.scheduler.record(True, 0.0)
    caplog.clear()
    replace_file(conf / "a.yaml", "version: 1\nbridges: [\n")
    agent.run_pass(["files changed"])  # the last good state is kept
    assert agent.board.get("config_error") is not None
    replace_file(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    with caplog.at_level(logging.INFO, logger="reconciler.watch"):
        agent.run_pass(["files changed"])
        agent.run_pass(["resync"])
    said = [r.getMessage() for r in caplog.records]
    assert sum("config error cleared" in m for m in said) == 1, said
    assert not any("recovered" in m for m in said), said
