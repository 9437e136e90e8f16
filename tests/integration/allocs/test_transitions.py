"""Clean transitions against the real kernel (issue 13, item 2), each converging in one run.

* a port map that moves or goes takes its conntrack entries with it: a client that keeps
  its source port reaches the new destination (UDP above all; TCP flows are reset);
* removing the last port of a bridge with a declared MTU keeps that MTU;
* an allocation whose namespace a process still holds is pruned (and destroyed) in one
  run: its veth goes, the holder is named.

The host is a throwaway namespace (``host_ns``); the client is another namespace routed
to it; conntrack entries live in those namespaces and go with them. Checked with ``ip -j``,
``conntrack -L`` and real traffic, never with the reconciler's own observer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support.host import Netns, sh, unique, write
from tests.support.traffic import client_of

pytestmark = pytest.mark.root

HOST4, CLIENT4 = "10.98.0.1", "10.98.0.2"
HOST6, CLIENT6 = "fd00:98::1", "fd00:98::2"
BRIDGE = "rcltr0"
A_ADDR, B_ADDR = "10.78.0.10", "10.78.0.20"
A_ADDR6, B_ADDR6 = "fd00:78::10", "fd00:78::20"
HOST_PORT = 5353

#: answers every datagram and every line of every TCP connection with its tag (argv[1]),
#: on IPv4 and IPv6
TAGGED = r"""
import socket, sys, threading
tag, port = sys.argv[1].encode(), int(sys.argv[2])
u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
u.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0); u.bind(("::", port))
t = socket.socket(socket.AF_INET6); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0); t.bind(("::", port)); t.listen(8)
def udp():
    while True:
        _d, peer = u.recvfrom(100); u.sendto(tag, peer)
def conn(c):
    f = c.makefile("rb")
    for _line in f:
        c.sendall(tag + b"\n")
def tcp():
    while True:
        c, _ = t.accept(); threading.Thread(target=conn, args=(c,), daemon=True).start()
threading.Thread(target=udp, daemon=True).start()
threading.Thread(target=tcp, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

#: one datagram from a fixed source port (argv[3]) to argv[1]:argv[2]; prints the answer
UDP_FROM = r"""
import socket, sys
v6 = ":" in sys.argv[1]
s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::" if v6 else "0.0.0.0", int(sys.argv[3]))); s.settimeout(1.5)
s.sendto(b"ping", (sys.argv[1], int(sys.argv[2])))
try:
    print(s.recv(100).decode())
except OSError as e:
    print("none")
"""

#: a TCP connection kept open: one line sent and its answer printed per line on stdin
TCP_KEPT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
f = c.makefile("rb")
for _cmd in sys.stdin:
    try:
        c.sendall(b"ping\n"); line = f.readline().decode().strip()
        print(line or "closed", flush=True)
    except ConnectionResetError:
        print("reset", flush=True)
    except OSError as e:
        print(type(e).__name__, flush=True)
"""


def in_ns(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *args]


@contextlib.contextmanager
def tagged(ns: str, tag: str, port: int) -> Iterator[None]:
    p = subprocess.Popen(in_ns(ns, sys.executable, "-c", TAGGED, tag, str(port)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 10)
        line = p.stdout.readline() if ready else ""
        assert line.strip() == "ready", f"listener in {ns}: {line!r}"
        yield
    finally:
        p.kill()
        p.wait()


def udp_from(client: str, sport: int, host: str = HOST4) -> str:
    return sh(*in_ns(client, sys.executable, "-c", UDP_FROM, host, str(HOST_PORT),
                     str(sport))).stdout.strip()


@pytest.fixture
def client(host_ns: Netns) -> Iterator[str]:
    """Another host: a namespace routed to ``host_ns`` over a veth (dual stack)."""
    with client_of(host_ns, host_ip=HOST4, client_ip=CLIENT4, host_ip6=HOST6,
                   client_ip6=CLIENT6) as c:
        yield c.name


def config(allocs: list[dict[str, object]], *, mtu: int = 1400) -> str:
    """The desired state: one bridge, one dual-stack subnet, ``allocs`` on it."""
    lines = ["version: 1", "bridges:", f"  - {{name: {BRIDGE}, mtu: {mtu}}}", "subnets:",
             "  - name: net", f"    bridge: {BRIDGE}", "    cidr: 10.78.0.0/24",
             "    cidr6: fd00:78::/64"]
    lines.append("allocs:" if allocs else "allocs: []")
    lines += ["  - " + json.dumps({"subnet": "net", **a}) for a in allocs]
    return "\n".join(lines) + "\n"


def apply_ok(host: Netns, path: str) -> str:
    """Apply must converge in this one run (exit 0), and the next plan be empty."""
    r = host.reconcile("apply", path)
    assert r.rc == 0, r.all
    again = host.reconcile("plan", path)
    assert again.rc == 0 and "No changes." in again.out, again.all
    return r.all


def conntrack_lines(host: Netns, proto: str, family: str = "ipv4") -> list[str]:
    out = host.run("conntrack", "-L", "-f", family, "-p", proto, "--orig-port-dst",
                   str(HOST_PORT), check=False).stdout
    return [ln for ln in out.splitlines() if ln.strip()]


needs_conntrack = pytest.mark.skipif(shutil.which("conntrack") is None,
                                     reason="the conntrack tool is not installed")


def _moves(proto: str) -> tuple[str, str, str, str]:
    """Two allocations, the files that map the host port to A, then to B (A gone)."""
    a, b = unique("a"), unique("b")
    port = {"host": HOST_PORT, "to": 53, "protocol": proto}
    return (a, b, config([{"id": a, "address": A_ADDR, "address6": A_ADDR6, "ports": [port]}]),
            config([{"id": b, "address": B_ADDR, "address6": B_ADDR6, "ports": [port]}]))


# ------------------------------------------------------------------ (a) conntrack


@needs_conntrack
def test_udp_map_moved_to_another_alloc_reaches_it_from_the_same_source_port(
        host_ns: Netns, client: str, tmp_path: object) -> None:
    a, b, first, second = _moves("udp")
    path = write(tmp_path, "t.yaml", first)
    apply_ok(host_ns, path)
    with tagged(a, "A", 53):
        assert udp_from(client, 40000) == "A"
        assert any(f"src={A_ADDR}" in ln for ln in conntrack_lines(host_ns, "udp"))
    write(tmp_path, "t.yaml", second)
    apply_ok(host_ns, path)  # A pruned, B declared with the same host port: one run
    assert not [ln for ln in conntrack_lines(host_ns, "udp") if f"src={A_ADDR}" in ln]
    with tagged(b, "B", 53):
        assert udp_from(client, 40000) == "B"
    write(tmp_path, "t.yaml", config([]))
    apply_ok(host_ns, path)
    assert not [ln for ln in conntrack_lines(host_ns, "udp") if f"src={B_ADDR}" in ln]


@needs_conntrack
def test_ipv6_udp_map_moved_to_another_alloc_reaches_it_from_the_same_source_port(
        host_ns: Netns, client: str, tmp_path: object) -> None:
    a, b, first, second = _moves("udp")
    path = write(tmp_path, "t.yaml", first)
    apply_ok(host_ns, path)
    with tagged(a, "A", 53):
        assert udp_from(client, 40002, HOST6) == "A"
        assert any(f"src={A_ADDR6}" in ln for ln in conntrack_lines(host_ns, "udp", "ipv6"))
    write(tmp_path, "t.yaml", second)
    apply_ok(host_ns, path)
    assert not [ln for ln in conntrack_lines(host_ns, "udp", "ipv6") if f"src={A_ADDR6}" in ln]
    with tagged(b, "B", 53):
        assert udp_from(client, 40002, HOST6) == "B"


@needs_conntrack
def test_udp_entries_made_before_a_map_existed_are_dropped_when_it_appears(
        host_ns: Netns, client: str, tmp_path: object) -> None:
    b = unique("b")
    path = write(tmp_path, "t.yaml", config([]))
    apply_ok(host_ns, path)
    # no map yet: the datagrams meet the host itself (nothing listens) and are tracked so
    assert udp_from(client, 40001) == "none"
    # the datagram may still wait for the client's ARP to resolve when its sender gives up
    deadline = time.monotonic() + 5
    while not conntrack_lines(host_ns, "udp") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert conntrack_lines(host_ns, "udp")
    write(tmp_path, "t.yaml", config([{"id": b, "address": B_ADDR, "ports": [
        {"host": HOST_PORT, "to": 53, "protocol": "udp"}]}]))
    apply_ok(host_ns, path)
    with tagged(b, "B", 53):
        assert udp_from(client, 40001) == "B"


@needs_conntrack
def test_tcp_flow_to_a_removed_map_is_reset_not_left_hanging(
        host_ns: Netns, client: str, tmp_path: object) -> None:
    a, b, first, second = _moves("tcp")
    path = write(tmp_path, "t.yaml", first)
    apply_ok(host_ns, path)
    with tagged(a, "A", 53):
        kept = subprocess.Popen(in_ns(client, sys.executable, "-c", TCP_KEPT, HOST4,
                                      str(HOST_PORT)), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert kept.stdin is not None and kept.stdout is not None
            kept.stdin.write("go\n")
            kept.stdin.flush()
            assert kept.stdout.readline().strip() == "A"
            # A's listener (and its end of the flow) keeps A's namespace alive meanwhile
            write(tmp_path, "t.yaml", second)
            apply_ok(host_ns, path)
            assert not [ln for ln in conntrack_lines(host_ns, "tcp") if f"src={A_ADDR}" in ln]
            with tagged(b, "B", 53):
                kept.stdin.write("go\n")
                kept.stdin.flush()
                # the flow to the gone allocation now meets B, which resets it (with the
                # stale entry kept it went on to A's address and hung until the timeout)
                assert kept.stdout.readline().strip() == "reset"
        finally:
            kept.kill()
            kept.wait()


# ------------------------------------------------------------------ (b) bridge MTU


def bridge_mtu(host: Netns) -> int:
    link = host.link(BRIDGE)
    assert link is not None
    return int(link["mtu"])


def test_removing_the_last_alloc_of_a_bridge_keeps_its_declared_mtu(
        host_ns: Netns, tmp_path: object) -> None:
    a = unique("a")
    text = config([{"id": a}], mtu=5000)
    path = write(tmp_path, "t.yaml", text)
    apply_ok(host_ns, path)
    assert bridge_mtu(host_ns) == 5000
    for _round in range(2):  # removed, added again, removed again
        write(tmp_path, "t.yaml", config([], mtu=5000))
        apply_ok(host_ns, path)
        assert bridge_mtu(host_ns) == 5000
        write(tmp_path, "t.yaml", text)
        apply_ok(host_ns, path)
        assert bridge_mtu(host_ns) == 5000


def test_a_bridge_made_with_its_mtu_at_creation_keeps_it_too(
        host_ns: Netns, tmp_path: object) -> None:
    """A bridge an older version made (IFLA_MTU at creation: not "set by user")."""
    a = unique("a")
    host_ns.run("ip", "link", "add", BRIDGE, "mtu", "5000", "type", "bridge")
    host_ns.run("ip", "link", "set", BRIDGE, "alias", "managed-by=reconciler")
    host_ns.run("ip", "link", "set", BRIDGE, "up")
    path = write(tmp_path, "t.yaml", config([{"id": a}], mtu=5000))
    apply_ok(host_ns, path)
    write(tmp_path, "t.yaml", config([], mtu=5000))
    apply_ok(host_ns, path)
    assert bridge_mtu(host_ns) == 5000


# ------------------------------------------------------------------ (c) held namespace


def veth_of(alloc_id: str) -> str:
    """The documented host-side name: vr + 12 hex of sha1(id), computed independently."""
    return "vr" + hashlib.sha1(alloc_id.encode()).hexdigest()[:12]


@contextlib.contextmanager
def holder(ns: str) -> Iterator[int]:
    """A ``sleep`` inside the allocation's namespace: it keeps the namespace alive."""
    p = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "sleep", "600"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("command", ["apply", "destroy"])
def test_an_alloc_held_by_a_process_is_pruned_in_one_run(
        host_ns: Netns, tmp_path: object, command: str) -> None:
    a, b = unique("a"), unique("b")
    path = write(tmp_path, "t.yaml", config([{"id": a, "ports": [{"host": HOST_PORT, "to": 53}]},
                                             {"id": b}]))
    apply_ok(host_ns, path)
    assert host_ns.link(veth_of(a)) is not None
    with holder(a) as pid:
        # the holder is in place once its namespace is the allocation's
        sh("sh", "-c", f"for i in $(seq 50); do [ $(stat -L -c %i /proc/{pid}/ns/net) = "
                       f"$(stat -L -c %i /run/netns/{a}) ] && exit 0; sleep 0.05; done; exit 1")
        if command == "apply":
            write(tmp_path, "t.yaml", config([{"id": b}]))
            r = host_ns.reconcile("apply", path)
        else:
            r = host_ns.reconcile("destroy", "--yes")
        assert r.rc == 0, r.all
        assert f"pid {pid} (sleep)" in r.all, r.all
        assert host_ns.link(veth_of(a)) is None
        assert not [ln for ln in host_ns.firewall_text(4).splitlines() if f"alloc={a}" in ln]
        if command == "apply":
            again = host_ns.reconcile("plan", path)
            assert again.rc == 0 and "No changes." in again.out, again.all
            assert host_ns.link(veth_of(b)) is not None
        else:
            assert host_ns.link(veth_of(b)) is None


def test_flows_are_deleted_in_windows_and_missing_ones_are_fine(host_ns: Netns) -> None:
    """``Conntrack.delete_flows`` sends its deletes many per netlink message buffer (the
    probes delete thousands after each run): more entries than one window, some of them
    already gone, all accounted for — checked with conntrack(8)."""
    if shutil.which("conntrack") is None:
        pytest.skip("conntrack(8) not installed")
    import ipaddress  # noqa: PLC0415 (only this test)

    from reconciler.drivers import netns  # noqa: PLC0415 (only this test)
    from reconciler.drivers.netlink.conntrack import Conntrack, Tuple  # noqa: PLC0415

    n = 300
    for i in range(n):
        host_ns.run("conntrack", "-I", "-p", "udp", "-s", "10.9.0.1", "-d", "10.9.0.2",
                    "--sport", str(40000 + i), "--dport", "53", "--timeout", "60")
    src, dst = ipaddress.ip_address("10.9.0.1"), ipaddress.ip_address("10.9.0.2")
    flows = [Tuple(src, dst, 17, 40000 + i, 53) for i in range(n + 20)]  # 20 never existed
    with netns.enter(host_ns.name):
        ct = Conntrack()
        try:
            assert ct.delete_flows(iter(flows)) == n
            assert ct.delete_flows(flows[:5]) == 0  # gone already: fine, none counted
        finally:
            ct.close()
    left = host_ns.run("conntrack", "-L", "-p", "udp", "--orig-dst", "10.9.0.2",
                       check=False).stdout
    assert [ln for ln in left.splitlines() if ln.strip()] == []
