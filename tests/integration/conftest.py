"""Fixtures of the real-kernel tests: the sandbox host, the one leak check, Docker.

Every test that touches the kernel does it inside ``host_ns``, a fresh network
namespace standing in for the host (``reconcile --netns NAME`` acts there). Other
namespaces of the test are named ``host_ns.ns(SUFFIX)`` (the driver tests) or
``unique(...)`` (allocations: namespaces are global), so that teardown and the
leak check find them by this process's ``SESSION`` prefix and never see another
worker's objects.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from reconciler.domain.ownership import probe_vantage_names
from reconciler.drivers import netns
from reconciler.drivers.netlink import client as links
from tests.support.agent import Agent, PlanAgent
from tests.support.cli import reconcile
from tests.support.dockerscratch import DockerScratch, client_or_skip, ensure_busybox_image
from tests.support.host import (
    SESSION,
    Netns,
    forget_run_files,
    host_link_names,
    is_root,
    netns_names,
    remove_vantage,
    sh,
    unique,
)


@pytest.fixture
def host_ns() -> Iterator[Netns]:
    """A fresh network namespace standing in for the host; removed even on failure,
    with whatever the reconciler made there and every ``host_ns.ns(...)`` namespace."""
    if not is_root():
        pytest.skip("needs root")
    name = unique()
    sh("ip", "netns", "add", name)
    inode = os.stat(f"/run/netns/{name}").st_ino
    # a namespace inode is reused once its namespace is gone: the probes' vantage a dead
    # namespace of that inode left (a killed prober, another run's leak) would be taken for
    # this fresh host's own leftover (gc lists it). No live prober can use it: remove it.
    remove_vantage(inode)
    before = netns_names()
    ns = Netns(name)
    try:
        sh("ip", "-n", name, "link", "set", "lo", "up")
        yield ns
    finally:
        # a simulated reboot makes the sandbox again under its name: another inode, and
        # the probes' vantage of each is the sandbox's
        now = _inode_of(name)
        inodes = sorted({inode} if now is None else {inode, now})
        vantages = {probe_vantage_names(str(i))[0] for i in inodes}
        # Allocation namespaces are global (/run/netns/ID) although the host is a
        # sandbox: tear down what the reconciler made there before the sandbox goes.
        new = {n for n in netns_names() - before - {name}
               if n.startswith(SESSION) or n in vantages}
        if new:
            reconcile("destroy", "--yes", "--lock-timeout", "20", netns=name, timeout=120)
        for left in ns.leftovers():
            netns.delete(left)  # live mounts and empty files alike
        for i in inodes:
            forget_run_files(i)
        # the sandbox is gone: a vantage of it still there is under /run/netns for good
        # (its name's inode is dead), until a namespace of that inode comes again
        # (the first inode, when a reboot replaced it, may be another sandbox's since)
        leaked = [v for i in inodes if (v := remove_vantage(i, orphan=i != now)) is not None]
        assert not leaked, f"test leaked the probes' vantage namespace: {leaked}"


def _inode_of(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except FileNotFoundError:
        return None


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """A test that leaves a namespace of this run or a veth of ours on the host fails."""
    if not is_root():
        yield
        return
    before, host_before = netns_names(), host_link_names()
    yield
    leaked = {n for n in netns_names() - before if n.startswith(SESSION)}
    for n in leaked:
        netns.delete(n)
    new_host_links = {n for n in host_link_names() - host_before if n.startswith("vr")}
    assert not leaked, f"test leaked network namespaces: {sorted(leaked)}"
    assert not new_host_links, f"veths appeared on the real host: {sorted(new_host_links)}"


@pytest.fixture
def nl(host_ns: Netns) -> Iterator[links.Netlink]:
    """A Netlink whose main socket lives in the sandbox (the test's "host")."""
    with netns.enter(host_ns.name):
        n = links.Netlink()
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """A Docker SDK client for the local daemon; skips when there is none."""
    client = client_or_skip()
    yield client
    client.close()


@pytest.fixture(scope="session")
def busybox_image(docker_client: Any) -> str:
    """Tag of a minimal busybox image, built with ``docker import`` if missing."""
    return ensure_busybox_image(docker_client)


@pytest.fixture
def docker_scratch(docker_client: Any) -> Iterator[DockerScratch]:
    """Per-test unique prefix; removes its networks even when the test fails, then fails
    the test if one is left."""
    scratch = DockerScratch(docker_client, None)
    try:
        yield scratch
    finally:
        scratch.cleanup()
        scratch.check_clean()


@pytest.fixture
def docker_scratch_image(docker_client: Any, busybox_image: str) -> Iterator[DockerScratch]:
    """Like ``docker_scratch``, with containers from the busybox image."""
    scratch = DockerScratch(docker_client, busybox_image)
    try:
        yield scratch
    finally:
        scratch.cleanup()
        scratch.check_clean()


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    """Start agents; every one is stopped (or killed) when the test ends, pass or fail."""
    started: list[Agent] = []

    def start(host: Netns, paths: list[str], *extra: str) -> Agent:
        a = Agent(host, paths, *extra)
        started.append(a)
        return a

    try:
        yield start
    finally:
        for a in started:
            a.kill()


@pytest.fixture
def plan_agent(host_ns: Netns, tmp_path: Any) -> Iterator[PlanAgent]:
    a = PlanAgent(host_ns, tmp_path)
    try:
        yield a
    finally:
        rc = a.agent.stop()
    assert rc == 0 and not os.path.exists(a.socket), "the agent left its socket behind"
