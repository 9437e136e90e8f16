"""The address space reads every routing table an ip rule selects, and a sandbox's own routing.

A route in table 52 (Tailscale's) over a declared subnet is a conflict naming the table;
in a ``--netns`` sandbox a Docker network (in the daemon's namespace) is a warning.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.allocs import subnet_config as _config
from tests.support.dockerscratch import DockerScratch
from tests.support.host import Netns, sh, unique, write

pytestmark = pytest.mark.root




# ------------------------------------------------------------------ item 4: address space


def _foreign_link(host: Netns) -> str:
    """A veth pair of someone else's in the sandbox (a VPN's tunnel, say), up."""
    name = unique("v")
    sh("ip", "-n", host.name, "link", "add", name, "type", "veth", "peer", "name", name + "p")
    sh("ip", "-n", host.name, "link", "set", name, "up")
    sh("ip", "-n", host.name, "link", "set", name + "p", "up")
    return name


def test_a_route_in_a_table_an_ip_rule_selects_is_a_conflict_naming_the_table(
        host_ns: Netns, tmp_path: Any) -> None:
    """Tailscale's table 52 (selected by its rule 5270); a table no rule selects is nobody's
    routing and is left out."""
    link = _foreign_link(host_ns)
    sh("ip", "-n", host_ns.name, "route", "add", "10.232.0.0/16", "dev", link, "table", "52")
    sh("ip", "-n", host_ns.name, "rule", "add", "pref", "5270", "lookup", "52")
    sh("ip", "-n", host_ns.name, "route", "add", "10.233.0.0/16", "dev", link, "table", "4242")
    bridge = unique("b")
    clash = _config(tmp_path, bridge, "10.232.7.0/24", [], "clash.yaml")
    plan = host_ns.reconcile("plan", "--no-agent", clash)
    assert plan.rc == 1, plan.all
    assert f"overlaps route 10.232.0.0/16 on {link} in table 52" in plan.out, plan.all
    applied = host_ns.reconcile("apply", clash)
    # the subnet is blocked (SPEC §11): its bridge may be made, its gateway is not
    assert applied.rc == 1 and "resource(s) blocked" in applied.err, applied.all
    assert not any(a.startswith("10.232.") for a in host_ns.addrs(bridge))
    free = _config(tmp_path, bridge, "10.233.7.0/24", [], "free.yaml")
    plan = host_ns.reconcile("plan", "--no-agent", free)
    assert plan.rc == 2 and "overlaps" not in plan.all, plan.all


@pytest.mark.docker
def test_in_a_sandbox_a_docker_network_of_another_namespace_is_a_warning(
        host_ns: Netns, tmp_path: Any, docker_scratch: DockerScratch) -> None:
    """The shared daemon's networks live in its own namespace, not the sandbox's: a subnet
    over one (the CNI test vector 10.0.0.0/8) cannot collide with the sandbox's routing.
    A declared Docker network over another one still conflicts: one daemon."""
    import docker  # noqa: PLC0415 (the fixture skipped the test without it)

    client = docker_scratch.client
    other, subnet = docker_scratch.name("ten"), None
    for third in range(240, 256):
        candidate = f"10.{third}.77.0/24"
        try:
            client.api.create_network(other, driver="bridge", ipam=docker.types.IPAMConfig(
                pool_configs=[docker.types.IPAMPool(subnet=candidate)]))
        except docker.errors.APIError as exc:
            if "overlap" not in str(exc):
                raise
            continue
        subnet = candidate
        break
    assert subnet is not None, "no free 10.x/24 for the test's Docker network"
    path = _config(tmp_path, unique("b"), "10.0.0.0/8", [])
    plan = host_ns.reconcile("plan", "--no-agent", path)
    assert plan.rc == 2, plan.all
    assert f"docker network {other} ({subnet}" in plan.all and "warning" in plan.all, plan.all
    mine = docker_scratch.name("mine")
    clash = write(tmp_path, "docker.yaml", json.dumps(
        {"version": 1, "docker_networks": [{"name": mine, "subnet": subnet}]}) + "\n")
    plan = host_ns.reconcile("plan", "--no-agent", clash)
    assert plan.rc == 1 and f"docker network {other} ({subnet}" in plan.out, plan.all
