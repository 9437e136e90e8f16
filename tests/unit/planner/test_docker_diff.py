"""What differs between a declared Docker network and a live one (``planner.docker_diff``),
also on networks captured from a real dockerd."""

from __future__ import annotations

import ipaddress

import pytest

from reconciler.domain.docker import (
    IPV6_FALLBACK_LABEL,
    OPT_MASQUERADE,
    OPT_MTU,
)
from reconciler.domain.live import LiveDockerNetwork
from reconciler.domain.model import DockerNetwork
from reconciler.drivers.docker.payloads import (
    parse_default_mtu,
    parse_network,
)
from reconciler.planner.docker_diff import diff_network
from tests.support.dockerfake import OURS, live, load, spec

V6 = ("172.18.0.0/16", "fc00:f853:ccd:e793::/64")


OTHER64 = ("172.18.0.0/16", "fc00:1234:5678:9abc::/64")


DIFF_CASES = [
    ("identical defaults", spec(), live(), 1500, []),
    ("docker-picked subnet is not a diff", spec(), live(subnets=("10.99.0.0/24",)), 1500, []),
    ("declared subnet matches", spec(subnet=ipaddress.IPv4Network("172.18.0.0/16")),
     live(), 1500, []),
    ("declared subnet differs", spec(subnet=ipaddress.IPv4Network("172.30.0.0/16")),
     live(), 1500, [("subnet", "172.18.0.0/16", "172.30.0.0/16")]),
    ("declared subnet, live has none", spec(subnet=ipaddress.IPv4Network("172.30.0.0/16")),
     live(subnets=()), 1500, [("subnet", "(none)", "172.30.0.0/16")]),
    ("ipv6 derived, attempt 0", spec(ipv6=True), live(enable_ipv6=True, subnets=V6), 1500, []),
    ("ipv6 derived, any /64 (kind probed)", spec(ipv6=True),
     live(enable_ipv6=True, subnets=OTHER64), 1500, []),
    ("ipv6 derived, live without v6", spec(ipv6=True), live(), 1500,
     [("ipv6", "false", "true")]),
    ("ipv6 derived, live v6 on but not a /64", spec(ipv6=True),
     live(enable_ipv6=True, subnets=("172.18.0.0/16", "fd00::/48")), 1500,
     [("subnet6", "fd00::/48", "fc00:f853:ccd:e793::/64 (derived)")]),
    ("ipv6 derived, created IPv4-only by the fallback", spec(ipv6=True),
     live(labels={**OURS, IPV6_FALLBACK_LABEL: "true"}), 1500, []),
    ("explicit subnet6 ignores the fallback marker",
     spec(subnet6=ipaddress.IPv6Network("fd00:1::/64")),
     live(labels={**OURS, IPV6_FALLBACK_LABEL: "true"}), 1500, [("ipv6", "false", "true")]),
    ("ipv6 not wanted, live has it", spec(), live(enable_ipv6=True, subnets=V6), 1500,
     [("ipv6", "true", "false")]),
    ("explicit subnet6 matches", spec(ipv6=True, subnet6=ipaddress.IPv6Network("fd00:1::/64")),
     live(enable_ipv6=True, subnets=("172.18.0.0/16", "fd00:1::/64")), 1500, []),
    ("explicit subnet6 implies ipv6", spec(subnet6=ipaddress.IPv6Network("fd00:1::/64")),
     live(enable_ipv6=True, subnets=("172.18.0.0/16", "fd00:1::/64")), 1500, []),
    ("explicit subnet6 differs (no probing)",
     spec(ipv6=True, subnet6=ipaddress.IPv6Network("fd00:1::/64")),
     live(enable_ipv6=True, subnets=OTHER64), 1500,
     [("subnet6", "fc00:1234:5678:9abc::/64", "fd00:1::/64")]),
    ("mtu declared differs", spec(mtu=1400), live(), 1500, [("mtu", "1500", "1400")]),
    ("mtu declared, default unknown", spec(mtu=1400), live(), None, [("mtu", "1500", "1400")]),
    ("mtu declared, live option absent, default unknown", spec(mtu=1400),
     live(options={OPT_MASQUERADE: "true"}), None, [("mtu", "(unset)", "1400")]),
    ("mtu from default differs", spec(), live(), 9000, [("mtu", "1500", "9000")]),
    ("mtu not compared when undeclared and default unknown", spec(),
     live(options={OPT_MASQUERADE: "true", OPT_MTU: "1234"}), None, []),
    ("mtu option absent equals daemon default", spec(),
     live(options={OPT_MASQUERADE: "true"}), 1500, []),
    ("mtu option absent, declared equal to daemon default", spec(mtu=1500),
     live(options={}), 1500, []),
    ("masquerade absent means on", spec(), live(options={OPT_MTU: "1500"}), 1500, []),
    ("masquerade off wanted", spec(masquerade=False), live(), 1500,
     [("masquerade", "true", "false")]),
    ("masquerade off live", spec(), live(options={OPT_MASQUERADE: "false", OPT_MTU: "1500"}),
     1500, [("masquerade", "false", "true")]),
    ("masquerade Go-bool spelling", spec(), live(options={OPT_MASQUERADE: "1", OPT_MTU: "1500"}),
     1500, []),
    ("masquerade garbage", spec(), live(options={OPT_MASQUERADE: "yes", OPT_MTU: "1500"}),
     1500, [("masquerade", "yes", "true")]),
    ("internal differs", spec(internal=True), live(), 1500, [("internal", "false", "true")]),
    ("labels subset ok, extras ignored", spec(labels=(("team", "infra"),)),
     live(labels={**OURS, "team": "infra", "other": "x"}), 1500, []),
    ("label missing", spec(labels=(("team", "infra"),)), live(), 1500,
     [("labels.team", "(absent)", "infra")]),
    ("label value differs", spec(labels=(("team", "infra"), ("env", "prod"))),
     live(labels={**OURS, "team": "net", "env": "prod"}), 1500,
     [("labels.team", "net", "infra")]),
    ("driver differs", spec(), live(driver="macvlan"), 1500, [("driver", "macvlan", "bridge")]),
    ("several at once", spec(ipv6=True, mtu=1400, masquerade=False, internal=True),
     live(), 1500,
     [("ipv6", "false", "true"), ("mtu", "1500", "1400"), ("masquerade", "true", "false"),
      ("internal", "false", "true")]),
]


@pytest.mark.parametrize("desired, observed, default_mtu, expected",
                         [c[1:] for c in DIFF_CASES], ids=[c[0] for c in DIFF_CASES])
def test_diff_network(desired: DockerNetwork, observed: LiveDockerNetwork,
                      default_mtu: int | None, expected: list[tuple[str, ...]]) -> None:
    got = diff_network(desired, observed, default_mtu)
    assert [d[:3] for d in got] == expected
    assert all(d[3] is True for d in got)  # Docker networks cannot be updated in place


def test_diff_of_captured_kind_network_is_empty() -> None:
    observed = parse_network(load("kind_owned_2_containers.json"))
    desired = spec(ipv6=True, labels=(("team", "infra"),))
    assert diff_network(desired, observed, parse_default_mtu(load("bridge.json"))) == []


def test_diff_of_captured_plain_network_shows_what_kind_misses() -> None:
    # kind's TODO: an existing network without IPv6 is silently accepted; we flag it.
    observed = parse_network(load("plain_cli_created.json"))
    got = diff_network(spec("plain", ipv6=True), observed, 1500)
    assert [d[0] for d in got] == ["ipv6"]
