"""The plan agent's wire protocol and identity checks, shared by client and server.

Stdlib only: the `reconcile plan` fast path imports it. A request is a
length-prefixed JSON header followed by the bytes of the files; the agent
acknowledges as soon as it has read a request, then answers with one message.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys

from reconciler.config.paths import MAX_FILE_BYTES
from reconciler.drivers.rundir import RUN_DIR

TYPE_CHECKING = False  # not `typing`: start-up path
if TYPE_CHECKING:
    from collections.abc import Sequence


PROTOCOL = 1




#: environment the answer depends on: the agent must run with the same values (the state
#: directory holds the journals a pending change leaves, which the answer depends on too)
ENV_KEYS = ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH", "RECONCILER_STATE_DIR")


_HEADER = struct.Struct("!I")


#: the agent acknowledges a request as soon as it has read it (it serves one at a time)
ACK, ACK_TIMEOUT = b"\x06", 10.0


REPLY_TIMEOUT = 300.0  # then planning: a full observation of thousands of namespaces


MAX_REQUEST_FILE = MAX_FILE_BYTES + 1  # read_bytes reads one more to see oversize


class Unanswered(Exception):
    """The agent cannot answer this invocation; the in-process CLI will."""


def socket_path(netns_inode: int) -> str:
    return os.path.join(RUN_DIR, f"plan-{netns_inode}.sock")

#: the ``reconciler`` package directory (this file is reconciler/agent/planview/protocol.py)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def code_id() -> str:
    """Return which code this is: name, size and mtime of every file of the package.

    A client and an agent answer a plan the same way only when they run the
    same code; an upgrade under a running agent makes clients plan in-process
    until the agent restarts. The interpreter and the installed distributions
    (PyYAML, jsonschema, the Docker SDK…: their dist-info names carry versions)
    count too.
    """
    root = PACKAGE_ROOT
    parts = [os.path.realpath(sys.executable), sys.version]
    for entry in sys.path:
        if entry.endswith(("site-packages", "dist-packages")):
            try:
                parts += sorted(n for n in os.listdir(entry) if n.endswith(".dist-info"))
            except OSError:
                continue
    for d, dirs, names in os.walk(root):  # every subpackage counts, however new
        dirs[:] = sorted(n for n in dirs if n != "__pycache__")
        for name in sorted(names):
            if name.endswith((".py", ".json")):
                st = os.stat(os.path.join(d, name))
                parts.append(f"{os.path.relpath(d, root)}/{name}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


def current_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ENV_KEYS}


def tool_paths() -> dict[str, str | None]:
    """Find where this PATH finds the tools an observation runs (their real files)."""
    out: dict[str, str | None] = {}
    dirs = os.environ.get("PATH", os.defpath).split(os.pathsep)
    for tool in ("iptables-save", "ip6tables-save"):
        out[tool] = None
        for d in dirs:
            path = os.path.join(d or ".", tool)
            if os.access(path, os.X_OK) and not os.path.isdir(path):
                out[tool] = os.path.realpath(path)
                break
    return out


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise Unanswered("the agent closed the connection")
        buf += chunk
    return bytes(buf)


def send_message(sock: socket.socket, doc: dict[str, object], blobs: Sequence[bytes] = ()) -> None:
    head = json.dumps(doc).encode()
    sock.sendall(_HEADER.pack(len(head)) + head + b"".join(blobs))


def recv_message(sock: socket.socket, limit: int = 64 << 20) -> dict[str, object]:
    (n,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    if n > limit:
        raise Unanswered("oversized reply")
    doc = json.loads(recv_exact(sock, n))
    if not isinstance(doc, dict):
        raise Unanswered("malformed reply")
    return doc


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])

