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


# ------------------------------------------------------------------ destroy asks on a terminal


def _on_a_terminal(ns: str, *args: str, answer: str | None,
                   timeout: float = 60) -> tuple[int, str]:
    """Run the CLI with its stdin, stdout and stderr on a pty (a person at a terminal);
    type ``answer`` once it asks (None: the test expects no question). Returns (rc, screen)."""
    main, tty = pty.openpty()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "reconciler", "--netns", ns, *args],
                            stdin=tty, stdout=tty, stderr=tty, env=env, cwd=REPO,
                            start_new_session=True)
    os.close(tty)
    screen = b""
    typed = False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(main, 4096)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                if not chunk and proc.poll() is not None:
                    break
                screen += chunk
            elif proc.poll() is not None:
                break
            if answer is not None and not typed and b"Enter a value:" in screen:
                os.write(main, answer.encode() + b"\n")
                typed = True
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(main)
    return rc, screen.decode(errors="replace").replace("\r\n", "\n")


def test_destroy_asks_on_a_terminal_and_only_yes_goes_on(host_ns: Netns,
                                                          tmp_path: Any) -> None:
    br = "rg" + unique()[-6:]
    assert host_ns.reconcile("apply", write(tmp_path, "a.yaml", BRIDGE % br)).rc == 0
    rc, screen = _on_a_terminal(host_ns.name, "destroy", answer="no")
    assert rc == 1, screen
    assert f"- bridge {br}" in screen and "Only 'yes' will be accepted" in screen
    assert "cancelled" in screen
    assert host_ns.link(br) is not None
    rc, screen = _on_a_terminal(host_ns.name, "destroy", answer="yes")
    assert rc == 0, screen
    assert host_ns.link(br) is None


def test_destroy_never_asks_with_yes_or_without_a_terminal(host_ns: Netns,
                                                           tmp_path: Any) -> None:
    br = "rg" + unique()[-6:]
    f = write(tmp_path, "a.yaml", BRIDGE % br)
    assert host_ns.reconcile("apply", f).rc == 0
    rc, screen = _on_a_terminal(host_ns.name, "destroy", "--yes", answer=None)
    assert rc == 0 and "Enter a value" not in screen, screen
    assert host_ns.link(br) is None
    assert host_ns.reconcile("apply", f).rc == 0
    # a pipe (scripts, CI): stdin is not a terminal, nothing is asked, nothing waits
    p = subprocess.run([sys.executable, "-m", "reconciler", "--netns", host_ns.name, "destroy"],
                       input="", capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "Enter a value" not in p.stdout + p.stderr, p.stderr
    assert host_ns.link(br) is None
