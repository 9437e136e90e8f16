"""Sentinels: what tells the plan view which part of the host changed since it was read.

See ``reconciler.agent.planview.view`` for how they are used.

See docs/decisions/029-drift-sources-side-by-side.md.
"""

from __future__ import annotations

import errno
import socket
import struct

from reconciler.drivers.iptables import IptablesDriver
from reconciler.drivers.netlink.listen import (
    ALL_GROUPS,
    NETLINK_LISTEN_ALL_NSID,
    nft_generation,
    open_nft_socket,
    open_socket,
)
from reconciler.drivers.netlink.wire import (
    HDR,
    RTM_DELROUTE,
    RTM_DELRULE,
    RTM_NEWROUTE,
    RTM_NEWRULE,
    SOL_NETLINK,
    split_messages,
)
from reconciler.drivers.nsfs import NETNS_RUN_DIR
from reconciler.drivers.nswatch import MountWatch, RunDirWatch, netns_mounts

#: what a sentinel can report dirty: a LiveState part to read again, "nsid:N" (one
#: namespace, by its nsid here), or EVERYTHING (an event may have been lost)
EVERYTHING = "*"


class Sentinel:
    """Something that can tell which part of the host changed since it was armed."""

    name = "sentinel"
    unit = EVERYTHING  # what ``changed()`` being true makes dirty

    def arm(self) -> None:
        """Arm just before its part of the host is read: changes from now on count."""

    def changed(self) -> bool:
        raise NotImplementedError

    def dirty(self) -> set[str]:
        """Drain what happened since the last call; the parts to read again."""
        return {self.unit} if self.changed() else set()

    def rearm(self) -> None:
        """Rearm after ``dirty()`` said something, before that part is read again."""
        self.arm()

    def close(self) -> None:
        """Release what it holds."""


_CMSG_SPACE = socket.CMSG_SPACE(4)


def _only_routes(data: bytes) -> bool:
    """Tell whether this datagram holds route (or rule: which tables count) notifications
    only."""
    kinds = {HDR.unpack_from(raw)[1] for raw in split_messages(data)}
    return bool(kinds) and kinds <= {RTM_NEWROUTE, RTM_DELROUTE, RTM_NEWRULE, RTM_DELRULE}


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
        """Return "links" for a link or address event of this namespace, "routes" for a datagram of
        its route events only, "nsid:N" for an event of namespace N."""
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
            else:  # host routes: the address space declared prefixes are checked against
                out.add("routes" if _only_routes(data) else "links")

    def arm(self) -> None:
        self.dirty()  # drop what is queued: the observation that follows sees it

    def rearm(self) -> None:
        """Do nothing: ``dirty()`` drained exactly what it reported."""

    def close(self) -> None:
        self.sock.close()


class NetnsDirSentinel(Sentinel):
    """Names under /run/netns appearing, going or being re-tagged (inotify, no thread)."""

    name = "netns-dir"
    unit = "netns"

    def __init__(self, run_dir: str = NETNS_RUN_DIR) -> None:
        self.watch = RunDirWatch(run_dir)

    def changed(self) -> bool:
        seen = bool(self.watch.drain())
        if not self.watch.watching:  # no watch when armed, or it died: a change by definition
            self.watch.rewatch()
            return True
        return seen

    def arm(self) -> None:
        self.changed()

    def close(self) -> None:
        self.watch.close()


class MountSentinel(Sentinel):
    """A namespace mounted, unmounted or replaced under /run/netns.

    ``poll`` on /proc/self/mountinfo wakes on any mount in this mount namespace
    (containers starting, other tools); only then is the table read, and only
    a change of the mounts under /run/netns (which namespace is where) counts.
    """

    name = "mounts"
    unit = "netns"

    def __init__(self, run_dir: str = NETNS_RUN_DIR) -> None:
        self.run_dir = run_dir
        self.watch = MountWatch()
        self.snapshot = netns_mounts(run_dir)

    def changed(self) -> bool:
        return self.watch.signalled() and netns_mounts(self.run_dir) != self.snapshot

    def arm(self) -> None:
        self.watch.signalled()
        self.snapshot = netns_mounts(self.run_dir)

    def close(self) -> None:
        self.watch.close()


def nft_backend() -> bool:
    """Tell whether iptables and ip6tables both use the nf_tables backend."""
    return all(IptablesDriver(family).backend() == "nf_tables" for family in (4, 6))


class NftSentinel(Sentinel):
    """nf_tables commits (every iptables-nft change bumps the generation id)."""

    name = "nftables"
    unit = "firewall"

    def __init__(self) -> None:
        self.sock = open_nft_socket()
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

