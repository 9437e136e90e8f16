"""Issue 25's lifetime defects against the real kernel (and dockerd where it says so).

Each test acts on its own sandbox (``host_ns``, ``--netns``): a mount namespace that
hides the namespaces mounted before it, routes in policy-routing tables, a Docker
network of another namespace, a killed reverter, flows from the probes' source port
range, a veth whose namespace lost its ``lo`` mark, a foreign rule with our comment and
the neighbour entries of a reverted allocation. What happened is read with ``ip``,
``iptables`` and the state directory's files, never with our own observer.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from reconciler.domain.ownership import alloc_ns_alias, alloc_veth_name
from tests.conftest import REPO, Netns, Result, sh, unique, write
from tests.integration.traffic import client_of

pytestmark = pytest.mark.root


def _config(tmp_path: Any, bridge: str, cidr: str, allocs: list[dict[str, Any]],
            name: str = "c.yaml") -> str:
    doc = {"version": 1, "bridges": [{"name": bridge}],
           "subnets": [{"name": "net", "bridge": bridge, "cidr": cidr}],
           "allocs": [{"subnet": "net", **a} for a in allocs]}
    return write(tmp_path, name, json.dumps(doc) + "\n")


# ------------------------------------------------------------------ item 3: mount namespaces

#: a mount namespace as the coexistence cells make one: a private /run, and /run/netns bound
#: back into it without its submounts (``mount --bind``, not ``--rbind``); argv: a directory
HIDING = r"""
set -eu
D=$1
mkdir -p "$D/keep"
mount --make-private / 2>/dev/null || true
mount --bind /run/netns "$D/keep"
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/netns
mount --move "$D/keep" /run/netns
echo ready
exec sleep 100000
"""

IS_NAMESPACE = ("import os,sys\n"
                "print(os.stat(sys.argv[1]).st_dev == os.stat('/proc/self/ns/net').st_dev)")


@contextlib.contextmanager
def hiding_cell(tmp_path: Any) -> Iterator[int]:
    """The pid whose mount namespace is the cell; the cell goes with it (its mounts too)."""
    keeper = subprocess.Popen(["unshare", "-m", "--propagation", "unchanged", "sh", "-c", HIDING,
                               "sh", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert keeper.stdout is not None
        ready, _, _ = select.select([keeper.stdout], [], [], 20)
        assert ready and keeper.stdout.readline().strip() == "ready"
        yield keeper.pid
    finally:
        keeper.kill()
        keeper.wait()


def in_cell(pid: int, host: Netns, *args: str) -> Result:
    p = subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", f"--net=/run/netns/{host.name}",
                        *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": REPO}, stdin=subprocess.DEVNULL)
    return Result(p.returncode, p.stdout, p.stderr)


def test_a_mount_namespace_that_hides_earlier_namespaces_is_refused_before_any_change(
        host_ns: Netns, tmp_path: Any) -> None:
    """The namespaces mounted before the bind are empty files in the cell: the planner
    would read the live allocation as gone, delete its veth and fail on the busy file.
    Refused in one line instead, by plan and apply, and nothing changes."""
    aid, bridge = unique("m") + "-a", unique("b")
    path = _config(tmp_path, bridge, "10.231.7.0/24", [{"id": aid}])
    assert host_ns.reconcile("apply", "--no-probe", path).rc == 0
    veth = alloc_veth_name(aid)
    with hiding_cell(tmp_path) as cell:
        seen = in_cell(cell, host_ns, sys.executable, "-c", IS_NAMESPACE, f"/run/netns/{aid}")
        assert seen.out.strip() == "False", seen.all  # the construction hides it
        for command in ("plan", "apply"):
            r = in_cell(cell, host_ns, sys.executable, "-m", "reconciler", command, "--no-probe"
                        if command == "apply" else "--no-agent", path)
            assert r.rc == 1, r.all
            lines = [ln for ln in r.all.splitlines() if ln.startswith("error:")]
            assert len(lines) == 1 and f"/run/netns/{aid}" in lines[0] \
                and "mount namespace" in lines[0], r.all
            assert "applied" not in r.out and "Traceback" not in r.all, r.all
    assert host_ns.link(veth) is not None
    again = host_ns.reconcile("plan", "--no-agent", path)
    assert again.rc == 0, again.all


# ------------------------------------------------------------------ item 4: address space


def _foreign_link(host: Netns) -> str:
    """A veth pair of someone else's in the sandbox (a VPN's tunnel, say), up."""
    name = unique("v")
    sh("ip", "-n", host.name, "link", "add", name, "type", "veth", "peer", "name", name + "p")
    sh("ip", "-n", host.name, "link", "set", name, "up")
    sh("ip", "-n", host.name, "link", "set", name + "p", "up")
    return name


def test_a_route_in_a_table_an_ip_rule_selects_is_a_conflict_naming_the_table(
        host_ns: Netns, tmp_path: Any) -> None:
    """Tailscale's table 52 (selected by its rule 5270); a table no rule selects is nobody's
    routing and is left out."""
    link = _foreign_link(host_ns)
    sh("ip", "-n", host_ns.name, "route", "add", "10.232.0.0/16", "dev", link, "table", "52")
    sh("ip", "-n", host_ns.name, "rule", "add", "pref", "5270", "lookup", "52")
    sh("ip", "-n", host_ns.name, "route", "add", "10.233.0.0/16", "dev", link, "table", "4242")
    bridge = unique("b")
    clash = _config(tmp_path, bridge, "10.232.7.0/24", [], "clash.yaml")
    plan = host_ns.reconcile("plan", "--no-agent", clash)
    assert plan.rc == 1, plan.all
    assert f"overlaps route 10.232.0.0/16 on {link} in table 52" in plan.out, plan.all
    applied = host_ns.reconcile("apply", clash)
    assert applied.rc == 1 and "refusing to apply" in applied.err, applied.all
    assert host_ns.link(bridge) is None
    free = _config(tmp_path, bridge, "10.233.7.0/24", [], "free.yaml")
    plan = host_ns.reconcile("plan", "--no-agent", free)
    assert plan.rc == 2 and "overlaps" not in plan.all, plan.all


@pytest.mark.docker
def test_in_a_sandbox_a_docker_network_of_another_namespace_is_a_warning(
        host_ns: Netns, tmp_path: Any) -> None:
    """The shared daemon's networks live in its own namespace, not the sandbox's: a subnet
    over one (the CNI test vector 10.0.0.0/8) cannot collide with the sandbox's routing.
    A declared Docker network over another one still conflicts: one daemon."""
    from tests.integration import docker_fixtures as fx  # noqa: PLC0415 (skips without docker)

    client = fx._client_or_skip()
    scratch = fx.DockerScratch(client, None)
    try:
        other, subnet = scratch.name("ten"), None
        for third in range(240, 256):
            candidate = f"10.{third}.77.0/24"
            try:
                client.api.create_network(other, driver="bridge", ipam=fx.docker.types.IPAMConfig(
                    pool_configs=[fx.docker.types.IPAMPool(subnet=candidate)]))
            except fx.docker.errors.APIError as exc:
                if "overlap" not in str(exc):
                    raise
                continue
            subnet = candidate
            break
        assert subnet is not None, "no free 10.x/24 for the test's Docker network"
        path = _config(tmp_path, unique("b"), "10.0.0.0/8", [])
        plan = host_ns.reconcile("plan", "--no-agent", path)
        assert plan.rc == 2, plan.all
        assert f"docker network {other} ({subnet}" in plan.all and "warning" in plan.all, plan.all
        mine = scratch.name("mine")
        clash = write(tmp_path, "docker.yaml", json.dumps(
            {"version": 1, "docker_networks": [{"name": mine, "subnet": subnet}]}) + "\n")
        plan = host_ns.reconcile("plan", "--no-agent", clash)
        assert plan.rc == 1 and f"docker network {other} ({subnet}" in plan.out, plan.all
    finally:
        scratch.cleanup()
        client.close()


# ------------------------------------------------------------------ item 6: the reverter


def _scope_dir(host: Netns) -> str:
    return os.path.join(os.environ["RECONCILER_STATE_DIR"], f"netns-{host.name}")


def _pending(host: Netns) -> dict[str, Any] | None:
    try:
        with open(os.path.join(_scope_dir(host), "pending.json")) as fh:
            rec: dict[str, Any] = json.load(fh)
            return rec
    except FileNotFoundError:
        return None


def _alive(pid: int | None) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(") ")[2][:1] not in ("Z", "X", "")
    except (FileNotFoundError, TypeError):
        return False


def _wait(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def box(host_ns: Netns) -> Iterator[Netns]:
    """``host_ns``; at the end no reverter of it left running, no record left behind."""
    try:
        yield host_ns
    finally:
        rec = _pending(host_ns)
        if rec is not None and _alive(rec.get("reverter_pid")):
            os.kill(rec["reverter_pid"], signal.SIGKILL)
        sh("rm", "-rf", _scope_dir(host_ns))


def test_a_killed_reverter_is_replaced_by_the_next_command(box: Netns, tmp_path: Any) -> None:
    """The reverter is SIGKILLed inside the window: the next command that reads the scope
    (here an apply, refused because the change is pending) starts another one, which reverts
    at the deadline without anyone taking the lock."""
    a, b, bridge = unique("r") + "-a", unique("r") + "-b", unique("b")
    base = _config(tmp_path, bridge, "10.234.0.0/24", [{"id": a}], "base.yaml")
    more = _config(tmp_path, bridge, "10.234.0.0/24", [{"id": a}, {"id": b}], "more.yaml")
    assert box.reconcile("apply", "--no-probe", base).rc == 0
    r = box.reconcile("apply", "--no-probe", more, "--confirm-within", "5s")
    assert r.rc == 0, r.all
    rec = _pending(box)
    assert rec is not None and _alive(rec["reverter_pid"])
    os.kill(rec["reverter_pid"], signal.SIGKILL)
    _wait(lambda: not _alive(rec["reverter_pid"]), 10, "the reverter's death")
    refused = box.reconcile("apply", "--no-probe", base)
    assert refused.rc == 1 and "pending until" in refused.err, refused.all
    now = _pending(box)
    assert now is not None and now["reverter_pid"] != rec["reverter_pid"], now
    assert _alive(now["reverter_pid"]), "no reverter runs for the pending change"
    _wait(lambda: _pending(box) is None, rec["deadline"] - time.time() + 30, "the revert")
    assert not os.path.exists(f"/run/netns/{b}") and os.path.exists(f"/run/netns/{a}")
    assert box.reconcile("plan", "--no-agent", base).rc == 0  # its neighbour entries too


#: in the sandbox's network namespace: record a pending change as `apply --confirm-within`
#: does before its first op, and die (killed before it could start the reverter)
RECORD_ONLY = r"""
import time
from reconciler.domain.model import DesiredState
from reconciler.engine import safechange
from reconciler.engine.reconcile import Reconciler
rec = Reconciler()
safechange.record(rec.observe(DesiredState()), rec.observer.handles, deadline=time.time() + 600)
"""


def test_a_record_whose_apply_died_before_its_reverter_refuses_nothing(
        box: Netns, tmp_path: Any) -> None:
    """A CLI killed between writing ``pending.json`` and starting the reverter made no change:
    the next command that takes the lock finds it so and drops the record at once, instead
    of refusing every change for the whole window."""
    a, bridge = unique("r") + "-a", unique("b")
    base = _config(tmp_path, bridge, "10.235.0.0/24", [{"id": a}])
    assert box.reconcile("apply", "--no-probe", base).rc == 0
    sh("nsenter", f"--net=/run/netns/{box.name}", sys.executable, "-c", RECORD_ONLY)
    rec = _pending(box)
    assert rec is not None and rec["reverter_pid"] is None, rec
    r = box.reconcile("apply", "--no-probe", base)
    assert r.rc == 0, r.all
    assert "before its first change" in r.err, r.all
    assert _pending(box) is None


# ------------------------------------------------------------------ item 6: impact's flows

#: accepts on argv[1] and keeps every connection open, answering its first line
HOLD = r"""
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
kept = []
def conn(c):
    kept.append(c); c.makefile("rb").readline(); c.sendall(b"held\n")
print("ready", flush=True)
while True:
    c, _ = s.accept(); threading.Thread(target=conn, args=(c,), daemon=True).start()
"""

#: one connection from source port argv[3] to argv[1]:argv[2], held open until killed
DIAL_FROM = r"""
import socket, sys, time
c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
c.bind(("0.0.0.0", int(sys.argv[3]))); c.settimeout(5); c.connect((sys.argv[1], int(sys.argv[2])))
c.sendall(b"hi\n"); print(c.makefile("rb").readline().decode().strip(), flush=True)
time.sleep(3600)
"""


@contextlib.contextmanager
def _process(*argv: str) -> Iterator[str]:
    p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 15)
        yield p.stdout.readline().strip() if ready else "no answer"
    finally:
        p.kill()
        p.wait()


def test_impact_counts_a_clients_flow_from_the_probes_port_range(
        host_ns: Netns, tmp_path: Any) -> None:
    """A client of another host whose ephemeral port is in 61000-61999 is a real flow; one
    from the host itself on such a port is what a probe looks like, and is left out."""
    host_ip, port = "10.236.9.1", 18195
    aid, bridge = unique("f") + "-a", unique("b")
    mapped = _config(tmp_path, bridge, "10.236.0.0/24",
                     [{"id": aid, "ports": [{"host": port, "to": 80}]}], "mapped.yaml")
    closed = _config(tmp_path, bridge, "10.236.0.0/24", [{"id": aid}], "closed.yaml")
    assert host_ns.reconcile("apply", "--no-probe", mapped).rc == 0
    with client_of(host_ns, host_ip=host_ip, client_ip="10.236.9.2") as client, \
            _process("nsenter", f"--net=/run/netns/{aid}", sys.executable, "-c", HOLD,
                     "80") as ready, \
            _process("nsenter", f"--net=/run/netns/{client.name}", sys.executable, "-c",
                     DIAL_FROM, host_ip, str(port), "61234") as remote, \
            _process("nsenter", f"--net=/run/netns/{host_ns.name}", sys.executable, "-c",
                     DIAL_FROM, host_ip, str(port), "61235") as local:
        assert (ready, remote, local) == ("ready", "held", "held")
        r = host_ns.reconcile("plan", "--no-agent", "--output", "json", closed)
        assert r.rc == 2, r.all
        impacts = {(i["type"], i["name"]): i for c in json.loads(r.out)["changes"]
                   for i in c["impact"]}
        assert impacts[("port_map", f"{port}/tcp")]["flows"] == 1, impacts


# ------------------------------------------------------------------ item 6: gc


def test_gc_leaves_the_veth_of_a_live_namespace_whatever_the_marks_say(
        host_ns: Netns, tmp_path: Any) -> None:
    """A workload rewrote the ``lo`` alias of its namespace: the namespace is mounted and
    live, its ``eth0`` is the peer of our veth; gc must not cut it off. And a foreign rule
    whose comment names an allocation is nobody's leftover: no warning about it."""
    aid, bridge = unique("g") + "-a", unique("b")
    path = _config(tmp_path, bridge, "10.237.0.0/24", [{"id": aid}])
    assert host_ns.reconcile("apply", "--no-probe", path).rc == 0
    veth = alloc_veth_name(aid)
    sh("ip", "-n", aid, "link", "set", "lo", "alias", "a workload's own words")
    try:
        host_ns.run("iptables", "-A", "FORWARD", "-m", "comment", "--comment",
                    "reconciler:alloc=ghost", "-j", "ACCEPT")
        report = host_ns.reconcile("gc", "--plan", "--output", "json")
        assert report.rc in (0, 2), report.all
        doc = json.loads(report.out)
        assert not [c for c in doc["changes"] if veth in json.dumps(c)], doc["changes"]
        assert not [w for w in doc["warnings"] if "ghost" in w], doc["warnings"]
        assert [w for w in doc["warnings"] if veth in w and f"/run/netns/{aid}" in w
                and "not an orphan" in w], doc["warnings"]
        done = host_ns.reconcile("gc")
        assert done.rc == 0, done.all
        assert host_ns.link(veth) is not None
        assert sh("ip", "-n", aid, "-j", "link", "show", "eth0").stdout.strip() not in ("", "[]")
    finally:  # the mark back: the sandbox's teardown destroys what is ours
        sh("ip", "-n", aid, "link", "set", "lo", "alias", host_alias(host_ns))


def host_alias(host: Netns) -> str:
    """The ``lo`` alias the reconciler of the sandbox writes (to put the mark back)."""
    return alloc_ns_alias(str(os.stat(f"/run/netns/{host.name}").st_ino))


# ------------------------------------------------------------------ gap: a revert's neighbours


def test_a_revert_of_an_added_allocation_takes_its_neighbour_entries(
        box: Netns, tmp_path: Any) -> None:
    """The change added an allocation (its bridge-side neighbour entries seeded with it):
    after `revert`, none of them is left, so plan and verify are clean at once."""
    a, b, bridge = unique("n") + "-a", unique("n") + "-b", unique("b")
    base = _config(tmp_path, bridge, "10.238.0.0/24", [{"id": a, "address": "10.238.0.10"}],
                   "base.yaml")
    more = _config(tmp_path, bridge, "10.238.0.0/24", [{"id": a, "address": "10.238.0.10"},
                                                       {"id": b, "address": "10.238.0.11"}],
                   "more.yaml")
    assert box.reconcile("apply", "--no-probe", base).rc == 0
    assert box.reconcile("apply", "--no-probe", more, "--confirm-within", "5m").rc == 0
    neigh = sh("ip", "-n", box.name, "neigh", "show", "dev", bridge).stdout
    assert "10.238.0.11 " in neigh, neigh  # seeded with the allocation
    r = box.reconcile("revert")
    assert r.rc == 0, r.all
    neigh = sh("ip", "-n", box.name, "neigh", "show", "dev", bridge).stdout
    assert "10.238.0.11 " not in neigh, neigh
    plan = box.reconcile("plan", "--no-agent", base)
    assert plan.rc == 0, plan.all
    verify = box.reconcile("verify", base)
    assert verify.rc == 0, verify.all
