"""The Docker driver's algorithms against an in-memory SDK: ensure, the IPv6 fallback,
pool-overlap probing, dedupe, remove, replace, observe."""

from __future__ import annotations

import ipaddress
from typing import Any

import docker.errors
import pytest

from reconciler.domain.docker import (
    IPV6_FALLBACK_LABEL,
    OPT_MASQUERADE,
    OPT_MTU,
    ula_subnet,
)
from reconciler.domain.errors import ConflictError, DriverError, TemporaryError
from reconciler.drivers.docker.client import DockerDriver
from reconciler.drivers.docker.payloads import (
    daemon_message,
    parse_network,
)
from reconciler.planner.docker_diff import diff_network
from tests.support.dockerfake import ERRORS, KIND_IPV6_ERRORS, OURS, FakeAPI, api_error, spec


def creates(api: FakeAPI) -> list[Any]:
    return [c[1] for c in api.calls if c[0] == "create"]


def pools(kw: dict[str, Any]) -> list[dict[str, str]]:
    """The IPAM pools of a create call, without the SDK's None-valued keys."""
    return [{k: v for k, v in p.items() if v is not None} for p in kw["ipam"]["Config"]]


def test_ensure_creates_with_kinds_options(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    res = drv.ensure(spec("kind", ipv6=True, labels=(("team", "infra"),)), 1500)
    assert res.created and res.attempt == 0 and res.subnet6 == "fc00:f853:ccd:e793::/64"
    (name, kw), = creates(api)
    assert name == "kind" and kw["driver"] == "bridge" and kw["check_duplicate"] is True
    assert kw["options"] == {OPT_MASQUERADE: "true", OPT_MTU: "1500"}
    assert kw["labels"] == {"team": "infra", **OURS}
    assert kw["enable_ipv6"] is True
    assert pools(kw) == [{"Subnet": "fc00:f853:ccd:e793::/64"}]


def test_ensure_v4_only_no_mtu_when_unknown(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    drv.ensure(spec("n", subnet=ipaddress.IPv4Network("10.1.0.0/24"), masquerade=False,
                    internal=True), None)
    (_, kw), = creates(api)
    assert kw["options"] == {OPT_MASQUERADE: "false"}
    assert kw["enable_ipv6"] is False and kw["internal"] is True
    assert pools(kw) == [{"Subnet": "10.1.0.0/24"}]


def test_ensure_existing_is_noop(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    nid = api.add("kind", labels=OURS)
    res = drv.ensure(spec("kind", ipv6=True), 1500)
    assert not res.created and res.network_id == nid and not creates(api)


def test_ensure_existing_foreign_is_conflict(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    api.add("kind")
    with pytest.raises(ConflictError, match="not managed by reconciler"):
        drv.ensure(spec("kind"), 1500)
    assert not creates(api)


def test_ensure_name_filter_is_exact(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    api.add("kind-other", labels=OURS)
    res = drv.ensure(spec("kind"), 1500)
    assert res.created


@pytest.mark.parametrize("msg", KIND_IPV6_ERRORS)
def test_ipv6_unavailable_falls_back_once(fake_docker: tuple[DockerDriver, FakeAPI], msg: str) -> None:
    drv, api = fake_docker
    api.create_errors = [daemon_message(msg)]
    res = drv.ensure(spec("kind", ipv6=True), 1500)
    assert res.created and res.ipv6_fallback and res.subnet6 is None
    assert res.warnings and "IPv4-only" in res.warnings[0]
    assert [kw["enable_ipv6"] for _, kw in creates(api)] == [True, False]
    # marked, so the next plan accepts it without IPv6 (kind's semantics)
    created = parse_network(api.nets[res.network_id])
    assert created.labels[IPV6_FALLBACK_LABEL] == "true" and created.owned
    assert diff_network(spec("kind", ipv6=True), created, 1500) == []


def test_ipv6_unavailable_with_explicit_subnet6_is_an_error(
        fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    api.create_errors = [KIND_IPV6_ERRORS[1]]
    with pytest.raises(DriverError, match="cannot set up IPv6"):
        drv.ensure(spec("kind", subnet6=ipaddress.IPv6Network("fd00:1::/64")), 1500)


def test_ipv6_unavailable_only_on_first_attempt(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    overlap = ERRORS["pool_overlap"]["sdk_explanation"]
    api.create_errors = [overlap, daemon_message(KIND_IPV6_ERRORS[2])]
    with pytest.raises(DriverError, match="ip6tables"):
        drv.ensure(spec("kind", ipv6=True), 1500)
    assert len(creates(api)) == 2


def test_pool_overlap_probes_next_attempts(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    overlap = ERRORS["pool_overlap"]["sdk_explanation"]
    api.create_errors = [overlap, overlap]
    res = drv.ensure(spec("kind", ipv6=True), 1500)
    assert res.created and res.attempt == 2 and res.subnet6 == str(ula_subnet("kind", 2))
    asked = [kw["ipam"]["Config"][0]["Subnet"] for _, kw in creates(api)]
    assert asked == [str(ula_subnet("kind", a)) for a in range(3)]


def test_pool_overlap_exhausts_after_five(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    api.create_errors = [ERRORS["pool_overlap"]["sdk_explanation"]] * 6
    with pytest.raises(DriverError, match="exhausted attempts trying to find a non-overlapping "
                                          "subnet for docker network kind"):
        drv.ensure(spec("kind", ipv6=True), 1500)
    assert len(creates(api)) == 5


def test_pool_overlap_explicit_subnet6_no_probing(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    api.create_errors = [ERRORS["pool_overlap"]["sdk_explanation"]]
    with pytest.raises(DriverError, match="subnet6 fd00:1::/64 overlaps"):
        drv.ensure(spec("kind", subnet6=ipaddress.IPv6Network("fd00:1::/64")), 1500)
    assert len(creates(api)) == 1


def test_pool_overlap_on_declared_ipv4_names_the_other(fake_docker: tuple[DockerDriver, FakeAPI]
                                                       ) -> None:
    drv, api = fake_docker
    api.add("someone-else", subnets=("10.1.0.0/16",))
    api.create_errors = [ERRORS["pool_overlap"]["sdk_explanation"]]
    with pytest.raises(DriverError, match="overlaps docker network someone-else"):
        drv.ensure(spec("kind", ipv6=True, subnet=ipaddress.IPv4Network("10.1.2.0/24")), 1500)
    assert len(creates(api)) == 1


def test_pool_overlap_rechecks_existence(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    overlap = ERRORS["pool_overlap"]["sdk_explanation"]

    real_create = api.create_network

    def racing_create(name: str, **kw: Any) -> dict[str, str]:
        # another reconciler wins the race with the same name, then we overlap
        api.create_network = real_create  # type: ignore[method-assign]
        api.add(name, labels=OURS)
        raise api_error(overlap)

    api.create_network = racing_create  # type: ignore[method-assign]
    res = drv.ensure(spec("kind", ipv6=True), 1500)
    assert not res.created


def test_already_exists_is_benign_and_dedupes(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker

    def racing_create(name: str, **kw: Any) -> dict[str, str]:
        api.add(name, labels=OURS, id_="9" * 64)
        api.add(name, labels=OURS, id_="1" * 64, containers=1)
        raise api_error(ERRORS["already_exists"]["sdk_explanation"])

    api.create_network = racing_create  # type: ignore[method-assign]
    res = drv.ensure(spec("kind"), 1500)
    assert not res.created and res.network_id == "1" * 64
    assert res.removed_duplicates == ("9" * 64,)


def test_ipv4_pool_exhausted_is_clear_and_no_loop(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    api.create_errors = [ERRORS["ipv4_pool_exhausted"]["sdk_explanation"]] * 10
    with pytest.raises(DriverError, match="default IPv4 address pools are exhausted"):
        drv.ensure(spec("kind", ipv6=True), 1500)
    assert len(creates(api)) == 1


def test_unknown_create_error_is_one_line(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    api.create_errors = ["invalid option foo"]
    with pytest.raises(DriverError) as err:
        drv.ensure(spec("kind"), 1500)
    assert str(err.value) == "docker network kind: ensure: invalid option foo"
    assert not isinstance(err.value, TemporaryError)


def test_dedupe_keeps_most_containers_then_lowest_id(fake_docker: tuple[DockerDriver, FakeAPI]
                                                     ) -> None:
    drv, api = fake_docker
    a = api.add("dup", labels=OURS, id_="3" * 64, containers=1)
    b = api.add("dup", labels=OURS, id_="2" * 64, containers=1)
    c = api.add("dup", labels=OURS, id_="1" * 64)
    res = drv.dedupe("dup")
    assert res.kept is not None and res.kept.id == b
    assert set(res.removed) == {a, c}
    assert [n["Id"] for n in api.nets.values() if n["Name"] == "dup"] == [b]


def test_dedupe_refuses_foreign(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    api.add("dup", labels=OURS, containers=2)
    api.add("dup")
    with pytest.raises(ConflictError, match="not ours"):
        drv.dedupe("dup")
    assert len([n for n in api.nets.values() if n["Name"] == "dup"]) == 2


def test_dedupe_single_or_none(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    assert drv.dedupe("nothing").kept is None
    nid = api.add("one")
    res = drv.dedupe("one")
    assert res.kept is not None and res.kept.id == nid and res.removed == ()


def test_dedupe_tolerates_vanished_duplicate(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    keep = api.add("dup", labels=OURS, id_="1" * 64)
    gone = api.add("dup", labels=OURS, id_="2" * 64)
    real_remove = api.remove_network

    def remove_racing(ref: str) -> None:
        real_remove(ref)
        raise api_error(f"network {ref} not found", docker.errors.NotFound)

    api.remove_network = remove_racing  # type: ignore[method-assign]
    res = drv.dedupe("dup")
    assert res.kept is not None and res.kept.id == keep and res.removed == ()
    assert gone not in api.nets


@pytest.mark.parametrize("name", ["bridge", "host", "none"])
def test_remove_refuses_docker_networks(fake_docker: tuple[DockerDriver, FakeAPI], name: str) -> None:
    drv, api = fake_docker
    with pytest.raises(ConflictError, match="Docker's own"):
        drv.remove(name)


def test_remove_rules(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    assert drv.remove("missing") is False
    api.add("foreign")
    with pytest.raises(ConflictError, match="not managed"):
        drv.remove("foreign")
    api.add("busy", labels=OURS, containers=1)
    with pytest.raises(ConflictError, match="container"):
        drv.remove("busy")
    nid = api.add("mine", labels=OURS)
    assert drv.remove(nid) is True
    assert nid not in api.nets


def test_replace_without_containers(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    old = api.add("kind", labels=OURS)
    res = drv.replace(spec("kind", ipv6=True), parse_network(api.nets[old]), 1500,
                      reconnect=False)
    assert res.created and res.network_id != old and old not in api.nets


def test_replace_refuses_attached_containers_without_reconnect(
        fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    old = api.add("kind", labels=OURS, containers=2)
    with pytest.raises(ConflictError, match="2 container"):
        drv.replace(spec("kind"), parse_network(api.nets[old]), 1500, reconnect=False)
    assert old in api.nets


def test_replace_refuses_foreign_unless_adopting(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    old = api.add("kind")
    with pytest.raises(ConflictError, match="adopt"):
        drv.replace(spec("kind"), parse_network(api.nets[old]), 1500, reconnect=False)
    res = drv.replace(spec("kind"), parse_network(api.nets[old]), 1500, reconnect=False,
                      adopt=True)
    assert api.nets[res.network_id]["Labels"] == OURS


def test_observe_selects_wanted_and_owned(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker
    api.add("wanted")
    api.add("ours-pruned", labels=OURS, containers=3)
    api.add("unrelated")
    state = drv.observe(["wanted", "absent"])
    assert state.available and state.default_mtu == 1500
    assert [(n.name, n.containers) for n in state.networks] == [
        ("ours-pruned", 3), ("wanted", 0)]


def test_observe_never_raises_on_api_errors(fake_docker: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake_docker

    def broken(**kw: Any) -> Any:
        raise api_error("something broke")

    api.networks = broken  # type: ignore[assignment,method-assign]
    state = drv.observe(["x"])
    assert not state.available and state.error == "docker: listing networks failed: " \
                                                  "something broke"


def test_replace_puts_containers_back_when_delete_fails(fake_docker: tuple[DockerDriver, FakeAPI]
                                                        ) -> None:
    drv, api = fake_docker
    old = api.add("kind", labels=OURS, containers=1, subnets=("172.20.0.0/16",))
    events: list[tuple[str, str]] = []
    api.disconnect_container_from_network = (  # type: ignore[attr-defined]
        lambda cid, net, force=False: events.append(("disconnect", cid)))
    api.connect_container_to_network = (  # type: ignore[attr-defined]
        lambda cid, net, **kw: events.append(("connect", cid)))

    def busy(ref: str) -> None:
        raise api_error(f"error while removing network: network kind id {ref} has active "
                        "endpoints")

    api.remove_network = busy  # type: ignore[method-assign]
    with pytest.raises(DriverError, match="active endpoints"):
        drv.replace(spec("kind", mtu=1400), parse_network(api.nets[old]), 1500, reconnect=True)
    cid = next(iter(api.nets[old]["Containers"]))
    assert events == [("disconnect", cid), ("connect", cid)]
    assert not creates(api)
