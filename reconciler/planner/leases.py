"""Leases in a plan (pure): which value wins, where each came from, the table the plan needs.

Per value (SPEC §11): the declared one; else a valid lease (live drift is healed
back to it); else, while there is no lease for it yet, the live value (an
upgrade moves nothing); else a new pick. The kind planners (``allocs/ipam``,
``addrspace``, ``hostlinks``, ``allocs/plan``) ask :meth:`Picks.lease` and say
what they chose with :meth:`Picks.record`; the plan carries :meth:`Picks.table`
(what the engine writes before the first op) and :meth:`Picks.to_json` (the
``picks`` field of ``plan``/``show --output json``).

See docs/decisions/041-leases.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from reconciler.domain.leases import DECLARED, LEASE, LIVE, NEW, Table

T = TypeVar("T")

_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


def valid_mac(value: object) -> bool:
    """Tell whether a leased or live MAC may be kept: six lower-case octets, not all zero."""
    return isinstance(value, str) and _MAC.fullmatch(value) is not None \
        and value != "00:00:00:00:00:00"


def choose(declared: T | None, lease: T | None, live: T | None, *,
           valid: Callable[[T], bool], pick: Callable[[], T | None]
           ) -> tuple[T | None, str, bool]:
    """Choose one value by precedence: (value, where it came from, whether a lease was dropped).

    ``valid`` says whether a leased or live value may be used here (in range, not taken);
    ``pick`` makes a new one (None: none left). A live value counts only while there is
    no lease: once leased, the lease is what the host is healed back to.
    """
    if declared is not None:
        return declared, DECLARED, False
    if lease is not None:
        if valid(lease):
            return lease, LEASE, False
        return pick(), NEW, True
    if live is not None and valid(live):
        return live, LIVE, False
    return pick(), NEW, False


class Picks:
    """What one plan picked: each value with its origin, and the lines that explain changes."""

    def __init__(self, table: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.read: Table = {k: dict(v) for k, v in (table or {}).items()}
        self.values: dict[str, dict[str, tuple[Any, str]]] = {}
        #: plan lines: a lease re-picked (invalid now, or displaced by a declared value)
        self.notes: list[str] = []
        #: alloc id -> why a lease of it cannot be used now (a leased host port held by a
        #: socket): the allocation is a conflict, its leases kept
        self.blocked: dict[str, str] = {}

    def lease(self, address: str, field: str) -> Any | None:
        """Return the leased value of ``address``'s ``field`` (as stored), or None."""
        return self.read.get(address, {}).get(field)

    def leased(self, field: str) -> dict[str, Any]:
        """Return ``{address: value}`` of every lease of ``field``."""
        return {a: f[field] for a, f in self.read.items() if field in f}

    def record(self, address: str, field: str, value: Any, source: str) -> None:
        self.values.setdefault(address, {})[field] = (value, source)

    def source(self, address: str, field: str) -> str | None:
        got = self.values.get(address, {}).get(field)
        return None if got is None else got[1]

    def dropped(self, address: str, field: str, why: str) -> None:
        """Say in the plan that a lease of ``address`` is given up (re-picked) and why."""
        kind, _, name = address.partition("/")
        old = self.lease(address, field)
        self.notes.append(f"{kind.replace('_', ' ')} {name}: leased {field} {old} {why}: "
                          "re-picked")

    def table(self, keep: Iterable[str] = ()) -> Table:
        """Return the lease table after this plan: every value picked (not declared), and the
        leases of ``keep`` (resources kept undeclared, ``--no-prune``) as they were."""
        out: Table = {}
        for address, fields in self.values.items():
            got = {f: v for f, (v, src) in fields.items() if src != DECLARED and v is not None}
            if got:
                out[address] = got
        for address in keep:
            if address in self.read and address not in out:
                out[address] = dict(self.read[address])
        return out

    def to_json(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Return ``{address: {field: {"value": v, "from": source}}}``, sorted."""
        return {a: {f: {"value": v, "from": src} for f, (v, src) in sorted(fields.items())}
                for a, fields in sorted(self.values.items())}


__all__ = ["DECLARED", "LEASE", "LIVE", "NEW", "Picks", "choose", "valid_mac"]
