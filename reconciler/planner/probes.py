"""Which probes to send, what each must find, and why one failed (pure, SPEC §7).

* :func:`probe_specs` turns the desired state and the live state after apply
  into ``ProbeSpec``s: per allocation the gateway echo (per family); per port
  map (per protocol and family, unless ``probe: false``) the paths a client can
  take. Targets come from live state — the owned addresses of the
  allocation's ``eth0``, the host ports of its DNAT rules (their
  ``reconciler:alloc=ID`` comments) — so the probes test what the host has,
  not what the files hope for; the map's flag and the subnet's isolation come
  from the desired state.
* :func:`probe_targets` is "what changed": the allocations a plan's changes touch.
* :func:`classify` turns the facts gathered around a failed probe into its cause line
  and whether a reconcile pass owns (and heals) that cause.

Paths and their expectations:

``host``: the host to a host address of its own (a local address that is not
on a link we own, not loopback or link-local; the map's ``host_ip`` when it has
one) through the map: expected reached. Without such an address (a bare
sandbox) it is skipped. ``localhost``: the host to 127.0.0.1 when the map
allows it (no ``host_ip``, or 127.0.0.1): IPv4 only, IPv6 has no loopback DNAT.
``hairpin``: the allocation to that same host address (its gateway when there
is none: the gateway is local too, and the DNAT rules match any local
destination); skipped for a 127.0.0.1-only map. ``external`` (opt-in): a
namespace of ours through the host address on its link (or ``host_ip``);
``direct``: that namespace straight to the allocation's address and container
port, expected reached only with ``isolation: open``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from dataclasses import dataclass

from reconciler.domain.live import LiveNetns, LiveState
from reconciler.domain.model import Alloc, DesiredState, PortMap
from reconciler.domain.ownership import ALLOC_IFNAME
from reconciler.domain.plan import Plan
from reconciler.domain.probes import Path, ProbeProto, ProbeSpec
from reconciler.domain.probes import Vantage as VantageKind
from reconciler.planner import addrspace, firewall
from reconciler.planner.allocs import Mapped

IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Vantage:
    """The external vantage namespace: its name and the host's address on its link."""

    netns: str
    host4: str


# ------------------------------------------------------------------ targets from live state


def alloc_addresses(ns: LiveNetns | None) -> dict[int, str]:
    """The owned address of each family on the allocation's ``eth0`` (live)."""
    out: dict[int, str] = {}
    if ns is None or not ns.usable:
        return out
    for lk in ns.links:
        if lk.name != ALLOC_IFNAME:
            continue
        for a in lk.addresses:
            if a.owned and a.address.version not in out:
                out[a.address.version] = str(a.address.ip)
    return out


def live_maps(live: LiveState) -> dict[str, list[tuple[int, Mapped]]]:
    """(family, map) of every live DNAT rule of ours, by alloc id."""
    out: dict[str, list[tuple[int, Mapped]]] = {}
    for family, chains in ((4, live.firewall4), (6, live.firewall6)):
        for rule in chains.chains.get(("nat", firewall.DNAT), ()):
            owner = firewall.owner_of(rule)
            if not owner or not owner.startswith("alloc="):
                continue
            t = rule.split()
            try:
                proto = t[t.index("-p") + 1]
                dport = int(t[t.index("--dport") + 1])
                to = int(t[t.index("--to-destination") + 1].rsplit(":", 1)[1])
                host_ip = (ipaddress.ip_address(t[t.index("-d") + 1].split("/")[0])
                           if "-d" in t else None)
            except (ValueError, IndexError):
                continue
            out.setdefault(owner.split("=", 1)[1], []).append(
                (family, Mapped(proto, dport, to, host_ip)))
    return out


def _usable_host_address(ip: IPAddr) -> bool:
    return not (ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified)


def host_addresses(live: LiveState, desired: DesiredState,
                   exclude: Collection[str] = ()) -> dict[int, str]:
    """Per family, a local address of the host not on a link we own (lowest first).

    Our bridges' gateways are left out (a probe to them proves less: they are on
    the allocations' own link), and so are loopback, link-local addresses and the
    links named in ``exclude`` (the external vantage link).
    """
    subnets = [s.cidr for s in desired.subnets.values() if s.resolved]
    subnets6 = [s.cidr6 for s in desired.subnets.values() if s.resolved and s.cidr6]
    found: dict[int, list[IPAddr]] = {4: [], 6: []}
    for lk in live.links.values():
        if lk.owned or lk.name == "lo" or lk.name in exclude or not lk.up:
            continue
        for a in lk.addresses:
            ip = a.address.ip
            if not _usable_host_address(ip):
                continue
            if any(ip in n for n in (subnets if ip.version == 4 else subnets6)):
                continue
            found[ip.version].append(ip)
    return {v: str(min(ips, key=int)) for v, ips in found.items() if ips}


def _declared(a: Alloc, proto: str, m: Mapped) -> PortMap | None:
    """The declared port map a live rule serves (host port fixed or auto, same target)."""
    for p in a.ports:
        if (proto in p.protocols and p.to == m.to and p.host_ip == m.host_ip
                and p.host in (None, m.host)):
            return p
    return None


def _gateway(desired: DesiredState, a: Alloc, family: int) -> str | None:
    s = desired.subnets.get(a.subnet)
    if s is None or not s.resolved:
        return None
    gw = s.gateway if family == 4 else s.gateway6
    return None if gw is None else str(gw)


def probe_specs(desired: DesiredState, live: LiveState, *,
                allocs: Collection[str] | None = None,
                vantage: Vantage | None = None,
                host_exclude: Collection[str] = ()) -> list[ProbeSpec]:
    """Every probe of the allocations named (all declared ones for None), in report order.

    ``auto`` prefixes are picked the way the plan picks them (kept from live state).
    """
    if not all(s.resolved for s in desired.subnets.values()):
        desired = addrspace.resolve(desired, live).desired
    wanted = None if allocs is None else set(allocs)
    chosen = sorted(((aid, a) for aid, a in desired.allocs.items()
                     if wanted is None or aid in wanted), key=lambda item: item[0])
    hosts = host_addresses(live, desired, host_exclude)
    maps = live_maps(live)
    out: list[ProbeSpec] = []
    for aid, a in chosen:
        addrs = alloc_addresses(live.netns.get(aid))
        out += _gateway_specs(desired, a, addrs)
        for family, m in sorted(maps.get(aid, ()), key=lambda fm: (fm[0], fm[1].proto,
                                                                     fm[1].host)):
            declared = _declared(a, m.proto, m)
            if declared is not None and not declared.probe:
                continue
            out += _map_specs(desired, a, family, m, addrs, hosts, vantage)
    return out


def _gateway_specs(desired: DesiredState, a: Alloc, addrs: dict[int, str]) -> list[ProbeSpec]:
    out = []
    for family in (4, 6):
        gw = _gateway(desired, a, family)
        if gw is None:
            continue
        skipped = None if family in addrs or family == 4 else "no IPv6 address on eth0"
        out.append(ProbeSpec(a.id, "gateway", "icmp", family, "alloc", gw, skipped=skipped,
                             src=addrs.get(family)))
    return out


def _map_specs(desired: DesiredState, a: Alloc, family: int, m: Mapped,
               addrs: dict[int, str], hosts: dict[int, str],
               vantage: Vantage | None) -> list[ProbeSpec]:
    proto: ProbeProto = "tcp" if m.proto == "tcp" else "udp"

    def spec(path: Path, where: VantageKind, dst: str | None, *, skipped: str | None = None,
             dport: int = m.host, expect: bool = True) -> ProbeSpec:
        if dst is None and skipped is None:
            skipped = "no address to send to"
        return ProbeSpec(a.id, path, proto, family, where, dst or "", m.host, dport, m.to,
                         expect, skipped)

    only = f"published on {m.host_ip} only"
    loopback_only = m.host_ip is not None and m.host_ip.is_loopback
    host_dst = str(m.host_ip) if m.host_ip is not None else hosts.get(family)
    out: list[ProbeSpec] = []
    if loopback_only:
        out.append(spec("host", "host", None, skipped=only))
    else:
        out.append(spec("host", "host", host_dst, skipped=None if host_dst else
                        "no host address"))
    if family == 4 and (m.host_ip is None or loopback_only):
        out.append(spec("localhost", "host", "127.0.0.1"))
    if loopback_only:
        out.append(spec("hairpin", "alloc", None, skipped=only))
    else:
        out.append(spec("hairpin", "alloc", host_dst or _gateway(desired, a, family)))
    if vantage is not None and family == 4:
        if loopback_only:
            out.append(spec("external", "external", None, skipped=only))
        else:
            out.append(spec("external", "external",
                            str(m.host_ip) if m.host_ip is not None else vantage.host4))
        s = desired.subnets.get(a.subnet)
        if s is not None:
            out.append(spec("direct", "external", addrs.get(4), dport=m.to,
                            expect=s.isolation == "open"))
    return out


# ------------------------------------------------------------------ causes


@dataclass(frozen=True)
class Sighting:
    """What a probe saw: its packet arrived (the capture, the echo reply); what the sender
    was told; an error that kept it from being sent."""

    reached: bool
    answer: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Cause:
    line: str
    ours: bool = False  # a reconcile pass owns this and heals it


def classify(spec: ProbeSpec, seen: Sighting) -> Cause:
    """The cause line of a probe whose outcome was not the expected one."""
    if seen.error is not None:
        return Cause(seen.error)
    if spec.path == "direct" and seen.reached:
        return Cause(f"reached {spec.dst}:{spec.to} directly although the subnet's isolation "
                     "is ports (something accepts it before RECONCILER-FORWARD)")
    if spec.path == "gateway":
        return Cause(f"no echo reply from the gateway {spec.dst}")
    if spec.path == "direct":
        return Cause(f"{spec.dst}:{spec.to} not reached directly although the subnet's "
                     "isolation is open")
    told = seen.answer or "timeout"
    if told in ("refused", "connected", "answered"):
        return Cause(f"{spec.proto} to {spec.dst}:{spec.dport} was answered ({told}) but "
                     "never arrived in the allocation (a REJECT rule or another listener)")
    return Cause(f"{spec.proto} to {spec.dst}:{spec.dport} never arrived in the "
                 f"allocation ({told})")


# ------------------------------------------------------------------ what changed


def probe_targets(plan: Plan, desired: DesiredState) -> set[str]:
    """Alloc ids a plan's changes touch: allocations changed with ops, the allocations of a
    changed subnet or bridge (or of a bridge whose sysctl changed), every allocation when a
    host-wide sysctl changed, and allocations with port maps when a firewall change ran."""
    out: set[str] = set()
    subnets: set[str] = set()
    bridges: set[str] = set()
    everything = False
    firewall_ran = False
    for c in plan.actionable:
        if not c.ops:
            continue
        if c.kind == "alloc":
            out.add(c.name)
        elif c.kind == "subnet":
            subnets.add(c.name)
        elif c.kind == "bridge":
            bridges.add(c.name)
        elif c.kind == "firewall":
            firewall_ran = True
        elif c.kind == "sysctl":
            parts = c.name.split("/")
            if len(parts) >= 4 and parts[2] == "conf" and parts[3] not in ("all", "default"):
                bridges.add(parts[3])
            else:
                everything = True
    for aid, a in desired.allocs.items():
        s = desired.subnets.get(a.subnet)
        if (everything or a.subnet in subnets or (s is not None and s.bridge in bridges)
                or (firewall_ran and a.ports)):
            out.add(aid)
    return out & set(desired.allocs)

