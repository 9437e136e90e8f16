"""Leases on the real kernel (SPEC §11, issue 25 item 1): nothing the reconciler picked moves.

Each test acts on its own sandbox ("the host"); a reboot is simulated by deleting every
namespace the test made (the sandbox's too: its links, routes and rules go with it) and
making the sandbox again under its name, the state directory kept.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
from typing import Any

import pytest

from tests.support.host import Netns, sh, unique, wait_for, write
from tests.support.lifetime import eth0, identities, lease_file, leases, reboot

pytestmark = pytest.mark.root


def files(tmp_path: Any, *, subnets: list[dict[str, Any]], allocs: list[dict[str, Any]],
          name: str = "net.yaml") -> str:
    bridges = sorted({s["bridge"] for s in subnets})
    doc = {"version": 1, "bridges": [{"name": b} for b in bridges], "subnets": subnets,
           "allocs": allocs}
    return write(tmp_path, name, json.dumps(doc) + "\n")


def applied(host: Netns, path: str, *extra: str) -> None:
    r = host.reconcile("apply", *extra, path)
    assert r.rc == 0, r.all


def pools() -> tuple[str, str]:
    return f"10.{random.randint(100, 199)}.0.0/20", f"fd00:{random.randint(1, 0xffff):x}::/48"


def test_a_reboot_brings_back_every_address_port_prefix_and_mac(host_ns: Netns, tmp_path):
    pool, pool6 = pools()
    b1, b0 = unique("b"), unique("b")
    dns, web, aaa = unique("d"), unique("w"), unique("a")  # aaa sorts first
    net = {"name": "s-net", "bridge": b1, "cidr": "auto", "pool": pool, "cidr6": "auto",
           "pool6": pool6}
    first = [{"id": dns, "subnet": "s-net", "ports": [{"host": "auto", "to": 53}]},
             {"id": web, "subnet": "s-net", "ports": [{"host": "auto", "to": 80}]}]
    applied(host_ns, files(tmp_path, subnets=[net], allocs=first))
    # then a subnet whose name sorts first, and an allocation whose id does
    later = files(tmp_path, subnets=[
        {"name": "a-net", "bridge": b0, "cidr": "auto", "pool": pool}, net],
        allocs=[{"id": aaa, "subnet": "s-net", "ports": [{"host": "auto", "to": 80}]},
                *first])
    applied(host_ns, later)
    ids = [aaa, dns, web]
    before = identities(host_ns, ids, [b0, b1])
    assert before[f"alloc/{dns}"]["ports"] and before[f"alloc/{aaa}"]["ports"], before
    assert len(before[f"alloc/{dns}"]["addresses"]) == 2, before  # IPv4 and IPv6
    reboot(host_ns, ids)
    assert host_ns.link(b1) is None
    applied(host_ns, later)
    assert identities(host_ns, ids, [b0, b1]) == before
    assert host_ns.reconcile("plan", later).rc == 0


def test_an_upgrade_takes_the_live_values_and_moves_nothing(host_ns: Netns, tmp_path):
    pool, _ = pools()
    b = unique("b")
    dns, web = unique("d"), unique("w")
    net = {"name": "net", "bridge": b, "cidr": "auto", "pool": pool}
    allocs = [{"id": dns, "subnet": "net", "ports": [{"host": "auto", "to": 53}]},
              {"id": web, "subnet": "net", "ports": [{"host": "auto", "to": 80}]}]
    path = files(tmp_path, subnets=[net], allocs=allocs)
    applied(host_ns, path)
    # as an earlier version left it: no lease file, and an eth0 MAC that is not derived
    os.unlink(lease_file(host_ns))
    sh("ip", "-n", web, "link", "set", "eth0", "address", "02:11:22:33:44:55")
    before = identities(host_ns, [dns, web], [b])
    plan = host_ns.reconcile("plan", "--output", "json", path)
    assert plan.rc == 0, plan.all  # nothing to change: the live values are taken
    picks = json.loads(plan.out)["picks"]
    assert picks[f"alloc/{web}"]["mac"] == {"value": "02:11:22:33:44:55", "from": "live"}
    assert {p["from"] for p in picks[f"alloc/{dns}"].values()} == {"live"}, picks
    applied(host_ns, path)
    assert identities(host_ns, [dns, web], [b]) == before
    table = leases(host_ns)
    assert table[f"alloc/{web}"]["mac"] == "02:11:22:33:44:55", table
    assert table[f"alloc/{dns}"]["address"] == eth0(dns)["addresses"][0], table


def test_a_damaged_lease_file_is_one_warning_and_is_rebuilt_from_live(host_ns: Netns,
                                                                      tmp_path):
    b, web = unique("b"), unique("w")
    path = files(tmp_path, subnets=[{"name": "net", "bridge": b, "cidr": "10.77.3.0/24"}],
                 allocs=[{"id": web, "subnet": "net", "ports": [{"host": "auto", "to": 80}]}])
    applied(host_ns, path)
    good = leases(host_ns)
    with open(lease_file(host_ns), "w") as fh:
        fh.write("{not json")
    plan = host_ns.reconcile("plan", path)
    assert plan.rc == 0, plan.all
    said = [ln for ln in plan.all.splitlines() if "lease file" in ln]
    assert len(said) == 1 and "cannot be read" in said[0], plan.all
    assert "Traceback" not in plan.all
    applied(host_ns, path)
    assert leases(host_ns) == good


def test_release_forgets_a_lease_and_a_declared_value_displaces_one(host_ns: Netns, tmp_path):
    b, dns, web, aaa = unique("b"), unique("d"), unique("w"), unique("a")
    net = {"name": "net", "bridge": b, "cidr": "10.77.4.0/24"}
    allocs = [{"id": dns, "subnet": "net"}, {"id": web, "subnet": "net"}]
    applied(host_ns, files(tmp_path, subnets=[net], allocs=allocs))
    web_addr = leases(host_ns)[f"alloc/{web}"]["address"]
    # a declared address that web's lease holds: declared wins, web is re-picked, said
    path = files(tmp_path, subnets=[net], allocs=[
        *allocs, {"id": aaa, "subnet": "net", "address": web_addr}])
    plan = host_ns.reconcile("plan", path)
    assert plan.rc == 2 and f"{web}: leased address {web_addr} is declared by alloc {aaa}" \
        in plan.all, plan.all
    applied(host_ns, path)
    assert eth0(aaa)["addresses"] == [web_addr]
    moved = eth0(web)["addresses"][0]
    assert moved != web_addr and leases(host_ns)[f"alloc/{web}"]["address"] == moved
    # release: the lease is gone from the file; unknown kinds are a usage error
    r = host_ns.reconcile("release", f"alloc/{web}")
    assert r.rc == 0 and "Released" in r.out, r.all
    assert f"alloc/{web}" not in leases(host_ns)
    assert host_ns.reconcile("release", f"alloc/{web}").rc == 0  # nothing left: still fine
    bad = host_ns.reconcile("release", "nothing/x")
    assert bad.rc == 1 and "want KIND/ID" in bad.err and "Traceback" not in bad.all, bad.all


def test_a_lease_made_invalid_is_re_picked_with_a_plan_line(host_ns: Netns, tmp_path):
    b, web = unique("b"), unique("w")
    applied(host_ns, files(tmp_path, subnets=[{"name": "net", "bridge": b,
                                                "cidr": "10.77.5.0/24"}],
                           allocs=[{"id": web, "subnet": "net"}]))
    old = leases(host_ns)[f"alloc/{web}"]["address"]
    path = files(tmp_path, subnets=[{"name": "net", "bridge": b, "cidr": "10.77.6.0/24"}],
                 allocs=[{"id": web, "subnet": "net"}])
    plan = host_ns.reconcile("plan", path)
    assert f"{web}: leased address {old} is no longer valid" in plan.all, plan.all
    applied(host_ns, path)
    new = leases(host_ns)[f"alloc/{web}"]["address"]
    assert ipaddress.ip_address(new) in ipaddress.ip_network("10.77.6.0/24")
    assert eth0(web)["addresses"] == [new]


def state_bytes(host: Netns) -> dict[str, bytes]:
    directory = os.path.dirname(lease_file(host))
    if not os.path.isdir(directory):
        return {}
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as fh:
            out[name] = fh.read()
    return out


def test_plan_and_dry_run_write_nothing(host_ns: Netns, tmp_path):
    b, web, aaa = unique("b"), unique("w"), unique("a")
    net = {"name": "net", "bridge": b, "cidr": "10.77.7.0/24"}
    path = files(tmp_path, subnets=[net], allocs=[{"id": web, "subnet": "net"}])
    for args in (("plan",), ("apply", "--dry-run")):
        r = host_ns.reconcile(*args, path)
        assert r.rc == 2 and state_bytes(host_ns) == {}, r.all
    applied(host_ns, path)
    before = state_bytes(host_ns)
    assert "leases.json" in before
    more = files(tmp_path, subnets=[net], allocs=[{"id": web, "subnet": "net"},
                                                   {"id": aaa, "subnet": "net"}])
    for args in (("plan", more), ("apply", "--dry-run", more), ("show", "--output", "json"),
                 ("verify", "--no-probe", more)):
        r = host_ns.reconcile(*args)
        assert r.rc in (0, 1, 2) and "Traceback" not in r.all, r.all
        assert state_bytes(host_ns) == before, args


def test_a_mac_changed_by_hand_is_drift_healed_by_apply(host_ns: Netns, tmp_path):
    b, web = unique("b"), unique("w")
    path = files(tmp_path, subnets=[{"name": "net", "bridge": b, "cidr": "10.77.8.0/24"}],
                 allocs=[{"id": web, "subnet": "net"}])
    applied(host_ns, path)
    mac, bmac = eth0(web)["mac"], host_ns.link(b)["address"]  # type: ignore[index]
    sh("ip", "-n", web, "link", "set", "eth0", "address", "02:aa:bb:cc:dd:ee")
    host_ns.run("ip", "link", "set", b, "address", "02:aa:bb:cc:dd:ef")
    plan = host_ns.reconcile("plan", path)
    assert plan.rc == 2, plan.all
    assert "02:aa:bb:cc:dd:ee" in plan.out and "02:aa:bb:cc:dd:ef" in plan.out, plan.all
    applied(host_ns, path)
    assert eth0(web)["mac"] == mac and host_ns.link(b)["address"] == bmac  # type: ignore[index]
    assert host_ns.reconcile("plan", path).rc == 0


def test_revert_restores_the_leases_of_the_state_it_restores(host_ns: Netns, tmp_path):
    b, web, dns = unique("b"), unique("w"), unique("d")
    net = {"name": "net", "bridge": b, "cidr": "10.77.9.0/24"}
    old = files(tmp_path, subnets=[net], allocs=[
        {"id": web, "subnet": "net", "ports": [{"host": "auto", "to": 80}]}], name="old.yaml")
    applied(host_ns, old)
    before = leases(host_ns)
    # web pruned (its leases released), dns takes the lowest free address and port
    new = files(tmp_path, subnets=[net], allocs=[
        {"id": dns, "subnet": "net", "ports": [{"host": "auto", "to": 53}]}], name="new.yaml")
    applied(host_ns, new, "--confirm-within", "5m")
    assert f"alloc/{web}" not in leases(host_ns) and f"alloc/{dns}" in leases(host_ns)
    r = host_ns.reconcile("revert")
    assert r.rc == 0, r.all
    assert leases(host_ns) == before
    assert host_ns.reconcile("plan", old).rc == 0


def test_no_prune_keeps_a_lease_and_gc_path_releases_it(host_ns: Netns, tmp_path):
    b, web, dns = unique("b"), unique("w"), unique("d")
    net = {"name": "net", "bridge": b, "cidr": "10.77.10.0/24"}
    applied(host_ns, files(tmp_path, subnets=[net], allocs=[{"id": dns, "subnet": "net"},
                                                             {"id": web, "subnet": "net"}]))
    only = files(tmp_path, subnets=[net], allocs=[{"id": dns, "subnet": "net"}])
    applied(host_ns, only, "--no-prune")
    assert f"alloc/{web}" in leases(host_ns)
    r = host_ns.reconcile("gc", only)
    assert r.rc == 0 and f"Released the leases of alloc/{web}" in r.out, r.all
    assert f"alloc/{web}" not in leases(host_ns) and f"alloc/{dns}" in leases(host_ns)
    d = host_ns.reconcile("destroy", "--yes")  # destroy keeps the leases
    assert d.rc == 0, d.all
    assert f"alloc/{dns}" in leases(host_ns)


def test_watch_heals_a_mac_changed_by_hand(host_ns: Netns, agents: Any, tmp_path):
    b, web = unique("b"), unique("w")
    d = tmp_path / "conf"
    d.mkdir()
    files(d, subnets=[{"name": "net", "bridge": b, "cidr": "10.77.11.0/24"}],
          allocs=[{"id": web, "subnet": "net"}])
    agent = agents(host_ns, [str(d)])
    agent.converged()
    mac, bmac = eth0(web)["mac"], host_ns.link(b)["address"]  # type: ignore[index]
    sh("ip", "-n", web, "link", "set", "eth0", "address", "02:aa:bb:cc:dd:ee")
    host_ns.run("ip", "link", "set", b, "address", "02:aa:bb:cc:dd:ef")
    wait_for(lambda: eth0(web)["mac"] == mac and host_ns.link(b)["address"] == bmac,  # type: ignore[index]
             30, every=0.1, what="both MACs healed")
    assert agent.stop() == 0
