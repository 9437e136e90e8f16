"""firewalld, when it runs in this network namespace: is each bridge we manage in a zone that
accepts its traffic?

firewalld (nftables backend, the default since 0.6) filters in a table of its own
(``inet firewalld``) whose forward chain ends in ``reject``: an ACCEPT of ours in
iptables' ``FORWARD`` cannot override it (each base chain decides on its own, and a
reject in any of them is final). Port maps still pass (firewalld accepts ``ct status
dnat``), but what allocations start, and their replies' first packets elsewhere, are
rejected unless the bridge is in a zone whose target is ACCEPT. We do not edit
firewalld's zones ourselves: the operator runs the one command we print (the decision
is in ARCHITECTURE.md). Read through /proc (a firewalld process in this network
namespace?), ``nft`` (is its table there?) and ``firewall-cmd`` (its D-Bus API), each
only when the one before said firewalld is present: a host without it pays ~1 ms.

See docs/decisions/017-firewalld-refuse-with-its-command.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

TABLE = "table inet firewalld"
TIMEOUT = 20.0


def _process_here() -> bool:
    """Tell whether a firewalld process is in this network namespace (/proc reads only, ~1 ms)."""
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as fh:
                if fh.read().strip() != "firewalld":
                    continue
            if os.stat(f"/proc/{pid}/ns/net").st_ino == mine:
                return True
        except OSError:
            continue  # gone meanwhile, or not ours to see
    return False


def running() -> bool:
    """Tell whether firewalld runs here: its process in this network namespace, and its nft
    table."""
    if shutil.which("firewall-cmd") is None or shutil.which("nft") is None:
        return False
    if not _process_here():
        return False
    try:
        out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                             timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and TABLE in out.stdout.splitlines()


def _cmd(*args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["firewall-cmd", *args], capture_output=True, text=True,
                              timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return None


def zone_target(zone: str) -> str | None:
    """Return the runtime target of ``zone`` (ACCEPT, default, DROP, %%REJECT%%), or None."""
    out = _cmd(f"--info-zone={zone}")
    if out is None or out.returncode != 0:
        return None
    for line in out.stdout.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "target":
            return value.strip()
    return None


def fix_command(bridges: Sequence[str]) -> str:
    adds = " ".join(f"--change-interface={b}" for b in bridges)
    return f"firewall-cmd --permanent --zone=trusted {adds} && firewall-cmd --reload"


def bridges_problem(bridges: Sequence[str]) -> str | None:
    """Return one line when firewalld runs here and a bridge is not in a zone with target ACCEPT."""
    if not bridges or not running():
        return None
    outside: list[str] = []
    targets: dict[str, str | None] = {}
    for b in sorted(bridges):
        out = _cmd(f"--get-zone-of-interface={b}")
        if out is None:
            return ("firewalld runs in this network namespace but firewall-cmd does not answer; "
                    f"put the bridges in a zone that accepts their traffic: {fix_command(bridges)}")
        zone = out.stdout.strip() if out.returncode == 0 else ""
        if not zone:
            outside.append(b)
            continue
        if zone not in targets:
            targets[zone] = zone_target(zone)
        if targets[zone] != "ACCEPT":
            outside.append(b)
    if not outside:
        return None
    return (f"firewalld runs here and rejects forwarded traffic of bridge(s) {', '.join(outside)} "
            "(not in a zone with target ACCEPT; an iptables ACCEPT cannot override firewalld's "
            f"reject); run `{fix_command(outside)}`, then apply again (the reload flushes "
            "rules other tools made)")
