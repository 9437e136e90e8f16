"""Docker's event stream, through the SDK (the watch loop's Docker drift source reads it)."""

from __future__ import annotations

from typing import Any


def _docker_client() -> Any:
    import docker

    return docker.from_env(timeout=10)

