"""Unit tests run pure logic only: touching the real kernel, iptables or Docker fails."""

from __future__ import annotations

import pytest


def _tripwire(*_a: object, **_k: object) -> None:
    raise AssertionError("Must not be called: unit tests may not touch the real host")


@pytest.fixture(autouse=True)
def no_real_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.drivers import iptables, sysctl

    monkeypatch.setattr(iptables.IptablesDriver, "observe", _tripwire)
    monkeypatch.setattr(iptables.IptablesDriver, "restore", _tripwire)
    monkeypatch.setattr(sysctl, "write", _tripwire)
    try:
        from reconciler.drivers.netlink import client as links
        monkeypatch.setattr(links.Netlink, "__init__", _tripwire)
    except ImportError:
        pass
    try:
        import docker
        monkeypatch.setattr(docker, "from_env", _tripwire)
        monkeypatch.setattr(docker, "DockerClient", _tripwire)
    except ImportError:
        pass
