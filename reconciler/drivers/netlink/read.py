"""Reading links, addresses and routes over rtnetlink, here and inside allocation namespaces.

:class:`NetlinkReader` holds one socket in the namespace it was created in, plus a
cache of sockets opened inside allocation namespaces (entered with setns in
the calling thread, socket created, thread switched back: the socket stays
bound to that namespace). Not thread-safe: one instance per thread.
``reconciler.drivers.netlink.client.Netlink`` adds the changes.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import resource
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Self

from reconciler.domain.errors import DriverError
from reconciler.domain.live import LiveLink, LiveNeighbour, LiveNetns, LiveRoute
from reconciler.drivers import netns
from reconciler.drivers.netlink.messages import (
    ADDR_DUMP,
    LINK_DUMP,
    NEIGH_DUMP,
    ROUTE_DUMP,
    ROUTE_DUMP_ALL,
    RULE_DUMP,
    ifinfo,
)
from reconciler.drivers.netlink.parse import (
    ROUTE_TYPES,
    assemble_links,
    neigh_state,
    parse_link,
    parse_neigh,
    parse_neigh_entry,
    parse_route,
    parse_rule_table,
)
from reconciler.drivers.netlink.transport import Socket, netlink_error
from reconciler.drivers.netlink.wire import (
    I32,
    IFA_TARGET_NETNSID,
    IFINFO,
    IFLA_EXT_MASK,
    IFLA_IFNAME,
    IFLA_TARGET_NETNSID,
    NETNSA_FD,
    NETNSA_NSID,
    NUD_NOARP,
    RT_TABLE_LOCAL,
    RT_TABLE_MAIN,
    RTA_DST,
    RTA_OIF,
    RTEXT_FILTER_SKIP_STATS,
    RTGEN,
    RTM_GETADDR,
    RTM_GETLINK,
    RTM_GETNEIGH,
    RTM_GETNSID,
    RTM_GETROUTE,
    RTM_GETRULE,
    RTMSG,
    U32,
    NlMsg,
    attr,
    str_attr,
    u32_attr,
)


@dataclass
class _NsEntry:
    inode: int
    sock: Socket
    nsid: int | None = None
    lo_mark: str | None = None  # lo was just brought up with this alias (create_netns)


def _raise_nofile_limit() -> int:
    """Raise the soft fd limit to the hard one (sockets are cached per namespace)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft



class NetlinkReader:
    """rtnetlink access to the current namespace and to allocation namespaces.

    The main socket belongs to the namespace of the thread that constructs
    the object ("host" below, though under ``--netns`` it is the sandbox).
    Sockets into allocation namespaces are opened on first use and cached by
    (name, namespace inode); a cached socket keeps its namespace alive, so the
    cache is pruned whenever observation finds a name gone or re-created, and
    :meth:`delete_netns` drops the socket before unmounting.
    """

    def __init__(self) -> None:
        self._host = Socket()
        self._ns: dict[str, _NsEntry] = {}
        self._max_cached = max(64, _raise_nofile_limit() - 512)

    def close(self) -> None:
        """Close every socket (host and cached namespace sockets)."""
        for entry in self._ns.values():
            entry.sock.close()
        self._ns.clear()
        self._host.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _entry(self, name: str) -> _NsEntry:
        """Return the cached socket inside ``name``, (re)opened if the namespace changed."""
        path = netns.path_of(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self.forget_netns(name)
            raise DriverError(f"network namespace {name}: {path} does not exist") from None
        if st.st_dev != netns.nsfs_dev():
            self.forget_netns(name)
            raise DriverError(f"network namespace {name}: {path} is not a namespace "
                              "(empty file: its bind mount is gone)")
        entry = self._ns.get(name)
        if entry is not None and entry.inode == st.st_ino:
            return entry
        if entry is not None:
            # re-created under that name; not forget_netns: the client keeps what creating
            # the new one told it (Netlink.forget_netns)
            del self._ns[name]
            entry.sock.close()
        self._make_room()
        with netns.enter(path):
            sock = Socket()
        entry = _NsEntry(st.st_ino, sock)
        self._ns[name] = entry
        return entry

    def _make_room(self) -> None:
        """Close the oldest cached socket when the cache is full (file descriptors)."""
        if len(self._ns) >= self._max_cached:
            self.forget_netns(next(iter(self._ns)))

    def _keep_socket(self, name: str, sock: Socket, *, lo_mark: str | None = None) -> None:
        """Cache ``sock``, opened inside namespace ``name`` by the caller, as the one into it.

        ``lo_mark``: the caller just brought ``lo`` up with that alias there.
        """
        self.forget_netns(name)
        self._make_room()
        self._ns[name] = _NsEntry(os.stat(netns.path_of(name)).st_ino, sock, lo_mark=lo_mark)

    def forget_netns(self, name: str) -> None:
        """Close the cached socket into ``name`` (it would keep the namespace alive)."""
        entry = self._ns.pop(name, None)
        if entry is not None:
            entry.sock.close()

    def cached_names(self) -> frozenset[str]:
        """Return the namespaces this object holds a socket into (and so keeps alive)."""
        return frozenset(self._ns)

    def prune_cache(self, keep: Iterable[str]) -> None:
        """Close cached sockets of namespaces not in ``keep``."""
        keep = set(keep)
        for name in [n for n in self._ns if n not in keep]:
            self.forget_netns(name)

    def _sock(self, ns: str | None) -> Socket:
        return self._host if ns is None else self._entry(ns).sock

    def get_nsid(self, name: str) -> int | None:
        """Return the nsid the current namespace uses for ``name``; None when none is assigned."""
        fd = netns.open_fd(name)
        try:
            replies = self._host.request(RTM_GETNSID, 0, RTGEN.pack(0) + u32_attr(NETNSA_FD, fd),
                                         f"network namespace {name}: get nsid")
        finally:
            os.close(fd)
        for raw in replies:
            a = NlMsg.decode(raw).attrs
            if NETNSA_NSID in a:
                nsid = I32.unpack_from(a[NETNSA_NSID])[0]
                return nsid if nsid >= 0 else None
        return None

    def link_messages(self, ns: str | None = None, *, nsid: int | None = None) -> list[NlMsg]:
        """Dump links, raw (stats skipped); ``nsid``: of another namespace via target nsid."""
        body = LINK_DUMP if nsid is None else LINK_DUMP + attr(IFLA_TARGET_NETNSID,
                                                                  I32.pack(nsid))
        where = f" in {ns}" if ns else (f" in nsid {nsid}" if nsid is not None else "")
        return [NlMsg.decode(r) for r in self._sock(ns).dump(RTM_GETLINK, body,
                                                            f"dump links{where}")]

    def addr_messages(self, ns: str | None = None, *, nsid: int | None = None) -> list[NlMsg]:
        """Dump addresses, raw: here, inside ``ns`` or (``nsid``) via target nsid."""
        body = ADDR_DUMP if nsid is None else ADDR_DUMP + attr(IFA_TARGET_NETNSID,
                                                                  I32.pack(nsid))
        where = f" in {ns}" if ns else (f" in nsid {nsid}" if nsid is not None else "")
        return [NlMsg.decode(r) for r in self._sock(ns).dump(RTM_GETADDR, body,
                                                            f"dump addresses{where}")]

    def route_messages(self, ns: str | None = None) -> list[NlMsg]:
        """Dump main-table routes, raw (both families); targets by nsid are not supported."""
        where = f" in {ns}" if ns else ""
        return [NlMsg.decode(r) for r in self._sock(ns).dump(RTM_GETROUTE, ROUTE_DUMP,
                                                            f"dump routes{where}")]

    def dump_neighbours(self, indexes: Iterable[int]) -> tuple[LiveNeighbour, ...]:
        """Dump the neighbour entries (ARP and NDP, with a link-layer address) of the links with
        those indexes, here: one dump of every link's, filtered."""
        wanted = set(indexes)
        if not wanted:
            return ()
        out = []
        for raw in self._host.dump(RTM_GETNEIGH, NEIGH_DUMP, "dump neighbours"):
            n = parse_neigh(NlMsg.decode(raw))
            if n is not None and n.index in wanted:
                out.append(n)
        return tuple(sorted(out, key=lambda n: (n.index, n.address)))

    def neighbour_states(self, index: int) -> dict[str, tuple[str | None, str]]:
        """List the neighbour entries on link ``index`` here that ``ip neigh show`` lists (failed
        ones included, NOARP ones not): address -> (MAC or None, state as ``ip neigh``
        words it). For the probes' diagnosis."""
        out: dict[str, tuple[str | None, str]] = {}
        for raw in self._host.dump(RTM_GETNEIGH, NEIGH_DUMP, "dump neighbours"):
            e = parse_neigh_entry(NlMsg.decode(raw))
            if e is not None and e[0] == index and not e[3] & NUD_NOARP:
                out[e[1]] = (e[2], neigh_state(e[3]))
        return out

    def route_get(self, address: str) -> tuple[str | None, str]:
        """Ask which (output link, route type) the routing here (rules included) picks for
        ``address`` (``RTM_GETROUTE``, what ``ip route get`` asks); (None, the error's words, lower
        case) when there is no route."""
        ip = ipaddress.ip_address(address)
        family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
        body = RTMSG.pack(family, ip.max_prefixlen, 0, 0, 0, 0, 0, 0, 0) + attr(RTA_DST, ip.packed)
        try:
            replies = self._host.request(RTM_GETROUTE, 0, body, f"route get {address}")
        except DriverError as e:
            return None, (os.strerror(e.errno) if e.errno else str(e)).lower()
        if not replies:
            return None, "no route"
        msg = NlMsg.decode(replies[0])
        rtype = ROUTE_TYPES.get(msg.header[7], f"type {msg.header[7]}")
        oif = msg.attrs.get(RTA_OIF, b"")
        if len(oif) < 4:
            return None, rtype
        return self._name_of(U32.unpack_from(oif)[0]), rtype

    def _name_of(self, index: int) -> str | None:
        try:
            replies = self._host.request(RTM_GETLINK, 0, ifinfo(index=index)
                                         + u32_attr(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS),
                                         f"link {index}: look up")
        except DriverError:
            return None
        return parse_link(NlMsg.decode(replies[0]), {}).name if replies else None

    def dump_links(self, ns: str | None = None) -> dict[str, LiveLink]:
        """Dump every link of the namespace (host by default) by name, addresses attached."""
        links = assemble_links(self.link_messages(ns), self.addr_messages(ns))
        return {link.name: link for link in links}

    def dump_routes(self, ns: str | None = None) -> tuple[LiveRoute, ...]:
        """Dump the main-table routes of the namespace (host by default)."""
        out = []
        for m in self.route_messages(ns):
            r = parse_route(m)
            if r is not None:
                out.append(r)
        return tuple(out)

    def rule_tables(self) -> dict[int, frozenset[int]]:
        """Return, per family (``socket.AF_INET``, ``AF_INET6``), the tables an ``ip rule`` of the
        host selects: main and default, and whatever Tailscale (52), ``wg-quick`` (its fwmark
        table) or an operator added. Not the local table: its routes are the links'
        addresses, read as addresses."""
        out: dict[int, set[int]] = {socket.AF_INET: set(), socket.AF_INET6: set()}
        for raw in self._host.dump(RTM_GETRULE, RULE_DUMP, "dump rules"):
            found = parse_rule_table(NlMsg.decode(raw))
            if found is not None and found[1] != RT_TABLE_LOCAL:
                out[found[0]].add(found[1])
        return {family: frozenset(tables) for family, tables in out.items()}

    def dump_host_routes(self) -> tuple[LiveRoute, ...]:
        """Dump the host's routes of every table an ``ip rule`` selects (:meth:`rule_tables`),
        each with its table: what a declared prefix must not overlap. Main only when the
        rules cannot be read."""
        try:
            tables: dict[int, frozenset[int]] = self.rule_tables()
        except DriverError:
            tables = {socket.AF_INET: frozenset({RT_TABLE_MAIN}),
                      socket.AF_INET6: frozenset({RT_TABLE_MAIN})}
        out = []
        for raw in self._host.dump(RTM_GETROUTE, ROUTE_DUMP_ALL, "dump routes"):
            r = parse_route(NlMsg.decode(raw), tables)
            if r is not None:
                out.append(r)
        return tuple(out)

    def observe_netns(self, names: Iterable[str], *, prune: bool = True) -> dict[str, LiveNetns]:
        """Observe links (with addresses) and main routes inside each named namespace.

        Names whose file is missing are left out; an empty file (or anything
        that cannot be entered) is reported ``usable=False`` rather than
        raising. With ``prune`` the socket cache is trimmed to ``names``, so
        sockets do not keep namespaces that were deleted out of band alive.
        """
        names = list(names)
        if prune:
            self.prune_cache(names)
        out: dict[str, LiveNetns] = {}
        for name in names:
            try:
                entry = self._entry(name)
            except FileNotFoundError:
                continue
            except DriverError:
                if os.path.lexists(netns.path_of(name)):
                    out[name] = LiveNetns(name=name, usable=False)
                continue
            try:
                links = assemble_links(self.link_messages(name), self.addr_messages(name))
                routes = self.dump_routes(name)
            except DriverError:
                self.forget_netns(name)
                raise
            if entry.nsid is None:
                with contextlib.suppress(DriverError):
                    entry.nsid = self.get_nsid(name)
            out[name] = LiveNetns(name=name, usable=True, links=tuple(links), routes=routes,
                                  nsid=entry.nsid, inode=entry.inode)
        return out

    def _lookup(self, name: str, ns: str | None) -> bytes | None:
        """Look up the raw RTM_NEWLINK reply for ``name`` (here or inside ``ns``), None when
        absent."""
        try:
            replies = self._sock(ns).request(
                RTM_GETLINK, 0, ifinfo() + str_attr(IFLA_IFNAME, name)
                + u32_attr(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS), f"link {name}: look up")
        except DriverError as e:
            if e.errno == errno.ENODEV:
                return None
            raise
        return replies[0] if replies else None

    def link_index(self, name: str, ns: str | None = None) -> int | None:
        """Return the ifindex of ``name`` (here or inside ``ns``), None when absent."""
        raw = self._lookup(name, ns)
        return None if raw is None else int(IFINFO.unpack_from(raw, 16)[2])

    def get_link(self, name: str, ns: str | None = None) -> LiveLink | None:
        """Get one link without addresses (master shown as ``if<N>``), None when absent."""
        raw = self._lookup(name, ns)
        return None if raw is None else parse_link(NlMsg.decode(raw), {})

    def peek_lo_alias(self, name: str) -> str | None:
        """Return the alias of ``lo`` inside namespace ``name``, without caching a socket there.

        Cheap enough to ask of every namespace under /run/netns: it tells our
        allocation namespaces from everyone else's without holding theirs open.
        """
        try:
            with netns.enter(name):
                sock = Socket()
        except (OSError, DriverError):
            return None
        try:
            replies = sock.request(RTM_GETLINK, 0, ifinfo(index=1)
                                   + u32_attr(IFLA_EXT_MASK, RTEXT_FILTER_SKIP_STATS),
                                   f"link lo in namespace {name}: look up")
        except DriverError:
            return None
        finally:
            sock.close()
        return parse_link(NlMsg.decode(replies[0]), {}).alias if replies else None

    def _index(self, name: str, ns: str | None) -> int:
        index = self.link_index(name, ns)
        if index is None:
            where = f" in namespace {ns}" if ns else ""
            raise netlink_error(errno.ENODEV, f"link {name}{where}", "no such link")
        return index

