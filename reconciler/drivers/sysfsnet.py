"""Whether a link's MAC is set: ``/sys/class/net/NAME/addr_assign_type``, in the right namespace.

rtnetlink does not report ``addr_assign_type``; sysfs does (3 is NET_ADDR_SET:
someone set the address, and a bridge then keeps it whatever ports come and
go). But ``/sys`` shows the links of the network namespace of whoever mounted
it, not of the thread that reads it: a sandbox run (``--netns NAME``, the
process setns'd into NAME with the host's mounts) reads the host's links
there. So the mounted ``/sys`` is believed only when it shows each asked link
with the ifindex and MAC that netlink reported in our namespace; otherwise a
short-lived thread unshares its mount namespace (nothing it mounts is seen by
anyone else, and it is gone with the thread), mounts a sysfs of the network
namespace it is in (ours: threads start in their creator's) over ``/sys`` and
reads there. About 0.3 ms; only bridges whose MAC is not the one we give new
bridges need asking (``engine.observe``).

See docs/decisions/010-stable-identities.md.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Mapping

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 1 << 18

#: addr_assign_type values (include/uapi/linux/netdevice.h)
NET_ADDR_SET = 3

_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]

#: (ifindex, MAC) of a link as netlink reported it in our namespace
Seen = tuple[int, str | None]


def _read(root: str, name: str) -> tuple[int, str, int] | None:
    """Read (ifindex, address, addr_assign_type) of ``name`` under ``root``; None if unreadable."""
    base = f"{root}/class/net/{name}"
    try:
        with open(f"{base}/ifindex", encoding="ascii") as f:
            index = int(f.read())
        with open(f"{base}/address", encoding="ascii") as f:
            mac = f.read().strip()
        with open(f"{base}/addr_assign_type", encoding="ascii") as f:
            kind = int(f.read())
    except (OSError, ValueError):
        return None
    return index, mac, kind


def _matches(found: tuple[int, str, int] | None, seen: Seen) -> bool:
    return found is not None and found[0] == seen[0] and found[1] == (seen[1] or "")


def _read_private(names: list[str]) -> dict[str, tuple[int, str, int] | None]:
    """Read through a sysfs of the current network namespace, mounted in a private mount
    namespace of a thread of our own."""
    out: dict[str, tuple[int, str, int] | None] = {}
    failure: list[str] = []

    def work() -> None:
        # CLONE_NEWNS implies CLONE_FS: the thread gets its own root and cwd copy, the
        # process keeps its own; the mounts below die with this thread's mount namespace
        if _libc.unshare(CLONE_NEWNS) != 0:
            failure.append(f"unshare: {os.strerror(ctypes.get_errno())}")
            return
        if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            failure.append(f"make / private: {os.strerror(ctypes.get_errno())}")
            return
        if _libc.mount(b"sysfs", b"/sys", b"sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV
                       | MS_NOEXEC, None) != 0:
            failure.append(f"mount sysfs: {os.strerror(ctypes.get_errno())}")
            return
        for name in names:
            out[name] = _read("/sys", name)

    thread = threading.Thread(target=work, name="sysfs-reader", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise OSError(f"reading addr_assign_type through a private sysfs: {failure[0]}")
    return out


def mac_is_set(links: Mapping[str, Seen]) -> dict[str, bool | None]:
    """Tell, for each link (name -> what netlink saw of it), whether its MAC is set (NET_ADDR_SET).

    None for a link sysfs does not show as netlink saw it (gone or changed
    meanwhile): unknown, the caller asks again next time. Raises OSError when the
    private sysfs cannot be mounted (no CAP_SYS_ADMIN).
    """
    if not links:
        return {}
    found = {name: _read("/sys", name) for name in links}
    if not all(_matches(found[n], seen) for n, seen in links.items()):
        found = _read_private(sorted(links))
    out: dict[str, bool | None] = {}
    for name, seen in links.items():
        got = found.get(name)
        out[name] = got[2] == NET_ADDR_SET if got is not None and _matches(got, seen) else None
    return out
