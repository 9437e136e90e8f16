"""kind's Docker-network rules as pure functions: the ULA /64 derived from a name and an
attempt, and which of several same-named networks is kept."""

from __future__ import annotations

import hashlib
import ipaddress
import struct

import pytest

from reconciler.domain.docker import (
    sort_duplicates,
    ula_subnet,
)
from tests.support.dockerfake import live


def test_ula_subnet_matches_kind_for_kind() -> None:
    assert ula_subnet("kind", 0) == ipaddress.IPv6Network("fc00:f853:ccd:e793::/64")


def _independent_ula(name: str, attempt: int) -> ipaddress.IPv6Network:
    # Written from the description (sha1(name || int32le(attempt)), digest[2:8]
    # after fc00), independently of the implementation under test.
    h = hashlib.sha1()
    h.update(name.encode("utf-8"))
    h.update(attempt.to_bytes(4, "little", signed=True))
    d = h.digest()
    groups = ["fc00"] + [f"{d[i]:02x}{d[i + 1]:02x}" for i in (2, 4, 6)]
    return ipaddress.IPv6Network(":".join(groups) + "::/64")


@pytest.mark.parametrize("name", ["kind", "rt-0", "a", "ünïcode", "x" * 60])
@pytest.mark.parametrize("attempt", [0, 1, 2, 3, 4, -1, 2**31 - 1])
def test_ula_subnet_derivation(name: str, attempt: int) -> None:
    net = ula_subnet(name, attempt)
    assert net == _independent_ula(name, attempt)
    assert net.prefixlen == 64
    assert net.subnet_of(ipaddress.IPv6Network("fc00::/16"))


def test_ula_subnet_attempts_differ() -> None:
    assert len({ula_subnet("kind", a) for a in range(5)}) == 5
    assert struct.pack("<i", 1) == b"\x01\x00\x00\x00"


def test_sort_duplicates_most_containers_then_lowest_id() -> None:
    nets = [live(id="c", containers=0), live(id="b", containers=2),
            live(id="a", containers=0), live(id="d", containers=2), live(id="e", containers=5)]
    assert [n.id for n in sort_duplicates(nets)] == ["e", "b", "d", "a", "c"]


def test_sort_duplicates_empty_and_iterables() -> None:
    assert sort_duplicates([]) == []
    assert [n.id for n in sort_duplicates(iter([live(id="z"), live(id="y")]))] == ["y", "z"]
