"""Which probes to send, what each must find, and why one failed (pure, SPEC §7).

* :func:`probe_specs` turns the desired state and the live state after apply
  into ``ProbeSpec``s: per allocation the gateway echo (per family); per port
  map (per protocol and family, unless ``probe: false``) the paths a client can
  take. Targets come from live state — the owned addresses of the
  allocation's ``eth0``, the host ports of its port-map entries in our table
  ``inet reconciler`` (their ``alloc=ID`` comments; read in the planner's rule
  form, ``planner.nftview``) — so the probes test what the host has, not what
  the files hope for; the map's flag and the subnet's isolation come from the
  desired state.
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
port, expected reached only with ``isolation: open``. Both for IPv4 and IPv6
maps: the link has a /30 and a /126 (``domain.probes.VANTAGE_NET6``).

See docs/decisions/031-probes-capture-decides.md.
See docs/decisions/049-diagnosis-names-what-issue-26-saw.md.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from reconciler.domain import nftable
from reconciler.domain.live import LiveNetns, LiveState
from reconciler.domain.model import Alloc, DesiredState, PortMap
from reconciler.domain.ownership import ALLOC_IFNAME
from reconciler.domain.plan import Plan
from reconciler.domain.probes import VANTAGE_NETS, Path, ProbeProto, ProbeSpec
from reconciler.domain.probes import Vantage as VantageKind
from reconciler.planner import addrspace, firewall, fwpaths
from reconciler.planner.allocs.ipam import Mapped
from reconciler.planner.allocs.live import owned_ns
from reconciler.planner.counters import RuleHit, foreign_hits, parse_counters

__all__ = ["RuleHit", "foreign_hits", "parse_counters"]

IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Vantage:
    """The external vantage namespace: its name and the host's addresses on its link.

    ``host6`` is None when the link has no IPv6 pair (a host without IPv6, or the link's
    ``disable_ipv6``): the IPv6 maps' external paths are then skipped with ``no6``.
    """

    netns: str
    host4: str
    host6: str | None = None
    no6: str = "the external vantage link has no IPv6 address"


# ------------------------------------------------------------------ targets from live state


def alloc_addresses(ns: LiveNetns | None, host_id: str) -> dict[int, str]:
    """Return the owned address of each family on the allocation's ``eth0`` (live); none when the
    namespace is not this host's allocation."""
    out: dict[int, str] = {}
    if not owned_ns(host_id, ns):
        return out
    assert ns is not None
    for lk in ns.links:
        if lk.name != ALLOC_IFNAME:
            continue
        for a in lk.addresses:
            if a.owned and a.address.version not in out:
                out[a.address.version] = str(a.address.ip)
    return out


def eth0_mtu(ns: LiveNetns | None, host_id: str) -> int | None:
    """Return the MTU of the allocation's ``eth0`` (live), the size of the full echo."""
    if ns is None or not owned_ns(host_id, ns):
        return None
    return next((lk.mtu for lk in ns.links if lk.name == ALLOC_IFNAME), None)


def live_maps(live: LiveState) -> dict[str, list[tuple[int, Mapped]]]:
    """Map every live port map of ours (our table's entries as DNAT rules) to (family, map),
    by alloc id."""
    out: dict[str, list[tuple[int, Mapped]]] = {}
    for family, chains in ((4, live.firewall4), (6, live.firewall6)):
        for d in firewall.dnat_rules(chains.chains.get(("nat", firewall.DNAT), ())):
            out.setdefault(d.alloc, []).append((family, Mapped.of(d)))
    return out


def _usable_host_address(ip: IPAddr) -> bool:
    """Tell whether an address is usable: not loopback, link-local, multicast or unspecified, and
    not the external vantage's pair (``VANTAGE_NETS``: whoever holds it, another prober's vantage is
    no address of the host; the IPv4 /30 is link-local anyway, the IPv6 /126 is not)."""
    return not (ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified
                or any(ip in net for net, _ in VANTAGE_NETS))


def host_addresses(live: LiveState, desired: DesiredState,
                   exclude: Collection[str] = ()) -> dict[int, str]:
    """Find, per family, a local address of the host not on a link we own (lowest first).

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
    """Find the declared port map a live rule serves (host port fixed or auto, same target)."""
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
                host_exclude: Collection[str] = (),
                br_netfilter: Mapping[int, bool] | None = None) -> list[ProbeSpec]:
    """List every probe of the allocations named (all declared ones for None), in report order.

    ``auto`` prefixes are picked the way the plan picks them (kept from live state).
    ``br_netfilter``: per family, whether ``bridge-nf-call-ip(6)tables`` is 1 (None: take
    it as on). It decides what ``hairpin: false`` can stop: with it, the DNAT is done as
    the frame crosses the bridge, which then must hand it back out of the port it came in
    on — the hairpin flag refuses that, and the path is expected not to arrive; without
    it the host routes the packet back out of the bridge device, which no port flag stops
    (measured: it arrives), so the path is skipped with that reason.
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
        ns = live.netns.get(aid)
        if ns is not None and ns.usable and not owned_ns(live.host_id, ns):
            # another host's (a sandbox's) namespace of that name: never a probe inside it
            out.append(ProbeSpec(a.id, "gateway", "icmp", 4, "alloc", "", refused=(
                f"namespace {aid} is not this host's allocation")))
            continue
        addrs = alloc_addresses(ns, live.host_id)
        out += _gateway_specs(desired, a, addrs, eth0_mtu(ns, live.host_id))
        for family, m in sorted(maps.get(aid, ()), key=lambda fm: (fm[0], fm[1].proto,
                                                                     fm[1].host)):
            declared = _declared(a, m.proto, m)
            if declared is not None and not declared.probe:
                continue
            out += _map_specs(desired, a, family, m, addrs, hosts, vantage,
                              True if br_netfilter is None else br_netfilter.get(family, False))
    return out


def _gateway_specs(desired: DesiredState, a: Alloc, addrs: dict[int, str],
                   mtu: int | None) -> list[ProbeSpec]:
    out = []
    for family in (4, 6):
        gw = _gateway(desired, a, family)
        if gw is None:
            continue
        skipped = None if family in addrs or family == 4 else "no IPv6 address on eth0"
        out.append(ProbeSpec(a.id, "gateway", "icmp", family, "alloc", gw, skipped=skipped,
                             src=addrs.get(family), size=mtu or 0))
    return out


def _map_specs(desired: DesiredState, a: Alloc, family: int, m: Mapped,
               addrs: dict[int, str], hosts: dict[int, str],
               vantage: Vantage | None, bridged: bool) -> list[ProbeSpec]:
    proto: ProbeProto = "tcp" if m.proto == "tcp" else "udp"

    def spec(path: Path, where: VantageKind, dst: str | None, *, skipped: str | None = None,
             dport: int = m.host, expect: bool = True) -> ProbeSpec:
        if dst is None and skipped is None:
            skipped = "no address to send to"
        # ``port`` is the port probed: the host port, or the container port for "direct"
        return ProbeSpec(a.id, path, proto, family, where, dst or "", dport, dport, m.to,
                         expect, skipped)

    subnet = desired.subnets.get(a.subnet)
    bridge = desired.bridges.get(subnet.bridge) if subnet is not None else None
    # a bridge that declares hairpin: false must not hand a frame back out of the port it
    # came in on: the hairpin path is expected NOT to arrive (arriving is a failure)
    hairpin = bridge is None or bridge.hairpin

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
    elif not hairpin and not bridged:
        tables = "iptables" if family == 4 else "ip6tables"
        out.append(spec("hairpin", "alloc", None, skipped=(
            f"hairpin: false cannot stop it without br_netfilter (bridge-nf-call-{tables} "
            "is not 1: the host routes it back out of the bridge device)")))
    else:
        out.append(spec("hairpin", "alloc", host_dst or _gateway(desired, a, family),
                        expect=hairpin))
    if vantage is not None:
        out += _external_specs(desired, a, family, m, addrs, vantage, spec)
    return out


def _external_specs(desired: DesiredState, a: Alloc, family: int, m: Mapped,
                    addrs: dict[int, str], vantage: Vantage,
                    spec: Callable[..., ProbeSpec]) -> list[ProbeSpec]:
    """Make ``external`` through the map and ``direct`` to the allocation's own address, from the
    vantage's address of the map's family (its /30 or its /126): the same paths and
    expectations for IPv4 and IPv6."""
    out: list[ProbeSpec] = []
    host = vantage.host4 if family == 4 else vantage.host6
    s = desired.subnets.get(a.subnet)
    if m.host_ip is not None and m.host_ip.is_loopback:
        out.append(spec("external", "external", None, skipped=f"published on {m.host_ip} only"))
    elif host is None:
        out.append(spec("external", "external", None, skipped=vantage.no6))
    else:
        out.append(spec("external", "external",
                        str(m.host_ip) if m.host_ip is not None else host))
    if s is not None:
        out.append(spec("direct", "external", addrs.get(family), dport=m.to,
                        skipped=vantage.no6 if host is None else None,
                        expect=s.isolation == "open"))
    return out


def has_ipv6_maps(live: LiveState) -> bool:
    """Tell whether some allocation has an IPv6 port map (an IPv6 entry of our table): only then
    does the vantage's IPv6 pair need looking at."""
    return bool(live.firewall6.chains.get(("nat", firewall.DNAT)))


# ------------------------------------------------------------------ causes


@dataclass(frozen=True)
class Sighting:
    """What a probe saw: its packet arrived (the capture, the echo reply); what the sender
    was told; an error that kept it from being sent; whether the full-size echo came back
    (None: none was sent)."""

    reached: bool
    answer: str | None = None
    error: str | None = None
    big: bool | None = None

    @property
    def answered_from_inside(self) -> bool:
        """TCP: the allocation's answer came back (its SYN-ACK, or its reset)."""
        return self.answer in ("connected", "refused")

    def holds(self, spec: ProbeSpec) -> bool:
        """Tell whether the outcome is the expected one. A TCP probe that must arrive must also be
        answered: its SYN arriving while nothing comes back is a broken return path (a
        timeout does not count as reached)."""
        if self.error is not None or self.big is False or self.reached != spec.expect:
            return False
        return not (spec.expect and spec.proto == "tcp" and not self.answered_from_inside)


@dataclass(frozen=True)
class Facts:
    """What the host showed around a failed probe's re-run (``engine.probes`` gathers it).

    ``sysctls`` keys are paths under /proc/sys (``net/ipv4/ip_forward``); ``route`` is
    (output link, type) of the host's route to the allocation's address.
    """

    sysctls: Mapping[str, str] = field(default_factory=dict)
    rp_filter_drops: int = 0
    hits: tuple[RuleHit, ...] = ()
    bridge: str | None = None
    bridge_hairpin: bool = True  # the bridge's declared hairpin
    port_hairpin: bool | None = None  # the hairpin flag of the alloc's bridge port (live)
    route: tuple[str | None, str | None] | None = None
    neighbour: tuple[str | None, str] | None = None  # the host's entry for the alloc: MAC, state
    mac: str | None = None  # eth0's MAC
    alloc_default: bool | None = None  # the allocation has a default route of the family
    #: (address, output link) of the host's route back to where the probe came from, when
    #: that is not the allocation (the external vantage)
    route_back: tuple[str, str | None] | None = None
    #: the host's interfaces a forwarded probe arrives on (its bridge, the vantage link)
    ingress: tuple[str, ...] = ()
    #: drops in other managers' own nftables tables that can have taken it, most certain
    #: first (``planner.nftforeign``)
    nft_drops: tuple[str, ...] = ()
    #: what is wrong with our table ``inet reconciler`` read after the re-run: "" when it is
    #: as built (or cannot be read), else :func:`table_problem`'s words
    table: str = ""


def table_problem(state: nftable.TableState) -> str:
    """Say what is wrong with our table as read back ("" when it is as built, or unread): the
    chain or set a hand edit changed, or that it is gone."""
    if not state.available:
        return ""
    if not state.exists:
        return "is gone"
    return "" if state.intact else f"is not as built ({state.broken})"


@dataclass(frozen=True)
class Cause:
    line: str
    ours: bool = False  # a reconcile pass owns this and heals it


_FORWARDED = ("hairpin", "external", "direct")  # paths the host routes through FORWARD


def classify(spec: ProbeSpec, seen: Sighting, facts: Facts | None = None) -> Cause:
    """Classify a probe whose outcome was not the expected one: its cause line, and whether a
    reconcile pass owns it. ``facts`` (the re-run's) name the cause where they can."""
    if seen.error is not None:
        return Cause(seen.error)
    if spec.path == "direct" and seen.reached and not spec.expect:
        # nothing another manager accepts can open it: our drop is in our own base chain
        return Cause(f"reached {spec.dst}:{spec.to} directly although the subnet's isolation "
                     f"is ports: the drop in chain {nftable.ISOLATE} of table "
                     f"{nftable.FAMILY} {nftable.TABLE} did not take it (its entry is missing "
                     "or the table was changed: a pass rebuilds it)", ours=True)
    if spec.path == "hairpin" and seen.reached and not spec.expect:
        flag_on = facts is not None and facts.port_hairpin is True
        return Cause(f"{spec.proto} to its own host port {spec.dst}:{spec.dport} came back "
                     "into the allocation although its bridge declares hairpin: false"
                     + (" (the port's hairpin flag is on)" if flag_on else ""), ours=flag_on)
    if spec.path == "gateway" and seen.reached and seen.big is False:
        return Cause(f"MTU black hole: a {spec.size}-byte echo with DF to the gateway "
                     f"{spec.dst} is lost where a small one passes (an MTU smaller than "
                     "eth0's on the way: the veth's host end or the bridge)")
    f = facts or Facts()
    found = _named_cause(spec, seen, f)
    if found is not None:
        return found
    if spec.path == "gateway":
        told = "" if seen.answer in (None, "timeout") else f" ({seen.answer})"
        return Cause(f"no echo reply from the gateway {spec.dst}{told}")
    if spec.path == "direct" and not seen.reached:
        return Cause(f"{spec.dst}:{spec.to} not reached directly although the subnet's "
                     "isolation is open")
    told = seen.answer or "timeout"
    if seen.reached:
        return Cause(f"{spec.proto} to {spec.dst}:{spec.dport} arrived in the allocation but "
                     f"nothing came back ({told}): its answer is lost on the way back, or the "
                     "allocation drops the packet")
    if told in ("refused", "connected", "answered") or told.startswith("refused by"):
        return Cause(f"{spec.proto} to {spec.dst}:{spec.dport} never arrived in the "
                     f"allocation, yet the sender was answered ({told}): a REJECT rule or "
                     "another listener on the way")
    return Cause(f"{spec.proto} to {spec.dst}:{spec.dport} never arrived in the "
                 f"allocation ({told})")


def _named_cause(spec: ProbeSpec, seen: Sighting, f: Facts) -> Cause | None:
    """Name the first cause the facts show, most specific first."""
    v = spec.family
    forwarding = "net/ipv4/ip_forward" if v == 4 else "net/ipv6/conf/all/forwarding"
    if spec.path in _FORWARDED and f.sysctls.get(forwarding) == "0":
        return Cause(f"forwarding is off ({forwarding.replace('/', '.')}=0)", ours=True)
    # IPv4 forwards only what arrives on an interface whose own forwarding is on (the
    # bridge for a hairpin, the vantage link from outside); "all" does not override it
    off = sorted(k for k, val in f.sysctls.items() if val == "0" and k.startswith(
        "net/ipv4/conf/") and k.endswith("/forwarding") and k.split("/")[3] in f.ingress)
    if v == 4 and spec.path in _FORWARDED and off:
        return Cause(f"forwarding is off on {off[0].split('/')[3]} "
                     f"({off[0].replace('/', '.')}=0): IPv4 forwards nothing that arrives "
                     "there")
    if f.route is not None:
        dev, kind = f.route
        if dev is None or kind not in (None, "unicast", "local"):
            # the plan does not compare host routes: a pass would not put it back
            return Cause(f"no route to the allocation's address ({kind})")
        if f.bridge is not None and dev != f.bridge:
            return Cause(f"the host routes the allocation's address via {dev}, not its "
                         f"bridge {f.bridge} (a foreign route)")
    bridged = f.sysctls.get(f"net/bridge/bridge-nf-call-{'ip' if v == 4 else 'ip6'}tables")
    hit = _pick(spec, f.hits)
    if hit is not None:
        exposed = ""
        if bridged == "1" and ("physdev" in hit.rule or (
                spec.path in ("hairpin", "gateway")
                and hit.chain in ("FORWARD", "PREROUTING", "POSTROUTING", "INPUT"))):
            exposed = (" (bridge-nf-call-iptables=1: br_netfilter hands what crosses the "
                       "bridge to it)")
        if hit.target in ("DNAT", "REDIRECT"):
            return Cause(f"a foreign rule sends it elsewhere: {hit}")
        return Cause(f"a foreign rule drops it: {hit}{exposed}")
    if f.nft_drops:
        return Cause(f"a foreign rule drops it: {f.nft_drops[0]}")
    if f.table:
        # its rules carry no counters: a table not as built is the suspect, not a certainty
        return Cause(f"our table {nftable.FAMILY} {nftable.TABLE} {f.table}: a pass "
                     "rebuilds it", ours=True)
    if v == 4 and f.rp_filter_drops > 0:  # IPv6 has no rp_filter (a host-wide v4 counter)
        strict = sorted(k.split("/")[3] for k, val in f.sysctls.items()
                        if k.endswith("/rp_filter") and val == "1")
        where = f" (rp_filter=1 on {', '.join(strict)})" if strict else ""
        back = ""
        if f.route_back is not None and f.route_back[1] is not None:
            back = f"; the route back to {f.route_back[0]} is via {f.route_back[1]}"
        return Cause(f"strict reverse-path filtering dropped it{where}: "
                     f"IPReversePathFilter rose by {f.rp_filter_drops}{back}")
    if spec.path == "localhost" and f.bridge is not None and \
            f.sysctls.get(f"net/ipv4/conf/{f.bridge}/route_localnet") == "0":
        return Cause(f"route_localnet is off on {f.bridge} (127.0.0.1 cannot be routed to "
                     "the allocation)", ours=True)
    if spec.path == "hairpin" and f.port_hairpin is False:
        if not f.bridge_hairpin:
            return Cause("hairpin is off on the allocation's bridge port (the bridge "
                         "declares hairpin: false)")
        return Cause("hairpin is off on the allocation's bridge port", ours=True)
    if f.alloc_default is False and spec.path not in ("gateway", "localhost"):
        return Cause(f"no IPv{v} default route inside the allocation", ours=True)
    if f.neighbour is not None and f.mac is not None:
        lladdr, state = f.neighbour
        if lladdr is not None and lladdr.lower() != f.mac.lower() and "FAILED" not in state:
            return Cause(f"stale neighbour entry: the host has {lladdr} ({state}) for the "
                         f"allocation, whose eth0 is {f.mac}")
    return None


def _pick(spec: ProbeSpec, hits: Sequence[RuleHit]) -> RuleHit | None:
    """Pick the hit that names this probe's packet (its ports or addresses), else the first. A
    DNAT or REDIRECT counts only where it names the probe's host port: others' DNATs (Docker's)
    see other traffic during the re-run too."""
    port = {str(spec.dport), f"{spec.dst}:{spec.dport}"}
    mine = [h for h in hits if h.family == spec.family and (
        h.target not in fwpaths.REDIRECTS or port & set(h.rule.replace("/", " ").split()))]
    if not mine:
        return None
    words = {str(spec.dport), str(spec.to), spec.dst}
    for h in mine:
        tokens = set(h.rule.replace("/", " ").split())
        if tokens & words:
            return h
    rules = [h for h in mine if not h.rule.startswith("policy")]
    return (rules or mine)[0]


# ------------------------------------------------------------------ what changed


def probe_targets(plan: Plan, desired: DesiredState) -> set[str]:
    """Find the alloc ids a plan's changes touch: allocations changed with ops, the allocations of a
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
        elif c.kind in ("firewall", "shim"):
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

