"""Stable identities read back independently: the MACs derived from names, a desired state
of allocations on one bridge, their addresses."""

from __future__ import annotations

import hashlib
import json

from tests.support.host import Netns, sh, unique, write

BRIDGE = "rclid0"


def derived(prefix: str, name: str) -> str:
    raw = bytearray(hashlib.sha256(prefix.encode() + name.encode()).digest()[:6])
    raw[0] = (raw[0] & 0xFC) | 0x02
    return ":".join(f"{b:02x}" for b in raw)


def alloc_mac(aid: str) -> str:
    return derived("reconciler/alloc-mac/", aid)


def bridge_mac(name: str) -> str:
    return derived("reconciler/bridge-mac/", name)


def config(tmp_path: object, allocs: list[dict[str, object]], name: str = "ids.yaml") -> str:
    lines = ["version: 1", "bridges:", f"  - {{name: {BRIDGE}}}", "subnets:",
             "  - name: net", f"    bridge: {BRIDGE}", "    cidr: 10.78.0.0/24",
             "    cidr6: fd00:78::/64", "allocs:" if allocs else "allocs: []"]
    lines += ["  - " + json.dumps({"subnet": "net", **a}) for a in allocs]
    return write(tmp_path, name, "\n".join(lines) + "\n")


def apply_ok(host: Netns, path: str) -> None:
    r = host.reconcile("apply", path)
    assert r.rc == 0, r.all
    r = host.reconcile("plan", path)
    assert r.rc == 0 and "No changes." in r.out, r.all


def v4_of(ns: str) -> str:
    (link,) = json.loads(sh("ip", "-n", ns, "-j", "addr", "show", "dev", "eth0").stdout)
    return next(a["local"] for a in link["addr_info"] if a["family"] == "inet")


def v6_of(ns: str) -> str:
    (link,) = json.loads(sh("ip", "-n", ns, "-j", "addr", "show", "dev", "eth0").stdout)
    return next(a["local"] for a in link["addr_info"]
                if a["family"] == "inet6" and a.get("scope") == "global")


def ids(n: int) -> list[str]:
    base = unique("i")
    return [f"{base}-{i}" for i in range(n)]
