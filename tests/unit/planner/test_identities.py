"""Stable identities, pure parts: the MAC derivation and what the planner makes of MACs and
neighbour entries (issue 13, item 1). The kernel side is tests/integration/allocs/test_identities.py.
"""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest

from reconciler.domain import ownership
from reconciler.domain.live import LiveNeighbour
from reconciler.domain.ops import (
    AllocAttach,
    AllocConfigure,
    LinkAddBridge,
    LinkSetMac,
    NeighReplace,
    decode,
)
from reconciler.domain.ownership import alloc_mac, alloc_veth_name, bridge_mac, derived_mac
from reconciler.domain.plan import Action, Change, Op, Plan
from reconciler.drivers import sysfsnet
from reconciler.drivers.netlink.parse import parse_neigh
from reconciler.drivers.netlink.wire import (
    HDR,
    NDA_DST,
    NDA_LLADDR,
    NDMSG,
    NUD_NOARP,
    NUD_PERMANENT,
    NUD_STALE,
    RTM_NEWNEIGH,
    NlMsg,
    attr,
)
from tests.support.fakehost import FakeHost
from tests.support.planning import alloc, converge, plan, port, state, subnet


def ops_of(change: Change, cls: type) -> list:  # type: ignore[type-arg]
    return [op for op in map(decode, change.ops) if isinstance(op, cls)]


def change_of(p: Plan, kind: str, name: str) -> Change:
    return next(c for c in p.changes if (c.kind, c.name) == (kind, name))


# ------------------------------------------------------------------ derivation


def test_derived_macs_are_pinned_values():
    # the same across heals, restarts and versions: a change here re-MACs every allocation
    assert alloc_mac("web-1") == "02:b9:26:85:7b:df"
    assert bridge_mac("nomad") == "46:0b:63:14:d8:2f"


@pytest.mark.parametrize("name", ["a", "web-1", "x" * 200, "ünïcode", ""])
def test_derived_macs_are_locally_administered_unicast(name: str):
    for mac in (alloc_mac(name), bridge_mac(name)):
        first = int(mac[:2], 16)
        assert first & 0x02 and not first & 0x01, mac
        assert len(bytes.fromhex(mac.replace(":", ""))) == 6 and mac == mac.lower()
    assert alloc_mac(name) != bridge_mac(name)  # one prefix each


def test_derivation_keeps_46_bits_of_the_hash():
    macs = {derived_mac(b"p/", str(i)) for i in range(5000)}
    assert len(macs) == 5000
    assert {int(m[:2], 16) & 0x03 for m in macs} == {0x02}
    assert len({int(m[:2], 16) >> 2 for m in macs}) == 64  # the other 6 bits of octet 1 vary


# ------------------------------------------------------------------ allocations


def test_new_allocs_and_bridges_are_made_with_their_derived_macs():
    host = FakeHost()
    p = plan(host, state(alloc("a")))
    (attach,) = ops_of(change_of(p, "alloc", "a"), AllocAttach)
    assert attach.mac == alloc_mac("a")
    (add,) = ops_of(change_of(p, "bridge", "br0"), LinkAddBridge)
    assert add.mac == bridge_mac("br0")
    converge(host, state(alloc("a")))
    assert host.netns["a"].links["eth0"].mac == alloc_mac("a")


def test_an_existing_eth0_with_another_mac_is_no_change():
    host = FakeHost()
    desired = state(alloc("a"))
    converge(host, desired)
    eth0 = host.netns["a"].links["eth0"]
    host.netns["a"].links["eth0"] = dataclasses.replace(eth0, mac="0a:11:22:33:44:55")
    host.neighbours.clear()  # made by an older version: nothing seeded for the derived MAC
    assert not plan(host, desired).has_changes  # kept


def test_a_heal_uses_the_derived_mac_and_replaces_the_entry_of_the_old_one():
    host = FakeHost()
    desired = state(alloc("a"))
    converge(host, desired)
    eth0 = host.netns["a"].links["eth0"]
    host.netns["a"].links["eth0"] = dataclasses.replace(eth0, mac="0a:11:22:33:44:55")
    index = host.links["br0"].index
    host.neighbours = [LiveNeighbour(index, "10.0.0.2", "0a:11:22:33:44:55", False)]
    del host.links[alloc_veth_name("a")]  # the heal re-creates the pair
    host.netns["a"].links.pop("eth0")
    c = change_of(plan(host, desired), "alloc", "a")
    (attach,) = ops_of(c, AllocAttach)
    (neigh,) = ops_of(c, NeighReplace)
    assert attach.mac == neigh.mac == alloc_mac("a")
    assert (neigh.link, neigh.address) == ("br0", "10.0.0.2")
    assert [op.name for op in c.ops][-1] == "neigh.replace"  # after eth0 is back
    converge(host, desired)
    # replaced as ours: exempt from the kernel's GC, so a plan deletes it when "a" goes
    assert host.neighbours == [LiveNeighbour(index, "10.0.0.2", alloc_mac("a"), False,
                                             extern_learn=True, protocol=ownership.NEIGH_PROTO)]


def test_a_stale_entry_is_replaced_with_eth0s_live_mac():
    host = FakeHost()
    desired = state(alloc("a"))
    converge(host, desired)
    live = "0a:11:22:33:44:55"
    eth0 = host.netns["a"].links["eth0"]
    host.netns["a"].links["eth0"] = dataclasses.replace(eth0, mac=live)
    index = host.links["br0"].index
    host.neighbours = [LiveNeighbour(index, "10.0.0.2", "0a:00:00:00:00:99", False),
                        LiveNeighbour(index, "10.0.0.9", "0a:00:00:00:00:98", False),
                        LiveNeighbour(index + 100, "10.0.0.2", "0a:00:00:00:00:97", False)]
    c = change_of(plan(host, desired), "alloc", "a")
    assert c.action is Action.UPDATE and c.reason == "changed: neighbour"
    assert ops_of(c, NeighReplace) == [NeighReplace("br0", "10.0.0.2", live)]


def test_a_permanent_wrong_entry_is_a_warning_and_left_alone():
    host = FakeHost()
    desired = state(alloc("a"))
    converge(host, desired)
    index = host.links["br0"].index
    host.neighbours.append(LiveNeighbour(index, "10.0.0.2", "0a:00:00:00:00:99", True))
    p = plan(host, desired)
    assert not p.has_changes
    (warning,) = [w for w in p.warnings if "neighbour" in w]
    assert "permanent neighbour entry 10.0.0.2 lladdr 0a:00:00:00:00:99" in warning
    assert alloc_mac("a") in warning and "br0" in warning


def test_two_allocs_deriving_one_mac_on_one_bridge_are_both_conflicts(monkeypatch):
    real = ownership.alloc_mac
    monkeypatch.setattr(ownership, "alloc_mac",
                        lambda aid: "02:00:00:00:00:01" if aid in ("a", "b") else real(aid))
    host = FakeHost()
    p = plan(host, state(alloc("a", port(8080, 80)), alloc("b"), alloc("c", port(8081, 80))))
    for aid, other in (("a", "'b'"), ("b", "'a'")):
        c = change_of(p, "alloc", aid)
        assert c.action is Action.CONFLICT and not c.ops
        assert "02:00:00:00:00:01" in c.reason and f"alloc {other}" in c.reason
    assert change_of(p, "alloc", "c").action is Action.CREATE
    scripts = json.dumps([op.args for c in p.changes for op in c.ops])
    assert "alloc=c" in scripts and "alloc=a" not in scripts  # a conflict reaches no rule


# ------------------------------------------------------------------ announcements


def announces(p: Plan, aid: str) -> bool:
    (configure,) = ops_of(change_of(p, "alloc", aid), AllocConfigure)
    return bool(configure.announce)


def test_a_bulk_create_of_addresses_nobody_has_seen_announces_nothing():
    host = FakeHost()
    desired = state(*(alloc(f"a{i}", port(None, 80)) for i in range(20)),
                    sub=subnet(cidr6="fd00:1::/64"))
    p = plan(host, desired)
    assert not any(announces(p, f"a{i}") for i in range(20))
    # the field is omitted at its default: the plan's JSON is what it was before it
    assert '"announce"' not in json.dumps(p.to_json())
    converge(host, desired)


def test_a_new_alloc_announces_an_address_the_bridges_neighbour_table_has():
    host = FakeHost()
    converge(host, state(alloc("a")))
    index = host.links["br0"].index
    # any state observation keeps: a stale one of a gone allocation, a permanent one
    host.neighbours += [LiveNeighbour(index, "10.0.0.3", "0a:00:00:00:00:99", False),
                        LiveNeighbour(index, "10.0.0.5", "0a:00:00:00:00:98", True),
                        LiveNeighbour(index + 100, "10.0.0.4", "0a:00:00:00:00:97", False)]
    desired = state(alloc("a"), alloc("b"), alloc("c"), alloc("d"), alloc("e"))
    p = plan(host, desired)
    assert [aid for aid in "bcde" if announces(p, aid)] == ["b", "d"]  # .3 and .5; .4 elsewhere
    assert change_of(p, "alloc", "a").action is Action.NOOP


def test_a_bridge_with_a_foreign_port_announces_every_new_address():
    # a NIC (or another tool's veth) on the bridge leads to caches we cannot read
    host = FakeHost()
    converge(host, state(alloc("a")))
    host.links["eno1"] = dataclasses.replace(host.links["br0"], name="eno1", index=900,
                                             kind="", owned=False, master="br0", alias=None,
                                             addresses=())
    p = plan(host, state(alloc("a"), alloc("b")))
    assert announces(p, "b")
    del host.links["eno1"]
    assert not announces(plan(host, state(alloc("a"), alloc("b"))), "b")


def test_an_ipv6_entry_alone_makes_a_dual_stack_alloc_announce():
    host = FakeHost()
    sub = subnet(cidr6="fd00:1::/64")
    converge(host, state(sub=sub))
    host.neighbours.append(LiveNeighbour(host.links["br0"].index, "fd00:1::2",
                                         "0a:00:00:00:00:99", False))
    assert announces(plan(host, state(alloc("a"), sub=sub)), "a")


def test_an_address_a_pruned_alloc_hands_over_in_the_same_plan_is_announced():
    host = FakeHost()
    converge(host, state(alloc("a"), alloc("b")))
    held = {aid: str(host.netns[aid].links["eth0"].addresses[0].address.ip) for aid in "ab"}
    # a goes, c comes and takes its address (the lowest free one)
    p = plan(host, state(alloc("b"), alloc("c")))
    assert change_of(p, "alloc", "a").action is Action.DELETE
    (configure,) = ops_of(change_of(p, "alloc", "c"), AllocConfigure)
    assert configure.addresses == (f"{held['a']}/24",) and configure.announce
    converge(host, state(alloc("b"), alloc("c")))


def test_a_heal_and_a_re_added_address_announce_and_a_missing_route_does_not():
    host = FakeHost()
    desired = state(alloc("a"), alloc("b"), alloc("c"))
    converge(host, desired)
    del host.links[alloc_veth_name("a")]  # a heal re-creates the pair
    host.netns["a"].links.pop("eth0")
    eth0 = host.netns["b"].links["eth0"]  # b lost its address
    host.netns["b"].links["eth0"] = dataclasses.replace(eth0, addresses=())
    host.netns["c"].routes.clear()  # c lost its default route: its addresses stayed
    p = plan(host, desired)
    assert [announces(p, aid) for aid in "abc"] == [True, True, False]
    converge(host, desired)


def test_a_veth_left_behind_by_a_gone_namespace_makes_the_new_one_announce():
    host = FakeHost()
    desired = state(alloc("a"))
    converge(host, desired)
    del host.netns["a"]  # the namespace file went; the veth (and maybe its peer) stayed
    p = plan(host, desired)
    assert change_of(p, "alloc", "a").reason == "namespace missing (veth left behind)"
    assert announces(p, "a")


def test_a_configure_op_of_an_earlier_plan_does_not_announce():
    op = decode(Op("alloc.configure", {"netns": "a", "addresses": ["10.0.0.2/24"],
                                       "gateways": ["10.0.0.1"], "mtu": None, "ipv6": False,
                                       "mark": "m"}))
    assert isinstance(op, AllocConfigure) and op.announce is False


# ------------------------------------------------------------------ bridges


def test_a_bridge_whose_mac_follows_its_ports_is_pinned_to_the_one_it_has():
    host = FakeHost()
    desired = state(alloc("a"))
    converge(host, desired)
    br = host.links["br0"]
    host.links["br0"] = dataclasses.replace(br, mac="0a:00:00:00:00:07", mac_pinned=False)
    c = change_of(plan(host, desired), "bridge", "br0")
    assert c.action is Action.UPDATE and c.reason == "changed: mac"
    assert [(a.field, a.before, a.after) for a in c.attrs] == [
        ("mac", "0a:00:00:00:00:07", "pin 0a:00:00:00:00:07")]
    assert ops_of(c, LinkSetMac) == [LinkSetMac("br0", "0a:00:00:00:00:07")]
    converge(host, desired)
    assert host.links["br0"].mac == "0a:00:00:00:00:07"


def test_a_bridge_without_ports_gets_the_derived_mac_and_unknown_is_left_alone():
    host = FakeHost()
    desired = state()
    converge(host, desired)
    br = host.links["br0"]
    host.links["br0"] = dataclasses.replace(br, mac=ownership.ZERO_MAC, mac_pinned=False)
    c = change_of(plan(host, desired), "bridge", "br0")
    assert ops_of(c, LinkSetMac) == [LinkSetMac("br0", bridge_mac("br0"))]
    host.links["br0"] = dataclasses.replace(br, mac="0a:00:00:00:00:07", mac_pinned=None)
    assert not plan(host, desired).has_changes


# ------------------------------------------------------------------ parsing, sysfs


def _neigh(family: int, dst: bytes, lladdr: bytes | None, state: int) -> NlMsg:
    body = NDMSG.pack(family, 7, state, 0, 1) + attr(NDA_DST, dst)
    if lladdr is not None:
        body += attr(NDA_LLADDR, lladdr)
    raw = HDR.pack(16 + len(body), RTM_NEWNEIGH, 0, 0, 0) + body
    return NlMsg.decode(raw)


def test_neighbour_messages_parse_to_entries_with_a_link_layer_address():
    mac = bytes.fromhex("0a0000000001")
    assert parse_neigh(_neigh(socket.AF_INET, bytes([10, 0, 0, 2]), mac, NUD_STALE)) == \
        LiveNeighbour(7, "10.0.0.2", "0a:00:00:00:00:01", False)
    v6 = socket.inet_pton(socket.AF_INET6, "fd00::2")
    assert parse_neigh(_neigh(socket.AF_INET6, v6, mac, NUD_PERMANENT)) == \
        LiveNeighbour(7, "fd00::2", "0a:00:00:00:00:01", True)
    assert parse_neigh(_neigh(socket.AF_INET, bytes(4), None, 0x20)) is None  # FAILED
    assert parse_neigh(_neigh(socket.AF_INET, bytes(4), mac, NUD_NOARP)) is None
    assert parse_neigh(_neigh(7, bytes(6), mac, NUD_STALE)) is None  # AF_BRIDGE: an fdb


def test_sysfs_is_believed_only_where_it_shows_what_netlink_saw(monkeypatch):
    tables = {"/sys": {"br0": (5, "0a:00:00:00:00:01", 1), "br1": (9, "0a:00:00:00:00:02", 3)}}
    private: list[list[str]] = []
    monkeypatch.setattr(sysfsnet, "_read", lambda root, name: tables[root].get(name))

    def read_private(names: list[str]) -> dict[str, tuple[int, str, int] | None]:
        private.append(names)
        return {n: (6, "0a:00:00:00:00:03", 3) if n == "br0" else None for n in names}

    monkeypatch.setattr(sysfsnet, "_read_private", read_private)
    assert sysfsnet.mac_is_set({"br0": (5, "0a:00:00:00:00:01"),
                                "br1": (9, "0a:00:00:00:00:02")}) == {"br0": False, "br1": True}
    assert not private
    # another namespace's /sys (a sandbox run): read through a private mount instead
    assert sysfsnet.mac_is_set({"br0": (6, "0a:00:00:00:00:03"),
                                "br2": (4, "0a:00:00:00:00:04")}) == {"br0": True, "br2": None}
    assert private == [["br0", "br2"]]


class _CountingTuple(tuple):  # type: ignore[type-arg]
    """A tuple that counts how often it is walked."""

    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        type(self).walks += 1
        return super().__iter__()


def test_a_plan_walks_the_neighbour_table_a_bounded_number_of_times(monkeypatch):
    """The planner looked through every neighbour entry for each allocation: with an entry
    per allocation (as the seeding makes) a plan of N allocations cost N^2 (~30 ms at 500,
    four times that at 1000). Counted, not timed: the table is walked a few times per
    plan, not once per allocation."""
    host = FakeHost()
    n = 300
    desired = state(*(alloc(f"a{i}") for i in range(n)), sub=subnet(cidr="10.0.0.0/22"))
    converge(host, desired)
    index = host.links["br0"].index
    for i in range(n):  # an entry per allocation, as the seeding makes them
        eth0 = host.netns[f"a{i}"].links["eth0"]
        host.neighbours.append(LiveNeighbour(index, str(eth0.addresses[0].address.ip),
                                             eth0.mac or "", False))
    assert not plan(host, desired).has_changes
    # one stale entry among them, still found and replaced
    stale = host.neighbours[7]
    host.neighbours[7] = dataclasses.replace(stale, mac="0a:00:00:00:00:99")
    real = host._neighbours
    monkeypatch.setattr(host, "_neighbours", lambda d: _CountingTuple(real(d)))
    _CountingTuple.walks = 0
    p = plan(host, desired)
    assert _CountingTuple.walks <= 10, _CountingTuple.walks
    replaced = [op for c in p.changes for op in map(decode, c.ops) if isinstance(op, NeighReplace)]
    assert [op.address for op in replaced] == [stale.address]
