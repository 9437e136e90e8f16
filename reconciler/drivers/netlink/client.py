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
inside allocation namespaces, dumps), ``changes`` (``NetlinkChanges``: the
host's changes), this module (``Netlink``: those and an allocation's veth and
what is configured inside it) and ``listen`` (subscriptions). Not thread-safe:
one instance per thread.

See docs/decisions/008-raw-rtnetlink.md.
See docs/decisions/009-nothing-on-the-wire-undeclared.md.
See docs/decisions/011-neighbours-told-up-front.md.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from reconciler.domain import ownership
from reconciler.domain.errors import ConflictError, DriverError
from reconciler.domain.live import IPInterface
from reconciler.drivers import netns
from reconciler.drivers.netlink.announce import enable_ndisc_notify
from reconciler.drivers.netlink.changes import NetlinkChanges, mac_bytes, our_neighbour
from reconciler.drivers.netlink.messages import (
    addr_body,
    arp_notify_on,
    ifinfo,
    no_ipv6_ll,
)
from reconciler.drivers.netlink.parse import bridge_port_state, parse_link
from reconciler.drivers.netlink.transport import Socket
from reconciler.drivers.netlink.wire import (
    AF_BRIDGE,
    BR_STATE_FORWARDING,
    I32,
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
    NDA_LLADDR,
    NDMSG,
    NLM_F_CREATE,
    NLM_F_ECHO,
    NLM_F_EXCL,
    NTF_MASTER,
    NUD_REACHABLE,
    RTEXT_FILTER_SKIP_STATS,
    RTM_GETLINK,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTM_NEWNEIGH,
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


class Netlink(NetlinkChanges):
    """rtnetlink reads (:class:`NetlinkReader`) and the changes: links, addresses, routes,
    allocation namespaces and the veths into them. Idempotent where the kernel allows.

    It keeps what its own changes told it (each bridge's index, the peer a veth creation
    put into a namespace), so building an allocation asks nothing it has the answer to.
    """

    def __init__(self) -> None:
        super().__init__()
        # the peer of a veth just created (until configured): no request asks for it again
        self._fresh: dict[str, _FreshPeer] = {}

    def forget_netns(self, name: str) -> None:
        """Close the cached socket into ``name`` and forget the peer just put there."""
        self._fresh.pop(name, None)
        super().forget_netns(name)

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
            peer += attr(IFLA_ADDRESS, mac_bytes(mac))
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

    def configure_inside(self, netns_name: str, addrs: Sequence[IPInterface],
                         gateways: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address],
                         *, ifname: str = "eth0", mtu: int | None = None,
                         ipv6_link_local: bool = False, mark: str | None = None,
                         announce: bool = False) -> None:
        """Configure an allocation namespace from inside: ``lo`` up, ``ifname`` up (MTU, ownership
        alias), owned addresses, default route(s) via the gateway(s) with our route proto.
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
                                                                    mac_bytes(mac)),
                         f"link {ifname}{where}: announce its addresses")

    def _seed_neighbours(self, sock: Socket, index: int, fresh: _FreshPeer,
                         addrs: Sequence[IPInterface],
                         gateways: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address],
                         where: str) -> None:
        """Seed what a new allocation's first packets would otherwise ask every allocation on the
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
        (:func:`changes.our_neighbour`): 1000 allocations' entries alone are about 2000, past the
        default gc_thresh3 of the one table all namespaces share, where each creation ran
        the forced GC (seeding took 148 ms instead of 21 for 1000) and the kernel's own
        lookups failed ("neighbour table overflow"). The kernel never collects them: the
        planner deletes the bridge-side ones of an allocation that is gone or re-addressed;
        the ones inside go with the namespace (or with eth0).
        """
        mac = mac_bytes(fresh.mac or "")
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
        asks += [(self._host, our_neighbour(iface.ip, bridge, mac),
                  f"neighbour {iface.ip} on the bridge") for iface in addrs]
        if bridge_mac is not None:
            asks += [(sock, our_neighbour(gw, index, mac_bytes(bridge_mac)),
                      f"neighbour {gw}{where}") for gw in gateways]
        for s, body, what in asks:
            try:
                s.request(RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_EXCL, body, what)
            except DriverError as e:
                log.debug("%s: not seeded: %s", what, e.args[0] if e.args else e)

    def _wait_forwarding(self, index: int, limit: float = 0.2) -> None:
        """Wait until the bridge port ``index`` forwards (linkwatch has seen its carrier; with
        STP off at once after that), at most ``limit`` seconds: usually it already does."""
        deadline = time.monotonic() + limit
        body = ifinfo(index=index) + u32_attr(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS)
        while True:
            replies = self._host.request(RTM_GETLINK, 0, body, f"link {index}: port state")
            state = bridge_port_state(NlMsg.decode(replies[0])) if replies else None
            if state in (None, BR_STATE_FORWARDING) or time.monotonic() > deadline:
                return
            time.sleep(0.0005)
