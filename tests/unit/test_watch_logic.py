"""Watch-mode logic without a host: scheduling (fake clock), event filters, the pass itself.

The agent is driven with a fake Reconciler; nothing here touches netlink,
iptables or Docker.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from reconciler.agent import sources as drift
from reconciler.agent import status
from reconciler.agent.files import relevant_path, watch_dirs
from reconciler.agent.loop import Agent
from reconciler.agent.passes import WatchOptions
from reconciler.agent.revision import check_permissions
from reconciler.agent.schedule import Scheduler, Trigger
from reconciler.agent.sources import DriftFilter, docker_event_reason
from reconciler.domain import ownership
from reconciler.domain.errors import PreconditionError
from reconciler.domain.plan import Action, Change, Plan
from reconciler.drivers.netlink import wire
from reconciler.drivers.netlink.parse import NetlinkEvent, parse_messages
from reconciler.engine import lock as lock_mod
from reconciler.engine.reconcile import ApplyResult

# --------------------------------------------------------------------------- scheduler


def test_requests_coalesce_into_one_pass() -> None:
    s = Scheduler()
    s.request("netlink drift", 10.0, delay=0.1)
    s.request("netlink drift", 10.05, delay=0.1)
    s.request("netlink drift", 10.08, delay=0.1)
    assert s.next_due() == pytest.approx(10.1)  # not pushed back: drift heals promptly
    assert s.take(10.09) == []
    assert s.take(10.1) == ["netlink drift"]
    assert s.take(10.2) == [] and s.next_due() is None


def test_file_debounce_is_trailing_and_capped() -> None:
    s = Scheduler(max_wait=5.0)
    s.request("files changed", 0.0, delay=0.5, trailing=True)
    for t in (0.3, 0.6, 0.9):  # a git checkout writing file after file
        s.request("files changed", t, delay=0.5, trailing=True)
    assert s.next_due() == pytest.approx(1.4)
    assert s.take(1.3) == []
    assert s.take(1.4) == ["files changed"]
    # a writer that never stops still gets a pass after max_wait
    t = 10.0
    s.request("files changed", t, delay=0.5, trailing=True)
    while t < 20:
        t += 0.2
        s.request("files changed", t, delay=0.5, trailing=True)
    assert s.next_due() == pytest.approx(15.0)


def test_take_leaves_requests_not_yet_due() -> None:
    s = Scheduler()
    s.request("startup", 0.0)
    s.request("files changed", 0.0, delay=0.5, trailing=True)
    assert s.take(0.0) == ["startup"]
    assert s.pending() == ["files changed"]


def test_backoff_doubles_to_a_cap_and_resets() -> None:
    s = Scheduler(backoff_base=1.0, backoff_cap=8.0)
    delays = [s.record(False, 100.0) for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert s.failures == 6
    s.record(True, 200.0)
    assert s.failures == 0 and s.backoff_until == 0.0 and "retry" not in s.pending()
    assert s.record(False, 300.0) == 1.0


def test_drift_waits_out_backoff_but_operator_actions_do_not() -> None:
    s = Scheduler(backoff_base=4.0)
    s.record(False, 0.0)  # retry at 4.0
    s.request("netlink drift", 1.0, delay=0.1)
    assert s.take(1.1) == []  # an echo of a failing pass must not spin
    assert s.next_due() == pytest.approx(4.0)
    s.request("files changed", 1.0, delay=0.5, trailing=True, bypass_backoff=True)
    assert s.take(1.5) == ["files changed"]
    assert s.take(4.0) == ["netlink drift", "retry"]


def test_resync_is_rearmed_not_accumulated() -> None:
    s = Scheduler()
    s.set_resync(0.0, 60.0)
    s.set_resync(30.0, 60.0)
    assert s.next_due() == pytest.approx(90.0)
    assert s.take(60.0) == []
    assert s.take(90.0) == ["resync"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trigger_wait_returns_due_reasons_and_stops() -> None:
    clock = FakeClock()
    stop = threading.Event()
    t = Trigger(Scheduler(), stop, clock)
    t.request("startup")
    assert t.wait() == ["startup"]
    t.request("netlink drift", delay=0.1)
    clock.now = 0.1
    assert t.wait() == ["netlink drift"]
    stop.set()
    t.request("netlink drift")
    assert t.wait() is None


def test_trigger_wakes_a_waiting_loop_from_another_thread() -> None:
    stop = threading.Event()
    t = Trigger(Scheduler(), stop)
    got: list[list[str] | None] = []
    th = threading.Thread(target=lambda: got.append(t.wait(max_sleep=5.0)))
    th.start()
    t.request("SIGHUP", bypass_backoff=True)
    th.join(2.0)
    assert got == [["SIGHUP"]]


# --------------------------------------------------------------------------- files


def test_relevant_paths(tmp_path: Any) -> None:
    d = str(tmp_path / "conf")
    f = str(tmp_path / "host.conf")
    named = [d, f]
    assert relevant_path(os.path.join(d, "a.yaml"), named)
    assert relevant_path(os.path.join(d, "b.yml"), named)
    assert relevant_path(f, named)
    assert relevant_path(d, named)  # the directory itself replaced
    for noise in (".a.yaml.swp", "a.yaml~", "4913", ".#a.yaml", "README.md"):
        assert not relevant_path(os.path.join(d, noise), named), noise
    assert not relevant_path(os.path.join(d, "sub", "c.yaml"), named)  # not read: not recursive
    assert not relevant_path(str(tmp_path / "other.conf"), named)


def test_watch_dirs(tmp_path: Any) -> None:
    d = tmp_path / "conf"
    d.mkdir()
    f = tmp_path / "x.yaml"
    assert watch_dirs([str(d), str(f)]) == [str(d), str(tmp_path)]


def test_strict_modes(tmp_path: Any) -> None:
    d = tmp_path / "conf"
    d.mkdir(mode=0o755)
    f = d / "a.yaml"
    f.write_text("version: 1\n")
    os.chmod(d, 0o755)
    os.chmod(f, 0o644)
    check_permissions([str(d)])
    os.chmod(f, 0o664)
    with pytest.raises(PreconditionError, match=r"a\.yaml: refusing to watch: file is writable "
                                                r"by group or others \(mode 0664\)"):
        check_permissions([str(d)])
    os.chmod(f, 0o644)
    os.chmod(d, 0o757)
    with pytest.raises(PreconditionError, match="directory is writable by group or others"):
        check_permissions([str(f)])
    os.chmod(d, 0o755)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o644


# --------------------------------------------------------------------------- netlink


def _rta(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _msg(kind: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 0, 0) + body


def link_msg(index: int, name: str, *, deleted: bool = False, alias: str | None = None,
             master: int | None = None) -> bytes:
    body = struct.pack("=BxHiII", 0, 1, index, 0, 0) + _rta(wire.IFLA_IFNAME,
                                                           name.encode() + b"\0")
    if alias is not None:
        body += _rta(wire.IFLA_IFALIAS, alias.encode() + b"\0")
    if master is not None:
        body += _rta(wire.IFLA_MASTER, struct.pack("=I", master))
    return _msg(wire.RTM_DELLINK if deleted else wire.RTM_NEWLINK, body)


def addr_msg(index: int, family: int, address: bytes, *, proto: int | None = None,
             deleted: bool = False) -> bytes:
    body = struct.pack("=BBBBI", family, 24, 0, 0, index) + _rta(wire.IFA_ADDRESS, address)
    if proto is not None:
        body += _rta(wire.IFA_PROTO, bytes([proto]))
    return _msg(wire.RTM_DELADDR if deleted else wire.RTM_NEWADDR, body)


def route_msg(oif: int, protocol: int) -> bytes:
    body = struct.pack("=BBBBBBBBI", 2, 0, 0, 0, 254, protocol, 0, 1, 0)
    return _msg(wire.RTM_NEWROUTE, body + _rta(wire.RTA_OIF, struct.pack("=I", oif)))


def test_parse_messages_of_one_datagram() -> None:
    data = (link_msg(7, "nomad", alias=ownership.LINK_ALIAS)
            + addr_msg(7, 2, bytes([10, 0, 0, 1]), proto=ownership.ADDR_PROTO)
            + addr_msg(7, 10, bytes.fromhex("fe80" + "00" * 12 + "0001"))
            + route_msg(7, 2) + link_msg(9, "veth1", deleted=True, master=7))
    evs = parse_messages(data)
    assert evs == [
        NetlinkEvent("link", False, 7, name="nomad", alias=ownership.LINK_ALIAS),
        NetlinkEvent("addr", False, 7, proto=ownership.ADDR_PROTO),
        NetlinkEvent("addr", False, 7, link_local=True),
        NetlinkEvent("route", False, 7, proto=2),
        NetlinkEvent("link", True, 9, name="veth1", master=7),
    ]


def test_parse_messages_skips_garbage() -> None:
    assert parse_messages(b"") == []
    assert parse_messages(b"\x01\x02\x03") == []
    truncated = link_msg(3, "x")[:-3]
    assert parse_messages(truncated) == []
    done = struct.pack("=IHHII", 16, wire.NLMSG_DONE, 0, 0, 0)
    assert parse_messages(done + link_msg(3, "x")) == [NetlinkEvent("link", False, 3, name="x")]


def test_drift_filter() -> None:
    resolved: list[int] = []

    def resolve(i: int) -> str | None:
        resolved.append(i)
        return {5: "eth0", 6: "nomad"}.get(i)

    f = DriftFilter(resolve)
    f.set_names({"nomad"})
    ev = parse_messages
    # a desired name, even when not (yet) ours, e.g. deleted out of band
    assert f.relevant(ev(link_msg(6, "nomad", deleted=True))[0])
    # links carrying our alias, and ports of relevant bridges
    assert f.relevant(ev(link_msg(8, "veth-web", alias=ownership.LINK_ALIAS))[0])
    f.set_names({"kind"})
    assert f.relevant(ev(link_msg(9, "vethpeer", master=8))[0])
    # unrelated links and addresses are not
    assert not f.relevant(ev(link_msg(5, "eth0"))[0])
    assert not f.relevant(ev(addr_msg(5, 2, bytes([192, 168, 1, 2])))[0])
    # addresses: ours by marker anywhere, or any non-link-local one on a relevant link
    assert f.relevant(ev(addr_msg(5, 2, bytes([10, 0, 0, 1]), proto=ownership.ADDR_PROTO))[0])
    assert f.relevant(ev(addr_msg(8, 2, bytes([10, 0, 0, 9])))[0])
    ll = bytes.fromhex("fe80" + "00" * 12 + "0001")
    assert not f.relevant(ev(addr_msg(8, 10, ll))[0])  # kernel-made, never ours
    # routes: only ours
    assert f.relevant(ev(route_msg(5, ownership.ROUTE_PROTO))[0])
    assert not f.relevant(ev(route_msg(8, 2))[0])
    # a deleted owned link is forgotten
    assert f.relevant(ev(link_msg(8, "veth-web", deleted=True))[0])
    assert not f.relevant(ev(addr_msg(8, 2, bytes([10, 0, 0, 9])))[0]) or 8 in resolved


def test_drift_filter_learns_from_the_initial_dump() -> None:
    f = DriftFilter(lambda i: None)
    f.learn(NetlinkEvent("link", False, 4, name="old", alias=ownership.LINK_ALIAS))
    assert f.relevant(NetlinkEvent("addr", True, 4))


def test_docker_event_reason() -> None:
    names = frozenset({"kind"})
    ev = {"Type": "network", "Action": "destroy",
          "Actor": {"ID": "abc", "Attributes": {"name": "kind", "type": "bridge"}}}
    assert docker_event_reason(ev, names) == "docker network destroy kind"
    assert docker_event_reason({**ev, "Action": "connect"}, names) == "docker network connect kind"
    assert docker_event_reason({**ev, "Type": "container"}, names) is None
    assert docker_event_reason({**ev, "Action": "exec_start"}, names) is None
    other = {**ev, "Actor": {"ID": "x", "Attributes": {"name": "bridge"}}}
    assert docker_event_reason(other, names) is None
    assert docker_event_reason({"Type": "network"}, names) is None


def test_docker_watcher_reconnects_with_backoff() -> None:
    stop = threading.Event()
    calls: list[str] = []
    reasons: list[str] = []
    event = {"Type": "network", "Action": "destroy",
             "Actor": {"Attributes": {"name": "kind"}}}

    class Client:
        def events(self, **_kw: Any) -> Any:
            if len(calls) == 3:
                stop.set()
            return iter([event])

        def close(self) -> None:
            pass

    def factory() -> Any:
        calls.append("connect")
        if len(calls) == 1:
            raise ConnectionError("daemon down")
        return Client()

    w = drift.DockerWatcher(reasons.append, stop, max_delay=0.01, client_factory=factory)
    w.set_names({"kind"})
    w.start()
    w.close()
    assert w._thread is not None
    w._thread.join(5.0)
    assert calls[:3] == ["connect"] * 3
    assert "docker events reconnected" in reasons
    assert "docker network destroy kind" in reasons


# --------------------------------------------------------------------------- status


def test_parse_addr() -> None:
    assert status.parse_addr("127.0.0.1:9477") == ("127.0.0.1", 9477)
    assert status.parse_addr("[::1]:80") == ("::1", 80)
    assert status.parse_addr("http://localhost:1/") == ("localhost", 1)
    for bad in ("9477", "host:", ":1", "h:99999", "h:x"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            status.parse_addr(bad)


def test_status_render() -> None:
    doc = {"pid": 1, "hostname": "h", "state": "running", "started_at": 0, "paths": ["/etc/r"],
           "revision": {"commit": "0123456789abcdef", "dirty": True},
           "desired": {"bridges": 1}, "pass_count": 3, "consecutive_failures": 0,
           "last_success_at": 95,
           "last_pass": {"number": 3, "result": "failed", "finished_at": 95,
                         "duration_seconds": 0.5, "reasons": ["files changed"],
                         "changes": {"applied": 1, "failed": 1}, "error": "boom"},
           "errors": [{"resource": "bridge/x", "error": "EPERM"}],
           "config_error": {"message": "/etc/r/a.yaml:3:5: bad", "since": 90}}
    text = status.render(doc, now=100)
    assert "commit 0123456789ab (dirty)" in text
    assert "last pass: #3 failed 5s ago" in text
    assert "bridge/x: EPERM" in text
    assert "  /etc/r/a.yaml:3:5: bad" in text
    assert not status.healthy_doc(doc)
    ok = {"last_pass": {"result": "ok"}, "errors": [], "config_error": None}
    assert status.healthy_doc(ok)


def test_status_server_serves_status_metrics_health() -> None:
    import urllib.request

    m = status.Metrics()
    m.passes.labels(result="ok").inc()
    board = status.StatusBoard(pass_count=1)
    sock = status.bind("127.0.0.1:0")
    srv = status.StatusServer(sock, board, m, lambda: (False, "stuck"))
    srv.start()
    addr = srv.address
    try:
        assert status.fetch(addr) == {"pass_count": 1}
        base = f"http://{addr}"
        body = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        assert 'reconciler_passes_total{result="ok"} 1.0' in body
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/healthz", timeout=5)
        assert err.value.code == 503
    finally:
        srv.close()
    with pytest.raises(Exception, match="cannot reach the watch agent"):
        status.fetch(addr, timeout=1)


# --------------------------------------------------------------------------- the pass


@dataclass
class FakeReconciler:
    """Plans one change until applied; the plan can be told to fail or conflict."""

    stop: threading.Event
    live_mtu: dict[str, int | None] = field(default_factory=dict)
    fail_apply: bool = False
    applied: list[str] = field(default_factory=list)
    last_live: Any = None
    #: interrupted changes a killed run left (their journals), finished by finish_journals
    journals: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def journals_pending(self) -> bool:
        return bool(self.journals)

    def finish_journals(self) -> list[str]:
        self.finished += self.journals
        self.journals = []
        return self.finished

    def _plan(self, desired: Any) -> Plan:
        changes = []
        for name, br in desired.bridges.items():
            if self.live_mtu.get(name, -1) != br.mtu:
                changes.append(Change("bridge", name, Action.UPDATE, "mtu differs"))
        for name in self.live_mtu:
            if name not in desired.bridges:
                changes.append(Change("bridge", name, Action.DELETE, "not declared"))
        return Plan(tuple(changes))

    def plan(self, desired: Any, options: Any) -> Plan:
        return self._plan(desired)

    def probe(self, desired: Any, live: Any = None, **_kw: Any) -> list[Any]:
        return []  # the probes' handling: tests/unit/test_probe_surface.py

    def close_probes(self) -> None:
        pass

    def apply(self, desired: Any, options: Any, on_outcome: Any = None,
              probe: Any = None, max_disruption: Any = None,
              before_changes: Any = None) -> ApplyResult:
        from reconciler.engine.executor import Outcome

        plan = self._plan(desired)
        if plan.has_changes and before_changes is not None:
            before_changes(plan)  # as the engine does: before the first op
        res = ApplyResult(plan)
        for c in plan.actionable:
            if self.fail_apply:
                res.outcomes.append(Outcome(c, "failed", "EPERM"))
                continue
            if c.action is Action.DELETE:
                del self.live_mtu[c.name]
            else:
                self.live_mtu[c.name] = desired.bridges[c.name].mtu
            self.applied.append(c.address)
            res.outcomes.append(Outcome(c, "applied"))
            if on_outcome:
                on_outcome(res.outcomes[-1])
        return res

    @property
    def observer(self) -> Any:
        class Ops:
            def close(self) -> None:
                pass

        class Obs:
            ops = Ops()

        return Obs()


@pytest.fixture
def agent_env(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(lock_mod, "LOCK_DIR", str(tmp_path / "lock"))
    monkeypatch.setattr("reconciler.agent.loop.git_revision", lambda paths: None)
    conf = tmp_path / "conf"
    conf.mkdir()
    fakes: list[FakeReconciler] = []

    def make(stop: threading.Event) -> Any:
        fakes.append(FakeReconciler(stop))
        return fakes[-1]

    agent = Agent(WatchOptions(paths=(str(conf),), hostname="web-1"),
                  reconciler_factory=make)
    return agent, conf, fakes[0]


def _write(path: Any, text: str) -> None:
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


BR = "version: 1\nbridges:\n  - name: {name}\n    mtu: {mtu}\n"


def test_pass_applies_then_keeps_last_good_on_invalid_edit(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    _write(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    r = agent.run_pass(["startup"])
    assert r.result == "applied" and rec.live_mtu == {"br0": 1400}
    _write(conf / "a.yaml", "version: 1\nbridges:\n  - name: br0\n    mtu: [\n")
    r = agent.run_pass(["files changed"])
    assert r.result == "ok"  # still converging to the last good state
    doc = agent.board.snapshot()
    assert doc["config_error"]["message"].startswith(str(conf / "a.yaml") + ":")
    assert rec.live_mtu == {"br0": 1400}
    rec.live_mtu.clear()  # drift while the files are broken is still healed
    assert agent.run_pass(["netlink drift"]).result == "applied"
    assert rec.live_mtu == {"br0": 1400}
    _write(conf / "a.yaml", BR.format(name="br0", mtu=1450))
    assert agent.run_pass(["files changed"]).result == "applied"
    assert rec.live_mtu == {"br0": 1450}
    assert agent.board.snapshot()["config_error"] is None


def test_config_made_writable_later_is_refused_like_an_invalid_edit(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    _write(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    agent.run_pass(["startup"])
    _write(conf / "a.yaml", BR.format(name="br0", mtu=9000))
    os.chmod(conf / "a.yaml", 0o666)
    agent.run_pass(["files changed"])
    assert rec.live_mtu == {"br0": 1400}
    assert "writable by group or others" in agent.board.snapshot()["config_error"]["message"]


def test_deleting_a_file_prunes_what_it_declared(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    _write(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    _write(conf / "b.yaml", BR.format(name="br1", mtu=1400))
    agent.run_pass(["startup"])
    assert set(rec.live_mtu) == {"br0", "br1"}
    os.unlink(conf / "b.yaml")
    assert agent.run_pass(["files changed"]).result == "applied"
    assert set(rec.live_mtu) == {"br0"}


def test_dry_run_reports_drift_and_changes_nothing(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    agent.options = dataclasses.replace(agent.options, dry_run=True)
    _write(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    r = agent.run_pass(["startup"])
    assert r.result == "drift" and rec.applied == [] and rec.live_mtu == {}
    assert not r.converged
    assert r.errors and r.errors[0]["resource"] == "bridge/br0", r.errors
    assert 'reconciler_passes_total{result="drift"} 1.0' in agent.metrics.render().decode()


def test_no_valid_state_yet_applies_nothing(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    _write(conf / "a.yaml", "version: 2\n")
    r = agent.run_pass(["startup"])
    assert r.result == "config-error" and rec.applied == []
    assert agent.board.snapshot()["config_error"]["message"]


def test_fleet_filter_by_hostname(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    _write(conf / "web.yaml", "hosts: ['web-*']\n" + BR.format(name="brweb", mtu=1400))
    _write(conf / "db.yaml", "hosts: ['db-*']\n" + BR.format(name="brdb", mtu=1400))
    agent.run_pass(["startup"])
    assert set(rec.live_mtu) == {"brweb"}


def test_failed_pass_reports_resource_errors_and_backs_off(agent_env: Any) -> None:
    agent, conf, rec = agent_env
    _write(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    rec.fail_apply = True
    r = agent.run_pass(["startup"])
    assert r.result == "failed"
    assert r.errors == [{"resource": "bridge/br0", "error": "EPERM"}]
    assert agent.board.snapshot()["errors"] == r.errors
    assert agent.scheduler.record(False, 0.0) == 1.0


def test_host_lock_is_taken_only_when_there_is_work(agent_env: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    agent, conf, rec = agent_env
    taken: list[int] = []
    real = agent._host_lock

    def spy() -> Any:
        taken.append(1)
        return real()

    monkeypatch.setattr(agent, "_host_lock", spy)
    _write(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    agent.run_pass(["startup"])
    agent.run_pass(["resync"])
    agent.run_pass(["netlink drift"])
    assert taken == [1]


def test_a_pass_finishes_interrupted_changes_under_the_lock_even_with_nothing_to_plan(
        agent_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replace killed after the network was re-created plans as "no changes": the pass
    must finish its journal anyway (under the host lock), and a --dry-run agent must not."""
    agent, conf, rec = agent_env
    _write(conf / "a.yaml", BR.format(name="br0", mtu=1400))
    agent.run_pass(["startup"])
    taken: list[int] = []
    real = agent._host_lock

    def spy() -> Any:
        taken.append(len(rec.journals))
        return real()

    monkeypatch.setattr(agent, "_host_lock", spy)
    rec.journals = ["docker_network/n"]
    agent.options = dataclasses.replace(agent.options, dry_run=True)
    agent.run_pass(["resync"])
    assert rec.finished == [] and taken == []
    agent.options = dataclasses.replace(agent.options, dry_run=False)
    report = agent.run_pass(["docker drift"])
    assert rec.finished == ["docker_network/n"] and taken == [1]
    assert report.result == "ok"


# --------------------------------------------------------------------------- examples

UNIT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "systemd",
                    "reconciler.service")


def _unit_lines() -> list[str]:
    with open(UNIT) as fh:
        return [ln.strip() for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]


def test_systemd_unit_runs_a_valid_watch_command() -> None:
    import shlex

    from reconciler.ui.parser import build_parser

    exec_start = [ln for ln in _unit_lines() if ln.startswith("ExecStart=")]
    assert len(exec_start) == 1
    argv = shlex.split(exec_start[0].removeprefix("ExecStart="))
    assert os.path.basename(argv[0]) == "reconcile"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "watch" and args.status_addr.startswith("127.0.0.1:")
    # a private mount namespace would hide the /run/netns mounts of allocations
    for opt in ("PrivateTmp", "ProtectSystem", "ProtectHome", "ReadOnlyPaths", "MountFlags",
                "PrivateMounts", "TemporaryFileSystem", "BindPaths"):
        assert not any(ln.startswith(opt + "=") for ln in _unit_lines()), opt


def test_systemd_unit_starts_the_agent_whatever_the_record_and_lets_it_see_holders() -> None:
    """A corrupt or unrevertable pending record must not keep the agent from starting (it
    reports the record itself, in its status and at every pass); and a namespace held by a
    process of another user is found only with CAP_SYS_PTRACE (/proc/PID/ns/net)."""
    pre = [ln for ln in _unit_lines() if ln.startswith("ExecStartPre=")]
    assert pre and all(ln.removeprefix("ExecStartPre=").startswith("-") for ln in pre), pre
    caps = [ln for ln in _unit_lines() if ln.startswith("CapabilityBoundingSet=")]
    assert len(caps) == 1 and "CAP_SYS_PTRACE" in caps[0].split("=", 1)[1].split()


def test_systemd_unit_verifies(tmp_path: Any) -> None:
    import shutil
    import subprocess
    import sys

    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze")
    with open(UNIT) as fh:
        text = fh.read().replace("/usr/local/bin/reconcile", f"{sys.executable} -m reconciler")
    unit = tmp_path / "reconciler.service"
    unit.write_text(text)
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    problems = [ln for ln in (p.stdout + p.stderr).splitlines() if "reconciler.service" in ln]
    assert p.returncode == 0 and not problems, p.stdout + p.stderr


def test_file_watcher_follows_git_sync_style_symlink_swaps(tmp_path):
    """repo -> revN swapped again and again (git-sync, ConfigMap ..data): every swap is seen."""
    import os
    import threading
    import time

    from reconciler.agent.files import FileWatcher

    def rev(n: int) -> str:
        d = tmp_path / f"rev{n}" / "fleet"
        d.mkdir(parents=True)
        (d / "a.yaml").write_text(f"version: 1\n# {n}\n")
        return f"rev{n}"

    os.symlink(rev(1), tmp_path / "repo")
    seen = threading.Event()
    w = FileWatcher([str(tmp_path / "repo" / "fleet")], lambda _p: seen.set())
    w.start()
    try:
        for n in (2, 3, 4):
            target = rev(n)
            seen.clear()
            os.symlink(target, tmp_path / "tmp-link")
            os.replace(tmp_path / "tmp-link", tmp_path / "repo")  # the atomic swap
            assert seen.wait(5), f"swap to {target} not seen"
            w.ensure()  # what the agent does on every pass
            time.sleep(0.1)
            seen.clear()
            (tmp_path / target / "fleet" / "a.yaml").write_text("version: 1\n# edited\n")
            assert seen.wait(5), f"edit inside {target} not seen"
    finally:
        w.close()


def test_link_local_is_judged_by_the_local_address_as_observation_does() -> None:
    """A global address with a link-local peer is not "link-local" (IFA_LOCAL is the
    address on the link, IFA_ADDRESS the peer), as in parse_addr."""
    ll, glob = bytes.fromhex("fe80" + "00" * 12 + "0002"), bytes.fromhex("2001db8" + "0" * 24 + "1")
    body = (struct.pack("=BBBBI", 10, 64, 0, 0, 7) + _rta(wire.IFA_LOCAL, glob)
            + _rta(wire.IFA_ADDRESS, ll))
    (ev,) = parse_messages(_msg(wire.RTM_NEWADDR, body))
    assert ev.what == "addr" and not ev.link_local
    body = (struct.pack("=BBBBI", 10, 64, 0, 0, 7) + _rta(wire.IFA_LOCAL, ll)
            + _rta(wire.IFA_ADDRESS, glob))
    (ev,) = parse_messages(_msg(wire.RTM_NEWADDR, body))
    assert ev.link_local


# --------------------------------------------------------------------------- address space


def test_overlap_reports_reach_log_status_and_metric(agent_env: Any, caplog: Any) -> None:
    from reconciler.planner.hostspace import LiveOverlap

    agent, _conf, _fake = agent_env
    o = LiveOverlap("10.66.0.0/24 on br0", "route 10.66.0.0/25 on tun0")
    with caplog.at_level("INFO", logger="reconciler.watch"):
        agent.on_overlaps([o])
        agent.on_overlaps([o])  # the same again: no second warning, the same "since"
        first = agent.board.get("address_overlaps")
        agent.on_overlaps([])
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "route 10.66.0.0/25 on tun0 overlaps 10.66.0.0/24 on br0" \
        in warned[0].getMessage()
    assert [(d["owned"], d["foreign"]) for d in first] == [(o.owned, o.foreign)]
    assert any("no longer overlaps" in r.getMessage() for r in caplog.records)
    assert agent.board.get("address_overlaps") == []
    assert b"reconciler_address_overlaps 0.0" in agent.metrics.render()
    text = status.render({"address_overlaps": first, "last_pass": {}}, now=first[0]["since"] + 3)
    assert "address overlaps: 1 (foreign, left alone):" in text
    assert "route 10.66.0.0/25 on tun0 overlaps owned 10.66.0.0/24 on br0 (since 3s ago)" in text


def test_the_overlap_alarm_wakes_on_addresses_and_routes_and_reports_changes() -> None:
    from reconciler.agent.sources import OverlapAlarm
    from reconciler.domain.live import LiveAddress, LiveLink, LiveRoute
    from reconciler.drivers.netlink.parse import NetlinkEvent

    class Reader:
        routes: tuple[LiveRoute, ...] = ()

        def dump_links(self) -> dict[str, LiveLink]:
            br = LiveLink("br0", 5, "bridge", 1500, True, True, addresses=(
                LiveAddress(ipaddress.ip_interface("10.66.0.1/24"), True),))
            return {"br0": br, "tun0": LiveLink("tun0", 6, "", 1500, True, False)}

        def dump_host_routes(self) -> tuple[LiveRoute, ...]:
            return self.routes

        def close(self) -> None:
            pass

    reader = Reader()
    reports: list[Any] = []
    stop = threading.Event()
    alarm = OverlapAlarm(reports.append, stop, reader=lambda: reader, gap=0.0)
    assert alarm.check(reader) == []  # type: ignore[arg-type]
    reader.routes = (LiveRoute("10.66.0.0/25", None, False, oif=6),)
    found = alarm.check(reader)  # type: ignore[arg-type]
    assert [o.foreign for o in found] == ["route 10.66.0.0/25 on tun0"]
    alarm.start()
    try:
        wait = time.monotonic() + 5
        while not reports and time.monotonic() < wait:
            time.sleep(0.01)
        assert [o.foreign for o in reports[-1]] == ["route 10.66.0.0/25 on tun0"]
        assert not alarm.hear(NetlinkEvent("link", False, 7, name="veth9"))  # a new veth
        assert not alarm.hear(NetlinkEvent("route", False, 7, link_local=True))  # fe80::/64
        assert alarm.hear(NetlinkEvent("link", True, 6, name="tun0"))  # a link goes away
        reader.routes = ()
        assert alarm.hear(NetlinkEvent("route", True, 6))
        wait = time.monotonic() + 5
        while reports[-1] and time.monotonic() < wait:
            time.sleep(0.01)
        assert reports[-1] == []
    finally:
        stop.set()
        alarm.close()
