"""The files under /run/netns of a pass's new namespaces, made ahead on a second thread.

Here ``/run/netns`` is on the root ext4 filesystem and creating a file in it costs
220-380 µs, as much as ``unshare(CLONE_NEWNET)`` itself (bench/RESULTS.md): for
an apply of 500 allocations, 0.15-0.2 s spent waiting on the filesystem while no
netlink request of ours is in flight. A thread makes those files (empty, tagged:
``netns.reserve``) in plan order while the executor builds the allocations before
them; the ``netns.create`` op then only waits for its own file, unshares and mounts.

The plan's order and its failure semantics stay the executor's: a file is an
empty tagged file until its op mounts a namespace on it, exactly what a crash
between create and mount leaves (observation reports it, the next plan replaces
or removes it), and :meth:`NetnsFiles.close` removes the ones no op used (a
failed or stopped run skips the rest). Only ops with a mark and nothing to
replace are reserved; a file that cannot be made ahead (it exists, the
directory is not shared yet) is left to ``netns.create``, which says why.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from reconciler.drivers import netns


class NetnsFiles:
    """Reserve ``(name, mark)`` files in order on a daemon thread; ``take`` waits for one."""

    def __init__(self, wanted: Sequence[tuple[str, str]]) -> None:
        self._order = [name for name, _ in wanted]
        self._marks = dict(wanted)
        self._done: dict[str, bool] = {}
        self._used: set[str] = set()
        self._cond = threading.Condition()
        self._stop = False
        self._finished = False
        self._thread: threading.Thread | None = None
        if self._order:
            self._thread = threading.Thread(target=self._run, name="netns-files", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            for name in self._order:
                with self._cond:
                    if self._stop:
                        return
                made = netns.reserve(name, self._marks[name])
                with self._cond:
                    self._done[name] = made
                    self._cond.notify_all()
        finally:
            with self._cond:  # whatever happened, no take() waits for it any longer
                self._finished = True
                self._cond.notify_all()

    def take(self, name: str) -> bool:
        """True when the file of ``name`` was made ahead (the caller creates the namespace on
        it now); False when it was not asked for or could not be made."""
        if name not in self._marks:
            return False
        with self._cond:
            while name not in self._done and not (self._stop or self._finished):
                self._cond.wait()
            made = self._done.get(name, False)
            if made:
                self._used.add(name)
            return made

    def close(self) -> None:
        """Stop, and remove the files made ahead that no op used (still empty files)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        for name, made in self._done.items():
            if made and name not in self._used:
                netns.unreserve(name)
