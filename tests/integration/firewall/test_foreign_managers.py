"""Other firewall managers beside our table (issue 26), against the real kernel.

(a) Another manager's ACCEPT first in ``FORWARD`` (dockerd inserts its per-network
accepts at the top whenever it starts or creates a network) opens no allocation port:
the isolation drop is in our own forward chain, which runs before every filter chain. The Docker cases run a private dockerd in a sandbox of its own (the
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
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cells import Cell
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
    """dockerd starts after the apply (its accepts land first in ``FORWARD``), creates
    networks and restarts: from docker0 and from its networks nothing but the declared map
    reaches the allocation, at every step and with no pass in between: our isolation drop
    runs in our own forward chain before every filter chain (issue 26, item 2)."""
    with _sandbox(tmp_path) as c:
        a = unique("g")
        cfg = _cfg(tmp_path, a)
        r = c.reconcile("apply", cfg)
        assert r.returncode == 0, r.stdout + r.stderr
        addr = _address(a)
        with serving(a, (22, 80)):
            c.start_dockerd()
            nets = [_network(c, "bridge"), _network(c)]
            with _on_bridge(c.host, *nets[0]) as peer0, _on_bridge(c.host, *nets[1]) as peer1:
                # main before the table: [22, 80] from both (dockerd's -i br ! -o br ACCEPT)
                assert scan(peer0, addr, [22, 80]) == []
                assert scan(peer1, addr, [22, 80]) == []
                assert fetch(peer1, nets[1][2], 8080) == "ok 80"  # the declared map
                bridge2, subnet2, gw2 = _network(c)
                with _on_bridge(c.host, bridge2, subnet2, gw2) as peer2:
                    assert scan(peer2, addr, [22, 80]) == []
                    c.stop_dockerd()
                    c.start_dockerd()
                    for peer in (peer0, peer1, peer2):
                        assert scan(peer, addr, [22, 80]) == []
                    assert fetch(peer2, gw2, 8080) == "ok 80"
        forward = c.run("iptables", "-S", "FORWARD").stdout
        report(request, "after 2 networks and a restart, with no pass since the apply, "
                        "nothing but the map open; FORWARD: "
                        + " | ".join(forward.splitlines()[1:4]) + " | ...")


# ------------------------------------------------------------------ (a) both families, no Docker

def test_an_accept_first_in_forward_opens_nothing_in_both_families(host_ns: Netns,
                                                                   tmp_path: Any) -> None:
    """Another manager's accept inserted at the top of FORWARD and of ip6tables' FORWARD opens
    no undeclared port, and is nobody's drift: plan has nothing to do."""
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
        assert {f: scan(client, addrs[f], [22, 80]) for f in (4, 6)} == {4: [], 6: []}
        assert fetch(client, HOST_IP, 8080) == "ok 80"
        assert fetch(client, HOST_IP6, 8080) == "ok 80"
        p = host_ns.reconcile("plan", cfg)
        assert p.rc == 0, p.all
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
