"""Probes against the real kernel: a sandbox with allocations and a host address to probe
from, the probe run in-process, and recorders of what arrives inside the allocations."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator

from reconciler.config.load import load
from reconciler.domain.probes import ProbeResult
from reconciler.drivers import netns
from reconciler.engine.observe import Observer
from reconciler.engine.probes import Prober
from tests.support.allocs import BRIDGE, alloc_ids
from tests.support.host import Netns, sh, write

HOST_ADDR6 = "2001:db8:51::1"


HOST_ADDR = "198.51.100.1"  # on a link of the sandbox: the sandbox's "host address"


#: logs "PROTO PORT PEERPORT" for every TCP connection and UDP datagram, on every address
RECORDER = r"""
import socket, sys, threading
lock = threading.Lock()
def log(*words):
    with lock:  # one line per event, whole, whichever thread writes it
        sys.stdout.write(" ".join(map(str, words)) + "\n"); sys.stdout.flush()
def tcp(port):
    s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0); s.bind(("::", port)); s.listen(64)
    while True:
        c, peer = s.accept(); log("tcp", port, peer[1]); c.close()
def udp(port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0); s.bind(("::", port))
    while True:
        _d, peer = s.recvfrom(512); log("udp", port, peer[1])
for spec in sys.argv[1:]:
    proto, port = spec.split(":")
    threading.Thread(target=tcp if proto == "tcp" else udp, args=(int(port),), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def recorder_lines(ns: str, script: str, *specs: str) -> Iterator[list[list[str]]]:
    """A listener script (``script``, args ``specs``) in ``ns``; the list fills with the
    words of each line it logged when the block ends."""
    words: list[list[str]] = []
    p = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-c", script,
                          *specs], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 10)
        assert ready and p.stdout.readline().strip() == "ready"
        yield words
    finally:
        lines = drain(p)
        p.kill()
        out, _ = p.communicate()
        words += [line.split() for line in [*lines, *out.splitlines()]]


@contextlib.contextmanager
def recording(ns: str, *specs: str) -> Iterator[list[tuple[str, int, int]]]:
    """Listeners in ``ns``; the list fills with (proto, port, peer port) when the block ends."""
    seen: list[tuple[str, int, int]] = []
    try:
        with recorder_lines(ns, RECORDER, *specs) as words:
            yield seen
    finally:
        seen += [(proto, int(port), int(peer)) for proto, port, peer in words]


def drain(p: subprocess.Popen[str], quiet: float = 0.3, limit: float = 5.0) -> list[str]:
    """The lines a recorder still writes after the probes, until it is quiet for ``quiet``
    seconds (at most ``limit``): the kernel took every probe in (that is "reached"), but a
    listener thread may not have accepted and logged it yet when it is killed. Raw reads
    of the pipe (``communicate`` reads the descriptor too, not a text buffer)."""
    assert p.stdout is not None
    fd = p.stdout.fileno()
    data = b""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], quiet)
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data.decode().splitlines()


def setup(host: Netns, tmp_path: object, *, host_address: bool = True,
          isolation: str = "ports") -> tuple[str, list[str]]:
    a0, a1 = alloc_ids(2)
    if host_address:
        # no dummy driver in this kernel: a veth pair inside the sandbox carries the address
        sh("ip", "-n", host.name, "link", "add", "hostaddr0", "type", "veth", "peer", "name",
           "hostaddr1")
        sh("ip", "-n", host.name, "addr", "add", f"{HOST_ADDR}/24", "dev", "hostaddr0")
        sh("ip", "-n", host.name, "addr", "add", f"{HOST_ADDR6}/64", "dev", "hostaddr0",
           "nodad")
        sh("ip", "-n", host.name, "link", "set", "hostaddr1", "up")
        sh("ip", "-n", host.name, "link", "set", "hostaddr0", "up")
    ports = [{"host": 18080, "to": 80}, {"host": 15353, "to": 53, "protocol": "udp"},
             {"host": 18443, "to": 443, "host_ip": "127.0.0.1"},
             {"host": 18081, "to": 81, "probe": False}]
    text = "\n".join([
        "version: 1", "bridges:", f"  - {{name: {BRIDGE}, mtu: 1400}}", "subnets:",
        "  - name: net", f"    bridge: {BRIDGE}", "    cidr: 10.77.0.0/24",
        "    cidr6: fd00:77::/64", f"    isolation: {isolation}", "allocs:",
        "  - " + json.dumps({"id": a0, "subnet": "net", "ports": ports}),
        "  - " + json.dumps({"id": a1, "subnet": "net"}), ""])
    path = write(tmp_path, "probes.yaml", text)
    r = host.reconcile("apply", path)
    assert r.rc == 0, r.all
    return path, [a0, a1]


def probe(host: Netns, path: str, check: object = None, **kw: object) -> list[ProbeResult]:
    """``Prober.run`` inside the sandbox; ``check()`` is called while the vantage is still
    up (the prober removes it on close)."""
    desired = load([path])
    with netns.enter(host.name):
        obs = Observer()
        try:
            live = obs.observe(desired)
            prober = Prober(obs.handles)
            try:
                results = prober.run(desired, live, **kw)  # type: ignore[arg-type]
                if callable(check):
                    check()
                return results
            finally:
                prober.close()
        finally:
            obs.handles.close()


def table(results: list[ProbeResult]) -> set[tuple[str, str, str, int, int | None, bool, bool]]:
    return {(r.alloc, r.path, r.proto, r.family, r.port, r.ok, r.skipped) for r in results}


def failures(results: list[ProbeResult]) -> list[str]:
    return [r.describe() for r in results if not r.ok and not r.skipped]
