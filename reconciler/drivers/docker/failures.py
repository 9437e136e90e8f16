"""Docker SDK failures, classified.

An unreachable daemon (and why), and the daemon's own words on one line.
"""

from __future__ import annotations

from collections.abc import Iterator

import docker
import docker.errors
import requests.exceptions

from reconciler.drivers.docker.payloads import (
    daemon_message,
)


class Unreachable(Exception):
    """Internal: the daemon could not be reached (converted at the boundary)."""


def explanation(exc: docker.errors.APIError) -> str:
    explanation = exc.explanation
    if isinstance(explanation, bytes):
        explanation = explanation.decode(errors="replace")
    text = explanation if isinstance(explanation, str) and explanation else str(exc)
    # Keep inner whitespace: kind's texts have a double space that classifiers need.
    return daemon_message(text)


def one_line(text: str) -> str:
    """Put the daemon's text on one line, for messages to people."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def walk(exc: BaseException, depth: int = 0) -> Iterator[BaseException]:
    """Yield the exception, its cause/context chain and exceptions in its args."""
    if depth > 8:
        return
    yield exc
    for arg in exc.args:
        if isinstance(arg, BaseException):
            yield from walk(arg, depth + 1)
    for nested in (exc.__cause__, exc.__context__):
        if nested is not None:
            yield from walk(nested, depth + 1)


def is_connection_failure(exc: BaseException) -> bool:
    if isinstance(exc, docker.errors.APIError):
        return False
    return any(
        isinstance(e, requests.exceptions.ConnectionError | requests.exceptions.Timeout
                   | ConnectionError | FileNotFoundError | TimeoutError)
        for e in walk(exc)
    ) or (isinstance(exc, docker.errors.DockerException)
          and "Error while fetching server API version" in str(exc))


def unreachable_reason(exc: BaseException) -> str:
    for e in walk(exc):
        if isinstance(e, FileNotFoundError):
            return "socket not found"
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if isinstance(e, PermissionError):
            return "permission denied"
        if isinstance(e, requests.exceptions.Timeout | TimeoutError):
            return "timed out"
    for e in walk(exc):
        text = str(e)
        for marker, reason in (("No such file", "socket not found"),
                               ("Connection refused", "connection refused"),
                               ("Permission denied", "permission denied"),
                               ("timed out", "timed out")):
            if marker in text:
                return reason
    return type(exc).__name__

