"""Leases: the values the reconciler picked, and where each value of a plan came from.

A lease table maps a resource (``alloc/web``, ``bridge/br0``, ``subnet/apps``,
``docker_network/ci``) to its leased fields (``address``, ``address6``, ``mac``,
``port tcp->80``, ``cidr``, ``cidr6``, ``subnet``, ``subnet6``), each a string or
an int. ``leases.json`` in the scope's state directory carries it
(``engine/leases``); the planner reads it from ``LiveState.leases`` and puts the
table the plan needs in ``Plan.leases``.

Pure: no I/O, nothing from above ``reconciler.domain``.

See docs/decisions/041-leases.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FORMAT = 1
FILENAME = "leases.json"

#: where a value came from, in precedence order
DECLARED, LEASE, LIVE, NEW = "declared", "lease", "live", "new"
SOURCES = (DECLARED, LEASE, LIVE, NEW)

#: the kinds a lease can belong to (``reconcile release KIND/ID``)
KINDS = ("alloc", "bridge", "subnet", "docker_network")

Table = dict[str, dict[str, Any]]


class LeaseError(ValueError):
    """A lease record this version cannot read."""


def port_field(protocols: tuple[str, ...], to: int, host_ip: object | None) -> str:
    """Name the lease field of an ``auto`` port map: ``port tcp->80``, ``port tcp+udp->53@::1``."""
    return f"port {'+'.join(protocols)}->{to}" + (f"@{host_ip}" if host_ip is not None else "")


def to_json(table: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Return the record of ``table`` (sorted, empty resources left out)."""
    return {"format": FORMAT,
            "leases": {k: dict(sorted(v.items())) for k, v in sorted(table.items()) if v}}


def from_json(raw: Any) -> Table:
    """Read a lease record; LeaseError saying what is wrong with it."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise LeaseError(f"not a lease record of format {FORMAT} (format {got!r})")
    leases = raw.get("leases")
    if not isinstance(leases, dict):
        raise LeaseError("its 'leases' is not a mapping")
    out: Table = {}
    for key, fields in leases.items():
        kind, _, name = str(key).partition("/")
        if kind not in KINDS or not name or not isinstance(fields, dict):
            raise LeaseError(f"entry {key!r} is not KIND/NAME with a mapping of fields")
        for f, v in fields.items():
            if not isinstance(f, str) or isinstance(v, bool) or not isinstance(v, str | int):
                raise LeaseError(f"entry {key!r}: field {f!r} is not a string or number")
        out[key] = dict(fields)
    return out


def released(table: Mapping[str, Mapping[str, Any]], address: str) -> Table:
    """Return ``table`` without the leases of ``address`` (``KIND/NAME``)."""
    return {k: dict(v) for k, v in table.items() if k != address}
