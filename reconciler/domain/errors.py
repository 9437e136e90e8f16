"""One error root for everything the reconciler raises on purpose.

Subclasses also inherit the matching builtin so callers that only know the
builtin still catch them. ``TemporaryError`` is retried with bounded backoff;
every other ``ReconcilerError`` is permanent.
"""

from __future__ import annotations


class ReconcilerError(Exception):
    """Root of every error the reconciler reports to users as one line."""


class ConfigError(ReconcilerError, ValueError):
    """The desired-state files are wrong (syntax, schema or semantics).

    ``key`` is the key path the problem is at (``allocs[0].ports[1].host``), when known;
    ``public`` words the problem without quoting the file (``str`` may quote its values):
    see :meth:`public_text`.
    """

    #: what :meth:`public_text` says of a problem whose words would quote the file
    HIDDEN = "invalid value (details: the agent's log, or `reconcile validate` as root)"

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 col: int | None = None, key: str | None = None,
                 public: str | None = None) -> None:
        self.file = file
        self.line = line
        self.col = col
        self.message = message
        self.key = key
        self.public = public
        super().__init__(self.__str__())

    def where(self) -> str:
        """Return ``file:line:col: `` (as much of it as is known), or ''."""
        if self.file is None:
            return ""
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.col is not None:
                where += f":{self.col}"
        return where + ": "

    def __str__(self) -> str:
        return f"{self.where()}{self.message}"

    def public_text(self) -> str:
        """Say where the problem is (file:line:col, the key path) and what kind it is, never a
        value of the file: for readers who may not read the files (the agent's ``/status``,
        which any local user can fetch, of files only root can read)."""
        key = f"{self.key}: " if self.key else ""
        return f"{self.where()}{key}{self.public or self.HIDDEN}"


class ConfigErrors(ConfigError):
    """Several independent configuration errors, reported together."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)

    def public_text(self) -> str:
        return "\n".join(e.public_text() for e in self.errors)


class ConflictError(ReconcilerError):
    """An object we would manage exists but is not ours."""


class StrandedError(ReconcilerError):
    """A multi-step change had to stop with something still taken away (containers off their
    network) that only its journal says how to put back: the journal stays, and the next
    run tries again. Not a ``TemporaryError``: waiting a second does not help."""


class StrandedConflict(StrandedError, ConflictError):
    """A ``StrandedError`` because an object that is not ours is in the way."""


class PreconditionError(ReconcilerError, RuntimeError):
    """The host cannot be reconciled as it is (missing tool, wrong namespace, ...)."""


class DriverError(ReconcilerError, OSError):
    """An outside system (kernel, iptables, Docker) refused an operation."""


class TemporaryError(DriverError):
    """A failure worth retrying after ``delay`` seconds (EBUSY, xtables lock, ...)."""

    def __init__(self, message: str, delay: float = 0.2) -> None:
        super().__init__(message)
        self.delay = delay


class PlanError(ReconcilerError):
    """The desired state cannot be realised on this host (e.g. a range is exhausted)."""


class StalePlanError(ReconcilerError):
    """A saved plan no longer matches the live state it was computed from."""


class LockedError(ReconcilerError):
    """Another writer holds the host lock."""


class VerifyError(ReconcilerError):
    """After apply, observing again still shows differences."""
