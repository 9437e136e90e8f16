"""Subscriptions: rtnetlink multicast groups and nf_tables (its notifications, its generation).

rtnetlink groups of this namespace, optionally of every namespace with an
nsid here (``NETLINK_LISTEN_ALL_NSID``); the nf_tables notification group of
this namespace (every commit: iptables-nft, nft, firewalld), and the ruleset
generation id asked on demand.

The one module that opens and reads notification sockets; the watch loop's
drift sources and the plan view's sentinels both use it.
"""

from __future__ import annotations

import errno
import socket
import struct

from reconciler.drivers.netlink.parse import NetlinkEvent, parse_messages
from reconciler.drivers.netlink.wire import (
    HDR,
    IFINFO,
    NETLINK_NETFILTER,
    NETLINK_ROUTE,
    NFGENMSG,
    NFNL_SUBSYS_NFTABLES,
    NFT_MSG_GETGEN,
    NFT_MSG_NEWGEN,
    NFTA_GEN_ID,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    RTM_GETLINK,
    parse_attrs,
    split_messages,
)

RTMGRP_LINK = 0x1


RTMGRP_IPV4_IFADDR = 0x10


RTMGRP_IPV4_ROUTE = 0x40


RTMGRP_IPV6_IFADDR = 0x100


RTMGRP_IPV6_ROUTE = 0x400


#: ``ip rule`` changes (RTNLGRP_IPV4_RULE 8, RTNLGRP_IPV6_RULE 19): which tables' routes are
#: the host's in the address space
RTMGRP_IPV4_RULE = 0x80


RTMGRP_IPV6_RULE = 1 << 18


GROUPS = (RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR | RTMGRP_IPV4_ROUTE
          | RTMGRP_IPV6_ROUTE | RTMGRP_IPV4_RULE | RTMGRP_IPV6_RULE)


RECV_BUFFER = 1 << 20


SOCKET_RCVBUF = 4 << 20


def open_socket(groups: int, rcvbuf: int = SOCKET_RCVBUF) -> socket.socket:
    """Open an rtnetlink socket subscribed to ``groups`` (a bitmask of RTMGRP_*)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                         NETLINK_ROUTE)
    try:
        try:  # root may exceed rmem_max: a burst of events must not overflow the queue
            sock.setsockopt(socket.SOL_SOCKET, 33, rcvbuf)  # SO_RCVBUFFORCE
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.bind((0, groups))
    except BaseException:
        sock.close()
        raise
    return sock


def dump_links() -> list[NetlinkEvent]:
    """Dump all links of the current namespace, as link events (seeds the filter)."""
    with open_socket(0) as sock:
        body = IFINFO.pack(0, 0, 0, 0, 0)
        sock.sendto(HDR.pack(HDR.size + len(body), RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
                    + body, (0, 0))
        sock.settimeout(5.0)
        out: list[NetlinkEvent] = []
        while True:
            data = sock.recv(RECV_BUFFER)
            if any(HDR.unpack_from(raw)[1] in (NLMSG_DONE, NLMSG_ERROR)
                   for raw in split_messages(data)):
                out.extend(parse_messages(data))
                return out
            out.extend(parse_messages(data))


NETLINK_LISTEN_ALL_NSID = 8



RTNLGRP_NSID = 28


#: the drift watcher's link, address and route groups, and nsid changes
ALL_GROUPS = GROUPS | (1 << (RTNLGRP_NSID - 1))


#: nfnetlink's multicast group of nf_tables notifications (bit NFNLGRP_NFTABLES - 1 of bind)
NFNLGRP_NFTABLES = 7


def open_nft_socket(timeout: float = 5.0) -> socket.socket:
    """Open a netfilter netlink socket for asking the nf_tables generation
    (:func:`nft_generation`)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                         NETLINK_NETFILTER)
    try:
        sock.settimeout(timeout)
        sock.bind((0, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def open_nft_events(rcvbuf: int = SOCKET_RCVBUF) -> socket.socket:
    """Open a netfilter netlink socket subscribed to this namespace's nf_tables notifications.

    Parse what it reads with ``parse.parse_nft_notices``. An ``ENOBUFS`` from it
    means notifications were dropped: anything may have been committed.
    """
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                         NETLINK_NETFILTER)
    try:
        try:  # a firewall reload is thousands of notifications: they must fit
            sock.setsockopt(socket.SOL_SOCKET, 33, rcvbuf)  # SO_RCVBUFFORCE
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.bind((0, 1 << (NFNLGRP_NFTABLES - 1)))
    except BaseException:
        sock.close()
        raise
    return sock


def nft_generation(sock: socket.socket, seq: int) -> int:
    """Return the nf_tables ruleset generation of this namespace (NFT_MSG_GETGEN)."""
    body = NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)
    sock.send(HDR.pack(16 + len(body), (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
                          NLM_F_REQUEST, seq, 0) + body)
    while True:
        for raw in split_messages(sock.recv(1 << 16)):
            _len, kind, _flags, mseq, _pid = HDR.unpack_from(raw)
            if mseq != seq:
                continue
            if kind == NLMSG_ERROR:
                raise OSError(-struct.unpack_from("=i", raw, 16)[0], "nf_tables generation")
            if kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN:
                gen = parse_attrs(raw, 20).get(NFTA_GEN_ID)  # after nlmsghdr + nfgenmsg
                if gen is None or len(gen) < 4:
                    raise OSError(errno.EPROTO, "nf_tables generation: no id")
                return int(struct.unpack_from("!I", gen)[0])

