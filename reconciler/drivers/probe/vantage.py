"""The external vantage: a namespace that reaches the host the way another host does.

Made once per host (opt-in), marked as ours, refused when a namespace or link of
its name is somebody else's; ``runner`` opens the external probes' sockets in it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import subprocess
from typing import Any

from reconciler.domain.errors import DriverError
from reconciler.domain.ownership import PROBE_VANTAGE_ALIAS
from reconciler.domain.probes import (
    VANTAGE6_HOST,
    VANTAGE6_PEER,
    VANTAGE_HOST,
    VANTAGE_NET,
    VANTAGE_NET6,
    VANTAGE_PEER,
)
from reconciler.drivers import netns


def _ip(*args: str, batch: str) -> None:
    try:
        p = subprocess.run(["ip", *args, "-batch", "-"], input=batch, capture_output=True,
                           text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DriverError(f"probe vantage: ip: {e}") from None
    if p.returncode != 0:
        line = (p.stderr.strip().splitlines() or ["failed"])[-1]
        raise DriverError(f"probe vantage: ip {' '.join(args)}: {line}")


#: the vantage link's MACs (locally administered, fixed): both ends know each other without
#: ARP, which strict rp_filter on the host would also refuse to answer (arp_process checks the
#: sender's route) — the probe then shows the rp_filter drop, not a neighbour that never came
VANTAGE_HOST_MAC, VANTAGE_PEER_MAC = "02:72:63:70:00:01", "02:72:63:70:00:02"


def _mark_lo() -> None:
    """Mark ``lo`` inside the new vantage namespace, before it is mounted, so a
    namespace of that name is provably ours (or provably not) from outside."""
    _ip(batch=f'link set lo alias "{PROBE_VANTAGE_ALIAS}"\nlink set lo up\n')


def create_vantage(ns: str, link: str) -> None:
    """Create the external vantage: namespace ``ns`` joined to this one by the veth ``link``.

    The host end has ``VANTAGE_HOST``/30, the namespace's ``eth0`` ``VANTAGE_PEER``/30
    and a default route through the host, so its connections arrive the way another
    host's do (PREROUTING, FORWARD); the same in IPv6 with the /126 ``VANTAGE_NET6``
    (``_add_ipv6``). Neither end makes addresses of its own (``addrgenmode none``: no
    link-local address, so no DAD or router solicitation), the pair is ``nodad``
    (usable at once) and the neighbours are permanent entries: apart from the probes,
    only the kernel's MLD reports (from ``::``, for the pair's solicited-node groups)
    cross the link. Made with ``ip -batch`` runs: it is opt-in and
    made once per host, where the netlink driver has no veth without a bridge (its veths
    are made attached, as an allocation's, and this driver may not call it). The caller
    holds the vantage's lock exclusively and removed what was there (``remove_vantage``);
    a namespace of that name that is still there is not ours and is refused, never
    replaced. ``lo`` inside carries ``PROBE_VANTAGE_ALIAS`` before the namespace is
    mounted (``_mark_lo`` in ``netns.create``'s ``init``; ``ip`` forked from the thread
    inside the new namespace runs there).
    """
    try:
        made = netns.create(ns, file_mark=PROBE_VANTAGE_ALIAS, init=_mark_lo)
    except DriverError as e:
        raise DriverError(f"probe vantage: {e}") from None
    if not made:
        raise DriverError(f"probe vantage: the namespace {ns} exists and is not ours")
    try:
        _ip(batch="\n".join((
            f"link add {link} address {VANTAGE_HOST_MAC} type veth peer name eth0 "
            f"address {VANTAGE_PEER_MAC} netns {ns}",
            f"link set {link} addrgenmode none",
            f'link set {link} alias "{PROBE_VANTAGE_ALIAS}"',
            f"addr add {VANTAGE_HOST}/{VANTAGE_NET.prefixlen} dev {link}",
            f"neigh replace {VANTAGE_PEER} lladdr {VANTAGE_PEER_MAC} dev {link} nud permanent",
            f"link set {link} up", "")))
        _ip("-n", ns, batch="\n".join((
            "link set eth0 addrgenmode none",
            f"addr add {VANTAGE_PEER}/{VANTAGE_NET.prefixlen} dev eth0",
            f"neigh replace {VANTAGE_HOST} lladdr {VANTAGE_HOST_MAC} dev eth0 nud permanent",
            "link set eth0 up", f"route add default via {VANTAGE_HOST}", "")))
    except DriverError:
        remove_vantage(ns, link)
        raise
    with contextlib.suppress(DriverError):
        _add_ipv6(ns, link)


def _add_ipv6(ns: str, link: str) -> None:
    """Add the vantage link's IPv6 pair, after its IPv4 side: a host without IPv6 (or with it
    disabled on new links) keeps an IPv4 vantage, and its IPv6 maps' external paths say
    why they are skipped (``vantage_ipv6_missing``) instead of every external probe failing."""
    if not os.path.isdir("/proc/sys/net/ipv6"):
        return
    _ip(batch="\n".join((
        f"addr add {VANTAGE6_HOST}/{VANTAGE_NET6.prefixlen} dev {link} nodad",
        f"neigh replace {VANTAGE6_PEER} lladdr {VANTAGE_PEER_MAC} dev {link} nud permanent",
        "")))
    _ip("-n", ns, batch="\n".join((
        f"addr add {VANTAGE6_PEER}/{VANTAGE_NET6.prefixlen} dev eth0 nodad",
        f"neigh replace {VANTAGE6_HOST} lladdr {VANTAGE_HOST_MAC} dev eth0 nud permanent",
        f"route add default via {VANTAGE6_HOST}", "")))


def vantage_ipv6_missing(link: str) -> str | None:
    """Return why the vantage has no IPv6 pair to probe from, or None when it has: its host end
    carries ``VANTAGE6_HOST`` (one file read; the namespace's end failing shows as the
    probes' own failure, "network unreachable")."""
    why = _ipv6_unavailable(link)
    if why is not None:
        return why
    if not _has_ipv6_pair(link):
        return f"the external vantage link has no IPv6 address ({VANTAGE6_HOST} is not on {link})"
    return None


def vantage_lacks_ipv6_pair(link: str) -> bool:
    """Tell whether the link could carry the IPv6 pair and does not: a vantage made by a version
    before the pair, or one whose pair someone removed (made again, see ``VantageLease``)."""
    return _ipv6_unavailable(link) is None and not _has_ipv6_pair(link)


def _ipv6_unavailable(link: str) -> str | None:
    if not os.path.isdir("/proc/sys/net/ipv6"):
        return "no IPv6 in this kernel (the external vantage link has no IPv6 pair)"
    try:
        with open(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6", encoding="ascii") as fh:
            if fh.read().strip() == "1":
                return (f"IPv6 is disabled on the external vantage link "
                        f"(net.ipv6.conf.{link}.disable_ipv6=1)")
    except OSError:
        pass  # the link went meanwhile: the look for the pair says so
    return None


def _has_ipv6_pair(link: str) -> bool:
    """Tell whether ``VANTAGE6_HOST`` is on ``link`` here: a read of ``if_inet6`` (the namespace's
    IPv6 addresses, one per line: hex address, index, prefix, scope, flags, name), not an ``ip``
    process per probe run."""
    want = ipaddress.IPv6Address(VANTAGE6_HOST).exploded.replace(":", "")
    try:
        with open("/proc/thread-self/net/if_inet6", encoding="ascii") as fh:
            rows = [line.split() for line in fh]
    except OSError:
        return False
    return any(len(r) == 6 and r[0] == want and r[5] == link for r in rows)


def _json(*args: str) -> list[dict[str, Any]] | None:
    """Run ``ip ARGS`` (with ``-j``) and parse what it prints; None when it fails."""
    try:
        p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                           check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    try:
        out = json.loads(p.stdout or "[]")
    except ValueError:
        return None
    return out if isinstance(out, list) else None


def _alias(*args: str) -> str | None:
    """Read the ``ifalias`` of one link (``ip -j link show``), "" when it has none, None if
    absent."""
    links = _json(*args)
    if links is None:
        return None
    return str(links[0].get("ifalias", "")) if links else None


def namespace_mark(ns: str) -> str | None:
    """Return the mark of the namespace ``ns``: its ``lo`` alias when it is a live namespace, the
    file's tag when it is an empty file (a crash between unmount and unlink), None when
    there is no such namespace; "" when it carries none."""
    try:
        if not netns.is_namespace_mount(ns):
            return netns.file_mark(ns) or ""
    except (OSError, DriverError):
        return None
    return _alias("-n", ns, "-j", "link", "show", "dev", "lo") or ""


def link_mark(link: str) -> str | None:
    """Return the alias of the host link ``link`` ("" when none), None when there is no such
    link."""
    return _alias("-j", "link", "show", "dev", link)


def vantage_state(ns: str, link: str) -> str:
    """Tell the vantage's state: ``ready`` (both parts there and marked ours), ``absent`` (neither
    there), ``foreign`` (a part of that name is there and not ours), else ``partial`` (ours, half
    there)."""
    ns_mark, link_mk = namespace_mark(ns), link_mark(link)
    if (ns_mark is not None and ns_mark != PROBE_VANTAGE_ALIAS) or \
            (link_mk is not None and link_mk != PROBE_VANTAGE_ALIAS):
        return "foreign"
    if ns_mark is None and link_mk is None:
        return "absent"
    if ns_mark is not None and link_mk is not None and netns.is_namespace_mount(ns):
        return "ready"
    return "partial"


def remove_vantage(ns: str, link: str) -> None:
    """Remove the vantage: the veth first (at once; the namespace's own teardown is
    asynchronous), then the namespace — each only when it carries the vantage's mark
    (``PROBE_VANTAGE_ALIAS``): a link or namespace of that name that is somebody else's
    stays. Absent parts are fine."""
    if link_mark(link) == PROBE_VANTAGE_ALIAS:
        with contextlib.suppress(DriverError):  # gone meanwhile: nothing to remove
            _ip(batch=f"link del {link}\n")
    if namespace_mark(ns) == PROBE_VANTAGE_ALIAS:
        with contextlib.suppress(DriverError, OSError):
            netns.delete(ns)

