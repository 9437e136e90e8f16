"""The impact of a plan in words (SPEC §8): under each change, and one line for the plan."""

from __future__ import annotations

from reconciler.domain.plan import Change, Impact, Plan, impact_detail, impact_noun


def flows_phrase(flows: int | None) -> str:
    """Say ``2 established flows``; empty when they were not counted."""
    if flows is None:
        return ""
    if flows == 0:
        return "no established flows"
    return f"{flows} established flow{'s' if flows != 1 else ''}"


def line(i: Impact) -> str:
    """Describe an impact in one line: ``alloc web: deleted: loses connectivity (10.78.0.10);
    2 established flows``"""
    text = f"{impact_noun(i.type)} {i.name}: {i.effect}"
    if i.addresses:
        text += f" ({', '.join(i.addresses)})"
    flows = flows_phrase(i.flows)
    return text + (f"; {flows}" if flows else "")


def change_lines(c: Change) -> list[str]:
    """Write the lines under one change of the text plan."""
    return [f"      impact: {line(i)}" for i in c.impact]


def summary(plan: Plan) -> str | None:
    """Sum up the impact: ``Impact: 3 items disrupted (2 allocs, 1 port map).``, or None.

    No total of flows: one flow is counted under each item it goes through (an
    allocation and its port map), so a sum would count it twice.
    """
    items = plan.impacted
    if not items:
        return None
    return (f"Impact: {len(items)} item{'s' if len(items) != 1 else ''} disrupted "
            f"({impact_detail(items)}).")
