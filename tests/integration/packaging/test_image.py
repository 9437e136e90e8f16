"""The container image: run it the documented way, aimed at a throwaway namespace.

The container gets the host network and ``--netns`` points it at this test's
namespace (via /run/netns mounted shared), so the host's own network is never
touched; the result is checked from outside with ``ip -n`` and ``nft``.

Runs when RECONCILER_TEST_IMAGE=1 (the image is built with scripts/build-image.sh,
which reuses the base image when it exists: in the background from the end of
collection on, tests/support/imagebuild.py) or when the image already exists (it is
then used as is).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import yaml

from tests.support import imagebuild
from tests.support.cli import reconcile
from tests.support.host import EXAMPLES, Netns, sh, unique

pytestmark = [pytest.mark.docker, pytest.mark.image, pytest.mark.root]

IMAGE = imagebuild.IMAGE

# The documented run line (Containerfile, docs/fleet-with-watch.md), minus the config mount.
RUN = ["docker", "run", "--rm", "--network", "host", "--pid", "host",
       "--cap-add", "NET_ADMIN", "--cap-add", "SYS_ADMIN", "--cap-add", "NET_BROADCAST",
       "--security-opt", "apparmor=unconfined", "--security-opt", "systempaths=unconfined",
       "-v", "/run/netns:/run/netns:rshared", "-v", "/run/reconciler:/run/reconciler",
       "-v", "/var/run/docker.sock:/var/run/docker.sock"]


def _image_exists() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True,
                          timeout=30).returncode == 0


@pytest.fixture(scope="module")
def image() -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if imagebuild.wanted():
        # started when collection ended (tests/conftest.py), or now
        rc, out = imagebuild.BUILD.wait()
        assert rc == 0, f"build-image.sh failed:\n{out}"
    elif not _image_exists():
        pytest.skip(f"image {IMAGE} not built (set RECONCILER_TEST_IMAGE=1 to build it)")
    return IMAGE


def _config(tmp_path: object) -> tuple[str, dict[str, str]]:
    """examples/nomad-allocs.yaml with names unique to this run (alloc namespaces are global)."""
    with open(os.path.join(EXAMPLES, "nomad-allocs.yaml")) as fh:
        doc = yaml.safe_load(fh)
    names = {"bridge": unique("b"), "subnet": unique("s"),
             **{a["id"]: unique("a") for a in doc["allocs"]}}
    for b in doc["bridges"]:
        b["name"] = names["bridge"]
    for s in doc["subnets"]:
        s["name"], s["bridge"] = names["subnet"], names["bridge"]
    for a in doc["allocs"]:
        a["id"], a["subnet"] = names[a["id"]], names["subnet"]
    conf = os.path.join(str(tmp_path), "conf")
    os.mkdir(conf, 0o755)
    with open(os.path.join(conf, "nomad.yaml"), "w") as fh:
        yaml.safe_dump(doc, fh, sort_keys=False)
    return conf, names


def _run(image: str, conf: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RUN, "-v", f"{conf}:/etc/reconciler:ro", image, *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def alloc_cleanup(host_ns: Netns) -> Iterator[list[str]]:
    """Namespaces the test expects; whatever survives a failed test is removed."""
    names: list[str] = []
    yield names
    if any(os.path.exists(f"/run/netns/{n}") for n in names):
        reconcile("destroy", "--yes", "--lock-timeout", "20", netns=host_ns.name)
    for n in names:
        sh("ip", "netns", "del", n, check=False)


def test_image_plans_applies_and_destroys_in_a_namespace(image: str, host_ns: Netns,
                                                         alloc_cleanup: list[str],
                                                         tmp_path: object) -> None:
    conf, names = _config(tmp_path)
    allocs = [v for k, v in names.items() if k not in ("bridge", "subnet")]
    alloc_cleanup.extend(allocs)
    ns = ["--netns", host_ns.name]

    p = _run(image, conf, "--version")
    assert p.returncode == 0 and p.stdout.startswith("reconcile "), p.stderr

    p = _run(image, conf, *ns, "plan", "/etc/reconciler")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"+ bridge {names['bridge']}" in p.stdout

    p = _run(image, conf, *ns, "apply", "/etc/reconciler")
    assert p.returncode == 0, p.stdout + p.stderr

    # Checked from outside the container.
    link = host_ns.link(names["bridge"])
    assert link is not None and link["mtu"] == 1500 and "UP" in link["flags"]
    assert "172.26.64.1/20" in host_ns.addrs(names["bridge"])
    for a in allocs:
        assert os.path.ismount(f"/run/netns/{a}"), f"alloc namespace {a} not visible on the host"
    web = Netns(allocs[0])
    assert "172.26.64.10/20" in web.addrs("eth0")
    rules = host_ns.firewall_text()  # our table, in the rule form of earlier versions
    assert "RECONCILER-" in rules and "172.26.64.10:80" in rules

    p = _run(image, conf, *ns, "plan", "/etc/reconciler")
    assert p.returncode == 0, "not converged after apply:\n" + p.stdout + p.stderr

    p = _run(image, conf, *ns, "destroy", "--yes")
    assert p.returncode == 0, p.stdout + p.stderr
    assert host_ns.link(names["bridge"]) is None
    assert not any(os.path.exists(f"/run/netns/{a}") for a in allocs)
    assert "RECONCILER-" not in host_ns.firewall_text()
    assert host_ns.run("nft", "list", "table", "inet", "reconciler", check=False).returncode != 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_image_watch_converges_and_stops_on_sigterm(image: str, host_ns: Netns,
                                                    alloc_cleanup: list[str],
                                                    tmp_path: object) -> None:
    conf, names = _config(tmp_path)
    alloc_cleanup.extend(v for k, v in names.items() if k not in ("bridge", "subnet"))
    addr = f"127.0.0.1:{_free_port()}"
    name = unique("watch")
    started = subprocess.run(
        [*[a for a in RUN if a != "--rm"], "-d", "--name", name,
         "-v", f"{conf}:/etc/reconciler:ro", image,
         "--netns", host_ns.name, "watch", "/etc/reconciler", "--status-addr", addr],
        capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        deadline = time.monotonic() + 90
        while True:
            st = reconcile("status", "--addr", addr)
            if st.rc == 0:
                break
            assert time.monotonic() < deadline, (
                st.all + sh("docker", "logs", name, check=False).stderr)
            time.sleep(0.2)
        assert host_ns.link(names["bridge"]) is not None
        logs = sh("docker", "logs", name, check=False).stderr
        # the documented flags give the plan agent what it needs (NET_BROADCAST)
        assert "answering `reconcile plan`" in logs and "not answering" not in logs, logs
        sh("docker", "stop", "-t", "30", name)
        code = sh("docker", "inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
        assert code == "0", sh("docker", "logs", name, check=False).stderr
    finally:
        sh("docker", "rm", "-f", name, check=False)
        reconcile("destroy", "--yes", "--lock-timeout", "20", netns=host_ns.name)
