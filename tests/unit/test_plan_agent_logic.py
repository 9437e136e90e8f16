"""The plan agent's pure parts: which command lines the client sends, when the view is reused."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from reconciler.live import LiveNetns, LiveState
from reconciler.model import DesiredState
from reconciler.planclient import PlanCall, Unanswered, normalise_argv
from reconciler.planner import PlanOptions
from reconciler.planserver import LiveView, Sentinel

# ------------------------------------------------------------------ the client's command line


def test_plain_plan_is_sent_with_its_paths() -> None:
    c = PlanCall(["plan", "a.yaml", "conf/"])
    assert c.paths == ["a.yaml", "conf/"] and c.rest == ["a.yaml", "conf/"]
    assert (c.netns, c.verbose, c.output, c.out, c.no_agent) == (None, 0, "text", None, False)


def test_global_and_plan_options_are_understood() -> None:
    c = PlanCall(["--netns", "sb", "-v", "--color=never", "plan", "--output", "json",
                  "--adopt", "bridge/b", "--no-prune", "--hostname=h1", "d/", "--out", "p.json"])
    assert (c.netns, c.verbose, c.color, c.output, c.out) == ("sb", 1, "never", "json", "p.json")
    assert c.paths == ["d/"]
    assert c.rest == ["--output", "json", "--adopt", "bridge/b", "--no-prune", "--hostname=h1",
                      "d/", "--out", "p.json"]
    assert PlanCall(["--netns=sb", "plan", "a"]).netns == "sb"


@pytest.mark.parametrize("argv", [
    ["apply", "a.yaml"],                  # another command
    ["-vv", "plan", "a.yaml"],            # debug logs come from the planning process
    ["plan", "--bogus", "a.yaml"],        # an option the client does not know
    ["--color", "purple", "plan", "a"],   # the CLI words bad values
    ["plan", "--output"],                 # option without its value
    ["--netns"],                          # no command
    ["--version"],
])
def test_anything_unusual_is_left_to_the_cli(argv: list[str]) -> None:
    with pytest.raises(Unanswered):
        PlanCall(argv)


def test_no_agent_and_the_plan_alias() -> None:
    assert PlanCall(["plan", "--no-agent", "a"]).no_agent
    assert normalise_argv(["--netns", "x", "--plan", "a"]) == ["--netns", "x", "plan", "a"]
    assert normalise_argv(["apply", "--plan"]) == ["apply", "--plan"]


def test_bad_namespace_names_are_left_to_the_cli() -> None:
    with pytest.raises(Unanswered):
        PlanCall(["--netns", "../etc", "plan", "a"]).target_inode()


# ------------------------------------------------------------------ when the view is reused


class FakeSentinel(Sentinel):
    def __init__(self, name: str) -> None:
        self.name = name
        self.fire = False
        self.armed = 0
        self.polled = 0

    def arm(self) -> None:
        self.armed += 1
        self.fire = False

    def changed(self) -> bool:
        self.polled += 1
        fired, self.fire = self.fire, False
        return fired


class FakeNetlink:
    def __init__(self) -> None:
        self.nsids: dict[str, int] = {}
        self.aliases: dict[str, str | None] = {}
        self.pruned = 0

    def get_nsid(self, name: str) -> int | None:
        return self.nsids.get(name)

    def peek_lo_alias(self, name: str) -> str | None:
        return self.aliases.get(name)

    def prune_cache(self, keep: Any) -> None:
        self.pruned += 1


class FakeObserver:
    def __init__(self) -> None:
        self.ops = type("Ops", (), {})()
        self.ops.netlink = FakeNetlink()
        self.live = LiveState()
        self.sysctls = {"net/ipv4/ip_forward": "1"}
        self.observed = 0

    def observe(self, desired: DesiredState) -> LiveState:
        self.observed += 1
        return dataclasses.replace(self.live, sysctls=dict(self.sysctls))

    def observe_unannounced(self, desired: DesiredState) -> dict[str, Any]:
        return {"sysctls": dict(self.sysctls), "listening": frozenset()}


@pytest.fixture
def parts() -> tuple[LiveView, FakeObserver, list[FakeSentinel], list[str]]:
    obs = FakeObserver()
    sentinels = [FakeSentinel("a"), FakeSentinel("b")]
    names: list[str] = []
    view = LiveView(obs, sentinels, firewall_volatile=False,  # type: ignore[arg-type]
                    docker_volatile=False, list_names=lambda: list(names))
    return view, obs, sentinels, names


OPTS = PlanOptions()


def test_unchanged_host_reuses_the_observation_and_the_plan(parts: Any) -> None:
    view, obs, sentinels, _names = parts
    d = DesiredState()
    p1, reused1 = view.plan(d, "k", OPTS)
    p2, reused2 = view.plan(d, "k", OPTS)
    assert (reused1, reused2, obs.observed) == (False, True, 1)
    assert p2 is p1
    assert all(s.armed == 1 for s in sentinels)


def test_any_sentinel_firing_means_observing_again_and_all_are_drained(parts: Any) -> None:
    view, obs, sentinels, _names = parts
    d = DesiredState()
    view.plan(d, "k", OPTS)
    sentinels[0].fire = True
    sentinels[1].fire = True
    _plan, reused = view.plan(d, "k", OPTS)
    assert not reused and obs.observed == 2
    assert all(s.polled == 1 for s in sentinels)  # the second was read although the first fired
    assert view.plan(d, "k", OPTS)[1]


def test_unannounced_values_are_compared_on_every_request(parts: Any) -> None:
    view, obs, _s, _names = parts
    d = DesiredState()
    view.plan(d, "k", OPTS)
    obs.sysctls = {"net/ipv4/ip_forward": "0"}  # a sysctl changes without any event
    assert not view.plan(d, "k", OPTS)[1] and obs.observed == 2


def test_other_files_or_options(parts: Any) -> None:
    view, obs, _s, _names = parts
    d = DesiredState()
    view.plan(d, "k", OPTS)
    assert not view.plan(d, "k2", OPTS)[1]  # other files: observed for them
    p_prune, _ = view.plan(d, "k2", OPTS)
    p_keep, reused = view.plan(d, "k2", PlanOptions(prune=False))
    assert reused and p_keep is not p_prune and p_keep.options["prune"] is False
    assert obs.observed == 2


def test_an_allocation_namespace_without_nsid_is_never_cached(parts: Any) -> None:
    view, obs, _s, names = parts
    names.append("alloc1")
    obs.live = dataclasses.replace(LiveState(), netns={"alloc1": LiveNetns("alloc1", True)})
    d = DesiredState()
    view.plan(d, "k", OPTS)
    assert not view.plan(d, "k", OPTS)[1]
    obs.ops.netlink.nsids["alloc1"] = 3  # now its events reach us
    view.plan(d, "k", OPTS)
    assert view.plan(d, "k", OPTS)[1]


def test_foreign_namespace_without_nsid_is_peeked_each_time(parts: Any) -> None:
    view, obs, _s, names = parts
    names.append("theirs")
    d = DesiredState()
    view.plan(d, "k", OPTS)
    assert view.plan(d, "k", OPTS)[1]
    obs.ops.netlink.aliases["theirs"] = "managed-by=reconciler alloc-of=1"
    assert not view.plan(d, "k", OPTS)[1]
    assert obs.ops.netlink.pruned >= 2  # no socket is kept into namespaces between requests


def test_a_sentinel_failing_or_an_observation_failing_forgets_the_view(parts: Any) -> None:
    view, obs, sentinels, _names = parts
    d = DesiredState()
    view.plan(d, "k", OPTS)

    def broken() -> bool:
        raise OSError("socket gone")

    sentinels[1].changed = broken  # type: ignore[method-assign]
    sentinels[0].fire = True  # drained before the failure: its news must not be lost
    assert not view.plan(d, "k", OPTS)[1]
    del sentinels[1].changed
    assert view.plan(d, "k", OPTS)[1]

    def failing(desired: DesiredState) -> LiveState:
        raise RuntimeError("netlink dump failed")

    obs.observe = failing
    sentinels[0].fire = True
    with pytest.raises(RuntimeError):
        view.plan(d, "k", OPTS)
    assert view.live is None  # the next request observes, whatever the sentinels say
