"""Golden output at 300 allocations (SPEC §13): the text and JSON of constructed plans, byte
for byte, and no text line over 200 characters.

The plans are built here, not planned: what is checked is the rendering. After a deliberate
change of the output, regenerate with ``RECONCILER_REGEN_GOLDEN=1`` and read the diff:

    RECONCILER_REGEN_GOLDEN=1 python -m pytest tests/unit/ui/test_golden.py
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from reconciler.domain.plan import Action, AttrChange, Change, Impact, Op, Plan, ports_attr
from reconciler.ui import render, scale

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("RECONCILER_REGEN_GOLDEN") == "1"
N = 300
BRIDGES = ("apps", "db", "web", "batch")
FLOATING = "192.0.2.10"


def _maps(i: int, host: int | None = None) -> list[str]:
    tcp = f"{host or 20000 + i}/tcp->80" + (f"@{FLOATING}" if i % 30 == 0 else "")
    return sorted([tcp, f"{40000 + i}/tcp->53", f"{40000 + i}/udp->53"])


def _alloc_id(i: int) -> str:
    return f"alloc-{i:03d}"


def create_plan() -> Plan:
    """Everything of 300 allocations over 4 bridges and subnets, from nothing."""
    changes = []
    for k, b in enumerate(BRIDGES):
        changes.append(Change("bridge", b, Action.CREATE, "not present",
                              (AttrChange("mtu", None, 1500), AttrChange("hairpin", None, True),
                               AttrChange("mac", None, f"02:00:00:00:00:{k:02x}")),
                              (Op("link.add_bridge", {"name": b, "mtu": 1500}),),
                              f"state.yaml:{3 + k}"))
    for k, b in enumerate(BRIDGES):
        changes.append(Change("subnet", b, Action.CREATE, "not present",
                              (AttrChange("bridge", None, b),
                               AttrChange("cidr", None, f"10.{90 + k}.0.0/16"),
                               AttrChange("gateway", None, f"10.{90 + k}.0.1/16")),
                              (Op("addr.add", {"link": b, "address": f"10.{90 + k}.0.1/16"}),),
                              f"state.yaml:{8 + k}"))
    for i in range(N):
        k = i % len(BRIDGES)
        changes.append(Change(
            "alloc", _alloc_id(i), Action.CREATE, "not present",
            (AttrChange("subnet", None, BRIDGES[k]),
             AttrChange("address", None, f"10.{90 + k}.{i // 250}.{2 + i % 250}/16"),
             ports_attr(None, _maps(i)), AttrChange("mac", None, f"02:aa:00:00:{i // 256:02x}:"
                                                                 f"{i % 256:02x}")),
            (Op("netns.create", {"name": _alloc_id(i)}),), f"state.yaml:{20 + 5 * i}",
            within=f"bridge/{BRIDGES[k]}"))
    for key in ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"):
        changes.append(Change("sysctl", key, Action.UPDATE, "needed by the declared subnets",
                              (AttrChange("value", "0", "1"),),
                              (Op("sysctl.set", {"key": key, "value": "1"}),),
                              warnings=("with IPv6 forwarding on, interfaces stop accepting "
                                        "router advertisements unless their accept_ra is 2",)))
    udp = ", ".join(f"udp/{40000 + i}" for i in range(N))
    for family in (4, 6):
        changes.append(Change("firewall", f"ipv{family}", Action.CREATE, "owned chains missing",
                              (AttrChange("nat/RECONCILER-DNAT", None, f"{3 * N} rules"),
                               AttrChange("conntrack", f"IPv{family} entries of " + udp, None)),
                              (Op("firewall.restore", {"family": family}),)))
    warnings = tuple(f"alloc {_alloc_id(i)!r} ports[0]: host_ip {FLOATING} is not an address "
                     "of this host right now (a floating address?): the map takes effect once it "
                     "is" for i in range(0, N, 30))
    return Plan(tuple(changes), "f" * 64, (("state.yaml", "0" * 64),), warnings)


def update_plan() -> Plan:
    """The MTU of bridge apps 1500 -> 1400 (75 allocations follow) and two port maps moved,
    with the firewall change and what it closes."""
    changes = [Change("bridge", "apps", Action.UPDATE, "changed: mtu",
                      (AttrChange("mtu", 1500, 1400),),
                      (Op("link.set", {"name": "apps", "mtu": 1400}),), "state.yaml:3")]
    for i in range(0, N, len(BRIDGES)):
        attrs = [AttrChange("mtu", 1500, 1400), AttrChange("links inside", "down or wrong MTU",
                                                           "up")]
        if i in (0, 4):
            attrs.append(ports_attr(_maps(i), _maps(i, 25000 + i)))
        changes.append(Change("alloc", _alloc_id(i), Action.UPDATE,
                              "changed: " + ", ".join(a.field for a in attrs), tuple(attrs),
                              (Op("link.set", {"name": f"vr{i:012x}", "mtu": 1400}),),
                              f"state.yaml:{20 + 5 * i}", within="bridge/apps"))
    closed = tuple(Impact("port_map", f"{20000 + i}/tcp",
                          f"closed (it sent to alloc {_alloc_id(i)} at 10.90.0.{2 + i}:80)",
                          (f"10.90.0.{2 + i}",), 0) for i in (0, 4))
    moved = tuple(Impact("port_map", f"{30000 + j}/udp", f"closed (it sent to alloc x-{j})",
                         (f"10.99.0.{j}",), None) for j in range(40))
    changes.append(Change("firewall", "ipv4", Action.UPDATE,
                          "rules missing for " + ", ".join(f"alloc={_alloc_id(i)}"
                                                           for i in range(0, N, 4)),
                          (AttrChange("nat/RECONCILER-DNAT", f"{3 * N} rules", f"{3 * N} rules"),),
                          (Op("firewall.restore", {"family": 4}),), impact=closed + moved))
    return Plan(tuple(changes), "e" * 64, (("state.yaml", "1" * 64),))


def _json(plan: Plan) -> str:
    buf = io.StringIO()
    render.write_json(plan, buf)
    return buf.getvalue()


CASES = {
    "plan-300-create.txt": lambda: render.render_text(create_plan()),
    "plan-300-create-compact.txt": lambda: render.render_text(create_plan(), compact=True),
    "plan-300-update.txt": lambda: render.render_text(update_plan()),
    "plan-300-update-v.txt": lambda: render.render_text(update_plan(), verbose=True),
    "plan-300-update.json": lambda: _json(update_plan()),
}


@pytest.mark.parametrize("name", CASES)
def test_output_at_300_allocations_is_the_golden_one(name: str) -> None:
    got = CASES[name]()
    path = GOLDEN / name
    if REGEN:
        path.parent.mkdir(exist_ok=True)
        path.write_text(got)
        pytest.skip(f"regenerated {path}")
    assert got == path.read_text(), (
        f"{name} differs from its golden file: if the change is meant, regenerate "
        "(RECONCILER_REGEN_GOLDEN=1) and review the diff")


@pytest.mark.parametrize("name", [n for n in CASES if n.endswith(".txt")])
def test_no_text_line_is_over_200_characters(name: str) -> None:
    lines = CASES[name]().splitlines()
    assert max(len(line) for line in lines) <= scale.WIDTH


def test_the_update_at_300_is_short_and_names_what_moved() -> None:
    text = render.render_text(update_plan())
    lines = text.splitlines()
    assert len(lines) < 30, text
    assert "  ~ 73 allocs on bridge apps: changed: mtu, links inside" in lines
    assert "      ports: 20000/tcp->80@192.0.2.10 => 25000/tcp->80@192.0.2.10" in lines
    assert "      ports: 20004/tcp->80 => 25004/tcp->80" in lines
    assert "      impact: … and 37 more (37 port maps; -v lists each)" in lines
    verbose = render.render_text(update_plan(), verbose=True).splitlines()
    assert sum(1 for x in verbose if x.startswith("  ~ alloc ")) == 75
    assert sum(1 for x in verbose if x.startswith("      impact: ")) == 42


def test_the_json_keeps_every_change_and_value_whole() -> None:
    plan = update_plan()
    assert Plan.from_json(plan.to_json()) == plan
    firewall = plan.to_json()["changes"][-1]
    assert firewall["reason"].count("alloc=") == 75 and len(firewall["impact"]) == 42
