"""A sandbox never changes another reconciler's Docker network (issue 15 item 4), real dockerd.

Two sandboxes (``--netns``) share the daemon, as the host and a sandbox, or two agents, do.
Networks are named under the test's ``unique()`` prefix and removed afterwards; results are
read with the docker CLI, never with our observer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from reconciler.domain.docker import SCOPE_LABEL
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from tests.support.dockercli import docker, ids, inspect, networks_file, no_traceback
from tests.support.host import Netns, forget_run_files, sh, unique

pytestmark = [pytest.mark.docker, pytest.mark.root]


@pytest.fixture
def second_ns() -> Iterator[Netns]:
    """Another sandbox beside ``host_ns``: another reconciler sharing the daemon."""
    name = unique("s")
    sh("ip", "netns", "add", name)
    inode = os.stat(f"/run/netns/{name}").st_ino
    ns = Netns(name)
    try:
        yield ns
    finally:
        ns.reconcile("destroy", "--yes", "--lock-timeout", "20")
        sh("ip", "netns", "del", name, check=False)
        forget_run_files(inode)


def test_a_sandbox_never_replaces_or_prunes_another_scopes_network(
        host_ns: Netns, second_ns: Netns, docker_scratch: Any, tmp_path: Any) -> None:
    name = docker_scratch.name("shared")
    a = networks_file(tmp_path, f"{{name: {name}}}", name="a.yaml")
    r = host_ns.reconcile("apply", a)
    assert r.rc == 0, r.all
    (first,) = ids(name)
    assert inspect(name)["Labels"][SCOPE_LABEL] == f"netns/{host_ns.name}"
    # the second one declares the same name, differently: without the guard it replaced it
    b = networks_file(tmp_path, f"{{name: {name}, mtu: 1400}}", name="b.yaml")
    for _round in range(2):  # and again: no flapping between the two
        r = second_ns.reconcile("plan", b)
        assert r.rc == 1, r.all
        assert f"! docker_network {name}" in r.out and "another reconciler" in r.out, r.out
        assert f"netns/{host_ns.name}" in r.out
        r = second_ns.reconcile("apply", b)
        assert r.rc == 1 and "blocked" in r.err, r.all
        no_traceback(r)
        assert ids(name) == [first]
        r = host_ns.reconcile("plan", a)
        assert r.rc == 0, r.all  # the owner still sees its own network, unchanged
    # the second one prunes (and destroys) only its own
    assert second_ns.reconcile("apply", networks_file(tmp_path, name="none.yaml")).rc == 0
    assert second_ns.reconcile("destroy", "--yes").rc == 0
    assert ids(name) == [first]


def test_a_sandbox_leaves_the_hosts_network_of_its_name_alone(host_ns: Netns, docker_scratch: Any,
                                                              tmp_path: Any) -> None:
    """The host's networks (scope "host", or no scope label: made before there was one)."""
    for labels in ((f"{SCOPE_LABEL}=host",), ()):
        name = docker_scratch.name(f"host{len(labels)}")
        docker("network", "create", "--label", f"{DOCKER_LABEL}={DOCKER_LABEL_VALUE}",
               *(x for lab in labels for x in ("--label", lab)), name)
        (before,) = ids(name)
        f = networks_file(tmp_path, f"{{name: {name}, internal: true}}", name=f"{name}.yaml")
        r = host_ns.reconcile("apply", f)
        assert r.rc == 1 and "another reconciler" in r.all and "'host'" in r.all, r.all
        no_traceback(r)
        assert ids(name) == [before] and inspect(name)["Internal"] is False
        r = host_ns.reconcile("apply", "--adopt", f"docker_network/{name}", f)
        assert r.rc == 1 and ids(name) == [before], r.all  # adopting is for foreign ones
        assert host_ns.reconcile("destroy", "--yes").rc == 0
        assert ids(name) == [before]
