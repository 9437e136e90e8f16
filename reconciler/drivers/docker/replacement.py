"""What replacing a network with containers attached must not forget (pure, JSON-able).

Docker cannot change a network in place: a replace disconnects every container,
removes the network, creates the new one and reconnects them. Between the first
disconnect and the last reconnect the only list of who was attached, with which
addresses, used to live in the process's memory; a ``kill -9`` there left
containers with no network for ever. ``Replacement`` is that list and both sets of
network settings, made before the first destructive step so that the caller can
store it durably (the engine's journal: ``engine/journal.py``); ``Steps`` is how
the driver reports each step as it completes, and ``DockerDriver.resume_replace``
carries a stored one on from whatever it did.

Step names: ``disconnect:<container id>``, ``remove``, ``create:<network id>``,
``connect:<container id>``, ``undo`` (the new network could not be made: the
old settings are being restored instead), and ``abandon`` (a step before the
removal failed for good: every container goes back onto the old network, each
``put-back:<container id>``; a run that finds it finishes that, not the replace).

See docs/decisions/023-journals.md.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Protocol

#: the step that gives a replace up before the old network was removed (see the docstring)
ABANDON = "abandon"

#: bumped when a field changes meaning: a journal of another version is refused, not guessed
FORMAT = 1


@dataclass(frozen=True)
class Endpoint:
    """A container attached to a network, as a replace re-attaches it (endpoint settings)."""

    container_id: str
    container_name: str
    ipv4: ipaddress.IPv4Address | None
    ipv6: ipaddress.IPv6Address | None
    aliases: tuple[str, ...]
    links: tuple[str, ...] = ()
    link_local_ips: tuple[str, ...] = ()
    driver_opts: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"container_id": self.container_id, "container_name": self.container_name,
                "ipv4": str(self.ipv4) if self.ipv4 else None,
                "ipv6": str(self.ipv6) if self.ipv6 else None,
                "aliases": list(self.aliases), "links": list(self.links),
                "link_local_ips": list(self.link_local_ips),
                "driver_opts": dict(self.driver_opts)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Endpoint:
        return cls(container_id=str(raw["container_id"]),
                   container_name=str(raw["container_name"]),
                   ipv4=ipaddress.IPv4Address(raw["ipv4"]) if raw.get("ipv4") else None,
                   ipv6=ipaddress.IPv6Address(raw["ipv6"]) if raw.get("ipv6") else None,
                   aliases=tuple(str(a) for a in raw.get("aliases") or ()),
                   links=tuple(str(a) for a in raw.get("links") or ()),
                   link_local_ips=tuple(str(a) for a in raw.get("link_local_ips") or ()),
                   driver_opts=tuple(sorted((str(k), str(v)) for k, v in
                                            (raw.get("driver_opts") or {}).items())))


@dataclass(frozen=True)
class CreateArgs:
    """One network create call's settings (both the new network's and the old one's)."""

    name: str
    options: dict[str, str]
    labels: dict[str, str]
    internal: bool
    subnet: ipaddress.IPv4Network | None
    gateway: str | None = None
    subnet6: ipaddress.IPv6Network | None = None
    gateway6: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "options": dict(self.options), "labels": dict(self.labels),
                "internal": self.internal,
                "subnet": str(self.subnet) if self.subnet else None, "gateway": self.gateway,
                "subnet6": str(self.subnet6) if self.subnet6 else None,
                "gateway6": self.gateway6}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CreateArgs:
        return cls(name=str(raw["name"]),
                   options={str(k): str(v) for k, v in (raw.get("options") or {}).items()},
                   labels={str(k): str(v) for k, v in (raw.get("labels") or {}).items()},
                   internal=bool(raw.get("internal", False)),
                   subnet=ipaddress.IPv4Network(raw["subnet"]) if raw.get("subnet") else None,
                   gateway=raw.get("gateway"),
                   subnet6=(ipaddress.IPv6Network(raw["subnet6"]) if raw.get("subnet6")
                            else None),
                   gateway6=raw.get("gateway6"))


@dataclass(frozen=True)
class Replacement:
    """Everything a replace needs to be finished (or undone) by another process.

    ``spec`` is the declared network (``domain.docker.spec_to_json``, the scope label
    included), ``new`` the first create call of it (the live subnets kept, so the
    containers' fixed addresses stay valid), ``pinned6`` the live IPv6 subnet kept
    instead of a derived one, ``old`` the network that was there (to restore it when
    the new one cannot be made).
    """

    name: str
    old_id: str
    spec: dict[str, Any]
    new: CreateArgs
    old: CreateArgs
    endpoints: tuple[Endpoint, ...]
    pinned6: ipaddress.IPv6Network | None = None
    default_mtu: int | None = None
    format: int = field(default=FORMAT)

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "name": self.name, "old_id": self.old_id,
                "spec": self.spec, "new": self.new.to_json(), "old": self.old.to_json(),
                "endpoints": [e.to_json() for e in self.endpoints],
                "pinned6": str(self.pinned6) if self.pinned6 else None,
                "default_mtu": self.default_mtu}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Replacement:
        """Read a replacement back; raise ValueError (or KeyError, TypeError) for anything this
        version did not write."""
        if raw.get("format") != FORMAT:
            raise ValueError(f"replacement format {raw.get('format')!r} is not {FORMAT}")
        mtu = raw.get("default_mtu")
        return cls(name=str(raw["name"]), old_id=str(raw["old_id"]), spec=dict(raw["spec"]),
                   new=CreateArgs.from_json(raw["new"]), old=CreateArgs.from_json(raw["old"]),
                   endpoints=tuple(Endpoint.from_json(e) for e in raw["endpoints"]),
                   pinned6=ipaddress.IPv6Network(raw["pinned6"]) if raw.get("pinned6")
                   else None,
                   default_mtu=int(mtu) if mtu is not None else None)


class Steps(Protocol):
    """Where a replace reports its progress (the engine's journal; ``NO_STEPS`` otherwise)."""

    def begin(self, replacement: Replacement) -> None:
        """Store ``replacement`` durably; called before the first destructive step, which
        does not happen if this raises."""

    def done(self, step: str) -> None:
        """Record that ``step`` completed."""


class _NoSteps:
    def begin(self, replacement: Replacement) -> None:
        pass

    def done(self, step: str) -> None:
        pass


NO_STEPS: Steps = _NoSteps()
