"""A revert's re-creation of a Docker network against the real dockerd
(``drivers/docker/snapshot``, review 2 item 1): a recorded container removed in the
window is named as gone and is no failure; a rebuild never detaches a container the
checkpoint does not list. Attachments are read back with the docker CLI."""

from __future__ import annotations

import json
import secrets
import subprocess
from typing import Any

import pytest

from reconciler.domain.docker import SCOPE_LABEL
from reconciler.domain.errors import ConflictError
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.drivers.docker import snapshot
from tests.support.dockerscratch import DockerScratch

pytestmark = [pytest.mark.docker, pytest.mark.root]



def _attached(network: str) -> dict[str, str]:
    """Container name -> IPv4 address on ``network``, as ``docker network inspect`` says."""
    out = subprocess.run(["docker", "network", "inspect", network], check=True,
                         capture_output=True, text=True).stdout
    return {c["Name"]: c["IPv4Address"].split("/")[0]
            for c in (json.loads(out)[0].get("Containers") or {}).values()}


def test_a_rebuild_reattaches_who_is_left_and_detaches_nobody_else(
        docker_scratch_image: DockerScratch) -> None:
    scratch = docker_scratch_image
    api: Any = scratch.client.api
    scope = f"test/{scratch.prefix}"
    net = scratch.name("net")
    third = secrets.randbelow(200) + 20
    subnet, gateway = f"10.197.{third}.0/24", f"10.197.{third}.1"
    ipam = {"Driver": "default", "Config": [{"Subnet": subnet, "Gateway": gateway}]}
    created = api.create_network(net, ipam=ipam, labels={
        DOCKER_LABEL: DOCKER_LABEL_VALUE, SCOPE_LABEL: scope})
    keep, leave = scratch.container("keep"), scratch.container("leave")
    scratch.attach(keep, created["Id"], ipv4_address=f"10.197.{third}.10")
    scratch.attach(leave, created["Id"], ipv4_address=f"10.197.{third}.11")
    (point,) = snapshot.snapshot(api, scope)
    assert {e.name for e in point.endpoints} == {keep.name, leave.name}

    # the window: the network goes (the change), one of its containers is removed
    for cid in (keep.id, leave.id):
        api.disconnect_container_from_network(cid, created["Id"], force=True)
    api.remove_network(created["Id"])
    api.remove_container(leave.id, force=True)

    restored = snapshot.restore(api, point)
    assert restored.gone == (leave.name,)
    assert _attached(net) == {keep.name: f"10.197.{third}.10"}

    # someone attaches a container to the restored network: a rebuild (in place of it)
    # must not take it away
    other = scratch.container("other")
    scratch.attach(other, restored.id)
    with pytest.raises(ConflictError, match=other.id[:12]):
        snapshot.restore(api, point, restored.id)
    assert set(_attached(net)) == {keep.name, other.name}
