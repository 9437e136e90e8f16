"""The flows a plan's impact names, and ``--max-disruption`` (SPEC §8).

Conntrack is read only for a plan that disrupts something, and only the entries of
what it disrupts (``planner.impact.flow_query``: kernel-filtered dumps by address and
port), so a plan that disrupts nothing costs no netfilter socket. A table that cannot
be read leaves the flows uncounted (``Impact.flows`` None): the impact itself stands.

See docs/decisions/020-impact-before-it-happens.md.
"""

from __future__ import annotations

import dataclasses
import logging

from reconciler.domain.errors import DriverError, ReconcilerError
from reconciler.domain.live import LiveFlow, LiveState
from reconciler.domain.plan import Plan, impact_detail
from reconciler.drivers.netlink.conntrack import live_flow
from reconciler.engine.handles import HostHandles
from reconciler.planner import impact

log = logging.getLogger("reconciler")


class DisruptionError(ReconcilerError):
    """The plan disrupts more items than ``--max-disruption`` allows: nothing was changed.

    ``plan`` is the refused plan (what the command shows)."""

    def __init__(self, message: str, plan: Plan) -> None:
        super().__init__(message)
        self.plan = plan


def count_flows(plan: Plan, live: LiveState, handles: HostHandles) -> tuple[Plan, LiveState]:
    """Count the flows of ``plan``'s impact; return it, and ``live`` with those flows."""
    query = impact.flow_query(plan)
    if not query:
        return plan, live
    try:
        found: list[LiveFlow] = []
        for family, (addresses, ports) in query.items():
            found += [f for e in handles.conntrack.flows(family, addresses, ports)
                      if (f := live_flow(e)) is not None]
    except (DriverError, OSError) as exc:
        log.debug("flows not counted: %s", exc)
        return plan, live
    live = dataclasses.replace(live, flows=tuple(found))
    return impact.with_flows(plan, live), live


def refusal(plan: Plan, limit: int | None) -> str | None:
    """Return the one line that refuses ``plan`` under ``--max-disruption limit``, or None."""
    items = plan.impacted
    if limit is None or len(items) <= limit:
        return None
    return (f"the plan disrupts {len(items)} item{'s' if len(items) != 1 else ''} "
            f"({impact_detail(items)}), "
            f"more than --max-disruption {limit}: refused, nothing changed")


def check(plan: Plan, limit: int | None) -> None:
    """Raise ``DisruptionError`` when ``plan`` disrupts more than ``limit`` items."""
    line = refusal(plan, limit)
    if line is not None:
        raise DisruptionError(line, plan)
