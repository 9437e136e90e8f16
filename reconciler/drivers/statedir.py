"""The persistent state directory (``/var/lib/reconciler/<scope>/``): pending changes and
journals, never ownership.

Stdlib only. Unlike the run directory (``drivers/rundir``, a tmpfs wiped by a
reboot), what is written here must survive a reboot and a ``kill -9`` at any
instant: a pending change's checkpoint is what a revert after a reboot restores,
and a journal is what the next run finishes or undoes. So every record is
written whole to a temporary file, ``fsync``'d, renamed over its name and the
directory ``fsync``'d: a reader sees the old record or the new one, never half
of one.

Ownership stays on the objects themselves (address protocol, link aliases,
chain names, Docker labels): nothing here decides what is ours, and a state
directory that is lost loses pending reverts and journals, not the host.

The directory and its scope subdirectories are 0700, must be real directories
owned by us that nobody else can write (``rundir.dir_problem``), and files are
opened with ``O_NOFOLLOW``: a local user who could plant a record here could make
a revert rebuild whatever they wrote.

See docs/decisions/024-state-directory.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from typing import Any

from reconciler.domain.errors import PreconditionError
from reconciler.drivers import rundir

STATE_DIR = "/var/lib/reconciler"


def state_root() -> str:
    """Return ``RECONCILER_STATE_DIR`` (read at each call: the tests point it elsewhere) or the
    default."""
    return os.environ.get("RECONCILER_STATE_DIR") or STATE_DIR


def scope_dirname(scope: str) -> str:
    """Name the directory of a scope (``host``, ``netns/NAME``, ``netns-inode/N``): one
    path component, reversible enough for people to read (``netns/a`` -> ``netns-a``)."""
    name = scope.replace("/", "-")
    if not name or name in (".", "..") or "\0" in name:
        raise ValueError(f"not a scope: {scope!r}")
    return name


def scope_dir(scope: str, root: str | None = None) -> str:
    """Make (0700) and check ``<root>/<scope>``; PreconditionError naming the problem."""
    root = root or state_root()
    for path in (root, os.path.join(root, scope_dirname(scope))):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o755, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
            st = os.lstat(path)
        except OSError as exc:
            raise PreconditionError(f"cannot make the state directory {path}: "
                                    f"{exc.strerror or exc} (RECONCILER_STATE_DIR must name "
                                    "a directory root can write)") from None
        problem = rundir.dir_problem(st, os.geteuid())
        if problem is not None:
            raise PreconditionError(f"refusing the state directory {path}: {problem}; "
                                    "fix it or remove it")
    return os.path.join(root, scope_dirname(scope))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_record(directory: str, name: str, value: Any) -> str:
    """Write ``value`` as JSON to ``directory/name`` durably and atomically; its path.

    Raises OSError (ENOSPC, EDQUOT, EROFS …) before anything is replaced: the
    caller must not start the change the record protects.
    """
    _check_name(name)
    path = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    data = json.dumps(value, indent=1, sort_keys=True).encode() + b"\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return path


def read_record(directory: str, name: str) -> Any | None:
    """Read the JSON record ``directory/name``, or None when there is none.

    A record that is not a regular file of ours, or not JSON, is a
    PreconditionError naming it (never followed, never guessed at).
    """
    _check_name(name)
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PreconditionError(f"{path} is a symlink; refusing to follow it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PreconditionError(f"{path} is not a regular file of ours; refusing it")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read()
    finally:
        os.close(fd)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise PreconditionError(f"{path} is not a record the reconciler wrote ({exc}); "
                                "move it away to go on") from None


def remove_record(directory: str, name: str) -> bool:
    """Remove ``directory/name`` durably; False when it was not there."""
    _check_name(name)
    try:
        os.unlink(os.path.join(directory, name))
    except FileNotFoundError:
        return False
    _fsync_dir(directory)
    return True


def list_records(directory: str, suffix: str = "") -> list[str]:
    """List the names of the records in ``directory`` ending in ``suffix`` (no temporaries)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if not n.startswith(".") and n.endswith(suffix))


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or "\0" in name:
        raise ValueError(f"not a record name: {name!r}")


def boot_id() -> str:
    """Read this boot's id (``/proc/sys/kernel/random/boot_id``): a record written under another
    boot outlived a reboot (a pending change is then overdue)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


# -- stale temporaries (`reconcile gc`) -----------------------------------------------------

#: the temporary ``write_record`` writes a record to before renaming it: ``.NAME.PID.tmp``
_TEMPORARY = re.compile(r"\.(?P<name>[^/\0]+)\.(?P<pid>[0-9]+)\.tmp")


#: no process has a pid above this (the kernel's PID_MAX_LIMIT, 2^22)
PID_MAX_LIMIT = 4 * 1024 * 1024


def _writer_pid(name: str) -> int | None:
    """Read the pid in a temporary's name (``.NAME.PID.tmp``), or None when the name is not one
    or its pid is one no process can have (0, beyond PID_MAX_LIMIT): an odd entry is not
    ours to judge, and ``os.kill`` would take 0 for our own process group."""
    m = _TEMPORARY.fullmatch(name)
    if m is None:
        return None
    digits = m.group("pid")
    if len(digits) > 8:
        return None
    pid = int(digits)
    return pid if 0 < pid <= PID_MAX_LIMIT else None


def _boot_time() -> float | None:
    """Read when this boot started (``btime`` of ``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as fh:
            for line in fh:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_why(path: str, pid: int, boot: float | None) -> str | None:
    """Say why the temporary at ``path`` is left over (its writer is gone, or it is older than
    this boot: a pid of now is not its writer), or None."""
    try:
        st = os.lstat(path)
    except OSError:  # gone meanwhile, or not to be read: not one to remove
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return None
    if not _pid_alive(pid):
        return f"a record's temporary whose writer (pid {pid}) is gone"
    if boot is not None and st.st_mtime < boot:
        return "a record's temporary written before this boot"
    return None


def stale_temporaries(scope: str, root: str | None = None) -> list[tuple[str, str]]:
    """List ``(path, why)`` of the temporaries in ``scope``'s directory that no writer will
    rename any more (a ``kill -9`` between write and rename). The directory is not made:
    none, nothing to collect."""
    directory = os.path.join(root or state_root(), scope_dirname(scope))
    names = rundir.list_trusted_dir(directory, "state directory")
    if names is None:
        return []
    boot = _boot_time()
    out = []
    for name in names:
        pid = _writer_pid(name)
        if pid is None:
            continue
        path = os.path.join(directory, name)
        why = _stale_why(path, pid, boot)
        if why is not None:
            out.append((path, why))
    return out


def remove_temporary(path: str) -> bool:
    """Remove the temporary ``path`` if it is still left over (checked again); its
    directory is fsync'd. False when it is not (any more)."""
    pid = _writer_pid(os.path.basename(path))
    if pid is None or _stale_why(path, pid, _boot_time()) is None:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    _fsync_dir(os.path.dirname(path))
    return True
