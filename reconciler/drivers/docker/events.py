"""Docker's event stream, through the SDK (the watch loop's Docker drift source reads it)."""

from __future__ import annotations

from typing import Any

import docker


def events_client(timeout: float = 10.0) -> Any:
    """Return a client of the daemon ``DOCKER_HOST`` names, for ``client.events(...)``."""
    return docker.from_env(timeout=timeout)
