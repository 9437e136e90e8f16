"""A scope is more than its namespace's inode: a sandbox that gets a deleted sandbox's inode
does not take its allocations, and marks of an earlier version stay ours on the same
namespace.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from reconciler.drivers import netns as netns_driver
from tests.support.cli import reconcile
from tests.support.host import Netns, forget_run_files, sh, unique, write

pytestmark = pytest.mark.root



# ----------------------------------------------------------------- a scope's identity


def _sandbox(name: str) -> int:
    sh("ip", "netns", "add", name)
    sh("ip", "-n", name, "link", "set", "lo", "up")
    return os.stat(f"/run/netns/{name}").st_ino


def _alloc_state(bridge: str, allocs: list[str]) -> str:
    listed = ", ".join(f"{{id: {a}, subnet: sn}}" for a in allocs)
    return (f"version: 1\nbridges: [{{name: {bridge}}}]\n"
            f"subnets: [{{name: sn, bridge: {bridge}, cidr: 10.219.0.0/24}}]\n"
            f"allocs: [{listed}]\n")


def _lo_alias(ns: str) -> str:
    out = sh("ip", "-n", ns, "-j", "-d", "link", "show", "lo").stdout
    return str(json.loads(out)[0].get("ifalias", ""))


def test_a_sandbox_that_gets_a_deleted_sandboxs_inode_does_not_take_its_allocations(tmp_path):
    """Sandbox A makes allocation X and is deleted (X lives on: a workload may be in it). A new
    sandbox B that gets A's inode must not take X for its own: `plan` there does not prune
    it, `apply` leaves it."""
    a, b, x = unique("sa"), unique("sb"), unique("sx")
    bridge = unique("ib")
    made: list[str] = []
    try:
        made.append(a)
        inode = _sandbox(a)
        cfg = write(tmp_path, "a.yaml", _alloc_state(bridge, [x]))
        made.append(x)
        r = reconcile("apply", cfg, netns=a)
        assert r.rc == 0, r.all
        sh("ip", "netns", "del", a)
        made.remove(a)
        forget_run_files(inode)
        # the kernel hands out the lowest free inode: hold the lower ones others freed
        # until one of ours gets A's
        for i in range(600):
            name = f"{b}-{i}" if i else b
            made.append(name)
            if _sandbox(name) == inode:
                b = name
                break
            time.sleep(0.01)
        else:
            pytest.skip("no new namespace got the deleted sandbox's inode")
        empty = write(tmp_path, "b.yaml", f"version: 1\nbridges: [{{name: {bridge}}}]\n")
        plan = reconcile("plan", empty, netns=b)
        assert x not in plan.out, f"sandbox {b} takes {x} of the deleted {a} for its own:\n" \
                                  f"{plan.out}"
        r = reconcile("apply", empty, netns=b)
        assert r.rc == 0, r.all
        assert os.path.exists(f"/run/netns/{x}") and netns_driver.is_namespace_mount(x)
    finally:
        for name in reversed(made):
            sh("ip", "netns", "del", name, check=False)
        forget_run_files(inode)


def test_allocations_an_earlier_version_marked_stay_ours_on_the_same_namespace(host_ns: Netns,
                                                                             tmp_path):
    """Marks of versions before the cookie (``alloc-of=<inode>``) on the same live sandbox:
    a declared allocation is kept and marked anew, an undeclared one joined to the sandbox
    by its veth is still ours (pruned as any undeclared one), nothing is orphaned."""
    bridge = unique("mb")
    keep, drop = unique("mk"), unique("md")
    both = write(tmp_path, "both.yaml", _alloc_state(bridge, [keep, drop]))
    r = host_ns.reconcile("apply", both)
    assert r.rc == 0, r.all
    inode = os.stat(f"/run/netns/{host_ns.name}").st_ino
    legacy = f"managed-by=reconciler alloc-of={inode}"
    for ns in (keep, drop):  # what an earlier version left on them
        sh("ip", "-n", ns, "link", "set", "dev", "lo", "alias", legacy)
    one = write(tmp_path, "one.yaml", _alloc_state(bridge, [keep]))
    plan = host_ns.reconcile("plan", one, "--output", "json")
    assert plan.rc == 2, plan.all
    changes = {c["name"]: c for c in json.loads(plan.out)["changes"] if c["kind"] == "alloc"}
    assert changes[keep]["action"] == "update", changes
    assert any(a["field"] == "mark" for a in changes[keep]["attrs"]), changes[keep]
    assert changes[drop]["action"] == "delete", changes
    r = host_ns.reconcile("apply", one)
    assert r.rc == 0, r.all
    assert _lo_alias(keep) != legacy and _lo_alias(keep).startswith(f"{legacy}-"), \
        _lo_alias(keep)
    assert not os.path.exists(f"/run/netns/{drop}")
    again = host_ns.reconcile("plan", one)
    assert again.rc == 0, again.all

