"""Unit tests run pure logic only: touching the real kernel, iptables or Docker fails.

Also the fixtures unit tests of several packages share (``fake_docker``).
"""

from __future__ import annotations

import docker
import pytest

from reconciler.drivers import iptables, sysctl
from reconciler.drivers.docker.client import DockerDriver
from reconciler.drivers.netlink.read import NetlinkReader
from tests.support.dockerfake import FakeAPI, FakeClient


def _tripwire(*_a: object, **_k: object) -> None:
    raise AssertionError("Must not be called: unit tests may not touch the real host")


@pytest.fixture(autouse=True)
def no_real_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(iptables.IptablesDriver, "observe", _tripwire)
    monkeypatch.setattr(iptables.IptablesDriver, "start_observe", _tripwire)
    monkeypatch.setattr(iptables.IptablesDriver, "observe_legacy", _tripwire)
    monkeypatch.setattr(iptables.IptablesDriver, "restore", _tripwire)
    monkeypatch.setattr(sysctl, "write", _tripwire)
    monkeypatch.setattr(NetlinkReader, "__init__", _tripwire)  # Netlink's too (a subclass)
    monkeypatch.setattr(docker, "from_env", _tripwire)
    monkeypatch.setattr(docker, "DockerClient", _tripwire)


@pytest.fixture
def fake_docker() -> tuple[DockerDriver, FakeAPI]:
    """The Docker driver over an in-memory SDK (``tests/support/dockerfake.py``)."""
    client = FakeClient()
    return DockerDriver(client=client), client.api
