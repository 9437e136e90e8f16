"""`reconcile gc` against the real kernel, iptables and dockerd.

Each kind of leak is made for real in a throwaway host namespace (``host_ns``): a
``kill -9`` mid-apply (``faults.py``'s SIGKILL fault), a veth deleted with ``ip``, a
namespace deleted with ``ip netns del`` (while a process holds it, or not), a socket
nobody listens on, a record's temporary whose writer is gone. Beside them stand
look-alikes that are not ours: an unmarked veth named like ours, a foreign namespace
and one marked by another host, a foreign rule naming one of our allocations, a held
lock, foreign Docker networks. `gc --plan` must list exactly ours (exit 2), `gc` remove
them (exit 0) and nothing else, and a second `gc --plan` find nothing (exit 0) —
checked with `ip -j`, `ip netns`, iptables-save, `docker network ls` and the files
themselves. The run directory is the test's own (``RECONCILER_LOCK_DIR``): the
machine's /run/reconciler belongs to whoever else runs here.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.domain.docker import SCOPE_LABEL
from reconciler.domain.ownership import (
    DOCKER_LABEL,
    DOCKER_LABEL_VALUE,
    alloc_veth_name,
    probe_vantage_names,
)
from reconciler.drivers import statedir
from tests.support.cli import Result
from tests.support.dockercli import assert_all_reattached, four_attached, ids, journals
from tests.support.dockerscratch import DockerScratch
from tests.support.host import REPO, Netns, sh, unique, write

pytestmark = pytest.mark.root

BRIDGE = "rgcbr0"



@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A run directory of the test's own (0700, root's), for every CLI call of the test;
    short, as the real one is (a unix socket's path has at most 107 bytes)."""
    d = Path(f"/run/{unique('r')}")
    d.mkdir(mode=0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def gc(ns: Netns, run_dir: Path, *args: str) -> Result:
    return ns.reconcile(*args, env={"RECONCILER_LOCK_DIR": str(run_dir)})


def with_kill(ns: Netns, run_dir: Path, fault: str, *args: str) -> Result:
    """`reconcile ARGS` in ``ns``, killed -9 at ``fault`` (tests/support/faults.py)."""
    p = subprocess.run([sys.executable, "-m", "tests.support.faults", fault,
                        "--netns", ns.name, *args], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "RECONCILER_LOCK_DIR": str(run_dir)})
    return Result(p.returncode, p.stdout, p.stderr)


def allocs_file(tmp_path: Path, name: str, ids: list[str], ports: dict[str, int],
                extra: str = "") -> str:
    lines = ["version: 1", f"bridges: [{{name: {BRIDGE}}}]",
             f"subnets: [{{name: rgc, bridge: {BRIDGE}, cidr: 10.214.0.0/24}}]", "allocs:"]
    for a in ids:
        mapped = f", ports: [{{host: {ports[a]}, to: 80}}]" if a in ports else ""
        lines.append(f"  - {{id: {a}, subnet: rgc{mapped}}}")
    return write(tmp_path, name, "\n".join(lines) + "\n" + extra)


def report(r: Result) -> tuple[set[str], set[str]]:
    """(kind/name of every change, path of every file) of `gc --plan --output json`."""
    doc = json.loads(r.out)
    return ({f"{c['kind']}/{c['name']}" for c in doc["changes"]},
            {f["path"] for f in doc["files"]})


def netns_names() -> set[str]:
    out = sh("ip", "-j", "netns", "list").stdout
    return {n["name"] for n in json.loads(out)} if out.strip() else set()


def links(ns: Netns) -> set[str]:
    return {lk["ifname"] for lk in ns.ip_json("link", "show")}


@pytest.fixture
def holder() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts inside namespaces; killed afterwards, even on failure."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.real_process  # the exit code and error shape of a real process
def test_gc_collects_exactly_the_broken_halves_and_stale_files(
        host_ns: Netns, run_dir: Path, tmp_path: Path,
        holder: list[subprocess.Popen[bytes]]) -> None:
    a1, a2, a3, a4 = (unique("g") for _ in range(4))
    a5, a6 = sorted(unique("g") for _ in range(2))  # allocations are made in id order
    first = [a1, a2, a3, a4]
    ports = {a1: 8081, a2: 8082, a3: 8083, a4: 8084}
    r = gc(host_ns, run_dir, "apply", "--no-probe", allocs_file(tmp_path, "a.yaml", first, ports))
    assert r.rc == 0, r.all
    inode = os.stat(f"/run/netns/{host_ns.name}").st_ino
    foreign = unique("x")
    marked_elsewhere = unique("y")
    look_alike = "vr0123456789ab"
    lock_fd = None
    try:
        # kill -9 mid-apply: a5 is made whole, a6's namespace never gets its veth, and the
        # host lock stays behind
        more = allocs_file(tmp_path, "b.yaml", [*first, a5, a6], ports)
        r = with_kill(host_ns, run_dir, "alloc.attach:2:SIGKILL", "apply", "--no-probe", more)
        assert r.rc == -9, r.all
        assert a6 in netns_names() and alloc_veth_name(a6) not in links(host_ns)
        stale_lock = run_dir / f"netns-{inode}.lock"
        assert stale_lock.exists()
        # by hand with ip: a1 loses its veth; a2's namespace is unmounted while a process
        # holds it (its veth stays); a3's namespace goes, its rules stay
        host_ns.run("ip", "link", "del", alloc_veth_name(a1))
        holder.append(subprocess.Popen(["nsenter", f"--net=/run/netns/{a2}", "sleep", "120"]))
        time.sleep(0.3)
        sh("ip", "netns", "del", a2)
        sh("ip", "netns", "del", a3)
        # a socket nobody listens on, a temporary whose writer is gone
        dead_sock = run_dir / f"plan-{inode}.sock"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(dead_sock))
        s.close()
        writer = subprocess.Popen(["true"])
        writer.wait()
        scope = statedir.scope_dir(f"netns/{host_ns.name}")
        tmp_record = Path(scope) / f".pending.json.{writer.pid}.tmp"
        tmp_record.write_text("{}")
        # look-alikes: an unmarked veth named like ours, a foreign namespace and one that
        # another host marked, a foreign rule naming a3, a lock someone holds
        host_ns.run("ip", "link", "add", look_alike, "type", "veth", "peer", "name", "rgcpeer0")
        sh("ip", "netns", "add", foreign)
        sh("ip", "netns", "add", marked_elsewhere)
        sh("ip", "-n", marked_elsewhere, "link", "set", "lo", "alias",
           "managed-by=reconciler alloc-of=1")
        host_ns.run("iptables", "-A", "FORWARD", "-m", "comment", "--comment",
                    f"reconciler:alloc={a3}", "-j", "ACCEPT")
        held = run_dir / "netns-1.lock"
        held.touch()
        lock_fd = os.open(held, os.O_RDONLY)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)

        r = gc(host_ns, run_dir, "gc", "--plan", "--output", "json")
        assert r.rc == 2, r.all
        changes, files = report(r)
        assert changes == {f"alloc/{a1}", f"alloc/{a6}", f"veth/{alloc_veth_name(a2)}"}, r.out
        # without files their rules stay (the files may still declare them: auto ports)
        (kept,) = [w for w in json.loads(r.out)["warnings"] if "port-map rules" in w]
        assert all(f"alloc {a}" in kept for a in (a1, a2, a3)) and a4 not in kept, kept
        assert files == {str(stale_lock), str(dead_sock), str(tmp_record)}, r.out
        text = gc(host_ns, run_dir, "gc", "--plan")
        assert text.rc == 2 and "Gc: 3 objects" in text.out, text.all
        assert stale_lock.exists() and dead_sock.exists()  # --plan removed nothing

        r = gc(host_ns, run_dir, "gc")
        assert r.rc == 0, r.all
        assert "Traceback" not in r.all
        names = netns_names()
        assert not names & {a1, a2, a3, a6}, names
        assert {a4, a5, foreign, marked_elsewhere} <= names
        host_links = links(host_ns)
        assert alloc_veth_name(a2) not in host_links
        assert {alloc_veth_name(a4), alloc_veth_name(a5), look_alike, BRIDGE} <= host_links
        rules = host_ns.firewall_text(4).splitlines()
        ours = [r for r in rules if r.startswith("-A RECONCILER-")]
        for a in (a1, a2, a3, a4):
            assert [r for r in ours if f"alloc={a}" in r], a
        assert not stale_lock.exists() and not dead_sock.exists() and not tmp_record.exists()
        assert held.exists()
        # the held namespace lost its eth0 with the veth (the kernel deletes both ends)
        inside = sh("nsenter", f"--net=/proc/{holder[0].pid}/ns/net", "ip", "-j", "link").stdout
        assert "eth0" not in {lk["ifname"] for lk in json.loads(inside)}

        again = gc(host_ns, run_dir, "gc", "--plan")
        assert again.rc == 0 and "Nothing to collect." in again.out, again.all
        assert "port-map rules" in again.out, again.all
        # the files say a1-a3 are gone: gc PATH removes their rules, and only theirs
        last = allocs_file(tmp_path, "c.yaml", [a4, a5], ports)
        r = gc(host_ns, run_dir, "gc", last)
        assert r.rc == 0, r.all
        rules = host_ns.firewall_text(4).splitlines()
        ours = [r for r in rules if r.startswith("-A RECONCILER-")]
        for a in (a1, a2, a3):
            assert not [r for r in ours if f"alloc={a}" in r], a
        assert [r for r in rules if r.startswith("-A FORWARD") and f"alloc={a3}" in r]
        assert [r for r in ours if f"alloc={a4}" in r]
        # what remains is whole: the last files apply without re-making anything
        r = gc(host_ns, run_dir, "plan", last)
        assert r.rc == 0, r.all
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
        for name in (foreign, marked_elsewhere):
            sh("ip", "netns", "del", name, check=False)


def test_gc_takes_the_host_lock_only_to_remove(host_ns: Netns, run_dir: Path,
                                               tmp_path: Path) -> None:
    a = unique("g")
    assert gc(host_ns, run_dir, "apply", "--no-probe",
              allocs_file(tmp_path, "a.yaml", [a], {})).rc == 0
    host_ns.run("ip", "link", "del", alloc_veth_name(a))
    inode = os.stat(f"/run/netns/{host_ns.name}").st_ino
    path = run_dir / f"netns-{inode}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = gc(host_ns, run_dir, "gc", "--plan")
        assert r.rc == 2 and f"- alloc {a}: broken" in r.out, r.all
        assert str(path) not in r.out  # held: not stale
        r = gc(host_ns, run_dir, "gc", "--lock-timeout", "0.5")
        assert r.rc == 1 and "another reconcile" in r.err, r.all
        assert a in netns_names()
    finally:
        os.close(fd)
    r = gc(host_ns, run_dir, "gc")
    assert r.rc == 0, r.all
    assert a not in netns_names()


@pytest.mark.docker
def test_gc_with_files_collects_what_no_file_declares_docker_networks_included(
        host_ns: Netns, run_dir: Path, tmp_path: Path) -> None:
    docker_cli = pytest.importorskip("docker")
    try:
        docker_cli.from_env(timeout=10).ping()
    except Exception as exc:  # noqa: BLE001 (any failure: no usable daemon)
        pytest.skip(f"docker daemon unreachable: {exc}")
    x1, x2 = unique("g"), unique("g")
    n1, n2 = unique("n"), unique("n")
    foreign, other_scope = unique("f"), unique("o")
    nets = f"docker_networks: [{{name: {n1}}}, {{name: {n2}}}]\n"
    everything = allocs_file(tmp_path, "all.yaml", [x1, x2], {x1: 8091, x2: 8090}, nets)
    fewer = allocs_file(tmp_path, "fewer.yaml", [x1], {x1: 8091},
                        f"docker_networks: [{{name: {n1}}}]\n")

    def docker(*args: str) -> str:
        return sh("docker", *args).stdout

    def network_names() -> set[str]:
        return set(docker("network", "ls", "--format", "{{.Name}}").split())

    try:
        r = gc(host_ns, run_dir, "apply", "--no-probe", everything)
        assert r.rc == 0, r.all
        docker("network", "create", foreign)
        docker("network", "create", "--label", f"{DOCKER_LABEL}={DOCKER_LABEL_VALUE}",
               "--label", f"{SCOPE_LABEL}=netns/elsewhere", other_scope)
        # without files: nothing of it is a broken half
        r = gc(host_ns, run_dir, "gc", "--plan")
        assert r.rc == 0 and "Nothing to collect." in r.out, r.all
        r = gc(host_ns, run_dir, "gc", "--plan", "--output", "json", fewer)
        assert r.rc == 2, r.all
        changes, files = report(r)
        assert changes == {f"alloc/{x2}", f"docker_network/{n2}", "firewall/nftables"}, r.out
        assert files == set()
        r = gc(host_ns, run_dir, "gc", fewer)
        assert r.rc == 0, r.all
        assert {n1, foreign, other_scope} <= network_names() and n2 not in network_names()
        assert x2 not in netns_names() and x1 in netns_names()
        assert f"alloc={x2}" not in host_ns.firewall_text(4)
        assert alloc_veth_name(x1) in links(host_ns)
        r = gc(host_ns, run_dir, "gc", "--plan", fewer)
        assert r.rc == 0 and "Nothing to collect." in r.out, r.all
        # what stays is as it was: nothing to do for its files (a declared subnet's rules
        # that only the gone allocation needed would be an update, which gc leaves to apply)
        r = gc(host_ns, run_dir, "plan", fewer)
        assert r.rc == 0, r.all
    finally:
        gc(host_ns, run_dir, "destroy", "--yes")
        for name in (n1, n2, foreign, other_scope):
            subprocess.run(["docker", "network", "rm", name], capture_output=True, check=False)
        assert not {n1, n2, foreign, other_scope} & network_names()


def test_gc_removes_the_probe_vantage_a_killed_prober_left(
        host_ns: Netns, run_dir: Path, holder: list[subprocess.Popen[bytes]]) -> None:
    inode = os.stat(f"/run/netns/{host_ns.name}").st_ino
    vantage_ns, vantage_link = probe_vantage_names(str(inode))
    lease = ("import os, sys, time\n"
             "from reconciler.engine.probes import VantageLease\n"
             "VantageLease(sys.argv[1]).ensure()\n"
             "print('ready', flush=True)\n"
             "time.sleep(120)\n")
    env = {**os.environ, "RECONCILER_LOCK_DIR": str(run_dir)}
    prober = subprocess.Popen(["nsenter", f"--net=/run/netns/{host_ns.name}", sys.executable,
                               "-c", lease, str(inode)], stdout=subprocess.PIPE, env=env)
    holder.append(prober)  # type: ignore[arg-type]
    try:
        assert prober.stdout is not None and prober.stdout.readline() == b"ready\n"
        assert vantage_ns in netns_names() and vantage_link in links(host_ns)
        r = gc(host_ns, run_dir, "gc", "--plan")
        assert r.rc == 0 and "Nothing to collect." in r.out, r.all  # a prober uses it
        prober.kill()  # kill -9: its share of the vantage goes, the vantage stays
        prober.wait()
        assert vantage_ns in netns_names()
        r = gc(host_ns, run_dir, "gc", "--plan", "--output", "json")
        assert r.rc == 2, r.all
        doc = json.loads(r.out)
        assert doc["probe_vantage"] == vantage_ns and doc["changes"] == []
        r = gc(host_ns, run_dir, "gc")
        assert r.rc == 0, r.all
        assert vantage_ns not in netns_names() and vantage_link not in links(host_ns)
        assert not (run_dir / f"probe-vantage-{inode}.lock").exists()
        r = gc(host_ns, run_dir, "gc", "--plan")
        assert r.rc == 0 and "Nothing to collect." in r.out, r.all
    finally:
        sh("ip", "netns", "del", vantage_ns, check=False)



def killed(ns: Netns, run_dir: Path, spec: str, *args: str) -> Result:
    """`reconcile ARGS` in ``ns``, SIGKILLed at ``spec`` (killpoints.py), on our run dir."""
    p = subprocess.run([sys.executable, "-m", "tests.support.killpoints", spec,
                        "--netns", ns.name, *args], capture_output=True, text=True,
                       timeout=300, cwd=REPO,
                       env={**os.environ, "RECONCILER_LOCK_DIR": str(run_dir)})
    return Result(p.returncode, p.stdout, p.stderr)


@pytest.mark.real_process  # the exit code and error shape of a real process
@pytest.mark.docker
def test_gc_finishes_an_interrupted_replace_before_it_collects(
        host_ns: Netns, run_dir: Path, docker_scratch_image: DockerScratch, tmp_path: Path) -> None:
    """Killed right after the new network was made, with every container detached: to
    gc with files that no longer declare it, the new network is an empty one of ours to
    remove, and the containers would stay detached for good. gc finishes the replace
    first (under the lock), so the network has its containers and stays (pruned once
    they leave); `gc --plan` says the journal is pending and exits 2."""
    import signal  # noqa: PLC0415
    name, changed, before = four_attached(host_ns, docker_scratch_image, tmp_path)
    r = killed(host_ns, run_dir, "create:1", "apply", "--force-replace", changed)
    assert r.rc == -signal.SIGKILL, r.all
    assert journals(host_ns) and len(ids(name)) == 1
    nothing = write(tmp_path, "none.yaml", "version: 1\n")
    r = gc(host_ns, run_dir, "gc", "--plan", nothing)
    assert r.rc == 2, r.all
    assert f"note: docker network {name}: a replace that a killed run left half done" \
        in r.err, r.all
    assert journals(host_ns)  # --plan finished nothing
    r = gc(host_ns, run_dir, "gc", nothing)
    assert "Traceback" not in r.all and "internal error" not in r.all, r.all
    assert r.rc == 0, r.all
    assert "interrupted replace" in r.err and "not removed yet" in r.out, r.all
    assert_all_reattached(name, before)  # read with `docker inspect`
    assert journals(host_ns) == []
    r = gc(host_ns, run_dir, "gc", "--plan", nothing)
    assert r.rc == 0 and "note:" not in r.err, r.all
