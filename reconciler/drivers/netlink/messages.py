"""Bodies of the rtnetlink requests the client sends (link info, addresses, dumps).

See docs/decisions/009-nothing-on-the-wire-undeclared.md.
"""

from __future__ import annotations

import os
import socket

from reconciler.domain.live import IPInterface
from reconciler.drivers.netlink.wire import (
    FIB_RULE_HDR,
    IFA_ADDRESS,
    IFA_F_NODAD,
    IFA_FLAGS,
    IFA_LOCAL,
    IFA_PROTO,
    IFADDR,
    IFF_UP,
    IFINFO,
    IFLA_AF_SPEC,
    IFLA_EXT_MASK,
    IFLA_INET6_ADDR_GEN_MODE,
    IFLA_INET_CONF,
    IN6_ADDR_GEN_MODE_NONE,
    IPV4_DEVCONF_ARP_NOTIFY,
    NDMSG,
    RT_TABLE_MAIN,
    RTEXT_FILTER_SKIP_STATS,
    RTMSG,
    attr,
    nested,
    u8_attr,
    u32_attr,
)


def ifinfo(index: int = 0, flags: int = 0, change: int = 0, family: int = 0) -> bytes:
    return IFINFO.pack(family, 0, index, flags, change)


def updown(up: bool | None) -> tuple[int, int]:
    if up is None:
        return 0, 0
    return (IFF_UP if up else 0), IFF_UP


LINK_DUMP = ifinfo() + u32_attr(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS)


ADDR_DUMP = IFADDR.pack(0, 0, 0, 0, 0)


ROUTE_DUMP = RTMSG.pack(0, 0, 0, 0, RT_TABLE_MAIN, 0, 0, 0, 0)


#: every table's routes (a strict dump filters by the header's table: 0 is none)
ROUTE_DUMP_ALL = RTMSG.pack(0, 0, 0, 0, 0, 0, 0, 0, 0)


#: every rule of both families (``ip rule`` and ``ip -6 rule``)
RULE_DUMP = FIB_RULE_HDR.pack(0, 0, 0, 0, 0, 0, 0, 0, 0)


NEIGH_DUMP = NDMSG.pack(0, 0, 0, 0, 0)  # both families, every link


def no_ipv6_ll() -> bytes:
    """Build the IFLA_AF_SPEC that gives this link no IPv6 link-local address (addrgenmode none).

    Empty when the kernel has no IPv6 (``ipv6.disable=1``): it would refuse the
    whole message for an AF_INET6 block (EAFNOSUPPORT), and there is no
    link-local address to avoid anyway.
    """
    if not os.path.isdir("/proc/sys/net/ipv6"):
        return b""
    return nested(IFLA_AF_SPEC, nested(socket.AF_INET6, u8_attr(IFLA_INET6_ADDR_GEN_MODE,
                                                              IN6_ADDR_GEN_MODE_NONE)))


def arp_notify_on() -> bytes:
    """Build the IFLA_AF_SPEC that turns ``arp_notify`` on for this link (its IPv4 devconf, no /proc
    write).

    The kernel applies IFLA_AF_SPEC after the flags of the message, so sent with
    the one that brings the link up it is off at NETDEV_UP and on from then on.
    """
    return nested(IFLA_AF_SPEC, nested(socket.AF_INET, nested(
        IFLA_INET_CONF, u32_attr(IPV4_DEVCONF_ARP_NOTIFY, 1))))


def addr_body(iface: IPInterface, index: int, proto: int | None, nodad: bool) -> bytes:
    family = socket.AF_INET if iface.version == 4 else socket.AF_INET6
    packed = iface.ip.packed
    flags = IFA_F_NODAD if (nodad and iface.version == 6) else 0
    body = IFADDR.pack(family, iface.network.prefixlen, flags, 0, index)
    body += attr(IFA_LOCAL, packed) + attr(IFA_ADDRESS, packed)
    if flags:
        body += u32_attr(IFA_FLAGS, flags)
    if proto is not None:
        body += u8_attr(IFA_PROTO, proto)
    return body

