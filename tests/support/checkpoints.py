"""A small live host for checkpoint and safe-change tests: one owned bridge with a foreign
address beside it, a foreign link, allocations with their veths and namespaces, and the
reconciler's own firewall chains."""

from __future__ import annotations

import ipaddress
import time
from typing import Any

from reconciler.domain.live import (
    LiveAddress,
    LiveChainSet,
    LiveLink,
    LiveNetns,
    LiveRoute,
    LiveState,
)
from reconciler.domain.ownership import LINK_ALIAS, alloc_mac, alloc_ns_alias, alloc_veth_name
from reconciler.engine import safechange
from reconciler.planner import nftview
from reconciler.planner.checkpoint import take
from tests.support.fakehost import table_from

HOST = "4026531840"


VETH = alloc_veth_name("a1")


FW = LiveChainSet(available=True, chains={
    ("filter", "FORWARD"): ("-m comment --comment reconciler -j RECONCILER-FORWARD",),
    ("filter", "RECONCILER-FORWARD"): (
        "-d 10.0.0.0/24 -o br0 -m comment --comment reconciler:subnet=net -j ACCEPT",),
    ("nat", "RECONCILER-DNAT"): (
        "-p tcp -m tcp --dport 8080 -m comment --comment reconciler:alloc=a1 "
        "-j DNAT --to-destination 10.0.0.2:80",),
    ("nat", "PREROUTING"): ("-m addrtype --dst-type LOCAL -m comment --comment reconciler "
                            "-j RECONCILER-DNAT",),
    ("nat", "OUTPUT"): ("-m addrtype --dst-type LOCAL -m comment --comment reconciler "
                        "-j RECONCILER-DNAT",)})


def live_addr(text: str, owned: bool = True) -> LiveAddress:
    return LiveAddress(ipaddress.ip_interface(text), owned)


def live_alloc(name: str, address: str = "10.0.0.2/24", mtu: int = 1500) -> LiveNetns:
    lo = LiveLink("lo", 1, "", 65536, True, False, alias=alloc_ns_alias(HOST))
    eth0 = LiveLink("eth0", 2, "veth", mtu, True, True, alias=LINK_ALIAS,
                    addresses=(live_addr(address),), mac=alloc_mac(name))
    return LiveNetns(name, True, (lo, eth0), (LiveRoute("default", "10.0.0.1", True, 2),))


def live_host(*, bridge_mtu: int = 1500, hairpin: bool = True, allocs: tuple[str, ...] = ("a1",),
          fw: LiveChainSet = FW, extra_bridge: bool = False) -> LiveState:
    links = {"br0": LiveLink("br0", 5, "bridge", bridge_mtu, True, True, alias=LINK_ALIAS,
                             addresses=(live_addr("10.0.0.1/24"), live_addr("192.0.2.1/24", False)),
                             mac="02:00:00:00:00:01"),
             "eth9": LiveLink("eth9", 2, "", 1500, True, False, mac="52:54:00:00:00:01")}
    for a in allocs:
        links[alloc_veth_name(a)] = LiveLink(alloc_veth_name(a), 6, "veth", bridge_mtu, True,
                                             True, alias=LINK_ALIAS, master="br0",
                                             hairpin=hairpin, mac="aa:00:00:00:00:06")
    if extra_bridge:
        links["br1"] = LiveLink("br1", 9, "bridge", 1500, True, True, alias=LINK_ALIAS,
                                mac="02:00:00:00:00:09")
    table = table_from(fw)
    return LiveState(host_id=HOST, links=links, table=table,
                     firewall4=nftview.view(table, 4), firewall6=nftview.view(table, 6),
                     sysctls={"net/ipv4/ip_forward": "1", "net/ipv6/conf/all/forwarding": "0",
                              "net/ipv4/conf/br0/route_localnet": "0"},
                     netns={a: live_alloc(a, mtu=bridge_mtu) for a in allocs})


def plan_ops(plan: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(op.name, op.args) for c in plan.actionable for op in c.ops]


def pending_record(deadline: float, boot: str) -> safechange.Pending:
    return safechange.Pending("netns/x", "t", deadline, time.time(), boot, take(live_host()))
