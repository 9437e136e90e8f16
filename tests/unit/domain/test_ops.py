"""Typed ops: one declaration per op, and a wire form that stays what plans have held."""

from __future__ import annotations

import json
from typing import Any

import pytest

from reconciler.domain import ops
from reconciler.domain.ops import OPS, LinkSet, OpError, decode, encode
from reconciler.domain.plan import Op, Plan
from tests.support.opscenarios import plan_json, recorded, recorded_ops, scenarios


def test_the_planner_writes_the_bytes_it_wrote_before_typed_ops() -> None:
    want = recorded()
    got = dict(scenarios())
    assert list(got) == list(want)
    for name, plan in got.items():
        assert plan_json(plan) == json.dumps(want[name], indent=2), name


def test_the_scenarios_hold_every_op() -> None:
    assert {o["op"] for o in recorded_ops()} == set(OPS)
    assert len(OPS) == 23  # firewall.restore gone; firewall.nft, firewall.shim new


@pytest.mark.parametrize("raw", recorded_ops(), ids=lambda o: f"{o['op']}({','.join(o['args'])})")
def test_decode_then_encode_gives_the_same_op_and_bytes(raw: dict[str, Any]) -> None:
    op = Op.from_json(raw)
    typed = decode(op)
    assert type(typed) is OPS[op.name]
    again = encode(typed)
    assert again == op
    assert json.dumps(again.to_json(), indent=2) == json.dumps(raw, indent=2)
    assert again.describe() == op.describe()


def test_every_op_of_every_scenario_plan_round_trips() -> None:
    for _name, plan in scenarios():
        for c in plan.changes:
            for op in c.ops:
                assert json.dumps(encode(decode(op)).to_json()) == json.dumps(op.to_json())
        assert Plan.from_json(json.loads(plan_json(plan))).same_work(plan)


def test_link_set_keeps_both_key_orders_plans_have_used() -> None:
    bridge = LinkSet("br0", owned=True, mtu=1500, up=True)
    assert list(encode(bridge).args) == ["name", "owned", "mtu", "up"]
    veth = LinkSet.up_owned("vr0")
    assert list(encode(veth).args) == ["name", "up", "owned"]
    assert veth == LinkSet("vr0", owned=True, up=True)  # the order is not part of the value
    assert list(encode(LinkSet("vr0", master="br0")).args) == ["name", "master"]


def test_a_json_list_decodes_to_a_tuple_and_encodes_back_to_a_list() -> None:
    typed = decode(Op("alloc.configure", {"netns": "a", "addresses": ["10.0.0.2/24"],
                                          "gateways": ["10.0.0.1"], "mtu": None, "ipv6": False,
                                          "mark": "m"}))
    assert isinstance(typed, ops.AllocConfigure) and typed.addresses == ("10.0.0.2/24",)
    assert encode(typed).args["addresses"] == ["10.0.0.2/24"]


def test_docker_ops_carry_the_scope_label_on_their_network() -> None:
    typed = decode(Op("docker.ensure", {
        "spec": {"name": "kind", "labels": {"team": "x"}}, "default_mtu": None,
        "scope": "netns/t"}))
    assert isinstance(typed, ops.DockerEnsure)
    assert dict(typed.network().labels) == {"team": "x", "io.reconciler.scope": "netns/t"}


@pytest.mark.parametrize(("op", "message"), [
    (Op("link.frob", {}), "unknown operation 'link.frob' (plan from a newer version?)"),
    (Op(["x"], {}), "unknown operation ['x']"),  # type: ignore[arg-type]
    (Op("link.delete", ["x"]), "link.delete: arguments must be an object, not [\"x\"]"),  # type: ignore[arg-type]
    (Op("link.delete", {}), "link.delete: missing argument 'name'"),
    (Op("link.delete", {"name": "x", "force": True}), "link.delete: unknown argument 'force'"),
    (Op("link.delete", {"name": 7}), "link.delete: argument 'name' must be a string, not 7"),
    (Op("link.add_bridge", {"name": "b", "mtu": True}),
     "link.add_bridge: argument 'mtu' must be an integer or null, not true"),
    (Op("link.set", {"name": "b", "up": "yes"}),
     "link.set: argument 'up' must be true or false or null, not \"yes\""),
    (Op("alloc.configure", {"netns": "a", "addresses": "10.0.0.2/24", "gateways": [],
                            "mtu": None, "ipv6": False, "mark": None}),
     "alloc.configure: argument 'addresses' must be a list of strings, not \"10.0.0.2/24\""),
    (Op("alloc.configure", {"netns": "a", "addresses": [1], "gateways": [], "mtu": None,
                            "ipv6": False, "mark": None}),
     "alloc.configure: argument 'addresses' must be a list of strings, not [1]"),
    (Op("docker.ensure", {"spec": [], "default_mtu": None, "scope": "host"}),
     "docker.ensure: argument 'spec' must be an object, not []"),
    (Op("docker.ensure", {"spec": {"mtu": 1}, "default_mtu": None, "scope": "host"}),
     "docker.ensure: malformed arguments (KeyError: 'name')"),
    (Op("docker.ensure", {"spec": {"name": "n", "subnet": "nonsense"}, "default_mtu": None,
                          "scope": "host"}),
     "docker.ensure: malformed arguments (AddressValueError: "),
])
def test_a_bad_op_is_one_clear_error(op: Op, message: str) -> None:
    with pytest.raises(OpError) as info:
        decode(op)
    assert str(info.value).startswith(message)
    assert isinstance(info.value, ValueError)  # `apply FILE` reports ValueErrors as one line
