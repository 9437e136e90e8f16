"""Journals of multi-step changes, without a daemon: a replace killed after any step (or
between a step and its record) is carried to the same end by ``resume_replace``; the
journal file's life; the executor's change journal; finishing an interrupted adopt.

The kill points against the real dockerd and kernel are tests/integration/crash/test_journal.py.
"""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Any

import docker.errors
import pytest

from reconciler.domain.errors import DriverError
from reconciler.domain.ops import AllocAttach, AllocConfigure, LinkDelete, encode
from reconciler.domain.plan import Action, Change, Op
from reconciler.drivers import statedir
from reconciler.drivers.docker.client import DockerDriver
from reconciler.drivers.docker.payloads import parse_network
from reconciler.drivers.docker.replacement import Replacement
from reconciler.engine import finish
from reconciler.engine.executor import Executor
from reconciler.engine.journal import (
    ALLOC,
    DOCKER,
    BadJournal,
    Journals,
    describe,
    needs_journal,
)
from tests.support.dockerfake import OURS, FakeAPI, api_error, spec


class Killed(BaseException):
    """kill -9: nothing after it runs (no ``except Exception`` catches it)."""


class ContainerAPI(FakeAPI):
    """FakeAPI with containers that really are on and off networks."""

    def __init__(self) -> None:
        super().__init__()
        self.kill_at: int | None = None  # the Nth mutating call dies right after it is done
        self.mutations = 0

    def _mutated(self) -> None:
        self.mutations += 1
        if self.kill_at is not None and self.mutations == self.kill_at:
            raise Killed

    def run(self, cid: str, net_id: str, ipv4: str, ipv6: str, aliases: list[str]) -> None:
        self.containers[cid] = {"Id": cid, "Name": "/" + cid,
                                "NetworkSettings": {"Networks": {}}}
        self._attach(cid, net_id, ipv4, ipv6, aliases)

    def _attach(self, cid: str, net_id: str, ipv4: str | None, ipv6: str | None,
                aliases: list[str]) -> None:
        net = self._find(net_id)
        if ipv4 is None:  # the daemon picks the lowest free one
            used = {c["IPv4Address"] for c in net["Containers"].values()}
            ipv4 = next(f"172.20.0.{i}/16" for i in range(2, 250) if f"172.20.0.{i}/16"
                        not in used)
        net["Containers"][cid] = {"Name": cid, "IPv4Address": ipv4, "IPv6Address": ipv6 or ""}
        self.containers[cid]["NetworkSettings"]["Networks"][net["Name"]] = {
            "NetworkID": net["Id"], "Aliases": [*aliases, cid[:12]]}

    def connect_container_to_network(self, cid: str, net_id: str, ipv4_address: Any = None,
                                     ipv6_address: Any = None, aliases: Any = None,
                                     **_kw: Any) -> None:
        self.calls.append(("connect", cid))
        if cid not in self.containers:
            raise api_error(f"No such container: {cid}", docker.errors.NotFound)
        self._attach(cid, net_id, f"{ipv4_address}/16" if ipv4_address else None,
                     f"{ipv6_address}/64" if ipv6_address else None, list(aliases or []))
        self._mutated()

    def disconnect_container_from_network(self, cid: str, net_id: str, force: bool = False
                                          ) -> None:
        self.calls.append(("disconnect", cid))
        net = self._find(net_id)
        if cid not in net["Containers"]:
            raise api_error(f"container {cid} is not connected to network {net_id}")
        del net["Containers"][cid]
        del self.containers[cid]["NetworkSettings"]["Networks"][net["Name"]]
        self._mutated()

    def remove_network(self, ref: str) -> None:
        if self._find(ref)["Containers"]:
            raise api_error(f"error while removing network: network {ref} has active "
                            "endpoints")
        super().remove_network(ref)
        self._mutated()

    def create_network(self, name: str, **kw: Any) -> dict[str, str]:
        out = super().create_network(name, **kw)
        self._mutated()
        return out

    def inspect_container(self, ref: str) -> dict[str, Any]:
        if ref not in self.containers:
            raise api_error(f"No such container: {ref}", docker.errors.NotFound)
        return self.containers[ref]


class Recorded:
    """The driver's Steps, kept in memory as a journal would keep them."""

    def __init__(self) -> None:
        self.replacement: Replacement | None = None
        self.done: list[str] = []
        self.kill_after: int | None = None

    def begin(self, replacement: Replacement) -> None:
        # what a journal stores is its JSON: a resume must work from that alone
        self.replacement = Replacement.from_json(json.loads(json.dumps(
            replacement.to_json())))

    def step(self, step: str) -> None:
        self.done.append(step)
        if self.kill_after is not None and len(self.done) == self.kill_after:
            raise Killed


def steps(rec: Recorded) -> Any:
    class _S:
        def begin(self, r: Replacement) -> None:
            rec.begin(r)

        def done(self, s: str) -> None:
            rec.step(s)
    return _S()


CONTAINERS = {"c1": ["web"], "c2": ["db", "cache"], "c3": [], "c4": ["api"]}


def four(api: ContainerAPI) -> str:
    old = api.add("kind", labels=OURS, subnets=("172.20.0.0/16", "fd00:1::/64"), ipv6=True)
    for i, (cid, aliases) in enumerate(CONTAINERS.items()):
        api.run(cid, old, f"172.20.0.{10 + i}/16", f"fd00:1::{10 + i}/64", aliases)
    return old


def endpoints(api: ContainerAPI) -> dict[str, tuple[str, str, list[str]]]:
    (net,) = [n for n in api.nets.values() if n["Name"] == "kind"]
    return {cid: (ep["IPv4Address"], ep["IPv6Address"],
                  sorted(a for a in api.containers[cid]["NetworkSettings"]["Networks"]["kind"]
                         ["Aliases"] if a != cid[:12]))
            for cid, ep in net["Containers"].items()}


def everything_back(api: ContainerAPI, before: dict[str, Any], old: str) -> None:
    assert old not in api.nets
    (net,) = [n for n in api.nets.values() if n["Name"] == "kind"]
    assert net["Options"]["com.docker.network.driver.mtu"] == "1400"
    assert endpoints(api) == before


# 4 disconnects, remove, create, 4 connects: every instant a kill can land
STEPS = 10


@pytest.mark.parametrize("kill_after", range(1, STEPS + 1))
@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "not-recorded"])
def test_a_replace_killed_after_any_step_is_finished_by_resume(kill_after: int,
                                                               recorded: bool) -> None:
    """``recorded``: killed after the step's record; else between the step and its record
    (the step happened, the journal does not say so)."""
    api = ContainerAPI()
    drv = DockerDriver(client=type("C", (), {"api": api, "close": lambda self: None})())
    old = four(api)
    before = endpoints(api)
    rec = Recorded()
    if recorded:
        rec.kill_after = kill_after
    else:
        api.kill_at = kill_after
    with pytest.raises(Killed):
        drv.replace(spec("kind", ipv6=True, mtu=1400), parse_network(api.nets[old]), 1500,
                    reconnect=True, steps=steps(rec))
    assert rec.replacement is not None
    api.kill_at = None
    rec.kill_after = None
    result = drv.resume_replace(rec.replacement, frozenset(rec.done), steps(rec))
    everything_back(api, before, old)
    assert sorted(result.reconnected) == sorted(CONTAINERS) and not result.gone
    assert not result.undone
    # once more (a kill before the journal was removed): nothing moves
    calls = len(api.calls)
    drv.resume_replace(rec.replacement, frozenset(rec.done), steps(rec))
    assert [c for c in api.calls[calls:] if c[0] in ("connect", "disconnect", "create",
                                                     "remove")] == []
    everything_back(api, before, old)


def test_begin_comes_before_the_first_disconnect_and_a_failing_begin_changes_nothing(
        ) -> None:
    api = ContainerAPI()
    drv = DockerDriver(client=type("C", (), {"api": api, "close": lambda self: None})())
    old = four(api)

    class Full:
        def begin(self, r: Replacement) -> None:
            raise OSError(28, "No space left on device")

        def done(self, s: str) -> None:
            raise AssertionError("no step may run")

    with pytest.raises(DriverError, match="No space left"):
        drv.replace(spec("kind", mtu=1400), parse_network(api.nets[old]), 1500,
                    reconnect=True, steps=Full())
    assert len(api.nets[old]["Containers"]) == 4
    assert not [c for c in api.calls if c[0] in ("disconnect", "remove", "create")]


def test_resume_names_a_container_gone_meanwhile_and_reattaches_the_rest() -> None:
    api = ContainerAPI()
    drv = DockerDriver(client=type("C", (), {"api": api, "close": lambda self: None})())
    old = four(api)
    before = endpoints(api)
    rec = Recorded()
    rec.kill_after = 5  # after the removal
    with pytest.raises(Killed):
        drv.replace(spec("kind", ipv6=True, mtu=1400), parse_network(api.nets[old]), 1500,
                    reconnect=True, steps=steps(rec))
    del api.containers["c2"]
    assert rec.replacement is not None
    rec.kill_after = None
    result = drv.resume_replace(rec.replacement, frozenset(rec.done), steps(rec))
    assert result.gone == ("c2",) and sorted(result.reconnected) == ["c1", "c3", "c4"]
    assert endpoints(api) == {k: v for k, v in before.items() if k != "c2"}


def test_a_new_network_that_cannot_be_made_is_undone_with_the_old_settings() -> None:
    api = ContainerAPI()
    drv = DockerDriver(client=type("C", (), {"api": api, "close": lambda self: None})())
    old = four(api)
    before = endpoints(api)
    rec = Recorded()
    api.create_errors = ["invalid option foo"]
    with pytest.raises(DriverError, match="invalid option foo; restored the old network"):
        drv.replace(spec("kind", ipv6=True, mtu=1400), parse_network(api.nets[old]), 1500,
                    reconnect=True, steps=steps(rec))
    assert "undo" in rec.done
    (net,) = [n for n in api.nets.values() if n["Name"] == "kind"]
    assert "com.docker.network.driver.mtu" not in net["Options"]  # the old settings
    assert endpoints(api) == before


# -- the journal file -----------------------------------------------------------------------

@pytest.fixture
def state(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Journals:
    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    return Journals("netns/t")


def test_journal_round_trip_and_nothing_is_made_until_a_change_needs_it(
        state: Journals, tmp_path: Any) -> None:
    assert state.names() == [] and state.find(DOCKER, "n") is None
    assert not (tmp_path / "state").exists()
    j = state.new(DOCKER, "n")
    j.begin({"x": 1})
    j.done("remove")
    assert state.names() == ["journal-docker_network-n.json"]
    mode = os.stat(tmp_path / "state" / "netns-t").st_mode & 0o777
    assert mode == 0o700
    again = state.find(DOCKER, "n")
    assert again is not None and again.body == {"x": 1} and again.steps == ["remove"]
    j.close()
    assert state.names() == [] and list(state.pending()) == []


def test_a_damaged_journal_is_reported_not_guessed(state: Journals) -> None:
    j = state.new(DOCKER, "n")
    j.begin({})
    with open(j.path, "w") as fh:
        fh.write('{"format": 99}')
    (bad,) = list(state.pending())
    assert isinstance(bad, BadJournal) and "format 99" in str(bad)


ADOPT_OPS = (encode(LinkDelete("eth0", netns="a")),
             encode(AllocAttach("a", "vr1", "br", None, False)),
             encode(AllocConfigure("a", ("10.0.0.2/24",), ("10.0.0.1",), None, False, "m")))


def test_only_a_change_that_deletes_inside_a_namespace_before_attaching_needs_one() -> None:
    assert needs_journal(Change("alloc", "a", Action.UPDATE, "", (), ADOPT_OPS))
    assert not needs_journal(Change("alloc", "a", Action.CREATE, "", (), ADOPT_OPS[1:]))
    assert not needs_journal(Change("veth", "v", Action.DELETE, "", (),
                                    (encode(LinkDelete("vr1")),)))


class Ops:
    """A HostOps stand-in: records ops, may fail the Nth."""

    def __init__(self, journals: Journals, fail_at: int | None = None) -> None:
        self.journals = journals
        self.ran: list[str] = []
        self.fail_at = fail_at

    def run(self, op: Op) -> None:
        if self.fail_at is not None and len(self.ran) + 1 == self.fail_at:
            raise DriverError(f"{op.name}: Operation not permitted")
        self.ran.append(op.name)


def test_an_adopt_failed_after_deleting_eth0_keeps_its_journal_and_the_next_run_finishes_it(
        state: Journals) -> None:
    change = Change("alloc", "a", Action.UPDATE, "changed: veth", (), ADOPT_OPS)
    ops = Ops(state, fail_at=2)
    from reconciler.domain.plan import Plan
    (outcome,) = Executor(ops, journal=lambda c: state.for_change(c, adopt=True)).execute(
        Plan((change,)))
    assert outcome.status == "failed" and ops.ran == ["link.delete"]
    j = state.find(ALLOC, "a")
    assert j is not None and j.steps == ["op:0"] and j.body["adopt"] is True
    ops.fail_at = None
    (line,) = finish.finish_journals(ops)  # type: ignore[arg-type]
    assert line == ("alloc a: finished an interrupted adopt (started by another run): "
                    "2 of 3 step(s) left")
    assert ops.ran == ["link.delete", "alloc.attach", "alloc.configure"]
    assert state.names() == []


def test_an_adopt_that_cannot_be_finished_says_so_once(state: Journals) -> None:
    j = state.for_change(Change("alloc", "a", Action.UPDATE, "", (), ADOPT_OPS), adopt=True)
    assert j is not None
    j.done("op:0")
    ops = Ops(state, fail_at=1)
    (line,) = finish.finish_journals(ops)  # type: ignore[arg-type]
    assert line.startswith("alloc a: could not finish an interrupted adopt: alloc.attach")
    assert "--adopt alloc/a" in line
    assert finish.finish_journals(ops) == []  # removed: no loop  # type: ignore[arg-type]


def test_a_completed_change_leaves_no_journal(state: Journals) -> None:
    ops = Ops(state)
    from reconciler.domain.plan import Plan
    Executor(ops, journal=lambda c: state.for_change(c, adopt=True)).execute(
        Plan((Change("alloc", "a", Action.UPDATE, "", (), ADOPT_OPS),)))
    assert ops.ran == ["link.delete", "alloc.attach", "alloc.configure"]
    assert state.names() == []
    assert statedir.list_records(os.path.join(statedir.state_root(), "netns-t")) == []


def test_replacement_json_round_trip() -> None:
    api = ContainerAPI()
    drv = DockerDriver(client=type("C", (), {"api": api, "close": lambda self: None})())
    old = four(api)
    rec = Recorded()
    rec.kill_after = 1
    with pytest.raises(Killed):
        drv.replace(spec("kind", ipv6=True), parse_network(api.nets[old]), 1500,
                    reconnect=True, steps=steps(rec))
    r = rec.replacement
    assert r is not None and r.old_id == old and len(r.endpoints) == 4
    assert r.pinned6 == ipaddress.IPv6Network("fd00:1::/64")
    assert r.new.subnet == ipaddress.IPv4Network("172.20.0.0/16")
    assert {e.container_id: e.aliases for e in r.endpoints} == {
        k: tuple(v) for k, v in CONTAINERS.items()}
    assert Replacement.from_json(r.to_json()) == r
    with pytest.raises(ValueError, match="format"):
        Replacement.from_json({**r.to_json(), "format": 2})


def test_plan_describes_a_journal_from_its_name() -> None:
    assert describe("journal-docker_network-my-net.json").startswith(
        "docker network my-net: a replace that a killed run left half done")
    assert describe("journal-alloc-a-1.json").startswith("alloc a-1: a change that a killed")


def test_a_full_disk_refuses_the_change_at_begin_but_never_stops_it_halfway(
        state: Journals, monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.domain.errors import PreconditionError
    from reconciler.engine import journal as journal_mod

    j = state.new(DOCKER, "n")
    j.begin({"x": 1})

    def full(*_a: Any, **_k: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_mod.statedir, "write_record", full)
    j.done("remove")  # logged, not raised: the replace goes on
    again = state.find(DOCKER, "n")
    assert again is not None and again.steps == []  # finishing from here is still right
    with pytest.raises(PreconditionError, match="cannot write its journal .*nothing changed"):
        state.new(DOCKER, "m").begin({})


# -- a replace that cannot be put back, or finds another's network (review items 4 and 5) --

class DaemonGoes(ContainerAPI):
    """Disconnecting ``refuse`` fails for good (an APIError); with ``goes_away`` the daemon
    is gone right after that refusal: every connect is a refused connection until ``gone``
    is cleared (the put-back connect is what fails)."""

    def __init__(self, refuse: str, *, goes_away: bool = True) -> None:
        super().__init__()
        self.refuse = refuse
        self.goes_away = goes_away
        self.gone = False

    def disconnect_container_from_network(self, cid: str, net_id: str, force: bool = False
                                          ) -> None:
        if cid == self.refuse:
            self.gone = self.goes_away  # the refusal is the daemon's last word
            raise api_error("container sandbox is being torn down")
        super().disconnect_container_from_network(cid, net_id, force)

    def connect_container_to_network(self, cid: str, net_id: str, **kw: Any) -> None:
        if self.gone:
            import requests.exceptions  # noqa: PLC0415 (only these tests)
            raise requests.exceptions.ConnectionError("Connection refused")
        super().connect_container_to_network(cid, net_id, **kw)


def _hostops(api: FakeAPI, journals: Journals) -> Any:
    from reconciler.engine.handles import HostHandles  # noqa: PLC0415
    from reconciler.engine.hostops import HostOps  # noqa: PLC0415
    drv = DockerDriver(client=type("C", (), {"api": api, "close": lambda self: None})())
    return HostOps(HostHandles(netlink=object(), docker=drv),  # type: ignore[arg-type]
                   journals=journals)


def _replace_op(api: ContainerAPI, old: str, scope: str = "host") -> Op:
    from reconciler.domain.docker import spec_to_json  # noqa: PLC0415
    from reconciler.domain.ops import DockerReplace  # noqa: PLC0415
    return encode(DockerReplace(spec_to_json(spec("kind", ipv6=True, mtu=1400)), 1500, scope,
                                old, True, False))


def attached(api: ContainerAPI, cid: str) -> str | None:
    """The ID of the network ``kind`` container ``cid`` is on, as the fake daemon has it."""
    net = api.containers[cid]["NetworkSettings"]["Networks"].get("kind")
    return None if net is None else str(net["NetworkID"])


def test_a_put_back_that_fails_keeps_the_journal_and_the_next_run_puts_the_container_back(
        state: Journals) -> None:
    """c1 is off the network, disconnecting c2 is refused, and the daemon goes before c1 is
    put back: the journal must stay (it alone knows c1 is detached) and the next run must
    attach c1 to the network again."""
    from reconciler.domain.errors import TemporaryError  # noqa: PLC0415

    api = DaemonGoes(refuse="c2")
    old = four(api)
    before = endpoints(api)
    ops = _hostops(api, state)
    with pytest.raises(TemporaryError, match="could not put back c1"):
        ops.run(_replace_op(api, old))
    assert attached(api, "c1") is None  # detached, and the daemon is gone
    assert state.names() == ["journal-docker_network-kind.json"]
    api.gone = False  # the daemon is back; c2 can be disconnected again too
    api.refuse = ""
    (line,) = finish.finish_journals(ops)
    assert line.startswith("docker network kind: undid an interrupted replace (started by "
                           "another run): 4 container(s) attached"), line
    assert {cid: attached(api, cid) for cid in CONTAINERS} == dict.fromkeys(CONTAINERS, old)
    assert endpoints(api) == before
    assert state.names() == []


def test_a_put_back_that_works_ends_the_replace_and_its_journal(state: Journals) -> None:
    api = DaemonGoes(refuse="c2", goes_away=False)
    old = four(api)
    before = endpoints(api)
    ops = _hostops(api, state)
    with pytest.raises(DriverError, match="container sandbox is being torn down"):
        ops.run(_replace_op(api, old))
    assert endpoints(api) == before and state.names() == []


def test_resume_never_attaches_our_containers_to_another_scopes_network(
        state: Journals) -> None:
    """Killed after the removal; meanwhile another reconciler (another scope) made a network
    of that name. The containers must not go there: a conflict that keeps the journal, and
    once that network is gone the next run finishes the replace."""
    from reconciler.domain.docker import SCOPE_LABEL  # noqa: PLC0415
    from reconciler.domain.errors import ConflictError  # noqa: PLC0415

    api = ContainerAPI()
    old = four(api)
    before = endpoints(api)
    ops = _hostops(api, state)
    api.kill_at = 5  # 4 disconnects, the removal
    with pytest.raises(Killed):
        ops.run(_replace_op(api, old))
    api.kill_at = None
    theirs = api.add("kind", labels={**OURS, SCOPE_LABEL: "netns/other"},
                     subnets=("172.20.0.0/16",))
    (line,) = finish.finish_journals(ops)
    assert "belongs to another reconciler" in line and "kept for the next run" in line, line
    assert all(attached(api, cid) is None for cid in CONTAINERS)
    assert state.names() == ["journal-docker_network-kind.json"]
    # the executor's retry path (the same op again) refuses the same way
    with pytest.raises(ConflictError, match="netns/other"):
        ops.run(_replace_op(api, old))
    assert all(attached(api, cid) is None for cid in CONTAINERS)
    assert state.names() == ["journal-docker_network-kind.json"]
    # a network of that name nobody owns is no better
    del api.nets[theirs]
    foreign = api.add("kind", subnets=("172.20.0.0/16",))
    (line,) = finish.finish_journals(ops)
    assert "not managed by reconciler" in line and "kept for the next run" in line, line
    assert all(attached(api, cid) is None for cid in CONTAINERS)
    del api.nets[foreign]
    (line,) = finish.finish_journals(ops)
    assert line.startswith("docker network kind: finished an interrupted replace"), line
    assert endpoints(api) == before and state.names() == []


def test_resume_keeps_our_own_network_made_before_its_step_was_recorded(
        state: Journals) -> None:
    """The create happened but was not recorded: the network of that name is ours (our
    scope) and the containers go onto it, as before."""
    api = ContainerAPI()
    old = four(api)
    before = endpoints(api)
    ops = _hostops(api, state)
    api.kill_at = 6  # 4 disconnects, the removal, the create (not recorded yet)
    with pytest.raises(Killed):
        ops.run(_replace_op(api, old))
    api.kill_at = None
    (line,) = finish.finish_journals(ops)
    assert line.startswith("docker network kind: finished an interrupted replace"), line
    assert endpoints(api) == before and state.names() == []
