"""The one run directory (``/run/reconciler``): locks and the plan socket live there.

Stdlib only. The directory is made 0700 and, whether we made it or found it,
must be a real directory (not a symlink) owned by us (root) that nobody else
can write: a local user who could plant an entry there could make `apply`
truncate and write any file through a symlink, or answer `reconcile plan` in
the agent's place. Files under it are opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from reconciler.domain.errors import PreconditionError

RUN_DIR = os.environ.get("RECONCILER_LOCK_DIR", "/run/reconciler")

#: errors of writing that are the machine's state, not a bug: one line for the user
WRITE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EDQUOT})


def ensure_dir(path: str = RUN_DIR) -> str:
    """Make ``path`` (0700) if needed and check it is ours alone; PreconditionError if not."""
    try:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, mode=0o755, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError as exc:
        why = exc.strerror
        if exc.errno in (errno.EEXIST, errno.ENOTDIR):
            bad = _first_non_directory(path)
            why = f"{bad} is not a directory" if bad else why
        raise PreconditionError(f"cannot make the run directory {path}: {why} "
                                "(run as root; RECONCILER_LOCK_DIR must name a directory "
                                "root can write)") from None
    problem = dir_problem(st, os.geteuid())
    if problem is not None:
        raise PreconditionError(f"refusing the run directory {path}: {problem}; remove it "
                                "(root recreates it 0700) or fix it")
    return path


def _first_non_directory(path: str) -> str | None:
    p = "/"
    for part in os.path.abspath(path).split("/")[1:-1]:
        p = os.path.join(p, part)
        if os.path.lexists(p) and not os.path.isdir(p):
            return p
    return None


def dir_problem(st: os.stat_result, me: int) -> str | None:
    """Why a run directory with this lstat cannot be trusted, or None (pure)."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != me:
        return f"it belongs to uid {st.st_uid}, not uid {me}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def open_file(path: str, mode: int = 0o600) -> int:
    """Open (create) a file under the run directory for reading and writing, never via a link.

    ``O_NOFOLLOW`` refuses a symlink planted at ``path`` (ELOOP); a regular file is
    required, so a FIFO or device planted there is refused too.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                 mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, "not a regular file of ours", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def describe_open_error(path: str, exc: OSError) -> str:
    """One line for an open of a run file that failed."""
    if exc.errno == errno.ELOOP:
        return f"{path} is a symlink; refusing to follow it (remove it)"
    return f"{path}: {exc.strerror or exc}"
