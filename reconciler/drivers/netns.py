"""Network namespaces: create, delete, enter, inspect — in-process, no helpers.

Everything here works with ``setns(2)``/``unshare(2)``/``mount(2)`` through
ctypes (Python 3.11 has no ``os.setns``). Namespaces are per *thread* in
Linux, so :func:`enter` and :func:`create` switch only the calling thread and
always switch back; :func:`enter_process_netns` is the one-shot switch of the
whole process for ``reconcile --netns NAME``.

Namespaces are published the way ``ip netns add`` does it: a file under
``/run/netns`` with the namespace's nsfs inode bind-mounted onto it, in a
shared mount so that every mount namespace on the host sees it.

See docs/decisions/002-allocations-prove-ownership-from-their-namespace.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
from collections.abc import Callable, Iterable, Iterator

from reconciler.domain.errors import DriverError, PreconditionError
from reconciler.drivers.nsfs import NETNS_RUN_DIR, name_ok

CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_SHARED = 1 << 20
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.linkat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]

_rundir_lock = threading.Lock()
_rundir_ready = False
_nsfs_dev: int | None = None


def _oserror(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise _oserror("setns")


def _mount(src: str, target: str, flags: int) -> None:
    if _libc.mount(src.encode(), target.encode(), b"none", flags, None) != 0:
        raise _oserror(f"mount {target}")


def check_name(name: str) -> None:
    """Raise ``DriverError`` unless ``name`` is usable as ``/run/netns/NAME``."""
    if not name_ok(name):
        raise DriverError(f"invalid network namespace name {name!r}")


def path_of(path_or_name: str) -> str:
    """Return ``/run/netns/NAME`` for a bare name; a path (anything with '/') as is."""
    if "/" in path_or_name:
        return path_or_name
    check_name(path_or_name)
    return f"{NETNS_RUN_DIR}/{path_or_name}"


def nsfs_dev() -> int:
    """Return the st_dev every nsfs inode (a namespace handle) reports."""
    global _nsfs_dev
    if _nsfs_dev is None:
        _nsfs_dev = os.stat("/proc/thread-self/ns/net").st_dev  # any nsfs handle will do
    return _nsfs_dev


def is_namespace_mount(path_or_name: str) -> bool:
    """Tell whether the file is a live namespace handle (True) or a plain (empty) file (False).

    An empty ``/run/netns/X`` is what remains when the bind mount is gone
    (made under ``ip netns exec``, a reboot wiped the mounts, a half-done
    ``ip netns add``); ``ip netns exec X`` then fails with EINVAL (EDGE 10).
    Raises ``FileNotFoundError`` when there is no such file.
    """
    return os.stat(path_of(path_or_name)).st_dev == nsfs_dev()


def namespace_inode(path_or_name: str) -> int | None:
    """Return the inode of the namespace behind the file (identity across renames), None if not a
    mount."""
    st = os.stat(path_of(path_or_name))
    return st.st_ino if st.st_dev == nsfs_dev() else None


def list_names() -> list[str]:
    """List the names under /run/netns, sorted (usable or not; see :func:`is_namespace_mount`)."""
    try:
        return sorted(os.listdir(NETNS_RUN_DIR))
    except FileNotFoundError:
        return []


def open_fd(path_or_name: str) -> int:
    """Open a namespace handle (O_CLOEXEC); ``DriverError`` names what is wrong."""
    path = path_of(path_or_name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DriverError(f"network namespace {path_or_name}: {path} does not exist") from None
    except OSError as e:
        raise DriverError(f"network namespace {path_or_name}: cannot open {path}: "
                          f"{e.strerror}") from None
    if os.fstat(fd).st_dev != nsfs_dev():
        os.close(fd)
        raise DriverError(f"network namespace {path_or_name}: {path} is not a namespace "
                          "(an empty file: its bind mount is gone)")
    return fd


@contextlib.contextmanager
def enter(path_or_name: str | int) -> Iterator[None]:
    """Switch the *calling thread* into a network namespace, and back on exit.

    Accepts a name under /run/netns, a path, or an open namespace fd (not
    closed). Sockets created inside stay bound to that namespace after the
    block. If switching back fails the thread would silently act on the wrong
    namespace, so that raises and the caller must not go on.
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if isinstance(path_or_name, int):
            target, own = path_or_name, False
        else:
            target, own = open_fd(path_or_name), True
        try:
            try:
                _setns(target)
            except OSError as e:
                raise DriverError(f"network namespace {path_or_name}: cannot enter: "
                                  f"{e.strerror}") from None
        finally:
            if own:
                os.close(target)
        try:
            yield
        finally:
            try:
                _setns(home)
            except OSError as e:  # pragma: no cover - the kernel never refuses our own ns
                raise RuntimeError(f"cannot return to the original network namespace: {e}") \
                    from e
    finally:
        os.close(home)


def enter_process_netns(path_or_name: str) -> None:
    """Move the whole (still single-threaded) process into a namespace: ``--netns NAME``.

    Equivalent to ``nsenter --net=/run/netns/NAME``: the mount namespace stays
    the host's, so namespaces created later are visible to everyone. Must run
    before any thread is started (setns only moves the calling thread).
    """
    tasks = os.listdir("/proc/self/task")
    if len(tasks) != 1 or threading.active_count() != 1:
        raise PreconditionError("--netns must be applied before any thread is started "
                                f"({len(tasks)} threads running)")
    path = path_of(path_or_name)
    try:
        fd = open_fd(path_or_name)
    except DriverError as e:
        raise PreconditionError(str(e)) from None
    try:
        _setns(fd)
    except OSError as e:
        raise PreconditionError(f"network namespace {path_or_name}: cannot enter {path}: "
                                f"{e.strerror}") from None
    finally:
        os.close(fd)


# --- mount propagation -------------------------------------------------------

def _mountinfo(pid: str) -> list[tuple[str, list[str]]]:
    """Read (mount point, optional fields) of each mount, in mount order."""
    out = []
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            try:
                sep = fields.index("-")
            except ValueError:
                continue
            mpoint = fields[4].replace("\\040", " ")
            out.append((mpoint, fields[6:sep]))
    return out


def _covering_mount(mounts: list[tuple[str, list[str]]], path: str) -> list[str] | None:
    """Return the optional fields of the mount that ``path`` lives on (last, longest match wins)."""
    best: list[str] | None = None
    best_len = -1
    for mpoint, opts in mounts:
        prefix = mpoint.rstrip("/") + "/"
        if (path == mpoint or path.startswith(prefix) or mpoint == "/") and len(mpoint) >= best_len:
            best, best_len = opts, len(mpoint)
    return best


def _shared_group(opts: list[str] | None) -> str | None:
    for o in opts or ():
        if o.startswith("shared:"):
            return o
    return None


def _parent_pid(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            ppid = f.read().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return None
    return ppid if ppid != "0" else None


def _mount_ns_inode(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


def other_mount_namespace(chain: Iterable[tuple[str, int | None]], mine: int) -> str | None:
    """Return the first process of ``chain`` (pid, mount namespace inode; None where it cannot
    be read) whose mount namespace is not ``mine``, or None (pure).

    The chain is pid 1 first, then this process's ancestors from the nearest up. Where init's
    namespace cannot be read (a sandbox's init, ``/proc/1/ns`` denied) the ancestors stand in
    for it: ``ip netns exec`` or ``unshare -m`` gave us a namespace our parent does not have.
    """
    for pid, inode in chain:
        if inode is not None and inode != mine:
            return pid
        if pid == "1" and inode == mine:
            return None  # init's own namespace: nothing above it can differ in a way that counts
    return None


def _namespace_chain() -> Iterator[tuple[str, int | None]]:
    yield "1", _mount_ns_inode("1")
    pid: str | None = _parent_pid("self")
    seen = 0
    while pid is not None and pid != "1" and seen < 64:
        yield pid, _mount_ns_inode(pid)
        pid, seen = _parent_pid(pid), seen + 1


def private_mount_namespace_problem() -> str | None:
    """Return why namespaces we create would be invisible outside this process, or None.

    ``ip netns exec`` (and e.g. a systemd unit with PrivateMounts) gives the
    process its own mount namespace whose mounts are slaves: a bind mount under
    /run/netns made here never reaches the host, outside ``/run/netns/X`` is an
    empty file and the namespace dies with the process (EDGE 37). It is fine
    when we share the mount namespace of init (or, where init's cannot be read,
    of every ancestor we can read), or when the mount holding /run/netns is in
    the same shared peer group as that other namespace's.
    """
    mine = _mount_ns_inode("self")
    if mine is None:
        return None  # no /proc to tell by: trust the caller
    other = other_mount_namespace(_namespace_chain(), mine)
    if other is None:
        return None
    target = NETNS_RUN_DIR
    my_group = _shared_group(_covering_mount(_mountinfo("self"), target))
    try:
        other_group = _shared_group(_covering_mount(_mountinfo(other), target))
    except OSError:
        other_group = my_group  # cannot see it: trust our own propagation flags
    if my_group is not None and my_group == other_group:
        return None
    return ("this process runs in a private mount namespace (e.g. under `ip netns exec`): "
            f"namespaces created under {NETNS_RUN_DIR} would be visible only to it and vanish "
            "when it exits; run `reconcile --netns NAME …` or `nsenter --net=/run/netns/NAME` "
            "instead")


def nsfs_mount_points(mountinfo: Iterable[str], directory: str) -> set[str]:
    """Return the names in ``directory`` that are namespace (nsfs) mounts in these lines of a
    ``/proc/PID/mountinfo`` (pure)."""
    out = set()
    prefix = directory.rstrip("/") + "/"
    for line in mountinfo:
        fields = line.split()
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        mpoint = fields[4]
        if sep + 1 < len(fields) and fields[sep + 1] == "nsfs" and mpoint.startswith(prefix):
            out.add(mpoint[len(prefix):])
    return out


def _init_namespace_mounts() -> set[str]:
    """Return the names under /run/netns that are namespace mounts for the init process (its
    mountinfo, which any process may read)."""
    with open("/proc/1/mountinfo", encoding="utf-8", errors="replace") as f:
        return nsfs_mount_points(f, NETNS_RUN_DIR)


def hidden_namespaces(names: Iterable[str], *, marked: str | None = None) -> list[str]:
    """Return those of ``names`` that are empty files under /run/netns here but namespace mounts
    in the init process's mount namespace.

    A mount namespace made like the coexistence tests' cells (a private ``/run``, and
    /run/netns bound back with ``mount --bind``, not ``--rbind``) shares /run/netns's
    peer group with the host, so namespaces mounted *after* it appear in both and the
    peer-group check of :func:`private_mount_namespace_problem` passes; the mounts made
    *before* it were not copied, and those namespaces are empty files here. Read
    through it, a live allocation is "not a live namespace": its veth deleted, its
    file busy. Only the files can tell: one that is empty here is looked up in init's
    mountinfo (its ``ns/mnt`` and ``root`` may be closed to us, its mountinfo is not),
    and checked here again (mounted meanwhile: it propagated, nothing is hidden). In
    init's own mount namespace an empty file is empty there too: nothing is hidden.

    ``marked``: also every name under /run/netns whose empty file carries that mark
    (this host's allocations', whatever the plan says of them: a hidden one reads as
    garbage to ``gc``). The names of ``names`` come first.
    """
    dev = nsfs_dev()
    declared = set(names)
    wanted = set(declared)
    if marked is not None:
        wanted.update(list_names())
    empty = []
    for name in sorted(wanted):
        if not name_ok(name):
            continue
        try:
            if os.stat(path_of(name)).st_dev == dev:
                continue
        except OSError:
            continue  # gone: nothing hidden
        if name in declared or (marked is not None and _mark_of(path_of(name)) == marked):
            empty.append(name)
    if not empty:
        return []
    try:
        mounted = _init_namespace_mounts()
    except OSError:
        return []  # init cannot be read: nothing to compare with
    out = []
    for name in sorted(empty, key=lambda n: (n not in declared, n)):
        try:
            if name in mounted and os.stat(path_of(name)).st_dev != dev:
                out.append(name)
        except OSError:
            continue
    return out


def hidden_namespaces_problem(names: Iterable[str], *, marked: str | None = None) -> str | None:
    """Return the one line that refuses to act where namespaces of ``names`` (and the files
    ``marked``) are hidden (:func:`hidden_namespaces`), or None."""
    hidden = hidden_namespaces(names, marked=marked)
    if not hidden:
        return None
    more = f" (and {len(hidden) - 1} more)" if len(hidden) > 1 else ""
    return (f"{NETNS_RUN_DIR}/{hidden[0]}{more} is a live network namespace, but an empty file "
            "in this process's mount namespace: its /run/netns was bound in without the "
            "namespaces mounted before it (`mount --bind`, not `--rbind`), so live "
            "allocations would look gone; run it in the host's mount namespace (or bind "
            f"{NETNS_RUN_DIR} with --rbind)")


def _ensure_rundir() -> None:
    """Make /run/netns and a shared mount of it, as iproute2 does (once per process)."""
    global _rundir_ready
    if _rundir_ready:
        return
    with _rundir_lock:
        if _rundir_ready:
            return
        problem = private_mount_namespace_problem()
        if problem is not None:
            raise PreconditionError(problem)
        os.makedirs(NETNS_RUN_DIR, mode=0o755, exist_ok=True)
        try:
            _mount("", NETNS_RUN_DIR, MS_SHARED | MS_REC)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: not a mount point yet
                raise DriverError(f"cannot make {NETNS_RUN_DIR} shared: {e.strerror}") from None
            try:
                _mount(NETNS_RUN_DIR, NETNS_RUN_DIR, MS_BIND | MS_REC)
                _mount("", NETNS_RUN_DIR, MS_SHARED | MS_REC)
            except OSError as e2:
                raise DriverError(f"cannot make {NETNS_RUN_DIR} a shared mount: "
                                  f"{e2.strerror}") from None
        _rundir_ready = True


def create(name: str, *, replace_stale: bool = False,
           init: Callable[[], None] | None = None, file_mark: str | None = None) -> bool:
    """Run ``ip netns add NAME`` in-process. Returns False if it already existed.

    An existing live namespace is success (concurrent creators, EDGE 4). An
    existing *empty* file (EDGE 10) raises unless ``replace_stale``, which
    deletes it and creates a fresh namespace. Refuses (PreconditionError) in a
    private mount namespace. Only the calling thread is switched, and back.

    ``init`` runs inside the new namespace before it is mounted, so whatever it
    marks (our ownership alias) is there before anyone can see the namespace:
    a crash leaves either no namespace or a marked one. ``file_mark`` goes on
    the file under the mount (an xattr), so the empty file a crash between
    unmount and unlink (or between create and mount) leaves is provably ours too.
    """
    path = path_of(name)
    _ensure_rundir()
    try:
        _new_file(path, file_mark)
    except FileExistsError:
        try:
            if is_namespace_mount(path):
                return False
        except FileNotFoundError:  # deleted meanwhile: try once more
            return create(name, replace_stale=replace_stale, init=init, file_mark=file_mark)
        if not replace_stale:
            raise DriverError(f"network namespace {name}: {path} exists but is not a namespace "
                              "(empty file)") from None
        delete(name)
        return create(name, init=init, file_mark=file_mark)
    except OSError as e:
        raise DriverError(f"network namespace {name}: cannot create {path}: {e.strerror}") \
            from None
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.unshare(CLONE_NEWNET) != 0:
            err = _oserror("unshare")
            _unlink_quiet(path)
            raise DriverError(f"network namespace {name}: {err.strerror}")
        try:
            if init is not None:
                init()
            _mount("/proc/thread-self/ns/net", path, MS_BIND)
        except OSError as e:
            _unlink_quiet(path)
            raise DriverError(f"network namespace {name}: bind mount failed: {e.strerror}") \
                from None
        except BaseException:
            _unlink_quiet(path)
            raise
        finally:
            _setns(home)  # the new namespace lives on through the mount
    finally:
        os.close(home)
    return True


AT_FDCWD, AT_EMPTY_PATH = -100, 0x1000


#: per (directory, mark): an open fd of a marked file of the directory whose inode the
#: names of this process's namespace files share (see ``_new_file``)
_templates: dict[tuple[str, str], int] = {}
_templates_lock = threading.Lock()


def _new_file(path: str, file_mark: str | None) -> None:
    """Create the empty file ``path`` (FileExistsError if there is one), carrying
    ``file_mark`` from the first instant it has its name.

    The mark goes on an unnamed file of the directory (O_TMPFILE), which is then linked
    to ``path`` (link(2) never replaces). Made and marked in place, a kill between the
    two left an unmarked file that the planner must leave alone as someone else's,
    refusing the allocation until ``--adopt``; an unnamed file a kill leaves behind is
    gone with the process (a named temporary was not: the kill -9 tests left
    ``.ID.<random>.new`` files).

    Every namespace file this process makes with one mark is another name (hard link)
    of that one marked inode: the file is only a mount point, each name takes its own
    bind mount (mounts belong to the name, not the inode), and an unmounted name still
    shows the mark. Allocating an inode per namespace cost 40-350 µs on an ext4
    ``/run`` right after a big prune (ext4 walks past recently deleted inodes), more
    than the link (~7 µs); a bulk apply makes hundreds. A template whose names are all
    gone can no longer be linked (ENOENT), one at the filesystem's link limit gives
    EMLINK, another mount EXDEV: then a fresh one is made.
    """
    if file_mark is None:
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))
        return
    with _templates_lock:
        _link_marked(os.path.dirname(path), file_mark, path)


def _link_marked(directory: str, file_mark: str, path: str) -> None:
    key = (directory, file_mark)
    target = os.fsencode(path)
    fd = _templates.get(key)
    if fd is not None:
        # linkat(fd, "", AT_EMPTY_PATH): the /proc/self/fd/N way fails with EXDEV where
        # /run/netns is a bind mount (as `ip netns` makes it)
        if _libc.linkat(fd, b"", AT_FDCWD, target, AT_EMPTY_PATH) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOENT, errno.EMLINK, errno.EXDEV):
            raise _oserror(f"link {path}")
        del _templates[key]
        os.close(fd)
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0)
    try:
        set_file_mark(fd, file_mark)
        if _libc.linkat(fd, b"", AT_FDCWD, target, AT_EMPTY_PATH) != 0:
            raise _oserror(f"link {path}")
    except BaseException:
        os.close(fd)
        raise
    if _mark_of(fd) == file_mark:
        _templates[key] = fd
    else:  # the mark is best effort: one that did not take is not shared with later files
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


FILE_MARK_XATTR = "trusted.reconciler"


def set_file_mark(fd: int, mark: str) -> None:
    """Tag a /run/netns file (tmpfs keeps trusted.* xattrs); best effort elsewhere."""
    with contextlib.suppress(OSError):
        os.setxattr(fd, FILE_MARK_XATTR, mark.encode())


def _mark_of(file: int | str) -> str | None:
    """Return the tag on ``file`` (an fd or a path), None without one."""
    try:
        return os.getxattr(file, FILE_MARK_XATTR).decode(errors="replace")
    except OSError:
        return None


def file_mark(name: str) -> str | None:
    """Return the tag on an *unmounted* /run/netns file (on a live mount this reads nsfs: None)."""
    return _mark_of(path_of(name))


_SYS_OPEN_TREE = 428  # the same number on every architecture (the generic syscall table)
_OPEN_TREE_CLONE = 1


def file_marks(names: Iterable[str]) -> dict[str, str | None]:
    """Return the tag on each /run/netns file, live namespace mounts included, or {} when it
    cannot be read here.

    A live namespace's bind mount hides its file (and the tag on it, which a workload
    cannot write, unlike anything inside the namespace): a detached copy of the
    /run/netns mount without its submounts (``open_tree(OPEN_TREE_CLONE)``, not
    recursive) shows the files beneath. Nothing is mounted anywhere; closing it is all.
    """
    wanted = list(names)
    if not wanted:
        return {}
    fd = _libc.syscall(_SYS_OPEN_TREE, AT_FDCWD, NETNS_RUN_DIR.encode(),
                       _OPEN_TREE_CLONE | os.O_CLOEXEC)
    if fd < 0:
        return {}
    out: dict[str, str | None] = {}
    try:
        for name in wanted:
            try:
                f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                            dir_fd=fd)
            except OSError:
                continue  # gone meanwhile, or a name we never give
            try:
                out[name] = _mark_of(f)
            finally:
                os.close(f)
    finally:
        os.close(fd)
    return out


def ensure_file_mark(name: str, mark: str) -> None:
    """Tag a live namespace's /run/netns file beneath its mount (an adopted one has none).

    Best effort, as :func:`set_file_mark`: without ``open_tree`` here the file stays as it is.
    """
    fd = _libc.syscall(_SYS_OPEN_TREE, AT_FDCWD, NETNS_RUN_DIR.encode(),
                       _OPEN_TREE_CLONE | os.O_CLOEXEC)
    if fd < 0:
        return
    try:
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        os.close(fd)
        return
    try:
        if _mark_of(f) != mark:
            set_file_mark(f, mark)
    finally:
        os.close(f)
        os.close(fd)


def delete(name: str) -> bool:
    """Run ``ip netns del NAME``: detach the mount, remove the file. False if absent.

    The namespace (and the veths inside it) is destroyed asynchronously by
    the kernel once nothing holds it any more — not when this returns, and not
    while any socket or fd still refers to it.
    """
    path = path_of(name)
    if _libc.umount2(path.encode(), MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):  # EINVAL: not mounted (empty file)
            raise DriverError(f"network namespace {name}: umount failed: {os.strerror(code)}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise DriverError(f"network namespace {name}: cannot remove {path}: {e.strerror}") \
            from None
    return True
