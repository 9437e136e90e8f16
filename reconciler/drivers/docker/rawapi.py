"""One raw Docker API call, without the SDK: every network, its subnets and owner.

Host-only runs must still prune networks this reconciler created earlier, and
every declared prefix is checked against Docker's networks, so the daemon has
to be asked; importing the Docker SDK and negotiating a client costs ~100 ms,
one ``GET /networks`` costs a few. Only a local unix socket is asked (a
remote daemon's networks are not on this host). The daemon's default address
pools come from its configuration file: the API does not report them.

See docs/decisions/007-start-up-costs.md.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from reconciler.domain.docker import DEFAULT_ADDRESS_POOLS, SCOPE_LABEL, parse_address_pools
from reconciler.domain.live import DockerAddressSpace
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.drivers.docker.payloads import network_use

DEFAULT_SOCKET = "/var/run/docker.sock"


#: dockerd's configuration file (``dockerd --config-file`` moves it; not followed)
DAEMON_CONFIG = "/etc/docker/daemon.json"


class _BadAnswer(Exception):
    """Not an HTTP answer we can read."""


#: the most of an answer read (a host with thousands of networks lists a few MB)
MAX_ANSWER = 64 << 20


def _get(path: str, target: str, timeout: float) -> tuple[int, bytes]:
    """Return (status, body) of one ``GET target`` over the unix socket ``path``, HTTP/1.0,
    within ``timeout`` seconds in all.

    Not ``http.client``: it imports ``ssl`` and ``email`` (~12 ms of every run) for one
    request whose answer is a status line, a few headers and a body. Read until the body
    is complete (its Content-Length, or the last chunk of a chunked one) or the daemon
    closes (an HTTP/1.0 request is answered without a persistent connection, but one
    kept open must not cost the timeout).
    """
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(f"GET {target} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        data = bytearray()
        body_at: int | None = None  # where the body starts, once the headers are in
        need: int | None = None  # the whole answer's length, when a Content-Length says
        while not _complete(data, body_at, need):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_ANSWER:
                raise _BadAnswer(f"answer larger than {MAX_ANSWER} bytes")
            if body_at is None and (end := data.find(b"\r\n\r\n")) >= 0:
                body_at = end + 4
                _status, headers, _ = _split(bytes(data[:body_at]))
                length = headers.get(b"content-length", b"")
                if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                    need = -1
                elif length.isdigit():
                    need = body_at + int(length)
    finally:
        sock.close()
    if not data:  # hung up before a word: a daemon going away
        raise ConnectionResetError("closed the connection without an answer")
    status, headers, body = _split(bytes(data))
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = _unchunk(body)
    elif (length := headers.get(b"content-length", b"")).isdigit():
        if len(body) < int(length):
            raise _BadAnswer("answer cut short")
        body = body[:int(length)]
    return status, body


def _split(data: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """Return (status, headers by lower-case name, body) of an answer; _BadAnswer if it is none."""
    head, sep, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = lines[0].split(None, 2)
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/") \
            or not status[1].isdigit():
        raise _BadAnswer("no HTTP answer")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(b":") for line in lines[1:])}
    return int(status[1]), headers, body


def _complete(data: bytearray, body_at: int | None, need: int | None) -> bool:
    """Tell whether ``data`` holds a whole answer already (else: read on, or to the end):
    ``need`` its length from Content-Length, -1 for a chunked body (complete once its last
    chunk is in), None to read until the daemon closes. Nothing here re-reads what came
    before (a big answer read again at each receive was quadratic)."""
    if body_at is None or need is None:
        return False
    if need >= 0:
        return len(data) >= need
    if not data.endswith(b"0\r\n\r\n"):
        return False
    try:
        _unchunk(bytes(data[body_at:]))
    except _BadAnswer:
        return False
    return True


def _unchunk(data: bytes) -> bytes:
    out: list[bytes] = []
    while True:
        size_line, sep, data = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0], 16)
        except ValueError:
            raise _BadAnswer("bad chunk size") from None
        if not sep or len(data) < size:
            raise _BadAnswer("answer cut short")
        if size == 0:
            return b"".join(out)
        out.append(data[:size])
        data = data[size + 2:]


def socket_path() -> str | None:
    """Return the unix socket DOCKER_HOST names (or the default); None for a non-unix
    DOCKER_HOST."""
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
    """Return every network of the local daemon; None when there is none to ask here.

    None: no socket (no Docker on this host), or a DOCKER_HOST that is not a unix
    socket (a remote daemon: its networks are not on this host).
    """
    path = socket_path()
    if path is None or not os.path.exists(path):
        return None
    try:
        status, body = _get(path, "/networks", timeout)
        if status != 200:
            return Listing(False, error=f"docker: listing networks failed: HTTP {status}")
        try:
            listed = json.loads(body)
        except ValueError as exc:
            raise _BadAnswer(f"not JSON ({exc})") from None
    except ConnectionRefusedError:
        # worded as the SDK words it (DockerDriver.observe), which is then not asked
        where = os.environ.get("DOCKER_HOST") or f"unix://{DEFAULT_SOCKET}"
        return Listing(False, error=f"docker daemon unreachable at {where}: connection refused",
                       refused=True)
    except _BadAnswer as exc:
        return Listing(False, error=f"docker: listing networks: bad answer from {path}: {exc}")
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return Listing(False, error=f"docker daemon unreachable at {path}: {why}")
    if not isinstance(listed, list):
        return Listing(False, error="docker: listing networks: unexpected answer")
    return Listing(True, tuple(n for n in listed if isinstance(n, dict)))


def owned_scopes(listing: Listing | None = None, timeout: float = 2.0) -> set[str] | None:
    """Return scope labels of the networks we own, or None when this call cannot tell.

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
    """Return ``default-address-pools`` of the daemon's configuration, else Docker's defaults."""
    try:
        with open(path, "rb") as fh:
            config = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        return DEFAULT_ADDRESS_POOLS
    return parse_address_pools(config) or DEFAULT_ADDRESS_POOLS


def address_space(listing: Listing | None) -> DockerAddressSpace | None:
    """Return every listed network's place in the address space, and the pools; None: no Docker."""
    if listing is None:
        return None
    pools = address_pools()
    if not listing.answered:
        return DockerAddressSpace(False, pools=pools, error=listing.error)
    uses = sorted((network_use(n) for n in listing.networks), key=lambda u: (u.name, u.id))
    return DockerAddressSpace(True, tuple(uses), pools)
