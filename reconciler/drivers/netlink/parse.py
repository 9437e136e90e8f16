"""Pure parsers of rtnetlink messages.

Live links, addresses and routes (``parse_link``…), the few fields of a
notification that the drift filter needs (``parse_messages``), and of an
nf_tables notification (``parse_nft_notices``).

Unit-tested on captured kernel messages and hand-built bytes.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from reconciler.domain import ownership
from reconciler.domain.live import IPInterface, LiveAddress, LiveLink, LiveNeighbour, LiveRoute
from reconciler.drivers.netlink.wire import (
    FIB_RULE_HDR,
    FR_ACT_TO_TBL,
    FRA_TABLE,
    HDR,
    I32,
    IFA_ADDRESS,
    IFA_LOCAL,
    IFA_PROTO,
    IFADDR,
    IFF_UP,
    IFINFO,
    IFLA_ADDRESS,
    IFLA_BRPORT_MODE,
    IFLA_BRPORT_STATE,
    IFLA_IFALIAS,
    IFLA_IFNAME,
    IFLA_INFO_KIND,
    IFLA_INFO_SLAVE_DATA,
    IFLA_INFO_SLAVE_KIND,
    IFLA_LINK_NETNSID,
    IFLA_LINKINFO,
    IFLA_MASTER,
    IFLA_MTU,
    NDA_DST,
    NDA_LLADDR,
    NDA_PROTOCOL,
    NFGENMSG,
    NFNL_SUBSYS_NFTABLES,
    NFT_MSG_NEWGEN,
    NFTA_TABLE,
    NTF_EXT_LEARNED,
    NUD_NOARP,
    NUD_PERMANENT,
    RT_TABLE_MAIN,
    RTA_DST,
    RTA_GATEWAY,
    RTA_OIF,
    RTA_TABLE,
    RTM_DELADDR,
    RTM_DELLINK,
    RTM_DELROUTE,
    RTM_DELRULE,
    RTM_F_CLONED,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTM_NEWROUTE,
    RTM_NEWRULE,
    RTMSG,
    U32,
    NlMsg,
    cstr,
    parse_attrs,
    split_messages,
)


def mac_text(raw: bytes) -> str | None:
    """Write a link-layer address as ``aa:bb:..`` (lower case, as ``ip`` prints it); None if
    empty."""
    return raw.hex(":") if raw else None


def parse_link(msg: NlMsg, names_by_index: dict[int, str],
               addresses: tuple[LiveAddress, ...] = ()) -> LiveLink:
    """Parse a LiveLink from an RTM_NEWLINK message, with ``addresses`` attached.

    ``names_by_index`` resolves IFLA_MASTER to the bridge's name. Hairpin
    comes from the bridge-port attributes the kernel puts in
    IFLA_LINKINFO/IFLA_INFO_SLAVE_DATA of every bridge port.
    """
    _family, _type, index, flags, _change = msg.header
    a = msg.attrs
    alias = cstr(a[IFLA_IFALIAS]) if IFLA_IFALIAS in a else None
    kind = ""
    hairpin: bool | None = None
    info = a.get(IFLA_LINKINFO)
    if info is not None:
        li = parse_attrs(info)
        if IFLA_INFO_KIND in li:
            kind = cstr(li[IFLA_INFO_KIND])
        if IFLA_INFO_SLAVE_KIND in li and cstr(li[IFLA_INFO_SLAVE_KIND]) == "bridge":
            port = parse_attrs(li.get(IFLA_INFO_SLAVE_DATA, b""))
            if IFLA_BRPORT_MODE in port:
                hairpin = bool(port[IFLA_BRPORT_MODE][0])
    master = None
    if IFLA_MASTER in a:
        mindex = U32.unpack_from(a[IFLA_MASTER])[0]
        master = names_by_index.get(mindex, f"if{mindex}")
    peer_nsid = I32.unpack_from(a[IFLA_LINK_NETNSID])[0] if IFLA_LINK_NETNSID in a else None
    return LiveLink(
        name=cstr(a[IFLA_IFNAME]),
        index=index,
        kind=kind,
        mtu=U32.unpack_from(a[IFLA_MTU])[0] if IFLA_MTU in a else 0,
        up=bool(flags & IFF_UP),
        owned=ownership.is_owned_alias(alias),
        alias=alias,
        master=master,
        addresses=addresses,
        hairpin=hairpin,
        peer_netnsid=peer_nsid if peer_nsid is not None and peer_nsid >= 0 else None,
        mac=mac_text(a.get(IFLA_ADDRESS, b"")),
    )


def parse_addr(msg: NlMsg) -> tuple[int, LiveAddress] | None:
    """Parse (ifindex, LiveAddress) from an RTM_NEWADDR message; None for IPv6 link-local."""
    family, prefixlen, _flags, _scope, index = msg.header
    a = msg.attrs
    raw = a.get(IFA_LOCAL) or a.get(IFA_ADDRESS)
    if raw is None:
        return None
    iface: IPInterface
    if family == socket.AF_INET:
        iface = ipaddress.IPv4Interface((raw, prefixlen))
    elif family == socket.AF_INET6:
        iface = ipaddress.IPv6Interface((raw, prefixlen))
        if iface.ip.is_link_local:
            return None
    else:
        return None
    owned = IFA_PROTO in a and a[IFA_PROTO][0] == ownership.ADDR_PROTO
    return index, LiveAddress(address=iface, owned=owned)


#: rtm_type names (``ip route`` spells them the same)
ROUTE_TYPES = {1: "unicast", 2: "local", 3: "broadcast", 4: "anycast", 5: "multicast",
               6: "blackhole", 7: "unreachable", 8: "prohibit", 9: "throw", 10: "nat"}


def parse_route(msg: NlMsg, tables: Mapping[int, Container[int]] | None = None
                ) -> LiveRoute | None:
    """Parse a LiveRoute from an RTM_NEWROUTE message of the main table (or, with ``tables``, of
    the tables it names for the route's family); None for others.

    ``dst`` is ``"default"`` for a zero-length prefix of either family (the
    gateway's family tells them apart), else ``"prefix/len"``.
    """
    family, dst_len, _src_len, _tos, table, proto, _scope, rtype, rflags = msg.header
    a = msg.attrs
    if RTA_TABLE in a:
        table = U32.unpack_from(a[RTA_TABLE])[0]
    wanted = (RT_TABLE_MAIN,) if tables is None else tables.get(family, ())
    if table not in wanted or rflags & RTM_F_CLONED:
        return None
    if family not in (socket.AF_INET, socket.AF_INET6):
        return None
    if dst_len == 0:
        dst = "default"
    else:
        dst = f"{ipaddress.ip_address(a[RTA_DST])}/{dst_len}" if RTA_DST in a else "default"
    gw = str(ipaddress.ip_address(a[RTA_GATEWAY])) if RTA_GATEWAY in a else None
    oif = U32.unpack_from(a[RTA_OIF])[0] if len(a.get(RTA_OIF, b"")) >= 4 else 0
    return LiveRoute(dst=dst, gateway=gw, owned=proto == ownership.ROUTE_PROTO, oif=oif,
                     type=ROUTE_TYPES.get(rtype, f"type {rtype}"), table=table)


def parse_rule_table(msg: NlMsg) -> tuple[int, int] | None:
    """Return (family, table) of an RTM_NEWRULE message whose action is a lookup in a table (``ip
    rule ... lookup T``); None for the others (goto, nop, blackhole, unreachable, prohibit,
    and a VRF's ``l3mdev`` lookup, whose table is the device's, not the host's)."""
    family, _dst, _src, _tos, table, _r1, _r2, action, _flags = msg.header
    if action != FR_ACT_TO_TBL or family not in (socket.AF_INET, socket.AF_INET6):
        return None
    raw = msg.attrs.get(FRA_TABLE, b"")
    if len(raw) >= 4:
        table = U32.unpack_from(raw)[0]
    return (family, table) if table else None



def bridge_port_state(msg: NlMsg) -> int | None:
    """Read IFLA_BRPORT_STATE of a bridge port's RTM_NEWLINK (BR_STATE_*); None for others."""
    li = parse_attrs(msg.attrs.get(IFLA_LINKINFO, b""))
    if IFLA_INFO_SLAVE_KIND not in li or cstr(li[IFLA_INFO_SLAVE_KIND]) != "bridge":
        return None
    port = parse_attrs(li.get(IFLA_INFO_SLAVE_DATA, b""))
    return port[IFLA_BRPORT_STATE][0] if IFLA_BRPORT_STATE in port else None


#: NUD_* state bits in the words ``ip neigh`` prints (linux/neighbour.h)
NUD_WORDS = ((0x01, "INCOMPLETE"), (0x02, "REACHABLE"), (0x04, "STALE"), (0x08, "DELAY"),
             (0x10, "PROBE"), (0x20, "FAILED"), (NUD_NOARP, "NOARP"),
             (NUD_PERMANENT, "PERMANENT"))


def neigh_state(state: int) -> str:
    """Word a neighbour entry's state as ``ip neigh`` does: ``STALE``, ``REACHABLE,...``."""
    return ",".join(w for bit, w in NUD_WORDS if state & bit) or "NONE"


def parse_neigh_entry(msg: NlMsg) -> tuple[int, str, str | None, int] | None:
    """Parse (ifindex, IP address, MAC or None, NUD state) of any IPv4/IPv6 RTM_NEWNEIGH message
    (incomplete and failed entries included: the probes' diagnosis words them)."""
    family, index, state, _flags, _type = msg.header
    dst = msg.attrs.get(NDA_DST)
    if family not in (socket.AF_INET, socket.AF_INET6) or dst is None or len(dst) not in (4, 16):
        return None
    return index, str(ipaddress.ip_address(dst)), mac_text(msg.attrs.get(NDA_LLADDR) or b""), state


def parse_neigh(msg: NlMsg) -> LiveNeighbour | None:
    """Parse a LiveNeighbour from an RTM_NEWNEIGH message; None without an IP and a link-layer
    address (incomplete or failed entries, NOARP ones: nothing to be stale about)."""
    entry = parse_neigh_entry(msg)
    if entry is None:
        return None
    index, address, mac, state = entry
    if state & NUD_NOARP or mac is None:
        return None
    proto = msg.attrs.get(NDA_PROTOCOL) or b"\0"
    return LiveNeighbour(index, address, mac, bool(state & NUD_PERMANENT),
                         extern_learn=bool(msg.header[3] & NTF_EXT_LEARNED), protocol=proto[0])


def assemble_links(link_msgs: Iterable[NlMsg], addr_msgs: Iterable[NlMsg]) -> list[LiveLink]:
    """Attach their addresses to links, from one link dump and one address dump."""
    link_msgs = list(link_msgs)
    names: dict[int, str] = {}
    for m in link_msgs:
        if IFLA_IFNAME in m.attrs:
            names[m.header[2]] = cstr(m.attrs[IFLA_IFNAME])
    by_index: dict[int, list[LiveAddress]] = {}
    for m in addr_msgs:
        parsed = parse_addr(m)
        if parsed is not None:
            by_index.setdefault(parsed[0], []).append(parsed[1])
    return [parse_link(m, names, tuple(by_index.get(m.header[2], ()))) for m in link_msgs]


What = Literal["link", "addr", "route", "rule"]


@dataclass(frozen=True)
class NetlinkEvent:
    """The few fields of one rtnetlink notification that the relevance filter needs."""

    what: What
    deleted: bool
    index: int  # ifindex of the link (addr: ifa_index, route: RTA_OIF, 0 when absent)
    name: str | None = None  # links only
    alias: str | None = None  # links only
    master: int | None = None  # links only
    proto: int | None = None  # addr: IFA_PROTO; route: rtm_protocol
    #: addr: an IPv6 fe80::/10 address; route: to IPv6 fe80::/10 or multicast (kernel-made
    #: on every link, never ours, never in a declared prefix)
    link_local: bool = False


def _parse_one(kind: int, raw: bytes) -> NetlinkEvent | None:
    body = HDR.size
    if kind in (RTM_NEWLINK, RTM_DELLINK) and len(raw) - body >= IFINFO.size:
        _family, _type, index, _flags, _change = IFINFO.unpack_from(raw, body)
        attrs = parse_attrs(raw, body + IFINFO.size)
        name, alias = attrs.get(IFLA_IFNAME), attrs.get(IFLA_IFALIAS)
        master = attrs.get(IFLA_MASTER)
        return NetlinkEvent("link", kind == RTM_DELLINK, index,
                            name=None if name is None else cstr(name),
                            alias=None if alias is None else cstr(alias),
                            master=U32.unpack_from(master)[0] if master and len(master) >= 4
                            else None)
    if kind in (RTM_NEWADDR, RTM_DELADDR) and len(raw) - body >= IFADDR.size:
        family, _plen, _flags, _scope, index = IFADDR.unpack_from(raw, body)
        attrs = parse_attrs(raw, body + IFADDR.size)
        proto = attrs.get(IFA_PROTO)
        addr = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
        link_local = (family == socket.AF_INET6 and addr is not None and len(addr) == 16
                      and ipaddress.IPv6Address(addr).is_link_local)
        return NetlinkEvent("addr", kind == RTM_DELADDR, index,
                            proto=proto[0] if proto else None, link_local=link_local)
    if kind in (RTM_NEWROUTE, RTM_DELROUTE) and len(raw) - body >= RTMSG.size:
        rtm = RTMSG.unpack_from(raw, body)
        attrs = parse_attrs(raw, body + RTMSG.size)
        oif = attrs.get(RTA_OIF)
        dst = attrs.get(RTA_DST)
        link_local = (rtm[0] == socket.AF_INET6 and dst is not None and len(dst) == 16
                      and (ipaddress.IPv6Address(dst).is_link_local
                           or ipaddress.IPv6Address(dst).is_multicast))
        return NetlinkEvent("route", kind == RTM_DELROUTE,
                            U32.unpack_from(oif)[0] if oif and len(oif) >= 4 else 0,
                            proto=rtm[5], link_local=link_local)
    if kind in (RTM_NEWRULE, RTM_DELRULE) and len(raw) - body >= FIB_RULE_HDR.size:
        # which tables the host's routing selects: the address space's routes
        return NetlinkEvent("rule", kind == RTM_DELRULE, 0)
    return None


def parse_messages(data: bytes) -> list[NetlinkEvent]:
    """Parse one datagram of rtnetlink messages; unknown or malformed messages are skipped."""
    events: list[NetlinkEvent] = []
    for raw in split_messages(data):
        if len(raw) < HDR.size or HDR.unpack_from(raw)[0] > len(raw):
            break  # truncated: the kernel never sends one
        ev = _parse_one(HDR.unpack_from(raw)[1], raw)
        if ev is not None:
            events.append(ev)
    return events


@dataclass(frozen=True)
class NftNotice:
    """One nf_tables notification: an object of ``table`` changed, or a commit ended.

    The kernel sends a commit's object notifications first and one NFT_MSG_NEWGEN
    (``commit``, no table) after them, so a listener can tell which tables a
    transaction touched once it is complete.
    """

    family: int  # nfgen_family: socket.AF_INET, AF_INET6, 1 (inet), 7 (bridge)...; 0 on NEWGEN
    table: str | None
    commit: bool = False


def parse_nft_notices(data: bytes) -> list[NftNotice]:
    """Parse one datagram of nf_tables notifications; other subsystems and malformed
    messages are skipped."""
    out: list[NftNotice] = []
    body = HDR.size
    for raw in split_messages(data):
        length, kind = HDR.unpack_from(raw)[:2]
        if length > len(raw) or len(raw) < body + NFGENMSG.size:
            break  # truncated: the kernel never sends one
        if kind >> 8 != NFNL_SUBSYS_NFTABLES:
            continue
        family = NFGENMSG.unpack_from(raw, body)[0]
        if kind & 0xFF == NFT_MSG_NEWGEN:
            out.append(NftNotice(family, None, commit=True))
            continue
        table = parse_attrs(raw, body + NFGENMSG.size).get(NFTA_TABLE)
        out.append(NftNotice(family, None if table is None else cstr(table)))
    return out
