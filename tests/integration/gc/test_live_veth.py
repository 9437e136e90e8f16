"""gc never cuts the veth of a namespace that is still mounted and live, whatever its marks.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from reconciler.domain.ownership import alloc_ns_alias, alloc_veth_name
from tests.support.allocs import subnet_config as _config
from tests.support.host import Netns, netns_id, sh, unique

pytestmark = pytest.mark.root




# ------------------------------------------------------------------ item 6: gc


def test_gc_leaves_the_veth_of_a_live_namespace_whatever_the_marks_say(
        host_ns: Netns, tmp_path: Any) -> None:
    """A workload rewrote the ``lo`` alias of its namespace: the namespace is mounted and
    live, its ``eth0`` is the peer of our veth, its file still carries our mark; gc must not
    cut it off. And a foreign rule
    whose comment names an allocation is nobody's leftover: no warning about it."""
    aid, bridge = unique("g") + "-a", unique("b")
    path = _config(tmp_path, bridge, "10.237.0.0/24", [{"id": aid}])
    assert host_ns.reconcile("apply", "--no-probe", path).rc == 0
    veth = alloc_veth_name(aid)
    sh("ip", "-n", aid, "link", "set", "lo", "alias", "a workload's own words")
    try:
        host_ns.run("iptables", "-A", "FORWARD", "-m", "comment", "--comment",
                    "reconciler:alloc=ghost", "-j", "ACCEPT")
        report = host_ns.reconcile("gc", "--plan", "--output", "json")
        assert report.rc in (0, 2), report.all
        doc = json.loads(report.out)
        assert not [c for c in doc["changes"] if veth in json.dumps(c)], doc["changes"]
        assert not [w for w in doc["warnings"] if "ghost" in w], doc["warnings"]
        # the mark on its /run/netns file (which no workload can write) still proves the
        # namespace ours, whatever lo's alias says: an allocation, no candidate orphan to warn of
        assert not [w for w in doc["warnings"] if veth in w or f"/run/netns/{aid}" in w], \
            doc["warnings"]
        done = host_ns.reconcile("gc")
        assert done.rc == 0, done.all
        assert host_ns.link(veth) is not None
        assert sh("ip", "-n", aid, "-j", "link", "show", "eth0").stdout.strip() not in ("", "[]")
    finally:  # the mark back: the sandbox's teardown destroys what is ours
        sh("ip", "-n", aid, "link", "set", "lo", "alias", host_alias(host_ns))


def host_alias(host: Netns) -> str:
    """The ``lo`` alias the reconciler of the sandbox writes (to put the mark back)."""
    return alloc_ns_alias(netns_id(host.name))




def test_gc_leaves_a_veth_whose_peer_a_namespace_without_our_mark_holds(
        host_ns: Netns, tmp_path: Any) -> None:
    """Someone moved an allocation's ``eth0`` into a namespace of their own and the allocation's
    namespace is gone: our veth's peer lives on in a namespace without this host's mark. gc
    must not cut it, and says why it is not an orphan."""
    aid, bridge = unique("g") + "-a", unique("b")
    path = _config(tmp_path, bridge, "10.237.1.0/24", [{"id": aid}])
    assert host_ns.reconcile("apply", "--no-probe", path).rc == 0
    veth, theirs = alloc_veth_name(aid), unique("w")
    sh("ip", "netns", "add", theirs)  # no mark on its file, no alias on its lo
    try:
        sh("ip", "-n", aid, "link", "set", "eth0", "netns", theirs)
        sh("ip", "netns", "del", aid)
        report = host_ns.reconcile("gc", "--plan", "--output", "json")
        assert report.rc in (0, 2), report.all
        doc = json.loads(report.out)
        assert not [c for c in doc["changes"] if veth in json.dumps(c)], doc["changes"]
        assert [w for w in doc["warnings"] if veth in w and f"/run/netns/{theirs}" in w
                and "not an orphan" in w], doc["warnings"]
        done = host_ns.reconcile("gc")
        assert done.rc == 0, done.all
        assert host_ns.link(veth) is not None
        assert sh("ip", "-n", theirs, "-j", "link", "show", "eth0").stdout.strip() not in ("", "[]")
    finally:
        sh("ip", "netns", "del", theirs, check=False)
