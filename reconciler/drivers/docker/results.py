"""What the Docker driver reports it did for one network."""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.domain.live import LiveDockerNetwork


@dataclass(frozen=True)
class EnsureResult:
    """What ``ensure``/``replace`` did for one network."""

    name: str
    network_id: str
    created: bool  # False: an existing network was kept (kind's no-op)
    subnet6: str | None = None  # the IPv6 subnet we asked for, if any
    attempt: int | None = None  # the derived-subnet attempt that succeeded
    ipv6_fallback: bool = False  # created IPv4-only because the daemon lacks IPv6
    removed_duplicates: tuple[str, ...] = ()
    reconnected: tuple[str, ...] = ()  # container names re-attached by replace
    gone: tuple[str, ...] = ()  # containers a replace could not re-attach: they no longer exist
    undone: bool = False  # a finished replace restored the old network instead
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class DedupeResult:
    kept: LiveDockerNetwork | None
    removed: tuple[str, ...] = ()

