"""Observation: read the live state through drivers into one ``LiveState`` value. Read-only."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from reconciler.domain.errors import DriverError
from reconciler.domain.live import (
    LiveDocker,
    LiveLink,
    LiveNeighbour,
    LiveNetns,
    LiveRoute,
    LiveState,
)
from reconciler.domain.model import DesiredState
from reconciler.domain.ownership import ZERO_MAC, alloc_ns_marks, alloc_veth_name, bridge_mac
from reconciler.drivers import netns, nsfs, sysctl, sysfsnet
from reconciler.drivers.docker import rawapi
from reconciler.drivers.nsfs import current_id
from reconciler.drivers.procfs import listening_ports
from reconciler.engine import leases
from reconciler.engine.handles import HostHandles
from reconciler.planner import nftview

#: sysctls every plan may need to compare
SYSCTL_KEYS = ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding",
               # the neighbour tables' hard limits, for all namespaces at once (only the
               # initial namespace shows them: a sandbox reads none)
               "net/ipv4/neigh/default/gc_thresh3", "net/ipv6/neigh/default/gc_thresh3")

log = logging.getLogger("reconciler")


class Observer:
    """Holds driver handles (sockets) across passes; ``observe`` is read-only."""

    def __init__(self, handles: HostHandles | None = None) -> None:
        self.handles = handles or HostHandles()
        #: (name, ifindex, MAC) of bridges seen with their MAC set: it stays set (nothing
        #: turns NET_ADDR_SET back), so they are not asked again while they are the same
        self._pinned: set[tuple[str, int, str | None]] = set()
        #: the scope whose lease file is read (``docker_scope``), found on first use
        self._scope: str | None = None
        #: the lease file's stamp and what reading it gave (``observe_leases``)
        self._leases: tuple[tuple[int, int, int] | None,
                            tuple[dict[str, dict[str, Any]], str | None]] = (
            None, ({}, None))

    def observe(self, desired: DesiredState) -> LiveState:
        # the two iptables saves (earlier versions' chains, to convert) run in their own
        # processes while the kernel is read here
        saves = [self.handles.iptables(family).start_observe() for family in (4, 6)]
        try:
            links = self.observe_links(desired)
            host_id = current_id()
            allocs = self.observe_allocs(desired, host_id, links)
            fields: dict[str, Any] = {
                "host_id": host_id,
                "links": links,
                "neighbours": self.observe_neighbours(desired, links),
                "netns": allocs,
                "peer_namespaces": self.observe_peer_namespaces(desired, links, allocs),
                "routes": self.observe_routes(desired),
                **self.observe_docker_parts(desired),
                **self.observe_unannounced(desired),
                **self.observe_leases(),
            }
        except BaseException:
            for finish in saves:  # no save left running or unreaped behind the error
                with contextlib.suppress(Exception):
                    finish()
            raise
        fields["old4"], fields["old6"] = (finish() for finish in saves)
        fields.update(self.observe_table())
        return dataclasses.replace(LiveState(), **fields)

    def observe_table(self) -> dict[str, Any]:
        """Read our nftables table back: the entries, and their rule form for each family."""
        table = self.handles.nft.observe()
        return {"table": table, "firewall4": nftview.view(table, 4),
                "firewall6": nftview.view(table, 6)}

    def observe_firewall(self) -> dict[str, Any]:
        """Read our table and the iptables chains of earlier versions (the plan agent)."""
        return {**self.observe_table(), "old4": self.handles.iptables(4).observe(),
                "old6": self.handles.iptables(6).observe()}

    def observe_leases(self) -> dict[str, Any]:
        """Read the scope's lease table (``engine/leases``): the ``leases`` and
        ``leases_problem`` fields of a LiveState. Nothing is made or written."""
        if self._scope is None:
            self._scope = docker_scope()
        stamp = leases.stamp(self._scope)
        if stamp is None or stamp != self._leases[0]:
            # read again only when the file changed (1000 allocations: ~130 kB, ~17 ms)
            self._leases = (stamp, leases.read(self._scope))
        table, problem = self._leases[1]
        return {"leases": {k: dict(v) for k, v in table.items()}, "leases_problem": problem}

    def forget_leases(self) -> None:
        """Read the lease file again next time (this process just wrote it)."""
        self._leases = (None, ({}, None))

    def observe_links(self, desired: DesiredState) -> dict[str, LiveLink]:
        """Observe every link here, and for the declared bridges whether their MAC is set.

        A bridge with the MAC we create bridges with was made by us, so it is set;
        one with 00:00:00:00:00:00 has no port and follows them. Only the others
        (bridges made by versions that did not set it) are asked (``sysfsnet``).
        """
        links = self.handles.netlink.dump_links()
        ask: dict[str, sysfsnet.Seen] = {}
        for name in desired.bridges:
            lk = links.get(name)
            if lk is None or lk.kind != "bridge":
                continue
            if lk.mac == bridge_mac(name) or (name, lk.index, lk.mac) in self._pinned:
                links[name] = dataclasses.replace(lk, mac_pinned=True)
            elif lk.mac in (None, ZERO_MAC):
                links[name] = dataclasses.replace(lk, mac_pinned=False)
            else:
                ask[name] = (lk.index, lk.mac)
        try:
            answers = sysfsnet.mac_is_set(ask)
        except OSError as e:
            log.debug("bridge MACs not checked: %s", e)
            answers = {}
        for asked, pinned in answers.items():
            if pinned is not None:
                lk = links[asked]
                links[asked] = dataclasses.replace(lk, mac_pinned=pinned)
                if pinned:
                    self._pinned.add((asked, lk.index, lk.mac))
        return links

    def observe_neighbours(self, desired: DesiredState,
                           links: dict[str, LiveLink]) -> tuple[LiveNeighbour, ...]:
        """Observe the neighbour entries on the declared bridges: an entry for an allocation's
        address that names another MAC than its ``eth0`` is stale, and one of ours for an address no
        allocation has any more is deleted (the kernel never collects ours). Read with no allocation
        declared too: the last ones pruned leave theirs.

        Not announced to the plan agent (no neighbour events are heard): it reads them
        on every request, one dump (none without a declared bridge).
        """
        return self.handles.netlink.dump_neighbours(
            lk.index for name in desired.bridges
            if (lk := links.get(name)) is not None and lk.kind == "bridge")

    def observe_unannounced(self, desired: DesiredState) -> dict[str, Any]:
        """Observe the LiveState fields no kernel event announces a change of: sysctls, listening
        sockets, iptables-legacy's rules.

        Cheap file reads (legacy rules: a /proc read, and a save only where legacy tables
        exist beside our nf_tables backend); the plan agent re-reads them on every request.
        """
        extra_sysctls = tuple(f"net/ipv4/conf/{b}/route_localnet" for b in desired.bridges)
        return {
            "sysctls": {k: v for k in (*SYSCTL_KEYS, *extra_sysctls)
                        if (v := sysctl.read(k)) is not None},
            "listening": listening_ports() if desired.allocs else frozenset(),
            "legacy4": self.handles.iptables(4).observe_legacy(),
            "legacy6": self.handles.iptables(6).observe_legacy(),
        }

    def observe_allocs(self, desired: DesiredState, host_id: str,
                       links: Mapping[str, LiveLink]) -> dict[str, LiveNetns]:
        """Observe the desired allocation namespaces, plus undeclared ones that carry this host's
        mark.

        An undeclared one with the mark of a version before the cookie (the inode alone,
        ``ownership.alloc_ns_marks``) is ours only when its veth pair joins it to this host
        (``links``: our marked veth of its name, whose peer is in it): a sandbox that got a
        deleted sandbox's inode must not take (and prune) the dead one's allocations, whose
        veths died with it. Declared ones are read whatever their mark.
        """
        names = set(netns.list_names())
        wanted = names & set(desired.allocs)
        mark, *legacy = alloc_ns_marks(host_id)
        stale: dict[str, LiveNetns] = {}
        maybe: set[str] = set()
        # the mark on the file, which a workload cannot write; ``lo``'s alias only for a
        # namespace whose file has none (made before files were marked)
        under = netns.file_marks(sorted(names - wanted))
        for name in sorted(names - wanted):
            try:
                if not netns.is_namespace_mount(name):
                    # An empty file (a crash between unmount and unlink): ours only if tagged.
                    if netns.file_mark(name) == mark:
                        stale[name] = LiveNetns(name, usable=False, file_mark=mark)
                    continue
            except (OSError, DriverError):
                continue  # removed meanwhile by someone else, or a name we never give
            alias = under.get(name) or self.handles.netlink.peek_lo_alias(name)
            if alias == mark:
                wanted.add(name)  # ours, undeclared: to be pruned
            elif alias in legacy:
                maybe.add(name)
        observed = self.observe_namespaces(wanted | maybe)
        for name in maybe:
            ns = observed.get(name)
            if ns is not None and not joined_to_host(ns, links):
                del observed[name]  # another namespace's that had our inode, or unproven
        return {**observed, **stale}

    def observe_peer_namespaces(self, desired: DesiredState, links: dict[str, LiveLink],
                                allocs: dict[str, LiveNetns]) -> dict[int, str]:
        """Find, for each owned veth whose allocation namespace was not found (an orphan
        candidate), the live namespace under /run/netns its peer is in, if any: nsid -> name.

        Such a namespace is mounted and live but not read as an allocation (its ``lo`` mark
        rewritten, say): its veth is no orphan and must not be cut. Nothing is read when
        there is no candidate (one nsid request per other namespace then).
        """
        known = {alloc_veth_name(n) for n in (*allocs, *desired.allocs)}
        wanted = {lk.peer_netnsid for lk in links.values()
                  if lk.kind == "veth" and lk.owned and lk.name not in known
                  and lk.peer_netnsid is not None}
        if not wanted:
            return {}
        out: dict[int, str] = {}
        for name in netns.list_names():
            if name in allocs:
                continue
            try:
                nsid = self.handles.netlink.get_nsid(name)
            except (OSError, DriverError):
                continue  # an empty file, or gone meanwhile
            if nsid in wanted:
                out[nsid] = name
        return out

    def observe_namespaces(self, names: Iterable[str]) -> dict[str, LiveNetns]:
        """Observe links, addresses and routes inside each named namespace (missing ones left
        out)."""
        names = sorted(names)
        # with no names too: that drops sockets held into namespaces no longer read, which
        # would keep them (and their veths) alive after someone deleted them
        observed = dict(self.handles.netlink.observe_netns(names))
        marks = netns.file_marks(observed)  # live mounts too: what proves them ours
        for name, ns in observed.items():
            found = marks.get(name) if name in marks else netns.file_mark(name)
            if found is not None or not ns.usable:
                observed[name] = dataclasses.replace(ns, file_mark=found)
        return observed

    def observe_routes(self, desired: DesiredState) -> tuple[LiveRoute, ...]:
        """Observe the host's routes of every table an ``ip rule`` selects, when declared prefixes
        must be checked against them.

        Two dumps (the rules, the routes); skipped when nothing declares a prefix (a
        router's full table is large).
        """
        if not (desired.subnets or desired.docker_networks):
            return ()
        return self.handles.netlink.dump_host_routes()

    def observe_docker_parts(self, desired: DesiredState) -> dict[str, Any]:
        """Observe ``docker`` (see :meth:`observe_docker`) and ``docker_space``: every Docker
        network's subnets and the daemon's pools, when anything declares a prefix (None otherwise,
        and without Docker on this host). One list call serves both."""
        listing = rawapi.list_networks()
        space = rawapi.address_space(listing) \
            if desired.subnets or desired.docker_networks else None
        return {"docker": self.observe_docker(desired, listing), "docker_space": space}

    def observe_docker(self, desired: DesiredState,
                       listing: rawapi.Listing | None = None) -> LiveDocker | None:
        """Observe the declared Docker networks and every network we own, or None.

        Whether we own networks only the daemon can say, so it is asked even
        when nothing Docker is declared. A host without Docker (no socket) is
        None: host-only runs must not fail for it. A socket whose daemon does
        not answer is reported, so the planner can warn that owned networks
        were not checked (an error only when networks are declared).
        """
        if not desired.docker_networks:
            if listing is not None and listing.refused:
                # Host-only run and no daemon behind the socket: what the SDK would say
                # (importing it costs ~60-110 ms of an apply) is known already.
                return LiveDocker(available=False, error=listing.error)
            # Host-only run: skip the SDK unless this reconciler owns networks to prune.
            scopes = rawapi.owned_scopes(listing)
            if scopes is not None and docker_scope() not in scopes:
                return None
        live = self.handles.docker.observe(sorted(desired.docker_networks))
        if not live.available:
            return live
        return dataclasses.replace(live, scope=docker_scope())


def joined_to_host(ns: LiveNetns, links: Mapping[str, LiveLink]) -> bool:
    """Tell whether the veth pair of allocation ``ns`` joins it to this host: our marked veth of
    its name is here, and its peer is in that namespace. A deleted host's allocations have
    none (a veth pair dies with either end's namespace)."""
    veth = links.get(alloc_veth_name(ns.name))
    return (veth is not None and veth.kind == "veth" and veth.owned
            and ns.nsid is not None and veth.peer_netnsid == ns.nsid)


def docker_scope() -> str:
    """Tell who we are among reconcilers sharing one dockerd (the ``io.reconciler.scope`` label).

    "host" in the network namespace of pid 1; in a sandbox (``--netns NAME``
    or nsenter) ``netns/NAME``, or ``netns-inode/N-C`` when it has no name (N its inode, C
    its cookie: ``nsfs.current_id``; a bare inode is reused by the next namespace made).
    """
    mine = nsfs.current_inode()
    try:
        if os.stat("/proc/1/ns/net").st_ino == mine:
            return "host"
    except OSError:
        pass
    for name in netns.list_names():
        try:
            if netns.namespace_inode(name) == mine:
                return f"netns/{name}"
        except OSError:
            continue
    return f"netns-inode/{nsfs.current_id()}"

