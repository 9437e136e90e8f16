"""Where named network namespaces live, and which namespaces this process is in.

Stdlib ``os`` only: the `reconcile plan` fast path uses it. The one definition
of ``/run/netns`` and the one place that reads the current namespace's identity.
"""

from __future__ import annotations

import os
import socket
import struct

NETNS_RUN_DIR = "/run/netns"

#: getsockopt(SOL_SOCKET, SO_NETNS_COOKIE): the 64-bit cookie of a socket's network
#: namespace (Linux >= 5.14; 6.18 gives the namespace id NS_GET_ID gives)
SO_NETNS_COOKIE = 71


def current_inode() -> int:
    """Return the inode of the calling thread's network namespace: unique among the live
    namespaces, reused as soon as one is gone (the kernel takes the lowest free number)."""
    return os.stat("/proc/thread-self/ns/net").st_ino


def current_cookie() -> int | None:
    """Return the cookie of the calling thread's network namespace, or None (a kernel before
    5.14): never given to another namespace while the machine runs."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            value: int = struct.unpack("=Q", s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE,
                                                          8))[0]
    except (OSError, struct.error):
        return None
    return value


def current_id() -> str:
    """Return the identity of the calling thread's network namespace: ``<inode>-<cookie>``.

    The inode alone (what versions before this one used, and all a kernel before 5.14
    gives) is reused: a sandbox made after another was deleted often gets its inode,
    and took its allocations for its own. The cookie is not reused until a reboot, and
    nothing it marks outlives one (the marks live on kernel objects and under /run).
    """
    cookie = current_cookie()
    inode = current_inode()
    return str(inode) if cookie is None else f"{inode}-{cookie}"


def mount_ns_inode() -> int:
    """Return the inode of this process's mount namespace."""
    return os.stat("/proc/self/ns/mnt").st_ino


#: ASCII letters and digits, and _.@:+- (a set: a loop over the characters cost ~15 ms of
#: an observation of 500 namespaces, whose names are all checked)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.@:+-")


def name_ok(name: str) -> bool:
    """Tell whether ``name`` is usable as ``/run/netns/NAME`` (what ``ip netns`` accepts, one path
    component)."""
    return 0 < len(name) <= 255 and name not in (".", "..") and _NAME_CHARS.issuperset(name)
