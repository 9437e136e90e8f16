"""Make text output scale: lines fitted to a width, lists elided with a count, identical
changes grouped, repeated warnings said once (SPEC §13).

``--output json`` keeps everything; this is for people and CI logs. See
docs/decisions/050-output-that-scales.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reconciler.domain.plan import Change

#: no text line longer than this (SPEC §13: "about 200 characters")
WIDTH = 200
#: identical changes to at least this many resources are one block with a count
GROUP_MIN = 3
#: names listed before the rest is counted (``a, b, c, … (+37 more)``)
NAMES_SHOWN = 5
#: impact lines shown under one change before the rest is counted
IMPACT_SHOWN = 5


#: a text is a list (elided by items) when it has this many comma-separated parts or more,
#: each at most :data:`ITEM_MAX` characters but the first and last (which carry the words
#: around the list); a sentence with commas is cut by characters instead
LIST_MIN, ITEM_MAX = 6, 60


def _is_list(parts: list[str]) -> bool:
    return len(parts) >= LIST_MIN and all(len(p) <= ITEM_MAX for p in parts[1:-1])


def fit(text: str, width: int = WIDTH) -> str:
    """Fit ``text`` into ``width`` characters: a comma-separated list keeps what fits and
    counts the rest (``a, b, … (+12 more)``); anything else is cut with the count of
    characters left out."""
    if len(text) <= width:
        return text
    parts = text.split(", ")
    if _is_list(parts):
        kept: list[str] = []
        used = 0
        for i, part in enumerate(parts):
            tail = len(f", … (+{len(parts) - i} more)")
            if used + len(part) + 2 + tail > width:
                break
            kept.append(part)
            used += len(part) + 2
        if kept:
            return ", ".join(kept) + f", … (+{len(parts) - len(kept)} more)"
    cut = max(0, width - len(f"… (+{len(text)} chars)"))
    return text[:cut] + f"… (+{len(text) - cut} chars)"



def names(items: Sequence[str], shown: int = NAMES_SHOWN) -> str:
    """List names, the first ``shown`` and a count of the rest: ``a, b, c, … (+37 more)``."""
    head = ", ".join(items[:shown])
    return head + (f", … (+{len(items) - shown} more)" if len(items) > shown else "")


def plural(kind: str, n: int) -> str:
    """Say ``1 alloc`` / ``40 allocs`` (``docker_network`` as ``docker networks``)."""
    word = kind.replace("_", " ")
    return f"{n} {word}" + ("" if n == 1 else "s")


@dataclass(frozen=True)
class Group:
    """Identical changes to several resources: one block with a count."""

    changes: tuple[Change, ...]

    @property
    def first(self) -> Change:
        return self.changes[0]

    def head(self) -> str:
        """Say ``40 allocs on bridge apps`` (``within`` spelled as words)."""
        c = self.first
        where = f" on {c.within.replace('/', ' ', 1)}" if c.within else ""
        return f"{plural(c.kind, len(self.changes))}{where}"


def _same(c: Change) -> object:
    """What must be equal for changes to be shown as one: all but the name and source, and
    of the impact (on the resource itself, without established flows) all but its
    addresses."""
    return (c.kind, c.action, c.reason, c.within, c.warnings,
            tuple((a.field, repr(a.before), repr(a.after)) for a in c.attrs),
            tuple((i.type, i.effect, i.flows) for i in c.impact))


def groupable(c: Change) -> bool:
    """Tell whether ``c`` may be shown in a group: its impact, if any, is on itself only and
    cuts no established flow (one that does is shown on its own, with its addresses)."""
    return all(i.type == c.kind and i.name == c.name and not i.flows for i in c.impact)


def blocks(changes: Iterable[Change], *, group: bool) -> list[Change | Group]:
    """Return the changes to show, in order; with ``group``, identical changes to
    :data:`GROUP_MIN` or more resources (:func:`groupable`) as one :class:`Group` where the
    first of them stands."""
    shown = list(changes)
    if not group:
        return list(shown)
    by_key: dict[object, list[Change]] = {}
    for c in shown:
        if groupable(c):
            by_key.setdefault(_same(c), []).append(c)
    out: list[Change | Group] = []
    done: set[int] = set()
    for c in shown:
        if id(c) in done:
            continue
        same = by_key.get(_same(c), []) if groupable(c) else []
        if len(same) >= GROUP_MIN:
            out.append(Group(tuple(same)))
            done.update(id(x) for x in same)
        else:
            out.append(c)
    return out


#: a warning about one resource: ``alloc 'web' (f.yaml:3) ports[0]: …``, ``veth vr12ab: …``
_ABOUT = re.compile(r"^(?P<kind>alloc|subnet|bridge|veth|docker network) '?(?P<name>[^\s':]+)'?"
                    r"(?P<where> \([^)]*\))?(?P<part> ports\[\d+\])?: (?P<rest>.+)$", re.S)


def warning_lines(warnings: Sequence[str], prefix: str = "warning", *,
                  whole: bool = False) -> list[str]:
    """Say each warning once: one said of several resources (``alloc 'a' ports[0]: host_ip
    … is not an address``) once, with the resources named and counted. ``whole``: lines
    are not fitted (errors: each is one complete line, however long)."""
    def line(text: str) -> str:
        return text if whole else fit(text)

    groups: dict[tuple[str, str], list[str]] = {}
    order: list[tuple[str, str] | str] = []
    for w in dict.fromkeys(warnings):
        m = _ABOUT.match(w)
        if m is None:
            order.append(w)
            continue
        key = (m["kind"], m["rest"])
        if key not in groups:
            order.append(key)
        groups.setdefault(key, []).append(m["name"] + (m["part"] or ""))
    out = []
    for item in order:
        if isinstance(item, str):
            out.append(line(f"{prefix}: {item}"))
            continue
        kind, rest = item
        who = groups[item]
        if len(who) == 1:
            original = next(w for w in warnings if (m := _ABOUT.match(w)) is not None
                            and (m["kind"], m["rest"]) == item)
            out.append(line(f"{prefix}: {original}"))
        else:
            head, tail = f"{prefix} ({plural(kind, len(who))}: ", f"): {rest}"
            room = max(WIDTH - len(head) - len(tail), 40)
            listed = names(who)
            if len(listed) > room:  # fewer names, counted right
                listed = fit(", ".join(who), room)
            out.append(line(head + listed + tail))
    return out
