"""What the probes read only after a failure, to name its cause (SPEC §7)."""

from __future__ import annotations

import subprocess


def save_counters(family: int, *, legacy: bool = False) -> str | None:
    """Run ``iptables-save -c`` (``ip6tables-save -c``): every rule with its counters, or None.

    Only around a failed probe's re-run: which foreign rule's counter rose says which
    rule dropped it. The same tools as the iptables driver, read-only. ``legacy``: the
    iptables-legacy tables instead (``iptables-legacy-save -c``).
    """
    cmd = ("iptables" if family == 4 else "ip6tables") + ("-legacy" if legacy else "") + "-save"
    try:
        p = subprocess.run([cmd, "-c"], capture_output=True, text=True, timeout=30,
                           errors="surrogateescape", check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def nft_ruleset() -> str | None:
    """Run ``nft -a list ruleset`` (every table, with handles and counters), or None.

    Only around a failed probe's re-run: another manager's own nftables table (not
    iptables-nft's, which ``save_counters`` reads) may drop it. Read-only.
    """
    try:
        p = subprocess.run(["nft", "-a", "list", "ruleset"], capture_output=True, text=True,
                           timeout=30, errors="surrogateescape", check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def netstat_counter(name: str, text: str | None = None) -> int:
    """Read a ``TcpExt``/``IpExt`` counter of this namespace's /proc/net/netstat (0 if absent)."""
    if text is None:
        try:
            with open("/proc/thread-self/net/netstat", encoding="ascii") as fh:
                text = fh.read()
        except OSError:
            return 0
    lines = text.splitlines()
    for head, values in zip(lines[::2], lines[1::2], strict=False):
        names, nums = head.split()[1:], values.split()[1:]
        if name in names and len(nums) == len(names):
            return int(nums[names.index(name)])
    return 0
