"""Drift event sources for watch mode: kernel netlink notifications and Docker events.

They never decide anything: a relevant event only asks the watch loop for a
pass (level-triggered), which observes the real state and plans from it. So
filtering can be cheap and approximate; a spurious pass finds nothing to do.

Netlink is read with a plain ``AF_NETLINK`` socket subscribed to the link,
address and route groups of the network namespace the calling thread is in
(``reconcile --netns`` moves the whole process before any thread starts).
Message parsing is pure (:func:`parse_messages`) and tested on hand-built bytes.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from reconciler import ownership

log = logging.getLogger("reconciler.drift")

# <linux/netlink.h>, <linux/rtnetlink.h>, <linux/if_link.h>, <linux/if_addr.h>
NETLINK_ROUTE = 0
NLMSG_ERROR, NLMSG_DONE, NLMSG_OVERRUN = 2, 3, 4
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
RTM_NEWADDR, RTM_DELADDR = 20, 21
RTM_NEWROUTE, RTM_DELROUTE = 24, 25
RTMGRP_LINK = 0x1
RTMGRP_IPV4_IFADDR = 0x10
RTMGRP_IPV4_ROUTE = 0x40
RTMGRP_IPV6_IFADDR = 0x100
RTMGRP_IPV6_ROUTE = 0x400
GROUPS = (RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR | RTMGRP_IPV4_ROUTE
          | RTMGRP_IPV6_ROUTE)
IFLA_IFNAME, IFLA_MASTER, IFLA_IFALIAS = 3, 10, 20
IFA_ADDRESS, IFA_LOCAL, IFA_PROTO = 1, 2, 11
AF_INET6 = 10

_NLMSGHDR = struct.Struct("=IHHII")
_IFINFOMSG = struct.Struct("=BxHiII")
_IFADDRMSG = struct.Struct("=BBBBI")
_RTMSG = struct.Struct("=BBBBBBBBI")
_RTATTR = struct.Struct("=HH")
RTA_OIF = 4
RECV_BUFFER = 1 << 20
SOCKET_RCVBUF = 4 << 20

What = Literal["link", "addr", "route"]


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
    link_local: bool = False  # addr: an IPv6 fe80::/10 address (kernel-made, never ours)


def _attrs(data: bytes, offset: int, end: int) -> Iterator[tuple[int, bytes]]:
    while offset + _RTATTR.size <= end:
        length, kind = _RTATTR.unpack_from(data, offset)
        if length < _RTATTR.size or offset + length > end:
            return
        yield kind & 0x3FFF, data[offset + _RTATTR.size: offset + length]
        offset += (length + 3) & ~3


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _u32(raw: bytes) -> int | None:
    return int(struct.unpack_from("=I", raw)[0]) if len(raw) >= 4 else None


def _parse_one(kind: int, data: bytes, body: int, end: int) -> NetlinkEvent | None:
    if kind in (RTM_NEWLINK, RTM_DELLINK) and end - body >= _IFINFOMSG.size:
        _family, _type, index, _flags, _change = _IFINFOMSG.unpack_from(data, body)
        fields: dict[str, Any] = {}
        for a, raw in _attrs(data, body + _IFINFOMSG.size, end):
            if a == IFLA_IFNAME:
                fields["name"] = _text(raw)
            elif a == IFLA_IFALIAS:
                fields["alias"] = _text(raw)
            elif a == IFLA_MASTER:
                fields["master"] = _u32(raw)
        return NetlinkEvent("link", kind == RTM_DELLINK, index, **fields)
    if kind in (RTM_NEWADDR, RTM_DELADDR) and end - body >= _IFADDRMSG.size:
        family, _plen, _flags, _scope, index = _IFADDRMSG.unpack_from(data, body)
        proto = None
        link_local = False
        for a, raw in _attrs(data, body + _IFADDRMSG.size, end):
            if a == IFA_PROTO and raw:
                proto = raw[0]
            elif a in (IFA_ADDRESS, IFA_LOCAL) and family == AF_INET6 and len(raw) == 16:
                link_local = ipaddress.IPv6Address(raw).is_link_local
        return NetlinkEvent("addr", kind == RTM_DELADDR, index, proto=proto,
                            link_local=link_local)
    if kind in (RTM_NEWROUTE, RTM_DELROUTE) and end - body >= _RTMSG.size:
        fields6 = _RTMSG.unpack_from(data, body)
        oif = 0
        for a, raw in _attrs(data, body + _RTMSG.size, end):
            if a == RTA_OIF:
                oif = _u32(raw) or 0
        return NetlinkEvent("route", kind == RTM_DELROUTE, oif, proto=fields6[5])
    return None


def parse_messages(data: bytes) -> list[NetlinkEvent]:
    """Parse one datagram of rtnetlink messages; unknown or malformed messages are skipped."""
    events: list[NetlinkEvent] = []
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or offset + length > len(data):
            break
        ev = _parse_one(kind, data, offset + _NLMSGHDR.size, offset + length)
        if ev is not None:
            events.append(ev)
        offset += (length + 3) & ~3
    return events


class DriftFilter:
    """Decides, cheaply, whether a netlink event concerns what we manage.

    Relevant: a link that is desired by name, carries our ownership alias, or
    is a port of such a link; an address or route carrying our protocol
    marker; an address (other than IPv6 link-local) on a relevant link.
    Thread-safe: the listener thread asks, the watch loop updates the names.
    """

    def __init__(self, resolve: Callable[[int], str | None] | None = None) -> None:
        self._resolve = resolve or _index_to_name
        self._lock = threading.Lock()
        self._names: frozenset[str] = frozenset()
        self._index_name: dict[int, str] = {}
        self._owned: set[int] = set()  # indexes whose link carries our alias

    def set_names(self, names: Iterable[str]) -> None:
        with self._lock:
            self._names = frozenset(names)

    def learn(self, ev: NetlinkEvent) -> None:
        """Record a link (from the initial dump or a notification) without judging it."""
        with self._lock:
            self._learn(ev)

    def _learn(self, ev: NetlinkEvent) -> None:
        if ev.what != "link":
            return
        if ev.deleted:
            self._index_name.pop(ev.index, None)
            self._owned.discard(ev.index)
            return
        if ev.name:
            self._index_name[ev.index] = ev.name
        if ownership.is_owned_alias(ev.alias):
            self._owned.add(ev.index)
        elif ev.alias is not None or ev.name:
            self._owned.discard(ev.index)

    def _index_relevant(self, index: int) -> bool:
        if index <= 0:
            return False
        if index in self._owned:
            return True
        name = self._index_name.get(index)
        if name is None:
            name = self._resolve(index)
            if name is None:
                return False
            self._index_name[index] = name
        return name in self._names

    def relevant(self, ev: NetlinkEvent) -> bool:
        with self._lock:
            if ev.what == "link":
                hit = (ev.index in self._owned or ownership.is_owned_alias(ev.alias)
                       or (ev.name is not None and ev.name in self._names)
                       or (ev.master is not None and self._index_relevant(ev.master)))
                self._learn(ev)
                return hit
            if ev.what == "addr":
                if ev.proto == ownership.ADDR_PROTO:
                    return True
                return not ev.link_local and self._index_relevant(ev.index)
            return ev.proto == ownership.ROUTE_PROTO


def _index_to_name(index: int) -> str | None:
    try:
        return socket.if_indextoname(index)
    except OSError:
        return None


def open_socket(groups: int, rcvbuf: int = SOCKET_RCVBUF) -> socket.socket:
    """An rtnetlink socket subscribed to ``groups`` (a bitmask of RTMGRP_*)."""
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
    """All links of the current namespace, as link events (seeds the filter)."""
    with open_socket(0) as sock:
        req = _NLMSGHDR.pack(_NLMSGHDR.size + _IFINFOMSG.size, RTM_GETLINK,
                             NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + _IFINFOMSG.pack(0, 0, 0, 0, 0)
        sock.sendto(req, (0, 0))
        sock.settimeout(5.0)
        out: list[NetlinkEvent] = []
        while True:
            data = sock.recv(RECV_BUFFER)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, kind, _f, _s, _p = _NLMSGHDR.unpack_from(data, offset)
                if kind in (NLMSG_DONE, NLMSG_ERROR) or length < _NLMSGHDR.size:
                    return out
                offset += (length + 3) & ~3
            out.extend(parse_messages(data))


class NetlinkWatcher:
    """Listens to rtnetlink notifications in a thread; calls ``on_drift(reason)`` for relevant ones.

    The socket is opened by :meth:`start` in the caller's thread, so that a
    failure is reported there and the namespace is the caller's.
    """

    def __init__(self, on_drift: Callable[[str], None], stop: threading.Event,
                 drift_filter: DriftFilter | None = None) -> None:
        self.on_drift = on_drift
        self.stop = stop
        self.filter = drift_filter or DriftFilter()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._sock = open_socket(GROUPS)  # subscribe first, then dump: no gap for missed links
        for ev in dump_links():
            self.filter.learn(ev)
        self._thread = threading.Thread(target=self._run, name="netlink-drift", daemon=True)
        self._thread.start()

    def set_names(self, names: Iterable[str]) -> None:
        self.filter.set_names(names)

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self.stop.is_set():
            try:
                ready, _w, _x = select.select([sock], [], [], 0.5)
                if not ready:
                    continue
                data = sock.recv(RECV_BUFFER)
            except OSError as exc:
                if self.stop.is_set() or exc.errno == errno.EBADF:
                    return
                if exc.errno == errno.ENOBUFS:  # we lost events: look at everything again
                    self.on_drift("netlink overrun")
                    continue
                log.warning("netlink listener: %s", exc)
                self.stop.wait(1.0)
                continue
            for ev in parse_messages(data):
                if self.filter.relevant(ev):
                    verb = "del" if ev.deleted else "new"
                    what = ev.name if ev.what == "link" and ev.name else f"ifindex {ev.index}"
                    self.on_drift(f"netlink {verb}{ev.what} {what}")

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._sock is not None:
            self._sock.close()


# --------------------------------------------------------------------------- /run/netns

NETNS_RUN_DIR = "/run/netns"


class NetnsDirWatcher:
    """Inotify on /run/netns: an allocation namespace unmounted (``ip netns del``) or re-made.

    Unmounting sends no netlink event, and the namespace may even live on
    (something still holds it), so its veth does not vanish either.
    """

    def __init__(self, on_drift: Callable[[str], None], run_dir: str = NETNS_RUN_DIR, *,
                 held: Callable[[], Iterable[str]] = frozenset) -> None:
        """``held``: names that matter besides ``set_names``, asked at event time (the
        namespaces an observer keeps a socket into, which a pass may have just opened)."""
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer as FsObserver

        self.on_drift = on_drift
        self.run_dir = run_dir
        self.held = held
        self._names: frozenset[str] = frozenset()
        self._observer = FsObserver()
        self._scheduled = False
        outer = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type not in ("created", "deleted", "moved"):
                    return
                for p in (event.src_path, getattr(event, "dest_path", "")):
                    name = os.path.basename(os.fsdecode(p)) if p else ""
                    if name and (name in outer._names or outer._held(name)):
                        outer.on_drift(f"netns {event.event_type} {name}")
                        return

        self._handler = Handler()
        self._observer.start()

    def _held(self, name: str) -> bool:
        try:
            return name in frozenset(self.held())
        except RuntimeError:  # changed while we looked (another thread): assume it matters
            return True

    def set_names(self, names: Iterable[str]) -> None:
        self._names = frozenset(names)
        if not self._scheduled and os.path.isdir(self.run_dir):
            try:
                self._observer.schedule(self._handler, self.run_dir, recursive=False)
                self._scheduled = True
            except OSError as exc:
                log.warning("cannot watch %s: %s", self.run_dir, exc)

    def close(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=2.0)


# --------------------------------------------------------------------------- Docker

DOCKER_ACTIONS = frozenset({"create", "destroy", "connect", "disconnect", "remove", "update"})


def docker_event_reason(event: Mapping[str, Any], names: frozenset[str]) -> str | None:
    """A reason to run a pass when a Docker event touches a desired network, else None."""
    if event.get("Type") != "network":
        return None
    action = str(event.get("Action", "")).split(":", 1)[0]
    if action not in DOCKER_ACTIONS:
        return None
    actor = event.get("Actor") or {}
    attrs = actor.get("Attributes") or {}
    name = attrs.get("name")
    if name not in names:
        return None
    return f"docker network {action} {name}"


class DockerWatcher:
    """Follows the daemon's network events in a thread; reconnects with capped backoff.

    A daemon that is down is not an error here: the next pass reports it; we
    keep trying to connect and ask for a pass once the stream is back (the
    daemon may have restarted and lost or re-created networks meanwhile).
    """

    def __init__(self, on_drift: Callable[[str], None], stop: threading.Event, *,
                 max_delay: float = 30.0,
                 client_factory: Callable[[], Any] | None = None) -> None:
        self.on_drift = on_drift
        self.stop = stop
        self.max_delay = max_delay
        self._factory = client_factory or _docker_client
        self._names: frozenset[str] = frozenset()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self.connected = False

    def set_names(self, names: Iterable[str]) -> None:
        self._names = frozenset(names)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="docker-drift", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        delay = 1.0
        first = True
        while not self.stop.is_set():
            try:
                self._client = self._factory()
                stream = self._client.events(decode=True, filters={"type": "network"})
                self.connected = True
                if not first:
                    log.info("docker events: connected again")
                    self.on_drift("docker events reconnected")
                first = False
                delay = 1.0
                for event in stream:
                    if self.stop.is_set():
                        return
                    reason = docker_event_reason(event, self._names)
                    if reason:
                        self.on_drift(reason)
                raise ConnectionError("event stream ended")
            except Exception as exc:  # the daemon is down or went away: retry
                self.connected = False
                if self.stop.is_set():
                    return
                if first or delay == 1.0:
                    log.warning("docker events unavailable (%s); retrying", _one_line(exc))
                first = False
                self._close_client()
                self.stop.wait(delay)
                delay = min(self.max_delay, delay * 2)

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # closing a dead connection
                client.close()

    def close(self) -> None:
        self._close_client()  # the thread is a daemon: a stream stuck in read dies with us
        if self._thread is not None:
            self._thread.join(timeout=0.2)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1][:200] if text else type(exc).__name__


def _docker_client() -> Any:
    import docker

    return docker.from_env(timeout=10)
