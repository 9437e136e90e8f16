"""Subnet isolation and the loopback guard, planned against an in-memory host."""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest

from reconciler.config.load import load
from reconciler.domain.errors import ConfigError
from reconciler.domain.model import (
    Bridge,
    BridgeName,
    DesiredState,
    Isolation,
    Subnet,
    SubnetName,
)
from reconciler.domain.plan import Action
from reconciler.planner import PlanOptions, make_plan
from reconciler.ui.render import render_text
from tests.support.fakehost import FakeHost

FWD = ("filter", "RECONCILER-FORWARD")
GUARD = ["-i br0 -m conntrack --ctstate RELATED,ESTABLISHED -m comment --comment "
         "reconciler:bridge=br0 -j ACCEPT",
         "-d 127.0.0.0/8 -i br0 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT "
         "-m comment --comment reconciler:bridge=br0 -j DROP"]


def subnet(name: str, br: str, cidr: str, isolation: Isolation = "ports",
           cidr6: str | None = None) -> Subnet:
    net = ipaddress.IPv4Network(cidr)
    net6 = ipaddress.IPv6Network(cidr6) if cidr6 else None
    return Subnet(SubnetName(name), BridgeName(br), net, net.network_address + 1, net6,
                  net6.network_address + 1 if net6 else None, isolation=isolation)


def state(*subnets: Subnet, bridges: tuple[str, ...] = ()) -> DesiredState:
    names = {s.bridge for s in subnets} | set(bridges)
    return DesiredState(bridges={BridgeName(b): Bridge(BridgeName(b)) for b in names},
                        subnets={s.name: s for s in subnets})


def converge(host: FakeHost, desired: DesiredState) -> None:
    for _ in range(3):
        p = make_plan(desired, host.observe(desired), PlanOptions())
        if not p.has_changes:
            return
        for c in p.actionable:
            for op in c.ops:
                host.run(op)
    raise AssertionError("did not converge")


def test_ports_is_the_default_and_admits_only_dnat_replies_and_the_subnet_itself():
    host = FakeHost()
    converge(host, state(subnet("web", "br0", "10.0.0.0/24", cidr6="fd00:1::/64")))
    c = "-m comment --comment reconciler:subnet=web"
    assert host.ours(4)[FWD] == [
        f"-d 10.0.0.0/24 -o br0 -m conntrack --ctstate RELATED,ESTABLISHED,DNAT {c} -j ACCEPT",
        f"-s 10.0.0.0/24 -d 10.0.0.0/24 -i br0 -o br0 {c} -j ACCEPT",
        f"-d 10.0.0.0/24 -o br0 {c} -j DROP",
        f"-s 10.0.0.0/24 -i br0 {c} -j ACCEPT"]
    assert host.ours(6)[FWD] == [
        f"-d fd00:1::/64 -o br0 -m conntrack --ctstate RELATED,ESTABLISHED,DNAT {c} -j ACCEPT",
        f"-s fd00:1::/64 -d fd00:1::/64 -i br0 -o br0 {c} -j ACCEPT",
        f"-d fd00:1::/64 -o br0 {c} -j DROP",
        f"-s fd00:1::/64 -i br0 {c} -j ACCEPT"]


def test_open_is_nomads_admin_chain():
    host = FakeHost()
    converge(host, state(subnet("web", "br0", "10.0.0.0/24", "open")))
    c = "-m comment --comment reconciler:subnet=web"
    assert host.ours(4)[FWD] == [f"-d 10.0.0.0/24 -o br0 {c} -j ACCEPT",
                                      f"-s 10.0.0.0/24 -i br0 {c} -j ACCEPT"]


def test_every_subnets_ingress_comes_before_any_egress_accept():
    """Subnet "a" may leave freely, but what it sends to "b" must meet b's isolation first."""
    host = FakeHost()
    converge(host, state(subnet("a", "bra", "10.0.1.0/24", "open"),
                         subnet("b", "brb", "10.0.2.0/24")))
    rules = host.ours(4)[FWD]
    ingress = [i for i, r in enumerate(rules) if " -o " in r]
    egress = [i for i, r in enumerate(rules) if " -o " not in r]
    assert len(ingress) == 4 and len(egress) == 2 and max(ingress) < min(egress), rules


def test_the_first_plan_after_the_upgrade_says_what_ports_closes():
    host = FakeHost()
    converge(host, state(subnet("web", "br0", "10.0.0.0/24", "open")))
    p = make_plan(state(subnet("web", "br0", "10.0.0.0/24")),
                  host.observe(state(subnet("web", "br0", "10.0.0.0/24"))), PlanOptions())
    fw = next(c for c in p.actionable if c.address == "firewall/nftables")
    assert fw.action is Action.UPDATE
    assert "isolation ports closes forwarding into 10.0.0.0/24 from outside it" in fw.reason
    assert "isolation ports closes" in render_text(p)
    # and back: open says what it opens
    converge(host, state(subnet("web", "br0", "10.0.0.0/24")))
    p = make_plan(state(subnet("web", "br0", "10.0.0.0/24", "open")),
                  host.observe(state()), PlanOptions())
    fw = next(c for c in p.actionable if c.address == "firewall/nftables")
    assert "isolation open forwards anything into 10.0.0.0/24" in fw.reason


def test_no_note_when_nothing_about_isolation_changes():
    host = FakeHost()
    converge(host, state(subnet("web", "br0", "10.0.0.0/24")))
    host.table.entries = {e for e in host.table.entries  # egress lost: a firewall change,
                          if not e.set.startswith("egress")}  # not an isolation one
    p = make_plan(state(subnet("web", "br0", "10.0.0.0/24")), host.observe(state()),
                  PlanOptions())
    fw = next(c for c in p.actionable if c.address == "firewall/nftables")
    assert "isolation" not in fw.reason


def test_the_loopback_guard_is_on_every_bridge_that_serves_a_subnet():
    host = FakeHost()
    converge(host, state(subnet("web", "br0", "10.0.0.0/24")))
    assert host.ours(4)[("filter", "RECONCILER-INPUT")] == GUARD
    assert ("filter", "RECONCILER-INPUT") not in host.ours(6)  # no route_localnet in v6


def test_the_guard_stays_while_route_localnet_outlives_the_subnet():
    host = FakeHost()
    converge(host, state(subnet("web", "br0", "10.0.0.0/24")))
    host.sysctls["net/ipv4/conf/br0/route_localnet"] = "1"  # port maps turned it on
    converge(host, state(bridges=("br0",)))
    assert host.ours(4)[("filter", "RECONCILER-INPUT")] == GUARD
    host.sysctls["net/ipv4/conf/br0/route_localnet"] = "0"
    converge(host, state(bridges=("br0",)))
    assert ("filter", "RECONCILER-INPUT") not in host.ours(4)


def test_kept_ingress_rules_stay_ahead_of_egress_with_no_prune():
    host = FakeHost()
    converge(host, state(subnet("a", "bra", "10.0.1.0/24"), subnet("z", "brz", "10.0.2.0/24")))
    only_z = state(subnet("z", "brz", "10.0.2.0/24"))
    p = make_plan(only_z, host.observe(only_z), PlanOptions(prune=False))
    for c in p.actionable:
        for op in c.ops:
            host.run(op)
    rules = host.ours(4)[FWD]
    assert sum("subnet=a" in r for r in rules) == 4
    ingress = [i for i, r in enumerate(rules) if " -o " in r]
    assert max(ingress) < min(i for i, r in enumerate(rules) if " -o " not in r), rules


def test_isolation_in_a_file(tmp_path):
    f = tmp_path / "a.yaml"
    f.write_text("version: 1\nbridges: [{name: br0}]\nsubnets:\n"
                 "  - {name: s, bridge: br0, cidr: 10.0.0.0/24, isolation: open}\n")
    assert load([str(f)]).subnets[SubnetName("s")].isolation == "open"
    f.write_text("version: 1\nbridges: [{name: br0}]\nsubnets:\n"
                 "  - {name: s, bridge: br0, cidr: 10.0.0.0/24}\n")
    assert load([str(f)]).subnets[SubnetName("s")].isolation == "ports"
    f.write_text("version: 1\nbridges: [{name: br0}]\nsubnets:\n"
                 "  - {name: s, bridge: br0, cidr: 10.0.0.0/24, isolation: closed}\n")
    with pytest.raises(ConfigError) as exc:
        load([str(f)])
    assert str(exc.value).startswith(f"{f}:4:")
    assert "isolation" in str(exc.value) and "\n" not in str(exc.value)


def test_isolation_is_part_of_the_subnet_value():
    s = subnet("web", "br0", "10.0.0.0/24")
    assert dataclasses.replace(s, isolation="open") != s
