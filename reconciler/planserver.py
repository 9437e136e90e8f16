"""The plan agent: `reconcile watch` answers `reconcile plan` from one event-driven view.

A fresh `reconcile plan` process pays an interpreter, the imports, a netlink
socket into every allocation namespace and a parse of every message, on every
run: about a second at 1000 allocations. The agent instead keeps the last
observation and proves, on each request, that nothing it saw has changed since:

* **netlink**: one rtnetlink socket subscribed to link, address and route
  events with ``NETLINK_LISTEN_ALL_NSID``, so it also hears every namespace
  that has an nsid here (the kernel gives one to each namespace a veth crosses
  into: all our allocation namespaces);
* **/run/netns**: inotify (names created, deleted, renamed; the ownership xattr)
  and ``poll`` on /proc/self/mountinfo, then which namespace is mounted where
  under /run/netns (other mounts on the host do not count);
* **nftables**: the ruleset generation id, bumped by every commit (the
  iptables-nft backend); with iptables-legacy the rules are read every time;
* whatever has no reliable change notification is read again on every
  request: sysctls, listening sockets, ``lo`` of a foreign namespace without an
  nsid, and Docker (its event log keeps 256 events and forgets them on a
  restart; one list call when no network is declared).

Each sentinel names the part of the live state its news is about, and only
that part is read again: the host's links (an event of this namespace), one
allocation namespace (an event carrying its nsid; events of namespaces not
under /run/netns are not about anything observed), every allocation namespace
(/run/netns changed, or a foreign namespace's ``lo`` took our mark), the
rules. When what was read again equals what was kept, the plan made
from it still stands; otherwise it is made again. So other tools' containers
coming and going cost a re-read of a part, not of the host.

Notifications are queued in the kernel by the very syscall that makes the
change, so draining the sockets at request time sees every change that finished
before the request. Any doubt -- a lost event (ENOBUFS), an allocation
namespace without an nsid, an error in a sentinel -- means observing
everything again, exactly as a fresh process would. Desired-state files come from the client
(read in its own directory); they are parsed again only when their bytes change.

The socket is ``/run/reconciler/plan-<netns inode>.sock``, mode 0600, one
server per namespace (an flock), answering root only.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from reconciler import drift, planclient
from reconciler.drivers import netns
from reconciler.drivers.iptables import IptablesDriver
from reconciler.drivers.links import (
    NLM_F_REQUEST,
    NLMSG_ERROR,
    SOL_NETLINK,
    parse_attrs,
    split_messages,
)
from reconciler.errors import ConfigError, DriverError, ReconcilerError
from reconciler.live import LiveNetns, LiveState
from reconciler.model import DesiredState
from reconciler.observe import Observer
from reconciler.paths import expand_paths, read_bytes
from reconciler.plan import Plan
from reconciler.planner import PlanOptions, links_that_matter, make_plan

log = logging.getLogger("reconciler.planserver")

# -------------------------------------------------------------------- sentinels

NETLINK_LISTEN_ALL_NSID = 8
NETLINK_NETFILTER = 12
RTNLGRP_NSID = 28
#: the drift watcher's link, address and route groups, and nsid changes
GROUPS = drift.GROUPS | (1 << (RTNLGRP_NSID - 1))

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
    kinds = {_NLHDR.unpack_from(raw)[1] for raw in split_messages(data)}
    return bool(kinds) and kinds <= {drift.RTM_NEWROUTE, drift.RTM_DELROUTE}


class NetlinkSentinel(Sentinel):
    """Link, address and route events of this namespace and of every namespace with an nsid."""

    name = "netlink"

    def __init__(self) -> None:
        sock = drift.open_socket(GROUPS, rcvbuf=8 << 20)  # other tools' bursts must fit
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


_NFNL_SUBSYS_NFTABLES, _NFT_MSG_NEWGEN, _NFT_MSG_GETGEN, _NFTA_GEN_ID = 10, 15, 16, 1
_NLHDR = struct.Struct("=IHHII")


def nft_generation(sock: socket.socket, seq: int) -> int:
    """The nf_tables ruleset generation of this namespace (NFT_MSG_GETGEN)."""
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, 0)
    sock.send(_NLHDR.pack(16 + len(body), (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETGEN,
                          NLM_F_REQUEST, seq, 0) + body)
    while True:
        for raw in split_messages(sock.recv(1 << 16)):
            _len, kind, _flags, mseq, _pid = _NLHDR.unpack_from(raw)
            if mseq != seq:
                continue
            if kind == NLMSG_ERROR:
                raise OSError(-struct.unpack_from("=i", raw, 16)[0], "nf_tables generation")
            if kind == (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWGEN:
                gen = parse_attrs(raw, 20).get(_NFTA_GEN_ID)  # after nlmsghdr + nfgenmsg
                if gen is None or len(gen) < 4:
                    raise OSError(errno.EPROTO, "nf_tables generation: no id")
                return int(struct.unpack_from("!I", gen)[0])


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


# -------------------------------------------------------------------- the cached view


class LiveView:
    """The last observation, kept true part by part (see the module docstring).

    ``plan`` answers how it got its live state: "cached" (no sentinel said
    anything and what has no sentinel read the same), "refreshed" (only the
    parts sentinels named were read again: host links, one namespace, all
    namespaces, the firewall, Docker) or "observed" (everything read again).
    """

    def __init__(self, observer: Observer, sentinels: list[Sentinel], *,
                 firewall_volatile: bool, docker_volatile: bool,
                 list_names: Callable[[], list[str]] = netns.list_names,
                 planner: Callable[..., Plan] = make_plan) -> None:
        self.observer = observer
        self.list_names = list_names
        self.make_plan = planner
        self.sentinels = sentinels
        self.firewall_volatile = firewall_volatile
        self.docker_volatile = docker_volatile
        self.live: LiveState | None = None
        self.key: Any = None
        self.cacheable = False
        self.by_nsid: dict[int, set[str]] = {}  # nsid here -> its names under /run/netns
        self.unwatched: dict[str, str | None] = {}  # foreign, no nsid -> lo alias
        self.foreign: dict[str, str | None] = {}  # foreign with an nsid -> lo alias
        self.plans: dict[Any, Plan] = {}

    # -- full observation ---------------------------------------------------------------

    def _observe(self, desired: DesiredState, key: Any) -> None:
        self.live, self.key, self.plans = None, None, {}  # until this observation succeeds
        for s in self.sentinels:
            s.arm()
        before = self._survey(desired)
        live = self.observer.observe(desired)
        self._adopt(before, live.netns)
        self.live, self.key = live, key

    def _survey(self, desired: DesiredState) -> dict[str, tuple[int | None, str | None]]:
        """Before reading namespaces: each name's nsid, and the ``lo`` alias of undeclared ones.

        Taken before the read, so that any change after it is announced (nsid) or
        noticed (alias re-read): a namespace that had no nsid when it was read
        could have changed unannounced in between.
        """
        nl = self.observer.ops.netlink
        out: dict[str, tuple[int | None, str | None]] = {}
        for name in self.list_names():
            try:
                nsid = nl.get_nsid(name)
            except (DriverError, OSError):
                nsid = None
            out[name] = (nsid, None if name in desired.allocs else nl.peek_lo_alias(name))
        return out

    def _adopt(self, survey: dict[str, tuple[int | None, str | None]],
               observed: dict[str, LiveNetns]) -> None:
        """Which nsid is which names; which namespaces cannot be heard and must be re-read.

        An allocation namespace of ours without an nsid sends us no events:
        nothing is cached then. A foreign one without an nsid has its ``lo``
        alias (what would make it ours) read again on every request.
        """
        self.observer.ops.netlink.prune_cache(())  # a socket would keep a namespace alive
        self.by_nsid, self.unwatched, self.foreign = {}, {}, {}
        self.cacheable = True
        for name, (nsid, alias) in survey.items():
            ours = name in observed
            if nsid is not None:
                self.by_nsid.setdefault(nsid, set()).add(name)  # one namespace, many names
                if not ours:
                    self.foreign[name] = alias
            elif ours and observed[name].usable:
                log.debug("plan view not cached: namespace %s has no nsid", name)
                self.cacheable = False
            elif not ours:
                self.unwatched[name] = alias
        if any(ns.usable and name not in survey for name, ns in observed.items()):
            self.cacheable = False  # appeared between the survey and the read

    # -- refresh ------------------------------------------------------------------------

    def _refresh(self, desired: DesiredState) -> dict[str, Any] | None:
        """The LiveState parts that may have changed, read again; None: observe everything."""
        assert self.live is not None
        dirty: set[str] = set()
        for s in self.sentinels:  # drain every one before reading anything
            got = s.dirty()
            if got:
                dirty |= got
                s.rearm()
        if EVERYTHING in dirty:
            return None
        nl = self.observer.ops.netlink
        namespaces: set[str] = set()
        for unit in [u for u in dirty if u.startswith("nsid:")]:
            for name in self.by_nsid.get(int(unit[5:]), ()):  # none: not under /run/netns
                if name not in self.live.netns:
                    if nl.peek_lo_alias(name) != self.foreign.get(name):
                        dirty.add("netns")  # a foreign namespace took our mark
                elif name in desired.allocs:
                    namespaces.add(name)
                else:
                    dirty.add("netns")  # ours by its mark only: is it still?
        if any(nl.peek_lo_alias(n) != alias for n, alias in self.unwatched.items()):
            dirty.add("netns")
        fresh: dict[str, Any] = self.observer.observe_unannounced(desired)
        if "links" in dirty:
            fresh["links"] = nl.dump_links()
        if "firewall" in dirty or self.firewall_volatile:
            fresh["firewall4"] = self.observer.ops.iptables(4).observe()
            fresh["firewall6"] = self.observer.ops.iptables(6).observe()
        if "docker" in dirty or self.docker_volatile:
            fresh["docker"] = self.observer.observe_docker(desired)
        if "netns" in dirty:
            survey = self._survey(desired)
            fresh["netns"] = self.observer.observe_allocs(desired, self.live.host_id)
            self._adopt(survey, fresh["netns"])
        elif namespaces:
            again = self.observer.observe_namespaces(namespaces)
            nl.prune_cache(())
            if set(again) != namespaces:
                return None  # one vanished without a /run/netns event: be safe
            fresh["netns"] = {**self.live.netns, **again}
        return fresh

    # -- answer -------------------------------------------------------------------------

    def plan(self, desired: DesiredState, key: Any, options: PlanOptions) -> tuple[Plan, str]:
        """The plan, and how its live state was had: "cached", "refreshed" or "observed"."""
        how = "observed"
        if key == self.key and self.live is not None and self.cacheable:
            try:
                fresh = self._refresh(desired)
            except Exception as exc:  # a sentinel that cannot tell may have eaten an event
                log.debug("plan view dropped: %s: %s", type(exc).__name__, exc)
                fresh = None
            if fresh is not None:
                live = self.live
                changed = {k for k, v in fresh.items() if getattr(live, k) != v}
                if changed:
                    new = dataclasses.replace(live, **fresh)
                    if changed != {"links"} or (links_that_matter(desired, new)
                                                != links_that_matter(desired, live)):
                        self.plans = {}  # else: only other tools' links moved
                    self.live = new
                how = "refreshed" if not self.plans else "cached"
        if how == "observed":
            self._observe(desired, key)
        assert self.live is not None
        okey = (options.prune, tuple(sorted(options.adopt)), options.force_replace)
        plan = self.plans.get(okey)
        if plan is None:
            plan = self.make_plan(desired, self.live, options, desired.file_hashes)
            self.plans[okey] = plan
        return plan, how

    def close(self) -> None:
        for s in self.sentinels:
            with contextlib.suppress(OSError):
                s.close()


def build_view(observer: Observer | None = None) -> LiveView:
    """The sentinels this host supports; what has none is read on every request."""
    sentinels: list[Sentinel] = [NetlinkSentinel(), NetnsDirSentinel(), MountSentinel()]
    firewall_volatile = True
    if nft_backend():
        try:
            sentinels.append(NftSentinel())
            firewall_volatile = False
        except OSError as exc:
            log.info("nf_tables generation unavailable (%s): rules are read per plan", exc)
    # Docker is asked on every request (one list call, or an inspect per declared network):
    # its event log keeps 256 events and forgets them on a restart, so "no event since"
    # proves nothing
    return LiveView(observer or Observer(), sentinels, firewall_volatile=firewall_volatile,
                    docker_volatile=True)


# -------------------------------------------------------------------- the server


class Declined(Exception):
    """This request is for the client's own CLI (the reason goes back to it)."""


class PlanServer:
    """Answers plan requests on the agent's unix socket, one at a time, in one thread."""

    def __init__(self, stop: threading.Event, *,
                 view_factory: Callable[[], LiveView] = build_view,
                 on_answer: Callable[[str], None] | None = None) -> None:
        self.stop = stop
        self.on_answer = on_answer or (lambda result: None)
        self.net = os.stat("/proc/thread-self/ns/net").st_ino
        self.mnt = os.stat("/proc/self/ns/mnt").st_ino
        self.path = planclient.socket_path(self.net)
        self.code = planclient.code_id()
        self.env = planclient.current_env()
        self._view_factory = view_factory
        self.view: LiveView | None = None
        self._desired: dict[Any, DesiredState] = {}
        self._sock: socket.socket | None = None
        self._lock_fd: int | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._parser: Any = None
        self._warm: tuple[tuple[str, ...], str | None] | None = None
        self._warm_key: Any = None
        self.tools: dict[str, str | None] = {}

    def start(self) -> bool:
        """Bind and serve; False (logged) when another agent serves this namespace."""
        os.makedirs(planclient.RUN_DIR, mode=0o755, exist_ok=True)
        lock_path = self.path[: -len(".sock")] + ".lock"
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                log.warning("another agent already answers plans for this namespace (%s)",
                            self.path)
                return False
            try:
                if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # locked a file its last holder had already removed: take the new one
        self._lock_fd = fd
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale one: we hold the lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        sock.listen(16)
        sock.settimeout(0.5)
        self._sock = sock
        self.view = self._view_factory()
        self.tools = planclient.tool_paths()
        self._thread = threading.Thread(target=self._serve, name="plan-server", daemon=True)
        self._thread.start()
        log.info("answering `reconcile plan` on %s", self.path)
        return True

    def _serve(self) -> None:
        assert self._sock is not None
        try:
            while not (self.stop.is_set() or self._closed.is_set()):
                self._warm_up()
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError as exc:  # e.g. EMFILE: wait, do not die with the socket bound
                    log.warning("plan server: accept: %s", exc)
                    self._closed.wait(0.5)
                    continue
                with conn:
                    try:
                        self._handle(conn)
                    except Exception as exc:  # one bad request must not end the server
                        log.warning("plan request failed: %s: %s", type(exc).__name__, exc)
        finally:
            self._unbind()  # at once: clients must not wait for an answer that cannot come

    def warm(self, paths: tuple[str, ...], hostname: str | None) -> None:
        """Observe for these files when idle, so the first plan of them is answered fast.

        The agent calls this after its converged passes with its own files:
        `reconcile plan /etc/reconciler` on the host then finds the view ready.
        A view that serves other files (a client's) is left alone.
        """
        self._warm = (paths, hostname)

    def _warm_up(self) -> None:
        job, self._warm = self._warm, None
        if job is None or self.view is None:
            return
        paths, hostname = job
        try:
            files = expand_paths(paths)
            blobs = [read_bytes(f) for f in files]
            desired, key = self._load([(f, os.path.abspath(f)) for f in files], blobs,
                                      hostname if hostname is not None
                                      else socket.gethostname())
            # only into an empty view, or one that holds the agent's files: never evict
            # what a client plans with other files
            if self.view.live is None or self.view.key in (None, self._warm_key):
                if key != self.view.key or self.view.live is None:
                    self.view.plan(desired, key, PlanOptions())
                self._warm_key = key
        except Exception as exc:  # only speed is at stake
            log.debug("plan view warm-up: %s: %s", type(exc).__name__, exc)

    def _unbind(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(30.0)
        if planclient.peer_uid(conn) not in (0, os.geteuid()):
            planclient.send_message(conn, {"status": "declined", "why": "root only"})
            return
        request = planclient.recv_message(conn, limit=1 << 20)
        files = request.get("files")
        if not isinstance(files, list):
            raise ValueError("no file list")
        blobs = []
        for entry in files:
            size = int(entry[2])
            if not 0 <= size <= planclient.MAX_REQUEST_FILE:
                raise ValueError("file size out of range")
            blobs.append(planclient._recv_exact(conn, size))
        conn.sendall(planclient.ACK)
        try:
            reply = self.answer(request, blobs)
        except Declined as exc:
            reply = {"status": "declined", "why": str(exc)}
        self.on_answer(reply["view"] if reply["status"] == "ok" else "declined")
        planclient.send_message(conn, reply)

    def answer(self, request: dict[str, Any], blobs: list[bytes]) -> dict[str, Any]:
        """The reply to one request (status "ok"), or raise Declined."""
        from reconciler import cli

        expect = {"protocol": planclient.PROTOCOL, "code": self.code, "mnt": self.mnt,
                  "net": self.net, "env": self.env}
        for field, value in expect.items():
            if request.get(field) != value:
                raise Declined(f"the agent runs with another {field}")
        tools = planclient.tool_paths()
        if request.get("tools") != tools:
            raise Declined("the agent finds other iptables tools (PATH)")
        if tools != self.tools:  # e.g. update-alternatives switched the iptables backend
            assert self.view is not None
            self.view.close()
            with contextlib.suppress(Exception):
                self.view.observer.ops.close()
            self.view, self.tools = self._view_factory(), tools
        if self._parser is None:
            self._parser = cli.build_parser()  # 3 ms: once
        parser = self._parser
        try:
            args = parser.parse_args(["plan", *request["argv"]])
        except SystemExit:
            raise Declined("the CLI reports usage errors") from None
        if list(args.paths) != request.get("paths"):
            raise Declined("paths parsed differently")
        try:
            options = cli._plan_options(args)
            desired, key = self._load(
                [(str(e[0]), str(e[1])) for e in request["files"]], blobs,
                args.hostname if args.hostname is not None else str(request.get("hostname")))
        except ConfigError:
            raise Declined("the CLI reports configuration errors") from None
        assert self.view is not None
        try:
            plan, how = self.view.plan(desired, key, options)
        except ReconcilerError as exc:
            raise Declined(f"the CLI reports this error: {exc}") from None
        text = cli.plan_text(plan, args.output, colour=bool(request.get("colour")),
                             verbose=int(request.get("verbose", 0)) > 0)
        reply: dict[str, Any] = {"status": "ok", "stdout": text, "rc": cli._plan_exit(plan),
                                 "view": how}
        if args.out:
            reply["out_json"] = cli.plan_text(plan, "json", colour=False, verbose=False)
        return reply

    def _load(self, entries: list[tuple[str, str]], blobs: list[bytes],
              host: str) -> tuple[DesiredState, Any]:
        """The desired state of these files ((name, absolute path) and bytes), and its key."""
        from reconciler.loader import load_sources

        key = (tuple((n, a, hashlib.sha256(b).hexdigest())
                     for (n, a), b in zip(entries, blobs, strict=True)), host)
        desired = self._desired.get(key)
        if desired is None:
            desired = load_sources([(n, a, b) for (n, a), b in zip(entries, blobs, strict=True)],
                                   hostname=host)
            self._desired = {key: desired}  # the last one only: files change, memory must not grow
        return desired, key

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._unbind()
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path[: -len(".sock")] + ".lock")
            os.close(self._lock_fd)
        if self.view is not None:
            self.view.close()
            with contextlib.suppress(Exception):
                self.view.observer.ops.close()
