"""Routes of every table an ip rule selects, and Docker networks of another namespace.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import threading

from reconciler.agent.planview import sentinels
from reconciler.agent.sources import DriftFilter, OverlapAlarm
from reconciler.domain.live import (
    DockerAddressSpace,
    DockerNetworkUse,
    LiveAddress,
    LiveDocker,
    LiveDockerNetwork,
    LiveLink,
    LiveRoute,
    LiveState,
)
from reconciler.domain.model import (
    DesiredState,
    DockerNetwork,
    DockerNetworkName,
)
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.drivers.netlink import listen, parse, wire
from reconciler.drivers.netlink.wire import NlMsg
from reconciler.planner import addrspace, hostspace
from tests.support.planning import desired, sub

# ------------------------------------------------------------------ every routing table


def _message(kind: int, header: bytes, *attrs: bytes) -> bytes:
    body = header + b"".join(attrs)
    return wire.HDR.pack(16 + len(body), kind, 0, 1, 0) + body


def _rule(family: int, table: int, *, action: int = wire.FR_ACT_TO_TBL, big: int | None = None,
          kind: int = wire.RTM_NEWRULE) -> bytes:
    attrs = (wire.u32_attr(wire.FRA_TABLE, big),) if big is not None else ()
    return _message(kind, wire.FIB_RULE_HDR.pack(family, 0, 0, 0, table, 0, 0, action, 0),
                    *attrs)


def _route(dst: str, table: int, oif: int = 6) -> NlMsg:
    net = ipaddress.ip_network(dst)
    family = socket.AF_INET if net.version == 4 else socket.AF_INET6
    return NlMsg.decode(_message(
        wire.RTM_NEWROUTE, wire.RTMSG.pack(family, net.prefixlen, 0, 0, min(table, 252), 3, 0,
                                           1, 0),
        wire.attr(wire.RTA_DST, net.network_address.packed), wire.u32_attr(wire.RTA_OIF, oif),
        wire.u32_attr(wire.RTA_TABLE, table)))


def test_a_rule_says_which_table_it_looks_up() -> None:
    def table(raw: bytes) -> tuple[int, int] | None:
        return parse.parse_rule_table(NlMsg.decode(raw))

    assert table(_rule(socket.AF_INET, 52)) == (socket.AF_INET, 52)  # Tailscale's 5270
    assert table(_rule(socket.AF_INET6, 0, big=51820)) == (socket.AF_INET6, 51820)  # wg-quick
    assert table(_rule(socket.AF_INET, 0, action=2)) is None  # goto
    assert table(_rule(socket.AF_INET, 0)) is None  # l3mdev: a VRF's own table


def test_routes_are_read_from_the_tables_the_rules_select_with_their_table() -> None:
    tables = {socket.AF_INET: frozenset({52, 254}), socket.AF_INET6: frozenset({254})}
    got = parse.parse_route(_route("10.232.0.0/16", 52), tables)
    assert got is not None and got.table == 52 and got.dst == "10.232.0.0/16"
    assert parse.parse_route(_route("10.233.0.0/16", 4242), tables) is None  # no rule
    assert parse.parse_route(_route("fd00:52::/64", 52), tables) is None  # an IPv4 rule only
    assert parse.parse_route(_route("10.232.0.0/16", 52)) is None  # main only by default


def test_a_route_of_another_table_is_a_conflict_naming_that_table() -> None:
    tun = LiveLink("tun0", 6, "", 1280, True, False)
    live = LiveState(links={"tun0": tun}, routes=(
        LiveRoute("10.232.0.0/16", None, False, oif=6, table=52),
        LiveRoute("10.9.0.0/16", None, False, type="blackhole", table=52),
        LiveRoute("10.232.9.0/24", None, False, oif=6)))
    whats = {o.what for o in hostspace.occupants(DesiredState(), live)}
    assert whats == {"route 10.232.0.0/16 on tun0 in table 52",
                     "blackhole route 10.9.0.0/16 in table 52", "route 10.232.9.0/24 on tun0"}


def test_rule_changes_wake_the_alarm_and_the_plan_view_not_a_pass() -> None:
    (ev,) = parse.parse_messages(_rule(socket.AF_INET, 52))
    assert ev.what == "rule" and not ev.deleted
    (gone,) = parse.parse_messages(_rule(socket.AF_INET, 52, kind=wire.RTM_DELRULE))
    assert gone.deleted
    assert not DriftFilter().relevant(ev)
    alarm = OverlapAlarm(lambda _found: None, threading.Event())
    assert alarm.hear(ev)
    assert sentinels._only_routes(_rule(socket.AF_INET, 52))
    assert listen.GROUPS & listen.RTMGRP_IPV4_RULE and listen.GROUPS & listen.RTMGRP_IPV6_RULE


def test_the_alarm_reads_the_routes_of_every_selected_table() -> None:
    class Reader:
        def dump_links(self) -> dict[str, LiveLink]:
            br = LiveLink("br0", 5, "bridge", 1500, True, True, addresses=(
                LiveAddress(ipaddress.ip_interface("10.66.0.1/24"), True),))
            return {"br0": br, "tailscale0": LiveLink("tailscale0", 6, "", 1280, True, False)}

        def dump_host_routes(self) -> tuple[LiveRoute, ...]:
            return (LiveRoute("10.66.0.0/25", None, False, oif=6, table=52),)

    alarm = OverlapAlarm(lambda _found: None, threading.Event())
    (found,) = alarm.check(Reader())  # type: ignore[arg-type]
    assert found.foreign == "route 10.66.0.0/25 on tailscale0 in table 52"


# ------------------------------------------------------------------ Docker in another namespace


def _docker(name: str, subnet: str) -> DockerNetwork:
    return DockerNetwork(DockerNetworkName(name), subnet=ipaddress.IPv4Network(subnet))


SPACE = DockerAddressSpace(True, (
    DockerNetworkUse("bridge", "d" * 64, ("172.17.0.0/16",), "docker0"),
    DockerNetworkUse("ten", "e" * 64, ("10.240.77.0/24",), "br-eeeeeeeeeeee"),
    DockerNetworkUse("host", "f" * 64, (), "br-ffffffffffff", driver="host")))


def _sandbox(*links: LiveLink) -> LiveState:
    tun = LiveLink("tun0", 6, "", 1280, True, False)
    return LiveState(links={lk.name: lk for lk in (tun, *links)}, docker_space=SPACE,
                     routes=(LiveRoute("10.250.0.0/16", None, False, oif=6),))


def test_in_a_sandbox_docker_networks_and_the_routing_here_are_a_warning_apart() -> None:
    d = desired(sub("cni", "b0", "10.0.0.0/8"),
                docker=(_docker("ci", "10.250.3.0/24"), _docker("dup", "10.240.77.0/25")))
    live = _sandbox()
    assert hostspace.docker_elsewhere(live)
    found = addrspace.check(d, live)
    # the sandbox's own route is still a conflict, and so are two networks of one daemon
    assert found.conflicts == {
        "subnet/cni": "cidr 10.0.0.0/8 overlaps route 10.250.0.0/16 on tun0",
        "docker_network/dup": "subnet 10.240.77.0/25 overlaps docker network ten "
                              "(10.240.77.0/24 on br-eeeeeeeeeeee)"}
    apart = [w for w in found.warnings if "no conflict here" in w]
    assert len(apart) == 2, found.warnings
    assert apart[0].startswith("subnet 'cni': cidr 10.0.0.0/8 overlaps docker network ten "
                               "(10.240.77.0/24 on br-eeeeeeeeeeee):"), apart
    assert apart[1].startswith("docker network 'ci': subnet 10.250.3.0/24 overlaps route "
                               "10.250.0.0/16 on tun0"), apart
    # the daemon's bridges are links here (the host, or a daemon inside the sandbox): conflicts
    here = _sandbox(LiveLink("docker0", 9, "bridge", 1500, True, False))
    assert not hostspace.docker_elsewhere(here)
    assert set(addrspace.check(d, here).conflicts) == {"subnet/cni", "docker_network/ci",
                                                        "docker_network/dup"}


def test_the_alarm_leaves_owned_docker_networks_of_another_namespace_out() -> None:
    docker = LiveDocker(True, networks=(LiveDockerNetwork(
        "e" * 64, "ten", "bridge", {DOCKER_LABEL: DOCKER_LABEL_VALUE}, {}, False, False,
        ("10.240.77.0/24",), 0),))
    sandbox = dataclasses.replace(_sandbox(), docker=docker)
    assert hostspace.owned_docker_prefixes(sandbox) == ([], set())
    here = dataclasses.replace(sandbox, links={**sandbox.links, "docker0": LiveLink(
        "docker0", 9, "bridge", 1500, True, False)})
    prefixes, bridges = hostspace.owned_docker_prefixes(here)
    assert [str(p) for p, _w, _l in prefixes] == ["10.240.77.0/24"]
    assert bridges == {"br-eeeeeeeeeeee"}


