"""Leases, pure parts (SPEC §11): the precedence per value, and what the planner makes of a lease
table on the in-memory host. The kernel side is tests/integration/lifetime/test_leases.py."""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest

from reconciler.domain import leases
from reconciler.domain.leases import DECLARED, LEASE, LIVE, NEW, port_field
from reconciler.domain.live import LiveChainSet, LiveState
from reconciler.domain.model import (
    AutoPrefix,
    DesiredState,
    DockerNetwork,
    DockerNetworkName,
)
from reconciler.domain.ops import LinkSetMac, decode
from reconciler.domain.ownership import alloc_mac
from reconciler.domain.plan import Action, Plan
from reconciler.planner import addrspace, make_plan
from reconciler.planner.leases import Picks, choose, valid_mac
from reconciler.ui.render import render_text
from tests.support.fakehost import FakeHost
from tests.support.planning import alloc, auto, converge, desired, plan, port, state, sub


def picked(p: Plan, address: str, field: str) -> tuple[object, str]:
    got = p.picks[address][field]
    return got["value"], got["from"]


# ------------------------------------------------------------------ choose


@pytest.mark.parametrize(("declared", "lease", "live", "want"), [
    (5, 6, 7, (5, DECLARED, False)),
    (None, 6, 7, (6, LEASE, False)),      # a valid lease wins over live: drift is healed
    (None, None, 7, (7, LIVE, False)),    # no lease yet: the live value (an upgrade)
    (None, None, None, (9, NEW, False)),
    (None, 99, 7, (9, NEW, True)),        # an invalid lease is re-picked, not taken from live
    (None, None, 99, (9, NEW, False)),    # an invalid live value is not kept
])
def test_choose_follows_the_precedence(declared, lease, live, want):
    assert choose(declared, lease, live, valid=lambda v: v < 50, pick=lambda: 9) == want


def test_valid_macs_are_six_lower_case_octets_not_zero():
    assert valid_mac("02:aa:bb:cc:dd:ee")
    assert not valid_mac("00:00:00:00:00:00") and not valid_mac("02:AA:BB:CC:DD:EE")
    assert not valid_mac(7) and not valid_mac("02:aa:bb:cc:dd")


def test_the_table_keeps_picked_values_and_kept_resources_only():
    p = Picks({"alloc/gone": {"address": "10.0.0.9"}, "alloc/kept": {"address": "10.0.0.8"}})
    p.record("alloc/a", "address", "10.0.0.2", DECLARED)
    p.record("alloc/a", "mac", "02:00:00:00:00:01", NEW)
    p.record("alloc/b", "address", "10.0.0.3", LEASE)
    assert p.table(keep=["alloc/kept"]) == {
        "alloc/a": {"mac": "02:00:00:00:00:01"}, "alloc/b": {"address": "10.0.0.3"},
        "alloc/kept": {"address": "10.0.0.8"}}


def test_a_lease_record_round_trips_and_bad_ones_are_refused():
    table = {"alloc/a": {"address": "10.0.0.2", port_field(("tcp",), 80, None): 20000}}
    assert leases.from_json(leases.to_json(table)) == table
    for bad in ([], {"format": 2, "leases": {}}, {"format": 1, "leases": []},
                {"format": 1, "leases": {"nokind": {}}},
                {"format": 1, "leases": {"alloc/a": {"address": [1]}}}):
        with pytest.raises(leases.LeaseError):
            leases.from_json(bad)


# ------------------------------------------------------------------ the planner


def rebooted(host: FakeHost) -> FakeHost:
    """A new host with nothing live but the lease table (the state directory survives)."""
    fresh = FakeHost()
    fresh.leases = {k: dict(v) for k, v in host.leases.items()}
    return fresh


def test_a_reboot_with_earlier_ids_added_gives_back_the_same_addresses_and_ports():
    host = FakeHost()
    first = state(alloc("dns", port(None, 53)), alloc("web", port(None, 80)))
    converge(host, first, leases=host)
    before = plan(host, first)
    later = state(alloc("aaa", port(None, 80)), alloc("dns", port(None, 53)),
                  alloc("web", port(None, 80)))
    converge(host, later, leases=host)
    after = rebooted(host)
    p = plan(after, later)
    for aid in ("dns", "web"):
        assert picked(p, f"alloc/{aid}", "address") == (
            before.picks[f"alloc/{aid}"]["address"]["value"], LEASE)
        assert picked(p, f"alloc/{aid}", "mac") == (alloc_mac(aid), LEASE)
    assert picked(p, "alloc/dns", port_field(("tcp",), 53, None)) == (20000, LEASE)
    assert picked(p, "alloc/aaa", port_field(("tcp",), 80, None)) == (20002, LEASE)


def test_an_upgrade_records_the_live_values_and_plans_nothing():
    host = FakeHost()
    desired = state(alloc("web", port(None, 80)))
    converge(host, desired)  # no lease store: an earlier version
    ns = host.netns["web"]
    ns.links["eth0"] = dataclasses.replace(ns.links["eth0"], mac="02:11:22:33:44:55")
    p = plan(host, desired)
    # nothing moves: eth0 keeps its MAC (only the fake's neighbour entries follow it)
    assert {o.name for c in p.actionable for o in c.ops} <= {"neigh.replace"}, p
    assert picked(p, "alloc/web", "mac") == ("02:11:22:33:44:55", LIVE)
    assert {v["from"] for v in p.picks["alloc/web"].values()} == {LIVE}
    assert p.leases["alloc/web"]["mac"] == "02:11:22:33:44:55"


def test_a_mac_changed_by_hand_is_healed_back_to_its_lease():
    host = FakeHost()
    desired = state(alloc("web"))
    converge(host, desired, leases=host)
    ns = host.netns["web"]
    ns.links["eth0"] = dataclasses.replace(ns.links["eth0"], mac="02:11:22:33:44:55")
    p = plan(host, desired)
    change = next(c for c in p.changes if c.name == "web")
    assert change.action is Action.UPDATE
    assert [decode(o) for o in change.ops if o.name == LinkSetMac.NAME] == [
        LinkSetMac("eth0", alloc_mac("web"), netns="web")]
    converge(host, desired, leases=host)


def test_a_declared_address_displaces_a_lease_and_says_so():
    host = FakeHost()
    converge(host, state(alloc("dns"), alloc("web")), leases=host)
    web = host.leases["alloc/web"]["address"]
    p = plan(host, state(alloc("aaa", address=web), alloc("dns"), alloc("web")))
    assert picked(p, "alloc/aaa", "address") == (web, DECLARED)
    assert picked(p, "alloc/web", "address")[1] == NEW
    assert f"alloc web: leased address {web} is declared by alloc aaa now: re-picked" \
        in p.warnings


def test_an_invalid_lease_is_re_picked_with_a_plan_line():
    host = FakeHost()
    host.leases = {"alloc/web": {"address": "10.9.9.9"}}
    p = plan(host, state(alloc("web")))
    assert picked(p, "alloc/web", "address") == ("10.0.0.2", NEW)
    assert any("leased address 10.9.9.9 is no longer valid" in w for w in p.warnings)


def test_a_leased_port_a_socket_holds_blocks_the_allocation_and_is_kept():
    host = FakeHost()
    desired = state(alloc("web", port(None, 80)))
    converge(host, desired, leases=host)
    host.listening.add(("tcp", 20000))
    p = plan(host, desired)
    change = next(c for c in p.changes if c.name == "web")
    assert change.action is Action.CONFLICT and "20000/tcp" in change.reason
    assert p.leases["alloc/web"][port_field(("tcp",), 80, None)] == 20000


def test_prune_releases_and_no_prune_keeps_the_leases_of_what_goes():
    host = FakeHost()
    converge(host, state(alloc("dns"), alloc("web")), leases=host)
    assert "alloc/web" in plan(host, state(alloc("dns")), prune=False).leases
    assert "alloc/web" not in plan(host, state(alloc("dns"))).leases


def test_a_damaged_lease_file_is_one_warning():
    host = FakeHost()
    desired = state(alloc("web"))
    live = dataclasses.replace(host.observe(desired), leases_problem="lease file x: bad")
    p = make_plan(desired, live)
    assert [w for w in p.warnings if "lease file" in w] == ["lease file x: bad"]


# ------------------------------------------------------------------ auto prefixes


def resolved(want: DesiredState, table: dict[str, dict[str, object]]) -> tuple[dict, Picks]:
    p = Picks(table)
    r = addrspace.resolve(want, LiveState(firewall4=LiveChainSet(True),
                                          firewall6=LiveChainSet(True)), picks=p)
    assert not r.fatal, r.fatal
    return {n: str(s.cidr) for n, s in r.desired.subnets.items()}, p


def auto_state(*names: str) -> DesiredState:
    ci = DockerNetwork(DockerNetworkName("ci"),
                       auto=AutoPrefix(ipaddress.ip_network("10.5.0.0/16"), 24))
    return desired(*(sub(n, f"b-{n}", auto("10.5.0.0/16", 24)) for n in names), docker=(ci,))


def test_leased_auto_prefixes_survive_a_reboot_with_a_name_that_sorts_first():
    first, p = resolved(auto_state("m-net"), {})
    assert first == {"m-net": "10.5.0.0/24"} and p.source("subnet/m-net", "cidr") == NEW
    assert p.values["docker_network/ci"]["subnet"] == ("10.5.1.0/24", NEW)
    table = p.table()
    # nothing live any more (a reboot), and a-net sorts first: the leases hold
    again, p2 = resolved(auto_state("a-net", "m-net"), table)
    assert again == {"a-net": "10.5.2.0/24", "m-net": "10.5.0.0/24"}
    assert p2.source("subnet/m-net", "cidr") == LEASE
    assert p2.values["docker_network/ci"]["subnet"] == ("10.5.1.0/24", LEASE)


def test_a_leased_prefix_outside_its_pool_now_is_re_picked_with_a_line():
    got, p = resolved(auto_state("m-net"), {"subnet/m-net": {"cidr": "10.9.0.0/24"}})
    assert got == {"m-net": "10.5.0.0/24"} and p.source("subnet/m-net", "cidr") == NEW
    assert p.notes == ["subnet m-net: leased cidr 10.9.0.0/24 is no longer valid (not a /24 "
                       "of pool 10.5.0.0/16): re-picked"]


def test_plan_v_says_where_each_picked_value_comes_from():
    host = FakeHost()
    p = plan(host, state(alloc("web", port(None, 80))))
    text = render_text(p, verbose=True)
    assert f"# picked: address 10.0.0.2 (new), mac {alloc_mac('web')} (new), port tcp->80 " \
        "20000 (new)" in text, text
    assert "# picked" not in render_text(p)
