"""Over a host's lifetime: a simulated reboot of a sandbox, and what the reconciler picked there.

``reboot`` deletes every namespace of a sandbox (its allocations' and the sandbox
itself, with its links, routes and rules) and makes the sandbox again under the same
name, so the state directory of its scope (``netns-NAME``) is the one kept.
``identities`` reads, with independent tools (``ip -j``, ``nft -j``), every value
the reconciler picks: addresses, MACs, ``auto`` host ports and prefixes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any

from reconciler.drivers import netns
from tests.support.host import (
    Netns,
    forget_run_files,
    ip_json,
    netns_names,
    remove_vantage,
    sh,
)


def reboot(host: Netns, allocs: Iterable[str]) -> None:
    """Take every kernel object of ``host`` and its ``allocs`` away, as a reboot does; the
    sandbox comes back empty under its name (lo up). The state directory is left alone."""
    for aid in allocs:
        if aid in netns_names():
            netns.delete(aid)
    old = os.stat(f"/run/netns/{host.name}").st_ino
    remove_vantage(old)  # a prober's (an agent's) that held it: gone with the host too
    sh("ip", "netns", "del", host.name)
    forget_run_files(old)
    sh("ip", "netns", "add", host.name)
    sh("ip", "-n", host.name, "link", "set", "lo", "up")


def eth0(aid: str) -> dict[str, Any]:
    """Return an allocation's eth0: ``{"mac": …, "addresses": [...]}`` (global scope only)."""
    for link in ip_json(aid, "addr", "show", "dev", "eth0"):
        return {"mac": link.get("address"),
                "addresses": sorted(a["local"] for a in link.get("addr_info", ())
                                    if a.get("scope") == "global")}
    raise AssertionError(f"no eth0 in {aid}")


def auto_ports(host: Netns, aid: str) -> list[int]:
    """Return the host ports of ``aid``'s DNAT rules: our nftables table's port-map entries
    of the sandbox, read with ``nft -j`` (``Netns.our_rules``)."""
    save = host.our_rules(4)
    return sorted({int(m.group(1)) for line in save.splitlines() if f"alloc={aid}" in line
                   and "-j DNAT" in line and (m := re.search(r"--dport (\d+)", line))})


def identities(host: Netns, allocs: Iterable[str], bridges: Iterable[str]) -> dict[str, Any]:
    """Return every picked value of ``allocs`` and ``bridges`` (their MACs and gateway
    prefixes), comparable across runs."""
    out: dict[str, Any] = {}
    for aid in allocs:
        out[f"alloc/{aid}"] = {**eth0(aid), "ports": auto_ports(host, aid)}
    for b in bridges:
        link = host.link(b)
        assert link is not None, b
        out[f"bridge/{b}"] = {"mac": link.get("address"), "prefixes": host.addrs(b)}
    return out


def lease_file(host: Netns) -> str:
    """Return the path of the sandbox's lease file (docs/lifetime.md)."""
    return os.path.join(os.environ["RECONCILER_STATE_DIR"], f"netns-{host.name}", "leases.json")


def leases(host: Netns) -> dict[str, Any]:
    """Read the sandbox's lease table (``{}`` when there is none)."""
    try:
        with open(lease_file(host)) as fh:
            return dict(json.load(fh)["leases"])
    except FileNotFoundError:
        return {}
