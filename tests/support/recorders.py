"""Drivers that record every call instead of making it: what the op gate sends where."""

from __future__ import annotations

from typing import Any


class Recorder:
    """Any method call is recorded as (driver, method, args, kwargs)."""

    def __init__(self, label: str, calls: list[tuple[Any, ...]]) -> None:
        self.label, self.calls = label, calls

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((self.label, method, args, kwargs))
            return Result()
        return call


class Result:
    warnings: tuple[str, ...] = ()
    removed_duplicates: tuple[str, ...] = ()
    reconnected: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()  # docker.restore

    def __len__(self) -> int:  # nothing deleted (conntrack entries)
        return 0
