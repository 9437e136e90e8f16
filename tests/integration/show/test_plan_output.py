"""A real plan of 300 allocations (SPEC §13): every text line within 200 characters, the
warning about ten floating host_ips said once, --compact short, JSON whole."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.host import Netns, unique, write

pytestmark = pytest.mark.root

N = 300
FLOATING = "192.0.2.10"  # TEST-NET-1: never an address of the sandbox


def _desired(tmp_path: Any, prefix: str) -> str:
    bridges = [f"{prefix}b{k}" for k in range(4)]
    lines = ["version: 1", "bridges:", *(f"  - {{name: {b}}}" for b in bridges), "subnets:"]
    lines += [f"  - {{name: s{k}, bridge: {b}, cidr: 10.{180 + k}.0.0/16, "
              f"cidr6: 'fd00:{180 + k}::/64'}}" for k, b in enumerate(bridges)]
    lines.append("allocs:")
    for i in range(N):
        ip = f", host_ip: {FLOATING}" if i % 30 == 0 else ""
        lines.append(f"  - {{id: {prefix}-{i}, subnet: s{i % 4}, ports: [{{host: {20000 + i}, "
                     f"to: 80{ip}}}, {{host: {40000 + i}, to: 53, protocol: both}}]}}")
    return write(tmp_path, "many.yaml", "\n".join(lines) + "\n")


def test_a_plan_of_300_allocations_fits_200_columns(host_ns: Netns, tmp_path: Any) -> None:
    prefix = unique("po")[-8:]
    path = _desired(tmp_path, prefix)
    r = host_ns.reconcile("plan", path, "--no-agent")
    assert r.rc == 2, r.all
    lines = r.out.splitlines()
    longest = max(lines, key=len)
    assert len(longest) <= 200, longest
    floating = [x for x in lines if FLOATING in x and x.startswith("warning")]
    assert len(floating) == 1 and floating[0].startswith("warning (10 allocs: "), floating
    # bridges, subnets, and our nftables table (one change for both families)
    assert lines[-1].startswith(f"Plan: {N + 4 + 4 + 1} to create, "), lines[-1]
    compact = host_ns.reconcile("plan", path, "--no-agent", "--compact")
    assert compact.rc == 2 and len(compact.out.splitlines()) <= 6, compact.out
    assert f"{N} allocs" in compact.out.splitlines()[0], compact.out
    doc = json.loads(host_ns.reconcile("plan", path, "--no-agent", "--output", "json").out)
    allocs = [c for c in doc["changes"] if c["kind"] == "alloc"]
    assert len(allocs) == N
    ports = [a for c in allocs for a in c["attrs"] if a["field"] == "ports"]
    assert len(ports) == N and all(len(p["added"]) == 3 and p["removed"] == [] for p in ports)
    # JSON keeps every value whole: the udp entries of all 300 new maps, in one attribute
    conntrack = [a for c in doc["changes"] if c["kind"] == "firewall" for a in c["attrs"]
                 if a["field"] == "conntrack"]
    assert conntrack and conntrack[0]["before"].count("udp/") == N
