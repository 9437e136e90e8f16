"""Our neighbour entries, pure parts: exempt from the kernel's GC, so the planner deletes
the bridge-side ones of an allocation pruned or re-addressed, and never anyone else's
(issue 13 item 6). The kernel side is tests/integration/allocs/test_neighbours.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from reconciler.domain.errors import PlanError
from reconciler.domain.live import LiveLink, LiveNeighbour
from reconciler.domain.ops import NeighDelete, NeighReplace, decode, encode
from reconciler.domain.ownership import NEIGH_PROTO, alloc_mac, alloc_veth_name
from reconciler.domain.plan import Action, Change, Plan
from reconciler.planner.allocs.neighbours import own_neighbour
from reconciler.planner.context import index_neighbours
from reconciler.planner.gc import _marked, gc_plan, only_removals
from tests.support.fakehost import FakeHost
from tests.support.planning import alloc, converge, plan, state, subnet

DUAL = subnet(cidr6="fd00::/64")


def neigh_ops(p: Plan, cls: type = NeighDelete) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    """(change address, entry address) of each neighbour op of ``cls`` in the plan."""
    return [(c.address, op.address) for c in p.actionable for op in map(decode, c.ops)
            if isinstance(op, cls)]


def ours(host: FakeHost, address: str, mac: str, **kw: object) -> LiveNeighbour:
    fields: dict[str, object] = {"extern_learn": True, "protocol": NEIGH_PROTO, **kw}
    return LiveNeighbour(host.links["br0"].index, address, mac, False, **fields)  # type: ignore[arg-type]


def test_the_fake_seeds_like_the_kernel_exempt_and_marked():
    host = FakeHost()
    converge(host, state(alloc("a"), sub=DUAL))
    assert host.neighbours == [ours(host, "10.0.0.2", alloc_mac("a")),
                               ours(host, "fd00::2", alloc_mac("a"))]


def test_a_pruned_allocs_entries_go_with_its_namespace_and_the_next_plan_is_empty():
    host = FakeHost()
    converge(host, state(alloc("a"), alloc("b"), sub=DUAL))
    only_a = state(alloc("a"), sub=DUAL)
    p = plan(host, only_a)
    assert neigh_ops(p) == [("alloc/b", "10.0.0.3"), ("alloc/b", "fd00::3")]
    (b,) = [c for c in p.actionable if c.name == "b"]
    assert b.action is Action.DELETE and [o.name for o in b.ops] == [
        "netns.delete", "neigh.delete", "neigh.delete"]
    assert [(x.field, x.before, x.after) for x in b.attrs] == [
        ("neighbour", f"10.0.0.3 at {alloc_mac('b')}", None),
        ("neighbour", f"fd00::3 at {alloc_mac('b')}", None)]
    converge(host, only_a)  # and a second plan is empty
    assert sorted(n.address for n in host.neighbours) == ["10.0.0.2", "fd00::2"]


def test_without_pruning_an_undeclared_allocs_entries_stay():
    host = FakeHost()
    converge(host, state(alloc("a"), alloc("b")))
    p = plan(host, state(alloc("a")), prune=False)
    assert not neigh_ops(p) and not p.has_changes


def test_a_readdressed_allocs_old_entry_goes_with_its_update():
    host = FakeHost()
    converge(host, state(alloc("a", address="10.0.0.10")))
    moved = state(alloc("a", address="10.0.0.11"))
    p = plan(host, moved)
    assert neigh_ops(p) == [("alloc/a", "10.0.0.10")]
    (a,) = p.actionable
    assert a.action is Action.UPDATE and "neighbour" in a.reason
    converge(host, moved)
    assert [n.address for n in host.neighbours] == []  # 10.0.0.11 is learnt, not seeded


def test_an_allocation_moved_to_another_bridge_leaves_nothing_on_the_old_one():
    host = FakeHost()
    two = dataclasses.replace(state(alloc("a")), bridges={
        **state().bridges, **state(br=dataclasses.replace(
            state().bridges["br0"], name="br1")).bridges})  # type: ignore[arg-type]
    two = dataclasses.replace(two, subnets={
        "net": subnet(), "other": subnet("other", br="br1", cidr="10.1.0.0/24")})
    converge(host, two)
    moved = dataclasses.replace(two, allocs={"a": alloc("a", sub="other")})
    p = plan(host, moved)
    assert ("alloc/a", "10.0.0.2") in neigh_ops(p)
    converge(host, moved)
    assert {n.index for n in host.neighbours} <= {host.links["br1"].index}


def test_an_address_handed_to_a_new_allocation_is_replaced_not_deleted():
    host = FakeHost()
    converge(host, state(alloc("a"), alloc("b")))
    after = state(alloc("a"), alloc("c"))
    p = plan(host, after)
    # c takes the address b leaves: b's entry is pointed at c's MAC, never deleted
    assert ("alloc/c", "10.0.0.3") in neigh_ops(p, NeighReplace)
    assert not neigh_ops(p)
    converge(host, after)
    assert ours(host, "10.0.0.3", alloc_mac("c")) in host.neighbours


def test_the_entries_of_an_allocation_gone_by_hand_are_orphans_deleted_even_without_prune():
    host = FakeHost()
    converge(host, state(alloc("a"), alloc("b")))
    host.netns.pop("b")
    host.links.pop(alloc_veth_name("b"))
    for prune in (True, False):
        p = plan(host, state(alloc("a")), prune=prune)
        assert [(c.address, c.action) for c in p.actionable] == [
            ("neighbour/br0/10.0.0.3", Action.DELETE)]
        assert "orphan" in p.actionable[0].reason
    converge(host, state(alloc("a")))
    assert [n.address for n in host.neighbours] == ["10.0.0.2"]


def test_foreign_look_alikes_are_never_deleted():
    host = FakeHost()
    converge(host, state(alloc("a")))
    la = "02:5e:00:00:00:01"  # our MACs' format
    foreign = [
        ours(host, "10.0.0.200", la, extern_learn=False),  # the kernel's own kind
        ours(host, "10.0.0.201", la, protocol=0),  # extern_learn, not our protocol
        ours(host, "10.0.0.202", "00:16:3e:00:00:02", protocol=11),  # a vendor's, zebra's
        dataclasses.replace(ours(host, "10.0.0.203", la), permanent=True),  # pinned
        ours(host, "10.0.0.204", la, protocol=3),  # another control plane's
    ]
    host.neighbours += foreign
    assert not plan(host, state(alloc("a"))).has_changes
    converge(host, state(alloc("a")))
    assert all(n in host.neighbours for n in foreign)


def test_a_bridge_that_is_not_ours_has_no_entries_of_ours():
    host = FakeHost()
    converge(host, state(alloc("a")))
    br0 = host.links["br0"]
    n = ours(host, "10.0.0.9", alloc_mac("gone"))
    assert own_neighbour(br0, n)
    assert not own_neighbour(dataclasses.replace(br0, owned=False), n)
    assert not own_neighbour(dataclasses.replace(br0, kind="veth"), n)
    assert not own_neighbour(dataclasses.replace(br0, index=br0.index + 1), n)
    # an undeclared bridge is not even read (nor is any bridge without files: gc)
    host.links["brx"] = LiveLink("brx", 99, "bridge", 1500, True, False)
    host.neighbours.append(dataclasses.replace(n, index=99))
    assert not plan(host, state(alloc("a"))).has_changes


def test_gc_with_files_collects_orphans_and_checks_the_mark_again():
    host = FakeHost()
    converge(host, state(alloc("a"), alloc("b")))
    host.netns.pop("b")
    host.links.pop(alloc_veth_name("b"))
    files = state(alloc("a"))
    live = host.observe(files)
    p = gc_plan(live, files)
    assert "neighbour/br0/10.0.0.3" in {c.address for c in p.actionable}
    # without files no bridge is declared, so none is read: nothing of this kind to collect
    assert all(c.kind != "neighbour" for c in gc_plan(host.observe(state()), None).actionable)
    # a neighbour change whose entry is not ours (here: a's own, plain) is not collected
    host.neighbours = [dataclasses.replace(n, extern_learn=False) for n in host.neighbours]
    forged = Change("neighbour", "br0/10.0.0.2", Action.DELETE,
                    ops=(encode(NeighDelete("br0", "10.0.0.2")),))
    seen = host.observe(files)
    assert not _marked(forged, seen, index_neighbours(seen.neighbours))
    only_removals(Plan((forged,)), live)  # a deletion, so it is a removal


def test_a_neigh_delete_is_a_removal_and_a_replace_is_not():
    host = FakeHost()
    live = host.observe(state())
    only_removals(Plan((Change("neighbour", "br0/10.0.0.2", Action.DELETE,
                               ops=(encode(NeighDelete("br0", "10.0.0.2")),)),)), live)
    with pytest.raises(PlanError, match="is not a removal"):
        only_removals(Plan((Change("neighbour", "br0/10.0.0.2", Action.DELETE, ops=(
            encode(NeighReplace("br0", "10.0.0.2", "02:00:00:00:00:01")),)),)), live)


# ------------------------------------------------------------------ the table's limit


def warnings(host: FakeHost, *aids: str) -> list[str]:
    return [w for w in plan(host, state(*(alloc(a) for a in aids))).warnings
            if "neighbour entries" in w]


def test_seeded_entries_no_longer_count_toward_the_neighbour_table_limit():
    host = FakeHost()
    host.sysctls["net/ipv4/neigh/default/gc_thresh3"] = "8"
    many = [f"a{i}" for i in range(5)]
    converge(host, state(*(alloc(a) for a in many)))
    assert not warnings(host, *many)  # 5 allocations, 10 entries, all exempt
    # made by an older version: plain entries, on the bridge and (unseen) inside
    host.neighbours = [dataclasses.replace(n, extern_learn=False, protocol=0)
                       for n in host.neighbours]
    (warning,) = warnings(host, *many)
    assert "5 IPv4 neighbour entries of the allocations' bridges are not exempt" in warning
    assert "up to 10" in warning and "net.ipv4.neigh.default.gc_thresh3" in warning
    host.neighbours = host.neighbours[:4]
    assert not warnings(host, *many)  # up to 8: within the limit
    host.neighbours = [dataclasses.replace(n, extern_learn=False, protocol=0)
                       for n in host.neighbours] * 3
    host.sysctls.pop("net/ipv4/neigh/default/gc_thresh3")  # a sandbox cannot read it
    assert not warnings(host, *many)
