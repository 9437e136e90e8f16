"""One address space (SPEC §9): the files' checks, the pure planner's picks and conflicts.

The property test at the end tries random host states -- addresses and routes of
foreign links, Docker networks and pools, owned prefixes of earlier picks -- and
checks that nothing picked for ``auto`` overlaps anything it must not.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.cli import commands as cli
from reconciler.config.load import load
from reconciler.domain.docker import DEFAULT_ADDRESS_POOLS, parse_address_pools
from reconciler.domain.errors import PlanError
from reconciler.domain.live import (
    DockerAddressSpace,
    DockerNetworkUse,
    LiveAddress,
    LiveChainSet,
    LiveDocker,
    LiveDockerNetwork,
    LiveLink,
    LiveRoute,
    LiveState,
)
from reconciler.domain.model import (
    AutoPrefix,
    BridgeName,
    DesiredState,
    DockerNetwork,
    DockerNetworkName,
    Subnet,
    SubnetName,
    UnresolvedPrefixError,
)
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.domain.plan import Action
from reconciler.drivers.docker import rawapi
from reconciler.drivers.docker.payloads import network_use
from reconciler.planner import addrspace, hostspace, make_plan
from reconciler.ui.render import render_text
from tests.support.fakehost import FakeHost
from tests.support.figures import SOAK, report
from tests.support.planning import auto, desired, sub

# ------------------------------------------------------------------ the files


def write(tmp_path: Any, text: str) -> str:
    p = tmp_path / "f.yaml"
    p.write_text(text)
    return str(p)


HEAD = "version: 1\nbridges: [{name: b}]\nsubnets:\n"

BAD = [
    (HEAD + "  - name: s\n    bridge: b\n    cidr: auto\n", 6, "auto needs pool"),
    (HEAD + "  - name: s\n    bridge: b\n    cidr: auto\n    pool: 10.0.0.1/16\n", 7,
     "host bits set; did you mean 10.0.0.0/16?"),
    (HEAD + "  - name: s\n    bridge: b\n    cidr: auto\n    pool: 'fd00::/48'\n", 7,
     "is IPv6; use pool6 for IPv6"),
    (HEAD + "  - name: s\n    bridge: b\n    cidr: auto\n    pool: 10.0.0.0/20\n    size: 16\n",
     8, "a /16 does not fit in pool 10.0.0.0/20; use size: 20 or more"),
    (HEAD + "  - name: s\n    bridge: b\n    cidr: auto\n    pool: 10.0.0.0/26\n", 7,
     "a /24 does not fit in pool 10.0.0.0/26"),  # the default size, named at the pool
    (HEAD + "  - name: s\n    bridge: b\n    cidr: auto\n    pool: 10.0.0.0/8\n    size: 31\n",
     8, "maximum"),
    (HEAD + "  - name: s\n    bridge: b\n    cidr: 10.0.0.0/24\n    pool: 10.0.0.0/16\n", 7,
     "pool: only used with cidr: auto (cidr is 10.0.0.0/24)"),
    (HEAD + "  - name: s\n    bridge: b\n    cidr: 10.0.0.0/24\n    size6: 64\n", 7,
     "size6: only used with cidr6: auto (there is no cidr6)"),
    (HEAD + "  - name: s\n    bridge: b\n    cidr: auto\n    pool: 10.0.0.0/16\n"
     "    gateway: 10.0.0.1\n", 8, "gateway: needs a fixed cidr"),
    (HEAD + "  - name: s\n    bridge: b\n    cidr: auto\n    pool: 10.0.0.0/16\n"
     "    range: {start: 10.0.0.5, end: 10.0.0.9}\n", 8, "range: needs a fixed cidr"),
    (HEAD + "  - name: s\n    bridge: b\n    cidr: 10.0.0.0/24\n    cidr6: auto\n", 7,
     "auto needs pool6"),
    (HEAD + "  - name: s\n    bridge: b\n    cidr: 10.0.0.0/24\n    cidr6: auto\n"
     "    pool6: 'fd00::/48'\n    gateway6: 'fd00::1'\n", 9, "gateway6: needs a fixed cidr6"),
    (HEAD + "  - {name: s, bridge: b, cidr: auto, pool: 10.0.0.0/16}\nallocs:\n"
     "  - id: a\n    subnet: s\n    address: 10.0.0.5\n", 8,
     "a fixed address needs a fixed prefix, but subnet 's' has cidr: auto"),
    ("version: 1\ndocker_networks:\n  - name: k\n    subnet: auto\n", 4, "auto needs pool"),
    ("version: 1\ndocker_networks:\n  - name: k\n    pool: 10.0.0.0/16\n", 4,
     "pool: only used with subnet: auto (there is no subnet)"),
    ("version: 1\ndocker_networks:\n  - name: k\n    ipv6: false\n    subnet6: auto\n"
     "    pool6: 'fd00::/48'\n", 4, "is false but subnet6"),
    (HEAD + "  - {name: s, bridge: b, cidr: 10.0.0.0/24}\nallocs:\n  - id: a\n    subnet: s\n"
     "    ports:\n      - {host: 80, to: 80, host_ip: 255.255.255.255}\n", 9,
     "is the broadcast address"),
    (HEAD + "  - {name: s, bridge: b, cidr: 10.0.0.0/24}\nallocs:\n  - id: a\n    subnet: s\n"
     "    ports:\n      - {host: 80, to: 80, host_ip: 239.1.2.3}\n", 9, "multicast"),
]
for _ip in ("10.0.0.0", "10.0.0.255", "10.0.0.1", "10.0.0.77"):  # network, broadcast, inside
    BAD.append((HEAD + "  - {name: s, bridge: b, cidr: 10.0.0.0/24}\nallocs:\n  - id: a\n"
                "    subnet: s\n    ports:\n      - {host: 80, to: 80}\n"
                f"      - {{host: 81, to: 80, host_ip: {_ip}}}\n", 10,
                f"host_ip {_ip} is inside subnet 's' (cidr 10.0.0.0/24, at "))


@pytest.mark.parametrize("text,line,needle", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_auto_and_host_ip_are_one_clear_error(tmp_path, capsys, text, line, needle):
    path = write(tmp_path, text)
    rc = cli.main(["validate", path])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in out + err
    assert needle in err, err
    assert err.splitlines()[0].startswith(f"error: {path}:{line}:"), err


def test_auto_validates_without_the_host(tmp_path):
    """validate reads the files alone: auto beside fixed prefixes in its pool is fine."""
    path = write(tmp_path, HEAD + "  - {name: s, bridge: b, cidr: auto, pool: 10.0.0.0/16,"
                 " cidr6: auto, pool6: 'fd00:1::/48', size6: 80}\n"
                 "  - {name: t, bridge: b, cidr: 10.0.3.0/24}\n"
                 "allocs:\n  - {id: a, subnet: s, ports: [{host: 80, to: 80, host_ip: 10.0.9.9}]}\n"
                 "docker_networks:\n  - {name: k, subnet: auto, pool: 10.1.0.0/16, size: 26,"
                 " subnet6: auto, pool6: 'fd00:2::/48'}\n  - {name: j, subnet6: 'fd00:3::/64'}\n")
    d = load([path])
    s = d.subnets[SubnetName("s")]
    assert s.auto == AutoPrefix(ipaddress.ip_network("10.0.0.0/16"), 24)
    assert s.auto6 == AutoPrefix(ipaddress.ip_network("fd00:1::/48"), 80)
    assert not s.resolved
    with pytest.raises(UnresolvedPrefixError):
        _ = s.cidr
    k = d.docker_networks[DockerNetworkName("k")]
    assert (k.subnet, k.ipv6, k.auto, k.auto6) == (
        None, True, AutoPrefix(ipaddress.ip_network("10.1.0.0/16"), 26),
        AutoPrefix(ipaddress.ip_network("fd00:2::/48"), 64))
    # subnet6 without ipv6 implies it (the compiled schema check used to fill in ipv6: false
    # and refuse the file as "ipv6 is false but subnet6 is given")
    assert d.docker_networks[DockerNetworkName("j")].ipv6


# ------------------------------------------------------------------ helpers

N = ipaddress.ip_network


def link(name: str, index: int, *addrs: str, owned: bool = False, kind: str = "veth",
         owned_addrs: bool | None = None) -> LiveLink:
    own = owned if owned_addrs is None else owned_addrs
    return LiveLink(name, index, kind, 1500, True, owned,
                    addresses=tuple(LiveAddress(ipaddress.ip_interface(a), own) for a in addrs))


def live(*links: LiveLink, routes: tuple[LiveRoute, ...] = (),
         space: DockerAddressSpace | None = None, docker: LiveDocker | None = None,
         fw4: LiveChainSet | None = None) -> LiveState:
    return LiveState(links={lk.name: lk for lk in links}, routes=routes, docker_space=space,
                     docker=docker, firewall4=fw4 or LiveChainSet(True),
                     firewall6=LiveChainSet(True))


def use(name: str, *subnets: str, bridge: str | None = None) -> DockerNetworkUse:
    nid = (name.encode().hex() * 8)[:64]
    return DockerNetworkUse(name, nid, subnets, bridge or f"br-{nid[:12]}")


def conflicts(d: DesiredState, lv: LiveState) -> dict[str, str]:
    return addrspace.check(addrspace.resolve(d, lv).desired, lv).conflicts


# ------------------------------------------------------------------ conflicts


def test_a_declared_prefix_over_foreign_addresses_routes_and_docker_networks_names_both():
    eth0 = link("eth0", 2, "192.168.1.10/24")
    tun0 = link("tun0", 3, "10.8.0.2/24")
    routes = (LiveRoute("192.168.1.0/24", None, False, oif=2),  # eth0's connected route
              LiveRoute("10.9.0.0/16", "10.8.0.1", False, oif=3),
              LiveRoute("10.20.0.0/24", None, False, type="blackhole"),
              LiveRoute("default", "192.168.1.1", False, oif=2),
              LiveRoute("fe80::/64", None, False, oif=2))
    space = DockerAddressSpace(True, (use("bridge", "172.17.0.0/16", bridge="docker0"),
                                      use("kind", "172.18.0.0/16", "fc00:1::/64")), ())
    d = desired(sub("lan", "b1", "192.168.1.128/25"), sub("vpn", "b1", "10.9.3.0/24"),
                sub("hole", "b1", "10.20.0.0/16"), sub("dock", "b2", "172.17.5.0/24"),
                sub("kinda", "b2", "10.30.0.0/24", "fc00:1::/64"), sub("free", "b2", "10.31.0.0/24"))
    # the daemon's bridges are links here: its networks share this namespace's routing
    docker0 = link("docker0", 4, "172.17.0.1/16", kind="bridge")
    got = conflicts(d, live(eth0, tun0, docker0, routes=routes, space=space))
    assert got == {
        "subnet/lan": "cidr 192.168.1.128/25 overlaps address 192.168.1.10/24 on eth0",
        "subnet/vpn": "cidr 10.9.3.0/24 overlaps route 10.9.0.0/16 via 10.8.0.1 on tun0",
        "subnet/hole": "cidr 10.20.0.0/16 overlaps blackhole route 10.20.0.0/24",
        "subnet/dock": "cidr 172.17.5.0/24 overlaps docker network bridge (172.17.0.0/16 on "
                       "docker0)",
        "subnet/kinda": "cidr6 fc00:1::/64 overlaps docker network kind (fc00:1::/64 on "
                        f"{use('kind').bridge})",
    }
    plan = make_plan(d, live(eth0, tun0, docker0, routes=routes, space=space))
    text = render_text(plan)
    assert "! subnet vpn: cidr 10.9.3.0/24 overlaps route 10.9.0.0/16 via 10.8.0.1 on tun0" \
        in text
    assert {c.name for c in plan.conflicts} == {"lan", "vpn", "hole", "dock", "kinda"}
    assert any(c.name == "free" and c.action is Action.CREATE for c in plan.changes)


def test_many_occupants_are_named_up_to_three():
    links = [link(f"eth{i}", 10 + i, f"10.0.{i}.1/24") for i in range(5)]
    got = conflicts(desired(sub("big", "b", "10.0.0.0/16")), live(*links))
    assert got["subnet/big"].endswith("address 10.0.2.1/24 on eth2 and 2 more"), got


def test_our_own_gateway_and_connected_route_are_no_conflict():
    """No churn: an owned subnet's gateway and its route on its own bridge are itself."""
    host = FakeHost()
    d = desired(sub("s", "br0", "10.1.0.0/24"))
    rec_plan = make_plan(d, host.observe(d))
    for c in rec_plan.actionable:
        for op in c.ops:
            host.run(op)
    lv = host.observe(d)
    assert any(r.dst == "10.1.0.0/24" for r in lv.routes)  # the connected route, on br0
    again = make_plan(d, lv)
    assert not again.has_changes and not again.conflicts, render_text(again)


def test_a_declared_docker_network_is_no_conflict_with_itself_but_with_others():
    space = DockerAddressSpace(True, (use("kind", "172.18.0.0/16"), use("other", "10.5.0.0/24")))
    routes = (LiveRoute("172.18.0.0/16", None, False, oif=7),)  # kind's bridge, in the host
    br = link(use("kind").bridge, 7, "172.18.0.1/16", kind="bridge")
    d = desired(docker=(DockerNetwork(DockerNetworkName("kind"),
                                      subnet=N("172.18.0.0/16")),  # type: ignore[arg-type]
                        DockerNetwork(DockerNetworkName("web"),
                                      subnet=N("10.5.0.128/25"))))  # type: ignore[arg-type]
    got = conflicts(d, live(br, routes=routes, space=space))
    assert got == {"docker_network/web": "subnet 10.5.0.128/25 overlaps docker network other "
                                         f"(10.5.0.0/24 on {use('other').bridge})"}


def test_an_owned_docker_network_this_plan_prunes_frees_its_subnet():
    nid = "ab" * 32
    space = DockerAddressSpace(True, (DockerNetworkUse("old", nid, ("10.6.0.0/24",), "br-x",
                                                       True),))
    docker = LiveDocker(True, networks=(LiveDockerNetwork(
        nid, "old", "bridge", {DOCKER_LABEL: DOCKER_LABEL_VALUE, "io.reconciler.scope": "host"},
        {}, False, False, ("10.6.0.0/24",), 0),))
    lv = live(link("br-x", 4, "10.6.0.1/24", kind="bridge"), space=space, docker=docker)
    d = desired(sub("s", "b", "10.6.0.0/24"))
    assert addrspace.check(d, lv, prune=True).conflicts == {}
    assert "docker network old" in addrspace.check(d, lv, prune=False).conflicts["subnet/s"]


def test_unassigned_docker_pools_warn_handed_out_ones_do_not():
    space = DockerAddressSpace(True, (use("bridge", "172.17.0.0/16"),
                                      use("n1", "192.168.0.0/24")), DEFAULT_ADDRESS_POOLS)
    d = desired(sub("nomad", "b", "172.26.64.0/20"), sub("in-used-chunk", "b", "192.168.5.0/24"),
                sub("free-chunk", "b", "192.168.17.0/24"), sub("outside", "b", "10.0.0.0/24"))
    found = addrspace.check(d, live(space=space))
    assert found.conflicts == {}
    assert found.warnings == [
        "subnet 'free-chunk': cidr 192.168.17.0/24 is in 192.168.16.0/20 of Docker's default "
        "address pool 192.168.0.0/16, not handed out yet: Docker skips it only while this "
        "prefix is routed where dockerd runs",
        "subnet 'nomad': cidr 172.26.64.0/20 is in Docker's default address pool "
        "172.26.0.0/16, not handed out yet: Docker skips it only while this prefix is routed "
        "where dockerd runs"]
    assert addrspace.check(d, live()).warnings == []  # no Docker on this host: no pools
    down = DockerAddressSpace(False, pools=(("10.0.0.0/8", 24),), error="down")
    warned = addrspace.check(d, live(space=down)).warnings  # daemon.json pools, networks unknown
    assert len(warned) == 2 and "'outside'" in warned[0] and warned[1].startswith("docker: down")


def test_daemon_json_pools(tmp_path):
    assert parse_address_pools({"default-address-pools": [
        {"base": "10.10.0.0/16", "size": 24}, {"base": "bad", "size": 24},
        {"base": "10.20.0.0/16", "size": 8}, {"base": "10.30.0.0/16", "size": True}]}) == (
        ("10.10.0.0/16", 24),)
    assert parse_address_pools({"bip": "10.1.0.1/24"}) is None
    assert parse_address_pools([]) is None
    cfg = tmp_path / "daemon.json"
    cfg.write_text(json.dumps({"default-address-pools": [{"base": "10.99.0.0/16", "size": 26}]}))
    assert rawapi.address_pools(str(cfg)) == (("10.99.0.0/16", 26),)
    cfg.write_text("{not json")
    assert rawapi.address_pools(str(cfg)) == DEFAULT_ADDRESS_POOLS
    assert rawapi.address_pools(str(tmp_path / "absent.json")) == DEFAULT_ADDRESS_POOLS
    assert DEFAULT_ADDRESS_POOLS[0] == ("172.17.0.0/16", 16) and len(DEFAULT_ADDRESS_POOLS) == 16


def test_a_listed_network_names_its_bridge():
    nid = "0123456789abcdef" * 4
    assert network_use({"Name": "n", "Id": nid, "IPAM": {"Config": [{"Subnet": "10.1.0.0/24"}]},
                        "Options": {}}).bridge == "br-0123456789ab"
    assert network_use({"Name": "bridge", "Id": nid, "Options": {
        "com.docker.network.bridge.name": "docker0"}}).bridge == "docker0"


def test_host_ip_not_on_the_host_warns_once_per_map():
    from reconciler.domain.model import Alloc, AllocId, PortMap

    d = desired(sub("s", "b", "10.1.0.0/24"))
    d = dataclasses.replace(d, allocs={AllocId("a"): Alloc(AllocId("a"), SubnetName("s"), ports=(
        PortMap(80, 80, "tcp", ipaddress.ip_address("127.0.0.2")),
        PortMap(81, 80, "tcp", ipaddress.ip_address("192.0.2.7")),
        PortMap(82, 80, "tcp", ipaddress.ip_address("198.51.100.9"))))})
    lv = live(link("lo", 1, "127.0.0.1/8"), link("eth0", 2, "192.0.2.7/24"))
    assert addrspace.host_ip_warnings(d, lv) == [
        "alloc 'a' ports[2]: host_ip 198.51.100.9 is not an address of this host right now (a "
        "floating address?): the map takes effect once it is"]


# ------------------------------------------------------------------ auto


def picks(d: DesiredState, lv: LiveState) -> dict[str, str]:
    r = addrspace.resolve(d, lv)
    assert not r.fatal, r.fatal
    out = {f"subnet/{n}": str(s.cidr) + (f" {s.cidr6}" if s.cidr6 else "")
           for n, s in r.desired.subnets.items()}
    out.update({f"docker/{n}": f"{n2.subnet} {n2.subnet6}"
                for n, n2 in r.desired.docker_networks.items()})
    return out


def test_new_picks_go_in_name_order_around_what_is_taken():
    lv = live(link("eth0", 2, "10.0.1.5/24"), routes=(LiveRoute("10.0.4.0/23", "10.0.1.1", False,
                                                                 oif=2),))
    d = desired(sub("b", "br1", auto("10.0.0.0/16", 24)), sub("a", "br1", auto("10.0.0.0/16", 23)),
                sub("fixed", "br2", "10.0.0.0/24"), sub("c", "br2", auto("10.0.0.0/16", 24),
                                                        auto("fd00::/56", 64)))
    assert picks(d, lv) == {"subnet/a": "10.0.2.0/23", "subnet/b": "10.0.6.0/24",
                            "subnet/c": "10.0.7.0/24 fd00::/64", "subnet/fixed": "10.0.0.0/24"}


def test_live_prefixes_are_kept_first_from_rules_then_from_the_gateway():
    # b had 10.0.9.0/24 (its rules say so), a has a gateway 10.0.5.1/24 on its bridge
    fw4 = LiveChainSet(True, {("filter", "RECONCILER-FORWARD"): (
        '-d 10.0.9.0/24 -o br1 -m comment --comment reconciler:subnet=b -j ACCEPT',)})
    br1 = link("br1", 5, "10.0.5.1/24", owned=True, kind="bridge")  # b's gateway flushed
    d = desired(sub("a", "br1", auto("10.0.0.0/16", 24)), sub("b", "br1", auto("10.0.0.0/16", 24)),
                sub("new", "br2", auto("10.0.0.0/16", 24)))
    assert picks(d, live(br1, fw4=fw4)) == {"subnet/a": "10.0.5.0/24", "subnet/b": "10.0.9.0/24",
                                            "subnet/new": "10.0.0.0/24"}
    # the gateway of a subnet no file declares any more (its rules still name it, as with
    # --no-prune) is not taken for a new one on the same bridge
    fw_old = LiveChainSet(True, {("filter", "RECONCILER-FORWARD"): (
        '-d 10.0.5.0/24 -o br1 -m comment --comment reconciler:subnet=old -j ACCEPT',)})
    only_a = desired(sub("a", "br1", auto("10.0.0.0/16", 24)))
    assert picks(only_a, live(link("br1", 5, "10.0.5.1/24", owned=True, kind="bridge"),
                              fw4=fw_old)) == {"subnet/a": "10.0.0.0/24"}
    # a kept prefix that no longer fits the request (other size, other pool) is let go
    d2 = desired(sub("a", "br1", auto("10.0.0.0/16", 25)), sub("b", "br1", auto("10.1.0.0/16", 24)))
    assert picks(d2, live(br1, fw4=fw4)) == {"subnet/a": "10.0.0.0/25", "subnet/b": "10.1.0.0/24"}


def test_a_docker_network_keeps_its_live_subnet_and_is_created_with_its_pick():
    nid = "cd" * 32
    docker = LiveDocker(True, networks=(LiveDockerNetwork(
        nid, "kind", "bridge", {DOCKER_LABEL: DOCKER_LABEL_VALUE, "io.reconciler.scope": "host"},
        {}, False, False, ("10.3.7.0/24",), 0),), scope="host")
    space = DockerAddressSpace(True, (DockerNetworkUse("kind", nid, ("10.3.7.0/24",),
                                                       "br-x", True),))
    kind = DockerNetwork(DockerNetworkName("kind"), auto=AutoPrefix(N("10.3.0.0/16"), 24))
    web = DockerNetwork(DockerNetworkName("web"), auto=AutoPrefix(N("10.3.0.0/16"), 24))
    lv = live(space=space, docker=docker)
    d = desired(docker=(kind, web))
    assert picks(d, lv) == {"docker/kind": "10.3.7.0/24 None", "docker/web": "10.3.0.0/24 None"}
    plan = make_plan(d, lv)
    kinds = {c.name: c for c in plan.changes}
    assert kinds["kind"].action is Action.NOOP, render_text(plan)
    create = kinds["web"]
    assert create.action is Action.CREATE
    assert create.ops[0].args["spec"]["subnet"] == "10.3.0.0/24"
    assert "subnet = 10.3.0.0/24 (auto from 10.3.0.0/16)" in render_text(plan)


def test_an_exhausted_pool_names_it_and_nothing_is_planned():
    lv = live(link("eth0", 2, "10.0.0.1/25"))
    d = desired(sub("a", "b", auto("10.0.0.0/24", 25)), sub("z", "b", auto("10.0.0.0/24", 25)))
    r = addrspace.resolve(d, lv)
    assert r.fatal == ["subnet 'z' (<memory>:0): cidr: auto: pool 10.0.0.0/24 has no free /25 "
                       "left (the host, Docker and the other declared prefixes take the rest)"]
    with pytest.raises(PlanError, match="pool 10.0.0.0/24 has no free /25"):
        make_plan(d, lv)


def test_docker_pools_count_as_taken_for_picks():
    space = DockerAddressSpace(True, (use("bridge", "172.17.0.0/16"),), DEFAULT_ADDRESS_POOLS)
    assert picks(desired(sub("a", "b", auto("172.16.0.0/12", 16))), live(space=space)) == {
        "subnet/a": "172.16.0.0/16"}  # 172.17-31 are Docker's (handed out or not)
    d = desired(sub("c", "b", auto("192.168.0.0/16", 20)))
    fatal = addrspace.resolve(d, live(space=space)).fatal
    assert len(fatal) == 1 and "pool 192.168.0.0/16 has no free /20" in fatal[0]
    # a network in the chunk 192.168.16.0/20: Docker hands out no more of that chunk
    used = DockerAddressSpace(True, (use("n", "192.168.16.0/24"),), DEFAULT_ADDRESS_POOLS)
    assert picks(desired(sub("c", "b", auto("192.168.0.0/16", 24))), live(space=used)) == {
        "subnet/c": "192.168.17.0/24"}
    assert picks(d, live()) == {"subnet/c": "192.168.0.0/20"}  # no Docker here: no pools


# ------------------------------------------------------------------ the agent's needs


def test_relevant_ignores_what_cannot_matter_and_sees_what_can():
    d = desired(sub("s", "b", "10.1.0.0/24"), sub("t", "b", auto("10.2.0.0/16", 24)))
    base = live(link("eth0", 2, "192.0.2.2/24"))
    far = dataclasses.replace(base, routes=(LiveRoute("10.200.0.0/16", None, False, oif=2),))
    near = dataclasses.replace(base, routes=(LiveRoute("10.1.0.128/25", None, False, oif=2),))
    pool = dataclasses.replace(base, routes=(LiveRoute("10.2.9.0/24", None, False, oif=2),))
    r = addrspace.relevant(d, base)
    assert addrspace.relevant(d, far) == r
    assert addrspace.relevant(d, near) != r and addrspace.relevant(d, pool) != r


def test_live_overlaps_compare_owned_prefixes_with_foreign_ones():
    br = link("br0", 5, "10.1.0.1/24", owned=True, kind="bridge")
    vpn = link("tun0", 6, "10.1.0.200/32")
    routes = (LiveRoute("10.1.0.0/24", None, False, oif=5),  # ours: on our bridge
              LiveRoute("10.1.0.0/25", None, False, oif=6),
              LiveRoute("10.99.0.0/16", None, False, oif=6))
    got = hostspace.live_overlaps(hostspace.owned_prefixes([br, vpn]), [br, vpn], routes)
    assert got == [hostspace.LiveOverlap("10.1.0.0/24 on br0", "address 10.1.0.200/32 on tun0"),
                   hostspace.LiveOverlap("10.1.0.0/24 on br0", "route 10.1.0.0/25 on tun0")]
    assert hostspace.live_overlaps(hostspace.owned_prefixes([vpn]), [br, vpn], routes) == []


# ------------------------------------------------------------------ property: 0 overlaps

UNIVERSE = N("10.0.0.0/14")
STATES = 10_000 if SOAK else 1_000


def _prefix_in(draw: st.DrawFn, within: Any, lo: int, hi: int) -> Any:
    length = draw(st.integers(max(lo, within.prefixlen), hi))
    span = 1 << (length - within.prefixlen)
    index = draw(st.integers(0, span - 1))
    return N((int(within.network_address) + index * (1 << (32 - length)), length))


@st.composite
def host_states(draw: st.DrawFn) -> dict[str, Any]:
    """Random host state and requests, all inside 10.0.0.0/14 so that they meet."""
    pools = [_prefix_in(draw, UNIVERSE, 15, 20) for _ in range(draw(st.integers(1, 3)))]
    occ: list[tuple[str, Any]] = []
    for _i in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["addr", "route", "blackhole", "docker", "owned"]))
        where = draw(st.sampled_from(pools)) if draw(st.booleans()) else UNIVERSE
        occ.append((kind, _prefix_in(draw, where, 18, 30)))
    space_kind = draw(st.sampled_from(["none", "default", "default", "custom", "down"]))
    custom = tuple((str(b), draw(st.integers(b.prefixlen, min(b.prefixlen + 6, 26))))
                   for b in (_prefix_in(draw, UNIVERSE, 17, 22)
                             for _ in range(draw(st.integers(1, 2)))))
    requests = []
    for i in range(draw(st.integers(1, 6))):
        pool = draw(st.sampled_from(pools))
        size = draw(st.integers(pool.prefixlen + 3, min(pool.prefixlen + 9, 28)))
        # Docker networks only where the daemon answers (down: they are not planned at all)
        kind = "docker" if space_kind in ("default", "custom") and draw(
            st.integers(0, 4)) == 0 else "subnet"
        # a prefix it was given earlier (maybe overlapping what appeared since), or none
        had = _prefix_in(draw, pool, size, size) if draw(st.booleans()) else None
        evidence = draw(st.sampled_from(["rules", "gateway"]))
        requests.append((f"r{i}", kind, pool, size, had, evidence))
    fixed = [_prefix_in(draw, draw(st.sampled_from(pools)), 18, 28)
             for _ in range(draw(st.integers(0, 3)))]
    host_ips = [ipaddress.IPv4Address(int(p.network_address) + draw(st.integers(0, 255)))
                for p in draw(st.lists(st.sampled_from(pools), max_size=2))]
    return {"pools": pools, "occ": occ, "space": space_kind, "custom": custom,
            "requests": requests, "fixed": fixed, "host_ips": host_ips}


def _build(h: dict[str, Any], extra: tuple[Any, ...] = ()) -> tuple[DesiredState, LiveState]:
    from reconciler.domain.model import Alloc, AllocId, PortMap

    links: list[LiveLink] = []
    routes: list[LiveRoute] = []
    uses: list[DockerNetworkUse] = []
    rules: list[str] = []
    dnets: list[LiveDockerNetwork] = []
    for i, (kind, net) in enumerate(h["occ"]):
        if kind == "addr":
            links.append(link(f"f{i}", 100 + i, f"{net.network_address + 1}/{net.prefixlen}"))
        elif kind == "route":
            routes.append(LiveRoute(str(net), None, False, oif=99))
        elif kind == "blackhole":
            routes.append(LiveRoute(str(net), None, False, type="blackhole"))
        elif kind == "docker":
            uses.append(use(f"d{i}", str(net)))
        else:  # an owned prefix of a subnet no file declares any more (--no-prune)
            links.append(link(f"o{i}", 300 + i, f"{net.network_address + 1}/{net.prefixlen}",
                              owned=True, kind="bridge"))
    links.append(link("f99", 99))
    subnets: list[Subnet] = []
    docker: list[DockerNetwork] = []
    for j, net in enumerate(h["fixed"]):
        if not any(net.overlaps(o) for o in h["fixed"][:j]):  # validate refuses the others
            subnets.append(sub(f"fixed{j}", f"fb{j}", str(net)))
    for name, kind, pool, size, had, evidence in [*extra, *h["requests"]]:
        if kind == "subnet":
            bridge = f"b-{name}"
            subnets.append(Subnet(SubnetName(name), BridgeName(bridge), AutoPrefix(pool, size)))
            addrs = ()
            if had is not None and evidence == "gateway":
                addrs = (f"{had.network_address + 1}/{had.prefixlen}",)
            if had is not None and evidence == "rules":
                # as the iptables driver canonicalises iptables-save: our tokens bare
                rules.append(f"-d {had} -o {bridge} -m comment --comment reconciler:subnet="
                             f"{name} -j ACCEPT")
            links.append(link(bridge, 500 + len(links), *addrs, owned=True, kind="bridge"))
        else:
            docker.append(DockerNetwork(DockerNetworkName(name), auto=AutoPrefix(pool, size)))
            if had is not None:
                u = use(name, str(had))
                uses.append(u)
                dnets.append(LiveDockerNetwork(u.id, name, "bridge", {}, {}, False, False,
                                               (str(had),), 0))
    space = {"none": None, "default": DockerAddressSpace(True, tuple(uses), ()),
             "custom": DockerAddressSpace(True, tuple(uses), h["custom"]),
             "down": DockerAddressSpace(False, (), h["custom"])}[h["space"]]
    live_docker = LiveDocker(True, networks=tuple(dnets)) if h["space"] in ("default", "custom") \
        else None
    allocs = {}
    if h["host_ips"]:  # on a subnet of its own, outside everything above
        subnets.append(sub("vipnet", "vipbr", "10.255.0.0/24"))
        allocs[AllocId("vip")] = Alloc(AllocId("vip"), SubnetName("vipnet"), ports=tuple(
            PortMap(1000 + k, 80, "tcp", ip) for k, ip in enumerate(h["host_ips"])))
    d = dataclasses.replace(desired(*subnets, docker=tuple(docker)), allocs=allocs)
    fw4 = LiveChainSet(True, {("filter", "RECONCILER-FORWARD"): tuple(rules)})
    return d, live(*links, routes=tuple(routes), space=space, docker=live_docker, fw4=fw4)


def _forbidden(h: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """What a new pick must not overlap, computed here without the planner's helpers:
    (host and owned occupants, Docker's unassigned pool chunks)."""
    occ = [net for kind, net in h["occ"] if kind != "docker" or h["space"] in ("default",
                                                                               "custom")]
    if h["space"] == "none":
        return occ, []
    pools = DEFAULT_ADDRESS_POOLS if h["space"] == "default" else h["custom"]
    docker_nets = [net for kind, net in h["occ"] if kind == "docker"] + [
        had for _n, kind, _p, _s, had, _e in h["requests"] if kind == "docker" and had] \
        if h["space"] != "down" else []
    chunks = []
    for base, size in pools:
        for chunk in N(base).subnets(new_prefix=size):  # at most 2**6 (host_states)
            if not any(chunk.overlaps(d) for d in docker_nets):
                chunks.append(chunk)
    return occ, chunks


def test_auto_picks_overlap_nothing_over_random_host_states(request: pytest.FixtureRequest):
    stats = {"states": 0, "overlaps": 0, "picked": 0, "kept": 0, "exhausted": 0}

    @settings(max_examples=STATES, deadline=None, database=None, derandomize=not SOAK,
              suppress_health_check=list(HealthCheck))
    @given(host_states())
    def prop(h: dict[str, Any]) -> None:
        stats["states"] += 1
        d, lv = _build(h)
        res = addrspace.resolve(d, lv)
        occupied, chunks = _forbidden(h)
        bad: list[str] = []
        got: dict[str, Any] = {}
        for name, kind, pool, size, had, _evidence in h["requests"]:
            if res.fatal:
                break
            net = (res.desired.subnets[SubnetName(name)].cidr if kind == "subnet"
                   else res.desired.docker_networks[DockerNetworkName(name)].subnet)
            got[name] = net
            if net.prefixlen != size or not net.subnet_of(pool):
                bad.append(f"{name}: {net} is not a /{size} of {pool}")
            if net == had:
                stats["kept"] += 1
                continue
            stats["picked"] += 1
            for o in occupied:
                if net.overlaps(o):
                    bad.append(f"{name}: new pick {net} overlaps {o}")
            for c in chunks:
                if net.overlaps(c):
                    bad.append(f"{name}: new pick {net} overlaps Docker's unassigned {c}")
        if res.fatal:
            stats["exhausted"] += 1
            return
        names = sorted(got)

        def kind_of(name: str) -> str:
            return next(r[1] for r in h["requests"] if r[0] == name)

        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if got[a].overlaps(got[b]):
                    bad.append(f"{a} {got[a]} and {b} {got[b]} overlap")
            for s in d.subnets.values():
                if s.auto is None and got[a].overlaps(s.cidr):
                    bad.append(f"{a} {got[a]} overlaps fixed {s.name} {s.cidr}")
            kept = any(r[0] == a and r[4] == got[a] for r in h["requests"])
            for ip in h["host_ips"]:
                if ip in got[a] and not kept:
                    bad.append(f"{a} {got[a]} was picked over host_ip {ip}")
                elif ip in got[a] and kind_of(a) == "subnet" and not any(
                        f"host_ip {ip} is inside subnet {a!r}" in f
                        for f in addrspace.check(res.desired, lv, picked=res.picked).fatal):
                    bad.append(f"{a} kept {got[a]} holds host_ip {ip} and the plan goes on")
        # a kept prefix that something foreign overlaps now is a conflict, never silent
        # (an owned prefix of a subnet no longer declared is ours: pruned, or --no-prune)
        found = addrspace.check(res.desired, lv)
        foreign = [net for kind, net in h["occ"] if kind in ("addr", "route", "blackhole")]
        for name, kind, _pool, _size, had, _evidence in h["requests"]:
            address = f"{'subnet' if kind == 'subnet' else 'docker_network'}/{name}"
            if got[name] == had and kind == "subnet" and any(
                    had.overlaps(o) for o in foreign) and address not in found.conflicts:
                bad.append(f"{name}: kept {had} overlaps the host and is not a conflict")
        # applied: each pick is live now (gateway on its bridge); planned again: the same
        applied = dict(h, requests=[(n, k, p, s, got[n], "gateway")
                                    for n, k, p, s, _had, _e in h["requests"]])
        d2, lv2 = _build(applied)
        again = addrspace.resolve(d2, lv2)
        if again.fatal or any(
                (again.desired.subnets[SubnetName(n)].cidr if k == "subnet"
                 else again.desired.docker_networks[DockerNetworkName(n)].subnet) != got[n]
                for n, k, *_ in h["requests"]):
            bad.append(f"not stable once applied: {again.fatal or again.desired}")
        # one more declared later, named before all the others: earlier picks stay
        pool0 = h["requests"][0][2]
        d3, lv3 = _build(applied, extra=(("a-new", "subnet", pool0, pool0.prefixlen + 4,
                                          None, "rules"),))
        more = addrspace.resolve(d3, lv3)
        if not more.fatal:
            for n, k, *_ in h["requests"]:
                now = (more.desired.subnets[SubnetName(n)].cidr if k == "subnet"
                       else more.desired.docker_networks[DockerNetworkName(n)].subnet)
                if now != got[n]:
                    bad.append(f"{n} moved from {got[n]} to {now} when a-new was declared")
            new = more.desired.subnets[SubnetName("a-new")].cidr
            if any(new.overlaps(v) for v in got.values()):
                bad.append(f"a-new {new} overlaps an earlier pick")
        stats["overlaps"] += len(bad)
        assert not bad, bad

    prop()
    report(request, f"address space: {stats['states']} states tried / {stats['overlaps']} "
                    f"overlaps ({stats['picked']} new picks, {stats['kept']} kept, "
                    f"{stats['exhausted']} states with an exhausted pool)")
    assert stats["overlaps"] == 0 and stats["picked"] > stats["states"] // 2


def test_the_probe_lists_every_network_or_says_why_not(tmp_path, monkeypatch):
    """One raw GET /networks on a unix socket: a fake daemon here, no SDK."""
    import socket
    import threading

    path = str(tmp_path / "docker.sock")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    assert rawapi.list_networks() is None  # no socket: no Docker on this host
    assert rawapi.owned_scopes() == set()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    answers = [b"", json.dumps([{"Name": "bridge", "Id": "a" * 64, "IPAM": {"Config": [
        {"Subnet": "172.17.0.0/16"}]}, "Options": {"com.docker.network.bridge.name": "docker0"}},
        {"Name": "ours", "Id": "b" * 64, "Labels": {DOCKER_LABEL: DOCKER_LABEL_VALUE,
                                                    "io.reconciler.scope": "host"}}]).encode()]

    def serve() -> None:
        for body in answers:
            conn, _ = server.accept()
            conn.recv(65536)
            if body:  # the first one hangs up without an answer: a daemon going away
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        down = rawapi.list_networks()
        assert down is not None and not down.answered and "unreachable" in (down.error or "")
        space = rawapi.address_space(down)
        assert space is not None and not space.available
        d = desired(sub("s", "b", "10.1.0.0/24"))
        found = addrspace.check(d, live(space=space))
        assert found.conflicts == {} and any("subnets not checked against Docker's networks"
                                             in w for w in found.warnings), found.warnings
        up = rawapi.list_networks()
        assert up is not None and up.answered and len(up.networks) == 2
        assert rawapi.owned_scopes(up) == {"host"}
        space = rawapi.address_space(up)
        assert space is not None and [(u.name, u.bridge, u.owned) for u in space.networks] == [
            ("bridge", "docker0", False), ("ours", "br-bbbbbbbbbbbb", True)]
    finally:
        t.join(5)
        server.close()


def test_a_stopped_daemon_is_not_asked_again_through_the_sdk(tmp_path, monkeypatch):
    """A socket file nobody listens on (dockerd stopped): a host-only observation says
    Docker is unavailable, in the SDK's words, without importing or calling the SDK."""
    import socket

    from reconciler.domain.model import DesiredState
    from reconciler.engine.handles import HostHandles
    from reconciler.engine.observe import Observer

    path = str(tmp_path / "docker.sock")
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(path)  # bound, never listening: connect() is refused
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")

    def no_sdk(self: HostHandles) -> None:
        raise AssertionError("the Docker SDK was asked")

    monkeypatch.setattr(HostHandles, "docker", property(no_sdk))
    try:
        listing = rawapi.list_networks()
        assert listing is not None and listing.refused and not listing.answered
        live = Observer(HostHandles()).observe_docker(DesiredState(), listing)
        assert live is not None and not live.available
        assert live.error == f"docker daemon unreachable at unix://{path}: connection refused"
    finally:
        left.close()


@pytest.mark.parametrize(("answer", "networks", "error"), [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"3\r\n[{}\r\n4;x=y\r\n, {}\r\n1\r\n]\r\n0\r\n\r\n", 2, None),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 9\r\n\r\n[{}]", None, "cut short"),
    (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n{}", None, "HTTP 500"),
    (b"SSH-2.0-OpenSSH\r\n", None, "no HTTP answer"),
])
def test_the_probe_reads_what_a_daemon_may_answer(tmp_path, monkeypatch, answer, networks,
                                                   error):
    """The probe's own HTTP/1.0 reading: a chunked body, a body cut short, an error status,
    something that is not HTTP."""
    import socket
    import threading

    path = str(tmp_path / "docker.sock")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    asked: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        asked.append(conn.recv(65536))
        conn.sendall(answer)
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        listing = rawapi.list_networks()
    finally:
        t.join(5)
        server.close()
    assert asked and asked[0].startswith(b"GET /networks HTTP/1.0\r\n")
    assert listing is not None
    if networks is not None:
        assert listing.answered and len(listing.networks) == networks
    else:
        assert not listing.answered and error in (listing.error or ""), listing.error


def test_the_probe_does_not_wait_for_a_daemon_that_keeps_the_connection(tmp_path, monkeypatch):
    """A complete answer (its Content-Length) is enough: a daemon that keeps the
    connection open must not cost the timeout and read as unreachable."""
    import socket
    import threading
    import time

    path = str(tmp_path / "docker.sock")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    done = threading.Event()

    def serve() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        body = b'[{"Name": "x"}]'
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        done.wait(10)  # kept open
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        listing = rawapi.list_networks(timeout=5.0)
        took = time.monotonic() - t0
    finally:
        done.set()
        t.join(5)
        server.close()
    assert listing is not None and listing.answered, listing
    assert [n["Name"] for n in listing.networks] == ["x"]
    assert took < 4.0  # not the timeout (a bound, not a speed figure)


def test_the_probe_reads_a_big_answer_without_reading_it_again_at_each_receive(tmp_path,
                                                                               monkeypatch):
    """A host with thousands of networks lists megabytes: the whole buffer parsed again
    after each receive was quadratic (32 MB took ~9 s, past the timeout: "unreachable").
    Counted, not timed: the headers are parsed a bounded number of times."""
    import socket
    import threading

    path = str(tmp_path / "docker.sock")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    body = json.dumps([{"Name": f"n{i}", "Pad": "x" * 200} for i in range(20_000)]).encode()
    splits = []
    real_split = rawapi._split
    monkeypatch.setattr(rawapi, "_split", lambda data: splits.append(len(data))
                        or real_split(data))

    def serve() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
        for at in range(0, len(head + body), 4096):  # in small pieces, as a busy daemon
            conn.sendall((head + body)[at:at + 4096])
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        listing = rawapi.list_networks(timeout=10.0)
    finally:
        t.join(10)
        server.close()
    assert listing is not None and listing.answered, listing.error
    assert len(listing.networks) == 20_000
    assert len(splits) <= 3, f"{len(splits)} parses of the answer"
