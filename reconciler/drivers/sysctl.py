"""Per-namespace kernel settings through /proc/sys/net (which follows the caller's
network namespace, unlike /sys/class/net)."""

from __future__ import annotations

import os
import re

from reconciler.domain.errors import DriverError

_KEY = re.compile(r"^net(/[A-Za-z0-9_.-]+)+$")


def _path(key: str) -> str:
    if not _KEY.fullmatch(key) or "/../" in f"{key}/" or "/./" in f"{key}/":
        raise DriverError(f"sysctl {key}: not a net/... key")
    return os.path.join("/proc/sys", key)


def read(key: str) -> str | None:
    """Read the value, or None when the key does not exist (e.g. IPv6 disabled)."""
    try:
        with open(_path(key)) as fh:
            return fh.read().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DriverError(f"sysctl {key}: {exc.strerror}") from None


def write(key: str, value: str) -> None:
    try:
        with open(_path(key), "w") as fh:
            fh.write(value)
    except OSError as exc:
        raise DriverError(f"sysctl {key}={value}: {exc.strerror}") from None
