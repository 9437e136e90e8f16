"""Probes: prove from inside the host that packets flow (SPEC §7).

``Prober.run`` asks the pure planner which probes exist and what each must find
(``planner.probes``), sends them all at once (``drivers.probe.runner``), and for each
one that failed gathers the facts around it and lets the planner name the
cause. ``probe_targets`` says which allocations a plan touched ("what changed",
after apply); watch probes everything on its own interval.

See docs/decisions/031-probes-capture-decides.md.
See docs/decisions/032-probes-in-apply-and-watch.md.
See docs/decisions/049-diagnosis-names-what-issue-26-saw.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import os
import time
from collections.abc import Collection
from typing import Any

from reconciler.domain.errors import DriverError
from reconciler.domain.live import LiveLink, LiveState
from reconciler.domain.model import AllocId, DesiredState
from reconciler.domain.ownership import (
    ALLOC_IFNAME,
    alloc_veth_name,
    host_inode,
    probe_vantage_names,
)
from reconciler.domain.plan import Plan
from reconciler.domain.probes import (
    VANTAGE6_HOST,
    VANTAGE6_PEER,
    VANTAGE_HOST,
    VANTAGE_PEER,
    ProbeResult,
    ProbeSpec,
    sort_key,
)
from reconciler.drivers import rundir, sysctl
from reconciler.drivers.netlink.conntrack import Tuple
from reconciler.drivers.nsfs import current_inode
from reconciler.drivers.probe import diagnosis, runner
from reconciler.drivers.probe import vantage as vantage_driver
from reconciler.engine.handles import HostHandles
from reconciler.planner import nftforeign
from reconciler.planner import probes as plan_probes
from reconciler.planner.probes import Cause, Facts, Sighting, Vantage, classify

__all__ = ["Prober", "VantageLease", "probe_targets", "remove_unused_vantage"]


def probe_targets(plan: Plan, desired: DesiredState) -> set[str]:
    """Return the alloc ids a plan's changes touch (see ``planner.probes.probe_targets``)."""
    return plan_probes.probe_targets(plan, desired)


class Prober:
    """Runs probes through the host's drivers; ``close`` removes what it set up."""

    def __init__(self, handles: HostHandles) -> None:
        self.handles = handles
        self._lease: VantageLease | None = None  # our share of the host's vantage

    def run(self, desired: DesiredState, live: LiveState, *,
            allocs: Collection[str] | None = None, external: bool = False,
            timeout: float = 1.0) -> list[ProbeResult]:
        """Probe the allocations named (every declared one for None); results in report order.

        ``live`` is the state after apply: targets are read from it. Changes nothing
        on the host but the external vantage namespace (made on the first run with
        ``external``, kept until :meth:`close`).
        """
        vantage, unusable = None, None
        if external:
            try:
                vantage = self._ensure_vantage(live.host_id, plan_probes.has_ipv6_maps(live))
            except DriverError as e:  # its probes fail with the reason; the others run
                vantage, unusable = Vantage("", VANTAGE_HOST, VANTAGE6_HOST), str(e)
        exclude = () if self._lease is None else (self._lease.link,)
        specs = plan_probes.probe_specs(desired, live, allocs=allocs, vantage=vantage,
                                        host_exclude=exclude, br_netfilter=_br_netfilter())
        lost = [s for s in specs if s.skipped is None and s.refused is None and unusable
                and s.vantage == "external"]
        sendable = [s for s in specs if s.skipped is None and s.refused is None
                    and s not in lost]
        external_ns = vantage.netns if vantage and not unusable else None
        outcomes = send(self.handles, sendable, timeout=timeout, external_ns=external_ns)
        failed = [i for i, (s, o) in enumerate(zip(sendable, outcomes, strict=True))
                  if not _sighting(o).holds(s)]
        causes: dict[int, Cause] = {}
        if failed:
            names = None if self._lease is None else (self._lease.ns, self._lease.link)
            again = Diagnosis(self.handles, desired, live, names).run(
                [sendable[i] for i in failed], timeout=timeout, external_ns=external_ns)
            for i, (outcome, cause) in zip(failed, again, strict=True):
                outcomes[i] = outcome
                if cause is not None:
                    causes[i] = cause
        results = [self._result(s, o, causes.get(i)) for i, (s, o) in
                   enumerate(zip(sendable, outcomes, strict=True))]
        results += [ProbeResult(s.alloc, s.path, s.proto, s.port, ok=True, skipped=True,
                                cause=s.skipped, family=s.family)
                    for s in specs if s.skipped is not None and s.refused is None]
        results += [ProbeResult(s.alloc, s.path, s.proto, s.port, ok=False, cause=s.refused,
                                family=s.family) for s in specs if s.refused is not None]
        results += [ProbeResult(s.alloc, s.path, s.proto, s.port, ok=False, cause=(
            f"no external vantage namespace: {unusable}"), family=s.family) for s in lost]
        return sorted(results, key=sort_key)

    def _ensure_vantage(self, host_id: str, ipv6: bool) -> Vantage:
        """Hold our share of the host's vantage, checked at every run: one that somebody removed
        (or half removed) since is made again. ``ipv6``: there are IPv6 maps to probe, so
        look whether its link has its IPv6 pair (one ``ip`` call; none without them)."""
        if self._lease is None or self._lease.host_id != host_id:
            if self._lease is not None:
                self._lease.release()
            self._lease = VantageLease(host_id)
        self._lease.ensure()
        if not ipv6:
            return Vantage(self._lease.ns, VANTAGE_HOST)
        why = vantage_driver.vantage_ipv6_missing(self._lease.link)
        if why is not None:
            return Vantage(self._lease.ns, VANTAGE_HOST, None, no6=why)
        return Vantage(self._lease.ns, VANTAGE_HOST, VANTAGE6_HOST)

    def _result(self, s: ProbeSpec, o: runner.Outcome, cause: Cause | None) -> ProbeResult:
        seen = _sighting(o)
        ok = seen.holds(s)
        if not ok and cause is None:
            cause = classify(s, seen)
        return ProbeResult(s.alloc, s.path, s.proto, s.port, ok=ok,
                           cause=None if ok or cause is None else cause.line, ms=o.ms,
                           family=s.family, ours=not ok and cause is not None and cause.ours)

    def close(self) -> None:
        """Give up our share of the external vantage; the last prober of the host to let go
        removes it."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None


#: how long a prober waits for the vantage's lock while another makes or removes it
VANTAGE_WAIT = 10.0


def vantage_lock_path(host_id: str) -> str:
    return os.path.join(rundir.RUN_DIR, f"probe-vantage-{host_inode(host_id)}.lock")


class VantageLease:
    """A share of the host's external vantage, held for a prober's lifetime.

    One vantage per host (its /30 and /126 route on one link only), used by every prober
    of the host at once — a ``watch`` agent's and a CLI ``verify``'s — through an
    ``flock`` on ``/run/reconciler/probe-vantage-<host>.lock``: each user holds it shared
    while it may probe; it is made, mended or removed only under the exclusive lock, which
    nobody can hold while another prober uses it. So a prober never removes a vantage in
    use, a dead prober's share goes with its process (the kernel drops its lock), and its
    leftover is removed by the next prober (or ``destroy``) that gets the lock alone.
    """

    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self.ns, self.link = probe_vantage_names(host_id)
        self._fd: int | None = None
        self._shared = False
        #: whether this lease tried once to give an IPv4-only vantage its IPv6 pair
        self._mended = False

    def _open(self) -> int:
        if self._fd is None:
            rundir.ensure_dir()
            path = vantage_lock_path(self.host_id)
            try:
                self._fd = rundir.open_file(path, 0o600)
            except OSError as e:
                raise DriverError(f"probe vantage: cannot open its lock: "
                                  f"{rundir.describe_open_error(path, e)}") from None
        return self._fd

    def _try(self, how: int) -> bool:
        """Take the lock without waiting. The last user unlinks the file as it removes the
        vantage (sandboxes would leave one each): a lock won on an unlinked file is
        dropped, and the next try opens the new one."""
        fd = self._open()
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise DriverError(f"probe vantage: lock: {e.strerror}") from None
            return False
        try:
            current = os.fstat(fd).st_ino == os.stat(vantage_lock_path(self.host_id)).st_ino
        except FileNotFoundError:
            current = False
        if not current:
            os.close(fd)
            self._fd, self._shared = None, False
        return current

    def ensure(self) -> None:
        """Hold a share of a ready vantage; make it (alone) when it is missing or broken."""
        deadline = time.monotonic() + VANTAGE_WAIT
        while True:
            state = vantage_driver.vantage_state(self.ns, self.link)
            if state == "ready" and not self._mended and \
                    vantage_driver.vantage_lacks_ipv6_pair(self.link):
                # made by a version before the IPv6 pair (or the pair was removed): made
                # again, once, when no other prober uses it; else used as it is, its IPv6
                # paths skipped with the reason
                self._mended = True
                if self._try(fcntl.LOCK_EX):
                    try:
                        vantage_driver.remove_vantage(self.ns, self.link)  # marked parts only
                        vantage_driver.create_vantage(self.ns, self.link)
                    finally:
                        fcntl.flock(self._open(), fcntl.LOCK_SH)
                        self._shared = True
                    continue
                self._shared = False  # a failed conversion gave up our share: taken again
            if state == "foreign":
                self.release()
                raise DriverError(f"probe vantage: {self.ns} or {self.link} exists and is not "
                                  "ours (no probe-vantage mark): left alone")
            if state == "ready" and self._shared:
                return  # nobody removes it while we hold our share
            if state == "ready" and self._try(fcntl.LOCK_SH):
                self._shared = True
                if vantage_driver.vantage_state(self.ns, self.link) == "ready":
                    return  # removed between the look and the lock: look again
            elif self._try(fcntl.LOCK_EX):  # (a shared lock of ours is converted)
                self._shared = False
                try:
                    if vantage_driver.vantage_state(self.ns, self.link) != "ready":
                        vantage_driver.remove_vantage(self.ns, self.link)  # marked parts only
                        vantage_driver.create_vantage(self.ns, self.link)
                finally:
                    fcntl.flock(self._open(), fcntl.LOCK_SH)
                    self._shared = True
                if vantage_driver.vantage_state(self.ns, self.link) == "ready":
                    return
            else:
                self._unlock()  # let the one making it finish (it waits for us otherwise)
            if time.monotonic() >= deadline:
                raise DriverError("probe vantage: gave up waiting for another prober of this "
                                  f"host to finish making or removing it ({VANTAGE_WAIT:g}s)")
            time.sleep(0.05)

    def _unlock(self) -> None:
        if self._fd is not None and self._shared:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._shared = False

    def release(self) -> None:
        """Let go; the last one out (the exclusive lock comes at once) removes the vantage."""
        if self._fd is None:
            return
        try:
            self.remove_if_alone()
        finally:
            if self._fd is not None:
                os.close(self._fd)
            self._fd, self._shared = None, False

    def remove_if_alone(self) -> bool:
        """Remove the vantage (its marked parts) and the lock file when nobody else holds a
        share; True when it did."""
        if not self._try(fcntl.LOCK_EX):
            return False
        vantage_driver.remove_vantage(self.ns, self.link)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(vantage_lock_path(self.host_id))  # while still holding it: see _try
        return True


def remove_unused_vantage(host_id: str | None = None) -> bool:
    """Remove the host's vantage when no prober uses it (a dead one's leftover), for ``destroy``;
    True when there was one to remove. A prober alive keeps it (its lock is shared)."""
    lease = VantageLease(host_id if host_id is not None else str(current_inode()))
    if vantage_driver.vantage_state(lease.ns, lease.link) not in ("ready", "partial"):
        return False
    try:
        return lease.remove_if_alone()
    finally:
        lease.release()


def vantage_present(host_id: str | None = None) -> str | None:
    """Name the host's vantage namespace when one (ours) is there, for ``show``."""
    host = host_id if host_id is not None else str(current_inode())
    ns, link = probe_vantage_names(host)
    return ns if vantage_driver.vantage_state(ns, link) in ("ready", "partial") else None


def send(handles: HostHandles, specs: list[ProbeSpec], *, timeout: float,
         external_ns: str | None) -> list[runner.Outcome]:
    """Run ``drivers.probe.runner.run``, and after each batch the conntrack entries its probes made
    deleted through the host's conntrack driver (``HostHandles.conntrack``)."""
    return runner.run(specs, timeout=timeout, external_ns=external_ns,
                      forget=lambda flows: forget_flows(handles, flows))


def forget_flows(handles: HostHandles, flows: list[runner.Flow]) -> int:
    """Delete the probes' own conntrack entries by their exact original tuples; returns how
    many went. Without conntrack here (no module, no permission) there is nothing to
    delete: the probes' results stand either way."""
    if not flows:
        return 0
    try:
        return handles.conntrack.delete_flows(flow_tuple(f) for f in flows)
    except DriverError:
        return 0


def flow_tuple(f: runner.Flow) -> Tuple:
    """Return the conntrack driver's original tuple of a flow a probe made."""
    src, dst = ipaddress.ip_address(f.src), ipaddress.ip_address(f.dst)
    if f.proto in (1, 58):  # ICMP, ICMPv6: echo id and type, code 0
        return Tuple(src, dst, f.proto, None, None, icmp=(f.a, f.b, 0))
    return Tuple(src, dst, f.proto, f.a, f.b)


def _br_netfilter() -> dict[int, bool]:
    """Tell, per family, whether br_netfilter hands bridged IP to iptables here (the sysctl is per
    network namespace; absent: the module is not loaded)."""
    out = {}
    for family, key in ((4, "net/bridge/bridge-nf-call-iptables"),
                        (6, "net/bridge/bridge-nf-call-ip6tables")):
        try:
            out[family] = sysctl.read(key) == "1"
        except DriverError:
            out[family] = False
    return out


def _sighting(o: runner.Outcome) -> Sighting:
    return Sighting(o.reached, o.answer, o.error, o.big)


#: distinct addresses whose route a diagnosis asks for (one RTM_GETROUTE each)
ROUTE_LOOKUPS = 32


class Diagnosis:
    """Failed probes sent again (together, apart from the first run), the host watched around.

    Before and after the re-run: ``iptables-save -c`` of the families involved (which
    foreign rule's counter rose; iptables-legacy's too where the observation found legacy
    tables beside our nf_tables backend) and the IPReversePathFilter counter; after it, our
    table (whether it is as built), the sysctls that decide the paths, the hairpin flag of
    each allocation's bridge port, the host's route and neighbour entry for its address
    and its eth0's MAC. The planner names the cause from these
    (``planner.probes.classify``).
    """

    def __init__(self, handles: HostHandles, desired: DesiredState, live: LiveState,
                 vantage: tuple[str, str] | None) -> None:
        self.handles, self.desired, self.live, self.vantage = handles, desired, live, vantage
        # what the facts of several failed probes share is asked for once
        self._sysctl_cache: dict[str | None, dict[str, str]] = {}
        self._routes: dict[str, tuple[str | None, str | None]] = {}
        self._neigh: dict[str, dict[str, tuple[str | None, str]]] = {}
        self._macs: dict[str, str | None] = {}
        #: ``nft -a list ruleset`` before and after the re-run (other managers' own tables)
        self._nft: tuple[str, str] | None = None

    def run(self, specs: list[ProbeSpec], *, timeout: float,
            external_ns: str | None) -> list[tuple[runner.Outcome, Cause | None]]:
        families = sorted({s.family for s in specs if s.proto != "icmp"} | {4})
        # iptables-legacy's tables too, where the observation found some beside our nf_tables
        # backend: both filter (and NAT) every packet, and only the legacy side would say why
        legacy = [f for f in families
                  if (self.live.legacy4 if f == 4 else self.live.legacy6) is not None]
        before = {f: diagnosis.save_counters(f) for f in families}
        before_legacy = {f: diagnosis.save_counters(f, legacy=True) for f in legacy}
        rp_before = diagnosis.netstat_counter("IPReversePathFilter")
        nft_before = diagnosis.nft_ruleset()
        outcomes = send(self.handles, specs, timeout=timeout, external_ns=external_ns)
        rp_drops = diagnosis.netstat_counter("IPReversePathFilter") - rp_before
        nft_after = diagnosis.nft_ruleset() if nft_before is not None else None
        self._nft = (nft_before or "", nft_after) if nft_after is not None else None
        hits: list[plan_probes.RuleHit] = []
        for f in families:
            old, new = before[f], diagnosis.save_counters(f)
            if old is not None and new is not None:
                hits += plan_probes.foreign_hits(f, old, new)
        for f in legacy:
            old, new = before_legacy[f], diagnosis.save_counters(f, legacy=True)
            if old is not None and new is not None:
                hits += plan_probes.foreign_hits(f, old, new, legacy=True)
        try:
            links = self.handles.netlink.dump_links()
        except DriverError:
            links = dict(self.live.links)
        # our own table: a hand edit (a rule added to a chain, a set changed) drops silently
        table = plan_probes.table_problem(self.handles.nft.observe())
        shared = {"rp_filter_drops": rp_drops, "hits": tuple(hits), "table": table}
        out: list[tuple[runner.Outcome, Cause | None]] = []
        for s, o in zip(specs, outcomes, strict=True):
            seen = _sighting(o)
            if seen.holds(s):
                out.append((o, None))  # it holds now: passing on the second try
                continue
            out.append((o, classify(s, seen, self._facts(s, links, shared))))
        return out

    def _facts(self, s: ProbeSpec, links: dict[str, LiveLink],
               shared: dict[str, Any]) -> Facts:
        a = self.desired.allocs.get(AllocId(s.alloc))
        subnet = self.desired.subnets.get(a.subnet) if a is not None else None
        bridge = subnet.bridge if subnet is not None else None
        declared = self.desired.bridges.get(bridge) if bridge is not None else None
        port = links.get(alloc_veth_name(s.alloc))
        address = plan_probes.alloc_addresses(self.live.netns.get(s.alloc),
                                              self.live.host_id).get(s.family)
        route = self._route(address) if address is not None else None
        neighbour = None
        if bridge is not None and address is not None:
            neighbour = self._neighbours(bridge).get(address)
        ns = self.live.netns.get(s.alloc)
        alloc_default = None if ns is None or not ns.usable else any(
            r.dst == "default" and r.gateway is not None and (":" in r.gateway) == (s.family == 6)
            for r in ns.routes)
        route_back = None
        peer = VANTAGE_PEER if s.family == 4 else VANTAGE6_PEER
        if s.vantage == "external" and (back := self._route(peer)) is not None:
            route_back = (peer, back[0])
        nft: tuple[str, ...] = ()
        if self._nft is not None:
            names = frozenset(n for n in (address, s.dst, str(s.dport), str(s.to)) if n)
            nft = tuple(r.where() for r in nftforeign.drops(
                *self._nft, family=s.family, names=names,
                forwarded=s.path in ("hairpin", "external", "direct")))
        ingress = tuple(i for i in (bridge, self.vantage[1] if self.vantage else None)
                        if i is not None)
        return Facts(sysctls=self._sysctls(bridge), bridge=bridge, alloc_default=alloc_default,
                     ingress=ingress, nft_drops=nft,
                     route_back=route_back,
                     bridge_hairpin=declared.hairpin if declared is not None else True,
                     port_hairpin=port.hairpin if port is not None else None, route=route,
                     neighbour=neighbour, mac=self._mac(s.alloc), **shared)

    def _sysctls(self, bridge: str | None) -> dict[str, str]:
        if bridge in self._sysctl_cache:
            return self._sysctl_cache[bridge]
        keys = ["net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding",
                "net/bridge/bridge-nf-call-iptables", "net/bridge/bridge-nf-call-ip6tables",
                "net/ipv4/conf/all/rp_filter"]
        if bridge is not None:
            keys += [f"net/ipv4/conf/{bridge}/route_localnet",
                     f"net/ipv4/conf/{bridge}/rp_filter", f"net/ipv4/conf/{bridge}/forwarding"]
        if self.vantage is not None:
            keys += [f"net/ipv4/conf/{self.vantage[1]}/rp_filter",
                     f"net/ipv4/conf/{self.vantage[1]}/forwarding"]
        out = {}
        for k in keys:
            with contextlib.suppress(DriverError):
                if (v := sysctl.read(k)) is not None:
                    out[k] = v
        self._sysctl_cache[bridge] = out
        return out

    def _route(self, address: str) -> tuple[str | None, str | None] | None:
        if address not in self._routes:
            if len(self._routes) >= ROUTE_LOOKUPS:
                return None
            self._routes[address] = self.handles.netlink.route_get(address)
        return self._routes[address]

    def _neighbours(self, bridge: str) -> dict[str, tuple[str | None, str]]:
        if bridge not in self._neigh:
            try:
                index = self.handles.netlink.link_index(bridge)
                self._neigh[bridge] = ({} if index is None
                                       else self.handles.netlink.neighbour_states(index))
            except DriverError:
                self._neigh[bridge] = {}
        return self._neigh[bridge]

    def _mac(self, alloc: str) -> str | None:
        if alloc not in self._macs:
            try:
                eth0 = self.handles.netlink.get_link(ALLOC_IFNAME, ns=alloc)
            except DriverError:
                eth0 = None
            self._macs[alloc] = eth0.mac if eth0 is not None else None
        return self._macs[alloc]
