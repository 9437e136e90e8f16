"""``reconcile graph``: the topology as Graphviz DOT (pure), the convention ``terraform
graph`` set: ``reconcile graph PATH | dot -Tpng > topology.png``.

One node per resource: a cluster per bridge holding it, the subnets it serves and
their allocations (addresses, MAC, port maps), and one for Docker networks with their
containers. What a node says comes from the host when the object is there
(``ui.topology``: the host's truth), otherwise from the plan's own attributes (what
apply would make: the addresses and host ports the planner picked), otherwise from
the files. With files, nodes declared but not on the host yet are dashed and owned
objects no file declares are dotted; with ``--plan`` each node is filled in its
action's colour, its label starts with the plan's symbol (``+ ~ - -/+ !``), a
legend spells them, and a note lists the changes that are not topology (firewall
transactions, sysctls, orphan veths).

See docs/decisions/033-show-and-graph-read-the-host.md.
"""

from __future__ import annotations

import html
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field

from reconciler.domain.model import DesiredState
from reconciler.domain.plan import Action, Change, Json, Plan
from reconciler.ui.topology import Topology

#: (fill, border) per action: the plan text's colours (``ui.render``), light enough to read on
STYLE = {
    Action.CREATE: ("#d8f5d0", "#2e7d32"),
    Action.UPDATE: ("#fff1c2", "#a67c00"),
    Action.REPLACE: ("#f4d9f7", "#8e24aa"),
    Action.DELETE: ("#fad4d4", "#c62828"),
    Action.CONFLICT: ("#ff9e9e", "#b00000"),
}
WORDS = {Action.CREATE: "create", Action.UPDATE: "update", Action.REPLACE: "replace",
         Action.DELETE: "delete", Action.CONFLICT: "conflict (blocks apply)"}
KINDS = ("bridge", "subnet", "alloc", "docker_network")
SHAPES = {"bridge": "box3d", "subnet": "box", "alloc": "box", "docker_network": "cylinder",
          "container": "component"}
#: facts of a change's attributes that say nothing about the topology
_QUIET_ATTRS = frozenset({"hairpin", "masquerade", "internal"})
_BARE_ATTRS = frozenset({"address", "address6", "ports", "cidr", "cidr6"})


def quote(text: str) -> str:
    """Quote a DOT ID: quotes escaped, no raw newline.

    In an ID the lexer keeps every backslash that does not escape a quote, so none can
    be written safely (a trailing one would escape the closing quote): IDs spell it
    ``/``. No name the reconciler owns or Docker accepts has one; labels keep it.
    """
    clean = text.replace("\\", "/").replace('"', '\\"')
    return '"' + clean.replace("\r", " ").replace("\n", " ") + '"'


def _escaped(text: str) -> str:
    """Escape text inside a label (an escString, where ``\\\\`` is one backslash and ``\\l`` a
    break): nothing a name holds can end the string or add an escape of its own."""
    return (text.replace("\\", "\\\\").replace('"', '\\"')
            .replace("\r", " ").replace("\n", " "))


def text_label(text: str) -> str:
    """Make a one-line label."""
    return f'"{_escaped(text)}"'


def _label(lines: Iterable[str]) -> str:
    """Make a label of left-justified lines."""
    return '"' + "".join(_escaped(line) + "\\l" for line in lines) + '"'


def _fmt(value: Json) -> list[str]:
    if value is None:
        return ["(none)"]
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, list):
        return [str(v).replace("->", " → ") for v in value] or ["(none)"]
    return [str(value).replace("->", " → ")]


@dataclass
class Node:
    kind: str
    name: str
    facts: list[str] = field(default_factory=list)
    #: on the host (owned), declared in the files
    live: bool = False
    declared: bool = False
    action: Action = Action.NOOP
    #: which bridge's cluster it sits in; parent node id for its edge
    cluster: str | None = None
    parent: str | None = None

    @property
    def id(self) -> str:
        return f"{self.kind}/{self.name}"


@dataclass
class Graph:
    nodes: dict[str, Node] = field(default_factory=dict)

    def node(self, kind: str, name: str) -> Node:
        key = f"{kind}/{name}"
        if key not in self.nodes:
            self.nodes[key] = Node(kind, name)
        return self.nodes[key]


def _live_nodes(g: Graph, topo: Topology) -> None:
    for b in topo.bridges.values():
        n = g.node("bridge", b.name)
        n.live, n.cluster = True, b.name
        n.facts = [f"mtu {b.mtu}" + ("" if b.up else ", down"), f"mac {b.mac or '(none)'}"]
    for s in topo.subnets.values():
        n = g.node("subnet", s.name)
        n.live, n.cluster = True, s.bridge
        n.parent = f"bridge/{s.bridge}" if s.bridge else None
        n.facts = [*s.cidrs, *(f"gateway {gw}" for gw in s.gateways)]
    for a in topo.allocs.values():
        n = g.node("alloc", a.id)
        n.live, n.cluster = True, a.bridge
        n.parent = (f"subnet/{a.subnet}" if a.subnet else
                    f"bridge/{a.bridge}" if a.bridge else None)
        n.facts = [*a.addresses, f"mac {a.mac or '(none)'}",
                   *(p.text.replace("->", " → ") for p in a.ports)]
        if a.veth is None:
            n.facts.append("no veth")
    for key, d in topo.docker_networks.items():
        n = g.node("docker_network", key)
        n.live, n.cluster = True, "docker"
        n.facts = [f"id {d.id[:12]}", *d.subnets,
                   f"{d.container_count} container{'s' if d.container_count != 1 else ''}"]
        for c in d.containers:
            cn = g.node("container", f"{key}/{c.name}")
            cn.live, cn.cluster, cn.parent = True, "docker", n.id
            cn.facts = list(c.addresses)


def _declared_nodes(g: Graph, desired: DesiredState) -> None:
    """Draw what the files say, for what the host does not have (yet): facts only if empty."""
    for b in desired.bridges.values():
        n = g.node("bridge", b.name)
        n.declared, n.cluster = True, b.name
        if not n.live:
            n.facts = [f"mtu {b.mtu}"] if b.mtu else []
    for s in desired.subnets.values():
        n = g.node("subnet", s.name)
        n.declared, n.cluster, n.parent = True, s.bridge, f"bridge/{s.bridge}"
        if not n.live:
            n.facts = [str(p) for p in (s.prefix, s.prefix6) if p is not None]
    for a in desired.allocs.values():
        n = g.node("alloc", a.id)
        sub = desired.subnets.get(a.subnet)
        n.declared, n.parent = True, f"subnet/{a.subnet}"
        n.cluster = sub.bridge if sub is not None else n.cluster
        if not n.live:
            n.facts = [str(x) for x in (a.address, a.address6) if x is not None]
            n.facts += [f"{p.host or 'auto'}/{p.protocol} → {p.to}"
                        + (f" @{p.host_ip}" if p.host_ip else "") for p in a.ports]
    for d in desired.docker_networks.values():
        n = g.node("docker_network", d.name)
        n.declared, n.cluster = True, "docker"
        if not n.live:
            n.facts = [str(x) for x in (d.subnet or d.auto, d.subnet6 or d.auto6)
                       if x is not None]


def _plan_facts(g: Graph, plan: Plan) -> None:
    """Put each change on its node: the planned values where the host has none, what an
    update changes, why a conflict blocks (the legend lists the changes that are no node)."""
    for c in plan.changes:
        if c.kind not in KINDS:
            continue
        n = g.node(c.kind, c.name)
        n.action = c.action
        if c.kind == "docker_network":
            n.cluster = "docker"
        attrs = [a for a in c.attrs if a.field not in _QUIET_ATTRS]
        if not n.live and c.action in (Action.CREATE, Action.REPLACE):
            # where an alloc or subnet sits the edge says; addresses, prefixes and port
            # maps speak for themselves
            edge = ("subnet", "bridge") if c.kind in ("alloc", "subnet") else ()
            n.facts = [v if a.field in _BARE_ATTRS else f"{a.field} {v}"
                       for a in attrs if a.after is not None and a.field not in edge
                       for v in _fmt(a.after)]
        elif c.action in (Action.UPDATE, Action.REPLACE):
            for a in attrs:
                if a.field == "ports" and isinstance(a.before, list) and isinstance(a.after, list):
                    # the maps it loses give way to the edit: old ⇒ new (SPEC §13)
                    gone = [m for m in a.before if m not in a.after]
                    new = [m for m in a.after if m not in a.before]
                    n.facts = [f for f in n.facts if f not in _fmt(gone)]
                    n.facts.append(f"ports: {', '.join(_fmt(gone))} ⇒ {', '.join(_fmt(new))}")
                else:
                    n.facts.append(f"{a.field}: {' '.join(_fmt(a.before))} → "
                                   f"{' '.join(_fmt(a.after))}")
        elif c.action is Action.CONFLICT or (c.action is Action.NOOP and not n.live
                                             and c.reason):
            # why apply cannot (a conflict) or will not (blocked by one) touch it
            n.facts += textwrap.wrap(c.reason, 60)


def build(topo: Topology, desired: DesiredState | None = None,
          plan: Plan | None = None) -> Graph:
    """Build the nodes of the graph: the live topology, then the declared one over it, then
    the plan's changes (where the plan says what the host will get)."""
    g = Graph()
    _live_nodes(g, topo)
    if desired is not None:
        _declared_nodes(g, desired)
    if plan is not None:
        _plan_facts(g, plan)
    return g


def _node_line(n: Node, *, with_plan: bool, with_files: bool) -> str:
    kind = "docker network" if n.kind == "docker_network" else n.kind
    name = n.name.split("/", 1)[1] if n.kind == "container" else n.name
    head = f"{kind} {name}"
    if with_plan and n.action is not Action.NOOP:
        head = f"{n.action.symbol} {head}"
    attrs = [f"shape={SHAPES[n.kind]}", f"label={_label([head, *n.facts])}"]
    styles = ["rounded"] if SHAPES[n.kind] == "box" else []
    if with_files and n.kind != "container" and n.action is not Action.CONFLICT:
        # (a conflict's object is on the host, only not ours)
        if n.declared and not n.live:
            styles.append("dashed")
        elif n.live and not n.declared:
            styles.append("dotted")
    if with_plan and n.action in STYLE:
        fill, border = STYLE[n.action]
        styles.append("filled")
        attrs += [f'fillcolor="{fill}"', f'color="{border}"', "penwidth=2"]
    if styles:
        attrs.append(f'style="{",".join(styles)}"')
    return f"    {quote(n.id)} [{', '.join(attrs)}];"


def _cell(text: str, attrs: str = "") -> str:
    return f"<TD{attrs}>{html.escape(text)}</TD>"


def _legend(plan: Plan | None, others: list[Change], *, with_files: bool,
            title: str = "") -> str | None:
    """Draw the graph's label, an HTML-like table (not a node, so the layout of the topology
    does not make room for it): the title, a row of the plan's symbols in their colours,
    a row of the borders (declared / undeclared), the plan's summary and the changes that
    are no node (firewall transactions, sysctls, orphan veths). None: nothing to explain."""
    rows = []
    if plan is not None:
        rows.append("".join(
            _cell(f"{a.symbol} {WORDS[a]}", f' BGCOLOR="{STYLE[a][0]}" COLOR="{STYLE[a][1]}"'
                                              ' STYLE="rounded"')
            for a in (Action.CREATE, Action.UPDATE, Action.REPLACE, Action.DELETE,
                      Action.CONFLICT)))
    if with_files:
        rows.append(_cell("declared, not on the host yet", ' STYLE="dashed"')
                    + _cell("on the host, in no file", ' STYLE="dotted"'))
    if plan is not None:
        s = plan.summary()
        notes = [(f"Plan: {s['create']} to create, {s['update']} to update, "
                  f"{s['replace']} to replace, {s['delete']} to delete"
                  + (f", {s['conflict']} conflict(s)" if s["conflict"] else "")
                  + f" ({s['unchanged']} unchanged)")]
        notes += [f"{c.action.symbol} {c.kind} {c.name}" for c in others[:12]]
        if len(others) > 12:
            notes.append(f"… and {len(others) - 12} more")
        rows.append('<TD BORDER="0" ALIGN="LEFT" BALIGN="LEFT">'
                    + "<BR/>".join(html.escape(n) for n in notes) + "</TD>")
    if not rows:
        return None
    if title:
        rows.insert(0, f'<TD BORDER="0"><FONT POINT-SIZE="12">{html.escape(title)}</FONT></TD>')
    width = max(r.count("<TD") for r in rows)

    def spanned(row: str) -> str:
        """Tell whether every row spans the table: a row of fewer cells stretches its last one."""
        n = row.count("<TD")
        head, sep, last = row.rpartition("<TD")
        return row if n == width else f'{head}{sep} COLSPAN="{width - n + 1}"{last}'

    table = "".join(f"<TR>{spanned(r)}</TR>" for r in rows)
    return (f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="4" CELLPADDING="4">'
            f'{table}</TABLE>>')


def dot(topo: Topology, desired: DesiredState | None = None, plan: Plan | None = None, *,
        actions: bool = False, title: str = "") -> str:
    """Write the DOT text: ``desired`` adds the files' view (declared vs live), ``plan`` what
    apply would give what is not on the host yet, and with ``actions`` the colours and
    symbols of what it would change, with their legend."""
    g = build(topo, desired, plan)
    others = [c for c in (plan.changes if plan else ()) if c.kind not in KINDS
              and c.action is not Action.NOOP]
    with_files = desired is not None
    shown = plan if actions else None
    legend = _legend(shown, others, with_files=with_files, title=title)
    label = legend or (text_label(title) if title else None)
    out = ["digraph reconciler {", "  rankdir=LR;", "  compound=true;",
           '  graph [fontname="Helvetica", fontsize=9, labelloc=t, labeljust=l'
           + (f", label={label}" if label else "") + "];",
           '  node [fontname="Helvetica", fontsize=10];',
           '  edge [color="#555555", arrowsize=0.7];']
    for parent in {n.parent for n in g.nodes.values()} - set(g.nodes) - {None}:
        # named but neither on the host nor declared (a subnet whose bridge is gone, an
        # alloc on a bridge we do not own): drawn bare, so the edge still says where
        assert parent is not None
        kind, _, name = parent.partition("/")
        g.node(kind, name).cluster = name if kind == "bridge" else None
    clusters: dict[str | None, list[Node]] = {}
    for n in g.nodes.values():
        clusters.setdefault(n.cluster, []).append(n)
    for cluster in sorted(clusters, key=lambda c: (c is None, c == "docker", c or "")):
        members = sorted(clusters[cluster], key=lambda n: (KINDS + ("container",)).index(n.kind))
        if cluster is None:
            out += [_node_line(n, with_plan=shown is not None, with_files=with_files)
                    for n in members]
            continue
        label = "Docker" if cluster == "docker" else f"bridge {cluster}"
        out.append(f"  subgraph {quote('cluster_' + cluster)} {{")
        out.append(f'    label={text_label(label)}; fontsize=10; color="#bbbbbb"; style="rounded";')
        out += [_node_line(n, with_plan=shown is not None, with_files=with_files)
                for n in members]
        out.append("  }")
    for n in g.nodes.values():
        if n.parent is not None:
            out.append(f"  {quote(n.parent)} -> {quote(n.id)};")
    out.append("}")
    return "\n".join(out) + "\n"
