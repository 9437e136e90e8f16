"""The Nomad job's git volume, as Docker makes it (issue 27 item 6).

Docker fills a new named volume from the image that mounts it first: git-sync's image
has /git as 65533:65533, mode 2775, so the volume's root became group-writable and the
agent refused the checkout (``writable by group or others (mode 2775)``). This builds a
stand-in for git-sync's image with ``docker import`` (no registry here), reproduces the
fill, runs the job's own git-perms command on it (read from the job file), and shows
the agent accepting the checkout; and that a mount with ``no_copy``, as every mount of
the volume in the job has (tests/unit/project/test_fleet_manifests.py), is never filled.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator

import hcl2
import pytest

from tests.support.agent import Agent
from tests.support.dockerscratch import import_busybox_image
from tests.support.host import REPO, Netns, sh, unique

pytestmark = [pytest.mark.root, pytest.mark.docker]

NOMAD = os.path.join(REPO, "examples", "nomad", "reconciler.nomad.hcl")
#: what git-sync's image holds at its mount point
GIT_SYNC_UID, GIT_SYNC_MODE = 65533, 0o2775
APPLETS = ("sh", "mkdir", "chmod", "chown", "cat", "true")


def _git_perms_command() -> list[str]:
    """The git-perms task's command line, as the job file has it."""
    with open(NOMAD) as fh:
        doc = hcl2.load(fh)
    group = doc["job"][0]['"reconciler"']["group"][0]['"reconciler"']
    tasks = {k.strip('"'): v for block in group["task"] for k, v in block.items()}
    config = tasks["git-perms"]["config"][0]
    return [config["command"].strip('"'), *(a.strip('"') for a in config["args"])]


@pytest.fixture
def stand_in() -> Iterator[tuple[str, Callable[[], str]]]:
    """A stand-in for git-sync's image, and a maker of volumes; all removed afterwards."""
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip("no Docker daemon")
    tag = f"{unique('gs')}:1".lower()
    volumes: list[str] = []

    def volume() -> str:
        volumes.append(unique("vol"))
        return volumes[-1]

    try:
        yield import_busybox_image(tag, APPLETS, (("git", GIT_SYNC_UID, GIT_SYNC_MODE),)), \
            volume
    finally:
        for v in volumes:
            subprocess.run(["docker", "volume", "rm", "-f", v], capture_output=True)
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)


def _mountpoint(volume: str) -> str:
    out = sh("docker", "volume", "inspect", volume).stdout
    path: str = json.loads(out)[0]["Mountpoint"]
    return path


def _run(image: str, mount: str, *command: str) -> None:
    sh("docker", "run", "--rm", "--network", "none", "--user", "0", "--mount", mount, image,
       *command)


def _checkout(image: str, mount: str, bridge: str) -> None:
    """What git-sync does as root: the files of the desired state under /git/repo."""
    _run(image, mount, "sh", "-c",
         "mkdir -p /git/repo/fleet && printf 'version: 1\\nbridges: [{name: %s}]\\n' "
         f"{bridge} > /git/repo/fleet/net.yaml")


def test_the_filled_volume_is_refused_and_the_jobs_git_perms_makes_it_accepted(
        stand_in: tuple[str, Callable[[], str]], host_ns: Netns,
        agents: Callable[..., Agent]) -> None:
    image, volume = stand_in
    vol = volume()
    mount = f"type=volume,src={vol},dst=/git"
    bridge = "rn" + unique()[-6:]
    _checkout(image, mount, bridge)  # the first mount: Docker fills the volume from /git
    root = _mountpoint(vol)
    st = os.stat(root)
    assert (st.st_uid, st.st_mode & 0o7777) == (GIT_SYNC_UID, GIT_SYNC_MODE)
    fleet = os.path.join(root, "repo", "fleet")
    r = host_ns.reconcile("watch", fleet, "--status-addr", "off", timeout=60)
    assert r.rc == 1 and "writable by group or others (mode 2775)" in r.err, r.all

    _run(image, mount, *_git_perms_command())  # the job's git-perms task, as written
    st = os.stat(root)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o755)
    agent = agents(host_ns, [fleet])
    agent.converged(timeout=30)
    assert host_ns.link(bridge) is not None
    assert agent.stop() == 0


def test_a_volume_mounted_with_no_copy_is_never_filled(
        stand_in: tuple[str, Callable[[], str]]) -> None:
    image, volume = stand_in
    vol = volume()
    _checkout(image, f"type=volume,src={vol},dst=/git,volume-nocopy", "rn0")
    st = os.stat(_mountpoint(vol))
    assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o755)

