"""What asks the watch loop for a pass when the host drifts: netlink, nf_tables, /run/netns,
Docker events.

They never decide anything: a relevant event only asks the watch loop for a
pass (level-triggered), which observes the real state and plans from it. So
filtering can be cheap and approximate; a spurious pass finds nothing to do.

Netlink is read with a plain ``AF_NETLINK`` socket subscribed to the link,
address and route groups of the network namespace the calling thread is in
(``reconcile --netns`` moves the whole process before any thread starts).
Message parsing is pure (:func:`parse_messages`) and tested on hand-built bytes.

See docs/decisions/018-coexistence-matrix.md.
See docs/decisions/029-drift-sources-side-by-side.md.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from reconciler.domain import nftable, ownership
from reconciler.domain.errors import ReconcilerError
from reconciler.drivers.netlink.listen import (
    GROUPS,
    RECV_BUFFER,
    dump_links,
    open_nft_events,
    open_socket,
)
from reconciler.drivers.netlink.parse import (
    NetlinkEvent,
    NftNotice,
    parse_messages,
    parse_nft_notices,
)
from reconciler.drivers.netlink.read import NetlinkReader
from reconciler.drivers.nsfs import NETNS_RUN_DIR
from reconciler.drivers.nswatch import IN_CREATE, IN_MOVED_TO, IN_NAMES, RunDirWatch
from reconciler.planner.hostspace import LiveOverlap, live_overlaps, owned_prefixes

log = logging.getLogger("reconciler.drift")


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
            if ev.what == "rule":
                return False  # other tools' policy routing: the address-space alarm's
            return ev.proto == ownership.ROUTE_PROTO


def _index_to_name(index: int) -> str | None:
    try:
        return socket.if_indextoname(index)
    except OSError:
        return None


class _SocketWatcher:
    """A subscription socket read in a thread of its own until ``stop``: the loop both
    watchers share (a lost event, ``ENOBUFS``, is one ``on_drift(overrun)``: look at
    everything again). Subclasses open the socket in :meth:`start` (the caller's thread
    and namespace, so a failure is reported there) and turn each datagram into drift."""

    thread_name = "drift"
    overrun = "overrun"
    label = "listener"

    def __init__(self, on_drift: Callable[[str], None], stop: threading.Event) -> None:
        self.on_drift = on_drift
        self.stop = stop
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _handle(self, data: bytes) -> None:
        raise NotImplementedError

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
                    self.on_drift(self.overrun)
                    continue
                log.warning("%s: %s", self.label, exc)
                self.stop.wait(1.0)
                continue
            self._handle(data)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._sock is not None:
            self._sock.close()


class NetlinkWatcher(_SocketWatcher):
    """Listens to rtnetlink notifications in a thread; calls ``on_drift(reason)`` for relevant ones.

    ``on_event``, when given, hears every event (relevant or not): the address-space
    alarm watches other tools' addresses and routes.
    The socket is opened by :meth:`start` in the caller's thread, so that a
    failure is reported there and the namespace is the caller's.
    """

    thread_name, overrun, label = "netlink-drift", "netlink overrun", "netlink listener"

    def __init__(self, on_drift: Callable[[str], None], stop: threading.Event,
                 drift_filter: DriftFilter | None = None, *,
                 on_event: Callable[[NetlinkEvent], object] | None = None) -> None:
        super().__init__(on_drift, stop)
        self.on_event = on_event
        self.filter = drift_filter or DriftFilter()

    def start(self) -> None:
        self._sock = open_socket(GROUPS)  # subscribe first, then dump: no gap for missed links
        for ev in dump_links():
            self.filter.learn(ev)
        self._start_thread()

    def set_names(self, names: Iterable[str]) -> None:
        self.filter.set_names(names)

    def _handle(self, data: bytes) -> None:
        for ev in parse_messages(data):
            if self.on_event is not None:
                self.on_event(ev)
            if self.filter.relevant(ev):
                verb = "del" if ev.deleted else "new"
                what = ev.name if ev.what == "link" and ev.name else f"ifindex {ev.index}"
                self.on_drift(f"netlink {verb}{ev.what} {what}")


#: the iptables tables we keep something in (``ip``/``ip6`` families of nf_tables under
#: iptables-nft; filter holds the mark shim in others' FORWARD and INPUT, filter and nat
#: the chains of earlier versions until the upgrade removes them): a commit that touches
#: one of them may have removed ours
IPTABLES_TABLES = frozenset({"filter", "nat"})
#: nfnetlink's family number of an ``inet`` table (NFPROTO_INET): our own table's
NFPROTO_INET = 1


class NftCommitFilter:
    """Which nf_tables commits may have touched our rules: pure, fed datagram by datagram.

    A commit's object notifications come before its NEWGEN; it is relevant when one
    of them names our table ``inet reconciler`` (domain.nftable) or an iptables table we
    keep something in, in the ``ip`` or ``ip6`` family (rules flushed, chains deleted,
    ``nft flush ruleset`` dropping the tables). Other tools' own tables (``inet
    firewalld``, ``ip6 kube-proxy``...) do not wake the loop.
    """

    def __init__(self, tables: frozenset[str] = IPTABLES_TABLES) -> None:
        self.tables = tables
        self._touched: set[str] = set()

    def feed(self, notices: Iterable[NftNotice]) -> list[str]:
        """Return reasons, one per relevant commit completed in these notices."""
        out = []
        for n in notices:
            if n.commit:
                if self._touched:
                    out.append("nftables commit to " + ", ".join(sorted(self._touched)))
                    self._touched.clear()
            elif n.family == NFPROTO_INET and n.table == nftable.TABLE:
                self._touched.add(f"{nftable.FAMILY} {nftable.TABLE}")
            elif n.family in (socket.AF_INET, socket.AF_INET6) and n.table in self.tables:
                self._touched.add(f"{'ip' if n.family == socket.AF_INET else 'ip6'} {n.table}")
        return out


class NftWatcher(_SocketWatcher):
    """Listens to nf_tables notifications in a thread; ``on_drift(reason)`` per relevant commit.

    This is how the watch loop hears a firewall reload on an iptables-nft host
    (``firewall-cmd --reload``, ``ufw reload``, a dockerd restart, ``iptables -F``,
    ``nft flush ruleset``) at once instead of at the next resync. Our own
    ``iptables-restore`` is heard too: its echo is one pass that finds nothing to do.
    iptables-legacy sends no notifications: there the interval heals. The socket
    is opened by :meth:`start` in the caller's thread and namespace.
    """

    thread_name, overrun, label = "nftables-drift", "nftables overrun", "nf_tables listener"

    def __init__(self, on_drift: Callable[[str], None], stop: threading.Event,
                 commit_filter: NftCommitFilter | None = None) -> None:
        super().__init__(on_drift, stop)
        self.filter = commit_filter or NftCommitFilter()

    def start(self) -> None:
        self._sock = open_nft_events()
        self._start_thread()

    def _handle(self, data: bytes) -> None:
        for reason in self.filter.feed(parse_nft_notices(data)):
            self.on_drift(reason)


def start_nft_watcher(on_drift: Callable[[str], None],
                      stop: threading.Event) -> tuple[NftWatcher | None, str]:
    """Start the watcher; return it and its line for the status's event sources; (None, why) when
    nf_tables cannot be heard here (no nf_tables, no permission): the interval heals then."""
    nft = NftWatcher(on_drift, stop)
    try:
        nft.start()
    except OSError as exc:
        log.info("nf_tables events unavailable (%s); relying on the interval", exc)
        return None, f"unavailable: {exc}"
    return nft, "listening"


class OverlapAlarm:
    """Foreign addresses and routes over prefixes we own, reported within a second.

    Address, route and rule events of the host (other than IPv6 link-local ones),
    and links going away, only wake it; in its own thread it then reads the host's
    links and its routes of every table an ``ip rule`` selects again (three dumps,
    not a pass), compares the owned prefixes
    -- owned addresses on our bridges, and the subnets of owned Docker networks
    the last pass saw -- with everything foreign
    (``planner.hostspace.live_overlaps``) and calls ``report`` with the current
    overlaps whenever they differ from the last report. It never touches
    anything: the foreign object is someone else's, and a plan shows the
    conflict. Checks are at least ``gap`` seconds apart.
    """

    def __init__(self, report: Callable[[list[LiveOverlap]], None], stop: threading.Event, *,
                 reader: Callable[[], NetlinkReader] = NetlinkReader, gap: float = 0.2) -> None:
        self.report = report
        self.stop = stop
        self.gap = gap
        self._make_reader = reader
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._docker: tuple[list[tuple[Any, str, str | None]], frozenset[str]] = ([],
                                                                                  frozenset())
        self._last: list[LiveOverlap] | None = None
        self._thread = threading.Thread(target=self._run, name="overlap-alarm", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.poke()

    def set_docker(self, prefixes: Sequence[tuple[Any, str, str | None]],
                   bridges: Iterable[str]) -> None:
        """Set the owned Docker networks' subnets and bridges, as the last pass saw them."""
        with self._lock:
            self._docker = (list(prefixes), frozenset(bridges))

    def hear(self, ev: NetlinkEvent) -> bool:
        """Hear a netlink event of the host; True when it woke the check (addresses, routes, rules
        and links going away do; IPv6 link-local ones and new or changed links do not)."""
        if ev.link_local or (ev.what == "link" and not ev.deleted):
            return False
        self._wake.set()
        return True

    def poke(self) -> None:
        """Check again soon (after a pass: what we own may have changed)."""
        self._wake.set()

    def check(self, reader: NetlinkReader) -> list[LiveOverlap]:
        with self._lock:
            docker, bridges = self._docker
        links = reader.dump_links()
        routes = reader.dump_host_routes()
        owned = [*owned_prefixes(links.values()), *docker]
        return live_overlaps(owned, links.values(), routes, bridges) if owned else []

    def _run(self) -> None:
        reader: NetlinkReader | None = None
        try:
            while not self.stop.is_set():
                if not self._wake.wait(0.5):
                    continue
                self._wake.clear()
                try:
                    if reader is None:
                        reader = self._make_reader()
                    found = self.check(reader)
                except (OSError, ReconcilerError) as exc:
                    log.warning("address-space alarm: %s", exc)
                    if reader is not None:
                        reader.close()
                        reader = None
                    self.stop.wait(1.0)
                    self._wake.set()
                    continue
                if found != self._last:
                    self._last = found
                    self.report(found)
                self.stop.wait(self.gap)
        finally:
            if reader is not None:
                reader.close()

    def close(self) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)


class NetnsDirWatcher:
    """Inotify on /run/netns: an allocation namespace unmounted (``ip netns del``) or re-made.

    Unmounting sends no netlink event, and the namespace may even live on
    (something still holds it), so its veth does not vanish either. A thread
    waits on the inotify descriptor (``drivers.nswatch``, which the plan view's
    sentinel reads too); a directory made, removed or replaced later is watched
    again, and a watch lost and found again asks for a pass (anything may have
    changed in between).
    """

    def __init__(self, on_drift: Callable[[str], None], run_dir: str = NETNS_RUN_DIR, *,
                 held: Callable[[], Iterable[str]] = frozenset,
                 stop: threading.Event | None = None, retry: float = 1.0) -> None:
        """``held``: names that matter besides ``set_names``, asked at event time (the
        namespaces an observer keeps a socket into, which a pass may have just opened)."""
        self.on_drift = on_drift
        self.held = held
        self.stop = stop or threading.Event()
        self.retry = retry
        self._closed = threading.Event()
        self._names: frozenset[str] = frozenset()
        self.watch = RunDirWatch(run_dir)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._warned = 0
        self._thread = threading.Thread(target=self._run, name="netns-drift", daemon=True)
        self._thread.start()

    def _held(self, name: str) -> bool:
        try:
            return name in frozenset(self.held())
        except RuntimeError:  # changed while we looked (another thread): assume it matters
            return True

    def set_names(self, names: Iterable[str]) -> None:
        self._names = frozenset(names)

    def _run(self) -> None:
        lost = not self.watch.watching
        while not (self.stop.is_set() or self._closed.is_set()):
            try:
                lost = self._step(lost)
            except Exception as exc:  # one bad event must not end the watch: log, go on
                log.warning("watching %s: %s: %s", self.watch.run_dir, type(exc).__name__, exc)
                self._closed.wait(self.retry)

    def _step(self, lost: bool) -> bool:
        """Wait for events once and report them; whether the watch is lost now."""
        if not self.watch.watching:
            if not self.watch.rewatch():
                if self.watch.error not in (0, errno.ENOENT) and self._warned != self.watch.error:
                    self._warned = self.watch.error
                    log.warning("cannot watch %s: %s", self.watch.run_dir,
                                os.strerror(self.watch.error))
                self._closed.wait(self.retry)  # no /run/netns yet: nothing of ours lives there
                return True
            if lost:
                self.on_drift("netns directory watched again")
        ready, _w, _x = select.select([self.watch.fileno(), self._wake_r], [], [], 0.5)
        if self.watch.fileno() not in ready:
            return False
        for mask, name in self.watch.drain():
            if not mask & IN_NAMES or not name:
                continue
            if name in self._names or self._held(name):
                what = "created" if mask & (IN_CREATE | IN_MOVED_TO) else "deleted"
                self.on_drift(f"netns {what} {name}")
        if not self.watch.watching:
            self.on_drift("netns directory replaced or events lost")
            return True
        return False

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():  # its descriptors stay open rather than be reused under it
            log.warning("the /run/netns watcher did not stop within 2 s")
            return
        self.watch.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


DOCKER_ACTIONS = frozenset({"create", "destroy", "connect", "disconnect", "remove", "update"})


def docker_event_reason(event: Mapping[str, Any], names: frozenset[str]) -> str | None:
    """Return a reason to run a pass when a Docker event touches a desired network, else None."""
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


def _events_client() -> Any:
    # the Docker SDK is ~80 ms and ~8 MB resident to import (the agent's RSS went from 43 to
    # 51 MB with it at the top): only agents that declare Docker networks start this watcher
    from reconciler.drivers.docker.events import events_client  # noqa: PLC0415

    return events_client()


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
        self._factory = client_factory or _events_client
        self._names: frozenset[str] = frozenset()
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self.connected = False

    def set_names(self, names: Iterable[str]) -> None:
        self._names = frozenset(names)

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

