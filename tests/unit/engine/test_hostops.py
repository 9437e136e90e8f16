"""HostOps, the one gate for side effects, against recording drivers: every op reaches one."""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Any

import pytest

from reconciler.domain import nftable
from reconciler.domain.ops import OPS, OpError
from reconciler.domain.plan import Op
from reconciler.engine import hostops, optiming
from reconciler.engine.handles import HostHandles
from reconciler.engine.hostops import HostOps
from tests.support.opscenarios import recorded_ops
from tests.support.recorders import Recorder


class Sysctl(Recorder):
    """The sysctl driver: writes are recorded, reads answer from ``values`` (they change
    nothing, so "one driver call per op" counts the changes)."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        super().__init__("sysctl", calls)
        self.values: dict[str, str] = {}

    def read(self, key: str) -> str | None:
        return self.values.get(key)


Calls = tuple[HostOps, list[tuple[Any, ...]]]
_GUARD = nftable.Entry("guarded", ("br9",), (), "bridge=br9")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    log: list[tuple[Any, ...]] = []
    handles = HostHandles(netlink=Recorder("netlink", log),  # type: ignore[arg-type]
                          docker=Recorder("docker", log),  # type: ignore[arg-type]
                          conntrack=Recorder("conntrack", log))  # type: ignore[arg-type]
    handles._ipt = {4: Recorder("ipt4", log), 6: Recorder("ipt6", log)}  # type: ignore[dict-item]
    handles._nft = Recorder("nft", log)  # type: ignore[assignment]
    ops = HostOps(handles)
    monkeypatch.setattr(hostops, "sysctl", Sysctl(log))
    return ops, log


def test_every_op_the_planner_writes_reaches_one_driver_call(calls: Calls) -> None:
    ops, log = calls
    seen = set()
    for raw in recorded_ops():
        before = len(log)
        ops.run(Op.from_json(raw))
        assert len(log) == before + 1, raw
        seen.add(raw["op"])
    assert seen == set(OPS)


@pytest.mark.parametrize(("op", "call"), [
    (Op("link.set", {"name": "vr1", "up": True, "owned": True}),
     ("netlink", "set_link", ("vr1",), {"mtu": None, "up": True, "master": None, "ns": None,
                                        "alias": "managed-by=reconciler"})),
    (Op("link.set", {"name": "eth0", "mtu": 1400, "netns": "a"}),
     ("netlink", "set_link", ("eth0",), {"mtu": 1400, "up": None, "master": None, "ns": "a",
                                         "alias": None})),
    (Op("link.delete", {"name": "eth0", "netns": "a"}),
     ("netlink", "delete_link", ("eth0", "a"), {})),
    (Op("addr.del", {"link": "eth0", "address": "10.0.0.2/24", "netns": "a"}),
     ("netlink", "del_address", ("eth0", ipaddress.ip_interface("10.0.0.2/24")), {"ns": "a"})),
    (Op("alloc.configure", {"netns": "a", "addresses": ["10.0.0.2/24", "fd00::2/64"],
                            "gateways": ["10.0.0.1", "fd00::1"], "mtu": None, "ipv6": True,
                            "mark": "m"}),
     ("netlink", "configure_inside",
      ("a", [ipaddress.ip_interface("10.0.0.2/24"), ipaddress.ip_interface("fd00::2/64")],
       [ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("fd00::1")]),
      {"mtu": None, "mark": "m", "announce": False})),  # "ipv6" is not read: eth0 never
    # has a link-local address
    (Op("alloc.configure", {"netns": "a", "addresses": ["10.0.0.2/24"], "gateways": ["10.0.0.1"],
                            "mtu": 1400, "ipv6": False, "mark": "m", "announce": True}),
     ("netlink", "configure_inside",
      ("a", [ipaddress.ip_interface("10.0.0.2/24")], [ipaddress.ip_address("10.0.0.1")]),
      {"mtu": 1400, "mark": "m", "announce": True})),
    (Op("addr.add", {"link": "br0", "address": "10.0.0.1/24"}),
     ("netlink", "add_address", ("br0", ipaddress.ip_interface("10.0.0.1/24")), {"ns": None})),
    (Op("addr.add", {"link": "eth0", "address": "fd00::2/64", "netns": "a"}),
     ("netlink", "add_address", ("eth0", ipaddress.ip_interface("fd00::2/64")), {"ns": "a"})),
    (Op("firewall.nft", {"delete": [_GUARD.wire()]}),
     ("nft", "apply", (nftable.element_commands("delete", [_GUARD]),), {})),
    (Op("sysctl.set", {"key": "net/ipv4/ip_forward", "value": "1"}),
     ("sysctl", "write", ("net/ipv4/ip_forward", "1"), {})),
])
def test_op_arguments_reach_the_driver(calls: Calls, op: Op, call: tuple[Any, ...]) -> None:
    ops, log = calls
    ops.run(op)
    assert log == [call]


@pytest.mark.parametrize(("default", "mode"), [("0", "0"), ("3", "3"), ("1", "0"), (None, "0")])
def test_an_ipv6_gateway_on_a_bridge_without_address_generation_turns_it_on_without_dad(
        calls: Calls, default: str | None, mode: str) -> None:
    """A bridge is made with address generation off (ensure_bridge); its IPv6 gateway brings
    its link-local address back, usable at once: accept_dad 0 first, then the default mode
    (or eui64 when the default is none or unreadable)."""
    ops, log = calls
    values = hostops.sysctl.values  # type: ignore[attr-defined]
    values["net/ipv6/conf/br0/addr_gen_mode"] = "1"
    if default is not None:
        values["net/ipv6/conf/default/addr_gen_mode"] = default
    ops.run(Op("addr.add", {"link": "br0", "address": "fd00::1/64"}))
    assert log == [("sysctl", "write", ("net/ipv6/conf/br0/accept_dad", "0"), {}),
                   ("sysctl", "write", ("net/ipv6/conf/br0/addr_gen_mode", mode), {}),
                   ("netlink", "add_address", ("br0", ipaddress.ip_interface("fd00::1/64")),
                    {"ns": None})]


def test_an_ipv6_address_on_a_link_with_address_generation_on_changes_no_sysctl(
        calls: Calls) -> None:
    ops, log = calls
    hostops.sysctl.values["net/ipv6/conf/br0/addr_gen_mode"] = "0"  # type: ignore[attr-defined]
    ops.run(Op("addr.add", {"link": "br0", "address": "fd00::1/64"}))
    assert log == [("netlink", "add_address", ("br0", ipaddress.ip_interface("fd00::1/64")),
                    {"ns": None})]


def test_a_revert_turning_address_generation_off_drops_the_link_local_it_left(
        calls: Calls) -> None:
    """Setting a bridge's addr_gen_mode back to none leaves the kernel's link-local
    address: it goes too; other values and other keys are only written."""
    ops, log = calls
    ops.run(Op("sysctl.set", {"key": "net/ipv6/conf/br0/addr_gen_mode", "value": "1"}))
    assert log == [("sysctl", "write", ("net/ipv6/conf/br0/addr_gen_mode", "1"), {}),
                   ("netlink", "del_link_local_addresses", ("br0",), {})]
    log.clear()
    ops.run(Op("sysctl.set", {"key": "net/ipv6/conf/br0/addr_gen_mode", "value": "0"}))
    ops.run(Op("sysctl.set", {"key": "net/ipv6/conf/default/addr_gen_mode", "value": "1"}))
    assert [c[1] for c in log] == ["write", "write"]


def test_an_op_that_does_not_decode_reaches_no_driver(calls: Calls) -> None:
    ops, log = calls
    with pytest.raises(OpError, match="unknown operation 'link.frob'"):
        ops.run(Op("link.frob", {"name": "x"}))
    with pytest.raises(OpError, match="addr.add: malformed arguments"):
        ops.run(Op("addr.add", {"link": "br0", "address": "10.0.0.300/24"}))
    assert log == []


def test_the_bench_timing_hook_records_each_firewall_op_and_nothing_else(
        calls: Calls, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ops, log = calls
    path = tmp_path / "times.jsonl"
    ops.run(Op("firewall.nft", {"delete": [_GUARD.wire()]}))
    assert not path.exists()  # off unless the bench asks for it
    monkeypatch.setenv(optiming.ENV, str(path))
    ops.run(Op("firewall.nft", {"delete": [_GUARD.wire()]}))
    ops.run(Op("link.delete", {"name": "x0"}))
    assert [c[:2] for c in log] == [("nft", "apply"), ("nft", "apply"),
                                    ("netlink", "delete_link")]
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["op"] for r in recs] == ["firewall.nft"]
    assert recs[0]["seconds"] >= 0 and recs[0]["pid"] == os.getpid()
