"""Changes over rtnetlink on the host: bridges, links, neighbours, addresses, routes, namespaces.

``NetlinkChanges`` adds them to the reads (``read.NetlinkReader``); ``client.Netlink``
adds what building an allocation needs (the veth into its namespace, what is
configured inside it). Idempotent where the kernel allows.

See docs/decisions/002-allocations-prove-ownership-from-their-namespace.md.
See docs/decisions/012-our-neighbour-entries.md.
"""

from __future__ import annotations

import errno
import ipaddress
import secrets
import socket

from reconciler.domain import ownership
from reconciler.domain.errors import ConflictError, DriverError
from reconciler.domain.live import IPInterface
from reconciler.drivers import netns
from reconciler.drivers.netlink.messages import (
    addr_body,
    ifinfo,
    no_ipv6_ll,
    updown,
)
from reconciler.drivers.netlink.read import NetlinkReader
from reconciler.drivers.netlink.transport import Socket
from reconciler.drivers.netlink.wire import (
    IFA_ADDRESS,
    IFA_LOCAL,
    IFF_UP,
    IFLA_ADDRESS,
    IFLA_BRPORT_MODE,
    IFLA_IFALIAS,
    IFLA_IFNAME,
    IFLA_INFO_KIND,
    IFLA_INFO_SLAVE_DATA,
    IFLA_INFO_SLAVE_KIND,
    IFLA_LINKINFO,
    IFLA_MASTER,
    IFLA_MTU,
    NDA_DST,
    NDA_LLADDR,
    NDA_PROTOCOL,
    NDMSG,
    NLM_F_CREATE,
    NLM_F_EXCL,
    NLM_F_REPLACE,
    NTF_EXT_LEARNED,
    NUD_STALE,
    RT_SCOPE_UNIVERSE,
    RT_TABLE_MAIN,
    RTA_GATEWAY,
    RTA_OIF,
    RTM_DELADDR,
    RTM_DELLINK,
    RTM_DELNEIGH,
    RTM_DELROUTE,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTM_NEWNEIGH,
    RTM_NEWROUTE,
    RTMSG,
    RTN_UNICAST,
    attr,
    nested,
    str_attr,
    u8_attr,
    u32_attr,
)


def mac_bytes(mac: str) -> bytes:
    """Return the bytes of a MAC written ``aa:bb:cc:dd:ee:ff``."""
    return bytes.fromhex(mac.replace(":", ""))


def our_neighbour(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, index: int,
                  mac: bytes) -> bytes:
    """Return the body of a neighbour entry we make: STALE, exempt from the kernel's GC and
    marked ours (NTF_EXT_LEARNED, NDA_PROTOCOL: see ``wire.NTF_EXT_LEARNED``)."""
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    return (NDMSG.pack(family, index, NUD_STALE, NTF_EXT_LEARNED, 0) + attr(NDA_DST, ip.packed)
            + attr(NDA_LLADDR, mac) + u8_attr(NDA_PROTOCOL, ownership.NEIGH_PROTO))


class NetlinkChanges(NetlinkReader):
    """rtnetlink reads (:class:`NetlinkReader`) and the host's changes: bridges, links,
    neighbours, addresses, routes and namespaces. Idempotent where the kernel allows.

    It keeps what its own changes told it (each bridge's index), so a change asks
    nothing it has the answer to.
    """

    def __init__(self) -> None:
        super().__init__()
        # answers we already have, so no request asks for them again: the index of each
        # bridge veths were put on
        self._bridge_index: dict[str, int] = {}
        #: each bridge's MAC by index, for the neighbour entries of new allocations: read
        #: once per pass (``new_pass``; someone may set a bridge's MAC between passes of the
        #: agent) and forgotten at our own set_mac
        self._bridge_mac: dict[int, str | None] = {}

    def new_pass(self) -> None:
        """Forget what was read of the bridges: a new plan is executed, it may be stale now."""
        self._bridge_mac.clear()

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
            body += attr(IFLA_ADDRESS, mac_bytes(first_mac))
        body += nested(IFLA_LINKINFO, str_attr(IFLA_INFO_KIND, "bridge"))
        try:
            self._host.request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body,
                               f"bridge {name}: create")
            if alias is not None:
                index = self._index(tmp, None)
                final_mac = mac if mac is not None else ownership.bridge_mac(name)
                self._host.request(RTM_NEWLINK, 0, ifinfo(index=index)
                                   + attr(IFLA_IFALIAS, alias.encode())
                                   + attr(IFLA_ADDRESS, mac_bytes(final_mac)) + no_ipv6_ll(),
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

    def set_mac(self, name: str, mac: str, ns: str | None = None) -> None:
        """Set a link's MAC (inside namespace ``ns``: an allocation's ``eth0``). Set to the one
        it has, it still counts as set (dev_set_mac_address marks NET_ADDR_SET either way):
        how an existing bridge is pinned without a change."""
        if ns is None:
            self._bridge_mac.clear()
        where = f" in namespace {ns}" if ns else ""
        self._sock(ns).request(RTM_NEWLINK, 0, ifinfo() + str_attr(IFLA_IFNAME, name)
                               + attr(IFLA_ADDRESS, mac_bytes(mac)),
                               f"link {name}{where}: set MAC {mac}")

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
                           our_neighbour(ip, index, mac_bytes(mac)),
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
        """Run ``ip netns add`` in-process (see :func:`netns.create`).

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
