"""Docker networks end to end through the CLI, against the real dockerd.

Host resources of the same files go into a throwaway namespace (``host_ns``);
Docker networks are global to the daemon, so every network name starts with a
per-test ``unique()`` prefix, and the ``scratch`` fixture removes everything
under it (and fails the test if something stays behind). Results are checked
with the docker CLI (``docker network inspect``), not with our observer.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from reconciler.domain.docker import SCOPE_LABEL, ula_subnet
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from tests.support.dockercli import (
    bridge_mtu,
    docker,
    endpoint,
    ids,
    inspect,
    networks_file,
    no_traceback,
    subnets,
)
from tests.support.dockerscratch import DockerScratch
from tests.support.host import EXAMPLES, Netns, write

pytestmark = [pytest.mark.docker, pytest.mark.root]


DOWN = {"DOCKER_HOST": "unix:///nonexistent.sock"}


# --------------------------------------------------------------------------


def test_apply_creates_kind_network_then_plan_is_empty(host_ns: Netns, docker_scratch: DockerScratch,
                                                       tmp_path: Any) -> None:
    name = docker_scratch.name("kind")
    f = networks_file(tmp_path, f"{{name: {name}, ipv6: true, labels: {{team: infra}}}}")
    r = host_ns.reconcile("plan", f)
    assert r.rc == 2, r.all
    assert f"+ docker_network {name}: not present" in r.out
    assert f"subnet6 = {ula_subnet(name, 0)} (derived)" in r.out
    assert ids(name) == []  # plan changes nothing

    r = host_ns.reconcile("apply", f)
    assert r.rc == 0, r.all
    attrs = inspect(name)
    assert attrs["Driver"] == "bridge" and attrs["EnableIPv6"] is True
    assert str(ula_subnet(name, 0)) in subnets(attrs)
    assert attrs["Labels"][DOCKER_LABEL] == DOCKER_LABEL_VALUE
    assert attrs["Labels"][SCOPE_LABEL] == f"netns/{host_ns.name}"
    assert attrs["Labels"]["team"] == "infra"
    assert attrs["Options"]["com.docker.network.bridge.enable_ip_masquerade"] == "true"
    if bridge_mtu():
        assert attrs["Options"]["com.docker.network.driver.mtu"] == bridge_mtu()

    r = host_ns.reconcile("plan", f)
    assert r.rc == 0 and "No changes." in r.out, r.all
    r = host_ns.reconcile("show")
    assert r.rc == 0 and f"docker network {name} ({attrs['Id'][:12]})" in r.out, r.all
    r = host_ns.reconcile("show", "--output", "json")
    assert name in [d["name"] for d in json.loads(r.out)["docker_networks"]]


def test_mtu_change_is_a_replace_with_the_reason(host_ns: Netns, docker_scratch: DockerScratch,
                                                 tmp_path: Any) -> None:
    name = docker_scratch.name("mtu")
    assert host_ns.reconcile("apply", networks_file(tmp_path, f"{{name: {name}}}")).rc == 0
    before = ids(name)
    changed = networks_file(tmp_path, f"{{name: {name}, mtu: 1400}}", name="c.yaml")
    r = host_ns.reconcile("plan", changed)
    assert r.rc == 2, r.all
    assert f"-/+ docker_network {name}: mtu differ" in r.out
    assert f"mtu: {bridge_mtu() or '(unset)'} -> 1400" in r.out
    r = host_ns.reconcile("apply", changed)
    assert r.rc == 0, r.all
    assert inspect(name)["Options"]["com.docker.network.driver.mtu"] == "1400"
    assert ids(name) != before and len(ids(name)) == 1
    assert host_ns.reconcile("plan", changed).rc == 0


def test_network_deleted_out_of_band_is_planned_again(host_ns: Netns, docker_scratch: DockerScratch,
                                                      tmp_path: Any) -> None:
    name = docker_scratch.name("oob")
    f = networks_file(tmp_path, f"{{name: {name}, ipv6: true}}")
    assert host_ns.reconcile("apply", f).rc == 0
    docker("network", "rm", name)
    r = host_ns.reconcile("plan", f)
    assert r.rc == 2 and f"+ docker_network {name}: not present" in r.out, r.all
    assert host_ns.reconcile("apply", f).rc == 0
    assert len(ids(name)) == 1


def test_prune_removes_only_ours(host_ns: Netns, docker_scratch: DockerScratch, tmp_path: Any) -> None:
    a, b, c = docker_scratch.name("a"), docker_scratch.name("b"), docker_scratch.name("c")
    foreign, other_scope = docker_scratch.name("foreign"), docker_scratch.name("other")
    assert host_ns.reconcile("apply", networks_file(tmp_path, f"{{name: {a}}}",
                                                    f"{{name: {b}}}")).rc == 0
    docker("network", "create", foreign)
    # ours, but made by another reconciler sharing this daemon (the host, another sandbox)
    docker("network", "create", "--label", f"{DOCKER_LABEL}={DOCKER_LABEL_VALUE}",
           "--label", f"{SCOPE_LABEL}=netns/elsewhere", other_scope)

    only_a = networks_file(tmp_path, f"{{name: {a}}}", name="a.yaml")
    r = host_ns.reconcile("plan", only_a)
    assert r.rc == 2, r.all
    assert f"- docker_network {b}: no longer declared" in r.out
    assert foreign not in r.out and other_scope not in r.out
    r = host_ns.reconcile("apply", only_a)
    assert r.rc == 0, r.all
    assert ids(b) == [] and len(ids(a)) == 1
    assert len(ids(foreign)) == 1 and len(ids(other_scope)) == 1
    assert "bridge" in docker("network", "ls", "--format", "{{.Name}}").split()

    # a declared name taken by a network we did not create: a conflict, left untouched
    docker("network", "create", c)
    c_id = ids(c)
    a_and_c = networks_file(tmp_path, f"{{name: {a}}}", f"{{name: {c}}}", name="ac.yaml")
    r = host_ns.reconcile("plan", a_and_c)
    assert r.rc == 1, r.all
    assert f"! docker_network {c}" in r.out and f"--adopt docker_network/{c}" in r.out
    r = host_ns.reconcile("apply", a_and_c)
    assert r.rc == 1 and "blocked" in r.err, r.all
    no_traceback(r)
    assert ids(c) == c_id and DOCKER_LABEL not in (inspect(c)["Labels"] or {})
    # destroy never touches foreign networks either
    r = host_ns.reconcile("destroy", "--yes")
    assert r.rc == 0, r.all
    assert ids(a) == [] and ids(c) == c_id and len(ids(foreign)) == 1
    assert len(ids(other_scope)) == 1

    # adopting it re-creates it with our label
    r = host_ns.reconcile("apply", "--adopt", f"docker_network/{c}", a_and_c)
    assert r.rc == 0, r.all
    assert ids(c) != c_id and inspect(c)["Labels"][DOCKER_LABEL] == DOCKER_LABEL_VALUE
    assert host_ns.reconcile("plan", a_and_c).rc == 0


def test_attached_containers_block_replace_unless_forced_then_keep_addresses(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any) -> None:
    name = docker_scratch_image.name("kc")
    f = networks_file(tmp_path, f"{{name: {name}, ipv6: true}}")
    assert host_ns.reconcile("apply", f).rc == 0
    net_id = ids(name)
    c1, c2 = docker_scratch_image.container("c1"), docker_scratch_image.container("c2")
    docker_scratch_image.attach(c1, name, aliases=["web"])
    docker_scratch_image.attach(c2, name, aliases=["db", "cache"])
    before = {c.id: endpoint(c, name) for c in (c1, c2)}
    for ep in before.values():
        assert ep["IPAddress"] and ep["GlobalIPv6Address"], ep

    changed = networks_file(tmp_path, f"{{name: {name}, ipv6: true, mtu: 1400}}",
                            name="c.yaml")
    r = host_ns.reconcile("plan", changed)
    assert r.rc == 1, r.all
    assert f"! docker_network {name}" in r.out
    assert "replace refused: 2 containers attached" in r.out and "--force-replace" in r.out
    r = host_ns.reconcile("apply", changed)
    assert r.rc == 1 and "blocked" in r.err, r.all
    no_traceback(r)
    assert ids(name) == net_id

    r = host_ns.reconcile("apply", "--force-replace", changed)
    assert r.rc == 0, r.all
    assert ids(name) != net_id
    assert inspect(name)["Options"]["com.docker.network.driver.mtu"] == "1400"
    for c in (c1, c2):
        old, new = before[c.id], endpoint(c, name)
        assert new["IPAddress"] == old["IPAddress"]
        assert new["GlobalIPv6Address"] == old["GlobalIPv6Address"]
        assert set(old["Aliases"]) - {c.id[:12]} <= set(new["Aliases"] or [])
    assert host_ns.reconcile("plan", changed).rc == 0


def test_duplicates_of_ours_are_deduped_keeping_the_one_with_containers(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any) -> None:
    name = docker_scratch_image.name("dup")
    labels = {DOCKER_LABEL: DOCKER_LABEL_VALUE, SCOPE_LABEL: f"netns/{host_ns.name}"}
    made = [docker_scratch_image.client.api.create_network(name, driver="bridge", labels=labels,
                                                  check_duplicate=False)["Id"]
            for _ in range(3)]
    if len(ids(name)) != 3:
        pytest.skip("this dockerd refuses duplicate network names")
    busy = max(made)  # not the lowest ID: the container count must decide
    docker_scratch_image.attach(docker_scratch_image.container("c"), busy)
    f = networks_file(tmp_path, f"{{name: {name}}}")
    r = host_ns.reconcile("plan", f)
    assert r.rc == 2, r.all
    assert f"~ docker_network {name}: 2 duplicates, keeping {busy[:12]}" in r.out
    r = host_ns.reconcile("apply", f)
    assert r.rc == 0, r.all
    assert ids(name) == [busy]
    assert host_ns.reconcile("plan", f).rc == 0


def test_daemon_down_host_resources_still_apply_then_next_run_converges(
        host_ns: Netns, docker_scratch: DockerScratch, tmp_path: Any) -> None:
    name = docker_scratch.name("down")
    f = networks_file(tmp_path, f"{{name: {name}, ipv6: true}}",
                      extra="bridges:\n  - {name: rtdown0, mtu: 1400}\n")
    expected = ("error: docker: daemon unreachable at unix:///nonexistent.sock: socket not "
                "found — docker networks not planned")
    r = host_ns.reconcile("plan", f, env=DOWN)
    assert r.rc == 1, r.all
    assert "+ bridge rtdown0" in r.out and expected in r.out
    r = host_ns.reconcile("apply", f, env=DOWN)
    assert r.rc == 1, r.all
    no_traceback(r)
    assert [ln for ln in r.err.splitlines() if "docker" in ln] == [expected]
    assert host_ns.link("rtdown0")["mtu"] == 1400
    assert ids(name) == []
    # a host-only file is not bothered by the missing daemon at all
    host_only = write(tmp_path, "h.yaml", "version: 1\nbridges:\n  - {name: rtdown0, mtu: 1400}\n")
    r = host_ns.reconcile("apply", "--no-prune", host_only, env=DOWN)
    assert r.rc == 0 and "docker" not in r.all, r.all

    r = host_ns.reconcile("apply", f)
    assert r.rc == 0, r.all
    assert "No changes." not in r.out and len(ids(name)) == 1
    assert host_ns.reconcile("plan", f).rc == 0


def test_example_kind_network_applies_and_destroys(host_ns: Netns, docker_scratch: DockerScratch,
                                                   tmp_path: Any) -> None:
    with open(os.path.join(EXAMPLES, "kind-network.yaml")) as fh:
        text = fh.read()
    assert "  - name: kind\n" in text
    name = docker_scratch.name("kind")
    f = write(tmp_path, "kind-network.yaml", text.replace("  - name: kind\n",
                                                          f"  - name: {name}\n"))
    r = host_ns.reconcile("apply", f)
    assert r.rc == 0, r.all
    attrs = inspect(name)
    assert attrs["EnableIPv6"] is True and str(ula_subnet(name, 0)) in subnets(attrs)
    assert host_ns.reconcile("plan", f).rc == 0
    r = host_ns.reconcile("destroy", "--yes")
    assert r.rc == 0 and f"- docker_network {name}" in r.out, r.all
    assert ids(name) == []
