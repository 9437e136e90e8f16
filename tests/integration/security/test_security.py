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

from tests.support.figures import report
from tests.support.host import REPO, Netns, unique, write
from tests.support.traffic import (
    HOST_IP,
    HOST_IP6,
    client_of,
    fetch,
    listening,
    scan,
    scan_udp,
    serving,
)

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
    rules = host_ns.firewall_text(4)
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


#: what listens inside both allocations of the alloc-address scan, on every address
ALLOC_TCP = (22, 80, 443, 1000, 8080)
ALLOC_UDP = (53, 123, 1000)
ALLOC_SCAN = sorted(set(range(1, 1025)) | {8080})


def _addresses(alloc: str) -> tuple[str, str]:
    """The IPv4 and IPv6 address of an allocation's eth0 (read from the kernel)."""
    out = Netns(alloc).ip_json("addr", "show", "eth0")
    infos = [a for a in out[0]["addr_info"] if a.get("scope") == "global"]
    v4 = next(a["local"] for a in infos if a["family"] == "inet")
    v6 = next(a["local"] for a in infos if a["family"] == "inet6")
    return v4, v6


@pytest.mark.parametrize("isolation", ["ports", "open"])
def test_a_routed_client_scans_the_allocations_own_addresses(host_ns: Netns, tmp_path, request,
                                                             isolation: str):
    """A host that routes to the subnet (the client's default route is the host) scans each
    allocation's own IPv4 and IPv6 address, TCP and UDP: with ``ports`` it reaches nothing,
    with ``open`` everything that listens; the declared maps work through the host either way.
    """
    a, b = unique("i"), unique("i")
    line = "" if isolation == "ports" else ", isolation: open"
    cfg = write(tmp_path, "s.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: sec, bridge: {BRIDGE}, cidr: 10.212.0.0/24, cidr6: "fd00:212::/64"{line}}}]
allocs:
  - id: {a}
    subnet: sec
    ports: [{{host: 1080, to: 80}}, {{host: 1053, to: 53, protocol: udp}}]
  - {{id: {b}, subnet: sec}}
""")
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    found: dict[str, tuple[list[int], list[int]]] = {}
    t0 = time.monotonic()
    with client_of(host_ns) as client, serving(a, ALLOC_TCP, ALLOC_UDP), \
            serving(b, ALLOC_TCP, ALLOC_UDP):
        for alloc in (a, b):
            for addr in _addresses(alloc):
                found[addr] = (scan(client, addr, ALLOC_SCAN), scan_udp(client, addr, ALLOC_SCAN))
        # the declared maps, through the host, from the same client (IPv4 and IPv6)
        mapped = {ip: (scan(client, ip, [1080, 1081]), scan_udp(client, ip, [1053, 1054]))
                  for ip in (HOST_IP, HOST_IP6)}
    took = time.monotonic() - t0
    tcp_hits = sorted({p for t, _u in found.values() for p in t})
    udp_hits = sorted({p for _t, u in found.values() for p in u})
    report(request, f"isolation {isolation}: scanned {len(ALLOC_SCAN)} tcp and "
                    f"{len(ALLOC_SCAN)} udp ports on each of {len(found)} allocation addresses "
                    f"(ipv4+ipv6) from a routed client in {took:.1f}s: reachable "
                    f"{sum(len(t) for t, _u in found.values())} tcp "
                    f"({tcp_hits or 'none'}), {sum(len(u) for _t, u in found.values())} udp "
                    f"({udp_hits or 'none'}); through the host map: "
                    f"{ {ip: m for ip, m in mapped.items()} }")
    assert len(found) == 4
    if isolation == "ports":
        assert found == {addr: ([], []) for addr in found}
    else:
        assert found == {addr: (list(ALLOC_TCP), list(ALLOC_UDP)) for addr in found}
    # IPv6 maps: the allocation has an address6, so the DNAT rule exists in ip6tables too
    assert mapped == {HOST_IP: ([1080], [1053]), HOST_IP6: ([1080], [1053])}


def test_allocations_reach_each_other_and_another_subnet_is_outside(host_ns: Netns, tmp_path):
    """Inside a subnet everything passes (bridged traffic crosses FORWARD); from another subnet
    only the map; the host itself (OUTPUT) reaches every allocation port."""
    a, b, c = unique("j"), unique("j"), unique("j")
    cfg = write(tmp_path, "s.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}}}, {{name: rsec1}}]
subnets:
  - {{name: one, bridge: {BRIDGE}, cidr: 10.214.0.0/24}}
  - {{name: two, bridge: rsec1, cidr: 10.215.0.0/24}}
allocs:
  - {{id: {a}, subnet: one, ports: [{{host: 1080, to: 80}}]}}
  - {{id: {b}, subnet: one}}
  - {{id: {c}, subnet: two}}
""")
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    a4 = _addresses_v4(a)
    with serving(a, (22, 80)):
        assert fetch(Netns(b), a4, 22) == "ok 22"  # same subnet: unmapped ports too
        assert fetch(Netns(c), a4, 22) == ""  # another subnet: outside
        assert fetch(Netns(c), a4, 80) == ""  # ... the mapped port, behind the map's back
        assert fetch(Netns(c), "10.215.0.1", 1080) == "ok 80"  # through the map: yes
        assert fetch(host_ns, a4, 22) == "ok 22"  # the host itself is untouched


def _addresses_v4(alloc: str) -> str:
    out = Netns(alloc).ip_json("addr", "show", "eth0")
    return next(a["local"] for a in out[0]["addr_info"] if a["family"] == "inet")


LOOPBACK_SECRET = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"secret\n"); c.close()
"""


def test_an_allocation_cannot_reach_the_hosts_loopback(host_ns: Netns, tmp_path):
    """CVE-2020-8558: route_localnet=1 on the bridge (127.0.0.1 port maps need it) let an
    allocation with CAP_NET_ADMIN route 127.0.0.1 via its gateway and read a service bound to
    the host's 127.0.0.1. The guard drops it; 127.0.0.1 port maps keep working."""
    a = unique("l")
    cfg = write(tmp_path, "s.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: lo, bridge: {BRIDGE}, cidr: 10.216.0.0/24}}]
allocs:
  - {{id: {a}, subnet: lo, ports: [{{host: 1443, to: 443, host_ip: 127.0.0.1}}]}}
""")
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    assert host_ns.run("cat", f"/proc/sys/net/ipv4/conf/{BRIDGE}/route_localnet").stdout.strip() \
        == "1"
    alloc = Netns(a)
    # the attacker, root in its own namespace: 127.0.0.1 via the gateway, not via its own lo
    alloc.run("ip", "addr", "del", "127.0.0.1/8", "dev", "lo")
    alloc.run("ip", "route", "add", "127.0.0.1/32", "via", "10.216.0.1", "dev", "eth0")
    alloc.run("sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1",
              "net.ipv4.conf.eth0.route_localnet=1")
    secret = subprocess.Popen(["nsenter", f"--net=/run/netns/{host_ns.name}", sys.executable,
                               "-c", LOOPBACK_SECRET, "7777"], stdout=subprocess.PIPE, text=True)
    try:
        assert secret.stdout is not None and secret.stdout.readline().strip() == "ready"
        assert fetch(alloc, "127.0.0.1", 7777) == ""
        # the host still reaches the allocation through its 127.0.0.1 port map
        with listening(a, 443):
            assert fetch(host_ns, "127.0.0.1", 1443) == "ok 443"
        # and it is the guard that stops the attack: without it, the same attempt reads
        # (our table's input chain flushed, or the bridge's entry in its set removed)
        for breaker, drift in ((("flush", "chain", "inet", "reconciler", "guard"),
                                "chain guard holds 0 rules, not 3"),
                               (("delete", "element", "inet", "reconciler", "guarded",
                                 f'{{ "{BRIDGE}" }}'), f"entries missing for bridge={BRIDGE}")):
            host_ns.run("nft", *breaker)
            assert fetch(alloc, "127.0.0.1", 7777) == "secret"
            # a pass puts the guard back
            r = host_ns.reconcile("apply", cfg)
            assert r.rc == 0 and drift in r.all, r.all
            assert fetch(alloc, "127.0.0.1", 7777) == ""
    finally:
        secret.kill()
        secret.wait()


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
