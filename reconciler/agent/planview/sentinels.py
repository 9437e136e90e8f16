"""Sentinels: what tells the plan view which part of the host changed since it was read.

See ``reconciler.agent.planview.view`` for how they are used.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import struct

from reconciler.drivers import netns
from reconciler.drivers.iptables import IptablesDriver
from reconciler.drivers.netlink.listen import (
    ALL_GROUPS,
    NETLINK_LISTEN_ALL_NSID,
    NETLINK_NETFILTER,
    nft_generation,
    open_socket,
)
from reconciler.drivers.netlink.wire import (
    HDR,
    RTM_DELROUTE,
    RTM_NEWROUTE,
    SOL_NETLINK,
    split_messages,
)

#: what a sentinel can report dirty: a LiveState part to read again, "nsid:N" (one
#: namespace, by its nsid here), or EVERYTHING (an event may have been lost)
EVERYTHING = "*"


class Sentinel:
    """Something that can tell which part of the host changed since it was armed."""

    name = "sentinel"
    unit = EVERYTHING  # what ``changed()`` being true makes dirty

    def arm(self) -> None:
        """Called just before reading its part of the host: changes from now on count."""

    def changed(self) -> bool:
        raise NotImplementedError

    def dirty(self) -> set[str]:
        """Drain what happened since the last call; the parts to read again."""
        return {self.unit} if self.changed() else set()

    def rearm(self) -> None:
        """After ``dirty()`` said something, before that part is read again."""
        self.arm()

    def close(self) -> None:
        """Release what it holds."""


_CMSG_SPACE = socket.CMSG_SPACE(4)


def _only_routes(data: bytes) -> bool:
    """Does this datagram hold route notifications only?"""
    kinds = {HDR.unpack_from(raw)[1] for raw in split_messages(data)}
    return bool(kinds) and kinds <= {RTM_NEWROUTE, RTM_DELROUTE}


class NetlinkSentinel(Sentinel):
    """Link, address and route events of this namespace and of every namespace with an nsid."""

    name = "netlink"

    def __init__(self) -> None:
        sock = open_socket(ALL_GROUPS, rcvbuf=8 << 20)  # other tools' bursts must fit
        try:
            sock.setblocking(False)
            sock.setsockopt(SOL_NETLINK, NETLINK_LISTEN_ALL_NSID, 1)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def dirty(self) -> set[str]:
        """"links" for an event of this namespace, "nsid:N" for one of namespace N."""
        out: set[str] = set()
        while True:
            try:
                data, anc, _flags, _addr = self.sock.recvmsg(1 << 16, _CMSG_SPACE)
            except BlockingIOError:
                return out
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                out.add(EVERYTHING)  # the kernel dropped events: anything may have changed
                continue
            nsid = None
            for level, kind, payload in anc:
                if level == SOL_NETLINK and kind == NETLINK_LISTEN_ALL_NSID and len(payload) >= 4:
                    nsid = struct.unpack_from("=i", payload)[0]
            if nsid is not None:
                out.add(f"nsid:{nsid}")
            elif not _only_routes(data):  # host routes are not part of what is observed
                out.add("links")

    def arm(self) -> None:
        self.dirty()  # drop what is queued: the observation that follows sees it

    def rearm(self) -> None:
        """Nothing: ``dirty()`` drained exactly what it reported."""

    def close(self) -> None:
        self.sock.close()


_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x2, 0x4, 0x8


_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200


_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_Q_OVERFLOW, _IN_IGNORED = 0x400, 0x800, 0x4000, 0x8000


_IN_MASK = (_IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_FROM | _IN_MOVED_TO
            | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF)


_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC


class NetnsDirSentinel(Sentinel):
    """Names under /run/netns appearing, going or being re-tagged (inotify, no thread)."""

    name = "netns-dir"
    unit = "netns"

    def __init__(self, run_dir: str = netns.NETNS_RUN_DIR) -> None:
        self.run_dir = run_dir
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.fd = fd
        self.watching = self._add_watch()

    def _add_watch(self) -> bool:
        return int(self._libc.inotify_add_watch(self.fd, self.run_dir.encode(), _IN_MASK)) >= 0

    def changed(self) -> bool:
        seen = False
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            seen = seen or bool(data)
            off = 0
            while off + 16 <= len(data):  # struct inotify_event: wd, mask, cookie, len, name
                mask, name_len = struct.unpack_from("=4xI4xI", data, off)
                if mask & (_IN_IGNORED | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_Q_OVERFLOW):
                    self.watching = False  # the directory went (maybe came back): watch anew
                off += 16 + name_len
        if not self.watching:  # no watch when armed, or it died: a change by definition
            self.watching = self._add_watch()
            return True
        return seen

    def arm(self) -> None:
        self.changed()

    def close(self) -> None:
        os.close(self.fd)


class MountSentinel(Sentinel):
    """A namespace mounted, unmounted or replaced under /run/netns.

    ``poll`` on /proc/self/mountinfo wakes on any mount in this mount namespace
    (containers starting, other tools); only then is the table read, and only
    a change of the mounts under /run/netns (which namespace is where) counts.
    """

    name = "mounts"
    unit = "netns"

    def __init__(self, run_dir: str = netns.NETNS_RUN_DIR) -> None:
        self.prefix = run_dir.rstrip("/") + "/"
        self.fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLPRI | select.POLLERR)
        self.snapshot = self._netns_mounts()

    def _netns_mounts(self) -> frozenset[tuple[str, str, str]]:
        """(mount id, root, mount point) of /run/netns and of every mount below it."""
        with open("/proc/self/mountinfo") as fh:
            text = fh.read()
        out = set()
        for line in text.splitlines():
            f = line.split(" ", 5)
            if len(f) > 4 and (f[4] + "/").startswith(self.prefix):
                out.add((f[0], f[3], f[4]))
        return frozenset(out)

    def _signalled(self) -> bool:
        return any(ev & (select.POLLPRI | select.POLLERR) for _fd, ev in self.poller.poll(0))

    def changed(self) -> bool:
        return self._signalled() and self._netns_mounts() != self.snapshot

    def arm(self) -> None:
        self._signalled()
        self.snapshot = self._netns_mounts()

    def close(self) -> None:
        os.close(self.fd)


def nft_backend() -> bool:
    """Do iptables and ip6tables both use the nf_tables backend?"""
    return all(IptablesDriver(family).backend() == "nf_tables" for family in (4, 6))


class NftSentinel(Sentinel):
    """nf_tables commits (every iptables-nft change bumps the generation id)."""

    name = "nftables"
    unit = "firewall"

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                  NETLINK_NETFILTER)
        self.sock.settimeout(5.0)
        self.sock.bind((0, 0))
        self.seq = 0
        self.gen = self._read()

    def _read(self) -> int:
        self.seq += 1
        return nft_generation(self.sock, self.seq)

    def arm(self) -> None:
        self.gen = self._read()

    def changed(self) -> bool:
        return self._read() != self.gen

    def close(self) -> None:
        self.sock.close()

