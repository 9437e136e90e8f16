"""The watch agent under ``--confirm-within`` against the real kernel: it confirms a revision
whose probes hold, reverts one whose probes fail and keeps it out, waits for a namespace's
holders, and waits for an operator's pending change and reverts it when overdue."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import pytest

from tests.support.host import Netns, unique
from tests.support.safechange import (
    NAMES,
    PORT_B,
    apply_ok,
    config_after,
    diff,
    pending_record,
    read_text,
    reverts,
    settled,
    setup_change,
    state,
    wait_gone,
    window_agent,
)

pytestmark = pytest.mark.root


def test_watch_confirms_a_new_revision_whose_probes_hold(box: Netns, tmp_path: Any) -> None:
    a, b, before, _extra = setup_change(box, tmp_path)
    cfg = tmp_path / "cfg"
    cfg.mkdir(mode=0o755)
    (cfg / "hosts.yaml").write_text(read_text(a))
    agent = window_agent(box, str(cfg), "3s")
    try:
        settled(agent)
        (cfg / "hosts.yaml").write_text(read_text(b))
        doc = agent.wait_status(lambda d: d.get("pending") is not None, 20,
                                what="the new revision pending")
        assert doc["pending"]["revision"] and doc["pending"]["deadline"].endswith("Z")
        metrics = agent.get("/metrics")
        assert "reconciler_pending_change 1.0" in metrics, metrics
        doc = settled(agent)
        assert doc["reverted_revision"] is None
        assert "confirmed revision" in agent.log_text()
        changed = state(box)
        assert diff(changed, before)
        time.sleep(GRACE_CHECK)  # past the reverter's own deadline: it stays
        assert not diff(state(box), changed)
        assert pending_record(box) is None and reverts(box)["count"] == 0
        metrics = agent.get("/metrics")
        assert "reconciler_pending_change 0.0" in metrics
        assert "reconciler_reverts_total 0.0" in metrics
    finally:
        agent.stop()


#: the agent's grace (agent/safewatch.GRACE) and a little: the reverter's deadline is past
GRACE_CHECK = 11.0


def test_watch_reverts_a_revision_whose_probes_fail_and_keeps_it_out(box: Netns,
                                                                    tmp_path: Any) -> None:
    a, b, before, _extra = setup_change(box, tmp_path)
    cfg = tmp_path / "cfg"
    cfg.mkdir(mode=0o755)
    (cfg / "hosts.yaml").write_text(read_text(a))
    agent = window_agent(box, str(cfg), "30s")
    drop = ("-p", "tcp", "--dport", str(PORT_B), "-j", "DROP")
    try:
        settled(agent)
        # the new revision's port map will not answer
        box.run("iptables", "-t", "raw", "-I", "PREROUTING", *drop)
        box.run("iptables", "-t", "raw", "-I", "OUTPUT", *drop)
        (cfg / "hosts.yaml").write_text(read_text(b))
        doc = agent.wait_status(lambda d: d.get("reverted_revision") is not None, 40,
                                what="the revision reverted")
        assert doc["pending"] is None
        assert not diff(state(box), before), diff(state(box), before)
        assert reverts(box)["count"] == 1
        metrics = agent.get("/metrics")
        assert "reconciler_reverts_total 1.0" in metrics, metrics
        # not applied again while the files stay as they are
        agent.proc.send_signal(signal.SIGHUP)
        agent.wait_status(lambda d: "was reverted" in str((d.get("last_pass") or {})
                                                          .get("error")), 20,
                          what="the reverted revision held back")
        assert not diff(state(box), before)
        # the files change: applied (and confirmed later) again
        box.run("iptables", "-t", "raw", "-D", "PREROUTING", *drop)
        box.run("iptables", "-t", "raw", "-D", "OUTPUT", *drop)
        (cfg / "hosts.yaml").write_text(read_text(b) + "# fixed\n")
        agent.wait_status(lambda d: d.get("pending") is not None, 20, what="pending again")
        assert diff(state(box), before)
    finally:
        box.run("iptables", "-t", "raw", "-D", "PREROUTING", *drop, check=False)
        box.run("iptables", "-t", "raw", "-D", "OUTPUT", *drop, check=False)
        agent.stop()


@pytest.mark.parametrize("then", ["confirm", "revert"])
def test_deleting_a_namespace_processes_hold_waits_for_the_confirm(box: Netns, tmp_path: Any,
                                                                   then: str) -> None:
    """A namespace with a process in it cannot be deleted and brought back: within the
    window its veth is down and its rules gone; confirm deletes it, a revert undoes the
    rest."""
    alloc, extra = unique("s"), unique("s")
    NAMES[:] = [alloc, extra]
    both = config_after(tmp_path, alloc, extra)
    only = config_after(tmp_path, alloc, None, name="only.yaml")
    apply_ok(box, both)
    before = state(box)
    holder = subprocess.Popen(["ip", "netns", "exec", extra, "sleep", "600"])
    try:
        r = apply_ok(box, only, "--confirm-within", "5m")
        assert f"deleted at `reconcile --netns {box.name} confirm`" in r.out, r.out
        during = state(box)
        veth = next(n for n in before["links"] if n not in during["links"] or
                    during["links"][n]["up"] != before["links"][n]["up"])
        assert during["links"][veth]["up"] is False, during["links"][veth]
        assert extra in during["allocs"], "deleted although processes hold it"
        assert not any(f"alloc={extra}" in ln for ln in during["rules"][4])
        r = box.reconcile(then)
        assert r.rc == 0, r.all
        after = state(box)
        if then == "confirm":
            assert "Made the postponed change" in r.out, r.out
            assert extra not in after["allocs"] and veth not in after["links"]
            assert box.reconcile("plan", only, "--no-agent").rc == 0
        else:
            assert not diff(after, before), diff(after, before)
    finally:
        holder.kill()
        holder.wait()


def test_the_agent_waits_for_an_operators_pending_change_and_reverts_it_when_overdue(
        box: Netns, tmp_path: Any) -> None:
    """An operator's `apply --confirm-within` holds the agent back (its passes change
    nothing, naming the deadline); its reverter killed, the agent's held pass starts
    another, which reverts it at its deadline (or the agent's next pass, whichever comes
    first); then the agent converges on its files."""
    a, b, before, _extra = setup_change(box, tmp_path)
    cfg = tmp_path / "cfg"
    cfg.mkdir(mode=0o755)
    (cfg / "hosts.yaml").write_text(read_text(a))
    from tests.support.agent import Agent

    agent = Agent(box, [str(cfg)], "--interval", "3600",  # type: ignore[arg-type]
                  "--probe-interval", "off")
    try:
        agent.converged(30)
        apply_ok(box, b, "--confirm-within", "4s")
        rec = pending_record(box)
        assert rec is not None
        os.kill(rec["reverter_pid"], signal.SIGKILL)
        assert wait_gone(rec["reverter_pid"])
        changed = state(box)
        agent.proc.send_signal(signal.SIGHUP)
        doc = agent.wait_status(lambda d: (d.get("last_pass") or {}).get("result") == "pending"
                                and d.get("pending"), 20, what="the agent held back")
        assert "pending until" in doc["last_pass"]["error"], doc["last_pass"]
        assert not diff(state(box), changed), "the agent changed the host of a pending change"
        held = pending_record(box)
        assert held is not None
        time.sleep(max(0.0, held["deadline"] - time.time()) + 0.5)
        agent.proc.send_signal(signal.SIGHUP)
        agent.wait_status(lambda d: d.get("pending") is None and (d.get("last_pass") or {})
                          .get("result") in ("ok", "applied"), 30, what="reverted, converged")
        log = agent.log_text()
        assert "starting a new one" in log, log  # the held pass noticed the dead reverter
        assert not diff(state(box), before), diff(state(box), before)
        assert reverts(box)["count"] == 1 and pending_record(box) is None
    finally:
        agent.stop()
