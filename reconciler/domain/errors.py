"""One error root for everything the reconciler raises on purpose.

Subclasses also inherit the matching builtin so callers that only know the
builtin still catch them. ``TemporaryError`` is retried with bounded backoff;
every other ``ReconcilerError`` is permanent.
"""

from __future__ import annotations


class ReconcilerError(Exception):
    """Root of every error the reconciler reports to users as one line."""


class ConfigError(ReconcilerError, ValueError):
    """The desired-state files are wrong (syntax, schema or semantics)."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 col: int | None = None) -> None:
        self.file = file
        self.line = line
        self.col = col
        self.message = message
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = self.file
            if self.line is not None:
                where += f":{self.line}"
                if self.col is not None:
                    where += f":{self.col}"
            where += ": "
        return f"{where}{self.message}"


class ConfigErrors(ConfigError):
    """Several independent configuration errors, reported together."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


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
