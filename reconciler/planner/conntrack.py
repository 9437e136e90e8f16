"""Which conntrack entries a change of port maps leaves stale (pure).

Conntrack NATs a flow once, at its first packet: a UDP client that keeps its
source port goes on reaching the allocation a map pointed at after the map has
moved to another one or gone, and one that was sending before a map existed is
never NATed (the host answered it, or nothing did). Upstream portmap and
kube-proxy delete such entries; so do we, in the firewall change of the family,
after its restore (``ConntrackDelete``):

* a live DNAT rule (protocol, host port, host address) that now sends elsewhere
  or is gone: the entries of that map whose replies do not come from its
  destination now (TCP and UDP: an established flow to a removed allocation is
  reset by the next one instead of hanging);
* a map that is new: its UDP entries that are not NATed to it (TCP flows to a port
  nothing listened on were refused, so none are left).

See docs/decisions/013-clean-transitions.md.
"""

from __future__ import annotations

from reconciler.domain.live import LiveChainSet
from reconciler.domain.ops import IPAddress, StaleMap
from reconciler.planner import firewall

_Key = tuple[str, int, IPAddress | None]  # protocol, host port, host address
_Dest = tuple[IPAddress, int]


def dnat_targets(rules: tuple[str, ...] | list[str]) -> dict[_Key, _Dest]:
    """Map our allocations' DNAT rules (``RECONCILER-DNAT``) by what they match -> where they
    send."""
    out: dict[_Key, _Dest] = {}
    for d in firewall.dnat_rules(rules):
        out.setdefault((d.proto, d.port, d.host_ip), (d.dest, d.to))
    return out


def stale_maps(desired: firewall.RuleSet, live: LiveChainSet) -> list[StaleMap]:
    """Find the port maps of one family whose conntrack entries must go once the rules change."""
    want = dnat_targets(desired.chains.get(firewall.DNAT, []))
    have = dnat_targets(live.chains.get(("nat", firewall.DNAT), ()))
    out = []
    for key, dest in sorted(have.items(), key=_order):
        if want.get(key) != dest:
            out.append(StaleMap(*key, want.get(key)))
    for key, dest in sorted(want.items(), key=_order):
        if key not in have and key[0] == "udp":
            out.append(StaleMap(*key, dest))
    return out


def _order(item: tuple[_Key, _Dest]) -> tuple[str, int, str]:
    (proto, port, host_ip), _dest = item
    return (proto, port, str(host_ip or ""))
