"""The checkpoint (planner/checkpoint, domain/checkpoint) and the restore plan made from it:
what is recorded, what goes back, in which order."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from reconciler.domain.checkpoint import Checkpoint, CheckpointError, EndpointPoint, NetworkPoint
from reconciler.domain.live import (
    LiveChainSet,
    LiveLink,
)
from reconciler.domain.ops import decode
from reconciler.domain.ownership import LINK_ALIAS, alloc_mac, alloc_ns_alias, alloc_veth_name
from reconciler.planner.checkpoint import restore_plan, take
from tests.support.checkpoints import HOST, VETH, live_alloc, live_host, plan_ops


def test_a_checkpoint_records_only_what_is_owned_and_round_trips_through_json() -> None:
    nets = (NetworkPoint("web", "1" * 64, "bridge", (("mtu", "1400"),), (("l", "v"),), True,
                         False, (("10.5.0.0/16", "10.5.0.1"),),
                         (EndpointPoint("c" * 64, "c1", "10.5.0.3", None, ("api",)),)),)
    cp = take(live_host(), nets)
    assert set(cp.links) == {"br0", VETH}  # eth9 is not ours
    assert cp.links["br0"].addresses == ("10.0.0.1/24",)  # the foreign address is not ours
    assert set(cp.allocs) == {"a1"} and cp.allocs["a1"].gateways == ("10.0.0.1",)
    assert set(cp.firewall[4]) == {("filter", "RECONCILER-FORWARD"), ("nat", "RECONCILER-DNAT")}
    again = Checkpoint.from_json(json.loads(json.dumps(cp.to_json())))
    assert again == cp


@pytest.mark.parametrize("raw", [None, {}, {"version": 99}, {"version": 1, "links": 5},
                                 {"version": 1, "host_id": "1", "links": [{"x": 1}]}])
def test_a_checkpoint_this_version_cannot_read_is_one_error(raw: Any) -> None:
    with pytest.raises(CheckpointError):
        Checkpoint.from_json(raw)


def test_nothing_changed_nothing_to_restore() -> None:
    live = live_host()
    assert not restore_plan(take(live), live).has_changes


def test_what_the_old_files_left_to_the_kernel_goes_back_to_its_value() -> None:
    """The bridge followed its ports (MTU 1500) and its port had hairpin on: the change set
    an MTU and turned hairpin off; the restore sets both back to the values."""
    cp = take(live_host())
    plan = restore_plan(cp, live_host(bridge_mtu=1400, hairpin=False))
    ops = plan_ops(plan)
    assert ("link.set", {"name": "br0", "mtu": 1500}) in ops
    assert ("link.set", {"name": VETH, "mtu": 1500}) in ops
    assert ("link.set_hairpin", {"name": VETH, "on": True}) in ops
    # eth0 inside followed the bridge too
    assert any(n == "alloc.configure" and a["mtu"] == 1500 for n, a in ops), ops


def test_what_the_change_created_goes_first_and_what_it_deleted_comes_back() -> None:
    cp = take(live_host())
    now = live_host(allocs=("a2",), extra_bridge=True, fw=LiveChainSet(available=True))
    plan = restore_plan(cp, now)
    ops = plan_ops(plan)
    names = [n for n, _a in ops]
    # a2 and br1 were made by the change: deleted, before anything is re-created
    assert ops[0] == ("link.delete", {"name": alloc_veth_name("a2")})
    assert ops[1] == ("netns.delete", {"name": "a2"})
    assert ("link.delete", {"name": "br1"}) in ops
    assert names.index("link.delete") < names.index("netns.create")
    # a1 comes back with its MAC, addresses and gateway, marked as this host's
    create = next(a for n, a in ops if n == "netns.create")
    assert create == {"name": "a1", "replace_stale": False, "mark": alloc_ns_alias(HOST)}
    attach = next(a for n, a in ops if n == "alloc.attach")
    assert attach["mac"] == alloc_mac("a1") and attach["bridge"] == "br0" and attach["hairpin"]
    configure = next(a for n, a in ops if n == "alloc.configure")
    assert configure["addresses"] == ["10.0.0.2/24"] and configure["gateways"] == ["10.0.0.1"]
    assert ("link.set_mac", {"name": VETH, "mac": "aa:00:00:00:00:06"}) in ops
    # the rules, as one transaction: the table rebuilt with every recorded entry
    fw = next(a for n, a in ops if n == "firewall.nft")
    assert fw["rebuild"] and {d["set"] for d in fw["add"]} == {"pm4", "open4"}, fw
    assert names[-1] == "firewall.nft"
    for c in plan.actionable:  # every op is one the executor can decode
        for op in c.ops:
            decode(op)


def test_an_address_the_change_moved_is_moved_back() -> None:
    cp = take(live_host())
    now = live_host()
    now.netns["a1"] = live_alloc("a1", "10.0.0.9/24")
    ops = plan_ops(restore_plan(cp, now))
    assert ("addr.del", {"link": "eth0", "address": "10.0.0.9/24", "netns": "a1"}) in ops
    assert any(n == "alloc.configure" and a["addresses"] == ["10.0.0.2/24"] for n, a in ops)


def test_a_sysctl_the_change_set_is_set_back() -> None:
    cp = take(live_host())
    now = live_host()
    now.sysctls["net/ipv6/conf/all/forwarding"] = "1"
    assert plan_ops(restore_plan(cp, now)) == [
        ("sysctl.set", {"key": "net/ipv6/conf/all/forwarding", "value": "0"})]


def test_docker_networks_are_restored_with_their_attachments() -> None:
    web = NetworkPoint("web", "1" * 64, pools=(("10.5.0.0/16", "10.5.0.1"),),
                       endpoints=(EndpointPoint("c" * 64, "c1", "10.5.0.3"),))
    live = live_host()
    cp = take(live, (web,))
    made = NetworkPoint("new", "2" * 64)
    replaced = dataclasses.replace(web, id="3" * 64, options=(("mtu", "1400"),), endpoints=())
    ops = plan_ops(restore_plan(cp, live, (replaced, made)))
    assert ("docker.remove", {"id": "2" * 64, "name": "new"}) in ops
    restore = next(a for n, a in ops if n == "docker.restore")
    assert restore["replace_id"] == "3" * 64
    assert restore["network"]["endpoints"][0]["ipv4"] == "10.5.0.3"
    # a checkpoint without Docker leaves Docker alone
    assert not restore_plan(take(live), live, (made,)).has_changes


def test_a_revert_never_deletes_what_was_foreign_at_the_checkpoint() -> None:
    """A foreign bridge, namespace and Docker network became ours within the window (the
    CLI refuses ``--adopt`` under a window, tests/unit/cli/test_safe.py; this is the
    restore plan's own guarantee, for a record from an older version or an agent that
    adopted): the revert never deletes them (deleting them would destroy someone else's
    objects). It cannot give them back either: that is why a window refuses --adopt."""
    from reconciler.domain.live import LiveDocker, LiveDockerNetwork

    def net(owned: bool) -> LiveDockerNetwork:
        labels = {"io.reconciler.managed": "true"} if owned else {}
        return LiveDockerNetwork("9" * 64, "theirs", "bridge", labels, {}, False, False, (), 0)

    live = live_host()
    links = dict(live.links)
    links["theirs0"] = LiveLink("theirs0", 12, "bridge", 1500, True, False)
    netns = dict(live.netns)
    foreign_ns = live_alloc("theirs-ns")
    lo = dataclasses.replace(foreign_ns.links[0], alias=None)
    netns["theirs-ns"] = dataclasses.replace(foreign_ns, links=(lo, *foreign_ns.links[1:]))
    before = dataclasses.replace(live, links=links, netns=netns,
                                 docker=LiveDocker(True, networks=(net(False),)))
    cp = Checkpoint.from_json(take(before, ()).to_json())
    assert cp.foreign["links"] == ("eth9", "theirs0") and cp.foreign["netns"] == ("theirs-ns",)
    links["theirs0"] = dataclasses.replace(links["theirs0"], owned=True, alias=LINK_ALIAS)
    netns["theirs-ns"] = foreign_ns
    after = dataclasses.replace(live, links=links, netns=netns,
                                docker=LiveDocker(True, networks=(net(True),)))
    ops = plan_ops(restore_plan(cp, after, (NetworkPoint("theirs", "9" * 64),)))
    assert not any(a.get("name") in ("theirs0", "theirs-ns", "theirs") for _n, a in ops), ops
