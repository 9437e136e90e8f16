"""Docker objects of one test: unique names and their cleanup, and the test image.

The fixtures that hand these out (``docker_client``, ``busybox_image``,
``docker_scratch``, ``docker_scratch_image``) live in ``tests/integration/conftest.py``.
Everything a test creates is named with a per-test random prefix and removed
afterwards, even when the test fails; nothing here touches Docker's default
networks or anybody else's objects.

There is no image registry here, so :func:`ensure_busybox_image` builds a tiny image with
``docker import`` from a rootfs holding only ``/bin/busybox`` and a few
symlinks. The image is kept between runs (it is 1 MB) and rebuilt if missing.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from typing import Any

import docker
import pytest

from tests.support.host import unique

BUSYBOX_IMAGE = "reconciler-test-busybox:1"
BUSYBOX_BINARY = "/bin/busybox"
_APPLETS = ("sh", "sleep", "ip", "ping", "cat", "ls", "true")


def client_or_skip() -> Any:
    """A Docker SDK client for the local daemon; skips the test when there is none."""
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:  # any failure here means: no usable daemon
        pytest.skip(f"docker daemon unreachable: {exc}")
    return client


def busybox_rootfs(applets: tuple[str, ...] = _APPLETS,
                   dirs: tuple[tuple[str, int, int], ...] = ()) -> bytes:
    """A rootfs of busybox and ``applets``; ``dirs``: more directories (name, uid, mode)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d, uid, mode in (*((d, 0, 0o1777 if d == "tmp" else 0o755)
                               for d in ("bin", "tmp", "proc", "sys", "dev", "etc")), *dirs):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode, info.uid, info.gid = mode, uid, uid
            tar.addfile(info)
        tar.add(BUSYBOX_BINARY, arcname="bin/busybox")
        for applet in applets:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            tar.addfile(info)
    return buf.getvalue()


def ensure_busybox_image(docker_client: Any) -> str:
    """Tag of a minimal busybox image, built with ``docker import`` if missing."""
    try:
        docker_client.images.get(BUSYBOX_IMAGE)
        return BUSYBOX_IMAGE
    except docker.errors.ImageNotFound:
        pass
    if not os.path.exists(BUSYBOX_BINARY) or shutil.which("docker") is None:
        pytest.skip(f"cannot build {BUSYBOX_IMAGE}: need {BUSYBOX_BINARY} and the docker CLI")
    subprocess.run(
        ["docker", "import", "--change", 'CMD ["/bin/sh"]', "-", BUSYBOX_IMAGE],
        input=busybox_rootfs(), check=True, capture_output=True,
    )
    return BUSYBOX_IMAGE


def import_busybox_image(tag: str, applets: tuple[str, ...],
                         dirs: tuple[tuple[str, int, int], ...]) -> str:
    """Build ``tag`` with ``docker import``: busybox, ``applets`` and ``dirs`` (name, uid and
    gid, mode), a stand-in for an image no registry here serves; the caller removes it."""
    if not os.path.exists(BUSYBOX_BINARY) or shutil.which("docker") is None:
        pytest.skip(f"cannot build {tag}: need {BUSYBOX_BINARY} and the docker CLI")
    subprocess.run(["docker", "import", "--change", 'CMD ["/bin/sh"]', "-", tag],
                   input=busybox_rootfs(applets, dirs), check=True, capture_output=True)
    return tag


class DockerScratch:
    """Unique names for one test, and cleanup of everything created under them.

    Networks are found again by name prefix at teardown, so networks created
    behind our back (by the driver under test, or by the daemon on a race)
    are removed too.
    """

    def __init__(self, client: Any, image: str | None) -> None:
        self.client = client
        self.image = image
        self.prefix = unique("d")
        self.containers: list[str] = []

    def name(self, suffix: str = "") -> str:
        return f"{self.prefix}-{suffix}" if suffix else self.prefix

    def container(self, suffix: str = "c") -> Any:
        """A running busybox container with no network (``--network none``)."""
        if self.image is None:
            raise RuntimeError("this scratch has no image; use the docker_scratch_image fixture")
        c = self.client.containers.run(self.image, ["sleep", "3600"], detach=True,
                                       network_mode="none", name=self.name(suffix),
                                       labels={"reconciler-test": self.prefix})
        self.containers.append(c.id)
        return c

    def attach(self, container: Any, network_id: str, **kwargs: Any) -> None:
        """Move a ``--network none`` container onto a network."""
        api = self.client.api
        container.reload()
        if "none" in container.attrs["NetworkSettings"]["Networks"]:
            api.disconnect_container_from_network(container.id, "none")
        api.connect_container_to_network(container.id, network_id, **kwargs)

    def networks(self) -> list[dict[str, Any]]:
        return [n for n in self.client.api.networks(filters={"name": self.prefix})
                if n["Name"].startswith(self.prefix)]

    def cleanup(self) -> None:
        """Remove our containers, then every network under our prefix.

        Keeps going past failures so one stuck object does not leak the rest,
        then reports what could not be removed.
        """
        api = self.client.api
        failures = []
        for cid in self.containers:
            try:
                api.remove_container(cid, force=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as exc:
                failures.append(f"container {cid[:12]}: {exc.explanation}")
        for net in self.networks():
            try:
                api.remove_network(net["Id"])
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as exc:
                failures.append(f"network {net['Name']}: {exc.explanation}")
        if failures:
            raise RuntimeError("docker test cleanup left objects behind: " + "; ".join(failures))

    def check_clean(self) -> None:
        """Fail when a network under our prefix is still there (after :meth:`cleanup`)."""
        left = [n["Name"] for n in self.networks()]
        if left:
            raise AssertionError(f"docker networks leaked: {left}")
