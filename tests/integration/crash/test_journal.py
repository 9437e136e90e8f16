"""Durable multi-step changes (SPEC §8): a kill -9 anywhere in one is finished by the next run.

A Docker network with 4 containers attached is replaced (`apply --force-replace`,
an MTU change) and the CLI is SIGKILLed right after one daemon request of the
replace (``killpoints.py``: after each disconnect, the removal, the create, each
reconnect). The next run — a plain `apply`, `destroy` or a `watch` pass — must
leave every container attached to the network of that name with the IPv4, IPv6
and aliases it had, read with `docker inspect`, not with our observer. The same
for an adopted namespace killed right after its foreign ``eth0`` was deleted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.support.cli import Result, reconcile
from tests.support.dockercli import (
    assert_all_reattached,
    attachment,
    docker,
    four_attached,
    ids,
    journals,
    no_traceback,
)
from tests.support.dockerscratch import DockerScratch
from tests.support.host import REPO, Netns, sh, unique, write

pytestmark = pytest.mark.root


#: after each daemon request of a replace with 4 containers, and once before anything
KILL_POINTS = ["disconnect:1:before", "disconnect:1", "disconnect:2", "disconnect:3",
               "disconnect:4", "remove:1", "create:1", "connect:1", "connect:2", "connect:3",
               "connect:4"]
def killed(ns: Netns, spec: str, *args: str) -> Result:
    """`reconcile ARGS` in ``ns``, SIGKILLed at ``spec`` (killpoints.py)."""
    return reconcile(spec, "--netns", ns.name, *args, cwd=REPO,
                     module="tests.support.killpoints")


@pytest.mark.docker
@pytest.mark.parametrize("point", KILL_POINTS)
def test_replace_killed_at_each_step_is_finished_by_the_next_apply(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any, point: str) -> None:
    name, changed, before = four_attached(host_ns, docker_scratch_image, tmp_path)
    old_id = ids(name)
    r = killed(host_ns, point, "apply", "--force-replace", changed)
    assert r.rc == -signal.SIGKILL, r.all  # the kill landed inside the replace
    # plan changes nothing, so it cannot finish it, but it must not say "nothing to do"
    r = host_ns.reconcile("plan", "--no-agent", changed)
    assert r.rc in (1, 2) and f"note: docker network {name}: a replace that a killed run " \
        "left half done" in r.err, r.all
    r = host_ns.reconcile("apply", changed)
    no_traceback(r)
    assert_all_reattached(name, before)
    assert r.rc == 0, r.all
    assert "interrupted replace" in r.err, r.all  # said in one line
    assert ids(name) != old_id
    attrs = json.loads(docker("network", "inspect", name))[0]
    assert attrs["Options"]["com.docker.network.driver.mtu"] == "1400"
    assert journals(host_ns) == []
    r = host_ns.reconcile("plan", changed)
    assert r.rc == 0, r.all


@pytest.mark.docker
def test_replace_killed_then_destroy_reattaches_before_it_removes(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any) -> None:
    name, changed, before = four_attached(host_ns, docker_scratch_image, tmp_path)
    r = killed(host_ns, "remove:1", "apply", "--force-replace", changed)
    assert r.rc == -signal.SIGKILL, r.all
    r = host_ns.reconcile("destroy", "--yes")
    no_traceback(r)
    # destroy keeps an owned network that containers use (it is removed once they leave)
    assert_all_reattached(name, before)
    assert "interrupted replace" in r.err and "not removed yet" in r.all, r.all
    assert journals(host_ns) == []


@pytest.mark.docker
def test_replace_killed_then_a_watch_pass_finishes_it(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any) -> None:
    name, changed, before = four_attached(host_ns, docker_scratch_image, tmp_path)
    r = killed(host_ns, "connect:2", "apply", "--force-replace", changed)
    assert r.rc == -signal.SIGKILL, r.all
    # the network exists with the new settings: the plan alone sees nothing to do
    agent = subprocess.Popen([sys.executable, "-m", "reconciler", "--netns", host_ns.name,
                              "watch", changed, "--status-addr", "off", "--interval", "3600"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
                journals(host_ns) or any(attachment(c, name) is None for c in before)):
            time.sleep(0.5)
    finally:
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=60)
    assert_all_reattached(name, before)
    assert journals(host_ns) == []
    assert "interrupted replace" in out, out


@pytest.mark.docker
def test_a_container_gone_meanwhile_is_named_and_does_not_loop(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any) -> None:
    name, changed, before = four_attached(host_ns, docker_scratch_image, tmp_path)
    r = killed(host_ns, "remove:1", "apply", "--force-replace", changed)
    assert r.rc == -signal.SIGKILL, r.all
    gone = docker_scratch_image.containers[1]
    docker_scratch_image.client.api.remove_container(gone, force=True)
    r = host_ns.reconcile("apply", changed)
    no_traceback(r)
    assert_all_reattached(name, {c: ep for c, ep in before.items() if c != gone})
    assert [ln for ln in r.err.splitlines() if "interrupted replace" in ln
            and docker_scratch_image.name("c1") in ln and "gone" in ln], r.all
    assert journals(host_ns) == []
    r = host_ns.reconcile("apply", changed)  # nothing left to finish: no loop
    assert r.rc == 0 and "interrupted" not in r.all, r.all


BRIDGE = "rtjrn0"


def test_adopt_killed_after_deleting_the_foreign_eth0_is_finished(
        host_ns: Netns, tmp_path: Any) -> None:
    a = unique("n")
    sh("ip", "netns", "add", a)
    try:
        # someone else's namespace with the alloc's id: its eth0 is not our veth
        sh("ip", "-n", a, "link", "add", "eth0", "type", "veth", "peer", "name", "theirs")
        sh("ip", "-n", a, "addr", "add", "10.76.0.50/24", "dev", "eth0")
        sh("ip", "-n", a, "link", "set", "eth0", "up")
        path = write(tmp_path, "adopt.yaml", "\n".join([
            "version: 1", f"bridges: [{{name: {BRIDGE}}}]",
            f"subnets: [{{name: jn, bridge: {BRIDGE}, cidr: 10.76.0.0/24}}]",
            f"allocs: [{{id: {a}, subnet: jn, address: 10.76.0.9}}]"]) + "\n")
        r = host_ns.reconcile("plan", path)
        assert r.rc == 1 and f"--adopt alloc/{a}" in r.out, r.all
        r = killed(host_ns, "link.delete:1", "apply", "--adopt", f"alloc/{a}", path)
        assert r.rc == -signal.SIGKILL, r.all
        inside = {lk["ifname"] for lk in json.loads(sh("ip", "-n", a, "-j", "link").stdout)}
        assert "eth0" not in inside  # the kill came right after the deletion
        # the next run, without --adopt: the journal says the adopt was asked for
        r = host_ns.reconcile("apply", path)
        no_traceback(r)
        links = {lk["ifname"]: lk for lk in json.loads(
            sh("ip", "-n", a, "-j", "-d", "addr").stdout)}
        assert "eth0" in links, r.all
        assert links["eth0"]["linkinfo"]["info_kind"] == "veth"
        assert [f"{x['local']}/{x['prefixlen']}" for x in links["eth0"]["addr_info"]
                if x["family"] == "inet"] == ["10.76.0.9/24"]
        assert links["lo"].get("ifalias", "").startswith("managed-by=reconciler")
        assert r.rc == 0, r.all
        assert "interrupted adopt" in r.err, r.all
        assert journals(host_ns) == []
        assert host_ns.reconcile("plan", path).rc == 0
    finally:
        host_ns.reconcile("destroy", "--yes", "--lock-timeout", "20")
        sh("ip", "netns", "del", a, check=False)


# -- review items 5 and 6: another's network in the way; refusals and destroy after finishing

def destroy_on_a_terminal(ns: Netns, answer: str) -> Result:
    """`reconcile destroy` with a terminal on stdin (so it shows the plan and asks), the
    answer typed ahead."""
    import pty  # noqa: PLC0415 (only this helper)

    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-m", "reconciler", "--netns", ns.name,
                              "destroy", "--lock-timeout", "20"], stdin=slave,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=REPO)
        os.close(slave)
        slave = -1
        os.write(master, answer.encode())
        out, err = p.communicate(timeout=300)
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    return Result(p.returncode, out, err)


@pytest.mark.docker
def test_interactive_destroy_finishes_the_journal_before_it_shows_the_plan(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any) -> None:
    """The plan shown must be of the host as apply will find it: made before the journal
    was finished, apply then found the host changed and destroyed nothing."""
    name, changed, before = four_attached(host_ns, docker_scratch_image, tmp_path)
    r = killed(host_ns, "remove:1", "apply", "--force-replace", changed)
    assert r.rc == -signal.SIGKILL, r.all
    r = destroy_on_a_terminal(host_ns, "yes\n")
    no_traceback(r)
    assert "changed while destroy was waiting" not in r.all, r.all
    assert r.rc == 0, r.all
    assert "interrupted replace" in r.err and "not removed yet" in r.all, r.all
    assert_all_reattached(name, before)
    assert journals(host_ns) == []


@pytest.mark.docker
def test_a_refused_apply_after_finishing_a_journal_says_it_changed_that(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any) -> None:
    name, changed, before = four_attached(host_ns, docker_scratch_image, tmp_path)
    r = killed(host_ns, "remove:1", "apply", "--force-replace", changed)
    assert r.rc == -signal.SIGKILL, r.all
    again = write(tmp_path, "c.yaml", f"version: 1\ndocker_networks:\n"
                                      f"  - {{name: {name}, ipv6: true, mtu: 1300}}\n")
    r = host_ns.reconcile("apply", "--force-replace", "--max-disruption", "0", again)
    no_traceback(r)
    assert r.rc == 1, r.all
    (line,) = [ln for ln in r.err.splitlines() if "--max-disruption 0" in ln]
    assert "nothing changed" not in line and "finished an interrupted change first" in line \
        and f"docker network {name}: finished an interrupted replace" in line, r.all
    assert_all_reattached(name, before)  # the interrupted one, to the mtu 1400 network
    attrs = json.loads(docker("network", "inspect", name))[0]
    assert attrs["Options"]["com.docker.network.driver.mtu"] == "1400"
    assert journals(host_ns) == []


@pytest.mark.docker
def test_resume_leaves_the_containers_off_another_scopes_network_and_keeps_the_journal(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: Any) -> None:
    """Killed after the removal; another reconciler (another scope) makes a network of that
    name meanwhile. The next run must not attach our containers to it, nor forget them:
    once that network is gone, the run after finishes the replace."""
    name, changed, before = four_attached(host_ns, docker_scratch_image, tmp_path)
    r = killed(host_ns, "remove:1", "apply", "--force-replace", changed)
    assert r.rc == -signal.SIGKILL, r.all
    theirs = docker("network", "create", "--label", "io.reconciler.managed=true", "--label",
                    f"io.reconciler.scope=netns/{docker_scratch_image.name('other')}", name).strip()
    try:
        r = host_ns.reconcile("apply", changed)
        no_traceback(r)
        assert r.rc != 0, r.all
        assert f"docker network {name}: could not finish an interrupted replace yet" in r.err \
            and "belongs to another reconciler" in r.err and "kept for the next run" in r.err, \
            r.all
        on_theirs = [cid[:12] for cid in before
                     if (attachment(cid, name) or {}).get("network_id") == theirs]
        assert on_theirs == [], f"attached to another reconciler's network: {on_theirs}"
        assert journals(host_ns) == [f"journal-docker_network-{name}.json"]
    finally:
        docker("network", "rm", theirs)
    r = host_ns.reconcile("apply", changed)
    no_traceback(r)
    assert_all_reattached(name, before)
    assert r.rc == 0, r.all
    assert "finished an interrupted replace" in r.err, r.all
    assert journals(host_ns) == []
