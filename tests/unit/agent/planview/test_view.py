"""When the plan agent's view is reused: an unchanged host reuses the observation and the
plan; each kind of event re-reads only what it names; a lost event or a failure forgets
the view."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from reconciler.agent.planview.sentinels import EVERYTHING, Sentinel
from reconciler.agent.planview.view import LiveView
from reconciler.domain.live import LiveLink, LiveNeighbour, LiveNetns, LiveState
from reconciler.domain.model import Alloc, AllocId, DesiredState, SubnetName
from reconciler.domain.plan import Plan
from reconciler.planner import PlanOptions


class FakeSentinel(Sentinel):
    """Reports ``units`` once when set (EVERYTHING when only ``fire`` is set)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fire = False
        self.units: set[str] = set()
        self.armed = 0
        self.polled = 0

    def arm(self) -> None:
        self.armed += 1

    def changed(self) -> bool:
        raise AssertionError("LiveView asks dirty()")

    def dirty(self) -> set[str]:
        self.polled += 1
        out = set(self.units) or ({EVERYTHING} if self.fire else set())
        self.fire, self.units = False, set()
        return out


class FakeNetlink:
    def __init__(self) -> None:
        self.nsids: dict[str, int] = {}
        self.aliases: dict[str, str | None] = {}
        self.pruned = 0
        self.links: dict[str, Any] = {}
        self.dumps = 0

    def get_nsid(self, name: str) -> int | None:
        return self.nsids.get(name)

    def peek_lo_alias(self, name: str) -> str | None:
        return self.aliases.get(name)

    def prune_cache(self, keep: Any) -> None:
        self.pruned += 1

    def dump_links(self) -> dict[str, Any]:
        self.dumps += 1
        return dict(self.links)


class FakeFirewall:
    def __init__(self) -> None:
        self.reads = 0

    def observe(self) -> Any:
        self.reads += 1
        return LiveState().firewall4


class FakeOps:
    def __init__(self) -> None:
        self.netlink = FakeNetlink()
        self.fw = FakeFirewall()

    def iptables(self, family: int) -> FakeFirewall:
        return self.fw


class FakeObserver:
    def __init__(self) -> None:
        self.handles = FakeOps()
        self.live = LiveState()
        self.sysctls = {"net/ipv4/ip_forward": "1"}
        self.namespaces: dict[str, LiveNetns] = {}
        self.observed = 0
        self.ns_reads: list[list[str]] = []
        self.alloc_reads = 0
        self.routes: tuple[Any, ...] = ()
        self.route_reads = 0
        self.docker_space: Any = None
        self.neighbours: tuple[Any, ...] = ()
        self.neighbour_reads = 0

    def observe(self, desired: DesiredState) -> LiveState:
        self.observed += 1
        return dataclasses.replace(self.live, sysctls=dict(self.sysctls),
                                   netns=dict(self.namespaces),
                                   links=self.handles.netlink.dump_links(),
                                   neighbours=self.neighbours)

    def observe_unannounced(self, desired: DesiredState) -> dict[str, Any]:
        return {"sysctls": dict(self.sysctls), "listening": frozenset()}

    def observe_leases(self) -> dict[str, Any]:
        return {"leases": {}, "leases_problem": None}

    def observe_links(self, desired: DesiredState) -> dict[str, Any]:
        return self.handles.netlink.dump_links()

    def observe_firewall(self) -> dict[str, Any]:
        """Our table and the iptables rules: one read."""
        return {"firewall4": self.handles.fw.observe()}

    def observe_neighbours(self, desired: DesiredState, links: Any) -> tuple[Any, ...]:
        self.neighbour_reads += 1
        return self.neighbours

    def observe_namespaces(self, names: Any) -> dict[str, LiveNetns]:
        self.ns_reads.append(sorted(names))
        return {n: self.namespaces[n] for n in names if n in self.namespaces}

    def observe_allocs(self, desired: DesiredState, host_id: str,
                       links: Any = None) -> dict[str, LiveNetns]:
        self.alloc_reads += 1
        return dict(self.namespaces)

    def observe_peer_namespaces(self, desired: DesiredState, links: Any,
                                allocs: Any) -> dict[int, str]:
        return {}

    def observe_docker(self, desired: DesiredState) -> Any:
        return None

    def observe_docker_parts(self, desired: DesiredState) -> dict[str, Any]:
        return {"docker": None, "docker_space": self.docker_space}

    def observe_routes(self, desired: DesiredState) -> Any:
        self.route_reads += 1
        return self.routes


@pytest.fixture
def parts() -> tuple[LiveView, FakeObserver, list[FakeSentinel], list[str]]:
    obs = FakeObserver()
    sentinels = [FakeSentinel("a"), FakeSentinel("b")]
    names: list[str] = []
    view = LiveView(obs, sentinels, firewall_volatile=False,  # type: ignore[arg-type]
                    docker_volatile=False, list_names=lambda: list(names), planner=fake_plan)
    return view, obs, sentinels, names


OPTS = PlanOptions()


D = DesiredState()


#: declares alloc1 and alloc2 (the planner is faked: only the names matter here)
D2 = DesiredState(allocs={AllocId(n): Alloc(AllocId(n), SubnetName("net"))
                          for n in ("alloc1", "alloc2")})


def fake_plan(desired: DesiredState, live: LiveState, options: PlanOptions,
              files: Any = ()) -> Plan:
    return Plan(options={"prune": options.prune})


def test_unchanged_host_reuses_the_observation_and_the_plan(parts: Any) -> None:
    view, obs, sentinels, _names = parts
    p1, how1 = view.plan(D, "k", OPTS)
    p2, how2 = view.plan(D, "k", OPTS)
    assert (how1, how2, obs.observed) == ("observed", "cached", 1)
    assert p2 is p1
    assert all(s.armed == 1 for s in sentinels)


def test_a_lost_event_means_observing_again_and_all_sentinels_are_drained(parts: Any) -> None:
    view, obs, sentinels, _names = parts
    view.plan(D, "k", OPTS)
    sentinels[0].fire = True
    sentinels[1].units = {"links"}
    assert view.plan(D, "k", OPTS)[1] == "observed" and obs.observed == 2
    assert all(s.polled == 1 for s in sentinels)  # the second was read although the first fired
    assert view.plan(D, "k", OPTS)[1] == "cached"


def test_unannounced_values_are_compared_on_every_request(parts: Any) -> None:
    view, obs, _s, _names = parts
    view.plan(D, "k", OPTS)
    obs.sysctls = {"net/ipv4/ip_forward": "0"}  # a sysctl changes without any event
    p_before = view.plans
    plan, how = view.plan(D, "k", OPTS)
    assert how == "refreshed" and obs.observed == 1 and view.plans is not p_before
    assert view.live.sysctls == {"net/ipv4/ip_forward": "0"}


def test_neighbour_entries_are_read_on_every_request(parts: Any) -> None:
    # no neighbour events are heard: a stale entry on a bridge must still reach the plan
    view, obs, _s, _names = parts
    view.plan(D, "k", OPTS)
    assert view.plan(D, "k", OPTS)[1] == "cached" and obs.neighbour_reads == 1
    obs.neighbours = (LiveNeighbour(5, "10.0.0.2", "aa:00:00:00:00:02", False),)
    p_before = view.plans
    _plan, how = view.plan(D, "k", OPTS)
    assert how == "refreshed" and obs.observed == 1 and view.plans is not p_before
    assert view.live.neighbours == obs.neighbours and obs.neighbour_reads == 2


def test_other_files_or_options(parts: Any) -> None:
    view, obs, _s, _names = parts
    view.plan(D, "k", OPTS)
    assert view.plan(D, "k2", OPTS)[1] == "observed"  # other files: observed for them
    p_prune, _ = view.plan(D, "k2", OPTS)
    p_keep, how = view.plan(D, "k2", PlanOptions(prune=False))
    assert how == "cached" and p_keep is not p_prune and p_keep.options["prune"] is False
    assert obs.observed == 2


def test_host_link_events_reread_the_host_links_only(parts: Any) -> None:
    view, obs, sentinels, _names = parts
    view.plan(D, "k", OPTS)
    sentinels[0].units = {"links"}
    assert view.plan(D, "k", OPTS)[1] == "cached"  # read again, same: the plan stands
    assert obs.handles.netlink.dumps == 2 and obs.observed == 1
    obs.handles.netlink.links = {"eth9": LiveLink("eth9", 9, "veth", 1500, True, False)}
    sentinels[0].units = {"links"}  # another tool's veth: kept, but the plan stands
    assert view.plan(D, "k", OPTS)[1] == "cached"
    assert set(view.live.links) == {"eth9"} and obs.observed == 1
    obs.handles.netlink.links["br9"] = LiveLink("br9", 10, "bridge", 1500, True, owned=True)
    sentinels[0].units = {"links"}  # a link of ours: planned again
    assert view.plan(D, "k", OPTS)[1] == "refreshed" and obs.observed == 1


def test_host_route_events_reread_the_routes_and_replan_only_when_they_matter(
        parts: Any) -> None:
    """Plans depend on host routes over declared prefixes (planner.addrspace): a route
    datagram re-reads the routes; one far from every declared prefix keeps the plan."""
    import ipaddress

    from reconciler.domain.live import LiveRoute
    from reconciler.domain.model import Bridge, BridgeName, Subnet

    view, obs, sentinels, _names = parts
    net = ipaddress.IPv4Network("10.1.0.0/24")
    d = DesiredState(bridges={BridgeName("b"): Bridge(BridgeName("b"))},
                     subnets={SubnetName("s"): Subnet(SubnetName("s"), BridgeName("b"), net)})
    view.plan(d, "k", OPTS)
    obs.routes = (LiveRoute("10.200.0.0/16", None, False, oif=7),)
    sentinels[0].units = {"routes"}
    assert view.plan(d, "k", OPTS)[1] == "cached" and obs.route_reads == 1
    assert view.live.routes == obs.routes  # kept up to date all the same
    obs.routes = (LiveRoute("10.1.0.0/25", None, False, oif=7),)  # over the declared subnet
    sentinels[0].units = {"routes"}
    assert view.plan(d, "k", OPTS)[1] == "refreshed" and obs.route_reads == 2
    sentinels[0].units = {"links"}  # links re-read routes too: a link down drops its routes
    obs.routes = ()
    assert view.plan(d, "k", OPTS)[1] == "refreshed" and obs.route_reads == 3
    assert obs.observed == 1


def test_other_docker_networks_keep_the_plan_unless_they_meet_a_declared_prefix() -> None:
    """Docker is read on every request; networks far from every declared prefix (other
    tools' containers' networks come and go) leave the plan standing."""
    import ipaddress

    from reconciler.domain.live import DockerAddressSpace, DockerNetworkUse
    from reconciler.domain.model import Bridge, BridgeName, Subnet

    obs = FakeObserver()
    view = LiveView(obs, [FakeSentinel("a")], firewall_volatile=False,  # type: ignore[arg-type]
                    docker_volatile=True, list_names=list, planner=fake_plan)
    d = DesiredState(bridges={BridgeName("b"): Bridge(BridgeName("b"))},
                     subnets={SubnetName("s"): Subnet(SubnetName("s"), BridgeName("b"),
                                                      ipaddress.IPv4Network("10.1.0.0/24"))})
    obs.docker_space = DockerAddressSpace(True, (), (("10.9.0.0/16", 24),))
    obs.live = dataclasses.replace(obs.live, docker_space=obs.docker_space)
    view.plan(d, "k", OPTS)

    def net(name: str, subnet: str) -> DockerNetworkUse:
        return DockerNetworkUse(name, name * 8, (subnet,), f"br-{name}")

    obs.docker_space = DockerAddressSpace(True, (net("far", "10.9.3.0/24"),),
                                          (("10.9.0.0/16", 24),))
    assert view.plan(d, "k", OPTS)[1] == "cached"
    obs.docker_space = DockerAddressSpace(True, (net("far", "10.9.3.0/24"),
                                                 net("near", "10.1.0.0/16")),
                                          (("10.9.0.0/16", 24),))
    assert view.plan(d, "k", OPTS)[1] == "refreshed"
    assert obs.observed == 1


def test_namespace_events_reread_that_namespace_only(parts: Any) -> None:
    view, obs, sentinels, names = parts
    names += ["alloc1", "alloc2", "theirs", "alias-of-2"]
    obs.namespaces = {"alloc1": LiveNetns("alloc1", True), "alloc2": LiveNetns("alloc2", True)}
    # alias-of-2: the same namespace bind-mounted under a second name
    obs.handles.netlink.nsids = {"alloc1": 1, "alloc2": 2, "theirs": 3, "alias-of-2": 2}
    view.plan(D2, "k", OPTS)
    obs.namespaces["alloc2"] = LiveNetns("alloc2", True, nsid=2)  # its route went, say
    sentinels[0].units = {"nsid:2", "nsid:77"}  # 77: not under /run/netns, ignored
    assert view.plan(D2, "k", OPTS)[1] == "refreshed"
    assert obs.ns_reads == [["alloc2"]] and obs.alloc_reads == 0 and obs.observed == 1
    assert view.live.netns["alloc2"].nsid == 2
    sentinels[0].units = {"nsid:3"}  # a foreign namespace: only its lo alias matters
    assert view.plan(D2, "k", OPTS)[1] == "cached" and obs.alloc_reads == 0
    obs.handles.netlink.aliases["theirs"] = "managed-by=reconciler alloc-of=1"
    sentinels[0].units = {"nsid:3"}
    view.plan(D2, "k", OPTS)
    assert obs.alloc_reads == 1  # it may be ours now: every namespace is looked at again


def test_an_undeclared_namespace_of_ours_is_judged_again(parts: Any) -> None:
    """Ours by its lo mark only: an event there may mean the mark went, so ownership is
    decided again over all namespaces, not just its contents re-read."""
    view, obs, sentinels, names = parts
    names.append("old1")
    obs.namespaces = {"old1": LiveNetns("old1", True)}
    obs.handles.netlink.nsids = {"old1": 5}
    view.plan(D, "k", OPTS)
    del obs.namespaces["old1"]  # lo alias changed: no longer ours
    sentinels[0].units = {"nsid:5"}
    assert view.plan(D, "k", OPTS)[1] == "refreshed"
    assert obs.alloc_reads == 1 and obs.ns_reads == [] and "old1" not in view.live.netns


def test_a_namespace_read_before_it_had_an_nsid_is_not_cached(parts: Any) -> None:
    view, obs, _s, names = parts
    obs.namespaces = {"alloc1": LiveNetns("alloc1", True)}  # appears after the survey
    view.plan(D2, "k", OPTS)
    assert view.plan(D2, "k", OPTS)[1] == "observed"


def test_run_netns_changes_reread_the_namespaces(parts: Any) -> None:
    view, obs, sentinels, _names = parts
    view.plan(D, "k", OPTS)
    sentinels[1].units = {"netns"}
    obs.namespaces = {"new": LiveNetns("new", True)}
    assert view.plan(D, "k", OPTS)[1] == "refreshed"
    assert obs.alloc_reads == 1 and set(view.live.netns) == {"new"} and obs.observed == 1


def test_firewall_events_reread_the_rules(parts: Any) -> None:
    view, obs, sentinels, _names = parts
    view.plan(D, "k", OPTS)
    sentinels[0].units = {"firewall"}
    assert view.plan(D, "k", OPTS)[1] == "cached" and obs.handles.fw.reads == 1


def test_an_allocation_namespace_without_nsid_is_never_cached(parts: Any) -> None:
    view, obs, _s, names = parts
    names.append("alloc1")
    obs.namespaces = {"alloc1": LiveNetns("alloc1", True)}
    view.plan(D2, "k", OPTS)
    assert view.plan(D2, "k", OPTS)[1] == "observed"
    obs.handles.netlink.nsids["alloc1"] = 3  # now its events reach us
    view.plan(D2, "k", OPTS)
    assert view.plan(D2, "k", OPTS)[1] == "cached"


def test_foreign_namespace_without_nsid_is_peeked_each_time(parts: Any) -> None:
    view, obs, _s, names = parts
    names.append("theirs")
    view.plan(D, "k", OPTS)
    assert view.plan(D, "k", OPTS)[1] == "cached"
    obs.handles.netlink.aliases["theirs"] = "managed-by=reconciler alloc-of=1"
    view.plan(D, "k", OPTS)
    assert obs.alloc_reads == 1
    assert obs.handles.netlink.pruned >= 2  # no socket is kept into namespaces between requests


def test_a_sentinel_failing_or_an_observation_failing_forgets_the_view(parts: Any) -> None:
    view, obs, sentinels, _names = parts
    view.plan(D, "k", OPTS)

    def broken() -> set[str]:
        raise OSError("socket gone")

    sentinels[1].dirty = broken  # type: ignore[method-assign]
    sentinels[0].units = {"links"}  # drained before the failure: its news must not be lost
    assert view.plan(D, "k", OPTS)[1] == "observed"
    del sentinels[1].dirty
    assert view.plan(D, "k", OPTS)[1] == "cached"

    def failing(desired: DesiredState) -> LiveState:
        raise RuntimeError("netlink dump failed")

    obs.observe = failing
    sentinels[0].fire = True
    with pytest.raises(RuntimeError):
        view.plan(D, "k", OPTS)
    assert view.live is None  # the next request observes, whatever the sentinels say
