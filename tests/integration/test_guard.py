"""Guard rails against the real kernel (issue 15 items 4 and 6), each test in its own sandbox.

Files for other hosts never prune, ``--adopt`` says what it deletes and refuses the
namespace the reconciler runs in, deletions check the mark on the object itself, and
``destroy`` asks on a terminal. Results are read with ``ip -j`` and ``/proc``, never
with our own observer.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.conftest import REPO, Netns, unique, write
from tests.integration.test_watch import Host, agents, confdir, host, wait_for
from tests.integration.test_watch import write as save

pytestmark = pytest.mark.root

__all__ = ["agents", "host"]  # fixtures used by the watch test below

BRIDGE = "version: 1\nbridges: [{name: %s, mtu: 1400}]\n"


# ------------------------------------------------------------------ hosts: patterns


def test_files_for_other_hosts_prune_nothing_in_plan_and_apply(host_ns: Netns,
                                                               tmp_path: Any) -> None:
    br = "rg" + unique()[-6:]
    mine = write(tmp_path, "mine.yaml", BRIDGE % br)
    assert host_ns.reconcile("apply", mine).rc == 0
    assert host_ns.link(br) is not None
    other = write(tmp_path, "other.yaml", "hosts: ['db-*']\n" + BRIDGE % br)
    for command in ("plan", "apply"):
        r = host_ns.reconcile(command, other, "--hostname", "web-1", "--no-agent"
                              if command == "plan" else "--no-probe")
        assert r.rc == 1, r.all
        assert r.err.count("\n") == 1 and r.err.startswith("error: "), r.err
        assert "db-*" in r.err and "'web-1'" in r.err and "other.yaml" in r.err
        assert host_ns.link(br) is not None, f"{command} pruned the bridge"
    # the deliberate way to empty a host still works
    empty = write(tmp_path, "empty.yaml", "version: 1\nhosts: ['web-*']\nbridges: []\n")
    r = host_ns.reconcile("apply", other, empty, "--hostname", "web-1")
    assert r.rc == 0, r.all
    assert host_ns.link(br) is None


def test_watch_keeps_the_last_good_state_when_no_file_is_for_this_host(
        host: Host, agents: Any, tmp_path: Any) -> None:
    d = confdir(tmp_path)
    f = os.path.join(d, "net.yaml")
    save(f, "hosts: ['web-*']\n" + BRIDGE % "rtgw0")
    agent = agents(host, [d], "--hostname", "web-3")
    agent.converged()
    assert host.mtu("rtgw0") == 1400
    save(f, "hosts: ['web1-*']\n" + BRIDGE % "rtgw0")  # a typo in the pattern
    doc = agent.wait_status(lambda s: s.get("config_error"), what="the config error")
    assert "web1-*" in doc["config_error"]["message"]
    assert "'web-3'" in doc["config_error"]["message"]
    time.sleep(1.0)  # a pass or two more: nothing may be pruned
    assert host.mtu("rtgw0") == 1400
    assert any("web1-*" in ln for ln in agent.lines), agent.log_text()
    save(f, "hosts: ['web-*']\nversion: 1\nbridges: []\n")  # on purpose
    wait_for(lambda: host.link("rtgw0") is None, 15, what="the bridge pruned on purpose")
    assert agent.stop() == 0
