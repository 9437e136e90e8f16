"""The checkpoint of a pending change: the owned state of the host as it was before it.

A value, and its JSON (``to_json`` / ``from_json``), which ``pending.json`` in the state
directory carries (``engine/safechange``). It records what the reconciler owns, as the
kernel and Docker reported it, not what some files declared: a revert puts back what
was there, including what the old files left to the kernel (an MTU, a hairpin flag).
``planner/checkpoint`` takes it from a ``LiveState`` and plans the restore.

Pure: no I/O, nothing from above ``reconciler.domain``.

See docs/decisions/025-safe-change-checkpoint.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHECKPOINT_VERSION = 1


class CheckpointError(ValueError):
    """A recorded checkpoint that this version cannot read."""


@dataclass(frozen=True)
class LinkPoint:
    """An owned link of the host (a bridge, an allocation's host-side veth)."""

    name: str
    kind: str
    mtu: int
    up: bool
    master: str | None = None
    hairpin: bool | None = None
    mac: str | None = None
    addresses: tuple[str, ...] = ()  # owned addresses, interfaces (address/prefix), sorted


@dataclass(frozen=True)
class AllocPoint:
    """An owned allocation namespace: its ``eth0`` and its owned default routes."""

    name: str
    mark: str | None  # the alias of its lo
    eth0_mtu: int | None = None  # None: no eth0
    eth0_mac: str | None = None
    eth0_up: bool = False
    addresses: tuple[str, ...] = ()  # owned, on eth0, sorted
    gateways: tuple[str, ...] = ()  # of the owned default routes, sorted


@dataclass(frozen=True)
class EndpointPoint:
    """A container attached to a Docker network."""

    container: str  # the container's full ID
    name: str = ""
    ipv4: str | None = None  # an address, no prefix
    ipv6: str | None = None
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class NetworkPoint:
    """An owned Docker network of this scope: its settings and attachments (not its ID,
    which a re-creation changes)."""

    name: str
    id: str = field(default="", compare=False)
    driver: str = "bridge"
    options: tuple[tuple[str, str], ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    ipv6: bool = False
    internal: bool = False
    pools: tuple[tuple[str, str | None], ...] = ()  # (subnet, gateway)
    #: the containers attached when the checkpoint was taken: whom a rebuild re-attaches,
    #: never what a restore compares (containers come and go without the reconciler)
    endpoints: tuple[EndpointPoint, ...] = ()

    def settings(self) -> tuple[object, ...]:
        """Return what a change can alter and a revert puts back: all but ID and attachments."""
        return (self.name, self.driver, self.options, self.labels, self.ipv6,
                self.internal, self.pools)


@dataclass(frozen=True)
class Checkpoint:
    host_id: str
    links: dict[str, LinkPoint] = field(default_factory=dict)
    allocs: dict[str, AllocPoint] = field(default_factory=dict)
    #: family -> ("table", "chain") -> rules of our chains (only those: not our jumps in
    #: the built-in chains, which the restore writes as every apply does, so a jump an
    #: operator moved goes back to the first position, not to where it was); a family
    #: missing: its firewall could not be read (left as it is)
    firewall: dict[int, dict[tuple[str, str], tuple[str, ...]]] = field(default_factory=dict)
    sysctls: dict[str, str] = field(default_factory=dict)
    #: None: Docker was not observed (not there, or nothing of ours): left as it is
    docker: tuple[NetworkPoint, ...] | None = None
    #: names of what was there and not ours ("links", "netns", "docker"): a change that
    #: adopted one (``--adopt``) made it ours, and a revert must never delete it
    foreign: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": CHECKPOINT_VERSION,
            "host_id": self.host_id,
            "links": [_plain(lk) for _n, lk in sorted(self.links.items())],
            "allocs": [_plain(a) for _n, a in sorted(self.allocs.items())],
            "firewall": {str(fam): [{"table": t, "chain": c, "rules": list(rules)}
                                    for (t, c), rules in sorted(chains.items())]
                         for fam, chains in sorted(self.firewall.items())},
            "sysctls": dict(sorted(self.sysctls.items())),
            "docker": None if self.docker is None else [network_to_json(n)
                                                        for n in self.docker],
            "foreign": {k: list(v) for k, v in sorted(self.foreign.items())},
        }

    @classmethod
    def from_json(cls, raw: Any) -> Checkpoint:
        """Return the checkpoint of ``to_json``; ``CheckpointError`` for anything else."""
        try:
            if raw.get("version") != CHECKPOINT_VERSION:
                raise CheckpointError(f"checkpoint version {raw.get('version')!r} is not "
                                      f"{CHECKPOINT_VERSION}")
            links = {d["name"]: LinkPoint(**_tuples(d, "addresses")) for d in raw["links"]}
            allocs = {d["name"]: AllocPoint(**_tuples(d, "addresses", "gateways"))
                      for d in raw["allocs"]}
            firewall = {int(fam): {(c["table"], c["chain"]): tuple(c["rules"]) for c in chains}
                        for fam, chains in raw["firewall"].items()}
            docker = None if raw["docker"] is None else tuple(
                network_from_json(n) for n in raw["docker"])
            foreign = {str(k): tuple(str(n) for n in v)
                       for k, v in (raw.get("foreign") or {}).items()}
            return cls(str(raw["host_id"]), links, allocs, firewall,
                       {str(k): str(v) for k, v in raw["sysctls"].items()}, docker, foreign)
        except CheckpointError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"not a checkpoint ({type(exc).__name__}: {exc})") from None


def network_to_json(n: NetworkPoint) -> dict[str, Any]:
    """Return a network's JSON, as the checkpoint and the ``docker.restore`` op carry it."""
    return {**_plain(n), "options": dict(n.options), "labels": dict(n.labels),
            "pools": [list(p) for p in n.pools], "endpoints": [_plain(e) for e in n.endpoints]}


def network_from_json(raw: Any) -> NetworkPoint:
    """Return the inverse of ``network_to_json`` (KeyError, TypeError, ValueError if malformed)."""
    return NetworkPoint(**{**raw, "options": tuple(sorted(raw["options"].items())),
                           "labels": tuple(sorted(raw["labels"].items())),
                           "pools": tuple((str(p[0]), p[1]) for p in raw["pools"]),
                           "endpoints": tuple(EndpointPoint(**_tuples(e, "aliases"))
                                              for e in raw["endpoints"])})


def _plain(value: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(value).items()}


def _tuples(raw: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {**raw, **{k: tuple(raw[k]) for k in keys if k in raw}}
