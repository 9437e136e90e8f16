"""Journals of multi-step changes: what a change needs to be finished, stored before it starts.

Two changes take something away before they put its replacement in place, and a
``kill -9`` (or a reboot) between the two used to strand it for ever: replacing a
Docker network with containers attached (every container is disconnected, the
network removed and re-created, the containers reconnected) and adopting a
namespace (its foreign ``eth0`` is deleted, then our veth attached). Each writes
``<state dir>/<scope>/journal-<kind>-<name>.json`` (``drivers/statedir``: fsync'd
file and directory) *before* its first destructive step, records each step as it
completes, and removes the journal at its end. A journal still there means its
change was interrupted: the next run (``apply``, ``destroy``, a ``watch`` pass)
finishes it under the host lock before it plans (``engine/finish.py``).

Kinds: ``docker_network`` (the body is the driver's ``Replacement``: attachments
with their addresses, aliases and endpoint settings, the new and the old network
settings; steps are the driver's) and ``alloc`` (the body is the change's ops in
their wire form; step ``op:N`` is the Nth op done, so the next run resumes after
the last one recorded — each op is idempotent, so the one after it may have
happened already).

Ownership never lives here: a journal says what to finish, the objects still say
whose they are.

See docs/decisions/023-journals.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from reconciler.domain.errors import PreconditionError
from reconciler.domain.ops import AllocAttach, LinkDelete
from reconciler.domain.plan import Change
from reconciler.drivers import statedir
from reconciler.drivers.docker.replacement import Replacement
from reconciler.engine.observe import docker_scope

log = logging.getLogger("reconciler")

PREFIX = "journal-"
SUFFIX = ".json"
#: bumped when the record's layout changes: a journal of another version is reported, not
#: guessed at
FORMAT = 1
DOCKER = "docker_network"
ALLOC = "alloc"


def record_name(kind: str, name: str) -> str:
    return f"{PREFIX}{kind}-{name}{SUFFIX}"


def describe(record: str) -> str:
    """Say what a journal file stands for, from its name alone (``plan`` reads no journal):
    ``docker network N: a replace …``."""
    kind, _, name = record[len(PREFIX):-len(SUFFIX)].partition("-")
    if kind == DOCKER:
        return (f"docker network {name}: a replace that a killed run left half done (its "
                "containers may be detached); the next apply, destroy, gc or watch pass "
                "finishes it first")
    return (f"{kind} {name}: a change that a killed run left half done; the next apply, "
            "destroy, gc or watch pass finishes it first")


@dataclass
class Journal:
    """One journal file: the body a change needs to be finished and the steps it did."""

    directory: str
    kind: str
    name: str
    body: dict[str, Any] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)
    started_at: float = 0.0
    pid: int = 0
    written: bool = False

    @property
    def record(self) -> str:
        return record_name(self.kind, self.name)

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.record)

    def begin(self, body: dict[str, Any]) -> None:
        """Store ``body`` durably. A PreconditionError (a full disk, a read-only state
        directory …) comes before anything changed: the change must not start."""
        self.body, self.steps = body, []
        self.started_at, self.pid = time.time(), os.getpid()
        try:
            self._write()
        except OSError as exc:
            raise PreconditionError(f"{self.kind} {self.name}: cannot write its journal "
                                    f"{self.path}: {exc.strerror or exc}; nothing changed"
                                    ) from None

    def done(self, step: str) -> None:
        """Record that ``step`` completed (durably, before the next one starts).

        A step that cannot be recorded does not stop the change halfway (that would
        strand what the journal protects): the journal keeps the steps before it, and
        finishing from there is correct because every step is idempotent.
        """
        self.steps.append(step)
        try:
            self._write()
        except OSError as exc:
            log.warning("%s %s: could not record step %s in %s: %s", self.kind, self.name,
                        step, self.path, exc.strerror or exc)

    def close(self) -> None:
        """Close the journal: the change reached its end, nothing is left to finish."""
        try:
            statedir.remove_record(self.directory, self.record)
        except OSError as exc:  # the next run finds everything done: a no-op finish
            log.warning("%s %s: could not remove %s: %s", self.kind, self.name, self.path,
                        exc.strerror or exc)
        self.written = False

    def _write(self) -> None:
        statedir.write_record(self.directory, self.record, {
            "format": FORMAT, "kind": self.kind, "name": self.name,
            "started_at": self.started_at, "pid": self.pid, "boot_id": statedir.boot_id(),
            "body": self.body, "done": self.steps})
        self.written = True


class ReplaceSteps:
    """The Docker driver's ``Steps`` over a journal: a replace reports into it.

    The journal file is made by ``begin`` only (a replace without containers needs
    none); ``journal`` is the one to carry on when finishing an interrupted replace.
    """

    def __init__(self, journals: Journals, name: str, journal: Journal | None = None) -> None:
        self.journals, self.name, self.journal = journals, name, journal

    def begin(self, replacement: Replacement) -> None:
        self.journal = self.journals.new(DOCKER, self.name)
        self.journal.begin(replacement.to_json())

    def done(self, step: str) -> None:
        if self.journal is not None:
            self.journal.done(step)

    def close(self) -> None:
        if self.journal is not None and self.journal.written:
            self.journal.close()


class BadJournal(PreconditionError):
    """A journal file this version cannot read (another version's, or damaged)."""


def needs_journal(change: Change) -> bool:
    """Tell whether ``change`` deletes a link inside a namespace before attaching our veth there:
    an adopted namespace's foreign ``eth0`` (or a heal of ours). Killed in between, the
    namespace would have no ``eth0``, and an adopted one is not ours yet, so no later plan
    would make one."""
    names = [op.name for op in change.ops]
    if AllocAttach.NAME not in names:
        return False
    first_attach = names.index(AllocAttach.NAME)
    return any(op.name == LinkDelete.NAME and op.args.get("netns") is not None
               for op in change.ops[:first_attach])


class Journals:
    """The journals of the scope we act in (``docker_scope``: the host, or a sandbox)."""

    def __init__(self, scope: str | None = None) -> None:
        self._scope = scope

    @property
    def scope(self) -> str:
        if self._scope is None:
            self._scope = docker_scope()
        return self._scope

    def _directory(self, *, create: bool) -> str | None:
        path = os.path.join(statedir.state_root(), statedir.scope_dirname(self.scope))
        if not create and not os.path.isdir(path):
            return None  # nothing was ever journalled here: made only when needed
        return statedir.scope_dir(self.scope)

    def new(self, kind: str, name: str) -> Journal:
        """Make a journal for a change about to start (written by its ``begin``)."""
        directory = self._directory(create=True)
        assert directory is not None
        return Journal(directory, kind, name)

    def find(self, kind: str, name: str) -> Journal | None:
        """Find the interrupted change of ``kind``/``name``, if there is one."""
        directory = self._directory(create=False)
        if directory is None:
            return None
        return self._read(directory, record_name(kind, name))

    def names(self) -> list[str]:
        """List the journal files there are (cheap: no file is read)."""
        directory = self._directory(create=False)
        if directory is None:
            return []
        return [n for n in statedir.list_records(directory, SUFFIX) if n.startswith(PREFIX)]

    def pending(self) -> Iterator[Journal | BadJournal]:
        """Yield every interrupted change, oldest first; a file that is not a journal of this
        version is a ``BadJournal`` (reported, left where it is)."""
        directory = self._directory(create=False)
        if directory is None:
            return
        found: list[Journal] = []
        for n in self.names():
            try:
                journal = self._read(directory, n)
            except BadJournal as exc:
                yield exc
                continue
            if journal is not None:
                found.append(journal)
        yield from sorted(found, key=lambda j: (j.started_at, j.record))

    def for_change(self, change: Change, *, adopt: bool) -> Journal | None:
        """Begin the journal of a plan change that needs one (``needs_journal``): its ops,
        and whether it adopts the object (for the line that says it was finished)."""
        if not needs_journal(change):
            return None
        journal = self.new(change.kind, change.name)
        journal.begin({"ops": [op.to_json() for op in change.ops], "adopt": adopt})
        return journal

    @staticmethod
    def _read(directory: str, record: str) -> Journal | None:
        path = os.path.join(directory, record)
        try:
            raw = statedir.read_record(directory, record)
        except PreconditionError as exc:
            raise BadJournal(str(exc)) from None
        if raw is None:
            return None
        try:
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, this version writes {FORMAT}")
            journal = Journal(directory, str(raw["kind"]), str(raw["name"]),
                              dict(raw["body"]), [str(s) for s in raw["done"]],
                              float(raw.get("started_at") or 0), int(raw.get("pid") or 0),
                              written=True)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise BadJournal(f"{path}: not a journal this version can finish ({exc}); "
                             "move it away to go on") from None
        if journal.record != record:
            raise BadJournal(f"{path}: names {journal.kind}/{journal.name}, not its own file")
        return journal
