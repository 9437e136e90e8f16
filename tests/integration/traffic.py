"""Real traffic between namespaces the tests made: a client linked to the sandbox host,
listeners inside allocations, and a bounded TCP connect scan.

Traffic only ever goes to addresses inside the test's own namespaces.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

from tests.conftest import Netns, sh, unique

HOST_IP, CLIENT_IP = "192.168.251.1", "192.168.251.2"

LISTEN = r"""
import socket, sys, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    def loop():
        while True:
            c, _ = s.accept(); c.sendall(b"ok %d\n" % port); c.close()
    threading.Thread(target=loop, daemon=True).start()
for p in sys.argv[1:]:
    serve(int(p))
print("ready", flush=True)
sys.stdin.read()
"""

#: connect to every port of argv[2:] on argv[1] (timeout 0.3 s, 200 at a time); print the open
SCAN = r"""
import json, selectors, socket, sys
host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
open_ = []
for i in range(0, len(ports), 200):
    sel, socks = selectors.DefaultSelector(), []
    for p in ports[i:i + 200]:
        s = socket.socket(); s.setblocking(False)
        s.connect_ex((host, p)); sel.register(s, selectors.EVENT_WRITE, p); socks.append(s)
    pending = len(socks)
    while pending:
        events = sel.select(timeout=0.3)
        if not events:
            break
        for key, _ in events:
            sel.unregister(key.fileobj); pending -= 1
            if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                open_.append(key.data)
    for s in socks:
        s.close()
print(json.dumps(sorted(open_)))
"""


@contextlib.contextmanager
def client_of(host: Netns) -> Iterator[Netns]:
    """A client namespace with a veth to the sandbox host: client CLIENT_IP, host HOST_IP."""
    name = unique("c")
    sh("ip", "netns", "add", name)
    try:
        hv, cv = f"{name[-6:]}h", f"{name[-6:]}c"
        sh("ip", "link", "add", hv, "netns", host.name, "type", "veth", "peer", "name", cv,
           "netns", name)
        sh("ip", "-n", host.name, "addr", "add", f"{HOST_IP}/24", "dev", hv)
        sh("ip", "-n", host.name, "link", "set", hv, "up")
        sh("ip", "-n", name, "addr", "add", f"{CLIENT_IP}/24", "dev", cv)
        sh("ip", "-n", name, "link", "set", cv, "up")
        sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ip", "-n", name, "route", "add", "default", "via", HOST_IP)
        yield Netns(name)
    finally:
        sh("ip", "netns", "del", name, check=False)


@contextlib.contextmanager
def listening(ns: str, *ports: int) -> Iterator[None]:
    """TCP listeners answering ``ok PORT`` inside namespace ``ns``, stopped afterwards."""
    p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", LISTEN,
                          *map(str, ports)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield
    finally:
        p.kill()
        p.wait()


def fetch(client: Netns, ip: str, port: int, timeout: float = 2.0) -> str:
    """What a TCP connection from ``client`` to ip:port reads ('' when it fails)."""
    code = ("import socket,sys\ntry:\n s=socket.create_connection((sys.argv[1],int(sys.argv[2])),"
            f"timeout={timeout})\n print(s.makefile().readline().strip())\nexcept OSError:\n"
            " print('')\n")
    return client.run(sys.executable, "-c", code, ip, str(port)).stdout.strip()


def scan(client: Netns, ip: str, ports: list[int]) -> list[int]:
    """Open TCP ports of ip:ports as seen from ``client`` (bounded: 0.3 s per 200 ports)."""
    out = client.run(sys.executable, "-c", SCAN, ip, *map(str, ports)).stdout
    result: list[int] = json.loads(out)
    return result
