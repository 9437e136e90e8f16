"""The stopgap on today's iptables backend (issue 26, item 0), against the real kernel.

(a) Another manager's ACCEPT above our jump in ``FORWARD`` (dockerd inserts its
per-network accepts at the top whenever it starts or creates a network) must not open an
allocation's undeclared ports: the plan shows the position as drift, ``verify`` fails
naming the rule, apply (or a running agent, at the nf_tables event) heals it, and where
``DOCKER-USER`` exists our jump sits first in it too, so dockerd's later inserts open
nothing at all. The Docker cases run a private dockerd in a sandbox of its own (the
coexistence matrix's cell: a mount namespace with a private ``/run``, ``/run/netns``
carried over, its own data-root and socket); the machine's dockerd and firewall are never
used. What a container on a Docker network reaches is checked from a namespace with a
port on that network's bridge (the same kernel path as a container's veth).

(b) A rule of iptables-legacy on a declared path, beside iptables-nft, is named by plan
(an error when it blocks the path whole), by ``verify`` and by the probes' diagnosis
rather than a silent "No changes". iptables-legacy runs only inside the test's network
namespace (legacy tables are per namespace).

Traffic goes only to addresses inside namespaces the tests made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cells import NFT_INTERVAL, Cell
from tests.support.figures import report
from tests.support.host import Netns, sh, unique, write
from tests.support.traffic import (
    HOST_IP,
    HOST_IP6,
    client_of,
    fetch,
    scan,
    serving,
)

pytestmark = pytest.mark.root

BRIDGE = "rstp0"
CIDR, CIDR6 = "10.231.0.0/24", "fd00:231::/64"
DOCKER = ("docker", "-H", "unix:///run/docker.sock")
JUMP = "-m comment --comment reconciler -j RECONCILER-FORWARD"


def _cfg(tmp_path: Any, alloc: str, *, v6: bool = False) -> str:
    six = f", cidr6: \"{CIDR6}\"" if v6 else ""
    return write(tmp_path, "stopgap.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: stp, bridge: {BRIDGE}, cidr: {CIDR}{six}}}]
allocs:
  - id: {alloc}
    subnet: stp
    ports: [{{host: 8080, to: 80}}]
""")


def _address(alloc: str, family: int = 4) -> str:
    infos = Netns(alloc).ip_json("addr", "show", "eth0")[0]["addr_info"]
    want = "inet" if family == 4 else "inet6"
    return next(a["local"] for a in infos if a["family"] == want and a.get("scope") == "global")


# ------------------------------------------------------------------ (a) Docker, in a sandbox

def _sandbox_or_skip(tmp_path: Any) -> Cell:
    if not all(shutil.which(t) for t in ("unshare", "nsenter", "dockerd", "docker", "nft",
                                          "iptables-nft")):
        pytest.skip("needs dockerd, docker, nft, unshare and nsenter")
    return Cell("nft", "no-dockerd", "none", str(tmp_path))


@contextlib.contextmanager
def _sandbox(tmp_path: Any) -> Iterator[Cell]:
    c = _sandbox_or_skip(tmp_path)
    try:
        yield c
    finally:
        c.close()  # the agent, destroy, dockerd, the mount namespace, the host namespace


def _network(c: Cell, name: str | None = None) -> tuple[str, str, str]:
    """A Docker network (created by the sandbox's dockerd unless ``name`` is "bridge"):
    its Linux bridge, subnet and gateway."""
    if name is None:
        name = unique("n")
        c.run(*DOCKER, "network", "create", name)
    info = json.loads(c.run(*DOCKER, "network", "inspect", name).stdout)[0]
    ipam = info["IPAM"]["Config"][0]
    bridge = info["Options"].get("com.docker.network.bridge.name") or f"br-{info['Id'][:12]}"
    # docker0's inspect names no gateway: it is the bridge's address, the subnet's first
    gateway = ipam.get("Gateway") or str(ipaddress.ip_network(ipam["Subnet"])[1])
    return bridge, ipam["Subnet"], gateway


@contextlib.contextmanager
def _on_bridge(host: Netns, bridge: str, subnet: str, gateway: str) -> Iterator[Netns]:
    """A namespace with a port on ``bridge`` (a Docker network's), an address of its subnet
    and the network's gateway as its default route: what a container there sends."""
    name = unique("d")
    sh("ip", "netns", "add", name)
    try:
        hv, pv = f"{name[-6:]}h", f"{name[-6:]}p"
        sh("ip", "link", "add", hv, "netns", host.name, "type", "veth", "peer", "name", pv,
           "netns", name)
        sh("ip", "-n", host.name, "link", "set", hv, "master", bridge, "up")
        net = ipaddress.ip_network(subnet)
        sh("ip", "-n", name, "addr", "add", f"{net[200]}/{net.prefixlen}", "dev", pv)
        sh("ip", "-n", name, "link", "set", pv, "up")
        sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ip", "-n", name, "route", "add", "default", "via", gateway)
        yield Netns(name)
    finally:
        sh("ip", "netns", "del", name, check=False)


def _plan(c: Cell, cfg: str) -> tuple[int, str]:
    r = c.reconcile("plan", "--no-agent", cfg)
    return r.returncode, r.stdout + r.stderr


def test_docker_networks_and_a_dockerd_restart_open_no_allocation_port(
        tmp_path: Any, request: pytest.FixtureRequest) -> None:
    """dockerd starts after the apply (its docker0 accepts land above our jump), then creates
    networks and restarts: from its networks nothing but the declared map reaches the
    allocation, once the position drift the plan shows is applied."""
    with _sandbox(tmp_path) as c:
        a = unique("g")
        cfg = _cfg(tmp_path, a)
        r = c.reconcile("apply", cfg)
        assert r.returncode == 0, r.stdout + r.stderr
        addr = _address(a)
        with serving(a, (22, 80)):
            c.start_dockerd()
            bridge, subnet, gw = _network(c)
            with _on_bridge(c.host, bridge, subnet, gw) as peer:
                # what the issue found: dockerd's `-i br-X ! -o br-X -j ACCEPT` above our jump
                assert scan(peer, addr, [22, 80]) == [22, 80]
                rc, out = _plan(c, cfg)
                assert rc == 2, out  # main: 0, "No changes"
                assert re.search(r"-i (docker0|br-\w+) ! -o (docker0|br-\w+) -j ACCEPT", out), out
                v = c.reconcile("verify", "--no-probe", cfg)
                assert v.returncode == 1, v.stdout + v.stderr
                # SPEC §13: a long line wraps at 200 characters; the words are what count
                assert "ahead of the jump to RECONCILER-FORWARD" in " ".join(v.stdout.split()), \
                    v.stdout
                r = c.reconcile("apply", cfg)
                assert r.returncode == 0, r.stdout + r.stderr
                assert scan(peer, addr, [22, 80]) == []
                assert fetch(peer, gw, 8080) == "ok 80"  # the declared map, from that network
                rules = c.run("iptables", "-S", "DOCKER-USER").stdout.splitlines()
                assert rules[1] == f"-A DOCKER-USER {JUMP}", rules  # first in DOCKER-USER
                assert _plan(c, cfg)[0] == 0
                # another network after the heal: dockerd's new accepts are above our jump in
                # FORWARD, behind DOCKER-USER: nothing to heal, nothing open
                bridge2, subnet2, gw2 = _network(c)
                with _on_bridge(c.host, bridge2, subnet2, gw2) as peer2:
                    assert scan(peer2, addr, [22, 80]) == []
                    assert _plan(c, cfg)[0] == 0
                    c.stop_dockerd()
                    c.start_dockerd()
                    assert scan(peer, addr, [22, 80]) == []
                    assert scan(peer2, addr, [22, 80]) == []
                    assert fetch(peer2, gw2, 8080) == "ok 80"
                    assert _plan(c, cfg)[0] == 0
        forward = c.run("iptables", "-S", "FORWARD").stdout
        report(request, "after 2 networks and a restart, FORWARD: "
                        + " | ".join(forward.splitlines()[1:4]) + " | ...")


class _Monitor:
    """``nft monitor rules`` in the sandbox, each line stamped as it arrives: when another
    manager's rule landed and when our jump was written again."""

    def __init__(self, c: Cell) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen([*c.enter(), "nft", "monitor", "rules"],
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        time.sleep(0.3)  # subscribed before anything happens

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.strip()))

    def first(self, pattern: str, after: float = 0.0) -> float | None:
        rx = re.compile(pattern)
        return next((t for t, line in self.lines if t >= after and rx.search(line)), None)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


#: rounds of "another manager inserts an accept at the top of FORWARD" after dockerd's start
ROUNDS = 7


def test_a_running_agent_heals_dockerd_accepts_above_its_jump_at_the_event(
        tmp_path: Any, request: pytest.FixtureRequest) -> None:
    """A ``reconcile watch`` agent (resync an hour away: only the nf_tables event can heal)
    puts its jump back ahead of dockerd's accepts when dockerd starts, and ahead of an accept
    inserted at the top of FORWARD. The [figures] line gives the window each left open: from
    the commit that put the accept above our jump to the commit of our jump's heal."""
    with _sandbox(tmp_path) as c:
        a = unique("g")
        cfg = _cfg(tmp_path, a)
        r = c.reconcile("apply", cfg)
        assert r.returncode == 0, r.stdout + r.stderr
        addr = _address(a)
        c.interval = NFT_INTERVAL
        c.start_agent(cfg)
        mon = _Monitor(c)
        windows: list[float] = []
        try:
            with serving(a, (22, 80)):
                t0 = time.monotonic()
                c.start_dockerd()

                def in_docker_user() -> bool:
                    return JUMP in c.run("iptables", "-S", "DOCKER-USER", check=False).stdout

                _wait(in_docker_user, 30, "the agent's jump in DOCKER-USER")
                opened = mon.first(r"add rule ip filter FORWARD .*iifname \"docker0\" .*accept",
                                   t0) or mon.first(r"rule ip filter FORWARD .*accept", t0)
                healed = mon.first(r"rule ip filter DOCKER-USER .*jump RECONCILER-FORWARD", t0)
                assert opened is not None and healed is not None, mon.lines
                start_window = healed - opened
                bridge, subnet, gw = _network(c, "bridge")  # docker0
                with _on_bridge(c.host, bridge, subnet, gw) as peer:
                    assert scan(peer, addr, [22, 80]) == []
                    assert fetch(peer, gw, 8080) == "ok 80"
                    for _ in range(ROUNDS):
                        # dockerd's own shape, inserted at the top (above DOCKER-USER)
                        rule = ("-i", bridge, "!", "-o", bridge, "-j", "ACCEPT")
                        t1 = time.monotonic()
                        c.run("iptables", "-I", "FORWARD", "1", *rule)

                        def first_again() -> bool:
                            top = c.run("iptables", "-S", "FORWARD").stdout.splitlines()[1]
                            return top == f"-A FORWARD {JUMP}"

                        _wait(first_again, 30, "our jump first in FORWARD again")
                        ins = mon.first(r"insert rule ip filter FORWARD .*accept", t1)
                        back = mon.first(r"rule ip filter FORWARD .*jump RECONCILER-FORWARD", t1)
                        assert ins is not None and back is not None, mon.lines[-10:]
                        windows.append(back - ins)
                        assert scan(peer, addr, [22, 80]) == []
                        c.run("iptables", "-D", "FORWARD", *rule)
                    assert _plan(c, cfg)[0] == 0
            logged = c.agent_log()
            assert any(r.get("msg", "").startswith("drift: nftables commit") for r in logged)
            assert not any("resync" in r.get("reasons", ()) for r in logged
                           if r.get("result") == "applied")
        finally:
            mon.close()
        load = os.getloadavg()
        report(request, f"window from another manager's accept above our jump to our jump "
                        f"healed by the agent at the nf_tables event: dockerd start "
                        f"{start_window * 1000:.0f} ms; accept inserted at the top of FORWARD, "
                        f"{ROUNDS} rounds: median {statistics.median(windows) * 1000:.0f} ms, "
                        f"min {min(windows) * 1000:.0f}, max {max(windows) * 1000:.0f} ms "
                        f"(load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
                        f"{os.cpu_count()} CPUs)")


# ------------------------------------------------------------------ (a) both families, no Docker

def test_an_accept_above_the_jump_is_drift_in_both_families(host_ns: Netns,
                                                            tmp_path: Any) -> None:
    """Another manager's accept inserted at the top of FORWARD and of ip6tables' FORWARD: a
    routed client reaches the allocation's undeclared ports until apply moves our jumps back
    to the top (the other manager's rules stay); plan and verify say so, and the probe that
    goes straight to the allocation names the rule that let it in."""
    a = unique("g")
    cfg = _cfg(tmp_path, a, v6=True)
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    addrs = {4: _address(a, 4), 6: _address(a, 6)}
    foreign = {4: ("-d", CIDR, "-j", "ACCEPT"), 6: ("-d", CIDR6, "-j", "ACCEPT")}
    tool = {4: "iptables", 6: "ip6tables"}
    with client_of(host_ns) as client, serving(a, (22, 80)):
        for f in (4, 6):
            host_ns.run(tool[f], "-I", "FORWARD", "1", *foreign[f])
        assert {f: scan(client, addrs[f], [22, 80]) for f in (4, 6)} == {4: [22, 80], 6: [22, 80]}
        p = host_ns.reconcile("plan", cfg)
        assert p.rc == 2, p.all  # main: 0, "No changes"
        assert f"-A FORWARD -d {CIDR} -j ACCEPT" in p.out, p.out
        assert f"-A FORWARD -d {CIDR6} -j ACCEPT" in p.out, p.out
        v = host_ns.reconcile("verify", cfg)
        assert v.rc == 1, v.all
        direct = [line for line in v.all.splitlines() if "directly" in line]
        assert direct and all("-d 10.231.0.0/24 -j ACCEPT" in line or
                              "-d fd00:231::/64 -j ACCEPT" in line for line in direct), v.all
        r = host_ns.reconcile("apply", cfg)
        assert r.rc == 0, r.all
        assert {f: scan(client, addrs[f], [22, 80]) for f in (4, 6)} == {4: [], 6: []}
        assert fetch(client, HOST_IP, 8080) == "ok 80"
        assert fetch(client, HOST_IP6, 8080) == "ok 80"
        for f in (4, 6):
            rules = host_ns.run(tool[f], "-S", "FORWARD").stdout.splitlines()
            assert rules[1:3] == [f"-A FORWARD {JUMP}",
                                  f"-A FORWARD {' '.join(foreign[f])}"], rules
        assert host_ns.reconcile("plan", cfg).rc == 0
        assert host_ns.reconcile("verify", cfg).rc == 0


# ------------------------------------------------------------------ (b) iptables-legacy

#: (what is injected, with which tool and arguments; the words that must name it; whether
#: it breaks a routed client's connection, else the host's own). A legacy FORWARD DROP is
#: passed by the mark shim now (tests/integration/firewall/test_shim.py)
LEGACY = {
    "output-subnet-drop": (("iptables-legacy", "-A", "OUTPUT", "-d", CIDR, "-j", "DROP"),
                           f"iptables-legacy filter/OUTPUT: -A OUTPUT -d {CIDR} -j DROP", False),
    "nat-hijack": (("iptables-legacy", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport",
                    "8080", "-j", "REDIRECT", "--to-ports", "9"),
                   "iptables-legacy nat/PREROUTING: -A PREROUTING -p tcp -m tcp --dport 8080 "
                   "-j REDIRECT --to-ports 9", True),
    "ip6-output-subnet-drop": (("ip6tables-legacy", "-A", "OUTPUT", "-d", CIDR6, "-j", "DROP"),
                               f"ip6tables-legacy filter/OUTPUT: -A OUTPUT -d {CIDR6} -j DROP",
                               False),
}


@pytest.mark.parametrize("case", sorted(LEGACY))
def test_a_legacy_rule_on_a_declared_path_is_named(host_ns: Netns, tmp_path: Any,
                                                   case: str) -> None:
    """iptables-legacy beside iptables-nft: a legacy OUTPUT DROP of the subnet, a legacy
    REDIRECT of a mapped host port, an ip6tables-legacy OUTPUT DROP. Each breaks the map
    (from a routed client, or from the host); plan and apply exit 1 naming it (no "No
    changes", exit 0), verify fails naming it, and the failed probe's cause names it."""
    if not shutil.which("iptables-legacy") or not shutil.which("ip6tables-legacy"):
        pytest.skip("needs iptables-legacy")
    cmd, named, routed = LEGACY[case]
    a = unique("g")
    cfg = _cfg(tmp_path, a, v6=True)
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    target = HOST_IP6 if cmd[0].startswith("ip6") else HOST_IP
    with client_of(host_ns) as client, serving(a, (80,), ()):
        sender = client if routed else host_ns
        assert fetch(sender, target, 8080) == "ok 80"
        host_ns.run(*cmd)
        assert fetch(sender, target, 8080, timeout=1.0) == ""  # it breaks the map
        p = host_ns.reconcile("plan", cfg)
        assert p.rc == 1, p.all  # main: 0, "No changes"
        assert named in p.all, p.all
        r = host_ns.reconcile("apply", cfg)
        assert r.rc == 1 and named in r.all, r.all
        v = host_ns.reconcile("verify", cfg)
        assert v.rc == 1, v.all
        assert named in v.all, v.all
        failed = [line for line in v.out.splitlines() if line.startswith("probe failed:")]
        assert any(named in line for line in failed), v.out
