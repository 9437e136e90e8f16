"""Pure parts of the netns/links drivers, on rtnetlink messages captured from the kernel.

``fixtures/alloc.json`` holds raw dumps (hex, exactly as the kernel
sent them) of a host namespace with an owned bridge, an owned veth with
hairpin on whose peer sits in an allocation namespace, a foreign veth with
hairpin off, and of that allocation namespace. Regenerate it with
``fixtures/capture.py``. No test here touches the kernel.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import struct

import pytest

from reconciler.domain.errors import DriverError, TemporaryError
from reconciler.domain.live import LiveAddress, LiveLink, LiveRoute
from reconciler.domain.ownership import alloc_veth_name
from reconciler.drivers import netns
from reconciler.drivers.netlink import messages as nlmessages
from reconciler.drivers.netlink import parse as nlparse
from reconciler.drivers.netlink import transport as nltransport
from reconciler.drivers.netlink import wire

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "alloc.json")


@pytest.fixture(scope="module")
def dumps() -> dict[str, list[wire.NlMsg]]:
    with open(FIXTURE) as fh:
        raw = json.load(fh)
    return {k: [wire.NlMsg.decode(bytes.fromhex(h)) for h in v] for k, v in raw.items()}


def _by_name(dumps: dict[str, list[wire.NlMsg]], where: str) -> dict[str, LiveLink]:
    return {lk.name: lk for lk in nlparse.assemble_links(dumps[f"{where}_links"],
                                                       dumps[f"{where}_addrs"])}


def ip(text: str) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
    return ipaddress.ip_interface(text)


def test_owned_bridge(dumps: dict[str, list[wire.NlMsg]]) -> None:
    br = _by_name(dumps, "host")["br0"]
    assert (br.kind, br.mtu, br.up, br.owned, br.master, br.hairpin) == \
        ("bridge", 1400, True, True, None, None)
    assert br.alias == "managed-by=reconciler"
    assert set(br.addresses) == {
        LiveAddress(ip("10.9.0.1/24"), owned=True),
        LiveAddress(ip("fd00:9::1/64"), owned=True),
        LiveAddress(ip("10.99.0.1/24"), owned=False),  # no IFA_PROTO: someone else's
    }


def test_bridge_ports_and_hairpin(dumps: dict[str, list[wire.NlMsg]]) -> None:
    host = _by_name(dumps, "host")
    on = host["vrhairpinon"]
    assert (on.kind, on.master, on.hairpin, on.owned, on.up, on.mtu) == \
        ("veth", "br0", True, True, True, 1400)
    assert on.peer_netnsid == 0  # the peer lives in another namespace
    off = host["vrhairpinoff"]
    assert (off.master, off.hairpin, off.owned, off.peer_netnsid) == ("br0", False, False, None)
    # a link that is not a bridge port has no hairpin value at all
    assert host["peer1"].hairpin is None and host["peer1"].master is None
    assert host["lo"].kind == "" and host["lo"].up is False


def test_master_name_unknown_index_is_readable(dumps: dict[str, list[wire.NlMsg]]) -> None:
    msg = next(m for m in dumps["host_links"]
               if wire.cstr(m.attrs[wire.IFLA_IFNAME]) == "vrhairpinon")
    assert nlparse.parse_link(msg, {}).master == "if2"


def test_inside_allocation(dumps: dict[str, list[wire.NlMsg]]) -> None:
    inside = _by_name(dumps, "alloc")
    assert set(inside) == {"lo", "eth0"}
    eth0 = inside["eth0"]
    assert (eth0.kind, eth0.up, eth0.mtu, eth0.owned) == ("veth", True, 1400, True)
    # link-local fe80:: is dropped, global addresses kept with their marker
    assert eth0.addresses == (LiveAddress(ip("10.9.0.10/24"), owned=True),
                              LiveAddress(ip("fd00:9::10/64"), owned=True))
    assert inside["lo"].up
    assert LiveAddress(ip("127.0.0.1/8"), owned=False) in inside["lo"].addresses


def test_routes(dumps: dict[str, list[wire.NlMsg]]) -> None:
    routes = [r for r in map(nlparse.parse_route, dumps["alloc_routes"]) if r is not None]
    # eth0 is ifindex 2 inside the allocation: every route goes through it (RTA_OIF)
    assert LiveRoute("default", "10.9.0.1", owned=True, oif=2) in routes
    assert LiveRoute("default", "fd00:9::1", owned=True, oif=2) in routes
    assert LiveRoute("10.9.0.0/24", None, owned=False, oif=2) in routes  # proto kernel
    assert LiveRoute("192.0.2.0/24", "10.9.0.2", owned=False, oif=2) in routes  # proto boot
    assert {r.type for r in routes} == {"unicast"}


def test_route_without_a_device_and_its_type() -> None:
    """A blackhole route has no RTA_OIF: oif 0, and its type named as ip(8) names it."""
    body = wire.RTMSG.pack(2, 24, 0, 0, wire.RT_TABLE_MAIN, 4, 0, 6, 0)
    body += wire.attr(wire.RTA_DST, bytes([10, 8, 0, 0]))
    raw = wire.HDR.pack(wire.HDR.size + len(body), wire.RTM_NEWROUTE, 0, 0, 0) + body
    route = nlparse.parse_route(wire.NlMsg.decode(raw))
    assert route == LiveRoute("10.8.0.0/24", None, owned=False, oif=0, type="blackhole")


def test_route_outside_main_table_is_ignored(dumps: dict[str, list[wire.NlMsg]]) -> None:
    msg = dumps["alloc_routes"][0]
    header = list(msg.header)
    header[4] = 255  # local table
    local = wire.NlMsg(msg.type, msg.flags, tuple(header),
                        {k: v for k, v in msg.attrs.items() if k != wire.RTA_TABLE})
    assert nlparse.parse_route(local) is None


def test_addr_without_address_attribute_is_skipped() -> None:
    msg = wire.NlMsg(wire.RTM_NEWADDR, 0, (2, 24, 0, 0, 3), {})
    assert nlparse.parse_addr(msg) is None


def test_wire_roundtrip() -> None:
    body = nlmessages.ifinfo(index=7, flags=1, change=1) + wire.str_attr(wire.IFLA_IFNAME, "br0") \
        + wire.u32_attr(wire.IFLA_MTU, 1400) \
        + wire.nested(wire.IFLA_LINKINFO, wire.str_attr(wire.IFLA_INFO_KIND, "bridge"))
    raw = struct.pack("=IHHII", 16 + len(body), wire.RTM_NEWLINK, 0, 1, 0) + body
    (one,) = wire.split_messages(raw + b"")
    msg = wire.NlMsg.decode(one)
    assert msg.header[2] == 7
    assert wire.cstr(msg.attrs[wire.IFLA_IFNAME]) == "br0"
    link = nlparse.parse_link(msg, {})
    assert (link.name, link.mtu, link.kind, link.up) == ("br0", 1400, "bridge", True)


def test_ext_ack_message_is_extracted() -> None:
    text = b"Attribute failed policy validation\0"
    tlv = struct.pack("=HH", 4 + len(text), wire.NLMSGERR_ATTR_MSG) + text
    tlv += b"\0" * (-len(tlv) & 3)
    orig = struct.pack("=IHHII", 32, wire.RTM_NEWLINK, 5, 9, 0)
    err = struct.pack("=i", -errno.EINVAL) + orig + tlv
    raw = struct.pack("=IHHII", 16 + len(err), wire.NLMSG_ERROR,
                      wire.NLM_F_CAPPED | wire.NLM_F_ACK_TLVS, 9, 0) + err
    assert nltransport._ext_ack(raw, wire.NLM_F_CAPPED | wire.NLM_F_ACK_TLVS) == \
        "Attribute failed policy validation"


def test_error_mapping() -> None:
    busy = nltransport.netlink_error(errno.EBUSY, "link vr1: set")
    assert isinstance(busy, TemporaryError) and busy.errno == errno.EBUSY
    other = nltransport.netlink_error(errno.ENODEV, "link vr1: set", "no such link")
    assert type(other) is DriverError
    assert str(other) == "link vr1: set: No such device (no such link)"


def test_host_veth_name() -> None:
    name = alloc_veth_name("web-1")
    assert name == alloc_veth_name("web-1")
    assert name.startswith("vr") and len(name) == 14 <= 15
    assert name != alloc_veth_name("web-2")
    assert alloc_veth_name("x" * 300).isalnum()


def test_netns_names_are_checked() -> None:
    assert netns.path_of("web-1") == "/run/netns/web-1"
    assert netns.path_of("/proc/1/ns/net") == "/proc/1/ns/net"
    for bad in ("..", ".", "a b", "a;b", ""):
        with pytest.raises(DriverError):
            netns.path_of(bad)


MOUNTINFO_INIT = [("/", ["shared:1"]), ("/run", ["shared:2"]),
                  ("/run/netns", ["shared:3"])]
MOUNTINFO_IP_NETNS_EXEC = [("/", ["master:1"]), ("/run", ["master:2"]),
                           ("/run/netns", ["master:3"]), ("/sys", [])]


def test_covering_mount_and_peer_group() -> None:
    assert netns._covering_mount(MOUNTINFO_INIT, "/run/netns") == ["shared:3"]
    assert netns._covering_mount(MOUNTINFO_INIT[:2], "/run/netns") == ["shared:2"]
    assert netns._covering_mount([("/", []), ("/run/netnsx", ["shared:9"])],
                                 "/run/netns") == []
    assert netns._shared_group(["shared:3", "master:1"]) == "shared:3"
    assert netns._shared_group(netns._covering_mount(MOUNTINFO_IP_NETNS_EXEC,
                                                     "/run/netns")) is None


def test_the_namespace_compared_with_is_init_or_else_the_nearest_readable_ancestor() -> None:
    mine = 7
    # init readable: it decides, whatever the ancestors say
    assert netns.other_mount_namespace([("1", 7), ("40", 9)], mine) is None
    assert netns.other_mount_namespace([("1", 9), ("40", 7)], mine) == "1"
    # init unreadable (a sandbox's init, /proc/1/ns denied): the ancestors stand in for it
    assert netns.other_mount_namespace([("1", None), ("40", 7), ("30", None), ("20", 7)],
                                       mine) is None
    assert netns.other_mount_namespace([("1", None), ("40", 9), ("20", 7)], mine) == "40"
    assert netns.other_mount_namespace([("1", None), ("40", 7), ("20", 9)], mine) == "20"
    assert netns.other_mount_namespace([("1", None)], mine) is None


def test_a_private_root_mount_with_init_unreadable_is_not_a_private_namespace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose / is private (no systemd) and whose init we may not read: this process and
    its ancestors share one mount namespace, so namespaces created here are the host's."""
    inodes = {"self": 7, "1": None, "40": 7, "20": 7}
    parents = {"self": "40", "40": "20", "20": "1"}
    monkeypatch.setattr(netns, "_mount_ns_inode", lambda pid: inodes[pid])
    monkeypatch.setattr(netns, "_parent_pid", lambda pid: parents.get(pid))
    monkeypatch.setattr(netns, "_mountinfo", lambda pid: [("/", []), ("/run", [])])
    assert netns.private_mount_namespace_problem() is None
    inodes["40"] = 9  # our parent is elsewhere: `ip netns exec` gave us our own namespace
    assert "private mount namespace" in (netns.private_mount_namespace_problem() or "")


def test_the_tripwire_guards_every_netlink_client() -> None:
    """Unit tests cannot open a real rtnetlink socket, through the reader or the client."""
    from reconciler.drivers.netlink.client import Netlink
    from reconciler.drivers.netlink.read import NetlinkReader

    for cls in (NetlinkReader, Netlink):
        with pytest.raises(AssertionError, match="Must not be called"):
            cls()
