"""A watched directory removed and made again in a loop stops nothing.

The agent keeps its last good state while the path is gone and reports it; it never
crashes and never prunes.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest

from tests.support.host import Netns, unique, write
from tests.support.localuser import Watch

pytestmark = pytest.mark.root


def _bridge_state(bridge: str) -> str:
    return f"version: 1\nbridges: [{{name: {bridge}}}]\n"



# ----------------------------------------------------------------- a vanishing directory


def test_a_watched_directory_removed_and_made_again_in_a_loop_stops_nothing(host_ns: Netns,
                                                                            tmp_path):
    """`rm -rf conf; mkdir conf` over and over: the agent keeps its last good state (the bridge
    stays), reports the missing files as a config error, never dies; once the directory is
    back with its file, a pass converges again."""
    bridge = unique("vb")
    conf = tmp_path / "conf"
    conf.mkdir(mode=0o755)
    write(conf, "a.yaml", _bridge_state(bridge))
    agent = Watch(host_ns, str(conf))
    stop = threading.Event()
    rounds = [0]

    def churn() -> None:
        shutil.rmtree(conf, ignore_errors=True)
        while not stop.is_set():
            try:
                os.mkdir(conf, 0o755)
                os.rmdir(conf)
            except OSError:
                pass
            rounds[0] += 1

    try:
        agent.converged()
        assert host_ns.link(bridge) is not None
        churner = threading.Thread(target=churn, daemon=True)
        churner.start()
        # many passes over the churning directory: SIGHUP asks for one at once (the file
        # events alone give one every few seconds, debounced)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and agent.proc.poll() is None:
            os.kill(agent.proc.pid, signal.SIGHUP)
            time.sleep(0.03)
        stop.set()
        churner.join()
        assert agent.proc.poll() is None, f"the agent died: {agent.output()}"
        assert host_ns.link(bridge) is not None, "the last good state was not kept"
        shutil.rmtree(conf, ignore_errors=True)
        conf.mkdir(mode=0o755)
        write(conf, "a.yaml", _bridge_state(bridge))
        agent.wait(lambda: not agent.status().get("config_error") and (
            agent.status().get("last_pass") or {}).get("result") in ("ok", "applied"),
            30, "a converged pass with the files back")
    finally:
        stop.set()
        out = agent.stop()
    assert rounds[0] > 100, rounds
    assert "internal error" not in out and "Traceback" not in out, out
    assert agent.proc.returncode == 0, out


