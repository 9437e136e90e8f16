"""One writer per host: an flock shared by `apply`, `destroy` and `watch`.

"Host" means network namespace: the lock file is named after the inode of the
namespace we act on, so sandboxes under `--netns` do not block each other.

See docs/decisions/021-one-writer-per-host.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from reconciler.domain.errors import LockedError, PreconditionError
from reconciler.drivers import rundir
from reconciler.drivers.nsfs import current_inode

LOCK_DIR = rundir.RUN_DIR


def lock_path() -> str:
    ino = current_inode()
    return os.path.join(LOCK_DIR, f"netns-{ino}.lock")


def _open(path: str) -> int:
    rundir.ensure_dir(LOCK_DIR)
    try:
        return rundir.open_file(path, 0o644)
    except OSError as exc:
        raise PreconditionError(f"cannot open the host lock: "
                                f"{rundir.describe_open_error(path, exc)}") from None


def _is_current(fd: int, path: str) -> bool:
    """Tell whether the file we locked is still the one at ``path`` (a releaser may have unlinked
    it)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


@contextmanager
def host_lock(timeout: float = 60.0, poll: float = 0.1) -> Iterator[None]:
    """Hold the host lock; wait up to ``timeout`` seconds, then fail naming the holder.

    The lock file is removed on release (sandboxes would otherwise leave one
    each behind); a waiter that then wins the flock on the unlinked file sees
    that it is no longer the file at the path and starts over.
    """
    path = lock_path()
    deadline = time.monotonic() + timeout
    fd = _open(path)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    raise LockedError(f"another reconcile (pid {holder}) is changing this host; "
                                      f"gave up after {timeout:g}s (lock {path})") from None
                time.sleep(poll)
                continue
            if _is_current(fd, path):
                break
            os.close(fd)  # locked a file its holder had already removed: take the new one
            fd = _open(path)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # ENOSPC, EDQUOT: the lock holds all the same, say so once
            raise PreconditionError(f"cannot write the host lock {path}: {exc.strerror}") \
                from None
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # while still holding it: see above
    finally:
        os.close(fd)  # closing releases the flock
