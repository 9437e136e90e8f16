"""Allocations against the real kernel: their ids, a desired state of them, listeners inside
their namespaces and a bounded connect from one namespace to others."""

from __future__ import annotations

import contextlib
import hashlib
import json
import select
from collections.abc import Iterator
from typing import Any

from tests.support import nsexec
from tests.support.host import unique, write

BRIDGE = "rcl0"


#: Listens on every "proto:port" given (tcp and udp, IPv4 and IPv6) and answers
#: "PORT PEER" so the caller sees which listener answered and from which source.
SERVER = r"""
import socket, sys, threading
def peer(a):
    return a[0].removeprefix("::ffff:")
def tcp(port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::", port)); s.listen(64)
    def loop():
        while True:
            c, a = s.accept()
            c.sendall(f"{port} {peer(a)}\n".encode()); c.close()
    return loop
def udp(port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port))
    def loop():
        while True:
            data, a = s.recvfrom(100)
            s.sendto(f"{port} {peer(a)}".encode(), a)
    return loop
loops = [(tcp if p == "tcp" else udp)(int(n)) for p, n in (x.split(":") for x in sys.argv[1:])]
for f in loops:
    threading.Thread(target=f, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


#: Tries every [proto, host, port] of a JSON list; prints the answers (null: none).
CLIENT = r"""
import json, socket, sys
timeout = float(sys.argv[2])
out = []
for proto, host, port in json.loads(sys.argv[1]):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        if proto == "tcp":
            with socket.create_connection((host, port), timeout=timeout) as c:
                out.append(c.recv(100).decode().strip())
        else:
            with socket.socket(fam, socket.SOCK_DGRAM) as c:
                c.settimeout(timeout); c.connect((host, port)); c.send(b"ping")
                out.append(c.recv(100).decode().strip())
    except OSError:
        out.append(None)
print(json.dumps(out))
"""


def in_ns(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *args]


@contextlib.contextmanager
def listening(ns: str, *specs: str) -> Iterator[nsexec.Process]:
    """A listener inside namespace ``ns`` (e.g. "tcp:80", "udp:53"); killed on exit."""
    p = nsexec.popen(ns, SERVER, *specs, stdout=nsexec.PIPE, stderr=nsexec.PIPE)
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 10)
        line = p.stdout.readline() if ready else ""
        assert line.strip() == "ready", f"listener in {ns} failed: {line!r}"
        yield p
    finally:
        p.kill()
        p.wait()


def connect_all(ns: str, targets: list[tuple[str, str, int]], timeout: float = 1.5) -> list[str | None]:
    """Answers to each (proto, host, port) from inside ``ns``, in one process."""
    out = nsexec.run(ns, CLIENT, json.dumps(targets), str(timeout)).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def reach(ns: str, proto: str, host: str, port: int, timeout: float = 1.5) -> str | None:
    return connect_all(ns, [(proto, host, port)], timeout)[0]


def alloc_ids(n: int = 2) -> list[str]:
    """Allocation ids carrying the session prefix, sorted in the order given."""
    base = unique("a")
    return [f"{base}-{i:02d}" for i in range(n)]


def config(tmp_path: object, allocs: list[dict[str, object]], *, hairpin: bool = True,
           mtu: int = 1400, cidr6: bool = True, rng: tuple[str, str] | None = None,
           settings: str = "", name: str = "allocs.yaml") -> str:
    lines = ["version: 1", "bridges:", f"  - {{name: {BRIDGE}, mtu: {mtu}, "
             f"hairpin: {str(hairpin).lower()}}}", "subnets:",
             "  - name: net", f"    bridge: {BRIDGE}", "    cidr: 10.77.0.0/24"]
    if cidr6:
        lines.append("    cidr6: fd00:77::/64")
    if rng:
        lines.append(f"    range: {{start: {rng[0]}, end: {rng[1]}}}")
    lines.append("allocs:" if allocs else "allocs: []")
    for a in allocs:
        lines.append("  - " + json.dumps({"subnet": "net", **a}))
    return write(tmp_path, name, "\n".join(lines) + "\n" + settings)


def veth_name(alloc_id: str) -> str:
    """The documented host-side name: vr + 12 hex of sha1(id), computed independently."""
    return "vr" + hashlib.sha1(alloc_id.encode()).hexdigest()[:12]


def subnet_config(tmp_path: Any, bridge: str, cidr: str, allocs: list[dict[str, Any]],
                  name: str = "c.yaml") -> str:
    """Write a desired state of one bridge, one subnet ``net`` on it and ``allocs``."""
    doc = {"version": 1, "bridges": [{"name": bridge}],
           "subnets": [{"name": "net", "bridge": bridge, "cidr": cidr}],
           "allocs": [{"subnet": "net", **a} for a in allocs]}
    return write(tmp_path, name, json.dumps(doc) + "\n")
