"""The mark shim in other managers' dropping ``FORWARD`` chains (issue 26 item 3, SPEC §12),
and the IPv6 output DNAT that leaves ``[::1]`` alone, against the real kernel.

Each test runs in the sandbox namespace of its own (``host_ns``): its iptables-nft and
iptables-legacy tables are that namespace's, never the machine's. Traffic goes only to
addresses inside namespaces the tests made. What the shim looks like is read with the
tools its owner uses: ``iptables -S``, ``iptables -C`` and ``iptables-save``.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.support.cells import Cell
from tests.support.host import Netns, unique, write
from tests.support.traffic import HOST_IP, HOST_IP6, client_of, fetch, serving

pytestmark = pytest.mark.root

BRIDGE = "rshm0"
CIDR, CIDR6 = "10.232.0.0/24", "fd00:232::/64"
SHIM = ("-m", "mark", "--mark", "0x2000/0x2000", "-m", "comment", "--comment",
        "reconciler:shim", "-j", "ACCEPT")
#: as ``iptables -S`` and ``iptables-save`` print it (they quote a comment with a colon)
SHIM_TEXT = ('-A FORWARD -m mark --mark 0x2000/0x2000 -m comment --comment "reconciler:shim" '
             "-j ACCEPT")


def _cfg(tmp_path: Any, alloc: str, *, mark: str = "") -> str:
    settings = f"settings: {{firewall_mark: {mark}}}\n" if mark else ""
    return write(tmp_path, "shim.yaml", f"""version: 1
{settings}bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: shm, bridge: {BRIDGE}, cidr: {CIDR}, cidr6: "{CIDR6}"}}]
allocs:
  - id: {alloc}
    subnet: shm
    ports: [{{host: 8080, to: 80}}]
""")


def _forward(ns: Netns, tool: str) -> list[str]:
    return ns.run(tool, "-S", "FORWARD").stdout.splitlines()


@pytest.mark.parametrize("tool", ["iptables", "iptables-legacy", "ip6tables-legacy"])
def test_the_shim_lets_declared_traffic_past_a_forward_policy_drop(
        host_ns: Netns, tmp_path: Any, tool: str) -> None:
    """``FORWARD`` policy DROP (dockerd ≤ 28's; with iptables-legacy beside our nf_tables
    rules it stopped every port map on main while apply said "No changes", exit 0): apply
    puts the shim there, written as iptables writes it (``-C`` finds it, ``-S`` and
    ``iptables-save`` print it), and traffic through the port map passes the DROP."""
    if not shutil.which(tool):
        pytest.skip(f"needs {tool}")
    a = unique("h")
    cfg = _cfg(tmp_path, a)
    host_ns.run(tool, "-P", "FORWARD", "DROP")
    host_ns.run(tool, "-A", "FORWARD", "-j", "DROP")  # a DROP rule too: the shim goes above
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    forward = _forward(host_ns, tool)
    assert SHIM_TEXT in forward, forward
    assert forward.index(SHIM_TEXT) < forward.index("-A FORWARD -j DROP"), forward
    assert host_ns.run(tool, "-C", "FORWARD", *SHIM, check=False).returncode == 0
    save = host_ns.run(tool + "-save").stdout
    assert save.count(SHIM_TEXT) == 1, save
    target = HOST_IP6 if tool.startswith("ip6") else HOST_IP
    with client_of(host_ns) as client, serving(a, (80,), ()):
        assert fetch(client, target, 8080) == "ok 80"
    assert host_ns.reconcile("plan", cfg).rc == 0
    v = host_ns.reconcile("verify", cfg)
    assert v.rc == 0, v.all
    # its loss is drift: plan shows it, apply puts it back
    host_ns.run(tool, "-D", "FORWARD", *SHIM)
    p = host_ns.reconcile("plan", cfg)
    assert p.rc != 0 and f"{tool} filter/FORWARD" in p.all, p.all
    assert host_ns.reconcile("apply", cfg).rc == 0
    assert SHIM_TEXT in _forward(host_ns, tool)
    # behind a DROP rule (someone inserted one above it): drift, moved back ahead of it
    host_ns.run(tool, "-I", "FORWARD", "1", "-p", "tcp", "-j", "DROP")
    p = host_ns.reconcile("plan", cfg)
    assert p.rc != 0 and "behind" in p.all, p.all
    assert host_ns.reconcile("apply", cfg).rc == 0
    forward = _forward(host_ns, tool)
    assert forward.index(SHIM_TEXT) < forward.index("-A FORWARD -p tcp -j DROP"), forward
    # destroy takes it away, and only it
    assert host_ns.reconcile("destroy", "--yes").rc == 0
    forward = _forward(host_ns, tool)
    assert not any("reconciler" in line for line in forward), forward
    assert "-A FORWARD -j DROP" in forward and "-P FORWARD DROP" in forward


def test_no_drop_no_shim_and_no_chain_made_for_it(host_ns: Netns, tmp_path: Any) -> None:
    """Nothing drops in ``FORWARD``: no shim. No legacy table in the namespace: none is made
    (the kernel's list of legacy tables stays empty)."""
    a = unique("h")
    assert host_ns.reconcile("apply", _cfg(tmp_path, a)).rc == 0
    assert not any("reconciler:shim" in line for line in _forward(host_ns, "iptables"))
    names = host_ns.run("cat", "/proc/net/ip_tables_names").stdout.split()
    assert names == [], names


def test_the_mark_bit_is_a_setting(host_ns: Netns, tmp_path: Any) -> None:
    """``settings.firewall_mark`` moves the bit: our table's forward chain ORs it in, the shim accepts it,
    and a change of it replaces the shim (one copy)."""
    a = unique("h")
    host_ns.run("iptables", "-P", "FORWARD", "DROP")
    assert host_ns.reconcile("apply", _cfg(tmp_path, a)).rc == 0
    r = host_ns.reconcile("apply", _cfg(tmp_path, a, mark="0x100000"))
    assert r.rc == 0, r.all
    forward = [line for line in _forward(host_ns, "iptables") if "reconciler:shim" in line]
    assert forward == [SHIM_TEXT.replace("0x2000/0x2000", "0x100000/0x100000")], forward
    table = host_ns.run("nft", "list", "table", "inet", "reconciler").stdout
    assert "meta mark set meta mark | 0x00100000" in table, table
    assert "0x00002000" not in table, table
    bad = host_ns.reconcile("plan", _cfg(tmp_path, a, mark="0x3000"))
    assert bad.rc != 0 and "firewall_mark" in bad.all and "single bit" in bad.all, bad.all


def test_a_host_service_on_ipv6_loopback_is_not_taken_by_a_port_map(
        host_ns: Netns, tmp_path: Any) -> None:
    """A service of the host on ``[::1]:8080`` beside an allocation's IPv6 map of 8080: the
    nat OUTPUT DNAT caught ``::1`` on main, and the connection hung (IPv6 has no
    ``route_localnet``: a packet from ``::1`` never leaves ``lo``)."""
    a = unique("h")
    assert host_ns.reconcile("apply", _cfg(tmp_path, a)).rc == 0
    with serving(host_ns.name, (8080,), ()), serving(a, (80,), ()):
        assert fetch(host_ns, "::1", 8080, timeout=2.0) == "ok 8080"
        with client_of(host_ns) as client:  # the map itself still works
            assert fetch(client, HOST_IP6, 8080) == "ok 80"


DOCKER = ("docker", "-H", "unix:///run/docker.sock")


def test_dockerd_keeps_working_beside_the_shim(tmp_path: Any,
                                               request: pytest.FixtureRequest) -> None:
    """A private dockerd in a sandbox (its own mount namespace, private ``/run``), FORWARD
    policy DROP as dockerd sets it: after the apply, dockerd creates and removes networks
    (its ``iptables -C/-I/-D`` on FORWARD must keep working: a native nft expression of ours
    there would make them fail with rc 3) and restarts; the shim stays, one copy, ahead of
    the chain's drops, and the declared map passes the DROP."""
    if not all(shutil.which(t) for t in ("unshare", "nsenter", "dockerd", "docker",
                                          "iptables-nft")):
        pytest.skip("needs dockerd, docker, unshare and nsenter")
    c = Cell("nft", "no-dockerd", "none", str(tmp_path))
    try:
        a = unique("h")
        cfg = _cfg(tmp_path, a)
        c.start_dockerd()
        c.run("iptables", "-P", "FORWARD", "DROP")  # what dockerd ≤ 28 sets on a real host
        r = c.reconcile("apply", cfg)
        assert r.returncode == 0, r.stdout + r.stderr
        shim = [line for line in c.run("iptables", "-S", "FORWARD").stdout.splitlines()
                if "reconciler:shim" in line]
        assert shim == [SHIM_TEXT], shim
        for _ in range(2):
            name = unique("n")
            c.run(*DOCKER, "network", "create", name)
            c.run(*DOCKER, "network", "rm", name)  # dockerd's -D of its own rules works
        c.stop_dockerd()
        c.start_dockerd()
        forward = c.run("iptables", "-S", "FORWARD").stdout.splitlines()
        assert forward.count(SHIM_TEXT) == 1, forward
        assert c.run("iptables", "-C", "FORWARD", *SHIM, check=False).returncode == 0
        assert c.run("iptables-save").stdout.count(SHIM_TEXT) == 1
        plan = c.reconcile("plan", "--no-agent", cfg)
        assert plan.returncode == 0, plan.stdout + plan.stderr
        with client_of(c.host) as client, serving(a, (80,), ()):
            assert fetch(client, HOST_IP, 8080) == "ok 80"
        request.node.user_properties.append(("FORWARD", " | ".join(forward)))
    finally:
        c.close()
