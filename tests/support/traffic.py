"""Real traffic between namespaces the tests made: a client linked to the sandbox host,
listeners inside allocations, and a bounded TCP connect scan.

Traffic only ever goes to addresses inside the test's own namespaces.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from tests.support import nsexec
from tests.support.host import Netns, sh, unique

HOST_IP, CLIENT_IP = "192.168.251.1", "192.168.251.2"
HOST_IP6, CLIENT_IP6 = "fd00:251::1", "fd00:251::2"

LISTEN = r"""
import socket, sys, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    def loop():
        while True:
            c, _ = s.accept()
            try:
                c.sendall(b"ok %d\n" % port)
            except OSError:
                pass  # reset first: the probes close with SO_LINGER 0; the next one is served
            c.close()
    threading.Thread(target=loop, daemon=True).start()
for p in sys.argv[1:]:
    serve(int(p))
print("ready", flush=True)
sys.stdin.read()
"""

#: TCP listeners (answer ``ok PORT``) and UDP listeners (answer ``ok PORT`` to any datagram)
#: on every address of both families: argv is "tcp:PORT" / "udp:PORT"
LISTEN_ALL = r"""
import socket, sys, threading
def tcp(port):
    s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port)); s.listen(64)
    def loop():
        while True:
            c, _ = s.accept()
            try:
                c.sendall(b"ok %d\n" % port)
            except OSError:
                pass  # reset first: the probes close with SO_LINGER 0; the next one is served
            c.close()
    threading.Thread(target=loop, daemon=True).start()
def udp(port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port))
    def loop():
        while True:
            _data, peer = s.recvfrom(512); s.sendto(b"ok %d\n" % port, peer)
    threading.Thread(target=loop, daemon=True).start()
for spec in sys.argv[1:]:
    proto, port = spec.split(":")
    (tcp if proto == "tcp" else udp)(int(port))
print("ready", flush=True)
sys.stdin.read()
"""

#: send a datagram to every port of argv[2:] on argv[1] (200 at a time, 0.5 s for answers);
#: print the ports that answered: a UDP port is reachable when its listener's answer comes back
SCAN_UDP = r"""
import json, select, socket, sys, time
host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
family = socket.AF_INET6 if ":" in host else socket.AF_INET
answered = []
for i in range(0, len(ports), 200):
    socks = {}
    for p in ports[i:i + 200]:
        s = socket.socket(family, socket.SOCK_DGRAM); s.setblocking(False)
        try:
            s.sendto(b"probe", (host, p))
        except OSError:
            s.close(); continue
        socks[s] = p
    deadline = time.monotonic() + 0.5
    while socks and time.monotonic() < deadline:
        ready, _, _ = select.select(list(socks), [], [], max(0.0, deadline - time.monotonic()))
        for s in ready:
            try:
                if s.recv(512).startswith(b"ok "):
                    answered.append(socks[s])
            except OSError:
                pass  # ICMP port unreachable: closed, not reachable
            s.close(); del socks[s]
    for s in socks:
        s.close()
print(json.dumps(sorted(answered)))
"""

#: connect to every port of argv[2:] on argv[1] (timeout 0.3 s, 200 at a time); print the open
SCAN = r"""
import json, selectors, socket, sys
host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
family = socket.AF_INET6 if ":" in host else socket.AF_INET
open_ = []
for i in range(0, len(ports), 200):
    sel, socks = selectors.DefaultSelector(), []
    for p in ports[i:i + 200]:
        s = socket.socket(family); s.setblocking(False)
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
def client_of(host: Netns, *, host_ip: str = HOST_IP, client_ip: str = CLIENT_IP,
              host_ip6: str = HOST_IP6, client_ip6: str = CLIENT_IP6) -> Iterator[Netns]:
    """A client namespace with a veth to the sandbox host: client CLIENT_IP, host HOST_IP
    (and their IPv6 twins), or the addresses given."""
    name = unique("c")
    sh("ip", "netns", "add", name)
    try:
        hv, cv = f"{name[-6:]}h", f"{name[-6:]}c"
        sh("ip", "link", "add", hv, "netns", host.name, "type", "veth", "peer", "name", cv,
           "netns", name)
        sh("ip", "-n", host.name, "addr", "add", f"{host_ip}/24", "dev", hv)
        sh("ip", "-n", host.name, "link", "set", hv, "up")
        sh("ip", "-n", name, "addr", "add", f"{client_ip}/24", "dev", cv)
        sh("ip", "-n", name, "link", "set", cv, "up")
        sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ip", "-n", name, "route", "add", "default", "via", host_ip)
        # IPv6 too: a routed client of the subnets' cidr6 (no DAD: usable at once)
        sh("ip", "-n", host.name, "addr", "add", f"{host_ip6}/64", "dev", hv, "nodad")
        sh("ip", "-n", name, "addr", "add", f"{client_ip6}/64", "dev", cv, "nodad")
        sh("ip", "-n", name, "-6", "route", "add", "default", "via", host_ip6)
        yield Netns(name)
    finally:
        sh("ip", "netns", "del", name, check=False)


@contextlib.contextmanager
def listening(ns: str, *ports: int) -> Iterator[None]:
    """TCP listeners answering ``ok PORT`` inside namespace ``ns``, stopped afterwards."""
    p = nsexec.popen(ns, LISTEN, *map(str, ports), stdin=nsexec.PIPE, stdout=nsexec.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield
    finally:
        p.kill()
        p.wait()


@contextlib.contextmanager
def serving(ns: str, tcp: tuple[int, ...] = (), udp: tuple[int, ...] = ()) -> Iterator[None]:
    """TCP and UDP listeners on every address (IPv4 and IPv6) inside namespace ``ns``."""
    specs = [f"tcp:{p}" for p in tcp] + [f"udp:{p}" for p in udp]
    p = nsexec.popen(ns, LISTEN_ALL, *specs, stdin=nsexec.PIPE, stdout=nsexec.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield
    finally:
        p.kill()
        p.wait()


def scan_udp(client: Netns, ip: str, ports: list[int]) -> list[int]:
    """UDP ports of ip whose listener's answer reaches ``client`` (bounded: 0.5 s per 200)."""
    out = nsexec.run(client.name, SCAN_UDP, ip, *map(str, ports)).stdout
    result: list[int] = json.loads(out)
    return result


def fetch(client: Netns, ip: str, port: int, timeout: float = 2.0) -> str:
    """What a TCP connection from ``client`` to ip:port reads ('' when it fails)."""
    code = ("import socket,sys\ntry:\n s=socket.create_connection((sys.argv[1],int(sys.argv[2])),"
            f"timeout={timeout})\n print(s.makefile().readline().strip())\nexcept OSError:\n"
            " print('')\n")
    return nsexec.run(client.name, code, ip, str(port)).stdout.strip()


def scan(client: Netns, ip: str, ports: list[int]) -> list[int]:
    """Open TCP ports of ip:ports as seen from ``client`` (bounded: 0.3 s per 200 ports)."""
    out = nsexec.run(client.name, SCAN, ip, *map(str, ports)).stdout
    result: list[int] = json.loads(out)
    return result
