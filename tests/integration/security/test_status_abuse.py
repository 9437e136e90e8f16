"""Nobody without root steers the agent's status: a squatter on its address, a flood of
clients from many loopback sources, values of root-only files in ``/status``.

Everything happens in the test's own namespaces, directories and ports; the unprivileged
user is ``nobody``; the only traffic goes to this machine's loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time

import pytest

from tests.support.agent import free_port as _free_port
from tests.support.figures import report
from tests.support.host import Netns, unique, write
from tests.support.localuser import NOBODY, PUBLIC_PYTHON, Watch
from tests.support.localuser import as_nobody as _as_nobody

pytestmark = pytest.mark.root


def _bridge_state(bridge: str) -> str:
    return f"version: 1\nbridges: [{{name: {bridge}}}]\n"



# ----------------------------------------------------------------- the log's rate

#: one connection per loopback source address, each sending a malformed request
SOURCES = r"""
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sent = 0
for i in range(n):
    src = f"127.{1 + i // 65000}.{(i // 250) % 256}.{1 + i % 250}"
    try:
        s = socket.socket()
        s.bind((src, 0))
        s.settimeout(3)
        s.connect((host, port))
        s.sendall(b"NOT HTTP\r\n\r\n")
        s.recv(1024)
        s.close()
        sent += 1
    except OSError:
        pass
print(sent, flush=True)
"""


def test_clients_from_many_loopback_sources_cannot_flood_the_log(host_ns: Netns, tmp_path,
                                                                 request):
    """An unprivileged process that uses another 127.x source per connection gets a bounded
    number of log lines in all, and a line says how many were held back."""
    n = 3000
    cfg = write(tmp_path, "s.yaml", _bridge_state(unique("lb")))
    agent = Watch(host_ns, cfg)
    try:
        agent.converged()
        host, port = agent.addr.split(":")
        flood = subprocess.run([PUBLIC_PYTHON, "-c", SOURCES, host, port, str(n)], user=NOBODY,
                               group=NOBODY, capture_output=True, text=True, cwd="/",
                               timeout=300)
        sent = int(flood.stdout.strip() or 0)
        assert sent >= n * 0.9, flood.stderr
        # the line that reports what was held back comes a second or so later
        with contextlib.suppress(AssertionError):
            agent.wait(lambda: any("suppressed" in ln for ln in agent.lines), 10,
                       "the line counting what was held back")
    finally:
        out = agent.stop()
    lines = [ln for ln in out.splitlines() if "status server:" in ln]
    report(request, f"{sent} malformed requests from {sent} loopback sources by uid {NOBODY}: "
                    f"{len(lines)} log lines about them")
    assert 0 < len(lines) <= 100, f"{len(lines)} lines: {lines[:3]} ... {lines[-3:]}"
    assert any("suppressed" in ln for ln in lines), lines
    assert "Traceback" not in out


# ----------------------------------------------------------------- no values in /status

FETCH = r"""
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for path in sys.argv[2:]:
    try:
        with opener.open(f"http://{sys.argv[1]}{path}", timeout=10) as r:
            print(r.read().decode())
    except urllib.error.HTTPError as exc:
        print(exc.read().decode())
"""


def test_status_shows_anyone_where_a_config_error_is_never_the_files_values(host_ns: Netns,
                                                                          tmp_path):
    """The files are root's alone (0600 in a 0700 directory); an invalid edit must not reach
    uid nobody through /status or /readyz on loopback: positions and key paths only."""
    bridge = unique("sb")
    conf = tmp_path / "conf"
    conf.mkdir(mode=0o700)
    path = write(conf, "a.yaml", _bridge_state(bridge))
    os.chmod(path, 0o600)
    agent = Watch(host_ns, str(conf))
    try:
        agent.converged()
        with open(path, "w") as fh:
            fh.write(f'version: 1\nbridges:\n  - {{name: {bridge}, mtu: "s3cr3t-mtu"}}\n')
        agent.wait(lambda: agent.status().get("config_error"), 30, "the config error")
        seen = _as_nobody(FETCH, agent.addr, "/status", "/readyz")
    finally:
        agent.stop()
    assert seen.returncode == 0, seen.stderr
    assert "s3cr3t" not in seen.stdout, seen.stdout
    assert re.search(re.escape(path) + r":3:\d+: bridges\[0\]\.mtu: must be of type integer",
                     seen.stdout), seen.stdout


# ----------------------------------------------------------------- the status address taken

#: a local user's server on the agent's status address: a forged "ready" to every request
SQUAT = r"""
import json, socket, sys
doc = json.dumps({"pid": 1, "hostname": "forged", "state": "running",
                  "last_pass": {"result": "ok", "number": 1}, "errors": [],
                  "ready": {"ready": True, "reason": "ready: forged"}}).encode()
s = socket.socket()
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(16)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(2)
    try:
        c.recv(4096)
        c.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + doc)
    except OSError:
        pass
    c.close()
"""


def test_a_squatter_on_the_status_address_neither_stops_the_agent_nor_speaks_for_it(
        host_ns: Netns, tmp_path):
    """uid nobody binds the status address first and answers "ready" to everyone. The agent
    starts and heals all the same, ``reconcile status`` gets the real agent's answer from its
    root-only socket, refuses the squatter's over TCP naming it, and once the squatter is
    gone the agent takes its address back."""
    bridge = unique("qb")
    cfg = write(tmp_path, "s.yaml", _bridge_state(bridge))
    port = _free_port()
    addr = f"127.0.0.1:{port}"
    squatter = subprocess.Popen([PUBLIC_PYTHON, "-c", SQUAT, "127.0.0.1", str(port)],
                                user=NOBODY, group=NOBODY, stdout=subprocess.PIPE, text=True,
                                cwd="/")
    agent = None
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "listening\n"
        agent = Watch(host_ns, cfg, addr=addr)
        deadline = time.monotonic() + 60
        while host_ns.link(bridge) is None and agent.proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert agent.proc.poll() is None, f"the agent did not start: {agent.output()}"
        assert host_ns.link(bridge) is not None, "the agent did not heal anything"
        mine = host_ns.reconcile("status", "--output", "json")
        assert mine.rc in (0, 1), mine.all
        doc = json.loads(mine.out)
        assert doc["pid"] == agent.proc.pid and doc["hostname"] != "forged", mine.out
        ready = host_ns.reconcile("status", "--probe", "readyz")
        assert "forged" not in ready.all, ready.all
        forged = host_ns.reconcile("status", "--addr", addr)
        assert forged.rc == 1 and forged.err.count("\n") == 1, forged.all
        assert f"held by uid {NOBODY}" in forged.err and f"pid {squatter.pid}" in forged.err, \
            forged.err
        squatter.kill()
        squatter.wait()
        agent.wait(lambda: agent.get("/healthz") == (200, "ok\n"), 120,
                   "the agent on its address once the squatter is gone")
        back = host_ns.reconcile("status", "--addr", addr, "--output", "json")
        assert json.loads(back.out)["pid"] == agent.proc.pid, back.all
    finally:
        if squatter.poll() is None:
            squatter.kill()
            squatter.wait()
        out = agent.stop() if agent is not None else ""
    assert "Traceback" not in out, out


