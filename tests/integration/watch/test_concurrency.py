"""Concurrent writers: two applies with allocations at once, and an apply while the watch
agent reconciles the same files — serialised by the host lock, final state correct.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support.cli import Result
from tests.support.host import REPO, SESSION, Netns, unique, write

sys.path.insert(0, REPO)
from bench.soak_crash import Config, Host, leaks  # noqa: E402

pytestmark = pytest.mark.root
BRIDGE = "rcon0"


def state(tmp_path: object, ids: tuple[str, ...], name: str = "s.yaml") -> Config:
    lines = ["version: 1", f"bridges: [{{name: {BRIDGE}}}]",
             f"subnets: [{{name: con, bridge: {BRIDGE}, cidr: 10.213.0.0/24}}]", "allocs:"]
    lines += [f"  - {{id: {a}, subnet: con, ports: [{{host: auto, to: 80}}]}}" for a in ids]
    return Config(write(tmp_path, name, "\n".join(lines) + "\n"), ids, ())


def no_leaks(ns: Netns, cfg: Config) -> None:
    h = Host.__new__(Host)
    h.name, h.prefix, h.inode = ns.name, f"{SESSION}w", os.stat(f"/run/netns/{ns.name}").st_ino
    assert leaks(h, cfg) == []
    r = ns.reconcile("plan", cfg.path)
    assert r.rc == 0, r.all


def test_two_applies_with_allocations_at_once(host_ns: Netns, tmp_path):
    cfg = state(tmp_path, tuple(unique("w") for _ in range(20)))
    results: list[Result] = []
    threads = [threading.Thread(target=lambda: results.append(host_ns.reconcile(
        "apply", "--lock-timeout", "120", cfg.path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.rc for r in results] == [0, 0], [r.all for r in results]
    # one did the work, the other found nothing left to do
    assert sorted("No changes." in r.out for r in results) == [False, True]
    no_leaks(host_ns, cfg)
    rules = host_ns.firewall_text(4)
    assert host_ns.run("nft", "list", "tables").stdout.count("inet reconciler") == 1
    assert all(rules.count(f"reconciler:alloc={a}\"") == 1 for a in cfg.allocs), rules


def test_apply_during_watch_is_serialised(host_ns: Netns, tmp_path):
    d = tmp_path / "conf"
    d.mkdir()
    first = tuple(unique("w") for _ in range(5))
    cfg = state(str(d), first)
    agent = subprocess.Popen([sys.executable, "-m", "reconciler", "--netns", host_ns.name,
                              "watch", "--status-addr", "off", "--interval", "1",
                              "--debounce", "0.1", "--no-docker-events", str(d)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while host_ns.reconcile("plan", cfg.path).rc != 0:
            assert time.monotonic() < deadline and agent.poll() is None
            time.sleep(0.3)
        # an edit the agent picks up, and a manual apply of the same files, racing
        more = first + tuple(unique("w") for _ in range(10))
        cfg = state(str(d), more)
        r = host_ns.reconcile("apply", "--lock-timeout", "120", str(d))
        assert r.rc == 0, r.all
        time.sleep(2.5)  # the agent's passes meanwhile (interval 1 s) must change nothing
        no_leaks(host_ns, cfg)
        assert agent.poll() is None
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            _out, err = agent.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            agent.kill()
            _out, err = agent.communicate()
    assert agent.returncode == 0, err[-2000:]
    assert "Traceback" not in err
