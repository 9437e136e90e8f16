"""Safe change of Docker networks against the real dockerd: a change that replaces a network
with containers attached, prunes one and creates one is reverted without a confirm, and
`docker network inspect` / `docker inspect` (not our observer) show every network as it
was: settings, IPAM, labels, and each container at its IPv4 and IPv6 addresses with its
aliases.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest

from tests.support.dockercli import docker as docker_cli
from tests.support.dockercli import networks_file
from tests.support.dockerscratch import DockerScratch
from tests.support.figures import report
from tests.support.host import Netns, sh, unique

pytestmark = [pytest.mark.docker, pytest.mark.root]

docker = pytest.importorskip("docker")



def view(prefix: str) -> dict[str, Any]:
    """Our test's networks as the docker CLI shows them, without IDs and timestamps."""
    out: dict[str, Any] = {}
    names = docker_cli("network", "ls", "--format", "{{.Name}}").split()
    for name in sorted(n for n in names if n.startswith(prefix)):
        found = json.loads(docker_cli("network", "inspect", name, check=False) or "[]")
        if not found:
            continue  # removed meanwhile (a revert is under way)
        net = found[0]
        containers = {}
        for cid, ep in sorted((net.get("Containers") or {}).items()):
            got = json.loads(docker_cli("inspect", cid, check=False) or "[]")
            if not got:
                continue
            c = got[0]
            attached = (c["NetworkSettings"]["Networks"] or {}).get(name) or {}
            aliases = attached.get("Aliases") or []
            containers[ep["Name"]] = (ep["IPv4Address"], ep["IPv6Address"],
                                      sorted(a for a in aliases if a != cid[:12]))
        out[name] = {"driver": net["Driver"], "ipv6": net["EnableIPv6"],
                     "internal": net["Internal"], "options": net["Options"],
                     "labels": net["Labels"], "ipam": net["IPAM"]["Config"],
                     "containers": containers}
    return out


def quick_view(api: Any, prefix: str) -> dict[str, Any]:
    """``view`` through the daemon's API directly (the docker CLI costs a process per
    object): to see the moment it is restored."""
    out: dict[str, Any] = {}
    for net in api.networks():
        if not net["Name"].startswith(prefix):
            continue
        try:
            full = api.inspect_network(net["Id"])
        except docker.errors.NotFound:
            continue
        containers = {}
        for cid, ep in sorted((full.get("Containers") or {}).items()):
            try:
                c = api.inspect_container(cid)
            except docker.errors.NotFound:
                continue
            attached = (c["NetworkSettings"]["Networks"] or {}).get(full["Name"]) or {}
            containers[ep["Name"]] = (ep["IPv4Address"], ep["IPv6Address"],
                                      sorted(a for a in attached.get("Aliases") or []
                                             if a != cid[:12]))
        out[full["Name"]] = {"driver": full["Driver"], "ipv6": full["EnableIPv6"],
                             "internal": full["Internal"], "options": full["Options"],
                             "labels": full["Labels"], "ipam": full["IPAM"]["Config"],
                             "containers": containers}
    return out


def _pending(host: Netns) -> dict[str, Any] | None:
    path = os.path.join(os.environ["RECONCILER_STATE_DIR"], f"netns-{host.name}",
                        "pending.json")
    try:
        with open(path) as fh:
            rec: dict[str, Any] = json.load(fh)
            return rec
    except FileNotFoundError:
        return None


#: dockerd's own work bounds this one: re-attaching a container is ~0.3-0.6 s of its time
#: here (a veth into the container, its rules), so the host resources' T+2 s is not the bar
DOCKER_BOUND = 6.0


def test_a_docker_change_not_confirmed_is_reverted_with_its_containers(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any,
        request: pytest.FixtureRequest) -> None:
    web, old, new = (docker_scratch_image.name(s) for s in ("web", "old", "new"))
    before_file = networks_file(tmp_path, f"{{name: {web}, ipv6: true}}", f"{{name: {old}}}")
    assert host_ns.reconcile("apply", before_file).rc == 0
    c1, c2 = docker_scratch_image.container("c1"), docker_scratch_image.container("c2")
    docker_scratch_image.attach(c1, web, aliases=["api"])
    docker_scratch_image.attach(c2, web, aliases=["db", "cache"])
    before = view(docker_scratch_image.prefix)
    assert len(before[web]["containers"]) == 2 and all(
        v4 and v6 for v4, v6, _a in before[web]["containers"].values()), before

    after_file = networks_file(tmp_path, f"{{name: {web}, ipv6: true, mtu: 1400}}",
                               f"{{name: {new}}}", name="after.yaml")
    r = host_ns.reconcile("apply", "--force-replace", "--confirm-within", "3s", after_file)
    assert r.rc == 0 and "Pending until" in r.out, r.all
    changed = view(docker_scratch_image.prefix)
    assert old not in changed and new in changed
    assert changed[web]["options"].get("com.docker.network.driver.mtu") == "1400"
    rec = _pending(host_ns)
    assert rec is not None
    try:
        end = rec["deadline"] + 15
        api = docker_scratch_image.client.api
        while quick_view(api, docker_scratch_image.prefix) != before:  # restored: as docker shows it
            assert time.time() < end, "not restored"
            time.sleep(0.05)
        at = time.time()
        while _pending(host_ns) is not None:  # then verified: the record goes
            assert time.time() < end, "restored but not verified"
            time.sleep(0.1)
    finally:
        if _pending(host_ns) is not None and rec.get("reverter_pid"):
            os.kill(rec["reverter_pid"], signal.SIGKILL)
            sh("rm", "-f", os.path.join(os.environ["RECONCILER_STATE_DIR"],
                                        f"netns-{host_ns.name}", "pending.json"))
    report(request, f"docker revert (1 network replaced with 2 containers, 1 pruned, 1 "
                    f"created): restored at T+{at - rec['deadline']:.1f}s")
    assert at - rec["deadline"] <= DOCKER_BOUND, f"restored at T+{at - rec['deadline']:.1f}s"
    assert view(docker_scratch_image.prefix) == before  # and the docker CLI agrees
    # the old file plans nothing: the restored networks are what it made
    assert host_ns.reconcile("plan", before_file, "--no-agent").rc == 0


def test_a_revert_leaves_a_network_the_change_did_not_touch_as_it_is(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any) -> None:
    """The change only adds a bridge; in the window a recorded container is removed and
    someone attaches another one to our network: the revert completes and the network is
    the same one, with whoever is attached now (review 2, item 1: it was rebuilt, the
    newcomer detached, and the removed container made the revert fail)."""
    web = docker_scratch_image.name("web")
    before_file = networks_file(tmp_path, f"{{name: {web}}}")
    assert host_ns.reconcile("apply", before_file).rc == 0
    c1, c2 = docker_scratch_image.container("c1"), docker_scratch_image.container("c2")
    docker_scratch_image.attach(c1, web)
    docker_scratch_image.attach(c2, web)
    bridge = unique("b")
    after_file = networks_file(tmp_path, f"{{name: {web}}}", name="after.yaml",
                               extra=f"bridges: [{{name: {bridge}}}]\n")
    r = host_ns.reconcile("apply", "--confirm-within", "5m", after_file)
    assert r.rc == 0 and "Pending until" in r.out, r.all
    rec = _pending(host_ns)
    assert rec is not None
    net_id = json.loads(docker_cli("network", "inspect", web))[0]["Id"]
    try:
        docker_scratch_image.client.api.remove_container(c2.id, force=True)
        newcomer = docker_scratch_image.container("new")
        docker_scratch_image.attach(newcomer, web)
        r = host_ns.reconcile("revert")
        assert r.rc == 0 and "Reverted" in r.out, r.all
    finally:
        if _pending(host_ns) is not None and rec.get("reverter_pid"):
            os.kill(rec["reverter_pid"], signal.SIGKILL)
            sh("rm", "-f", os.path.join(os.environ["RECONCILER_STATE_DIR"],
                                        f"netns-{host_ns.name}", "pending.json"))
    after = json.loads(docker_cli("network", "inspect", web))[0]
    assert after["Id"] == net_id
    assert sorted(c["Name"] for c in after["Containers"].values()) == sorted(
        [c1.name, newcomer.name])
    assert host_ns.link(bridge) is None
