"""Running a workload in an allocation, each way docs/workloads.md gives (issue 27 item 7).

An allocation's namespace is a named one, /run/netns/ID: whatever joins it serves on
the allocation's address, and its port maps reach it. Each way starts the same tiny
server (busybox ``nc``) in the allocation and a client in the sandbox host connects
through the port map on 127.0.0.1: `ip netns exec`, `nsenter --net`, podman's
``--network ns:PATH`` and systemd's ``NetworkNamespacePath=`` (``systemd-run``, where
systemd is the init: not in this CI's container, which checks the shipped unit with
systemd-analyze instead, tests/unit/project/test_systemd_units.py). Docker cannot join
a named namespace: its refusal is checked too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.dockerscratch import busybox_rootfs
from tests.support.host import Netns, unique, write

pytestmark = pytest.mark.root

BUSYBOX = "/bin/busybox"
PORT = 18480

#: connects to 127.0.0.1:PORT from the sandbox host, retrying while the server starts
#: (bounded: 30 s), and prints the line the server sent
CLIENT = """
import socket, sys, time
end = time.monotonic() + 30
while True:
    try:
        with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as s:
            data = s.makefile().readline()
        if data:
            print(data.strip())
            break
    except OSError:
        pass
    if time.monotonic() > end:
        sys.exit("no answer")
    time.sleep(0.2)
"""


def _server(how: str) -> list[str]:
    """The workload: answer one connection on port 80 with "via HOW"."""
    return [BUSYBOX, "sh", "-c", f"echo via {how} | {BUSYBOX} nc -l -p 80"]


@pytest.fixture
def alloc(host_ns: Netns, tmp_path: Path) -> str:
    """An allocation with a port map PORT -> 80 in the sandbox host; its id."""
    if not os.path.exists(BUSYBOX):
        pytest.skip(f"needs {BUSYBOX}")
    aid, br = unique("w"), "rw" + unique()[-6:]
    path = write(tmp_path, "w.yaml",
                 f"version: 1\nbridges: [{{name: {br}}}]\n"
                 f"subnets: [{{name: wnet, bridge: {br}, cidr: 10.97.0.0/24}}]\n"
                 f"allocs: [{{id: {aid}, subnet: wnet, ports: [{{host: {PORT}, to: 80}}]}}]\n")
    r = host_ns.reconcile("apply", "--no-probe", path)
    assert r.rc == 0, r.all
    return aid


def _answer(host_ns: Netns, server: subprocess.Popen[bytes]) -> str:
    try:
        r = host_ns.run(sys.executable, "-c", CLIENT, str(PORT), check=False)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()
    finally:
        server.kill()
        server.wait(30)


@pytest.mark.parametrize("how", ["ip-netns-exec", "nsenter"])
def test_a_process_joins_the_allocation(host_ns: Netns, alloc: str, how: str) -> None:
    join = (["ip", "netns", "exec", alloc] if how == "ip-netns-exec"
            else ["nsenter", f"--net=/run/netns/{alloc}"])
    server = subprocess.Popen([*join, *_server(how)], stdout=subprocess.DEVNULL)
    assert _answer(host_ns, server) == f"via {how}"


def test_systemd_runs_a_unit_in_the_allocation(host_ns: Netns, alloc: str) -> None:
    if not os.path.isdir("/run/systemd/system"):
        pytest.skip("systemd is not the init here (the unit is checked by systemd-analyze)")
    unit = unique("wl")
    server = subprocess.Popen(["systemd-run", "--wait", "--collect", f"--unit={unit}",
                               "-p", f"NetworkNamespacePath=/run/netns/{alloc}",
                               *_server("systemd")], stdout=subprocess.DEVNULL)
    try:
        assert _answer(host_ns, server) == "via systemd"
    finally:
        subprocess.run(["systemctl", "stop", unit], capture_output=True)


@pytest.fixture
def podman(tmp_path: Path) -> Iterator[list[str]]:
    """podman with a store of the test's own (vfs: no mounts left behind) and a busybox
    image imported into it; removed afterwards."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (scripts/install.sh --test installs it)")
    conf = tmp_path / "containers.conf"
    # no default ulimits: raising them fails in a container without CAP_SYS_RESOURCE
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    run = tempfile.mkdtemp(prefix=unique("pod"))  # podman wants a runroot of < 50 chars
    cmd = ["env", f"CONTAINERS_CONF={conf}", "podman", "--root", str(tmp_path / "root"),
           "--runroot", run, "--storage-driver", "vfs",
           "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
    p = subprocess.run([*cmd, "import", "-", "localhost/rtworkload:1"],
                       input=busybox_rootfs(("sh", "nc", "ip")), capture_output=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    try:
        yield cmd
    finally:
        subprocess.run([*cmd, "rm", "-a", "-f"], capture_output=True, timeout=120)
        subprocess.run([*cmd, "rmi", "-a", "-f"], capture_output=True, timeout=120)
        shutil.rmtree(run, ignore_errors=True)


def test_podman_runs_a_container_in_the_allocation(host_ns: Netns, alloc: str,
                                                   podman: list[str]) -> None:
    name = unique("pod")
    server = subprocess.Popen([*podman, "run", "--rm", "--name", name,
                               "--network", f"ns:/run/netns/{alloc}", "localhost/rtworkload:1",
                               "sh", "-c", "echo via podman | nc -l -p 80"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert _answer(host_ns, server) == "via podman"
    finally:
        subprocess.run([*podman, "rm", "-f", name], capture_output=True, timeout=60)


@pytest.mark.docker
def test_docker_cannot_join_a_named_namespace(alloc: str, busybox_image: str) -> None:
    p = subprocess.run(["docker", "run", "--rm", "--network", f"ns:/run/netns/{alloc}",
                        busybox_image, "true"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and f"network ns:/run/netns/{alloc} not found" in p.stderr, \
        p.stderr
