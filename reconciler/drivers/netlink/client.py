"""Changes over rtnetlink: links, addresses, routes, allocation namespaces and their veths.

Why not pyroute2's ``IPRoute`` here: measured on this machine, its decoder
needs ~0.35 ms per link message and ~0.2 ms of overhead per request, so
observing 1000 allocation namespaces would take seconds and building 500
allocations would spend most of its time in Python. This module speaks the
few rtnetlink messages it needs directly (a raw ``AF_NETLINK`` socket, the
kernel's wire format, extended ACKs) and decodes only the attributes we use;
a dump of a small namespace costs tens of microseconds.

The package's layers: ``wire`` (the codec), ``parse`` (pure parsers,
unit-tested on captured kernel messages), ``transport`` (one socket),
``messages`` (request bodies), ``read`` (``NetlinkReader``: sockets here and
inside allocation namespaces, dumps), this module (``Netlink``: the changes)
and ``listen`` (subscriptions). Not thread-safe: one instance per thread.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from reconciler.domain import ownership
from reconciler.domain.errors import ConflictError, DriverError
from reconciler.domain.live import IPInterface
from reconciler.drivers import netns
from reconciler.drivers.netlink.announce import enable_ndisc_notify
from reconciler.drivers.netlink.messages import (
    addr_body,
    arp_notify_on,
    ifinfo,
    no_ipv6_ll,
    updown,
)
from reconciler.drivers.netlink.parse import bridge_port_state, parse_link
from reconciler.drivers.netlink.read import NetlinkReader
from reconciler.drivers.netlink.transport import Socket
from reconciler.drivers.netlink.wire import (
    AF_BRIDGE,
    BR_STATE_FORWARDING,
    I32,
    IFA_ADDRESS,
    IFA_LOCAL,
    IFF_UP,
    IFLA_ADDRESS,
    IFLA_BRPORT_MODE,
    IFLA_EXT_MASK,
    IFLA_IFALIAS,
    IFLA_IFNAME,
    IFLA_INFO_DATA,
    IFLA_INFO_KIND,
    IFLA_INFO_SLAVE_DATA,
    IFLA_INFO_SLAVE_KIND,
    IFLA_LINK,
    IFLA_LINK_NETNSID,
    IFLA_LINKINFO,
    IFLA_MASTER,
    IFLA_MTU,
    IFLA_NET_NS_FD,
    NDA_DST,
    NDA_LLADDR,
    NDA_PROTOCOL,
    NDMSG,
    NLM_F_CREATE,
    NLM_F_ECHO,
    NLM_F_EXCL,
    NLM_F_REPLACE,
    NTF_EXT_LEARNED,
    NTF_MASTER,
    NUD_REACHABLE,
    NUD_STALE,
    RT_SCOPE_UNIVERSE,
    RT_TABLE_MAIN,
    RTA_GATEWAY,
    RTA_OIF,
    RTEXT_FILTER_SKIP_STATS,
    RTM_DELADDR,
    RTM_DELLINK,
    RTM_DELNEIGH,
    RTM_DELROUTE,
    RTM_GETLINK,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTM_NEWNEIGH,
    RTM_NEWROUTE,
    RTMSG,
    RTN_UNICAST,
    U32,
    VETH_INFO_PEER,
    NlMsg,
    attr,
    nested,
    str_attr,
    u8_attr,
    u32_attr,
)

log = logging.getLogger("reconciler")

def _mac_bytes(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))


def _our_neighbour(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, index: int,
                   mac: bytes) -> bytes:
    """The body of a neighbour entry we make: STALE, exempt from the kernel's GC and
    marked ours (NTF_EXT_LEARNED, NDA_PROTOCOL: see ``wire.NTF_EXT_LEARNED``)."""
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    return (NDMSG.pack(family, index, NUD_STALE, NTF_EXT_LEARNED, 0) + attr(NDA_DST, ip.packed)
            + attr(NDA_LLADDR, mac) + u8_attr(NDA_PROTOCOL, ownership.NEIGH_PROTO))


@dataclass(frozen=True)
class _FreshPeer:
    """What the kernel's echo of a veth creation told about the peer it put in a namespace."""

    inode: int  # the namespace it went into
    ifname: str
    index: int  # its ifindex there (IFLA_LINK of the host end)
    nsid: int | None  # that namespace's nsid here (IFLA_LINK_NETNSID of the host end)
    host_index: int  # the host end's ifindex (a port of the bridge)
    mac: str | None  # the MAC it was created with; None: the kernel's (unknown here)
    bridge_index: int = 0  # the bridge the host end was put on


class Netlink(NetlinkReader):
    """rtnetlink reads (:class:`NetlinkReader`) and the changes: links, addresses, routes,
    allocation namespaces and the veths into them. Idempotent where the kernel allows.

    It keeps what its own changes told it (each bridge's index, the peer a veth creation
    put into a namespace), so building an allocation asks nothing it has the answer to.
    """

    def __init__(self) -> None:
        super().__init__()
        # answers we already have, so no request asks for them again: the index of each
        # bridge veths were put on, and the peer of a veth just created (until configured)
        self._bridge_index: dict[str, int] = {}
        self._fresh: dict[str, _FreshPeer] = {}
        #: each bridge's MAC by index, for the neighbour entries of new allocations: read
        #: once per pass (``new_pass``; someone may set a bridge's MAC between passes of the
        #: agent) and forgotten at our own set_mac
        self._bridge_mac: dict[int, str | None] = {}

    def new_pass(self) -> None:
        """A new plan is executed: what was read of the bridges may be stale now."""
        self._bridge_mac.clear()

    def forget_netns(self, name: str) -> None:
        """Close the cached socket into ``name`` and forget the peer just put there."""
        self._fresh.pop(name, None)
        super().forget_netns(name)

    def ensure_bridge(self, name: str, mtu: int | None = None,
                      alias: str | None = ownership.LINK_ALIAS, mac: str | None = None) -> bool:
        """Create bridge ``name`` (up, with MTU, ownership alias and MAC). False if it existed.

        A MAC given at creation is set (addr_assign_type NET_ADDR_SET): the
        bridge keeps it whatever ports come and go, where otherwise it takes
        its lowest port's and 00:00:00:00:00:00 with none.

        An existing bridge is left as is (use :meth:`set_link` to converge it);
        an existing link of another kind raises ConflictError.

        The kernel ignores IFLA_IFALIAS when creating a link, so the bridge is
        made under a temporary name, marked, then renamed: a crash never leaves
        an unmarked bridge under the wanted name (it would look foreign), only
        a temporary one that the next run prunes. Until the alias is set, the
        temporary bridge's mark is its MAC (``ownership.temp_bridge_mac`` of its
        name, in the creation message); the message that sets the alias also sets
        the MAC it keeps (``mac``, else ``bridge_mac(name)``): a leftover
        ``rcltmp`` bridge without either mark is someone else's.

        IPv6 address generation is turned off before the bridge is first up (the
        kernel refuses IFLA_AF_SPEC at creation): an empty bridge has carrier, so
        it would make a link-local address at once and send DAD, MLD and router
        solicitations to every port. A subnet with IPv6 turns it back on when it
        adds its gateway (``engine.hostops.HostOps``, ``AddrAdd``).
        """
        tmp = name if alias is None else ownership.TEMP_BRIDGE_PREFIX + secrets.token_hex(4)
        body = ifinfo() + str_attr(IFLA_IFNAME, tmp)
        first_mac = mac if alias is None else ownership.temp_bridge_mac(tmp)
        if first_mac is not None:
            body += attr(IFLA_ADDRESS, _mac_bytes(first_mac))
        body += nested(IFLA_LINKINFO, str_attr(IFLA_INFO_KIND, "bridge"))
        try:
            self._host.request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body,
                               f"bridge {name}: create")
            if alias is not None:
                index = self._index(tmp, None)
                final_mac = mac if mac is not None else ownership.bridge_mac(name)
                self._host.request(RTM_NEWLINK, 0, ifinfo(index=index)
                                   + attr(IFLA_IFALIAS, alias.encode())
                                   + attr(IFLA_ADDRESS, _mac_bytes(final_mac)) + no_ipv6_ll(),
                                   f"bridge {name}: mark")
                try:
                    self._host.request(RTM_NEWLINK, 0, ifinfo(index=index)
                                       + str_attr(IFLA_IFNAME, name), f"bridge {name}: rename")
                except DriverError:
                    self.delete_link(tmp)
                    raise
        except DriverError as e:
            if e.errno != errno.EEXIST:
                raise
            existing = self.get_link(name)
            if existing is not None and existing.kind != "bridge":
                raise ConflictError(f"bridge {name}: a link of kind "
                                    f"{existing.kind or 'physical'!r} has that name") from None
            return False
        self._bridge_index.pop(name, None)
        if mtu is not None:
            # The MTU is set after creation, not given in it (IFLA_MTU): only a change
            # marks a bridge's MTU as set by the user (br_change_mtu); one that is not
            # follows its ports and falls back to 1500 when the last one leaves
            # (br_mtu_auto_adjust), so the declared MTU was lost with the last allocation.
            self.set_link(name, mtu=mtu)
        if alias is None and (no_ll := no_ipv6_ll()):
            self._host.request(RTM_NEWLINK, 0, ifinfo() + str_attr(IFLA_IFNAME, name) + no_ll,
                               f"bridge {name}: no IPv6 link-local address")
        self.set_link(name, up=True)
        return True

    def set_link(self, name: str, *, mtu: int | None = None, up: bool | None = None,
                 alias: str | None = None, master: str | None = None,
                 ns: str | None = None) -> None:
        """Change MTU / admin state / alias / master of an existing link (here or in ``ns``).

        ``alias=""`` removes the alias; ``master=""`` detaches from a bridge.
        """
        flags, change = updown(up)
        body = ifinfo(flags=flags, change=change) + str_attr(IFLA_IFNAME, name)
        if mtu is not None:
            body += u32_attr(IFLA_MTU, mtu)
        if alias is not None:
            body += attr(IFLA_IFALIAS, alias.encode())
        if master is not None:
            body += u32_attr(IFLA_MASTER, self._index(master, ns) if master else 0)
        where = f" in namespace {ns}" if ns else ""
        self._sock(ns).request(RTM_NEWLINK, 0, body, f"link {name}{where}: set")

    def set_mac(self, name: str, mac: str) -> None:
        """Set a link's MAC. Set to the one it has, it still counts as set (dev_set_mac_address
        marks NET_ADDR_SET either way): how an existing bridge is pinned without a change."""
        self._bridge_mac.clear()
        self._host.request(RTM_NEWLINK, 0, ifinfo() + str_attr(IFLA_IFNAME, name)
                           + attr(IFLA_ADDRESS, _mac_bytes(mac)), f"link {name}: set MAC {mac}")

    def replace_neighbour(self, link: str, ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
                          mac: str) -> None:
        """Point the neighbour entry of ``ip`` on ``link`` (here) at ``mac``, created or
        replaced in state STALE: usable at once, and confirmed by the kernel's own probe
        (delay_first_probe_time) the first time it is used, so a wrong guess lives seconds,
        not a REACHABLE entry's reachable_time."""
        index = self._bridge_index.get(link)
        if index is None:
            index = self._index(link, None)
        self._host.request(RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_REPLACE,
                           _our_neighbour(ip, index, _mac_bytes(mac)),
                           f"neighbour {ip} on {link}: replace")

    def delete_neighbour(self, link: str,
                         ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        """Delete the neighbour entry of ``ip`` on ``link`` (here). False if it was not
        there (or ``link`` is gone, and its entries with it)."""
        index = self._bridge_index.get(link)
        try:
            if index is None:
                index = self._index(link, None)
            family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
            self._host.request(RTM_DELNEIGH, 0, NDMSG.pack(family, index, 0, 0, 0)
                               + attr(NDA_DST, ip.packed), f"neighbour {ip} on {link}: delete")
        except DriverError as e:
            if e.errno in (errno.ENOENT, errno.ENODEV):
                return False
            raise
        return True

    def delete_link(self, name: str, ns: str | None = None) -> bool:
        """Delete a link (a veth takes its peer with it). False if it did not exist.

        Deleting a veth is synchronous and slow (~tens of ms, RCU); deleting an
        allocation's namespace removes its veth much faster.
        """
        if ns is None:
            self._bridge_index.pop(name, None)
        try:
            self._sock(ns).request(RTM_DELLINK, 0, ifinfo() + str_attr(IFLA_IFNAME, name),
                                   f"link {name}: delete")
        except DriverError as e:
            if e.errno == errno.ENODEV:
                return False
            raise
        return True

    def set_hairpin(self, name: str, on: bool) -> None:
        """Set the bridge port's hairpin mode (IFLA_BRPORT_MODE in the port's slave data).

        By name in one RTM_NEWLINK, as :meth:`create_veth_into_netns` does; the
        AF_BRIDGE RTM_SETLINK (IFLA_PROTINFO) would need the ifindex: a lookup first.
        """
        body = ifinfo() + str_attr(IFLA_IFNAME, name) + nested(
            IFLA_LINKINFO, str_attr(IFLA_INFO_SLAVE_KIND, "bridge"),
            nested(IFLA_INFO_SLAVE_DATA, u8_attr(IFLA_BRPORT_MODE, 1 if on else 0)))
        self._host.request(RTM_NEWLINK, 0, body, f"link {name}: set hairpin")

    def create_veth_into_netns(self, host_name: str, netns_name: str, bridge: str,
                               mtu: int | None = None, hairpin: bool = True,
                               peer_name: str = "eth0",
                               alias: str | None = ownership.LINK_ALIAS,
                               mac: str | None = None) -> bool:
        """Create a veth pair, the peer directly inside ``netns_name``, host end on ``bridge``.

        Two messages: RTM_NEWLINK creates both ends (peer placed by
        IFLA_NET_NS_FD, host end enslaved, both down), then one RTM_NEWLINK on
        the host end sets the ownership alias, hairpin (bridge-port slave
        data), IPv6 address generation off (a bridge port needs no link-local
        address, and its DAD/RS/MLD multicast would be flooded to every other
        port) and brings it up. That is safe in one message although the kernel
        applies IFLA_AF_SPEC after the flags: the peer is still down, so the host
        end has no carrier and IPv6 makes no address on it yet. An existing veth
        (whose peer may be up) gets address generation off in a message of its own
        first. The peer stays down until :meth:`configure_inside`. ``mac`` is the
        peer's MAC, given in the creation itself (IFLA_ADDRESS of the peer's ifinfo);
        an existing pair keeps the one it has.

        The creation asks for the kernel's echo (NLM_F_ECHO): it gives the peer's
        ifindex inside the namespace and the namespace's nsid here, which
        :meth:`configure_inside` and observation would otherwise ask for (the
        bridge's index is remembered the same way). Kernels without the echo
        (before 6.3) simply answer nothing and those are looked up as before.

        Returns False when ``host_name`` already exists with its peer in that
        namespace (then master, MTU, alias, hairpin and up are re-applied).
        Raises DriverError when the namespace already has ``peer_name`` (EDGE
        9) or the host veth's peer is elsewhere (orphan, EDGE 8), and
        ConflictError when the host name is taken by another kind of link.
        """
        cached = self._bridge_index.get(bridge)
        bridge_index = cached if cached is not None else self._index(bridge, None)
        self._fresh.pop(netns_name, None)
        fd = netns.open_fd(netns_name)
        try:
            inode = os.fstat(fd).st_ino
            try:
                replies = self._create_veth(host_name, netns_name, fd, peer_name,
                                            bridge_index, mtu, mac)
            except DriverError as e:
                if cached is None or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                # IFLA_MASTER named no bridge (do_set_master): the bridge was re-created
                # since we learnt its index, ask once more
                del self._bridge_index[bridge]
                bridge_index = self._index(bridge, None)
                replies = self._create_veth(host_name, netns_name, fd, peer_name,
                                            bridge_index, mtu, mac)
            created = True
        except DriverError as e:
            if e.errno != errno.EEXIST:
                raise
            created = False
            replies = []
            self._check_existing_veth(host_name, netns_name, peer_name)
            if cached is not None:  # re-applied below as master: no stale index
                bridge_index = self._index(bridge, None)
        finally:
            os.close(fd)
        self._bridge_index[bridge] = bridge_index
        for raw in replies:  # the echo of the host end: IFLA_LINK is the peer's index there
            echo = NlMsg.decode(raw)
            a = echo.attrs
            if IFLA_LINK in a:
                nsid = I32.unpack_from(a[IFLA_LINK_NETNSID])[0] \
                    if IFLA_LINK_NETNSID in a else -1
                self._fresh[netns_name] = _FreshPeer(inode, peer_name,
                                                     U32.unpack_from(a[IFLA_LINK])[0],
                                                     nsid if nsid >= 0 else None,
                                                     echo.header[2], mac, bridge_index)
        # The kernel ignores IFLA_IFALIAS at creation, and bridge-port attributes
        # exist only once the port does: one more message for all of it.
        body = ifinfo(flags=IFF_UP, change=IFF_UP) + str_attr(IFLA_IFNAME, host_name)
        if not created:
            if no_ll := no_ipv6_ll():
                self._host.request(RTM_NEWLINK, 0, ifinfo() + str_attr(IFLA_IFNAME, host_name)
                                   + no_ll, f"veth {host_name}: no IPv6 link-local address")
            body += u32_attr(IFLA_MASTER, bridge_index)
            if mtu is not None:
                body += u32_attr(IFLA_MTU, mtu)
        if alias is not None:
            body += attr(IFLA_IFALIAS, alias.encode())
        if created:
            body += no_ipv6_ll()
        body += nested(IFLA_LINKINFO, str_attr(IFLA_INFO_SLAVE_KIND, "bridge"),
                       nested(IFLA_INFO_SLAVE_DATA,
                              u8_attr(IFLA_BRPORT_MODE, 1 if hairpin else 0)))
        self._host.request(RTM_NEWLINK, 0, body, f"veth {host_name}: set up")
        return created

    def _create_veth(self, host_name: str, netns_name: str, fd: int, peer_name: str,
                     bridge_index: int, mtu: int | None, mac: str | None) -> list[bytes]:
        # The peer cannot be brought up here: veth_open() fails with ENOTCONN
        # until the pair is complete. configure_inside() brings it up.
        peer = ifinfo() + str_attr(IFLA_IFNAME, peer_name) + u32_attr(IFLA_NET_NS_FD, fd)
        host = (ifinfo() + str_attr(IFLA_IFNAME, host_name)
                + u32_attr(IFLA_MASTER, bridge_index))
        if mtu is not None:
            peer += u32_attr(IFLA_MTU, mtu)
            host += u32_attr(IFLA_MTU, mtu)
        if mac is not None:
            peer += attr(IFLA_ADDRESS, _mac_bytes(mac))
        host += nested(IFLA_LINKINFO, str_attr(IFLA_INFO_KIND, "veth"),
                       nested(IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer)))
        return self._host.request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL | NLM_F_ECHO, host,
                                  f"veth {host_name} into {netns_name}: create")

    def _check_existing_veth(self, host_name: str, netns_name: str, peer_name: str) -> None:
        existing = self.get_link(host_name)
        if existing is None:
            raise DriverError(f"veth {host_name} into {netns_name}: namespace already has "
                              f"a link named {peer_name}")
        if existing.kind != "veth":
            raise ConflictError(f"veth {host_name}: a link of kind "
                                f"{existing.kind or 'physical'!r} has that name")
        nsid = self.get_nsid(netns_name)
        if existing.peer_netnsid is None or existing.peer_netnsid != nsid:
            raise DriverError(f"veth {host_name}: exists but its peer is not in network "
                              f"namespace {netns_name} (orphan veth; delete it first)")

    def add_address(self, link: str, iface: IPInterface, *,
                    proto: int | None = ownership.ADDR_PROTO, ns: str | None = None,
                    nodad: bool = True) -> bool:
        """Add an address (with our IFA_PROTO marker). False if it was already there.

        IPv6 addresses skip DAD by default (IPAM guarantees uniqueness; a
        tentative address cannot be used for a while after creation).
        """
        index = self._index(link, ns)
        where = f" in namespace {ns}" if ns else ""
        try:
            self._sock(ns).request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL,
                                   addr_body(iface, index, proto, nodad),
                                   f"address {iface} on {link}{where}: add")
        except DriverError as e:
            if e.errno == errno.EEXIST:
                return False
            raise
        return True

    def del_address(self, link: str, iface: IPInterface, *, ns: str | None = None) -> bool:
        """Remove an address. False if it (or the link) was already gone."""
        index = self.link_index(link, ns)
        if index is None:
            return False
        where = f" in namespace {ns}" if ns else ""
        try:
            self._sock(ns).request(RTM_DELADDR, 0, addr_body(iface, index, None, False),
                                   f"address {iface} on {link}{where}: delete")
        except DriverError as e:
            if e.errno in (errno.EADDRNOTAVAIL, errno.ENODEV, errno.ENOENT):
                return False
            raise
        return True

    def del_link_local_addresses(self, link: str) -> int:
        """Remove the IPv6 link-local addresses of host link ``link`` (the kernel made
        them when its address generation was on; setting that back to none leaves them).
        How many went."""
        index = self.link_index(link, None)
        if index is None:
            return 0
        gone = 0
        for msg in self.addr_messages():
            family, prefixlen, _flags, _scope, msg_index = msg.header
            raw = msg.attrs.get(IFA_LOCAL) or msg.attrs.get(IFA_ADDRESS)
            if family != socket.AF_INET6 or msg_index != index or raw is None:
                continue
            iface = ipaddress.IPv6Interface((raw, prefixlen))
            if iface.ip.is_link_local and self.del_address(link, iface):
                gone += 1
        return gone

    def _route_body(self, gateway: ipaddress.IPv4Address | ipaddress.IPv6Address,
                    oif: int, proto: int) -> bytes:
        family = socket.AF_INET if gateway.version == 4 else socket.AF_INET6
        return (RTMSG.pack(family, 0, 0, 0, RT_TABLE_MAIN, proto, RT_SCOPE_UNIVERSE,
                            RTN_UNICAST, 0)
                + attr(RTA_GATEWAY, gateway.packed) + u32_attr(RTA_OIF, oif))

    def replace_default_route(self, ifname: str,
                              gateway: ipaddress.IPv4Address | ipaddress.IPv6Address, *,
                              ns: str | None = None, proto: int = ownership.ROUTE_PROTO,
                              index: int | None = None) -> None:
        """Create or replace the default route of the gateway's family (idempotent)."""
        oif = index if index is not None else self._index(ifname, ns)
        where = f" in namespace {ns}" if ns else ""
        self._sock(ns).request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE,
                               self._route_body(gateway, oif, proto),
                               f"default route via {gateway}{where}: replace")

    def del_default_route(self, version: int, *, ns: str | None = None) -> bool:
        """Remove the default route of one IP version. False if there was none."""
        family = socket.AF_INET if version == 4 else socket.AF_INET6
        # our protocol only: never a default route someone else put there
        body = RTMSG.pack(family, 0, 0, 0, RT_TABLE_MAIN, ownership.ROUTE_PROTO,
                           RT_SCOPE_UNIVERSE, 0, 0)
        where = f" in namespace {ns}" if ns else ""
        try:
            self._sock(ns).request(RTM_DELROUTE, 0, body,
                                   f"default IPv{version} route{where}: delete")
        except DriverError as e:
            if e.errno == errno.ESRCH:
                return False
            raise
        return True

    def create_netns(self, name: str, *, replace_stale: bool = False,
                     mark: str | None = None) -> bool:
        """``ip netns add`` in-process (see :func:`netns.create`).

        With ``mark``, ``lo`` inside is brought up and given that alias before the
        namespace is mounted, so an allocation namespace is never visible unmarked;
        the socket that did it is kept as the cached one into the namespace (no
        second socket for :meth:`configure_inside`).
        """
        if replace_stale:
            self.forget_netns(name)
        kept: list[Socket] = []

        def init() -> None:
            sock = Socket()
            try:
                sock.request(RTM_NEWLINK, 0,
                             ifinfo(index=1, flags=IFF_UP, change=IFF_UP)
                             + attr(IFLA_IFALIAS, (mark or "").encode()),
                             f"link lo in namespace {name}: mark")
            except BaseException:
                sock.close()
                raise
            kept.append(sock)

        try:
            created = netns.create(name, replace_stale=replace_stale,
                                   init=init if mark is not None else None, file_mark=mark)
            if kept:
                self._keep_socket(name, kept[0], lo_mark=mark)
                kept.clear()
        finally:
            for sock in kept:
                sock.close()
        if not created and mark is not None and self.peek_lo_alias(name) != mark:
            # someone made a namespace of that name since we looked: not ours to fill
            raise ConflictError(f"network namespace {name}: appeared meanwhile and was not "
                                "created by the reconciler; it is left alone")
        return created

    def delete_netns(self, name: str) -> bool:
        """Drop our cached socket into ``name``, then ``ip netns del`` it."""
        self.forget_netns(name)
        return netns.delete(name)

    def configure_inside(self, netns_name: str, addrs: Sequence[IPInterface],
                         gateways: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address],
                         *, ifname: str = "eth0", mtu: int | None = None,
                         ipv6_link_local: bool = False, mark: str | None = None,
                         announce: bool = False) -> None:
        """Inside an allocation namespace: ``lo`` up, ``ifname`` up (MTU, ownership alias),
        owned addresses, default route(s) via the gateway(s) with our route proto.
        Idempotent.

        IPv6 address generation on ``ifname`` is off (unless ``ipv6_link_local``),
        set in a message of its own *before* the one that brings it up: the kernel
        applies IFLA_AF_SPEC after the flags of a message, and the host end is
        up, so in one message the link gets carrier, makes its link-local address
        and starts DAD, MLD reports and router solicitations that the bridge
        floods to every allocation (measured: nearly every allocation had one,
        and apply cost per allocation doubled from 250 to 2000). Nothing needs
        it: neighbour discovery and the default route use the declared global
        address and gateway.

        The index of ``ifname`` comes from the echo of :meth:`create_veth_into_netns`
        when that just made it, else from a lookup.

        ``arp_notify`` goes on in the message that brings ``ifname`` up (applied after
        its flags: off at NETDEV_UP, when there is no address to announce anyway);
        ``ndisc_notify``, which has no netlink setter, is written from inside the
        namespace when there is an IPv6 address. Neither sends anything by itself
        (the addresses come after the up, IPv6 ones without DAD). With ``announce``
        (the planner's call: a heal, an address re-added, an address the segment has
        seen) the addresses are announced last (a gratuitous ARP and an unsolicited
        NA with the override flag for each; see ``announce``), so whoever cached
        another MAC for them learns this one at once: setting the MAC to the one it
        has makes the kernel send them (NETDEV_CHANGEADDR). Not at NETDEV_UP: the
        bridge enables the new port only when linkwatch has seen its carrier, after
        the up, and drops what comes earlier; so for a new pair it first waits until
        the host end forwards (one look-up: it usually does by then). Without it
        nothing is sent: each announcement is flooded to every port of the bridge.

        It only adds: removing addresses/routes that should not be there is
        the planner's call (:meth:`del_address`, :meth:`del_default_route`).
        """
        entry = self._entry(netns_name)
        sock = entry.sock
        fresh = self._fresh.pop(netns_name, None)
        index = None
        if fresh is not None and fresh.inode == entry.inode and fresh.ifname == ifname:
            index = fresh.index
            if entry.nsid is None:  # for observation: no RTM_GETNSID (a scan of all nsids)
                entry.nsid = fresh.nsid
        where = f" in namespace {netns_name}"
        if mark is None or entry.lo_mark != mark:  # not just done by create_netns
            lo = ifinfo(index=1, flags=IFF_UP, change=IFF_UP)
            if mark is not None:
                lo += attr(IFLA_IFALIAS, mark.encode())
            sock.request(RTM_NEWLINK, 0, lo, f"link lo{where}: set up")
        entry.lo_mark = None
        name = str_attr(IFLA_IFNAME, ifname)
        attrs = name + attr(IFLA_IFALIAS, ownership.LINK_ALIAS.encode())
        if mtu is not None:
            attrs += u32_attr(IFLA_MTU, mtu)
        if not ipv6_link_local and (no_ll := no_ipv6_ll()):
            sock.request(RTM_NEWLINK, 0, ifinfo() + attrs + no_ll,
                         f"link {ifname}{where}: configure")
            attrs = name
        sock.request(RTM_NEWLINK, 0, ifinfo(flags=IFF_UP, change=IFF_UP) + attrs
                     + arp_notify_on(), f"link {ifname}{where}: set up")
        if any(iface.version == 6 for iface in addrs):
            try:
                with netns.enter(netns_name):
                    enable_ndisc_notify(ifname)
            except OSError as e:
                raise DriverError(f"link {ifname}{where}: ndisc_notify: {e.strerror}") from None
        if index is None:
            index = self._index(ifname, netns_name)
        for iface in addrs:
            # IFA_F_NODAD (IPv6): these addresses come from our own IPAM (or are declared
            # and checked unique by the loader) on a bridge only we attach allocations to,
            # so DAD could find no duplicate; it would only keep the address tentative
            # (unusable: the first connection is lost) for a second and flood a probe.
            try:
                sock.request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL,
                             addr_body(iface, index, ownership.ADDR_PROTO, True),
                             f"address {iface} on {ifname}{where}: add")
            except DriverError as e:
                if e.errno != errno.EEXIST:
                    raise
        for gw in gateways:
            self.replace_default_route(ifname, gw, ns=netns_name, index=index)
        if fresh is not None and fresh.index == index and fresh.mac is not None \
                and fresh.bridge_index:
            self._seed_neighbours(sock, index, fresh, addrs, gateways, where)
        if not announce:
            return
        mac = fresh.mac if fresh is not None and fresh.index == index else None
        if mac is None:
            link = self.get_link(ifname, netns_name)
            mac = link.mac if link is not None else None
        if mac is not None:
            if fresh is not None:
                self._wait_forwarding(fresh.host_index)
            sock.request(RTM_NEWLINK, 0, ifinfo(index=index) + attr(IFLA_ADDRESS,
                                                                    _mac_bytes(mac)),
                         f"link {ifname}{where}: announce its addresses")

    def _seed_neighbours(self, sock: Socket, index: int, fresh: _FreshPeer,
                         addrs: Sequence[IPInterface],
                         gateways: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address],
                         where: str) -> None:
        """What a new allocation's first packets would otherwise ask every allocation on the
        bridge, told up front: its MAC on its port of the bridge (an fdb entry that ages
        like a learnt one), its addresses' neighbour entries on the bridge, and inside, the
        gateways' at the bridge's MAC.

        Without them the first packet each way is an ARP broadcast (or, before the bridge
        has learnt the MAC, an unknown unicast) that the bridge floods to every port and
        every allocation's stack looks at: right after an apply of 500 allocations the
        first probe of each cost ~4 ms (1000 echo sends took 4 s), the cost of each
        allocation growing with their number. Only for a pair just made, whose MAC is the
        one we gave it; entries are created, never replaced (one already there, even a
        foreign one, stays: the planner judges those), and in state STALE: used at once,
        confirmed by the kernel's own unicast probe when first used, so a wrong guess
        lives seconds. Nothing here is needed for traffic to flow (the kernel resolves
        without it): a kernel that refuses one is not an error of the apply.

        The neighbour entries are exempt from the kernel's GC and marked ours
        (:func:`_our_neighbour`): 1000 allocations' entries alone are about 2000, past the
        default gc_thresh3 of the one table all namespaces share, where each creation ran
        the forced GC (seeding took 148 ms instead of 21 for 1000) and the kernel's own
        lookups failed ("neighbour table overflow"). The kernel never collects them: the
        planner deletes the bridge-side ones of an allocation that is gone or re-addressed;
        the ones inside go with the namespace (or with eth0).
        """
        mac = _mac_bytes(fresh.mac or "")
        bridge = fresh.bridge_index
        if bridge not in self._bridge_mac:
            try:
                replies = self._host.request(
                    RTM_GETLINK, 0, ifinfo(index=bridge)
                    + u32_attr(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS), f"link {bridge}: MAC")
            except DriverError:
                replies = []
            self._bridge_mac[bridge] = \
                parse_link(NlMsg.decode(replies[0]), {}).mac if replies else None
        bridge_mac = self._bridge_mac[bridge]
        asks: list[tuple[Socket, bytes, str]] = [
            (self._host, NDMSG.pack(AF_BRIDGE, fresh.host_index, NUD_REACHABLE, NTF_MASTER, 0)
             + attr(NDA_LLADDR, mac), f"fdb {fresh.mac} on port {fresh.host_index}")]
        asks += [(self._host, _our_neighbour(iface.ip, bridge, mac),
                  f"neighbour {iface.ip} on the bridge") for iface in addrs]
        if bridge_mac is not None:
            asks += [(sock, _our_neighbour(gw, index, _mac_bytes(bridge_mac)),
                      f"neighbour {gw}{where}") for gw in gateways]
        for s, body, what in asks:
            try:
                s.request(RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_EXCL, body, what)
            except DriverError as e:
                log.debug("%s: not seeded: %s", what, e.args[0] if e.args else e)

    def _wait_forwarding(self, index: int, limit: float = 0.2) -> None:
        """Until the bridge port ``index`` forwards (linkwatch has seen its carrier; with
        STP off at once after that), at most ``limit`` seconds: usually it already does."""
        deadline = time.monotonic() + limit
        body = ifinfo(index=index) + u32_attr(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS)
        while True:
            replies = self._host.request(RTM_GETLINK, 0, body, f"link {index}: port state")
            state = bridge_port_state(NlMsg.decode(replies[0])) if replies else None
            if state in (None, BR_STATE_FORWARDING) or time.monotonic() > deadline:
                return
            time.sleep(0.0005)
