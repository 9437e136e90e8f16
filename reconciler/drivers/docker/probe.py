"""One raw Docker API call, without the SDK: every network, its subnets and owner.

Host-only runs must still prune networks this reconciler created earlier, and
every declared prefix is checked against Docker's networks, so the daemon has
to be asked; importing the Docker SDK and negotiating a client costs ~100 ms,
one ``GET /networks`` costs a few. Only a local unix socket is probed (a
remote daemon's networks are not on this host). The daemon's default address
pools come from its configuration file: the API does not report them.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from dataclasses import dataclass
from typing import Any

from reconciler.domain.docker import DEFAULT_ADDRESS_POOLS, SCOPE_LABEL, parse_address_pools
from reconciler.domain.live import DockerAddressSpace
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.drivers.docker.payloads import network_use

DEFAULT_SOCKET = "/var/run/docker.sock"


#: dockerd's configuration file (``dockerd --config-file`` moves it; not followed)
DAEMON_CONFIG = "/etc/docker/daemon.json"


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def socket_path() -> str | None:
    """The unix socket DOCKER_HOST names (or the default); None for a non-unix DOCKER_HOST."""
    host = os.environ.get("DOCKER_HOST", "")
    if not host:
        return DEFAULT_SOCKET
    if host.startswith("unix://"):
        return host[len("unix://"):]
    return None


@dataclass(frozen=True)
class Listing:
    """What ``GET /networks`` said: every network (with its IPAM config), or why not."""

    answered: bool
    networks: tuple[dict[str, Any], ...] = ()
    error: str | None = None
    #: the socket file is there but nothing listens on it (dockerd stopped, its socket left
    #: behind): the SDK would only be refused too
    refused: bool = False


def list_networks(timeout: float = 2.0) -> Listing | None:
    """Every network of the local daemon; None when there is none to ask here.

    None: no socket (no Docker on this host), or a DOCKER_HOST that is not a unix
    socket (a remote daemon: its networks are not on this host).
    """
    path = socket_path()
    if path is None or not os.path.exists(path):
        return None
    conn = _UnixConnection(path, timeout)
    try:
        conn.request("GET", "/networks")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            return Listing(False, error=f"docker: listing networks failed: HTTP {resp.status}")
        listed = json.loads(body)
    except ConnectionRefusedError:
        # worded as the SDK words it (DockerDriver.observe), which is then not asked
        where = os.environ.get("DOCKER_HOST") or f"unix://{DEFAULT_SOCKET}"
        return Listing(False, error=f"docker daemon unreachable at {where}: connection refused",
                       refused=True)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return Listing(False, error=f"docker daemon unreachable at {path}: {why}")
    finally:
        conn.close()
    if not isinstance(listed, list):
        return Listing(False, error="docker: listing networks: unexpected answer")
    return Listing(True, tuple(n for n in listed if isinstance(n, dict)))


def owned_scopes(listing: Listing | None = None, timeout: float = 2.0) -> set[str] | None:
    """Scope labels of the networks we own, or None when this probe cannot tell.

    An absent socket is an empty set: no daemon, nothing of ours to prune.
    """
    path = socket_path()
    if path is None:
        return None
    if not os.path.exists(path):
        return set()
    if listing is None:
        listing = list_networks(timeout)
    if listing is None or not listing.answered:
        return None
    return {str((n.get("Labels") or {}).get(SCOPE_LABEL, "")) for n in listing.networks
            if (n.get("Labels") or {}).get(DOCKER_LABEL) == DOCKER_LABEL_VALUE}


def address_pools(path: str = DAEMON_CONFIG) -> tuple[tuple[str, int], ...]:
    """``default-address-pools`` of the daemon's configuration, else Docker's defaults."""
    try:
        with open(path, "rb") as fh:
            config = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        return DEFAULT_ADDRESS_POOLS
    return parse_address_pools(config) or DEFAULT_ADDRESS_POOLS


def address_space(listing: Listing | None) -> DockerAddressSpace | None:
    """Every listed network's place in the address space, and the pools; None: no Docker."""
    if listing is None:
        return None
    pools = address_pools()
    if not listing.answered:
        return DockerAddressSpace(False, pools=pools, error=listing.error)
    uses = sorted((network_use(n) for n in listing.networks), key=lambda u: (u.name, u.id))
    return DockerAddressSpace(True, tuple(uses), pools)
