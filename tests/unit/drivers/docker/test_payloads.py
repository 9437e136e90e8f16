"""Docker payloads and error texts captured from a real dockerd 20.10.24 (``fixtures/``):
the error classifiers, in the SDK's and the CLI's wording, and the network parser."""

from __future__ import annotations

from typing import Any

import pytest

from reconciler.domain.docker import (
    OPT_MASQUERADE,
    OPT_MTU,
)
from reconciler.drivers.docker.payloads import (
    daemon_message,
    is_already_exists,
    is_ipv4_pool_exhausted,
    is_ipv6_unavailable,
    is_no_such_network,
    is_pool_overlap,
    parse_default_mtu,
    parse_network,
)
from tests.support.dockerfake import ERRORS, KIND_IPV6_ERRORS, load

FORMS = ("sdk_explanation", "sdk_str", "cli_stderr")


CLASSIFIERS = {
    "pool_overlap": is_pool_overlap,
    "already_exists": is_already_exists,
    "no_such_network": is_no_such_network,
    "no_such_network_inspect": is_no_such_network,
    "ipv4_pool_exhausted": is_ipv4_pool_exhausted,
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("key", sorted(ERRORS))
def test_classifiers_on_captured_errors(key: str, form: str) -> None:
    msg = ERRORS[key][form]
    for other_key, classify in CLASSIFIERS.items():
        expected = CLASSIFIERS.get(key) is classify
        assert classify(msg) is expected, (key, other_key, form, msg)
    assert not is_ipv6_unavailable(msg)


# kind's texts verbatim; this host's daemon cannot be made to produce them.
@pytest.mark.parametrize("msg", KIND_IPV6_ERRORS)
def test_ipv6_unavailable_cli_and_sdk_forms(msg: str) -> None:
    assert is_ipv6_unavailable(msg)
    explanation = daemon_message(msg)
    assert is_ipv6_unavailable(explanation)
    assert is_ipv6_unavailable(f'500 Server Error for http+docker://localhost/v1.41/networks/'
                               f'create: Internal Server Error ("{explanation}")')
    assert not is_pool_overlap(msg)
    assert not is_no_such_network(msg)


@pytest.mark.parametrize("msg", [
    # one space instead of kind's two: not the daemon's text
    "Failed to Setup IP tables: Unable to enable NAT rule: (iptables failed: ip6tables",
    # IPv4 iptables failures are not an IPv6 problem
    "Failed to Setup IP tables: Unable to enable NAT rule:  (iptables failed: iptables --wait",
    "IPv6 is great",
    "",
])
def test_ipv6_unavailable_negative(msg: str) -> None:
    assert not is_ipv6_unavailable(msg)


@pytest.mark.parametrize("msg, expected", [
    ("Error: No such network: kind", True),
    ("Error: No such network: a\nError: No such network: b\n", True),
    # kind: any other error line spoils it
    ("Error: No such network: a\nError response from daemon: boom\n", False),
    ("network kind not found", True),
    ("exit status 1", False),
    ("", False),
    ("could not find an available, non-overlapping IPv4 address pool among the defaults to "
     "assign to the network", False),
])
def test_no_such_network_table(msg: str, expected: bool) -> None:
    assert is_no_such_network(msg) is expected


def test_pool_overlap_other_text() -> None:
    assert is_pool_overlap("Error response from daemon: networks have overlapping IPv4")


def test_parse_kind_network_with_containers() -> None:
    n = parse_network(load("kind_owned_2_containers.json"))
    assert n.name == "kind"
    assert n.id.startswith("3dffc8de20ff")
    assert n.driver == "bridge"
    assert n.enable_ipv6 is True
    assert n.internal is False
    assert n.subnets == ("172.24.0.0/16", "fc00:f853:ccd:e793::/64")
    assert n.containers == 2
    assert n.owned
    assert n.labels["team"] == "infra"
    assert n.options[OPT_MTU] == "1500"


def test_parse_cli_and_api_payloads_agree() -> None:
    assert parse_network(load("kind_owned_2_containers_cli.json")) == parse_network(
        load("kind_owned_2_containers.json"))


def test_parse_plain_and_internal() -> None:
    plain = parse_network(load("plain_cli_created.json"))
    assert not plain.owned and plain.options == {} and plain.containers == 0
    assert plain.enable_ipv6 is False and len(plain.subnets) == 1
    internal = parse_network(load("internal_no_masq.json"))
    assert internal.internal and internal.options[OPT_MASQUERADE] == "false"
    assert internal.subnets == ("172.30.0.0/16",)


def test_parse_list_entries_have_no_container_counts() -> None:
    # GET /networks leaves Containers empty: counts need an inspect.
    for entry in load("list_entry.json"):
        assert parse_network(entry).containers == 0


@pytest.mark.parametrize("fixture", ["host.json", "none.json", "bridge.json"])
def test_parse_docker_own_networks(fixture: str) -> None:
    n = parse_network(load(fixture))
    assert n.name == fixture.removesuffix(".json")
    assert not n.owned


def test_parse_minimal_payload() -> None:
    n = parse_network({"Id": "x", "Name": "y", "IPAM": {"Config": None}, "Containers": None,
                       "Labels": None, "Options": None})
    assert n.subnets == () and n.containers == 0 and n.labels == {} and n.options == {}


def test_parse_default_mtu_from_bridge_fixture() -> None:
    assert parse_default_mtu(load("bridge.json")) == 1500


@pytest.mark.parametrize("options, expected", [
    ({OPT_MTU: "1500"}, 1500),
    ({OPT_MTU: "9000"}, 9000),
    ({OPT_MTU: " 1450\n"}, 1450),
    ({OPT_MTU: ""}, None),
    ({OPT_MTU: "abc"}, None),
    ({OPT_MTU: "-1"}, None),
    ({OPT_MTU: "0"}, None),
    ({OPT_MTU: "1.5"}, None),
    ({}, None),
    (None, None),
])
def test_parse_default_mtu_table(options: Any, expected: int | None) -> None:
    assert parse_default_mtu({"Name": "bridge", "Options": options}) == expected
