"""Security against the real kernel: only declared ports are reachable, watch refuses
config others can write, the status endpoint listens on loopback by default.

All traffic goes to addresses inside the test's own namespaces.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, Netns, unique, write
from tests.figures import report
from tests.integration.traffic import HOST_IP, client_of, listening, scan

pytestmark = pytest.mark.root
BRIDGE = "rsec0"
SCAN_PORTS = list(range(1, 2001))


def test_only_declared_ports_are_reachable(host_ns: Netns, tmp_path, request):
    a, b = unique("s"), unique("s")
    cfg = write(tmp_path, "s.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: sec, bridge: {BRIDGE}, cidr: 10.212.0.0/24}}]
allocs:
  - id: {a}
    subnet: sec
    ports: [{{host: 1080, to: 80}}, {{host: auto, to: 81}}, {{host: 1443, to: 443, host_ip: 127.0.0.1}}]
  - {{id: {b}, subnet: sec}}
""")
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    rules = host_ns.iptables_save(4)
    auto = _auto_port(rules, a)
    # every port of both allocations listens, so only the firewall decides what is reachable
    inside = [22, 80, 81, 443, 8080, 1080, 1443, 2000]
    with client_of(host_ns) as client, listening(a, *inside), listening(b, *inside):
        ports = sorted(set(SCAN_PORTS) | {auto, 8080, 9000})
        t0 = time.monotonic()
        reachable = scan(client, HOST_IP, ports)
        took = time.monotonic() - t0
    report(request, f"scanned {len(ports)} tcp ports of the host address in {took:.1f}s: "
                    f"reachable {reachable} (declared 1080, auto {auto}; 1443 is 127.0.0.1-only)")
    assert reachable == sorted([1080, auto])


def _auto_port(rules: str, alloc: str) -> int:
    for line in rules.splitlines():
        if f"reconciler:alloc={alloc}" in line and "--to-destination" in line and \
                line.endswith(":81"):
            return int(line.split("--dport ")[1].split()[0])
    raise AssertionError(f"no auto port for {alloc}:\n{rules}")


def _watch(ns: Netns, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reconciler", "--netns", ns.name, "watch",
                           "--status-addr", "off", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def test_watch_refuses_a_directory_others_can_write(host_ns: Netns, tmp_path):
    d = tmp_path / "conf"
    d.mkdir()
    write(str(d), "a.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    os.chmod(d / "a.yaml", 0o644)
    for mode in (0o777, 0o775):
        os.chmod(d, mode)
        r = _watch(host_ns, str(d))
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert "writable by group or others" in r.stderr, r.stderr
    assert host_ns.link(BRIDGE) is None


def test_watch_with_allow_insecure_config_starts(host_ns: Netns, tmp_path):
    f = write(str(tmp_path), "a.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    os.chmod(f, 0o666)
    p = subprocess.Popen([sys.executable, "-m", "reconciler", "--netns", host_ns.name, "watch",
                          "--status-addr", "off", "--allow-insecure-config", f],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while host_ns.link(BRIDGE) is None and time.monotonic() < deadline:
            assert p.poll() is None, p.stdout.read() if p.stdout else ""
            time.sleep(0.2)
        assert host_ns.link(BRIDGE) is not None
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    assert p.returncode == 0


def test_status_listens_on_loopback_by_default(host_ns: Netns, tmp_path):
    """The agent runs inside the sandbox with the default --status-addr: loopback only."""
    f = write(str(tmp_path), "a.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    p = subprocess.Popen(["nsenter", f"--net=/run/netns/{host_ns.name}", sys.executable, "-m",
                          "reconciler", "watch", "--no-docker-events", f],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        listeners: list[str] = []
        while time.monotonic() < deadline and not listeners:
            out = host_ns.run("ss", "-Hltn").stdout
            listeners = [ln.split()[3] for ln in out.splitlines() if ln.strip()]
            time.sleep(0.2)
        assert listeners == ["127.0.0.1:9477"], listeners
        with client_of(host_ns) as client:
            assert scan(client, HOST_IP, [9477]) == []
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
