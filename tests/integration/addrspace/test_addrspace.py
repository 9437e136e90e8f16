"""One address space on the real kernel and the real dockerd (SPEC §9).

Each test acts on its own throwaway namespace ("the host"): the foreign links,
addresses and routes it makes live there and go with it. Docker networks are
global to the daemon: those a test makes carry its scratch prefix and are
removed afterwards (docker_fixtures); Docker's own networks are only read.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import time
from typing import Any

import pytest

from tests.support.agent import Agent
from tests.support.cli import reconcile
from tests.support.host import Netns, sh, unique, write

pytestmark = pytest.mark.root



def foreign_link(host: Netns, *addrs: str) -> str:
    """A veth pair in the host that is not ours (someone's VPN or LAN link), up."""
    name = unique("v")
    sh("ip", "-n", host.name, "link", "add", name, "type", "veth", "peer", "name", name + "p")
    sh("ip", "-n", host.name, "link", "set", name, "up")
    sh("ip", "-n", host.name, "link", "set", name + "p", "up")
    for a in addrs:
        sh("ip", "-n", host.name, "addr", "add", a, "dev", name)
    return name


def subnet_file(tmp_path: Any, subnets: list[dict[str, Any]], *, allocs: list[Any] = (),
                name: str = "net.yaml", docker: list[Any] = ()) -> tuple[str, list[str]]:
    bridges = sorted({s["bridge"] for s in subnets})
    doc: dict[str, Any] = {"version": 1, "bridges": [{"name": b} for b in bridges],
                           "subnets": subnets}
    if allocs:
        doc["allocs"] = list(allocs)
    if docker:
        doc["docker_networks"] = list(docker)
    return write(tmp_path, name, json.dumps(doc) + "\n"), bridges


def refused(host: Netns, path: str, *needles: str) -> str:
    """plan shows a conflict naming every needle; apply blocks it (exit 1, SPEC §11) and
    gives nothing of the blocked prefix to any link."""
    plan = host.reconcile("plan", path)
    assert plan.rc == 1, plan.all
    conflict = [ln for ln in plan.out.splitlines() if ln.lstrip().startswith("!")]
    assert conflict and all(any(n in ln for ln in conflict) for n in needles), plan.all
    applied = host.reconcile("apply", path)
    assert applied.rc == 1 and "resource(s) blocked" in applied.err, applied.all
    assert needles[0].split()[-1] in applied.err, applied.all
    prefixes = [ipaddress.ip_network(n) for n in needles if _is_prefix(n)]
    held = [a for a in sh("ip", "-n", host.name, "-br", "addr").stdout.split()
            if "/" in a and any(ipaddress.ip_interface(a).ip in p for p in prefixes)]
    assert not held or all(a in needles[-1] for a in held), held  # the foreign one stays
    assert "Traceback" not in plan.all + applied.all
    return "\n".join(conflict)


def _is_prefix(text: str) -> bool:
    try:
        ipaddress.ip_network(text)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------ overlaps refused


def test_a_subnet_over_a_foreign_route_is_refused_naming_both(host_ns: Netns, tmp_path):
    link = foreign_link(host_ns, "10.91.0.2/24")
    sh("ip", "-n", host_ns.name, "route", "add", "10.92.0.0/16", "via", "10.91.0.1")
    br = unique("b")
    path, _ = subnet_file(tmp_path, [{"name": "vpn-clash", "bridge": br,
                                      "cidr": "10.92.7.0/24"}])
    line = refused(host_ns, path, "subnet vpn-clash", "10.92.7.0/24",
                   f"route 10.92.0.0/16 via 10.91.0.1 on {link}")
    assert not host_ns.addrs(br), line  # blocked: its bridge may be made, no gateway on it


def test_a_subnet_over_a_foreign_address_is_refused_naming_both(host_ns: Netns, tmp_path):
    link = foreign_link(host_ns, "10.93.0.9/16")
    path, _ = subnet_file(tmp_path, [{"name": "lan-clash", "bridge": unique("b"),
                                      "cidr": "10.93.200.0/24"}])
    refused(host_ns, path, "subnet lan-clash", "10.93.200.0/24", f"address 10.93.0.9/16 on {link}")


def apart(host: Netns, path: str, *needles: str) -> str:
    """plan shows no conflict but a warning naming every needle: in the sandbox, Docker's
    networks are in the daemon's namespace, and cannot collide with the sandbox's routing."""
    plan = host.reconcile("plan", "--no-agent", path)
    assert plan.rc == 2, plan.all
    lines = [ln for ln in plan.all.splitlines() if "no conflict here" in ln]
    assert lines and all(any(n in ln for ln in lines) for n in needles), plan.all
    return "\n".join(lines)


@pytest.mark.docker
def test_a_subnet_inside_docker0_is_a_warning_in_a_sandbox_naming_both(
        host_ns: Netns, tmp_path, docker_client: Any, docker_scratch: Any):
    """docker0 is only read: a /24 inside its subnet (or inside a network the test makes,
    when this machine's docker0 has none). docker0 is the daemon's, in another namespace than
    the sandbox: a warning (on the host itself, where docker0 is a link, it is a conflict:
    the unit tests)."""
    bridge = docker_client.api.inspect_network("bridge")
    subnets = [c["Subnet"] for c in (bridge.get("IPAM") or {}).get("Config") or []
               if ":" not in c.get("Subnet", ":")]
    if subnets:
        net, owner = ipaddress.IPv4Network(subnets[0]), "docker network bridge"
    else:
        net = ipaddress.IPv4Network(make_docker_network(docker_client, docker_scratch, "d0"))
        owner = f"docker network {docker_scratch.name('d0')}"
    inside = list(net.subnets(new_prefix=max(24, net.prefixlen)))[-1]
    path, _ = subnet_file(tmp_path, [{"name": "in-docker0", "bridge": unique("b"),
                                      "cidr": str(inside)}])
    apart(host_ns, path, "subnet 'in-docker0'", str(inside), f"{owner} ({net}")


def make_docker_network(client: Any, scratch: Any, suffix: str, prefixlen: int = 24) -> str:
    """A Docker network of the test's own on a free random subnet; returns the subnet."""
    import docker

    for _ in range(20):
        subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/{prefixlen}"
        ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=subnet)])
        try:
            client.api.create_network(scratch.name(suffix), driver="bridge", ipam=ipam)
            return subnet
        except docker.errors.APIError as exc:
            if "overlap" not in str(exc):
                raise
    raise AssertionError("no free subnet for a test network")


@pytest.mark.docker
def test_a_docker_network_over_another_is_refused_a_sandbox_subnet_over_one_warned(
        host_ns: Netns, tmp_path, docker_client: Any, docker_scratch: Any):
    other = make_docker_network(docker_client, docker_scratch, "other")
    name = docker_scratch.name("other")
    path, _ = subnet_file(tmp_path, [{"name": "over-docker", "bridge": unique("b"),
                                      "cidr": other}])
    apart(host_ns, path, "subnet 'over-docker'", other, f"docker network {name} ({other}")
    mine = docker_scratch.name("mine")
    path = write(tmp_path, "docker.yaml", json.dumps(
        {"version": 1, "docker_networks": [{"name": mine, "subnet": other}]}) + "\n")
    refused(host_ns, path, f"docker_network {mine}", f"docker network {name} ({other}")
    assert not docker_client.api.networks(names=[mine])


@pytest.mark.docker
def test_a_docker_network_is_no_conflict_with_itself(host_ns: Netns, tmp_path,
                                                     docker_client: Any, docker_scratch: Any):
    """Its own live subnet and bridge route are the declared network: apply, plan, no change."""
    free = make_docker_network(docker_client, docker_scratch, "probe")
    docker_client.api.remove_network(docker_scratch.name("probe"))
    mine = docker_scratch.name("self")
    path = write(tmp_path, "docker.yaml", json.dumps(
        {"version": 1, "docker_networks": [{"name": mine, "subnet": free}]}) + "\n")
    first = host_ns.reconcile("apply", path)
    assert first.rc == 0, first.all
    again = host_ns.reconcile("plan", path)
    assert again.rc == 0 and "No changes" in again.out, again.all


# ------------------------------------------------------------------ auto


def pick_of(host: Netns, bridge: str, version: int = 4) -> ipaddress.IPv4Network | \
        ipaddress.IPv6Network:
    addrs = [a for a in host.addrs(bridge) if (":" in a) == (version == 6)]
    assert len(addrs) == 1, (bridge, host.addrs(bridge))
    return ipaddress.ip_interface(addrs[0]).network


def test_auto_picks_are_clear_of_the_host_stable_and_kept_when_more_are_declared(
        host_ns: Netns, tmp_path):
    pool = f"10.{random.randint(100, 199)}.0.0/20"
    first = ipaddress.IPv4Network(pool)
    taken_route = list(first.subnets(new_prefix=24))[0]  # the pool's first /24: a VPN's route
    taken_addr = list(first.subnets(new_prefix=24))[1]  # the second: the LAN's address
    link = foreign_link(host_ns, f"{taken_addr.network_address + 5}/24")
    sh("ip", "-n", host_ns.name, "route", "add", str(taken_route), "dev", link)
    b1, b2 = unique("b"), unique("b")
    auto6 = {"cidr6": "auto", "pool6": "fd00:9a::/48"}
    path, _ = subnet_file(tmp_path, [
        {"name": "m-sub", "bridge": b1, "cidr": "auto", "pool": pool, **auto6},
        {"name": "w-sub", "bridge": b2, "cidr": "auto", "pool": pool, "size": 23}],
        allocs=[{"id": unique("a"), "subnet": "m-sub"}])
    plan = host_ns.reconcile("plan", path)
    assert plan.rc == 2 and f"(auto from {pool})" in plan.out, plan.all
    applied = host_ns.reconcile("apply", path)
    assert applied.rc == 0, applied.all
    m, w = pick_of(host_ns, b1), pick_of(host_ns, b2)
    m6 = pick_of(host_ns, b1, 6)
    # clear of the route, the address and each other; in name order, the lowest free first
    for net in (m, w):
        assert net.subnet_of(first) and not net.overlaps(taken_route) \
            and not net.overlaps(taken_addr), (m, w)
    assert not m.overlaps(w) and m.prefixlen == 24 and w.prefixlen == 23
    assert m == list(first.subnets(new_prefix=24))[2], m
    assert m6 == ipaddress.IPv6Network("fd00:9a::/64")
    again = host_ns.reconcile("plan", path)  # a new process: a restart of the reconciler
    assert again.rc == 0 and "No changes" in again.out, again.all
    # more prefixes declared later, named before the others: earlier picks stay
    b3 = unique("b")
    path, _ = subnet_file(tmp_path, [
        {"name": "a-sub", "bridge": b3, "cidr": "auto", "pool": pool, "size": 22},
        {"name": "m-sub", "bridge": b1, "cidr": "auto", "pool": pool, **auto6},
        {"name": "w-sub", "bridge": b2, "cidr": "auto", "pool": pool, "size": 23}])
    applied = host_ns.reconcile("apply", path)
    assert applied.rc == 0, applied.all
    assert (pick_of(host_ns, b1), pick_of(host_ns, b2), pick_of(host_ns, b1, 6)) == (m, w, m6)
    a = pick_of(host_ns, b3)
    assert not any(a.overlaps(n) for n in (m, w, taken_route, taken_addr)), a
    # our table deleted by someone: the bridge's gateway still says which prefix it is
    host_ns.run("nft", "delete", "table", "inet", "reconciler")
    r = host_ns.reconcile("apply", path)
    assert r.rc == 0, r.all
    assert (pick_of(host_ns, b1), pick_of(host_ns, b2), pick_of(host_ns, b3)) == (m, w, a)
    assert host_ns.reconcile("plan", path).rc == 0


@pytest.mark.real_process  # the exit code and error shape of a real process
def test_an_exhausted_pool_is_a_plan_error_naming_the_pool(host_ns: Netns, tmp_path):
    pool = f"10.{random.randint(100, 199)}.{random.randint(0, 255)}.0/24"
    link = foreign_link(host_ns)
    half = ipaddress.IPv4Network(pool).subnets(new_prefix=25)
    sh("ip", "-n", host_ns.name, "route", "add", str(next(half)), "dev", link)
    path, _ = subnet_file(tmp_path, [
        {"name": "a-fits", "bridge": unique("b"), "cidr": "auto", "pool": pool, "size": 25},
        {"name": "b-does-not", "bridge": unique("b"), "cidr": "auto", "pool": pool,
         "size": 25}])
    for cmd in ("plan", "apply"):
        r = host_ns.reconcile(cmd, path)
        assert r.rc == 1 and "Traceback" not in r.all, r.all
        assert f"subnet 'b-does-not' ({path}:" in r.err and f"pool {pool} has no free /25" \
            in r.err, r.all
    assert not host_ns.ip_json("link", "show", "type", "bridge")


@pytest.mark.docker
def test_a_docker_network_with_subnet_auto_is_created_with_the_pick(
        host_ns: Netns, tmp_path, docker_client: Any, docker_scratch: Any):
    occupied = make_docker_network(docker_client, docker_scratch, "occ", prefixlen=24)
    pool = str(ipaddress.IPv4Network(occupied).supernet(new_prefix=23))
    name = docker_scratch.name("auto")
    path = write(tmp_path, "docker.yaml", json.dumps(
        {"version": 1, "docker_networks": [{"name": name, "subnet": "auto", "pool": pool,
                                            "size": 24}]}) + "\n")
    r = host_ns.reconcile("apply", path)
    assert r.rc == 0, r.all
    (net,) = docker_client.api.networks(names=[name])
    got = [c["Subnet"] for c in net["IPAM"]["Config"]]
    other = [str(n) for n in ipaddress.IPv4Network(pool).subnets(new_prefix=24)
             if str(n) != occupied]
    assert got == other, (got, occupied, pool)
    again = host_ns.reconcile("plan", path)
    assert again.rc == 0 and "No changes" in again.out, again.all


# ------------------------------------------------------------------ host_ip


def test_a_host_ip_not_on_the_host_is_a_warning_for_that_map(host_ns: Netns, tmp_path):
    br = unique("b")
    aid = unique("a")
    path, _ = subnet_file(tmp_path, [{"name": "vip", "bridge": br, "cidr": "10.94.0.0/24"}],
                          allocs=[{"id": aid, "subnet": "vip", "ports": [
                              {"host": 18081, "to": 80, "host_ip": "127.0.0.1"},
                              {"host": 18082, "to": 80, "host_ip": "10.95.0.7"}]}])
    r = host_ns.reconcile("plan", path)
    assert r.rc == 2, r.all
    warned = [ln for ln in r.out.splitlines() if ln.startswith("warning:") and aid in ln]
    assert len(warned) == 1 and "ports[1]: host_ip 10.95.0.7" in warned[0], r.all
    js = json.loads(host_ns.reconcile("plan", "--output", "json", path).out)
    assert [w for w in js["warnings"] if aid in w] == [warned[0][len("warning: "):]]
    foreign_link(host_ns, "10.95.0.7/32")  # the VIP arrives: no warning any more
    r = host_ns.reconcile("plan", path)
    assert r.rc == 2 and not any(aid in ln for ln in r.out.splitlines()
                                 if ln.startswith("warning:")), r.all


# ------------------------------------------------------------------ the agent's alarm


def test_the_agent_reports_a_foreign_overlap_within_a_second(host_ns: Netns, tmp_path):
    conf = os.path.join(str(tmp_path), "conf")
    os.mkdir(conf)
    os.chmod(str(tmp_path), 0o755)
    os.chmod(conf, 0o755)
    br = unique("b")
    cidr = f"10.{random.randint(100, 199)}.{random.randint(0, 255)}.0/24"
    path, _ = subnet_file(conf, [{"name": "owned", "bridge": br, "cidr": cidr}])
    os.chmod(path, 0o644)
    agent = Agent(host_ns, [conf], "--interval", "3600")  # type: ignore[arg-type]
    try:
        agent.converged()
        link = foreign_link(host_ns)
        half = str(next(ipaddress.IPv4Network(cidr).subnets(new_prefix=25)))
        t0 = time.monotonic()
        sh("ip", "-n", host_ns.name, "route", "add", half, "dev", link)
        doc = agent.wait_status(lambda d: d.get("address_overlaps"), 5,
                                what="the overlap in the status")
        took = time.monotonic() - t0
        (o,) = doc["address_overlaps"]
        assert o["foreign"] == f"route {half} on {link}" and o["owned"] == f"{cidr} on {br}", o
        assert took < 1.0, f"reported after {took:.2f}s"
        metrics = agent.get("/metrics") or ""
        assert "reconciler_address_overlaps 1.0" in metrics, metrics
        assert any("address overlap" in r.get("msg", "") and link in r.get("msg", "")
                   for r in agent.logs()), agent.log_text()
        text = reconcile("status", "--addr", agent.addr)  # exit 1 if a pass saw the conflict
        assert f"route {half} on {link} overlaps owned {cidr} on {br}" in text.out, text.all
        assert host_ns.link(link) is not None  # left alone
        sh("ip", "-n", host_ns.name, "route", "del", half, "dev", link)
        agent.wait_status(lambda d: d.get("address_overlaps") == [], 5,
                          what="the overlap cleared")
        assert "reconciler_address_overlaps 0.0" in (agent.get("/metrics") or "")
    finally:
        assert agent.stop() == 0



@pytest.mark.real_process  # the exit code and error shape of a real process
def test_the_address_space_example_applies_and_converges(host_ns: Netns, tmp_path):
    import yaml

    from tests.support.host import EXAMPLES

    with open(os.path.join(EXAMPLES, "address-space.yaml")) as fh:
        doc = yaml.safe_load(fh)
    ids = [unique("a") for _ in doc["allocs"]]  # namespaces are global
    for a, new in zip(doc["allocs"], ids, strict=True):
        a["id"] = new
    path = write(tmp_path, "address-space.yaml", yaml.safe_dump(doc, sort_keys=False))
    try:
        assert host_ns.reconcile("apply", path).rc == 0
        assert host_ns.addrs("apps0") == ["10.240.0.1/24", "fd00:240::1/64"]
        again = host_ns.reconcile("plan", path)
        assert again.rc == 0 and "No changes" in again.out, again.all
        assert host_ns.reconcile("destroy", "--yes").rc == 0
    finally:
        for i in ids:
            sh("ip", "netns", "del", i, check=False)
