"""State shared by the kind planners during one (pure) planning pass."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from reconciler.domain.live import LiveNeighbour, LiveState
from reconciler.domain.model import DesiredState
from reconciler.planner import firewall
from reconciler.planner.firewall import RuleSet
from reconciler.planner.leases import Picks


@dataclass(frozen=True)
class PlanOptions:
    prune: bool = True
    #: "kind/name" addresses the user allows us to take over (``--adopt``)
    adopt: frozenset[str] = frozenset()
    #: replace Docker networks with containers attached (disconnect, re-create, reconnect)
    force_replace: bool = False


def index_neighbours(neighbours: Iterable[LiveNeighbour]
                     ) -> dict[tuple[int, str], list[tuple[int, LiveNeighbour]]]:
    """Index neighbour entries by (link index, address), each with its place in ``neighbours``:
    looked up once per allocation (or deletion), a scan of all of them each time was
    quadratic."""
    out: dict[tuple[int, str], list[tuple[int, LiveNeighbour]]] = {}
    for position, n in enumerate(neighbours):
        out.setdefault((n.index, n.address), []).append((position, n))
    return out


@dataclass
class PlanContext:
    desired: DesiredState
    live: LiveState
    options: PlanOptions
    rules4: RuleSet = field(default_factory=lambda: RuleSet(4))
    rules6: RuleSet = field(default_factory=lambda: RuleSet(6))
    #: sysctl key -> value the desired state needs (never reverted on prune)
    sysctls: dict[str, str] = field(default_factory=dict)
    #: canonical live view of every managed object, for the saved-plan fingerprint
    observed: dict[str, Any] = field(default_factory=dict)
    #: (link, address) pairs some change already accounts for
    claimed_addresses: set[tuple[str, str]] = field(default_factory=set)
    #: "kind/name" of resources blocked by a conflict (dependants are not planned)
    blocked: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)
    #: resources that could not be planned (e.g. Docker unreachable): the rest still applies,
    #: the run exits non-zero
    errors: list[str] = field(default_factory=list)
    #: problems that make the whole plan unusable (address range exhausted, port clash)
    fatal: list[str] = field(default_factory=list)
    #: "kind/name" -> what its declared prefixes overlap on the host (planner.addrspace)
    overlaps: dict[str, str] = field(default_factory=dict)
    #: "kind/name" -> {field: pool} of the prefixes picked for ``auto``
    picked: dict[str, dict[str, str]] = field(default_factory=dict)
    #: the picked values: leased, kept from live or new, each with its origin (SPEC §11)
    picks: Picks = field(default_factory=Picks)
    _live_rules: dict[int, dict[str, list[tuple[str, str]]]] = field(default_factory=dict)
    _neighbours: dict[tuple[int, str], list[tuple[int, LiveNeighbour]]] | None = None

    def live_rules(self, family: int) -> dict[str, list[tuple[str, str]]]:
        """Index the live rules by owner (``alloc=ID``), once per plan: every kind asks."""
        if family not in self._live_rules:
            live = self.live.firewall4 if family == 4 else self.live.firewall6
            self._live_rules[family] = firewall.live_by_owner(live)
        return self._live_rules[family]

    def neighbours_of(self, index: int, addresses: set[str]) -> list[LiveNeighbour]:
        """Return the live neighbour entries on link ``index`` for ``addresses``, in observation
        order; indexed once per plan (every allocation asks: a scan of the whole table for
        each was quadratic, ~30 ms of a plan of 500 and growing fourfold per doubling)."""
        if self._neighbours is None:
            self._neighbours = index_neighbours(self.live.neighbours)
        found = sorted(entry for a in addresses for entry in self._neighbours.get((index, a), ()))
        return [n for _, n in found]

    def adopted(self, kind: str, name: str) -> bool:
        return f"{kind}/{name}" in self.options.adopt
