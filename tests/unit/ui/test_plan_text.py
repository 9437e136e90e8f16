"""Plans people can review (SPEC §13): attributes on their resource, grouped changes,
elided lists, warnings said once, no line over 200 characters, --compact."""

from __future__ import annotations

import json

from reconciler.domain.plan import Action, AttrChange, Change, Plan, ports_attr
from reconciler.ui import render, scale
from tests.support.fakehost import FakeHost
from tests.support.planning import alloc, converge, port, state
from tests.support.planning import plan as planned


def test_fit_elides_a_list_with_a_count_and_wraps_anything_else() -> None:
    items = ", ".join(f"udp/{40000 + i}" for i in range(300))
    fitted = scale.fit(items, 100)
    assert len(fitted) <= 100 and fitted.startswith("udp/40000, udp/40001, ")
    kept = fitted.split(", … ")[0].count(", ") + 1
    assert fitted.endswith(f", … (+{300 - kept} more)")
    blob = "x" * 500
    assert scale.fit(blob, 100, cut=True) == "x" * (100 - len("… (+500 chars)")) + "… (+414 chars)"
    assert scale.fit(blob, 100).replace("\n  ", "") == blob  # wrapped: nothing lost
    assert all(len(line) <= 100 for line in scale.fit(blob, 100).splitlines())
    assert scale.fit("short", 100) == "short"


def test_identical_changes_are_one_block_with_a_count_and_v_expands_them() -> None:
    changes = tuple(Change("alloc", f"a-{i:03d}", Action.UPDATE, "changed: mtu",
                           (AttrChange("mtu", 1500, 1400),), within="bridge/apps")
                    for i in range(40))
    odd = Change("alloc", "b-1", Action.UPDATE, "changed: mtu", (AttrChange("mtu", 9000, 1400),),
                 within="bridge/apps")
    plan = Plan((Change("bridge", "apps", Action.UPDATE, "changed: mtu",
                        (AttrChange("mtu", 1500, 1400),)), *changes, odd))
    text = render.render_text(plan)
    assert "  ~ 40 allocs on bridge apps: changed: mtu\n      mtu: 1500 -> 1400\n" in text
    assert "      allocs: a-000, a-001, a-002, a-003, a-004, … (+35 more) (-v lists each)" in text
    assert "  ~ alloc b-1: changed: mtu\n      mtu: 9000 -> 1400" in text  # not the same change
    assert text.count("\n") < 12
    verbose = render.render_text(plan, verbose=True)
    assert all(f"  ~ alloc a-{i:03d}: changed: mtu" in verbose for i in range(40))


def test_a_warning_of_many_resources_is_said_once_with_them() -> None:
    floating = [f"alloc 'a-{i}' ports[0]: host_ip 192.0.2.10 is not an address of this host "
                "right now (a floating address?): the map takes effect once it is"
                for i in range(10)]
    shared = "bridge MTU differs from the uplink"
    plan = Plan((Change("alloc", "x", Action.UPDATE, "r", (AttrChange("mtu", 1, 2),),
                        warnings=(shared,)),
                 Change("alloc", "y", Action.UPDATE, "r", (AttrChange("mtu", 3, 2),),
                        warnings=(shared,))),
                warnings=(*floating, "docker: unreachable"))
    lines = render.render_text(plan).splitlines()
    host_ip = [x for x in lines if "host_ip 192.0.2.10" in x]
    assert host_ip == ["warning (10 allocs: a-0 ports[0], a-1 ports[0], a-2 ports[0], … (+7 more)): "
                       "host_ip 192.0.2.10 is not an address of this host right now (a floating "
                       "address?): the map takes effect once it is"]
    assert [x for x in lines if shared in x] == [f"warning (alloc x, alloc y): {shared}"]
    assert "warning: docker: unreachable" in lines


def test_a_port_map_edit_reads_on_the_allocation_in_text_and_json() -> None:
    """The most common edit (8080 -> 8082) shows on the allocation, old and new, and the JSON
    has the maps added and removed as fields; the firewall's own change stays below."""
    host = FakeHost()
    converge(host, state(alloc("web", port(8080, 80), port(5353, 53, "udp"))))
    plan = planned(host, state(alloc("web", port(8082, 80), port(5353, 53, "udp"))))
    (web,) = [c for c in plan.actionable if c.kind == "alloc"]
    assert web.action is Action.UPDATE and web.ops == ()
    text = render.render_text(plan)
    assert "  ~ alloc web: changed: ports\n      ports: 8080/tcp->80 => 8082/tcp->80\n" in text
    assert "~ firewall nftables" in text.split("~ alloc web")[1]
    (attr,) = json.loads(json.dumps(plan.to_json()))["changes"][
        [c.kind for c in plan.actionable].index("alloc")]["attrs"]
    assert attr == {"field": "ports", "before": ["5353/udp->53", "8080/tcp->80"],
                    "after": ["5353/udp->53", "8082/tcp->80"],
                    "added": [{"host": 8082, "protocol": "tcp", "to": 80, "host_ip": None}],
                    "removed": [{"host": 8080, "protocol": "tcp", "to": 80, "host_ip": None}]}
    assert Plan.from_json(plan.to_json()).actionable == plan.actionable  # read back whole


def test_ports_attr_spells_host_ips_and_protocols() -> None:
    a = ports_attr(["53/udp->53@127.0.0.1", "80/tcp->80"], ["80/tcp->80", "53/udp->53@::1"])
    assert a.extra == {"added": [{"host": 53, "protocol": "udp", "to": 53, "host_ip": "::1"}],
                       "removed": [{"host": 53, "protocol": "udp", "to": 53,
                                    "host_ip": "127.0.0.1"}]}
    line = render.render_text(Plan((Change("alloc", "w", Action.UPDATE, "changed: ports", (a,)),)))
    assert "      ports: 53/udp->53@127.0.0.1 => 53/udp->53@::1\n" in line


def test_compact_counts_each_action_by_kind_and_keeps_errors() -> None:
    plan = Plan((*(Change("alloc", f"a{i}", Action.CREATE, "not present") for i in range(300)),
                 Change("bridge", "apps", Action.UPDATE, "changed: mtu"),
                 Change("subnet", "s", Action.CONFLICT, "exists, not ours")),
                warnings=("w1", "w2"), errors=("docker: unreachable",))
    assert render.render_text(plan, compact=True) == (
        "  + 300 allocs\n  ~ 1 bridge\n  ! subnet s: exists, not ours\n"
        "warnings: 2 (the full plan lists them)\nerror: docker: unreachable\n"
        "Plan: 300 to create, 1 to update, 0 to replace, 0 to delete, 1 blocked "
        "(0 unchanged).\n")


def test_deletions_without_flows_are_grouped_and_one_with_flows_stands_alone() -> None:
    from reconciler.domain.plan import Impact

    def gone(name: str, flows: int) -> Change:
        return Change("alloc", name, Action.DELETE, "no longer declared", impact=(
            Impact("alloc", name, "deleted: loses connectivity", (f"10.0.0.{len(name)}",),
                   flows),))

    plan = Plan((*(gone(f"a{i}", 0) for i in range(320)), gone("busy", 3)))
    lines = render.render_text(plan).splitlines()
    assert lines[:3] == ["  - 320 allocs: no longer declared",
                         "      impact: 320 allocs: deleted: loses connectivity; no established "
                         "flows",
                         "      allocs: a0, a1, a2, a3, a4, … (+315 more) (-v lists each)"]
    assert "      impact: alloc busy: deleted: loses connectivity (10.0.0.4); 3 established " \
           "flows" in lines
    assert len(lines) == 8


def test_a_sentence_with_commas_is_wrapped_and_an_error_never() -> None:
    """A message is no list: eliding its clauses as items once left 'is a live network
    namespace, … (+3 more)' of the one line that explains a refusal; cutting it by characters
    lost a warning's MAC address."""
    sentence = ("/run/netns/a is a live network namespace, but this process sees an empty "
                "file there: it runs in a mount namespace of its own, made after it, so the "
                "allocation would look gone; run it from the host's mount namespace, or "
                "without ip netns exec, and try again " + "x" * 40)
    fitted = scale.fit(sentence, 200)
    assert all(len(line) <= 200 for line in fitted.splitlines()) and "\n  " in fitted
    assert " ".join(part.strip() for part in fitted.splitlines()) == sentence
    plan = Plan(errors=(sentence,))
    assert f"error: {sentence}" in render.render_text(plan).splitlines()
    assert f"error: {sentence}" in render.render_text(plan, compact=True).splitlines()
