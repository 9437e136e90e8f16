"""Fixtures for tests of the netns/links drivers against the real kernel.

Import them into a test module (``from tests.integration.netns_fixtures import
sandbox, nl``). Each test gets a unique prefix ``rt-<hex>``; the ``sandbox``
namespace ``rt-<hex>`` plays the host, so bridges and veths never touch the
machine's own interfaces; allocation namespaces are ``rt-<hex>-<suffix>``.
Teardown removes every /run/netns entry with the prefix (mounted or empty
file), even when the test failed, and then fails the test if anything with
the prefix was left behind or a veth of ours appeared on the real host.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from reconciler.drivers import netns
from reconciler.drivers.netlink import client as links


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=60)


def ip_json(ns: str, *args: str) -> list[dict[str, Any]]:
    """``ip -n NS -j -d ARGS`` parsed: the independent view tests check against."""
    out = sh("ip", "-n", ns, "-j", "-d", *args).stdout
    return json.loads(out) if out.strip() else []


def ip_link(ns: str, name: str) -> dict[str, Any] | None:
    for link in ip_json(ns, "link", "show"):
        if link["ifname"] == name:
            return link
    return None


class Sandbox:
    """The per-test host namespace and the names derived from the test's prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.name = prefix

    def ns(self, suffix: str) -> str:
        return f"{self.prefix}-{suffix}"

    def leftovers(self) -> list[str]:
        return sorted(n for n in netns.list_names()
                      if n == self.prefix or n.startswith(self.prefix + "-"))


def _remove_all(box: Sandbox) -> None:
    for name in box.leftovers():
        netns.delete(name)  # handles live mounts and empty files alike


def _host_link_names() -> set[str]:
    out = sh("ip", "-j", "link", "show").stdout
    return {link["ifname"] for link in json.loads(out)}


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    """A fresh ``rt-<hex>`` namespace standing in for the host; all ``rt-<hex>*`` removed."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    box = Sandbox(f"rt-{secrets.token_hex(4)}")
    host_before = _host_link_names()
    sh("ip", "netns", "add", box.name)
    sh("ip", "-n", box.name, "link", "set", "lo", "up")
    try:
        yield box
    finally:
        _remove_all(box)
        leaked = box.leftovers()
        new_host_links = {n for n in _host_link_names() - host_before if n.startswith("vr")}
        assert not leaked, f"leaked namespaces: {leaked}"
        assert not new_host_links, f"veths appeared on the real host: {new_host_links}"


@pytest.fixture
def nl(sandbox: Sandbox) -> Iterator[links.Netlink]:
    """A Netlink whose main socket lives in the sandbox (the test's "host")."""
    with netns.enter(sandbox.name):
        n = links.Netlink()
    try:
        yield n
    finally:
        n.close()


def wait_until(predicate: Any, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``predicate`` (the kernel tears namespaces down asynchronously)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
