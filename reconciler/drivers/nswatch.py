"""What changes under /run/netns: names (inotify) and the namespaces mounted there (mountinfo).

Unmounting a namespace sends no netlink event (and the namespace may even live
on, held by a process), so both the watch loop's drift source and the plan
view's sentinels watch the directory itself. Both read it through this module:
a non-blocking inotify descriptor (no thread of its own; the caller polls or
selects on it) and ``poll`` on ``/proc/self/mountinfo``.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct

from reconciler.drivers.nsfs import NETNS_RUN_DIR

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x800, 0x4000, 0x8000
#: a name appeared or went (what the drift source cares about)
IN_NAMES = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_NAMES | IN_DELETE_SELF | IN_MOVE_SELF)
#: the watch itself is gone (the directory was removed or replaced) or events were lost
_LOST = IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF | IN_Q_OVERFLOW
_EVENT = struct.Struct("=iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)

_libc = ctypes.CDLL(None, use_errno=True)


class RunDirWatch:
    """inotify on /run/netns (created, deleted, renamed names; xattr and content changes).

    ``watching`` is False while there is no watch (the directory does not exist
    yet, or was removed, renamed or replaced, or events overflowed): whoever
    reads then must assume anything changed, and :meth:`rewatch`. Events of a
    watch that was replaced (a directory renamed away keeps its old watch) are
    dropped, and the old watch removed.
    """

    def __init__(self, run_dir: str = NETNS_RUN_DIR) -> None:
        self.run_dir = run_dir
        fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.fd: int = fd
        self.wd = -1
        self.watching = False
        #: errno of the last failed watch (ENOENT: no directory yet)
        self.error = 0
        self.rewatch()

    def fileno(self) -> int:
        return self.fd

    def rewatch(self) -> bool:
        """Watch the directory (again); False when it cannot be watched now (see ``error``)."""
        if self.wd >= 0:
            _libc.inotify_rm_watch(self.fd, self.wd)  # EINVAL when the kernel dropped it: fine
            self.wd = -1
        wd = int(_libc.inotify_add_watch(self.fd, self.run_dir.encode(), _MASK))
        self.error = 0 if wd >= 0 else ctypes.get_errno()
        self.wd = wd
        self.watching = wd >= 0
        return self.watching

    def drain(self) -> list[tuple[int, str]]:
        """Drain every event queued since the last call: (mask, name; "" for the directory
        itself)."""
        out: list[tuple[int, str]] = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            except OSError:  # closed under us: nothing more to read
                self.watching = False
                return out
            off = 0
            while off + _EVENT.size <= len(data):
                wd, mask, _cookie, name_len = _EVENT.unpack_from(data, off)
                raw = data[off + _EVENT.size: off + _EVENT.size + name_len]
                off += _EVENT.size + name_len
                if mask & IN_Q_OVERFLOW:  # wd -1: events of every watch were lost
                    self.watching = False
                    out.append((mask, ""))
                    continue
                if wd != self.wd:
                    continue  # a watch replaced since (the directory moved away, then back)
                if mask & _LOST:
                    self.watching = False
                out.append((mask, raw.split(b"\0", 1)[0].decode("utf-8", "replace")))

    def close(self) -> None:
        os.close(self.fd)


def netns_mounts(run_dir: str = NETNS_RUN_DIR) -> frozenset[tuple[str, str, str]]:
    """Return (mount id, root, mount point) of ``run_dir`` and of every mount below it."""
    prefix = run_dir.rstrip("/") + "/"
    with open("/proc/self/mountinfo") as fh:
        text = fh.read()
    out = set()
    for line in text.splitlines():
        f = line.split(" ", 5)
        if len(f) > 4 and (f[4] + "/").startswith(prefix):
            out.add((f[0], f[3], f[4]))
    return frozenset(out)


class MountWatch:
    """``poll`` on /proc/self/mountinfo: wakes on any mount change in this mount namespace."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLPRI | select.POLLERR)

    def signalled(self) -> bool:
        """Tell whether the mount table changed since the last call (consumes the notification)."""
        return any(ev & (select.POLLPRI | select.POLLERR) for _fd, ev in self.poller.poll(0))

    def close(self) -> None:
        os.close(self.fd)
