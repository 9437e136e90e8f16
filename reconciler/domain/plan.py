"""The plan: a frozen, JSON-serialisable value.

A plan is a tuple of ``Change``s. Each change names one resource, says what
will happen to it (Terraform's closed set of actions), why, which attributes
differ, and lists the idempotent ``Op``s the executor will run for it. The
reason is for people; the executor only ever looks at the ops.


Rendering for people lives in ``reconciler.ui.render``.

See docs/decisions/006-plans-are-values.md; attribute detail in JSON (a port map edit's
maps) and ``within``: docs/decisions/050-output-that-scales.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

FORMAT_VERSION = 1


class Action(StrEnum):
    NOOP = "no-op"
    CREATE = "create"
    UPDATE = "update"
    DELETE = "delete"
    REPLACE = "replace"
    CONFLICT = "conflict"  # exists but not ours: blocks apply, never touched

    @property
    def symbol(self) -> str:
        return _SYMBOLS[self]


_SYMBOLS = {
    Action.NOOP: " ", Action.CREATE: "+", Action.UPDATE: "~", Action.DELETE: "-",
    Action.REPLACE: "-/+", Action.CONFLICT: "!",
}


Json = Any


@dataclass(frozen=True)
class Op:
    """One idempotent driver operation in its wire form, e.g.
    ``Op("link.add_bridge", {"name": "nomad", "mtu": 1500})``.

    Each op and its arguments are declared once, as a typed op in
    ``reconciler.domain.ops`` (``encode`` makes the ``Op``, ``decode`` reads it).
    """

    name: str
    args: dict[str, Json] = field(default_factory=dict)

    def to_json(self) -> dict[str, Json]:
        return {"op": self.name, "args": self.args}

    @classmethod
    def from_json(cls, raw: dict[str, Json]) -> Op:
        return cls(raw["op"], dict(raw.get("args", {})))

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.args.items() if k != "rules")
        return f"{self.name}({args})"


@dataclass(frozen=True)
class AttrChange:
    """One attribute of a resource, before and after; ``extra``: structured detail written
    beside them in JSON (a port map edit's ``added`` and ``removed`` maps)."""

    field: str
    before: Json
    after: Json
    extra: dict[str, Json] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Json]:
        return {"field": self.field, "before": self.before, "after": self.after, **self.extra}

    @classmethod
    def from_json(cls, raw: dict[str, Json]) -> AttrChange:
        return cls(raw["field"], raw["before"], raw["after"],
                   {k: v for k, v in raw.items() if k not in ("field", "before", "after")})


def port_map_json(text: str) -> dict[str, Json]:
    """Read one port map as plans spell it (``8080/tcp->80``, ``53/udp->53@127.0.0.1``) into
    its fields: ``{"host": 8080, "protocol": "tcp", "to": 80, "host_ip": null}``."""
    hostpart, _, rest = text.partition("->")
    host, _, proto = hostpart.partition("/")
    to, _, host_ip = rest.partition("@")
    return {"host": int(host), "protocol": proto, "to": int(to), "host_ip": host_ip or None}


def ports_attr(before: list[str] | None, after: list[str] | None) -> AttrChange:
    """Say how an allocation's port maps change: both lists (sorted), and in JSON the maps
    ``added`` and ``removed`` as fields (SPEC §13)."""
    old, new = set(before or ()), set(after or ())
    return AttrChange("ports", before, after, {
        "added": [port_map_json(m) for m in sorted(new - old)],
        "removed": [port_map_json(m) for m in sorted(old - new)]})


@dataclass(frozen=True)
class FlowMatch:
    """Which conntrack entries are the flows of an impacted item (``planner.impact``).

    Without ``port``: flows one of ``addresses`` started, or that it answers (the reply
    comes from it: connections to it, DNATed ones included). With ``port`` (protocol,
    host port): flows to that host port that a DNAT sent to one of ``addresses``.
    Not saved with the plan: flows are counted where a plan is made.
    """

    addresses: tuple[str, ...] = ()
    port: tuple[str, int] | None = None


#: what an impact entry is about (``Impact.type``), in words: (one, many)
IMPACT_TYPES = {"alloc": ("alloc", "allocs"), "container": ("container", "containers"),
                "port_map": ("port map", "port maps")}


def impact_noun(kind: str, n: int = 1) -> str:
    """Name an impact type in words: ``alloc``/``allocs``, ``port map``/``port maps``."""
    one, many = IMPACT_TYPES.get(kind, (kind, kind + "s"))
    return one if n == 1 else many


def impact_detail(items: tuple[Impact, ...]) -> str:
    """Count the impacted items of each type: ``2 allocs, 1 port map``."""
    by_type = Counter(i.type for i in items)
    return ", ".join(f"{n} {impact_noun(t, n)}" for t, n in sorted(by_type.items()))


@dataclass(frozen=True)
class Impact:
    """Something a change disrupts: an allocation that loses connectivity, a container
    disconnected from a Docker network, a port map closed or moved (SPEC §8).

    ``flows``: the established flows through it (TCP established, UDP answered; the
    probes' own source ports left out) when they were counted, None when not. They move
    on their own, so they are no part of the plan's work (``Plan.same_work``).
    """

    type: str
    name: str
    effect: str
    addresses: tuple[str, ...] = ()
    flows: int | None = None
    match: FlowMatch | None = field(default=None, compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.type, self.name)

    def to_json(self) -> dict[str, Json]:
        return {"type": self.type, "name": self.name, "effect": self.effect,
                "addresses": list(self.addresses), "flows": self.flows}

    @classmethod
    def from_json(cls, raw: dict[str, Json]) -> Impact:
        flows = raw.get("flows")
        return cls(str(raw["type"]), str(raw["name"]), str(raw.get("effect", "")),
                   tuple(str(a) for a in raw.get("addresses") or ()),
                   flows if isinstance(flows, int) and not isinstance(flows, bool) else None)


@dataclass(frozen=True)
class Change:
    kind: str
    name: str
    action: Action
    reason: str = ""
    attrs: tuple[AttrChange, ...] = ()
    ops: tuple[Op, ...] = ()
    source: str | None = None
    warnings: tuple[str, ...] = ()
    #: what it disrupts (``planner.impact``); empty for what disrupts nothing
    impact: tuple[Impact, ...] = ()
    #: the resource it sits in, for people (``bridge/apps`` for an allocation): identical
    #: changes are grouped by it (``~ 40 allocs on bridge apps``); not part of the work
    within: str | None = None

    @property
    def address(self) -> str:
        return f"{self.kind}/{self.name}"

    def to_json(self) -> dict[str, Json]:
        return {
            "kind": self.kind, "name": self.name, "action": self.action.value,
            "reason": self.reason, "source": self.source,
            "attrs": [a.to_json() for a in self.attrs],
            "ops": [o.to_json() for o in self.ops],
            "warnings": list(self.warnings),
            "impact": [i.to_json() for i in self.impact],
            **({"within": self.within} if self.within else {}),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Json]) -> Change:
        return cls(raw["kind"], raw["name"], Action(raw["action"]), raw.get("reason", ""),
                   tuple(AttrChange.from_json(a) for a in raw.get("attrs", [])),
                   tuple(Op.from_json(o) for o in raw.get("ops", [])), raw.get("source"),
                   tuple(raw.get("warnings", [])),
                   # plans saved before impact was planned have none
                   tuple(Impact.from_json(i) for i in raw.get("impact") or ()),
                   raw.get("within") if isinstance(raw.get("within"), str) else None)


def _files(raw: Json) -> tuple[tuple[str, str], ...]:
    """Return a saved plan's ``files``: (path, sha256) pairs of strings, else ValueError naming
    it."""
    if not isinstance(raw, list) or not all(
            isinstance(f, dict) and isinstance(f.get("path"), str)
            and isinstance(f.get("sha256"), str) for f in raw):
        raise ValueError("files: want a list of {path, sha256} strings")
    return tuple((str(f["path"]), str(f["sha256"])) for f in raw if isinstance(f, dict))


def _scope(raw: Json) -> dict[str, Json]:
    if not isinstance(raw, dict) or not all(
            isinstance(raw.get(k), str | None) for k in ("id", "netns")):
        raise ValueError("scope: want a mapping of id and netns strings")
    return {k: v for k, v in raw.items() if k in ("id", "netns") and v is not None}


@dataclass(frozen=True)
class Plan:
    changes: tuple[Change, ...] = ()
    #: hash of the live view of every managed object the plan was computed from
    live_fingerprint: str = ""
    #: sha256 of each desired-state file the plan was computed from
    files: tuple[tuple[str, str], ...] = ()
    warnings: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()  # e.g. Docker unreachable: those resources are not planned
    #: the options it was planned with (prune, adopt, force_replace): `apply FILE` reuses them
    options: dict[str, Json] = field(default_factory=dict)
    #: where it was planned: ``id``, the network namespace's identity (``nsfs.current_id``),
    #: and ``netns``, the name given with --netns (when the CLI saved it): `apply FILE`
    #: refuses it in another namespace
    scope: dict[str, Json] = field(default_factory=dict)

    @property
    def actionable(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.action not in (Action.NOOP, Action.CONFLICT))

    @property
    def conflicts(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.action is Action.CONFLICT)

    @property
    def has_changes(self) -> bool:
        return bool(self.actionable)

    @property
    def impacted(self) -> tuple[Impact, ...]:
        """Every item the plan disrupts, once each (one alloc can be disrupted by several
        changes: its own and its subnet's); what ``--max-disruption`` counts."""
        seen: dict[tuple[str, str], Impact] = {}
        for c in self.actionable:
            for i in c.impact:
                seen.setdefault(i.key, i)
        return tuple(seen.values())

    def summary(self) -> dict[str, int]:
        counts = Counter(c.action for c in self.changes)
        return {
            "create": counts[Action.CREATE], "update": counts[Action.UPDATE],
            "replace": counts[Action.REPLACE], "delete": counts[Action.DELETE],
            "conflict": counts[Action.CONFLICT], "unchanged": counts[Action.NOOP],
        }

    def to_json(self) -> dict[str, Json]:
        return {
            "format_version": FORMAT_VERSION,
            "changes": [c.to_json() for c in self.changes if c.action is not Action.NOOP],
            "summary": self.summary(),
            "live_fingerprint": self.live_fingerprint,
            "files": [{"path": p, "sha256": h} for p, h in self.files],
            "warnings": list(self.warnings),
            "errors": list(self.errors),
            "options": self.options,
            **({"scope": self.scope} if self.scope else {}),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Json]) -> Plan:
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported plan format {raw.get('format_version')!r}")
        return cls(tuple(Change.from_json(c) for c in raw["changes"]), raw["live_fingerprint"],
                   _files(raw.get("files", [])),
                   tuple(raw.get("warnings", [])), tuple(raw.get("errors", [])),
                   dict(raw.get("options", {})), _scope(raw.get("scope", {})))

    def same_work(self, other: Plan) -> bool:
        """Return True when both plans would run the same ops on the same live state.

        Where a resource was declared (``source``) and what it sits in (``within``) are for
        people and may be
        spelled differently (relative vs absolute path): they are not compared. Nor is
        the impact: it follows from the files and the live state the fingerprint
        covers, but for its flow counts, which move on their own (and a plan saved
        before impact was planned has none).
        """
        def work(plan: Plan) -> list[dict[str, Json]]:
            return [{k: v for k, v in c.to_json().items()
                     if k not in ("source", "impact", "within")}
                    for c in plan.changes if c.action is not Action.NOOP]

        return work(self) == work(other) and self.live_fingerprint == other.live_fingerprint


def fingerprint(view: Json) -> str:
    """Return a stable hash of a JSON-able value (sorted keys)."""
    blob = json.dumps(view, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()

