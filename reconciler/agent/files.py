"""What asks the watch loop for a pass when the desired-state files change (watchdog).

Symlinks on the way to a watched directory (git-sync's ``repo`` link, a
ConfigMap's ``..data``) are followed when they are swapped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer as FsObserver

from reconciler.config.paths import YAML_SUFFIXES

log = logging.getLogger("reconciler.watch")


def relevant_path(path: str, named: Sequence[str]) -> bool:
    """Return True when a changed path can alter what the loader reads from ``named`` paths."""
    ap = os.path.abspath(path)
    for n in named:
        an = os.path.abspath(n)
        if ap == an:
            return True
        if os.path.dirname(ap) == an:  # a file directly inside a named directory
            base = os.path.basename(ap)
            if base.endswith(YAML_SUFFIXES) and not base.startswith("."):
                return True
    return False


def watch_dirs(paths: Sequence[str]) -> list[str]:
    """Return the directories to watch (non-recursively) for the given file/directory paths."""
    out: list[str] = []
    for p in paths:
        ap = os.path.abspath(p)
        d = ap if os.path.isdir(ap) else os.path.dirname(ap)
        if d not in out:
            out.append(d)
    return out


def parents_to_watch(paths: Sequence[str]) -> list[str]:
    """Return the parent of each named directory: its removal and its return are events there
    (a watch on the directory itself dies with it)."""
    out: list[str] = []
    for p in paths:
        ap = os.path.abspath(p)
        parent = os.path.dirname(ap)
        if os.path.isdir(ap) and parent != ap and parent not in out:
            out.append(parent)
    return out


def _links_on_the_way(path: str) -> list[str]:
    """Return every symlink among the components of ``path``."""
    out = []
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        p = os.sep.join(parts[:i])
        if os.path.islink(p):
            out.append(p)
    return out


class _FileEvents(FileSystemEventHandler):
    """Watchdog's callback: a change of a desired-state file or of a link on the way to one."""

    def __init__(self, watcher: FileWatcher) -> None:
        super().__init__()
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        if event.event_type in ("deleted", "moved") and event.is_directory:
            # a watched directory gone or moved away: its watch died or follows it elsewhere
            self.watcher.gone(os.fsdecode(event.src_path))
        for p in (event.src_path, getattr(event, "dest_path", "")):
            p = os.fsdecode(p) if p else ""
            if p and (relevant_path(p, self.watcher.paths) or p in self.watcher.links):
                self.watcher.on_change(p)
                return


class FileWatcher:
    """Watchdog (inotify) on the directories holding the desired-state files."""

    def __init__(self, paths: Sequence[str], on_change: Callable[[str], None]) -> None:
        self.paths = list(paths)
        self.on_change = on_change
        self._observer = FsObserver()
        #: watched directory -> ((the real directory inotify follows, its device and inode),
        #: the watch)
        self._scheduled: dict[str, tuple[tuple[str, int, int], Any]] = {}
        #: symlinks on the way to a watched directory (git-sync, ConfigMap ..data swaps)
        self.links: set[str] = set()
        self._handler = _FileEvents(self)
        #: watched directories seen removed or moved away (by the observer's thread): watched
        #: anew by the next ``ensure`` (the one made in its place may get the same inode)
        self._gone: set[str] = set()
        self._gone_lock = threading.Lock()

    def gone(self, path: str) -> None:
        """Note that the directory ``path`` was removed or moved away."""
        with self._gone_lock:
            self._gone.add(os.path.abspath(path))

    def ensure(self) -> None:
        """Watch every directory that exists now (a deleted one is picked up when it returns).

        inotify follows symlinks once, at the time of the watch: when a link on the
        way to a watched directory is swapped (git-sync's ``repo`` link, a
        ConfigMap's ``..data``), the watch is moved to the new target, and the
        directory holding the link is watched too so that the swap itself wakes us.
        A directory removed (or moved away) and made again is another directory, even
        with the same inode (its watch died with the old one): it is watched anew, and
        the parent of a named directory is watched so that its return wakes us. A
        directory that vanishes while this looks is left for the next call.
        """
        wanted = set(watch_dirs(self.paths)) | set(parents_to_watch(self.paths))
        for d in sorted(wanted):
            for link in _links_on_the_way(d):
                self.links.add(link)
                wanted.add(os.path.dirname(link))
        with self._gone_lock:
            gone, self._gone = self._gone, set()
        for d in sorted(wanted):
            try:
                st = os.stat(d)
            except OSError:
                continue  # not there now: watched when it returns
            if not stat.S_ISDIR(st.st_mode):
                continue
            real = (os.path.realpath(d), st.st_dev, st.st_ino)
            current = self._scheduled.get(d)
            if current is not None and current[0] == real and d not in gone:
                continue
            if current is not None:
                with contextlib.suppress(KeyError, OSError):
                    self._observer.unschedule(current[1])
                del self._scheduled[d]
            try:
                watch = self._observer.schedule(self._handler, d, recursive=False)
                self._scheduled[d] = (real, watch)
            except FileNotFoundError:
                log.debug("cannot watch %s: gone meanwhile", d)
            except OSError as exc:
                log.warning("cannot watch %s: %s", d, exc)

    def start(self) -> None:
        self.ensure()
        self._observer.start()

    def close(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=2.0)

