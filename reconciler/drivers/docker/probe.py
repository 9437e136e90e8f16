"""One raw Docker API call, without the SDK: which scopes own networks here?

Host-only runs must still prune networks this reconciler created earlier, so
the daemon has to be asked; importing the Docker SDK and negotiating a client
costs ~100 ms, this costs a few. Only a local unix socket is probed; for
anything else the caller falls back to the SDK.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.parse

from reconciler.domain.docker import SCOPE_LABEL
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE

DEFAULT_SOCKET = "/var/run/docker.sock"


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


def owned_scopes(timeout: float = 2.0) -> set[str] | None:
    """Scope labels of the networks we own, or None when this probe cannot tell.

    An absent socket is an empty set: no daemon, nothing of ours to prune.
    """
    path = socket_path()
    if path is None:
        return None
    if not os.path.exists(path):
        return set()
    filters = json.dumps({"label": [f"{DOCKER_LABEL}={DOCKER_LABEL_VALUE}"]})
    conn = _UnixConnection(path, timeout)
    try:
        conn.request("GET", "/networks?filters=" + urllib.parse.quote(filters))
        resp = conn.getresponse()
        if resp.status != 200:
            return None
        listed = json.loads(resp.read())
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()
    return {str((n.get("Labels") or {}).get(SCOPE_LABEL, "")) for n in listed
            if isinstance(n, dict)}
