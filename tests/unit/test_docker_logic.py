"""Docker driver logic without a daemon.

Pure functions are tested on payloads and error texts captured from a real
dockerd 20.10.24 (tests/unit/fixtures/docker/). The ensure/dedupe/replace
algorithms run against an in-memory fake of the SDK's low-level API, which
also lets us provoke daemon answers this host cannot produce (IPv6 missing).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import struct
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from reconciler.domain.docker import (
    IPV6_FALLBACK_LABEL,
    OPT_MASQUERADE,
    OPT_MTU,
    sort_duplicates,
    ula_subnet,
)
from reconciler.domain.errors import ConflictError, DriverError, TemporaryError
from reconciler.domain.live import LiveDockerNetwork
from reconciler.domain.model import DockerNetwork, DockerNetworkName
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.drivers.docker.client import DockerDriver
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
from reconciler.planner.docker_diff import diff_network

FIXTURES = Path(__file__).parent / "fixtures" / "docker"
OURS = {DOCKER_LABEL: DOCKER_LABEL_VALUE}


def load(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


ERRORS = load("errors.json")


def spec(name: str = "kind", **kw: Any) -> DockerNetwork:
    return DockerNetwork(name=DockerNetworkName(name), **kw)


def live(**kw: Any) -> LiveDockerNetwork:
    base: dict[str, Any] = dict(
        id="a" * 64, name="kind", driver="bridge", labels=dict(OURS),
        options={OPT_MASQUERADE: "true", OPT_MTU: "1500"}, enable_ipv6=False,
        internal=False, subnets=("172.18.0.0/16",), containers=0,
    )
    base.update(kw)
    return LiveDockerNetwork(**base)


# --------------------------------------------------------------------------
# ula_subnet
# --------------------------------------------------------------------------

def test_ula_subnet_matches_kind_for_kind() -> None:
    assert ula_subnet("kind", 0) == ipaddress.IPv6Network("fc00:f853:ccd:e793::/64")


def _independent_ula(name: str, attempt: int) -> ipaddress.IPv6Network:
    # Written from the description (sha1(name || int32le(attempt)), digest[2:8]
    # after fc00), independently of the implementation under test.
    h = hashlib.sha1()
    h.update(name.encode("utf-8"))
    h.update(attempt.to_bytes(4, "little", signed=True))
    d = h.digest()
    groups = ["fc00"] + [f"{d[i]:02x}{d[i + 1]:02x}" for i in (2, 4, 6)]
    return ipaddress.IPv6Network(":".join(groups) + "::/64")


@pytest.mark.parametrize("name", ["kind", "rt-0", "a", "ünïcode", "x" * 60])
@pytest.mark.parametrize("attempt", [0, 1, 2, 3, 4, -1, 2**31 - 1])
def test_ula_subnet_derivation(name: str, attempt: int) -> None:
    net = ula_subnet(name, attempt)
    assert net == _independent_ula(name, attempt)
    assert net.prefixlen == 64
    assert net.subnet_of(ipaddress.IPv6Network("fc00::/16"))


def test_ula_subnet_attempts_differ() -> None:
    assert len({ula_subnet("kind", a) for a in range(5)}) == 5
    assert struct.pack("<i", 1) == b"\x01\x00\x00\x00"


# --------------------------------------------------------------------------
# error classifiers, on texts the real daemon produced
# --------------------------------------------------------------------------

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
KIND_IPV6_ERRORS = [
    "Error response from daemon: Cannot read IPv6 setup for bridge br-1234: open "
    "/proc/sys/net/ipv6/conf/br-1234/disable_ipv6: no such file or directory",
    "Error response from daemon: Failed to Setup IP tables: Unable to enable NAT rule:  "
    "(iptables failed: ip6tables --wait -t nat -I POSTROUTING ...: exit status 3)",
    "Error response from daemon: setting default policy to DROP in FORWARD chain failed:  "
    "(iptables failed: ip6tables --wait -P FORWARD DROP: exit status 3)",
]


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


# --------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------

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


# --------------------------------------------------------------------------
# sort_duplicates
# --------------------------------------------------------------------------

def test_sort_duplicates_most_containers_then_lowest_id() -> None:
    nets = [live(id="c", containers=0), live(id="b", containers=2),
            live(id="a", containers=0), live(id="d", containers=2), live(id="e", containers=5)]
    assert [n.id for n in sort_duplicates(nets)] == ["e", "b", "d", "a", "c"]


def test_sort_duplicates_empty_and_iterables() -> None:
    assert sort_duplicates([]) == []
    assert [n.id for n in sort_duplicates(iter([live(id="z"), live(id="y")]))] == ["y", "z"]


# --------------------------------------------------------------------------
# diff_network
# --------------------------------------------------------------------------

V6 = ("172.18.0.0/16", "fc00:f853:ccd:e793::/64")
OTHER64 = ("172.18.0.0/16", "fc00:1234:5678:9abc::/64")

DIFF_CASES: list[tuple[str, DockerNetwork, LiveDockerNetwork, int | None, list[tuple[str, ...]]]]
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


# --------------------------------------------------------------------------
# The driver's algorithms against an in-memory SDK
# --------------------------------------------------------------------------

def api_error(text: str, cls: type[docker.errors.APIError] = docker.errors.APIError
              ) -> docker.errors.APIError:
    return cls(f'500 Server Error: ("{text}")', explanation=text)


class FakeAPI:
    """Just enough of ``docker.APIClient`` for the network driver."""

    def __init__(self) -> None:
        self.nets: dict[str, dict[str, Any]] = {}
        self.create_errors: list[str] = []  # raised by the next create calls, in order
        self.calls: list[tuple[str, Any]] = []
        self.containers: dict[str, dict[str, Any]] = {}
        self._next = 0
        self.add("bridge", options={OPT_MTU: "1500"}, id_="b" * 64)

    def add(self, name: str, *, labels: dict[str, str] | None = None, containers: int = 0,
            options: dict[str, str] | None = None, subnets: tuple[str, ...] = (),
            ipv6: bool = False, id_: str | None = None) -> str:
        self._next += 1
        nid = id_ or f"{self._next:02d}" + "0" * 62
        self.nets[nid] = {
            "Id": nid, "Name": name, "Driver": "bridge", "EnableIPv6": ipv6, "Internal": False,
            "IPAM": {"Config": [{"Subnet": s} for s in subnets]},
            "Containers": {f"{nid[:4]}c{i}": {"Name": f"c{i}"} for i in range(containers)},
            "Options": options or {}, "Labels": labels or {},
        }
        return nid

    def _find(self, ref: str) -> dict[str, Any]:
        for n in self.nets.values():
            if ref in (n["Id"], n["Name"]) or (len(ref) >= 12 and n["Id"].startswith(ref)):
                return n
        raise api_error(f"network {ref} not found", docker.errors.NotFound)

    def networks(self, names: Any = None, ids: Any = None, filters: Any = None) -> list[Any]:
        self.calls.append(("networks", filters))
        out = []
        for n in self.nets.values():
            if filters and "name" in filters and not re.search(filters["name"], n["Name"]):
                continue
            out.append({**n, "Containers": {}})
        return out

    def inspect_network(self, ref: str) -> dict[str, Any]:
        self.calls.append(("inspect", ref))
        return self._find(ref)

    def create_network(self, name: str, **kw: Any) -> dict[str, str]:
        self.calls.append(("create", (name, kw)))
        if self.create_errors:
            raise api_error(self.create_errors.pop(0))
        pools = kw["ipam"]["Config"] if kw.get("ipam") else []
        subnets = tuple(p["Subnet"] for p in pools) or ("172.20.0.0/16",)
        nid = self.add(name, labels=kw.get("labels"), options=kw.get("options"),
                       subnets=subnets, ipv6=kw.get("enable_ipv6", False))
        return {"Id": nid, "Warning": ""}

    def inspect_container(self, ref: str) -> dict[str, Any]:
        return self.containers.get(ref) or {"Id": ref, "Name": "/" + ref,
                                            "NetworkSettings": {"Networks": {}}}

    def remove_network(self, ref: str) -> None:
        self.calls.append(("remove", ref))
        n = self._find(ref)
        del self.nets[n["Id"]]


class FakeClient:
    def __init__(self) -> None:
        self.api = FakeAPI()

    def close(self) -> None:
        pass


@pytest.fixture
def fake() -> tuple[DockerDriver, FakeAPI]:
    client = FakeClient()
    return DockerDriver(client=client), client.api


def creates(api: FakeAPI) -> list[Any]:
    return [c[1] for c in api.calls if c[0] == "create"]


def pools(kw: dict[str, Any]) -> list[dict[str, str]]:
    """The IPAM pools of a create call, without the SDK's None-valued keys."""
    return [{k: v for k, v in p.items() if v is not None} for p in kw["ipam"]["Config"]]


def test_ensure_creates_with_kinds_options(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    res = drv.ensure(spec("kind", ipv6=True, labels=(("team", "infra"),)), 1500)
    assert res.created and res.attempt == 0 and res.subnet6 == "fc00:f853:ccd:e793::/64"
    (name, kw), = creates(api)
    assert name == "kind" and kw["driver"] == "bridge" and kw["check_duplicate"] is True
    assert kw["options"] == {OPT_MASQUERADE: "true", OPT_MTU: "1500"}
    assert kw["labels"] == {"team": "infra", **OURS}
    assert kw["enable_ipv6"] is True
    assert pools(kw) == [{"Subnet": "fc00:f853:ccd:e793::/64"}]


def test_ensure_v4_only_no_mtu_when_unknown(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    drv.ensure(spec("n", subnet=ipaddress.IPv4Network("10.1.0.0/24"), masquerade=False,
                    internal=True), None)
    (_, kw), = creates(api)
    assert kw["options"] == {OPT_MASQUERADE: "false"}
    assert kw["enable_ipv6"] is False and kw["internal"] is True
    assert pools(kw) == [{"Subnet": "10.1.0.0/24"}]


def test_ensure_existing_is_noop(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    nid = api.add("kind", labels=OURS)
    res = drv.ensure(spec("kind", ipv6=True), 1500)
    assert not res.created and res.network_id == nid and not creates(api)


def test_ensure_existing_foreign_is_conflict(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    api.add("kind")
    with pytest.raises(ConflictError, match="not managed by reconciler"):
        drv.ensure(spec("kind"), 1500)
    assert not creates(api)


def test_ensure_name_filter_is_exact(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    api.add("kind-other", labels=OURS)
    res = drv.ensure(spec("kind"), 1500)
    assert res.created


@pytest.mark.parametrize("msg", KIND_IPV6_ERRORS)
def test_ipv6_unavailable_falls_back_once(fake: tuple[DockerDriver, FakeAPI], msg: str) -> None:
    drv, api = fake
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
        fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    api.create_errors = [KIND_IPV6_ERRORS[1]]
    with pytest.raises(DriverError, match="cannot set up IPv6"):
        drv.ensure(spec("kind", subnet6=ipaddress.IPv6Network("fd00:1::/64")), 1500)


def test_ipv6_unavailable_only_on_first_attempt(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    overlap = ERRORS["pool_overlap"]["sdk_explanation"]
    api.create_errors = [overlap, daemon_message(KIND_IPV6_ERRORS[2])]
    with pytest.raises(DriverError, match="ip6tables"):
        drv.ensure(spec("kind", ipv6=True), 1500)
    assert len(creates(api)) == 2


def test_pool_overlap_probes_next_attempts(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    overlap = ERRORS["pool_overlap"]["sdk_explanation"]
    api.create_errors = [overlap, overlap]
    res = drv.ensure(spec("kind", ipv6=True), 1500)
    assert res.created and res.attempt == 2 and res.subnet6 == str(ula_subnet("kind", 2))
    asked = [kw["ipam"]["Config"][0]["Subnet"] for _, kw in creates(api)]
    assert asked == [str(ula_subnet("kind", a)) for a in range(3)]


def test_pool_overlap_exhausts_after_five(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    api.create_errors = [ERRORS["pool_overlap"]["sdk_explanation"]] * 6
    with pytest.raises(DriverError, match="exhausted attempts trying to find a non-overlapping "
                                          "subnet for docker network kind"):
        drv.ensure(spec("kind", ipv6=True), 1500)
    assert len(creates(api)) == 5


def test_pool_overlap_explicit_subnet6_no_probing(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    api.create_errors = [ERRORS["pool_overlap"]["sdk_explanation"]]
    with pytest.raises(DriverError, match="subnet6 fd00:1::/64 overlaps"):
        drv.ensure(spec("kind", subnet6=ipaddress.IPv6Network("fd00:1::/64")), 1500)
    assert len(creates(api)) == 1


def test_pool_overlap_on_declared_ipv4_names_the_other(fake: tuple[DockerDriver, FakeAPI]
                                                       ) -> None:
    drv, api = fake
    api.add("someone-else", subnets=("10.1.0.0/16",))
    api.create_errors = [ERRORS["pool_overlap"]["sdk_explanation"]]
    with pytest.raises(DriverError, match="overlaps docker network someone-else"):
        drv.ensure(spec("kind", ipv6=True, subnet=ipaddress.IPv4Network("10.1.2.0/24")), 1500)
    assert len(creates(api)) == 1


def test_pool_overlap_rechecks_existence(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
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


def test_already_exists_is_benign_and_dedupes(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake

    def racing_create(name: str, **kw: Any) -> dict[str, str]:
        api.add(name, labels=OURS, id_="9" * 64)
        api.add(name, labels=OURS, id_="1" * 64, containers=1)
        raise api_error(ERRORS["already_exists"]["sdk_explanation"])

    api.create_network = racing_create  # type: ignore[method-assign]
    res = drv.ensure(spec("kind"), 1500)
    assert not res.created and res.network_id == "1" * 64
    assert res.removed_duplicates == ("9" * 64,)


def test_ipv4_pool_exhausted_is_clear_and_no_loop(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    api.create_errors = [ERRORS["ipv4_pool_exhausted"]["sdk_explanation"]] * 10
    with pytest.raises(DriverError, match="default IPv4 address pools are exhausted"):
        drv.ensure(spec("kind", ipv6=True), 1500)
    assert len(creates(api)) == 1


def test_unknown_create_error_is_one_line(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    api.create_errors = ["invalid option foo"]
    with pytest.raises(DriverError) as err:
        drv.ensure(spec("kind"), 1500)
    assert str(err.value) == "docker network kind: ensure: invalid option foo"
    assert not isinstance(err.value, TemporaryError)


def test_dedupe_keeps_most_containers_then_lowest_id(fake: tuple[DockerDriver, FakeAPI]
                                                     ) -> None:
    drv, api = fake
    a = api.add("dup", labels=OURS, id_="3" * 64, containers=1)
    b = api.add("dup", labels=OURS, id_="2" * 64, containers=1)
    c = api.add("dup", labels=OURS, id_="1" * 64)
    res = drv.dedupe("dup")
    assert res.kept is not None and res.kept.id == b
    assert set(res.removed) == {a, c}
    assert [n["Id"] for n in api.nets.values() if n["Name"] == "dup"] == [b]


def test_dedupe_refuses_foreign(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    api.add("dup", labels=OURS, containers=2)
    api.add("dup")
    with pytest.raises(ConflictError, match="not ours"):
        drv.dedupe("dup")
    assert len([n for n in api.nets.values() if n["Name"] == "dup"]) == 2


def test_dedupe_single_or_none(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    assert drv.dedupe("nothing").kept is None
    nid = api.add("one")
    res = drv.dedupe("one")
    assert res.kept is not None and res.kept.id == nid and res.removed == ()


def test_dedupe_tolerates_vanished_duplicate(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
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
def test_remove_refuses_docker_networks(fake: tuple[DockerDriver, FakeAPI], name: str) -> None:
    drv, api = fake
    with pytest.raises(ConflictError, match="Docker's own"):
        drv.remove(name)


def test_remove_rules(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
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


def test_replace_without_containers(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    old = api.add("kind", labels=OURS)
    res = drv.replace(spec("kind", ipv6=True), parse_network(api.nets[old]), 1500,
                      reconnect=False)
    assert res.created and res.network_id != old and old not in api.nets


def test_replace_refuses_attached_containers_without_reconnect(
        fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    old = api.add("kind", labels=OURS, containers=2)
    with pytest.raises(ConflictError, match="2 container"):
        drv.replace(spec("kind"), parse_network(api.nets[old]), 1500, reconnect=False)
    assert old in api.nets


def test_replace_refuses_foreign_unless_adopting(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    old = api.add("kind")
    with pytest.raises(ConflictError, match="adopt"):
        drv.replace(spec("kind"), parse_network(api.nets[old]), 1500, reconnect=False)
    res = drv.replace(spec("kind"), parse_network(api.nets[old]), 1500, reconnect=False,
                      adopt=True)
    assert api.nets[res.network_id]["Labels"] == OURS


def test_observe_selects_wanted_and_owned(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake
    api.add("wanted")
    api.add("ours-pruned", labels=OURS, containers=3)
    api.add("unrelated")
    state = drv.observe(["wanted", "absent"])
    assert state.available and state.default_mtu == 1500
    assert [(n.name, n.containers) for n in state.networks] == [
        ("ours-pruned", 3), ("wanted", 0)]


def test_observe_never_raises_on_api_errors(fake: tuple[DockerDriver, FakeAPI]) -> None:
    drv, api = fake

    def broken(**kw: Any) -> Any:
        raise api_error("something broke")

    api.networks = broken  # type: ignore[assignment,method-assign]
    state = drv.observe(["x"])
    assert not state.available and state.error == "docker: listing networks failed: " \
                                                  "something broke"


def test_replace_puts_containers_back_when_delete_fails(fake: tuple[DockerDriver, FakeAPI]
                                                        ) -> None:
    drv, api = fake
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
