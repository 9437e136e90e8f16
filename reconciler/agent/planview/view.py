"""The plan agent: `reconcile watch` answers `reconcile plan` from one event-driven view.

A fresh `reconcile plan` process pays an interpreter, the imports, a netlink
socket into every allocation namespace and a parse of every message, on every
run: about a second at 1000 allocations. The agent instead keeps the last
observation and proves, on each request, that nothing it saw has changed since:

* **netlink**: one rtnetlink socket subscribed to link, address and route
  events with ``NETLINK_LISTEN_ALL_NSID``, so it also hears every namespace
  that has an nsid here (the kernel gives one to each namespace a veth crosses
  into: all our allocation namespaces); the host's own routes are part of the
  address space declared prefixes are checked against;
* **/run/netns**: inotify (names created, deleted, renamed; the ownership xattr)
  and ``poll`` on /proc/self/mountinfo, then which namespace is mounted where
  under /run/netns (other mounts on the host do not count);
* **nftables**: the ruleset generation id, bumped by every commit (the
  iptables-nft backend); with iptables-legacy the rules are read every time;
* whatever has no reliable change notification is read again on every
  request: sysctls, listening sockets, ``lo`` of a foreign namespace without an
  nsid, the neighbour entries of the declared bridges (one dump), and Docker
  (its event log keeps 256 events and forgets them on a restart; one list call
  when no network is declared).

Each sentinel names the part of the live state its news is about, and only
that part is read again: the host's links (an event of this namespace), its
routes (a datagram of route events only), one
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
The socket and its server are ``server.py``.

See docs/decisions/028-plan-answered-by-the-agent.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from reconciler.agent.planview.sentinels import (
    EVERYTHING,
    MountSentinel,
    NetlinkSentinel,
    NetnsDirSentinel,
    NftSentinel,
    Sentinel,
    nft_backend,
)
from reconciler.domain.errors import DriverError
from reconciler.domain.live import LiveNetns, LiveState
from reconciler.domain.model import DesiredState
from reconciler.domain.plan import Plan
from reconciler.drivers import netns
from reconciler.engine.impact import count_flows
from reconciler.engine.observe import Observer
from reconciler.planner import addrspace, links_that_matter, make_plan
from reconciler.planner.context import PlanOptions

log = logging.getLogger("reconciler.planserver")


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
        """Survey before reading namespaces: each name's nsid, and the ``lo`` alias of undeclared
        ones.

        Taken before the read, so that any change after it is announced (nsid) or
        noticed (alias re-read): a namespace that had no nsid when it was read
        could have changed unannounced in between.
        """
        nl = self.observer.handles.netlink
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
        """Learn which nsid is which names; which namespaces cannot be heard and must be re-read.

        An allocation namespace of ours without an nsid sends us no events:
        nothing is cached then. A foreign one without an nsid has its ``lo``
        alias (what would make it ours) read again on every request.
        """
        self.observer.handles.netlink.prune_cache(())  # a socket would keep a namespace alive
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
        """Return the LiveState parts that may have changed, read again; None: observe
        everything."""
        assert self.live is not None
        dirty: set[str] = set()
        for s in self.sentinels:  # drain every one before reading anything
            got = s.dirty()
            if got:
                dirty |= got
                s.rearm()
        if EVERYTHING in dirty:
            return None
        nl = self.observer.handles.netlink
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
        fresh.update(self.observer.observe_leases())  # one small file: read per request
        if "links" in dirty:
            fresh["links"] = self.observer.observe_links(desired)
        # no neighbour events are heard: read on every request (one dump)
        fresh["neighbours"] = self.observer.observe_neighbours(
            desired, fresh.get("links", self.live.links))
        if "firewall" in dirty or self.firewall_volatile:
            fresh.update(self.observer.observe_firewall())
        if "routes" in dirty or "links" in dirty:
            # a link going down drops its IPv4 routes without a route notification
            fresh["routes"] = self.observer.observe_routes(desired)
        if "docker" in dirty or self.docker_volatile:
            fresh.update(self.observer.observe_docker_parts(desired))
        if "netns" in dirty:
            survey = self._survey(desired)
            fresh["netns"] = self.observer.observe_allocs(desired, self.live.host_id,
                                                          fresh.get("links", self.live.links))
            self._adopt(survey, fresh["netns"])
        elif namespaces:
            again = self.observer.observe_namespaces(namespaces)
            nl.prune_cache(())
            if set(again) != namespaces:
                return None  # one vanished without a /run/netns event: be safe
            fresh["netns"] = {**self.live.netns, **again}
        if "links" in fresh or "netns" in fresh:
            fresh["peer_namespaces"] = self.observer.observe_peer_namespaces(
                desired, fresh.get("links", self.live.links), fresh.get("netns", self.live.netns))
        return fresh

    # -- answer -------------------------------------------------------------------------

    def plan(self, desired: DesiredState, key: Any, options: PlanOptions) -> tuple[Plan, str]:
        """Return the plan, and how its live state was had: "cached", "refreshed" or "observed"."""
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
                    if not changed <= {"links", "routes", "docker_space"} or (
                            links_that_matter(desired, new) != links_that_matter(desired, live)
                            or addrspace.relevant(desired, new, prune=options.prune)
                            != addrspace.relevant(desired, live, prune=options.prune)):
                        self.plans = {}  # else: only other tools' links, routes and
                        # Docker networks moved, none of them near a declared prefix
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
        # flows move on their own: counted for each answer, never kept (only a plan that
        # disrupts something reads them, and only theirs)
        plan, _live = count_flows(plan, self.live, self.observer.handles)
        return plan, how

    def close(self) -> None:
        for s in self.sentinels:
            with contextlib.suppress(OSError):
                s.close()


def build_view(observer: Observer | None = None) -> LiveView:
    """Build the view over the sentinels this host supports; what has none is read on every
    request."""
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

