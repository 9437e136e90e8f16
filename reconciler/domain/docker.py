"""Docker networks with kind's semantics: the rules the driver and the planner share.

No daemon, no SDK: the options and labels we set, kind's ULA derivation and
duplicate order, and the JSON form of a declared network that plan ops carry.
Comparing a declared network with a live one is the planner's
(``reconciler.planner.docker_diff``).

See docs/decisions/019-docker-scope-label.md.
"""

from __future__ import annotations

import hashlib
import ipaddress
import struct
from collections.abc import Iterable, Mapping
from typing import Any

from reconciler.domain.live import LiveDockerNetwork
from reconciler.domain.model import DockerNetwork, DockerNetworkName

#: Network options kind sets (and that we compare).
OPT_MASQUERADE = "com.docker.network.bridge.enable_ip_masquerade"


OPT_MTU = "com.docker.network.driver.mtu"


#: Docker's own networks: read (the MTU of ``bridge``), never changed.
PROTECTED_NETWORKS = frozenset({"bridge", "host", "none"})


#: Label on a network created IPv4-only because the daemon could not do IPv6
#: (kind's fallback); ``diff_network`` then accepts it without IPv6.
IPV6_FALLBACK_LABEL = "io.reconciler.ipv6-unavailable"


#: Label naming the reconciler instance that created a network: "host", or the
#: network namespace a sandbox run (``--netns``) acted on. Docker networks are
#: global to the daemon, so pruning removes only networks of its own scope — a
#: sandbox run never prunes the host's networks, nor the host a sandbox's.
SCOPE_LABEL = "io.reconciler.scope"


def network_scope(labels: Mapping[str, str]) -> str:
    """Tell which reconciler made an owned network, from its labels (``SCOPE_LABEL``); "host"
    for one made before networks carried the label (sandbox runs came with it). Another
    scope's network is never replaced, deduped or pruned: a conflict."""
    return labels.get(SCOPE_LABEL, "host")


def declared_scope_matches(label: str, scope: str) -> bool:
    """Tell whether a *declared* network labelled with scope ``label`` is ``scope``'s: its own,
    or the label an earlier version gave a namespace without a name (``netns-inode/N``,
    now ``netns-inode/N-<cookie>``). That inode alone cannot tell this namespace from a
    deleted one that had it, so such a network is taken only where it is declared here,
    never pruned."""
    if label == scope:
        return True
    head, sep, _cookie = scope.rpartition("-")
    return bool(sep) and scope.startswith("netns-inode/") and label == head


#: Docker's default address pools (libnetwork ipamutils, Docker 20.10 and later):
#: 172.17.0.0/16 … 172.31.0.0/16 handed out whole, 192.168.0.0/16 as /20s. The API
#: does not report them; ``/etc/docker/daemon.json`` ``default-address-pools`` replaces them.
DEFAULT_ADDRESS_POOLS: tuple[tuple[str, int], ...] = (
    *((f"172.{n}.0.0/16", 16) for n in range(17, 32)),
    ("192.168.0.0/16", 20),
)


#: Option naming the Linux bridge of a bridge network (Docker's ``bridge`` network: docker0)
OPT_BRIDGE_NAME = "com.docker.network.bridge.name"


def bridge_of(network_id: str, options: dict[str, str] | None) -> str:
    """Return the Linux bridge of a Docker bridge network: the option, else ``br-<id[:12]>``."""
    named = (options or {}).get(OPT_BRIDGE_NAME)
    return named if named else f"br-{network_id[:12]}"


def parse_address_pools(config: object) -> tuple[tuple[str, int], ...] | None:
    """Return ``default-address-pools`` of a parsed daemon.json; None when it sets none (or is bad).

    Entries that are not ``{"base": PREFIX, "size": N}`` with N no shorter than the
    base are dropped: dockerd itself refuses to start with them.
    """
    if not isinstance(config, dict):
        return None
    raw = config.get("default-address-pools")
    if not isinstance(raw, list) or not raw:
        return None
    out: list[tuple[str, int]] = []
    for entry in raw:
        if not isinstance(entry, dict):
            continue
        base, size = entry.get("base"), entry.get("size")
        if not isinstance(base, str) or not isinstance(size, int) or isinstance(size, bool):
            continue
        try:
            net = ipaddress.ip_network(base, strict=False)
        except ValueError:
            continue
        if net.prefixlen <= size <= net.max_prefixlen:
            out.append((str(net), size))
    return tuple(out) or None


def ula_subnet(name: str, attempt: int) -> ipaddress.IPv6Network:
    """Return the IPv6 ULA /64 kind derives for network ``name`` on probe ``attempt``.

    sha1 over the name's bytes followed by ``attempt`` as a little-endian
    int32; bytes 2..7 of the digest follow ``fc00``.
    """
    digest = hashlib.sha1(name.encode() + struct.pack("<i", attempt)).digest()
    raw = b"\xfc\x00" + digest[2:8] + bytes(8)
    return ipaddress.IPv6Network((raw, 64))


def sort_duplicates(networks: Iterable[LiveDockerNetwork]) -> list[LiveDockerNetwork]:
    """Return kind's order for networks sharing a name: most containers first, then lowest ID."""
    return sorted(networks, key=lambda n: (-n.containers, n.id))


def parse_mtu(value: object) -> int | None:
    """Return a positive MTU from a Docker option string, else None."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text.isdigit():
        return None
    mtu = int(text)
    return mtu if mtu > 0 else None


def parse_bool(value: str) -> bool | None:
    # Go's strconv.ParseBool, which the daemon uses for bridge options.
    if value in ("1", "t", "T", "true", "TRUE", "True"):
        return True
    if value in ("0", "f", "F", "false", "FALSE", "False"):
        return False
    return None


def split_subnets(subnets: Iterable[str]) -> tuple[list[ipaddress.IPv4Network],
                                                   list[ipaddress.IPv6Network]]:
    """Return the IPv4 and IPv6 networks among Docker's IPAM subnet strings (unparsable ones
    dropped)."""
    v4: list[ipaddress.IPv4Network] = []
    v6: list[ipaddress.IPv6Network] = []
    for text in subnets:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            continue
        if isinstance(net, ipaddress.IPv4Network):
            v4.append(net)
        else:
            v6.append(net)
    return v4, v6


def flag(value: bool) -> str:
    """Return a boolean as Docker options spell it."""
    return "true" if value else "false"


def spec_to_json(spec: DockerNetwork) -> dict[str, Any]:
    """Return a declared network as JSON-able op arguments (``spec_from_json`` reads it back)."""
    return {
        "name": spec.name, "ipv6": spec.ipv6,
        "subnet": str(spec.subnet) if spec.subnet is not None else None,
        "subnet6": str(spec.subnet6) if spec.subnet6 is not None else None,
        "mtu": spec.mtu, "masquerade": spec.masquerade, "internal": spec.internal,
        "labels": dict(spec.labels),
    }


def spec_from_json(raw: dict[str, Any]) -> DockerNetwork:
    """Return the inverse of ``spec_to_json`` (raises ValueError/KeyError on a malformed op)."""
    subnet = raw.get("subnet")
    subnet6 = raw.get("subnet6")
    mtu = raw.get("mtu")
    return DockerNetwork(
        name=DockerNetworkName(str(raw["name"])),
        ipv6=bool(raw.get("ipv6", False)),
        subnet=ipaddress.IPv4Network(subnet) if subnet else None,
        subnet6=ipaddress.IPv6Network(subnet6) if subnet6 else None,
        mtu=int(mtu) if mtu is not None else None,
        masquerade=bool(raw.get("masquerade", True)),
        internal=bool(raw.get("internal", False)),
        labels=tuple(sorted((str(k), str(v)) for k, v in (raw.get("labels") or {}).items())),
    )

