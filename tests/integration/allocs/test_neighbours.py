"""The neighbour entries an apply seeds, against the real kernel (issue 13 item 6, issue 18).

They are created exempt from the kernel's neighbour GC (``extern_learn``), so they do
not fill ``gc_thresh3``; the kernel then never collects them, so the reconciler deletes
the bridge-side ones of an allocation that is pruned or re-addressed, and nothing else.
Checked with ``ip -j neigh`` of the sandbox host and of the allocation namespaces (it
prints ``"extern_learn": null`` and ``"protocol"`` for such entries).
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.support.host import Netns, sh, unique
from tests.support.identities import (
    BRIDGE,
    alloc_mac,
    apply_ok,
    bridge_mac,
    config,
    ids,
    v4_of,
    v6_of,
)

pytestmark = pytest.mark.root

#: the protocol our entries carry (``ownership.NEIGH_PROTO``: 'R'); ``ip`` prints it in decimal
OUR_PROTO = "82"


def table(ns: str, dev: str) -> dict[str, dict[str, object]]:
    """``ip -j neigh show dev`` of namespace ``ns``: destination -> its JSON object."""
    out = json.loads(sh("ip", "-n", ns, "-j", "neigh", "show", "dev", dev).stdout or "[]")
    return {str(n["dst"]): n for n in out}


def extern_learn(entry: dict[str, object]) -> bool:
    return "extern_learn" in entry


def test_seeded_entries_are_exempt_from_gc_on_the_bridge_and_inside(host_ns: Netns, tmp_path):
    aids = ids(2)
    apply_ok(host_ns, config(tmp_path, [{"id": a} for a in aids]))
    bridge = table(host_ns.name, BRIDGE)
    for aid in aids:
        for ip in (v4_of(aid), v6_of(aid)):
            entry = bridge.get(ip)
            assert entry is not None, (ip, bridge)
            assert entry["lladdr"] == alloc_mac(aid), entry
            assert extern_learn(entry), f"bridge-side entry of {ip} counts toward gc: {entry}"
            assert entry.get("protocol") == OUR_PROTO, entry
        inside = table(aid, "eth0")
        for gw in ("10.78.0.1", "fd00:78::1"):
            entry = inside.get(gw)
            assert entry is not None, (gw, inside)
            assert entry["lladdr"] == bridge_mac(BRIDGE), entry
            assert extern_learn(entry), f"gateway entry in {aid} counts toward gc: {entry}"


def test_a_pruned_allocs_bridge_entries_go_in_the_same_apply(host_ns: Netns, tmp_path):
    keep, gone = ids(2)
    apply_ok(host_ns, config(tmp_path, [{"id": keep}, {"id": gone}]))
    addrs = (v4_of(gone), v6_of(gone))
    kept = (v4_of(keep), v6_of(keep))
    assert set(addrs) <= set(table(host_ns.name, BRIDGE))
    path = config(tmp_path, [{"id": keep}], "one.yaml")
    r = host_ns.reconcile("plan", path)
    assert r.rc == 2 and f"- alloc {gone}" in r.out, r.all
    r = host_ns.reconcile("apply", path)
    assert r.rc == 0, r.all
    bridge = table(host_ns.name, BRIDGE)
    assert not set(addrs) & set(bridge), f"entries of pruned {gone} stayed: {bridge}"
    assert set(kept) <= set(bridge), bridge
    r = host_ns.reconcile("plan", path)
    assert r.rc == 0 and "No changes." in r.out, r.all


def test_a_readdressed_allocs_old_entry_goes(host_ns: Netns, tmp_path):
    (aid,) = ids(1)
    apply_ok(host_ns, config(tmp_path, [{"id": aid, "address": "10.78.0.10"}]))
    assert table(host_ns.name, BRIDGE)["10.78.0.10"]["lladdr"] == alloc_mac(aid)
    path = config(tmp_path, [{"id": aid, "address": "10.78.0.11"}], "moved.yaml")
    r = host_ns.reconcile("plan", path)
    assert r.rc == 2 and "10.78.0.10" in r.out, r.all
    r = host_ns.reconcile("apply", path)
    assert r.rc == 0, r.all
    assert v4_of(aid) == "10.78.0.11"
    bridge = table(host_ns.name, BRIDGE)
    assert "10.78.0.10" not in bridge, bridge
    r = host_ns.reconcile("plan", path)
    assert r.rc == 0 and "No changes." in r.out, r.all


def test_an_entry_arp_moved_to_another_mac_still_goes_with_its_allocation(host_ns: Netns,
                                                                          tmp_path):
    """The kernel updates our entry's lladdr from ARP and keeps its flags and protocol: an
    allocation whose eth0 took a vendor's MAC left, after its prune, an entry exempt from
    the kernel's GC that no plan or gc saw as ours (the review found it)."""
    keep, gone = ids(2)
    apply_ok(host_ns, config(tmp_path, [{"id": keep}, {"id": gone}]))
    vendor = "00:16:3e:aa:bb:cc"
    sh("ip", "-n", gone, "link", "set", "eth0", "address", vendor)
    ip = v4_of(gone)
    send = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            "s.sendto(b'x', ('10.78.0.1', 9))")
    for _ in range(50):  # the gateway's ARP answer path updates the entry of the sender
        sh("ip", "netns", "exec", gone, sys.executable, "-c", send)
        entry = table(host_ns.name, BRIDGE).get(ip)
        if entry is not None and entry["lladdr"] == vendor:
            break
        time.sleep(0.1)
    assert entry is not None and entry["lladdr"] == vendor, entry
    assert extern_learn(entry) and entry.get("protocol") == OUR_PROTO, entry
    path = config(tmp_path, [{"id": keep}], "one.yaml")
    r = host_ns.reconcile("apply", path)
    assert r.rc == 0, r.all
    assert ip not in table(host_ns.name, BRIDGE), table(host_ns.name, BRIDGE)
    r = host_ns.reconcile("plan", path)
    assert r.rc == 0 and "No changes." in r.out, r.all


def test_foreign_look_alikes_are_never_deleted(host_ns: Netns, tmp_path):
    keep, gone = ids(2)
    apply_ok(host_ns, config(tmp_path, [{"id": keep}, {"id": gone}]))
    ours_format = "02:5e:00:00:00:01"  # locally administered, unicast: our MACs' format
    other = unique("fb")
    host_ns.run("ip", "link", "add", other, "type", "bridge")
    host_ns.run("ip", "link", "set", other, "up")
    foreign = {
        # pinned by someone
        (BRIDGE, "10.78.0.200"): ("lladdr", ours_format, "nud", "permanent"),
        # a plain entry (the kernel's own kind) for an address nothing declares
        (BRIDGE, "10.78.0.201"): ("lladdr", ours_format, "nud", "stale"),
        # extern_learn, a vendor's MAC, another control plane's protocol (zebra's)
        (BRIDGE, "10.78.0.202"): ("lladdr", "00:16:3e:00:00:02", "nud", "stale",
                                  "extern_learn", "protocol", "zebra"),
        # extern_learn, our MACs' format, but not our protocol
        (BRIDGE, "10.78.0.203"): ("lladdr", ours_format, "nud", "stale", "extern_learn"),
        # the MAC of the allocation being pruned, but permanent
        (BRIDGE, "10.78.0.204"): ("lladdr", alloc_mac(gone), "nud", "permanent"),
        # all our marks, on a bridge that is not ours
        (other, "10.78.0.205"): ("lladdr", alloc_mac(gone), "nud", "stale", "extern_learn",
                                 "protocol", OUR_PROTO),
    }
    for (dev, ip), spec in foreign.items():
        host_ns.run("ip", "neigh", "add", ip, *spec, "dev", dev)
    before = {key: table(host_ns.name, key[0])[key[1]] for key in foreign}
    ours = (v4_of(gone), v6_of(gone))
    path = config(tmp_path, [{"id": keep}], "one.yaml")
    r = host_ns.reconcile("apply", path)
    assert r.rc == 0, r.all
    bridge = table(host_ns.name, BRIDGE)
    assert not set((v4_of(keep), v6_of(keep))) - set(bridge), bridge
    assert not set(ours) & set(bridge), f"the pruned allocation's entries stayed: {bridge}"
    for (dev, ip), entry in before.items():
        now = table(host_ns.name, dev).get(ip)
        assert now is not None, f"foreign entry {ip} on {dev} was deleted: {entry}"
        assert now["lladdr"] == entry["lladdr"] and extern_learn(now) == extern_learn(entry)
    r = host_ns.reconcile("plan", path)
    assert r.rc == 0 and "No changes." in r.out, r.all


def test_an_entry_the_plan_replaces_becomes_ours_and_goes_with_its_allocation(host_ns: Netns,
                                                                             tmp_path):
    keep, gone = ids(2)
    apply_ok(host_ns, config(tmp_path, [{"id": keep}, {"id": gone}]))
    ip = v4_of(gone)
    # someone's plain entry with another MAC: the plan points it at the allocation's
    host_ns.run("ip", "neigh", "replace", ip, "lladdr", "02:00:5e:10:00:01", "dev", BRIDGE,
                "nud", "stale")
    assert not extern_learn(table(host_ns.name, BRIDGE)[ip])
    apply_ok(host_ns, config(tmp_path, [{"id": keep}, {"id": gone}]))
    entry = table(host_ns.name, BRIDGE)[ip]
    assert entry["lladdr"] == alloc_mac(gone) and extern_learn(entry), entry
    assert entry.get("protocol") == OUR_PROTO, entry
    apply_ok(host_ns, config(tmp_path, [{"id": keep}], "one.yaml"))
    assert ip not in table(host_ns.name, BRIDGE)
