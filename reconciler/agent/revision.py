"""Which revision of the files the agent runs, and whether others could have written them."""

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
    """Commit and dirty flag of the git checkout holding ``paths[0]``, or None.

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
    head = git("rev-parse", "HEAD") if top else None
    if not top or not head:
        return None
    rel = [os.path.relpath(os.path.abspath(p), cwd) for p in paths]
    porcelain = git("status", "--porcelain", "--untracked-files=all", "--", *rel)
    return {"commit": head, "dirty": bool(porcelain), "toplevel": top}


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
        return str(rev["commit"])[:12] + ("-dirty" if rev.get("dirty") else "")
    return "sha256:" + str(rev.get("files_sha256", ""))[:12]


def check_permissions(paths: Sequence[str]) -> None:
    """Refuse config that someone other than root (or us) could change, like sshd StrictModes.

    The files and the directories that hold them must not be writable by group
    or others and must belong to root or to the user running the agent.
    """
    try:
        files = expand_paths(paths)
    except ConfigError:
        files = [p for p in paths if os.path.exists(p)]
    targets: list[str] = []
    for p in [*paths, *files]:
        ap = os.path.abspath(p)
        for t in (ap, os.path.dirname(ap)) if not os.path.isdir(ap) else (ap,):
            if t not in targets and os.path.exists(t):
                targets.append(t)
    me = os.geteuid()
    for t in targets:
        st = os.stat(t)
        what = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PreconditionError(
                f"{t}: refusing to watch: {what} is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); run `chmod go-w {t}` or pass "
                "--allow-insecure-config")
        if st.st_uid not in (0, me):
            raise PreconditionError(
                f"{t}: refusing to watch: {what} belongs to uid {st.st_uid}, not root or uid "
                f"{me}; fix the owner or pass --allow-insecure-config")

