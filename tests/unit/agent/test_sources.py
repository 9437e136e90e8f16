"""Drift sources without a kernel or a daemon: rtnetlink datagrams parsed, the drift
filter, Docker event reasons and the Docker watcher's reconnects, the overlap alarm."""

from __future__ import annotations

import ipaddress
import struct
import threading
import time
from typing import Any

from reconciler.agent import sources as drift
from reconciler.agent.sources import DriftFilter, docker_event_reason
from reconciler.domain import ownership
from reconciler.drivers.netlink import wire
from reconciler.drivers.netlink.parse import NetlinkEvent, parse_messages


def _rta(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _msg(kind: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 0, 0) + body


def link_msg(index: int, name: str, *, deleted: bool = False, alias: str | None = None,
             master: int | None = None) -> bytes:
    body = struct.pack("=BxHiII", 0, 1, index, 0, 0) + _rta(wire.IFLA_IFNAME,
                                                           name.encode() + b"\0")
    if alias is not None:
        body += _rta(wire.IFLA_IFALIAS, alias.encode() + b"\0")
    if master is not None:
        body += _rta(wire.IFLA_MASTER, struct.pack("=I", master))
    return _msg(wire.RTM_DELLINK if deleted else wire.RTM_NEWLINK, body)


def addr_msg(index: int, family: int, address: bytes, *, proto: int | None = None,
             deleted: bool = False) -> bytes:
    body = struct.pack("=BBBBI", family, 24, 0, 0, index) + _rta(wire.IFA_ADDRESS, address)
    if proto is not None:
        body += _rta(wire.IFA_PROTO, bytes([proto]))
    return _msg(wire.RTM_DELADDR if deleted else wire.RTM_NEWADDR, body)


def route_msg(oif: int, protocol: int) -> bytes:
    body = struct.pack("=BBBBBBBBI", 2, 0, 0, 0, 254, protocol, 0, 1, 0)
    return _msg(wire.RTM_NEWROUTE, body + _rta(wire.RTA_OIF, struct.pack("=I", oif)))


def test_parse_messages_of_one_datagram() -> None:
    data = (link_msg(7, "nomad", alias=ownership.LINK_ALIAS)
            + addr_msg(7, 2, bytes([10, 0, 0, 1]), proto=ownership.ADDR_PROTO)
            + addr_msg(7, 10, bytes.fromhex("fe80" + "00" * 12 + "0001"))
            + route_msg(7, 2) + link_msg(9, "veth1", deleted=True, master=7))
    evs = parse_messages(data)
    assert evs == [
        NetlinkEvent("link", False, 7, name="nomad", alias=ownership.LINK_ALIAS),
        NetlinkEvent("addr", False, 7, proto=ownership.ADDR_PROTO),
        NetlinkEvent("addr", False, 7, link_local=True),
        NetlinkEvent("route", False, 7, proto=2),
        NetlinkEvent("link", True, 9, name="veth1", master=7),
    ]


def test_parse_messages_skips_garbage() -> None:
    assert parse_messages(b"") == []
    assert parse_messages(b"\x01\x02\x03") == []
    truncated = link_msg(3, "x")[:-3]
    assert parse_messages(truncated) == []
    done = struct.pack("=IHHII", 16, wire.NLMSG_DONE, 0, 0, 0)
    assert parse_messages(done + link_msg(3, "x")) == [NetlinkEvent("link", False, 3, name="x")]


def test_drift_filter() -> None:
    resolved: list[int] = []

    def resolve(i: int) -> str | None:
        resolved.append(i)
        return {5: "eth0", 6: "nomad"}.get(i)

    f = DriftFilter(resolve)
    f.set_names({"nomad"})
    ev = parse_messages
    # a desired name, even when not (yet) ours, e.g. deleted out of band
    assert f.relevant(ev(link_msg(6, "nomad", deleted=True))[0])
    # links carrying our alias, and ports of relevant bridges
    assert f.relevant(ev(link_msg(8, "veth-web", alias=ownership.LINK_ALIAS))[0])
    f.set_names({"kind"})
    assert f.relevant(ev(link_msg(9, "vethpeer", master=8))[0])
    # unrelated links and addresses are not
    assert not f.relevant(ev(link_msg(5, "eth0"))[0])
    assert not f.relevant(ev(addr_msg(5, 2, bytes([192, 168, 1, 2])))[0])
    # addresses: ours by marker anywhere, or any non-link-local one on a relevant link
    assert f.relevant(ev(addr_msg(5, 2, bytes([10, 0, 0, 1]), proto=ownership.ADDR_PROTO))[0])
    assert f.relevant(ev(addr_msg(8, 2, bytes([10, 0, 0, 9])))[0])
    ll = bytes.fromhex("fe80" + "00" * 12 + "0001")
    assert not f.relevant(ev(addr_msg(8, 10, ll))[0])  # kernel-made, never ours
    # routes: only ours
    assert f.relevant(ev(route_msg(5, ownership.ROUTE_PROTO))[0])
    assert not f.relevant(ev(route_msg(8, 2))[0])
    # a deleted owned link is forgotten
    assert f.relevant(ev(link_msg(8, "veth-web", deleted=True))[0])
    assert not f.relevant(ev(addr_msg(8, 2, bytes([10, 0, 0, 9])))[0]) or 8 in resolved


def test_drift_filter_learns_from_the_initial_dump() -> None:
    f = DriftFilter(lambda i: None)
    f.learn(NetlinkEvent("link", False, 4, name="old", alias=ownership.LINK_ALIAS))
    assert f.relevant(NetlinkEvent("addr", True, 4))


def test_docker_event_reason() -> None:
    names = frozenset({"kind"})
    ev = {"Type": "network", "Action": "destroy",
          "Actor": {"ID": "abc", "Attributes": {"name": "kind", "type": "bridge"}}}
    assert docker_event_reason(ev, names) == "docker network destroy kind"
    assert docker_event_reason({**ev, "Action": "connect"}, names) == "docker network connect kind"
    assert docker_event_reason({**ev, "Type": "container"}, names) is None
    assert docker_event_reason({**ev, "Action": "exec_start"}, names) is None
    other = {**ev, "Actor": {"ID": "x", "Attributes": {"name": "bridge"}}}
    assert docker_event_reason(other, names) is None
    assert docker_event_reason({"Type": "network"}, names) is None


def test_docker_watcher_reconnects_with_backoff() -> None:
    stop = threading.Event()
    calls: list[str] = []
    reasons: list[str] = []
    event = {"Type": "network", "Action": "destroy",
             "Actor": {"Attributes": {"name": "kind"}}}

    class Client:
        def events(self, **_kw: Any) -> Any:
            if len(calls) == 3:
                stop.set()
            return iter([event])

        def close(self) -> None:
            pass

    def factory() -> Any:
        calls.append("connect")
        if len(calls) == 1:
            raise ConnectionError("daemon down")
        return Client()

    w = drift.DockerWatcher(reasons.append, stop, max_delay=0.01, client_factory=factory)
    w.set_names({"kind"})
    w.start()
    w.close()
    assert w._thread is not None
    w._thread.join(5.0)
    assert calls[:3] == ["connect"] * 3
    assert "docker events reconnected" in reasons
    assert "docker network destroy kind" in reasons


def test_link_local_is_judged_by_the_local_address_as_observation_does() -> None:
    """A global address with a link-local peer is not "link-local" (IFA_LOCAL is the
    address on the link, IFA_ADDRESS the peer), as in parse_addr."""
    ll, glob = bytes.fromhex("fe80" + "00" * 12 + "0002"), bytes.fromhex("2001db8" + "0" * 24 + "1")
    body = (struct.pack("=BBBBI", 10, 64, 0, 0, 7) + _rta(wire.IFA_LOCAL, glob)
            + _rta(wire.IFA_ADDRESS, ll))
    (ev,) = parse_messages(_msg(wire.RTM_NEWADDR, body))
    assert ev.what == "addr" and not ev.link_local
    body = (struct.pack("=BBBBI", 10, 64, 0, 0, 7) + _rta(wire.IFA_LOCAL, ll)
            + _rta(wire.IFA_ADDRESS, glob))
    (ev,) = parse_messages(_msg(wire.RTM_NEWADDR, body))
    assert ev.link_local


def test_the_overlap_alarm_wakes_on_addresses_and_routes_and_reports_changes() -> None:
    from reconciler.agent.sources import OverlapAlarm
    from reconciler.domain.live import LiveAddress, LiveLink, LiveRoute
    from reconciler.drivers.netlink.parse import NetlinkEvent

    class Reader:
        routes: tuple[LiveRoute, ...] = ()

        def dump_links(self) -> dict[str, LiveLink]:
            br = LiveLink("br0", 5, "bridge", 1500, True, True, addresses=(
                LiveAddress(ipaddress.ip_interface("10.66.0.1/24"), True),))
            return {"br0": br, "tun0": LiveLink("tun0", 6, "", 1500, True, False)}

        def dump_host_routes(self) -> tuple[LiveRoute, ...]:
            return self.routes

        def close(self) -> None:
            pass

    reader = Reader()
    reports: list[Any] = []
    stop = threading.Event()
    alarm = OverlapAlarm(reports.append, stop, reader=lambda: reader, gap=0.0)
    assert alarm.check(reader) == []  # type: ignore[arg-type]
    reader.routes = (LiveRoute("10.66.0.0/25", None, False, oif=6),)
    found = alarm.check(reader)  # type: ignore[arg-type]
    assert [o.foreign for o in found] == ["route 10.66.0.0/25 on tun0"]
    alarm.start()
    try:
        wait = time.monotonic() + 5
        while not reports and time.monotonic() < wait:
            time.sleep(0.01)
        assert [o.foreign for o in reports[-1]] == ["route 10.66.0.0/25 on tun0"]
        assert not alarm.hear(NetlinkEvent("link", False, 7, name="veth9"))  # a new veth
        assert not alarm.hear(NetlinkEvent("route", False, 7, link_local=True))  # fe80::/64
        assert alarm.hear(NetlinkEvent("link", True, 6, name="tun0"))  # a link goes away
        reader.routes = ()
        assert alarm.hear(NetlinkEvent("route", True, 6))
        wait = time.monotonic() + 5
        while reports[-1] and time.monotonic() < wait:
            time.sleep(0.01)
        assert reports[-1] == []
    finally:
        stop.set()
        alarm.close()
