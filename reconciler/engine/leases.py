"""The lease store: ``<state dir>/<scope>/leases.json``, read by observation, written by the engine.

What the planner picked (addresses, MACs, ``auto`` host ports and prefixes) is
written here before the first op that uses it (``Reconciler.apply``), whole
and durably (``drivers/statedir``: temporary, fsync, rename, fsync of the
directory), so a reboot or lost kernel state brings the same values back.
Reading never makes the directory: ``plan`` and dry runs write nothing. A record
that cannot be read is a problem line (the plan's one warning), never a crash:
the next apply rebuilds the table from live state.

See docs/decisions/041-leases.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from reconciler.domain import leases
from reconciler.domain.errors import PreconditionError
from reconciler.drivers import statedir

log = logging.getLogger("reconciler")


def path(scope: str) -> str:
    """Return the lease file's path for ``scope`` (``observe.docker_scope``)."""
    return os.path.join(statedir.state_root(), statedir.scope_dirname(scope), leases.FILENAME)


def stamp(scope: str) -> tuple[int, int, int] | None:
    """Return (inode, mtime ns, size) of the lease file, or None when there is none: a table
    read before with the same stamp is the same table (every write renames a new file)."""
    try:
        st = os.stat(path(scope), follow_symlinks=False)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def read(scope: str) -> tuple[leases.Table, str | None]:
    """Read the lease table of ``scope``: (table, None), or ({}, why it could not be read)."""
    where = path(scope)
    directory = os.path.dirname(where)
    if not os.path.isdir(directory):
        return {}, None  # nothing was ever leased here (the directory is made only to write)
    try:
        raw = statedir.read_record(directory, leases.FILENAME)
        if raw is None:
            return {}, None
        return leases.from_json(raw), None
    except (PreconditionError, leases.LeaseError, OSError) as exc:
        return {}, (f"lease file {where} cannot be read ({exc}): picked values are taken from "
                    "the live state and the table is rebuilt by the next apply")


def write(table: Mapping[str, Mapping[str, Any]], scope: str) -> str:
    """Write ``table`` durably; its path. PreconditionError (nothing changed) when it cannot."""
    directory = statedir.scope_dir(scope)
    try:
        return statedir.write_record(directory, leases.FILENAME, leases.to_json(table))
    except OSError as exc:
        raise PreconditionError(f"cannot write the lease file {path(scope)}: "
                                f"{exc.strerror or exc}; nothing changed") from None


def release(address: str, scope: str) -> list[str]:
    """Forget the leases of ``address`` (``KIND/NAME``); the fields released (none: it had
    none). A damaged lease file is a PreconditionError: nothing is guessed."""
    table, problem = read(scope)
    if problem is not None:
        raise PreconditionError(f"lease file {path(scope)} cannot be read; move it away (the "
                                "next apply rebuilds it from the live state); nothing changed")
    fields = sorted(table.get(address, {}))
    if fields:
        write(leases.released(table, address), scope)
    return fields


def release_undeclared(declared: Collection[str], scope: str) -> list[str]:
    """Forget the leases of every resource not in ``declared`` (``gc PATH``); those released.
    A lease file that cannot be read is left alone (the next apply rebuilds it)."""
    table, problem = read(scope)
    gone = sorted(a for a in table if a not in declared)
    if problem is None and gone:
        write({a: f for a, f in table.items() if a in declared}, scope)
    return gone if problem is None else []


class LeaseStore(Protocol):
    """Where the engine saves the lease table a plan needs: the file, or a test's fake host."""

    def save(self, table: Mapping[str, Mapping[str, Any]]) -> None: ...


class LeaseFile:
    """The lease file of the scope ``scope()`` names (found on first use)."""

    def __init__(self, scope: Callable[[], str]) -> None:
        self._find, self._scope = scope, ""

    @property
    def scope(self) -> str:
        if not self._scope:
            self._scope = self._find()
        return self._scope

    def save(self, table: Mapping[str, Mapping[str, Any]]) -> None:
        write(table, self.scope)
