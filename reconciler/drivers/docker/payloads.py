"""What the Docker daemon returns (only the keys we read), and pure classifiers of its errors."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypedDict

from reconciler.domain.docker import OPT_MTU, bridge_of
from reconciler.domain.docker import parse_mtu as _parse_mtu
from reconciler.domain.live import DockerNetworkUse, LiveDockerNetwork, LiveEndpoint

_DAEMON_PREFIX = "Error response from daemon: "


class IPAMPoolPayload(TypedDict, total=False):
    Subnet: str
    Gateway: str


class IPAMPayload(TypedDict, total=False):
    Driver: str
    Config: list[IPAMPoolPayload] | None


class EndpointPayload(TypedDict, total=False):
    Name: str
    IPv4Address: str
    IPv6Address: str


class NetworkInspect(TypedDict, total=False):
    """``GET /networks/{id}`` (``docker network inspect``)."""

    Name: str
    Id: str
    Driver: str
    EnableIPv6: bool
    Internal: bool
    IPAM: IPAMPayload
    Containers: dict[str, EndpointPayload] | None
    Options: dict[str, str] | None
    Labels: dict[str, str] | None


def daemon_message(msg: str) -> str:
    """Return the daemon's explanation, without the CLI's ``Error response from daemon:``.

    The CLI prints ``Error response from daemon: <text>``; the SDK's
    ``APIError.explanation`` is ``<text>`` and ``str(APIError)`` wraps it as
    ``... Forbidden ("<text>")``. Classifiers look for kind's texts anywhere in
    the message so all three forms match.
    """
    text = msg.strip()
    if text.startswith(_DAEMON_PREFIX):
        text = text[len(_DAEMON_PREFIX):]
    return text


# kind's exact texts (note the double space before "(iptables failed").
_IPV6_UNAVAILABLE = (
    # IPv6 disabled in the kernel
    "Cannot read IPv6 setup for bridge",
    # ip6tables missing or broken
    "Failed to Setup IP tables: Unable to enable NAT rule:  (iptables failed: ip6tables",
    # IPv6 missing in the kernel
    "setting default policy to DROP in FORWARD chain failed:  (iptables failed: ip6tables",
)


_POOL_OVERLAP = (
    "Pool overlaps with other one on this address space",
    "networks have overlapping",
)


_IPV4_POOL_EXHAUSTED = "could not find an available, non-overlapping IPv4 address pool"


_NOT_FOUND = re.compile(r"\bnetwork [\w.-]+ not found\b")


_EXIT_STATUS = re.compile(r"exit status \d+")


def is_ipv6_unavailable(msg: str) -> bool:
    """Tell whether the daemon cannot set up IPv6 on this host (kind falls back to IPv4-only)."""
    text = daemon_message(msg)
    return any(known in text for known in _IPV6_UNAVAILABLE)


def is_pool_overlap(msg: str) -> bool:
    """Tell whether a requested subnet overlaps one in use (kind probes the next subnet)."""
    text = daemon_message(msg)
    return any(known in text for known in _POOL_OVERLAP)


def is_already_exists(msg: str) -> bool:
    """Tell whether the message is ``network with name X already exists`` (a create race;
    benign)."""
    text = daemon_message(msg)
    return "network with name" in text and "already exists" in text


def is_no_such_network(msg: str) -> bool:
    """Tell whether the network is gone (benign while deleting or inspecting).

    The CLI has printed ``Error: No such network: X``; the 20.10 API says
    ``network X not found``. The status code alone is no proof: the daemon
    also answers 404 when the IPv4 default pools are exhausted.
    """
    lines = [daemon_message(line) for line in msg.splitlines() if line.strip()]
    # kind's isOnlyErrorNoSuchNetwork: every error line must be a "no such network".
    return bool(lines) and all(
        "No such network" in line or _NOT_FOUND.search(line) or _EXIT_STATUS.fullmatch(line)
        for line in lines
    ) and not all(_EXIT_STATUS.fullmatch(line) for line in lines)


def is_ipv4_pool_exhausted(msg: str) -> bool:
    """Tell whether Docker's default IPv4 address pools are all in use."""
    return _IPV4_POOL_EXHAUSTED in daemon_message(msg)


def parse_network(attrs: Mapping[str, Any]) -> LiveDockerNetwork:
    """Parse a ``LiveDockerNetwork`` from a network inspect (or list) payload."""
    ipam = attrs.get("IPAM") or {}
    subnets = tuple(
        str(pool["Subnet"]) for pool in (ipam.get("Config") or []) if pool.get("Subnet")
    )
    return LiveDockerNetwork(
        id=str(attrs.get("Id", "")),
        name=str(attrs.get("Name", "")),
        driver=str(attrs.get("Driver", "")),
        labels={str(k): str(v) for k, v in (attrs.get("Labels") or {}).items()},
        options={str(k): str(v) for k, v in (attrs.get("Options") or {}).items()},
        enable_ipv6=bool(attrs.get("EnableIPv6", False)),
        internal=bool(attrs.get("Internal", False)),
        subnets=subnets,
        containers=len(attrs.get("Containers") or {}),
        endpoints=endpoints(attrs),
    )


def _bare(address: object) -> str | None:
    """Strip the prefix: ``172.18.0.2/16`` -> ``172.18.0.2``; None for an empty or missing one."""
    text = str(address or "").split("/", 1)[0].strip()
    return text or None


def endpoints(attrs: Mapping[str, Any]) -> tuple[LiveEndpoint, ...]:
    """Return the containers a network inspect lists (a list call lists none), by name."""
    found = [LiveEndpoint(str(ep.get("Name") or cid[:12]), _bare(ep.get("IPv4Address")),
                          _bare(ep.get("IPv6Address")),
                          tuple(str(ep[k]) for k in ("IPv4Address", "IPv6Address") if ep.get(k)))
             for cid, ep in (attrs.get("Containers") or {}).items() if isinstance(ep, Mapping)]
    return tuple(sorted(found, key=lambda e: e.name))


def network_use(attrs: Mapping[str, Any]) -> DockerNetworkUse:
    """Place a listed network in the address space: its subnets and its Linux bridge."""
    n = parse_network(attrs)
    return DockerNetworkUse(n.name, n.id, n.subnets, bridge_of(n.id, n.options), n.owned,
                            n.driver)


def parse_default_mtu(bridge_attrs: Mapping[str, Any]) -> int | None:
    """Return the MTU option of Docker's default ``bridge`` network, or None.

    None when the option is absent, empty or not a positive number; kind then
    omits the MTU option and Docker uses its own default.
    """
    options = bridge_attrs.get("Options") or {}
    return _parse_mtu(options.get(OPT_MTU))

