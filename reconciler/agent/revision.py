"""Which revision of the files the agent runs, and whether others could have written them.

See docs/decisions/027-nobody-else-steers-the-agent.md.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from collections.abc import Sequence
from typing import Any

from reconciler.config.paths import expand_paths
from reconciler.domain.errors import ConfigError, PreconditionError


def git_revision(paths: Sequence[str], timeout: float = 5.0) -> dict[str, Any] | None:
    """Return the commit, its commit time and the dirty flag of the git checkout holding
    ``paths[0]``, or None.

    Runs with optional locks off (never takes index.lock from under a user's
    git command) and fsmonitor off (no hook programs run on our behalf).
    """
    if not paths:
        return None
    first = os.path.abspath(paths[0])
    cwd = first if os.path.isdir(first) else os.path.dirname(first)
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
    base = ["git", "-c", "core.fsmonitor=false", "-C", cwd]

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run([*base, *args], capture_output=True, text=True, timeout=timeout,
                               env=env, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    # one process for the commit and its time (the fleet compares revisions by time:
    # hashes have no order); no signature check: that would run gpg for us
    head = git("log", "-1", "--no-show-signature", "--format=%H %ct", "HEAD") if top else None
    if not top or not head:
        return None
    commit, _, when = head.partition(" ")
    rel = [os.path.relpath(os.path.abspath(p), cwd) for p in paths]
    porcelain = git("status", "--porcelain", "--untracked-files=all", "--", *rel)
    return {"commit": commit, "committed_at": int(when) if when.isdigit() else None,
            "dirty": bool(porcelain), "toplevel": top}


def expected_problem(rev: dict[str, Any] | None, expected: str) -> str | None:
    """Return why the checkout ``rev`` is not exactly the commit ``watch --expect-revision`` names
    (a commit id or a prefix of one), or None when it is.

    A pinned rollout (SPEC §10) makes each new commit a new rollout of the engine, so an
    agent must never act on another one: a moving branch, a local edit, a checkout that
    someone changed by hand would otherwise reach the host outside the rollout.
    """
    if not rev or not rev.get("commit"):
        return (f"--expect-revision {expected}: the files are not in a git checkout, so "
                "their revision is unknown; refusing them")
    commit = str(rev["commit"])
    if not commit.lower().startswith(expected.lower()):
        return (f"revision {commit[:12]} is not the expected {expected} "
                "(--expect-revision): refusing it; a new revision is a new rollout")
    if rev.get("dirty"):
        return (f"revision {commit[:12]} has local changes, so it is not exactly the expected "
                f"{expected} (--expect-revision): refusing it")
    return None


def files_digest(files: Sequence[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0")
        try:
            with open(f, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
        except OSError:
            h.update(b"?")
    return h.hexdigest()


def describe_revision(rev: dict[str, Any]) -> str:
    if rev.get("commit"):
        if rev.get("dirty"):
            # two different dirty contents of one commit are two revisions: say which
            digest = str(rev.get("files_sha256", ""))[:8]
            return str(rev["commit"])[:12] + "-dirty" + (f"-{digest}" if digest else "")
        return str(rev["commit"])[:12]
    return "sha256:" + str(rev.get("files_sha256", ""))[:12]


#: symlinks followed while resolving one path before giving up (the kernel's ELOOP limit)
MAX_LINKS = 40

#: (path, device, inode) of every file and directory one resolution passed through
Chain = tuple[tuple[str, int, int], ...]


def resolution(path: str) -> list[tuple[str, os.stat_result]]:
    """Return every directory and file the kernel passes through to open ``path``, with its lstat.

    Component by component from ``/``, following each symlink where it is met: the
    directory that holds a link is in the list (whoever can write it can flip the
    link), and so is everything on the way to the link's target, up to ``/``.
    """
    out: list[tuple[str, os.stat_result]] = []
    seen: set[str] = set()

    def visit(p: str) -> os.stat_result:
        st = os.lstat(p)
        if p not in seen and not stat.S_ISLNK(st.st_mode):
            seen.add(p)
            out.append((p, st))
        return st

    todo = [c for c in os.path.abspath(path).split("/") if c]
    cur = "/"
    visit(cur)
    links = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            cur = os.path.dirname(cur)  # cur is resolved already: its parent is real
            continue
        nxt = os.path.join(cur, part)
        st = visit(nxt)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise OSError(40, "too many levels of symbolic links", path)
            target = os.readlink(nxt)
            todo = [c for c in target.split("/") if c] + todo
            if target.startswith("/"):
                cur = "/"
            continue
        cur = nxt
    return out


def _problem(p: str, st: os.stat_result, me: int) -> str | None:
    what = "directory" if stat.S_ISDIR(st.st_mode) else "file"
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & stat.S_IWOTH and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
        return (f"{p}: refusing to watch: directory is writable by group or others (mode "
                f"{mode:04o}; the sticky bit does not help: anyone can plant a file or link "
                "there before us); keep the desired state in a directory only root can "
                "write, or pass --allow-insecure-config")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{p}: refusing to watch: {what} is writable by group or others (mode "
                f"{mode:04o}); run `chmod go-w {p}` or pass --allow-insecure-config")
    if st.st_uid not in (0, me):
        return (f"{p}: refusing to watch: {what} belongs to uid {st.st_uid}, not root or uid "
                f"{me}; fix the owner or pass --allow-insecure-config")
    return None


def check_permissions(paths: Sequence[str]) -> Chain:
    """Refuse config that someone other than root (or us) could change, like sshd StrictModes.

    Every file (each ``*.yaml`` of a named directory too) is resolved as the kernel
    would open it, symlinks included, and each directory and file on the way, up to
    ``/``, must belong to root or to the user running the agent and not be writable by
    group or others — a world-writable directory is refused even with the sticky bit.
    The watch loop calls this at every load, so a symlink that flips (git-sync, a
    ConfigMap) is checked again where it points now. Returns what was checked
    ((path, device, inode) in order), so a caller can tell that nothing moved while it
    read the files.
    """
    try:
        files = expand_paths(paths)
    except ConfigError:
        files = [p for p in paths if os.path.lexists(p)]
    me = os.geteuid()
    chain: list[tuple[str, int, int]] = []
    done: set[str] = set()
    for p in [*paths, *files]:
        try:
            steps = resolution(p)
        except (FileNotFoundError, NotADirectoryError):
            # not there (now): nothing is read from it, and the load says it is missing;
            # no look before (a path removed between the look and the walk was refused
            # as "cannot resolve it")
            continue
        except OSError as exc:
            raise PreconditionError(f"{p}: refusing to watch: cannot resolve it: "
                                    f"{exc.strerror or exc}") from None
        for t, st in steps:
            if t in done:
                continue
            done.add(t)
            problem = _problem(t, st, me)
            if problem is not None:
                via = "" if os.path.abspath(p) == t else f" (on the way to {p})"
                raise PreconditionError(problem.replace(": refusing to watch:",
                                                        f"{via}: refusing to watch:", 1))
            chain.append((t, st.st_dev, st.st_ino))
    return tuple(chain)
