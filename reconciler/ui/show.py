"""What ``reconcile show`` prints: the owned objects grouped by bridge and subnet (pure).

One line per bridge, its subnets under it and their allocations under those, each
allocation with its addresses, MAC, host veth and port maps; then what belongs to no
bridge of ours, our nftables table's entries per set, leftover namespaces, the probes' vantage and
Docker networks with their containers. ``--output json`` keeps the keys it always had
(``links``, ``firewall``, ``netns``, ``probe_vantage``, ``docker_networks``: scripts
read them; ``firewall`` holds the table's entries in the planner's rule form) and adds
``table`` (``inet reconciler``: how many entries each set holds), ``bridges`` (the same
tree as the text), ``allocs`` (flat) and
``picks`` (where each picked value comes from: its lease, or the live value with no
lease yet; docs/lifetime.md).

See docs/decisions/033-show-and-graph-read-the-host.md.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from reconciler.domain import nftable
from reconciler.domain.docker import SCOPE_LABEL
from reconciler.domain.leases import LEASE, LIVE
from reconciler.domain.live import LiveState
from reconciler.domain.ownership import CHAIN_PREFIX
from reconciler.ui.topology import AllocView, SubnetView, Topology, live_topology


def _alloc_json(a: AllocView) -> dict[str, Any]:
    return {"id": a.id, "bridge": a.bridge, "subnet": a.subnet,
            "addresses": list(a.addresses), "mac": a.mac, "veth": a.veth,
            "ports": [{"host": p.host, "protocol": p.protocol, "to": p.to,
                       "host_ip": p.host_ip} for p in a.ports]}


def _subnet_json(topo: Topology, s: SubnetView) -> dict[str, Any]:
    return {"name": s.name, "cidrs": list(s.cidrs), "gateways": list(s.gateways),
            "allocs": [_alloc_json(a) for a in topo.allocs_of(s.bridge, s.name)]}


def view(live: LiveState, probe_vantage: str | None) -> dict[str, Any]:
    """Build the JSON document of ``show`` (and what its text is printed from)."""
    topo = live_topology(live, all_scopes=True)
    owned_links = {n: lk for n, lk in sorted(live.links.items()) if lk.owned}
    bridge_names = [*topo.bridges, *sorted({s.bridge for s in topo.subnets.values()
                                            if s.bridge is not None} - set(topo.bridges))]
    bridges = []
    for name in bridge_names:
        b = topo.bridges.get(name)
        bridges.append({
            "name": name, "owned": b is not None, "mtu": b.mtu if b else None,
            "up": b.up if b else None, "mac": b.mac if b else None,
            "addresses": list(b.addresses) if b else [],
            "subnets": [_subnet_json(topo, s) for s in topo.subnets_of(name)],
            "allocs": [_alloc_json(a) for a in topo.allocs_of(name, None)]})
    elsewhere = [a for a in topo.allocs.values() if a.bridge not in topo.bridges
                 and not any(s.bridge == a.bridge for s in topo.subnets.values())]
    by_net = {n.id: n for n in (live.docker.networks if live.docker else ())}
    return {
        "links": [{"name": n, "kind": lk.kind, "mtu": lk.mtu, "up": lk.up, "master": lk.master,
                   "addresses": [str(a.address) for a in lk.addresses if a.owned]}
                  for n, lk in owned_links.items()],
        "firewall": {f"ipv{fam}": {f"{t}/{c}": list(r) for (t, c), r in sorted(fw.chains.items())
                                   if c.startswith(CHAIN_PREFIX)}
                     for fam, fw in ((4, live.firewall4), (6, live.firewall6))},
        "table": {"name": f"{nftable.FAMILY} {nftable.TABLE}", "exists": live.table.exists,
                  "intact": live.table.intact,
                  "sets": dict(sorted(Counter(e.set for e in live.table.entries).items()))},
        "netns": sorted(live.netns),
        "probe_vantage": probe_vantage,
        "docker_networks": [{"name": n.name, "id": n.id[:12], "subnets": list(n.subnets),
                             "scope": n.labels.get(SCOPE_LABEL),
                             "containers": [{"name": e.name, "addresses": list(e.addresses)}
                                            for e in by_net[n.id].endpoints]}
                            for n in by_net.values() if n.owned],
        "bridges": bridges,
        "allocs": [_alloc_json(a) for a in [*topo.allocs.values()]],
        "allocs_without_bridge": [a.id for a in elsewhere],
        "picks": picks(live, topo),
        **({"leases_problem": live.leases_problem} if live.leases_problem else {}),
    }


def picks(live: LiveState, topo: Topology) -> dict[str, dict[str, dict[str, Any]]]:
    """Say where the picked values on the host come from, as ``plan --output json`` does: the
    lease table's values are ``lease``; a live address or MAC of ours with no lease yet (the
    next apply records it) is ``live``. Without the files, nothing is ``declared`` here."""
    out: dict[str, dict[str, dict[str, Any]]] = {
        a: {f: {"value": v, "from": LEASE} for f, v in sorted(fields.items())}
        for a, fields in sorted(live.leases.items())}
    for a in topo.allocs.values():
        got = out.setdefault(f"alloc/{a.id}", {})
        for cidr in a.addresses:
            ip = cidr.split("/")[0]
            field = "address6" if ":" in ip else "address"
            got.setdefault(field, {"value": ip, "from": LIVE})
        if a.mac is not None:
            got.setdefault("mac", {"value": a.mac, "from": LIVE})
    for b in topo.bridges.values():
        if b.mac is not None:
            out.setdefault(f"bridge/{b.name}", {}).setdefault("mac", {"value": b.mac,
                                                                      "from": LIVE})
    return {a: fields for a, fields in sorted(out.items()) if fields}


def _alloc_lines(a: dict[str, Any], indent: str) -> list[str]:
    head = " ".join([*a["addresses"], f"mac {a['mac'] or '(none)'}",
                     f"veth {a['veth']}" if a["veth"] else "no veth"])
    lines = [f"{indent}alloc {a['id']}: {head}"]
    if a["ports"]:
        ports = " ".join(f"{p['host']}/{p['protocol']}->{p['to']}"
                         + (f"@{p['host_ip']}" if p["host_ip"] else "") for p in a["ports"])
        lines.append(f"{indent}  ports {ports}")
    return lines


def text(doc: dict[str, Any]) -> str:
    """Write the text of ``show``: the tree first, then everything that is in no tree."""
    lines: list[str] = []
    in_tree = {a["veth"] for a in doc["allocs"] if a["veth"]}
    shown_ns = {a["id"] for a in doc["allocs"]}
    for b in doc["bridges"]:
        if b["owned"]:
            addrs = " ".join(b["addresses"])
            lines.append(f"bridge {b['name']}: mtu {b['mtu']} {'up' if b['up'] else 'down'} "
                         f"mac {b['mac'] or '(none)'} {addrs}".rstrip())
        else:
            lines.append(f"bridge {b['name']}: not owned or gone")
        for s in b["subnets"]:
            gw = f", gateway {' '.join(s['gateways'])}" if s["gateways"] else ", no gateway"
            lines.append(f"  subnet {s['name']}: {' '.join(s['cidrs'])}{gw}")
            for a in s["allocs"]:
                lines += _alloc_lines(a, "    ")
        if b["allocs"]:
            lines.append("  in no subnet of its rules:")
            for a in b["allocs"]:
                lines += _alloc_lines(a, "    ")
    loose = [a for a in doc["allocs"] if a["id"] in doc["allocs_without_bridge"]]
    if loose:
        lines.append("allocations on no bridge of ours:")
        for a in loose:
            lines += _alloc_lines(a, "  ")
    for lk in doc["links"]:
        if lk["kind"] == "bridge" or lk["name"] in in_tree:
            continue
        addrs = " ".join(lk["addresses"])
        master = f" master {lk['master']}" if lk["master"] else ""
        lines.append(f"{lk['kind'] or 'link'} {lk['name']}: mtu {lk['mtu']} "
                     f"{'up' if lk['up'] else 'down'}{master} {addrs}".rstrip())
    table = doc["table"]
    if table["exists"]:
        sets = ", ".join(f"{name} {n}" for name, n in table["sets"].items())
        lines.append(f"table {table['name']}: {sum(table['sets'].values())} entries"
                     + (f" ({sets})" if sets else "")
                     + ("" if table["intact"] else "; not as this version writes it"))
    for ns in doc["netns"]:
        if ns not in shown_ns:
            lines.append(f"netns {ns}")
    if doc["probe_vantage"]:
        lines.append(f"probe vantage netns {doc['probe_vantage']}")
    for dn in doc["docker_networks"]:
        scope = f" [scope {dn['scope']}]" if dn["scope"] else ""
        lines.append(f"docker network {dn['name']} ({dn['id']}) "
                     f"{' '.join(dn['subnets'])}{scope}")
        for c in dn["containers"]:
            lines.append(f"  container {c['name']} {' '.join(c['addresses'])}".rstrip())
    if not any((doc["links"], table["exists"], doc["netns"],
                doc["docker_networks"], doc["probe_vantage"])):
        lines.append("Nothing managed by the reconciler on this host.")
    return "\n".join(lines) + "\n"
