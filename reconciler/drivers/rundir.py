"""The one run directory (``/run/reconciler``): locks and the plan socket live there.

Stdlib only. The directory is made 0700 and, whether we made it or found it,
must be a real directory (not a symlink) owned by us (root) that nobody else
can write: a local user who could plant an entry there could make `apply`
truncate and write any file through a symlink, or answer `reconcile plan` in
the agent's place. Files under it are opened with ``O_NOFOLLOW``.

See docs/decisions/021-one-writer-per-host.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
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
    """Return why a run directory with this lstat cannot be trusted, or None (pure)."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != me:
        return f"it belongs to uid {st.st_uid}, not uid {me}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def list_trusted_dir(directory: str, what: str) -> list[str] | None:
    """List the sorted names in ``directory`` once it is checked ours (:func:`dir_problem`);
    None when it does not exist. Anything else that keeps it from being read (it is a
    file, a path through a file, unreadable) is one PreconditionError line naming it."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PreconditionError(f"cannot read the {what} {directory}: "
                                f"{exc.strerror or exc}") from None
    problem = dir_problem(st, os.geteuid())
    if problem is not None:
        raise PreconditionError(f"refusing the {what} {directory}: {problem}")
    try:
        return sorted(os.listdir(directory))
    except FileNotFoundError:  # removed meanwhile
        return None
    except OSError as exc:
        raise PreconditionError(f"cannot read the {what} {directory}: "
                                f"{exc.strerror or exc}") from None


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
    """Describe in one line an open of a run file that failed."""
    if exc.errno == errno.ELOOP:
        return f"{path} is a symlink; refusing to follow it (remove it)"
    return f"{path}: {exc.strerror or exc}"


# -- stale files (`reconcile gc`) ----------------------------------------------------------

#: the names the reconciler gives its files here: the host lock, the plan agent's lock and
#: socket, the agent's root-only status socket, the probe vantage's lock (each named after a
#: network namespace inode)
_RUN_FILE = re.compile(r"(?:netns-[0-9]+\.lock|plan-[0-9]+\.(?:lock|sock)|status-[0-9]+\.sock"
                       r"|probe-vantage-[0-9]+\.lock)")


def _take_unused_lock(path: str) -> int | None:
    """Take the fd of ``path`` flocked by us, when it is a lock file of ours that nobody holds
    and is still the file at ``path``; None otherwise (held, gone, replaced, not ours).

    Whoever waits for a lock re-checks its inode once it has it (``engine.lock``, the
    plan server, the vantage lease), so a file removed while we hold it sends them to
    a new one: removing it is safe only while it is flocked, and never makes it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, "not a lock file of ours")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        now = os.lstat(path)
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            raise OSError(errno.ESTALE, "replaced meanwhile")
    except OSError:
        os.close(fd)
        return None
    return fd


def lock_is_free(path: str) -> bool:
    """Tell whether nobody holds the lock file ``path`` (or there is none); it is not made."""
    if not os.path.lexists(path):
        return True
    fd = _take_unused_lock(path)
    if fd is None:
        return False
    os.close(fd)
    return True


def _nobody_listens(path: str) -> os.stat_result | None:
    """Return the lstat of ``path`` when it is a socket file of ours on which nothing accepts
    connections (ECONNREFUSED); None otherwise."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except ConnectionRefusedError:
            return st
        except OSError:
            return None  # a timeout (a full backlog: someone is there), gone meanwhile
    return None


def _companion_lock(path: str) -> str:
    """Name the lock the server of socket ``path`` holds while it serves (``plan-N.lock``)."""
    return path[: -len(".sock")] + ".lock"


def stale_files(directory: str = RUN_DIR) -> list[tuple[str, str]]:
    """List ``(path, why)`` of our files here that nobody uses: a lock nobody holds, a socket
    nobody listens on and whose server's lock nobody holds. Sockets first: one is
    removed under its server's lock (:func:`remove_stale`). Files of other names, and
    entries that are not regular files (or sockets) of ours, are never listed."""
    names = list_trusted_dir(directory, "run directory")
    if names is None:
        return []
    out: list[tuple[str, str]] = []
    for name in sorted((n for n in names if _RUN_FILE.fullmatch(n)),
                       key=lambda n: (not n.endswith(".sock"), n)):
        path = os.path.join(directory, name)
        if name.endswith(".sock"):
            why = _stale_socket(path, remove=False)
        else:
            why = _stale_lock(path, remove=False)
        if why is not None:
            out.append((path, why))
    return out


def remove_stale(path: str) -> bool:
    """Remove ``path`` if it is still stale, checked again now; False if it is not (any
    more) or is gone."""
    if not _RUN_FILE.fullmatch(os.path.basename(path)):
        return False
    if path.endswith(".sock"):
        return _stale_socket(path, remove=True) is not None
    return _stale_lock(path, remove=True) is not None


def _stale_lock(path: str, *, remove: bool) -> str | None:
    fd = _take_unused_lock(path)
    if fd is None:
        return None
    try:
        if remove:
            os.unlink(path)  # while we hold it: a waiter on this file then starts over
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)
    return "a lock nobody holds"


def _stale_socket(path: str, *, remove: bool) -> str | None:
    lock = _companion_lock(path)
    fd = _take_unused_lock(lock) if os.path.lexists(lock) else None
    if fd is None and os.path.lexists(lock):
        return None  # its server holds its lock: alive (or starting), never connected to
    try:
        before = _nobody_listens(path)
        if before is None:
            return None
        if remove:
            # the file that refused is still the one at the path (without a server's lock
            # to hold, this is what keeps a new server's socket from going instead)
            after = os.lstat(path)
            if (before.st_ino, before.st_dev) != (after.st_ino, after.st_dev):
                return None
            os.unlink(path)
    except FileNotFoundError:
        return None
    finally:
        if fd is not None:
            os.close(fd)
    return "a socket nobody listens on"
