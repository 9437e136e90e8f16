"""`reconcile gc`: the pure removals (planner.gc) over an in-memory host, the collector's
run, and the stale-file drivers on a temporary directory."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.domain.docker import SCOPE_LABEL
from reconciler.domain.errors import PlanError
from reconciler.domain.live import LiveDocker, LiveDockerNetwork, LiveLink
from reconciler.domain.model import DesiredState
from reconciler.domain.nftable import Entry
from reconciler.domain.ops import AddrAdd, FirewallNft, LinkAddBridge, LinkDelete, encode
from reconciler.domain.ownership import DOCKER_LABEL, alloc_veth_name
from reconciler.domain.plan import Action, Change, Op, Plan
from reconciler.drivers import rundir, statedir
from reconciler.engine import lock
from reconciler.engine.gc import Collector, GcResult, StaleFile
from reconciler.planner import firewall
from reconciler.planner.gc import gc_plan, only_removals
from reconciler.ui import gc as gc_view
from tests.support.fakehost import FakeHost, FakeNetns
from tests.support.planning import alloc, bridge, converge, port, state, subnet


def addresses(p: Plan) -> dict[str, Action]:
    return {c.address: c.action for c in p.actionable}


def three(host: FakeHost) -> DesiredState:
    desired = state(alloc("a", port(8080, 80)), alloc("b", port(8081, 80)),
                    alloc("c", port(8082, 80)))
    converge(host, desired)
    return desired


def dnat(host: FakeHost) -> list[str]:
    return host.ours(4).get(("nat", firewall.DNAT), [])


def collect(host: FakeHost, desired: DesiredState | None, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> GcResult:
    monkeypatch.setattr(lock, "LOCK_DIR", str(tmp_path / "lock"))
    c = Collector(host, runner=host, sleep=lambda _s: None,  # type: ignore[arg-type]
                  who_holds=lambda _names: {}, files=list, remove=lambda _f: False,
                  vantage=lambda _host: None)
    return c.collect(desired)


def test_a_converged_host_has_nothing_to_collect():
    host = FakeHost()
    desired = three(host)
    for files in (None, desired):
        p = gc_plan(host.observe(files or DesiredState()), files)
        assert not p.has_changes and not p.errors


def test_broken_halves_are_collected_whole_allocations_are_not():
    host = FakeHost()
    three(host)
    host.perform(LinkDelete(alloc_veth_name("a")))  # namespace a keeps no veth
    del host.netns["b"]  # unmounted while something holds it: its veth stays behind
    p = gc_plan(host.observe(DesiredState()))
    assert addresses(p) == {"alloc/a": Action.DELETE,
                            f"veth/{alloc_veth_name('b')}": Action.DELETE}
    # their rules stay without files (the files may declare them: their auto ports)
    (kept,) = p.warnings
    assert "alloc a, alloc b" in kept and "alloc c" not in kept
    # with files that declare c only, they go too
    only_c = state(alloc("c", port(8082, 80)))
    p = gc_plan(host.observe(only_c), only_c)
    # b's bridge-side neighbour entry (exempt from the kernel's GC) names no live allocation
    assert addresses(p) == {"alloc/a": Action.DELETE,
                            f"veth/{alloc_veth_name('b')}": Action.DELETE,
                            "neighbour/br0/10.0.0.3": Action.DELETE,
                            "firewall/nftables": Action.UPDATE}
    # a's goes with its namespace
    (gone,) = [c for c in p.actionable if c.address == "alloc/a"]
    assert [(o.name, o.args.get("address")) for o in gone.ops][-1] == ("neigh.delete",
                                                                       "10.0.0.2")
    fw = next(c for c in p.actionable if c.kind == "firewall")
    assert "alloc=a" in fw.reason and "alloc=b" in fw.reason and "alloc=c" not in fw.reason


def test_rules_of_a_vanished_alloc_go_with_nothing_added(tmp_path, monkeypatch):
    host = FakeHost()
    three(host)
    host.netns.pop("c")  # `ip netns del`: the namespace and its veth are gone
    host.links.pop(alloc_veth_name("c"))
    jumps = list(host.fw[4].chains[("nat", "PREROUTING")])
    result = collect(host, state(alloc("a", port(8080, 80)), alloc("b", port(8081, 80))),
                     tmp_path, monkeypatch)
    assert result.ok and result.residual is not None and not result.residual.has_changes
    assert [r for r in dnat(host) if "alloc=c" in r] == []
    assert len([r for r in dnat(host) if "alloc=" in r]) == 2
    assert host.fw[4].chains[("nat", "PREROUTING")] == jumps
    assert set(host.netns) == {"a", "b"}


def test_a_missing_entry_is_not_added_back():
    host = FakeHost()
    three(host)
    host.netns.pop("c")
    host.links.pop(alloc_veth_name("c"))
    # someone deleted one of a's elements: gc only deletes, it never adds it back
    host.table.entries = {e for e in host.table.entries
                          if not (e.owner == "alloc=a" and e.set == "pm4")}
    kept = state(alloc("a", port(8080, 80)), alloc("b", port(8081, 80)))
    fw = next(c for c in gc_plan(host.observe(kept), kept).actionable
              if c.kind == "firewall")
    args = fw.ops[0].args
    assert not args["add"] and not args["rebuild"], args
    assert {d["owner"] for d in args["delete"]} == {"alloc=c"}


def test_foreign_look_alikes_are_never_listed():
    host = FakeHost()
    three(host)
    # an unmarked veth named like ours, an unmarked temporary-bridge name, another host's
    # allocation namespace without a veth
    host.add_link(alloc_veth_name("zz"), "veth")
    host.links["rcltmp0123abcd"] = LiveLink("rcltmp0123abcd", 99, "bridge", 1500, False, False)
    host.netns["other"] = FakeNetns(77, {"lo": LiveLink("lo", 1, "", 65536, True, False,
                                                        alias="managed-by=reconciler "
                                                              "alloc-of=1")})
    host.fw[4].chains[("filter", "FORWARD")].append(
        "-m comment --comment reconciler:alloc=foreign -j ACCEPT")  # not in a chain of ours
    p = gc_plan(host.observe(DesiredState()))
    assert not p.has_changes, addresses(p)


def test_a_held_namespace_without_veth_is_left_alone_without_files():
    host = FakeHost()
    desired = three(host)
    host.links.pop(alloc_veth_name("a"))
    host.netns["a"].links.pop("eth0")
    p = gc_plan(host.observe(DesiredState()), holders={"a": (4242,)})
    assert "alloc/a" not in addresses(p)
    assert any("pid 4242" in w for w in p.warnings)
    # its rules stay with it
    assert "firewall/nftables" not in addresses(p)
    # declared: healed by apply, never collected
    assert "alloc/a" not in addresses(gc_plan(host.observe(desired), desired))


def test_with_files_also_what_a_prune_removes_and_only_that(tmp_path, monkeypatch):
    host = FakeHost()
    three(host)
    kept = state(alloc("a", port(8080, 80)), alloc("b", port(8081, 80)))
    p = gc_plan(host.observe(kept), kept)
    assert addresses(p) == {"alloc/c": Action.DELETE, "firewall/nftables": Action.UPDATE}
    # the declared ones need no change: nothing of them is in the plan either way
    host.netns["a"].links["eth0"] = dataclasses.replace(host.netns["a"].links["eth0"],
                                                        addresses=())
    assert "alloc/a" not in addresses(gc_plan(host.observe(kept), kept))
    result = collect(host, kept, tmp_path, monkeypatch)
    assert result.ok
    assert set(host.netns) == {"a", "b"}
    assert not host.netns["a"].links["eth0"].addresses  # gc did not heal it: apply does
    assert not gc_plan(host.observe(kept), kept).has_changes


def test_with_files_that_declare_nothing_everything_owned_goes(tmp_path, monkeypatch):
    host = FakeHost()
    three(host)
    host.add_link("eth9", "dummy")
    result = collect(host, DesiredState(), tmp_path, monkeypatch)
    assert result.ok
    assert set(host.links) == {"eth9"} and not host.netns
    assert not any(c.startswith("RECONCILER") for _t, c in host.fw[4].chains)


def test_a_declared_bridge_keeps_its_mtu_when_gc_takes_its_last_ports():
    host = FakeHost()
    desired = state(alloc("a"), br=bridge(mtu=9000))
    converge(host, desired)
    p = gc_plan(host.observe(state(br=bridge(mtu=9000))), state(br=bridge(mtu=9000)))
    assert addresses(p)["alloc/a"] is Action.DELETE
    assert addresses(p)["bridge/br0"] is Action.UPDATE  # its MTU set to what it is


def _docker(host: FakeHost, *nets: LiveDockerNetwork) -> DesiredState:
    real = host.observe

    def observe(desired: DesiredState):  # type: ignore[no-untyped-def]
        return dataclasses.replace(real(desired), docker=LiveDocker(True, networks=nets))

    host.observe = observe  # type: ignore[method-assign]
    return DesiredState()


def _net(name: str, labels: dict[str, str]) -> LiveDockerNetwork:
    return LiveDockerNetwork(f"{name}-id", name, "bridge", labels, {}, False, False, (), 0)


def test_docker_networks_are_collected_only_with_files_only_ours_of_our_scope():
    host = FakeHost()
    ours = {DOCKER_LABEL: "true", SCOPE_LABEL: "host"}
    _docker(host, _net("mine", ours), _net("theirs", {}),
            _net("sandbox", {**ours, SCOPE_LABEL: "netns/x"}))
    assert not gc_plan(host.observe(DesiredState())).has_changes
    p = gc_plan(host.observe(DesiredState()), DesiredState())
    assert addresses(p) == {"docker_network/mine": Action.DELETE}


def test_a_plan_with_anything_but_removals_is_refused():
    host = FakeHost()
    live = host.observe(DesiredState())
    for op in (encode(LinkAddBridge("br9", None)), encode(AddrAdd("br9", "10.0.0.1/24"))):
        with pytest.raises(PlanError, match="is not a removal"):
            only_removals(Plan((Change("bridge", "br9", Action.DELETE, ops=(op,)),)), live)
    entry = Entry("guarded", ("br9",), (), "bridge=br9").wire()
    for fw in (FirewallNft(add=(entry,)), FirewallNft(rebuild=True), FirewallNft(delete=(entry,)),
               FirewallNft(cleanup4="*filter\n-I FORWARD 1 -j ACCEPT\nCOMMIT\n")):
        with pytest.raises(PlanError, match="is not a removal"):
            only_removals(Plan((Change("firewall", "nftables", Action.UPDATE,
                                       ops=(encode(fw),)),)), live)


def test_text_and_exit_codes():
    host = FakeHost()
    three(host)
    del host.netns["b"]
    kept = state(alloc("a", port(8080, 80)), alloc("c", port(8082, 80)))
    p = gc_plan(host.observe(kept), kept)
    files = [StaleFile("/run/reconciler/netns-1.lock", "run", "a lock nobody holds")]
    report = GcResult(p, files)
    out = gc_view.text(report)
    assert f"  - veth {alloc_veth_name('b')}: orphan" in out
    assert "  - file /run/reconciler/netns-1.lock: a lock nobody holds" in out
    assert "  - neighbour br0/10.0.0.3: orphan: ours (extern_learn, proto 82)" in out
    assert "Gc: 3 objects (1 firewall, 1 neighbour, 1 veth) and 1 file to collect." in out
    assert gc_view.exit_code(report) == 2
    assert gc_view.exit_code(GcResult(Plan(), [])) == 0
    assert gc_view.text(GcResult(Plan(), [])) == "Nothing to collect.\n"
    assert gc_view.exit_code(GcResult(Plan(errors=("docker: down",)), [])) == 1
    assert gc_view.to_json(report)["files"] == [f.to_json() for f in files]
    left = GcResult(Plan(), [], vantage="rcprobe-1")
    assert gc_view.exit_code(left) == 2 and "  - probe vantage rcprobe-1: left by" in \
        gc_view.text(left)


# -- the stale-file drivers -------------------------------------------------------------------

def test_run_files_nobody_uses_are_listed_and_removed(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "netns-1.lock").touch()
    held = run / "netns-2.lock"
    held.touch()
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    (run / "notours.lock").touch()
    os.symlink("/etc/passwd", run / "netns-3.lock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(run / "plan-1.sock"))
    dead.close()
    alive = socket.socket(socket.AF_UNIX)
    alive.bind(str(run / "plan-2.sock"))
    alive.listen(1)
    served = socket.socket(socket.AF_UNIX)  # its server holds its lock: never connected to
    served.bind(str(run / "plan-3.sock"))
    (run / "plan-3.lock").touch()
    fd3 = os.open(run / "plan-3.lock", os.O_RDONLY)
    fcntl.flock(fd3, fcntl.LOCK_EX)
    try:
        stale = rundir.stale_files(str(run))
        assert [os.path.basename(p) for p, _ in stale] == ["plan-1.sock", "netns-1.lock"]
        for p, _why in stale:
            assert rundir.remove_stale(p)
        assert sorted(os.listdir(run)) == ["netns-2.lock", "netns-3.lock", "notours.lock",
                                           "plan-2.sock", "plan-3.lock", "plan-3.sock"]
        assert not rundir.remove_stale(str(held))
    finally:
        os.close(fd)
        os.close(fd3)
        alive.close()
        served.close()


def test_a_lock_replaced_after_it_was_listed_is_not_removed(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "netns-1.lock").touch()
    [(path, _why)] = rundir.stale_files(str(run))
    os.unlink(path)  # its holder released it, a new holder made and holds a new one
    Path(path).touch()
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert not rundir.remove_stale(path)
        assert os.path.exists(path)
    finally:
        os.close(fd)


def test_temporaries_of_dead_writers_are_stale(tmp_path: Path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(gone.stdout)
    scope = tmp_path / "netns-x"
    scope.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    (scope / f".pending.json.{pid}.tmp").touch()
    (scope / f".journal-1.json.{os.getpid()}.tmp").touch()  # a live writer's
    (scope / "pending.json").touch()
    stale = statedir.stale_temporaries("netns/x", root=str(tmp_path))
    assert [os.path.basename(p) for p, _ in stale] == [f".pending.json.{pid}.tmp"]
    assert statedir.remove_temporary(stale[0][0])
    assert not statedir.remove_temporary(str(scope / f".journal-1.json.{os.getpid()}.tmp"))
    assert sorted(os.listdir(scope)) == [f".journal-1.json.{os.getpid()}.tmp", "pending.json"]
    assert statedir.stale_temporaries("netns/none", root=str(tmp_path)) == []
    assert not (tmp_path / "netns-none").exists()  # never made


def test_ipv6_rules_of_a_vanished_alloc_go_too(tmp_path, monkeypatch):
    host = FakeHost()
    desired = state(alloc("a", port(8080, 80)), alloc("b", port(8081, 80)),
                    sub=subnet(cidr6="fd00::/64"))
    converge(host, desired)
    assert any("alloc=b" in r for r in host.ours(6)[("nat", firewall.DNAT)])
    host.netns.pop("b")
    host.links.pop(alloc_veth_name("b"))
    kept = state(alloc("a", port(8080, 80)), sub=subnet(cidr6="fd00::/64"))
    p = gc_plan(host.observe(kept), kept)
    assert addresses(p) == {"firewall/nftables": Action.UPDATE,
                            "neighbour/br0/10.0.0.3": Action.DELETE,
                            "neighbour/br0/fd00::3": Action.DELETE}
    assert collect(host, kept, tmp_path, monkeypatch).ok
    assert sorted(n.address for n in host.neighbours) == ["10.0.0.2", "fd00::2"]
    for family in (4, 6):
        rules = host.ours(family)[("nat", firewall.DNAT)]
        assert not [r for r in rules if "alloc=b" in r] and [r for r in rules if "alloc=a" in r]


# -- the review's fixes (fix-gc) ---------------------------------------------------------------

def test_a_temporary_bridge_marked_only_by_its_mac_is_collected():
    """A kill between creating the temporary bridge and setting its alias leaves the MAC it
    was made with as its only mark: the planner removes it (``hostlinks``), so gc does."""
    from reconciler.domain.ownership import temp_bridge_mac
    host = FakeHost()
    three(host)
    for name in ("rcltmp0a1b2c3d", "rcltmp0a1b2c3e"):
        host.add_link(name, "bridge")
        host.links[name] = dataclasses.replace(host.links[name], up=False)
    host.links["rcltmp0a1b2c3d"] = dataclasses.replace(
        host.links["rcltmp0a1b2c3d"], mac=temp_bridge_mac("rcltmp0a1b2c3d"))
    # the same MAC on another bridge is no mark of that one
    host.links["rcltmp0a1b2c3e"] = dataclasses.replace(
        host.links["rcltmp0a1b2c3e"], mac=temp_bridge_mac("rcltmp0a1b2c3d"))
    for files in (None, DesiredState()):
        p = gc_plan(host.observe(files or DesiredState()), files)
        assert addresses(p).get("bridge/rcltmp0a1b2c3d") is Action.DELETE, addresses(p)
        assert "bridge/rcltmp0a1b2c3e" not in addresses(p)


def test_an_owned_network_without_a_scope_label_is_the_hosts():
    """Networks made before they carried the scope label are the host scope's, as the
    planner reads them (``domain.docker.network_scope``)."""
    host = FakeHost()
    _docker(host, _net("old", {DOCKER_LABEL: "true"}))
    p = gc_plan(host.observe(DesiredState()), DesiredState())
    assert addresses(p) == {"docker_network/old": Action.DELETE}


def test_without_files_the_rules_of_a_vanished_alloc_are_kept_with_a_warning(
        tmp_path, monkeypatch):
    """Its namespace went by hand, but the files may still declare it: its DNAT rules hold
    its ``auto`` host ports, which the next apply keeps only if they are still there."""
    host = FakeHost()
    three(host)
    host.netns.pop("c")
    host.links.pop(alloc_veth_name("c"))
    before = dnat(host)
    p = gc_plan(host.observe(DesiredState()))
    assert not p.has_changes, addresses(p)
    (warning,) = p.warnings
    assert "alloc c" in warning and "gc PATH" in warning, warning
    result = collect(host, None, tmp_path, monkeypatch)
    assert result.ok and dnat(host) == before
    assert "Nothing to collect." in gc_view.text(result) and "alloc c" in gc_view.text(result)
    # with files that no longer declare it, they go (and only its)
    kept = state(alloc("a", port(8080, 80)), alloc("b", port(8081, 80)))
    result = collect(host, kept, tmp_path, monkeypatch)
    assert result.ok
    assert [r for r in dnat(host) if "alloc=c" in r] == []
    assert len([r for r in dnat(host) if "alloc=" in r]) == 2


class Keeper:
    """The journals of a killed run, for the collector: finishing one runs its last op."""

    def __init__(self, host: FakeHost, pending: dict[str, Op], lock_path: str) -> None:
        self.host, self.pending, self.lock_path = host, pending, lock_path
        self.finished_locked: list[bool] = []

    def journal_notes(self) -> list[str]:
        return [f"alloc {n}: a change that a killed run left half done" for n in self.pending]

    def finish_journals(self) -> list[str]:
        self.finished_locked.append(not rundir.lock_is_free(self.lock_path))
        lines = []
        for name, op in sorted(self.pending.items()):
            self.host.run(op)
            lines.append(f"alloc {name}: finished an interrupted heal")
        self.pending = {}
        return lines


def test_gc_finishes_interrupted_changes_under_the_lock_before_it_plans(tmp_path, monkeypatch):
    """A heal killed after it deleted the veth and before it attached the new one: gc
    would take the namespace for a broken half and delete it. Finished first, it is whole."""
    from reconciler.domain.ops import AllocAttach
    host = FakeHost()
    three(host)
    host.perform(LinkDelete(alloc_veth_name("a")))
    host.netns["a"].links.pop("eth0", None)
    assert "alloc/a" in addresses(gc_plan(host.observe(DesiredState())))
    monkeypatch.setattr(lock, "LOCK_DIR", str(tmp_path / "lock"))
    keeper = Keeper(host, {"a": encode(AllocAttach("a", alloc_veth_name("a"), "br0", None,
                                                    False))}, lock.lock_path())
    c = Collector(host, runner=host, sleep=lambda _s: None,  # type: ignore[arg-type]
                  who_holds=lambda _names: {}, files=list, remove=lambda _f: False,
                  vantage=lambda _host: None, journals=keeper)
    # --plan changes nothing: it says a journal is pending, and exits 2
    report = c.report(None)
    assert keeper.pending and report.notes == [
        "alloc a: a change that a killed run left half done"]
    assert gc_view.exit_code(report) == 2
    result = c.collect(None)
    assert keeper.finished_locked == [True]
    assert result.finished == ["alloc a: finished an interrupted heal"]
    assert "alloc/a" not in addresses(result.plan) and set(host.netns) == {"a", "b", "c"}
    assert gc_view.to_json(result)["journals"] == result.finished
    assert gc_view.exit_code(c.report(None)) == 0


def test_gc_plan_with_a_pending_journal_exits_2_even_with_nothing_to_collect():
    report = GcResult(Plan(), [], notes=["docker network n: a replace …"])
    assert gc_view.exit_code(report) == 2
    assert gc_view.to_json(report)["notes"] == ["docker network n: a replace …"]
    assert gc_view.exit_code(GcResult(Plan(errors=("x",)), [], notes=["n"])) == 1


def test_odd_temporaries_are_skipped(tmp_path: Path):
    """A pid no process can have (too big for the kernel's pid_t, 0) names no writer: the
    entry is not ours to judge, so it is neither listed nor removed, and nothing fails."""
    scope = tmp_path / "netns-x"
    scope.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    for name in (".x.99999999999999999999.tmp", ".x.0.tmp", ".x.4294967296.tmp"):
        (scope / name).touch()
        assert not statedir.remove_temporary(str(scope / name))
    (scope / ".dir.1.tmp").mkdir()  # not a regular file
    assert statedir.stale_temporaries("netns/x", root=str(tmp_path)) == []
    assert len(os.listdir(scope)) == 4


def test_a_run_or_state_directory_that_is_not_a_directory_is_one_line(tmp_path: Path):
    from reconciler.domain.errors import PreconditionError
    os.chmod(tmp_path, 0o700)
    afile = tmp_path / "run"
    afile.write_text("")
    with pytest.raises(PreconditionError, match="it is not a directory"):
        rundir.stale_files(str(afile))
    with pytest.raises(PreconditionError, match="(?i)cannot read .*not a directory"):
        rundir.stale_files(str(afile / "below"))
    (tmp_path / "netns-x").write_text("")
    with pytest.raises(PreconditionError, match="it is not a directory"):
        statedir.stale_temporaries("netns/x", root=str(tmp_path))
    with pytest.raises(PreconditionError, match="(?i)cannot read .*not a directory"):
        statedir.stale_temporaries("netns/x", root=str(afile))


def test_gc_removes_nothing_while_a_journal_cannot_be_finished(tmp_path, monkeypatch):
    """The daemon unreachable: the journal is kept for the next run, and gc, which would
    take its halves for leaks, stops with one error naming it."""
    from reconciler.domain.errors import PreconditionError
    from reconciler.domain.ops import AllocAttach
    host = FakeHost()
    three(host)
    host.perform(LinkDelete(alloc_veth_name("a")))
    monkeypatch.setattr(lock, "LOCK_DIR", str(tmp_path / "lock"))

    class Stuck(Keeper):
        def finish_journals(self) -> list[str]:
            return ["alloc a: could not finish an interrupted heal yet: …; kept for the next run"]

    keeper = Stuck(host, {"a": encode(AllocAttach("a", "x", "br0", None, False))},
                   lock.lock_path())
    c = Collector(host, runner=host, sleep=lambda _s: None,  # type: ignore[arg-type]
                  who_holds=lambda _names: {}, files=list, remove=lambda _f: False,
                  vantage=lambda _host: None, journals=keeper)
    ran = len(host.log)
    with pytest.raises(PreconditionError, match="nothing collected") as err:
        c.collect(None)
    assert "alloc a: a change that a killed run left half done" in str(err.value)
    assert "a" in host.netns and len(host.log) == ran  # nothing ran
    assert rundir.lock_is_free(lock.lock_path())
