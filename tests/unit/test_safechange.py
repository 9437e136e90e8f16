"""Safe change without a host: the checkpoint (planner/checkpoint, domain/checkpoint), the
restore plan, the pending record and its refusals, the CLI options and the units."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest

from reconciler.domain.checkpoint import Checkpoint, CheckpointError, EndpointPoint, NetworkPoint
from reconciler.domain.errors import PreconditionError
from reconciler.domain.live import (
    LiveAddress,
    LiveChainSet,
    LiveLink,
    LiveNetns,
    LiveRoute,
    LiveState,
)
from reconciler.domain.ops import decode
from reconciler.domain.ownership import LINK_ALIAS, alloc_mac, alloc_ns_alias, alloc_veth_name
from reconciler.engine import safechange
from reconciler.planner.checkpoint import restore_plan, take
from reconciler.ui.parser import build_parser

HOST = "4026531840"
VETH = alloc_veth_name("a1")
FW = LiveChainSet(available=True, chains={
    ("filter", "FORWARD"): ("-m comment --comment reconciler -j RECONCILER-FORWARD",),
    ("filter", "RECONCILER-FORWARD"): (
        "-d 10.0.0.0/24 -o br0 -m comment --comment reconciler:subnet=net -j ACCEPT",),
    ("nat", "RECONCILER-DNAT"): (
        "-p tcp -m tcp --dport 8080 -m comment --comment reconciler:alloc=a1 "
        "-j DNAT --to-destination 10.0.0.2:80",),
    ("nat", "PREROUTING"): ("-m addrtype --dst-type LOCAL -m comment --comment reconciler "
                            "-j RECONCILER-DNAT",),
    ("nat", "OUTPUT"): ("-m addrtype --dst-type LOCAL -m comment --comment reconciler "
                        "-j RECONCILER-DNAT",)})


def _addr(text: str, owned: bool = True) -> LiveAddress:
    return LiveAddress(ipaddress.ip_interface(text), owned)


def _alloc(name: str, address: str = "10.0.0.2/24", mtu: int = 1500) -> LiveNetns:
    lo = LiveLink("lo", 1, "", 65536, True, False, alias=alloc_ns_alias(HOST))
    eth0 = LiveLink("eth0", 2, "veth", mtu, True, True, alias=LINK_ALIAS,
                    addresses=(_addr(address),), mac=alloc_mac(name))
    return LiveNetns(name, True, (lo, eth0), (LiveRoute("default", "10.0.0.1", True, 2),))


def _live(*, bridge_mtu: int = 1500, hairpin: bool = True, allocs: tuple[str, ...] = ("a1",),
          fw: LiveChainSet = FW, extra_bridge: bool = False) -> LiveState:
    links = {"br0": LiveLink("br0", 5, "bridge", bridge_mtu, True, True, alias=LINK_ALIAS,
                             addresses=(_addr("10.0.0.1/24"), _addr("192.0.2.1/24", False)),
                             mac="02:00:00:00:00:01"),
             "eth9": LiveLink("eth9", 2, "", 1500, True, False, mac="52:54:00:00:00:01")}
    for a in allocs:
        links[alloc_veth_name(a)] = LiveLink(alloc_veth_name(a), 6, "veth", bridge_mtu, True,
                                             True, alias=LINK_ALIAS, master="br0",
                                             hairpin=hairpin, mac="aa:00:00:00:00:06")
    if extra_bridge:
        links["br1"] = LiveLink("br1", 9, "bridge", 1500, True, True, alias=LINK_ALIAS,
                                mac="02:00:00:00:00:09")
    return LiveState(host_id=HOST, links=links, firewall4=fw,
                     firewall6=LiveChainSet(available=True),
                     sysctls={"net/ipv4/ip_forward": "1", "net/ipv6/conf/all/forwarding": "0",
                              "net/ipv4/conf/br0/route_localnet": "0"},
                     netns={a: _alloc(a, mtu=bridge_mtu) for a in allocs})


def _ops(plan: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(op.name, op.args) for c in plan.actionable for op in c.ops]


def test_a_checkpoint_records_only_what_is_owned_and_round_trips_through_json() -> None:
    nets = (NetworkPoint("web", "1" * 64, "bridge", (("mtu", "1400"),), (("l", "v"),), True,
                         False, (("10.5.0.0/16", "10.5.0.1"),),
                         (EndpointPoint("c" * 64, "c1", "10.5.0.3", None, ("api",)),)),)
    cp = take(_live(), nets)
    assert set(cp.links) == {"br0", VETH}  # eth9 is not ours
    assert cp.links["br0"].addresses == ("10.0.0.1/24",)  # the foreign address is not ours
    assert set(cp.allocs) == {"a1"} and cp.allocs["a1"].gateways == ("10.0.0.1",)
    assert set(cp.firewall[4]) == {("filter", "RECONCILER-FORWARD"), ("nat", "RECONCILER-DNAT")}
    again = Checkpoint.from_json(json.loads(json.dumps(cp.to_json())))
    assert again == cp


@pytest.mark.parametrize("raw", [None, {}, {"version": 99}, {"version": 1, "links": 5},
                                 {"version": 1, "host_id": "1", "links": [{"x": 1}]}])
def test_a_checkpoint_this_version_cannot_read_is_one_error(raw: Any) -> None:
    with pytest.raises(CheckpointError):
        Checkpoint.from_json(raw)


def test_nothing_changed_nothing_to_restore() -> None:
    live = _live()
    assert not restore_plan(take(live), live).has_changes


def test_what_the_old_files_left_to_the_kernel_goes_back_to_its_value() -> None:
    """The bridge followed its ports (MTU 1500) and its port had hairpin on: the change set
    an MTU and turned hairpin off; the restore sets both back to the values."""
    cp = take(_live())
    plan = restore_plan(cp, _live(bridge_mtu=1400, hairpin=False))
    ops = _ops(plan)
    assert ("link.set", {"name": "br0", "mtu": 1500}) in ops
    assert ("link.set", {"name": VETH, "mtu": 1500}) in ops
    assert ("link.set_hairpin", {"name": VETH, "on": True}) in ops
    # eth0 inside followed the bridge too
    assert any(n == "alloc.configure" and a["mtu"] == 1500 for n, a in ops), ops


def test_what_the_change_created_goes_first_and_what_it_deleted_comes_back() -> None:
    cp = take(_live())
    now = _live(allocs=("a2",), extra_bridge=True, fw=LiveChainSet(available=True))
    plan = restore_plan(cp, now)
    ops = _ops(plan)
    names = [n for n, _a in ops]
    # a2 and br1 were made by the change: deleted, before anything is re-created
    assert ops[0] == ("link.delete", {"name": alloc_veth_name("a2")})
    assert ops[1] == ("netns.delete", {"name": "a2"})
    assert ("link.delete", {"name": "br1"}) in ops
    assert names.index("link.delete") < names.index("netns.create")
    # a1 comes back with its MAC, addresses and gateway, marked as this host's
    create = next(a for n, a in ops if n == "netns.create")
    assert create == {"name": "a1", "replace_stale": False, "mark": alloc_ns_alias(HOST)}
    attach = next(a for n, a in ops if n == "alloc.attach")
    assert attach["mac"] == alloc_mac("a1") and attach["bridge"] == "br0" and attach["hairpin"]
    configure = next(a for n, a in ops if n == "alloc.configure")
    assert configure["addresses"] == ["10.0.0.2/24"] and configure["gateways"] == ["10.0.0.1"]
    assert ("link.set_mac", {"name": VETH, "mac": "aa:00:00:00:00:06"}) in ops
    # the rules, as one transaction, with the jumps every apply writes
    script = next(a["script"] for n, a in ops if n == "firewall.restore")
    assert ":RECONCILER-DNAT - [0:0]" in script and "-I PREROUTING 1" in script
    assert names[-1] == "firewall.restore"
    for c in plan.actionable:  # every op is one the executor can decode
        for op in c.ops:
            decode(op)


def test_an_address_the_change_moved_is_moved_back() -> None:
    cp = take(_live())
    now = _live()
    now.netns["a1"] = _alloc("a1", "10.0.0.9/24")
    ops = _ops(restore_plan(cp, now))
    assert ("addr.del", {"link": "eth0", "address": "10.0.0.9/24", "netns": "a1"}) in ops
    assert any(n == "alloc.configure" and a["addresses"] == ["10.0.0.2/24"] for n, a in ops)


def test_a_sysctl_the_change_set_is_set_back() -> None:
    cp = take(_live())
    now = _live()
    now.sysctls["net/ipv6/conf/all/forwarding"] = "1"
    assert _ops(restore_plan(cp, now)) == [
        ("sysctl.set", {"key": "net/ipv6/conf/all/forwarding", "value": "0"})]


def test_docker_networks_are_restored_with_their_attachments() -> None:
    web = NetworkPoint("web", "1" * 64, pools=(("10.5.0.0/16", "10.5.0.1"),),
                       endpoints=(EndpointPoint("c" * 64, "c1", "10.5.0.3"),))
    live = _live()
    cp = take(live, (web,))
    made = NetworkPoint("new", "2" * 64)
    replaced = dataclasses.replace(web, id="3" * 64, options=(("mtu", "1400"),), endpoints=())
    ops = _ops(restore_plan(cp, live, (replaced, made)))
    assert ("docker.remove", {"id": "2" * 64, "name": "new"}) in ops
    restore = next(a for n, a in ops if n == "docker.restore")
    assert restore["replace_id"] == "3" * 64
    assert restore["network"]["endpoints"][0]["ipv4"] == "10.5.0.3"
    # a checkpoint without Docker leaves Docker alone
    assert not restore_plan(take(live), live, (made,)).has_changes


def _pending(deadline: float, boot: str) -> safechange.Pending:
    return safechange.Pending("netns/x", "t", deadline, time.time(), boot, take(_live()))


def test_pending_is_overdue_after_its_deadline_or_a_reboot(monkeypatch: Any) -> None:
    monkeypatch.setenv(safechange.BOOT_ID_ENV, "boot-1")
    assert not _pending(time.time() + 60, "boot-1").overdue
    assert _pending(time.time() - 1, "boot-1").overdue
    assert _pending(time.time() + 60, "boot-0").overdue
    line = safechange.refusal(_pending(time.time() + 60, "boot-1"))
    assert "pending until 20" in line and "nothing changed" in line and "\n" not in line


def test_a_pending_record_round_trips_and_a_bad_one_is_one_line(tmp_path: Any,
                                                                monkeypatch: Any) -> None:
    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    p = _pending(time.time() + 60, "b")
    directory = safechange.scope_dir("netns/x")
    safechange._write(directory, p)
    assert safechange.pending("netns/x") == p
    with open(os.path.join(directory, "pending.json"), "w") as fh:
        json.dump({"version": 1, "scope": "x"}, fh)
    with pytest.raises(PreconditionError, match="not a pending change this version can read"):
        safechange.pending("netns/x")


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90.0), ("5m", 300.0), ("45", 45.0)])
def test_confirm_within_takes_a_duration(text: str, seconds: float) -> None:
    args = build_parser().parse_args(["apply", "x.yaml", "--confirm-within", text])
    assert args.confirm_within == seconds


@pytest.mark.parametrize("text", ["soon", "-5s", "0", ""])
def test_a_bad_confirm_within_is_a_usage_error(text: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["apply", "x.yaml", f"--confirm-within={text}"])
    assert exc.value.code == 1 and "is not a duration" in capsys.readouterr().err


UNITS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "systemd")


def test_the_units_revert_an_overdue_change_at_boot() -> None:
    for unit, key in (("reconciler.service", "ExecStartPre="),
                      ("reconciler-revert.service", "ExecStart=")):
        with open(os.path.join(UNITS, unit)) as fh:
            lines = [ln.strip() for ln in fh if ln.startswith(key)]
        assert len(lines) == 1, unit
        argv = shlex.split(lines[0].removeprefix(key))
        args = build_parser().parse_args(argv[1:])
        assert args.command == "revert" and args.if_overdue, unit


def test_the_revert_unit_verifies(tmp_path: Any) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze")
    with open(os.path.join(UNITS, "reconciler-revert.service")) as fh:
        text = fh.read().replace("/usr/local/bin/reconcile", f"{sys.executable} -m reconciler")
    unit = tmp_path / "reconciler-revert.service"
    unit.write_text(text)
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    problems = [ln for ln in (p.stdout + p.stderr).splitlines() if "reconciler-revert" in ln]
    assert p.returncode == 0 and not problems, p.stdout + p.stderr


def test_reading_makes_no_state_directory(tmp_path: Any, monkeypatch: Any) -> None:
    """An apply without a window asks whether something is pending: that must not need a
    writable /var/lib (a read-only image), nor leave a directory behind."""
    root = tmp_path / "state"
    monkeypatch.setenv("RECONCILER_STATE_DIR", str(root))
    assert safechange.pending("host") is None
    assert safechange.revert_count("host") == (0, None)
    assert not root.exists()


class _Board:
    def __init__(self) -> None:
        self.doc: dict[str, Any] = {}

    def update(self, **fields: Any) -> None:
        self.doc.update(fields)


class _Gauge:
    def __init__(self) -> None:
        self.value = 0.0

    def set(self, v: float) -> None:
        self.value = v

    def inc(self, v: float = 1.0) -> None:
        self.value += v


class _Metrics:
    def __init__(self) -> None:
        self.pending_change, self.reverts = _Gauge(), _Gauge()


@pytest.fixture
def watch(tmp_path: Any, monkeypatch: Any) -> Any:
    from reconciler.agent.safewatch import SafeWatch

    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(safechange, "docker_scope", lambda: "netns/x")
    board, metrics = _Board(), _Metrics()
    return SafeWatch(30.0, board, metrics, None, None), board, metrics


def _lock() -> Any:
    import contextlib

    return contextlib.nullcontext()


def test_the_agent_is_held_back_by_an_operators_pending_change(watch: Any,
                                                             monkeypatch: Any) -> None:
    sw, board, metrics = watch
    monkeypatch.setenv(safechange.BOOT_ID_ENV, "b")
    assert board.doc == {"pending": None, "reverted_revision": None}
    monkeypatch.setattr(safechange, "reverter_alive", lambda _p: True)  # the operator's
    safechange._write(safechange.scope_dir("netns/x"), dataclasses.replace(
        _pending(time.time() + 60, "b"), applied=True, reverter_pid=os.getpid()))
    held = sw.gate(None, None, "rev1", _lock)
    assert held is not None and "pending until" in held
    assert board.doc["pending"]["deadline"].endswith("Z") and metrics.pending_change.value == 1


def test_a_reverted_revision_is_not_applied_again_until_the_files_change(watch: Any) -> None:
    sw, board, metrics = watch
    statedir_dir = safechange.scope_dir("netns/x")
    from reconciler.drivers import statedir

    statedir.write_record(statedir_dir, safechange.REVERTS,
                          {"count": 1, "last_revision": "sha256:aaa"})
    assert "was reverted" in str(sw.gate(None, None, "sha256:aaa", _lock))
    assert sw.gate(None, None, "sha256:bbb", _lock) is None
    sw.publish()
    assert board.doc["reverted_revision"] == "sha256:aaa" and metrics.reverts.value == 1


def test_a_revert_never_deletes_what_was_foreign_at_the_checkpoint() -> None:
    """A foreign bridge, namespace and Docker network became ours within the window (the
    CLI refuses ``--adopt`` under a window, tests/unit/test_safe_fixes.py; this is the
    restore plan's own guarantee, for a record from an older version or an agent that
    adopted): the revert never deletes them (deleting them would destroy someone else's
    objects). It cannot give them back either: that is why a window refuses --adopt."""
    from reconciler.domain.live import LiveDocker, LiveDockerNetwork

    def net(owned: bool) -> LiveDockerNetwork:
        labels = {"io.reconciler.managed": "true"} if owned else {}
        return LiveDockerNetwork("9" * 64, "theirs", "bridge", labels, {}, False, False, (), 0)

    live = _live()
    links = dict(live.links)
    links["theirs0"] = LiveLink("theirs0", 12, "bridge", 1500, True, False)
    netns = dict(live.netns)
    foreign_ns = _alloc("theirs-ns")
    lo = dataclasses.replace(foreign_ns.links[0], alias=None)
    netns["theirs-ns"] = dataclasses.replace(foreign_ns, links=(lo, *foreign_ns.links[1:]))
    before = dataclasses.replace(live, links=links, netns=netns,
                                 docker=LiveDocker(True, networks=(net(False),)))
    cp = Checkpoint.from_json(take(before, ()).to_json())
    assert cp.foreign["links"] == ("eth9", "theirs0") and cp.foreign["netns"] == ("theirs-ns",)
    links["theirs0"] = dataclasses.replace(links["theirs0"], owned=True, alias=LINK_ALIAS)
    netns["theirs-ns"] = foreign_ns
    after = dataclasses.replace(live, links=links, netns=netns,
                                docker=LiveDocker(True, networks=(net(True),)))
    ops = _ops(restore_plan(cp, after, (NetworkPoint("theirs", "9" * 64),)))
    assert not any(a.get("name") in ("theirs0", "theirs-ns", "theirs") for _n, a in ops), ops


def test_status_says_what_is_pending_and_what_was_reverted() -> None:
    from reconciler.agent.status import render

    text = render({"pending": {"deadline": "2026-12-01T14:27:57Z", "revision": "abc123"},
                   "reverted_revision": "sha256:0f0f", "paths": []})
    assert "pending: a change of revision abc123 until 2026-12-01T14:27:57Z" in text
    assert "reverted: revision sha256:0f0f" in text
    assert "pending" not in render({"pending": None, "reverted_revision": None, "paths": []})
