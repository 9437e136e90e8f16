"""Local users cannot steer the agent: not through symlinks into directories they can write,
not through files planted where the agent keeps its locks, not by exhausting its status
server; and what the machine refuses (a full disk, a read-only mount, the other iptables
backend) is one line.

Everything happens in the test's own namespaces and directories; the unprivileged user is
``nobody``; the only traffic goes to this machine's loopback.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support.figures import report
from tests.support.host import REPO, Netns, unique, write
from tests.support.localuser import NOBODY, PUBLIC_PYTHON, Watch, as_nobody

pytestmark = pytest.mark.root
BRIDGE = "rhard0"


def _state(alloc: str | None) -> str:
    allocs = f"allocs: [{{id: {alloc}, subnet: hn}}]\n" if alloc else "allocs: []\n"
    return (f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n"
            f"subnets: [{{name: hn, bridge: {BRIDGE}, cidr: 10.217.0.0/24}}]\n" + allocs)


@pytest.fixture
def public_dir() -> Iterator[str]:
    """A root-owned 0755 directory nobody can traverse (pytest's tmp_path is 0700)."""
    d = os.path.join("/run", unique("pub"))
    os.mkdir(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


#: an interpreter nobody can run (the venv's may live under root's home): stdlib scripts only
# ----------------------------------------------------------------- symlinks


#: nobody renames one root-owned file over another in a directory anyone can write: the
#: target stays root's, mode 0644, so an owner-and-mode check of the file alone passes
SWAP = "import os, sys; os.rename(sys.argv[1], sys.argv[2])"


def test_watch_refuses_a_link_into_a_directory_others_can_write(host_ns: Netns, public_dir):
    """The attack: conf/a.yaml -> WW/real.yaml, WW world-writable; nobody renames an older
    root-owned file of WW (an empty state) over the target and the agent prunes the
    allocation. It must not start at all."""
    a = unique("h")
    conf, ww = os.path.join(public_dir, "conf"), os.path.join(public_dir, "ww")
    os.mkdir(conf, 0o755)
    os.mkdir(ww)
    os.chmod(ww, 0o777)
    real = write(ww, "real.yaml", _state(a))
    older = write(ww, "older.yaml", _state(None))
    for f in (real, older):
        os.chmod(f, 0o644)
    os.symlink(real, os.path.join(conf, "a.yaml"))
    agent = Watch(host_ns, conf)
    try:
        deadline = time.monotonic() + 20
        while agent.proc.poll() is None and time.monotonic() < deadline and \
                (agent.status().get("last_pass") or {}).get("result") not in ("ok", "applied"):
            time.sleep(0.2)
        if agent.proc.poll() is None:  # it started: finish the attack, show what it cost
            swapped = as_nobody(SWAP, older, real)
            assert swapped.returncode == 0, swapped.stderr
            time.sleep(6)  # resyncs every 2 s
            gone = not os.path.exists(f"/run/netns/{a}")
            raise AssertionError(f"the agent accepted {conf}/a.yaml -> {real} in a world-"
                                 f"writable directory; nobody swapped it and the allocation "
                                 f"was {'pruned' if gone else 'kept'}")
        out = agent.output()
    finally:
        agent.stop()
    assert agent.proc.returncode == 1, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert f"{ww} (on the way to {conf}/a.yaml): refusing to watch" in out, out
    assert "Traceback" not in out and host_ns.link(BRIDGE) is None


def test_a_link_that_flips_into_a_directory_others_can_write_is_refused(host_ns: Netns,
                                                                         public_dir):
    """git-sync style: conf/current is a link root swaps atomically. Swapped to a revision
    that lies in a directory anyone can write (WW/rev2, itself root's and 0755: whoever can
    write WW can rename another tree to rev2), it is refused at the next load: the last good
    state stays, nothing is pruned."""
    a = unique("h")
    conf, good, ww = (os.path.join(public_dir, n) for n in ("conf", "good", "ww"))
    for d in (conf, good, ww):
        os.mkdir(d, 0o755)
    os.chmod(ww, 0o777)
    rev2 = os.path.join(ww, "rev2")
    os.mkdir(rev2, 0o755)
    write(good, "a.yaml", _state(a))
    write(rev2, "a.yaml", _state(None))
    os.symlink(good, os.path.join(conf, "current"))
    agent = Watch(host_ns, os.path.join(conf, "current"))
    try:
        agent.converged()
        assert os.path.exists(f"/run/netns/{a}")
        os.symlink(rev2, os.path.join(conf, ".next"))
        os.rename(os.path.join(conf, ".next"), os.path.join(conf, "current"))
        os.kill(agent.proc.pid, signal.SIGHUP)  # and the file watcher may see it too
        agent.wait(lambda: agent.status().get("config_error"), 20, "the config error")
        err = agent.status()["config_error"]["message"]
        assert err.startswith(f"{ww} (on the way to ") and "refusing to watch" in err, err
        seen = agent.status()["pass_count"]
        agent.wait(lambda: agent.status()["pass_count"] > seen, 20, "a resync more")
        assert os.path.exists(f"/run/netns/{a}"), "the allocation was pruned"
        assert host_ns.link(BRIDGE) is not None
    finally:
        out = agent.stop()
    assert agent.proc.returncode == 0 and "Traceback" not in out, out


# ----------------------------------------------------------------- run files


def test_a_link_planted_at_the_lock_path_is_not_followed(host_ns: Netns, tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    ino = os.stat(f"/run/netns/{host_ns.name}").st_ino
    os.symlink(str(precious), run / f"netns-{ino}.lock")
    cfg = write(tmp_path, "s.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    r = host_ns.reconcile("apply", cfg, env={"RECONCILER_LOCK_DIR": str(run)})
    assert precious.read_text() == "keep me\n"
    assert r.rc == 1 and r.err.count("\n") == 1, r.all
    assert "is a symlink; refusing to follow it" in r.err and host_ns.link(BRIDGE) is None
    # a run directory that is itself a link, or that others can write, is refused too
    os.unlink(run / f"netns-{ino}.lock")
    for bad in ("link", "mode"):
        d = tmp_path / f"run-{bad}"
        if bad == "link":
            os.symlink(str(run), d)
        else:
            d.mkdir()
            os.chmod(d, 0o777)
        r = host_ns.reconcile("apply", cfg, env={"RECONCILER_LOCK_DIR": str(d)})
        assert r.rc == 1 and r.err.count("\n") == 1 and "refusing the run directory" in r.err, \
            r.all
    assert host_ns.link(BRIDGE) is None


# ----------------------------------------------------------------- the status server


FLOOD = r"""
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = []
for _ in range(n):
    try:
        s = socket.create_connection((host, port), timeout=3)
    except OSError:
        continue
    socks.append(s)
print(len(socks), flush=True)
sys.stdin.read()
"""


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(ln.split()[1]) for ln in fh if ln.startswith("Threads:"))


def test_idle_connections_of_an_unprivileged_user_do_not_exhaust_the_agent(host_ns: Netns,
                                                                           tmp_path, request):
    n = 4000
    cfg = write(tmp_path, "s.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    agent = Watch(host_ns, cfg)
    flood = None
    try:
        agent.converged()
        before = _threads(agent.proc.pid)
        host, port = agent.addr.split(":")
        flood = subprocess.Popen([PUBLIC_PYTHON, "-c", FLOOD, host, port, str(n)], user=NOBODY,
                                 group=NOBODY, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, cwd="/")
        assert flood.stdout is not None
        opened = int(flood.stdout.readline())
        during = _threads(agent.proc.pid)
        t0 = time.monotonic()
        health = agent.get("/healthz", timeout=5)
        health_s = time.monotonic() - t0
        host_ns.run("ip", "link", "del", BRIDGE)  # drift, while the connections are held
        healed = agent.wait(lambda: host_ns.link(BRIDGE) is not None, 30, "the bridge back")
        after = _threads(agent.proc.pid)
    finally:
        if flood is not None:
            flood.kill()
            flood.wait()
        out = agent.stop()
    refused = [ln for ln in out.splitlines() if "status server: closed a connection" in ln]
    report(request, f"{opened} idle connections by uid {NOBODY}: agent threads {before} before, "
                    f"{during} during, {after} after the drift; /healthz {health and health[0]} "
                    f"in {health_s * 1000:.0f} ms; bridge deleted and healed in {healed:.1f}s; "
                    f"{len(refused)} log lines about refused clients, "
                    f"{out.count('Traceback')} tracebacks")
    assert opened >= n * 0.9
    assert during <= before + 2 and after <= before + 4, (before, during, after)
    assert health == (200, "ok\n")
    assert "Traceback" not in out
    assert 0 < len(refused) <= 60


# ----------------------------------------------------------------- the machine says no


def test_the_other_iptables_backend_holding_dockers_chains_refuses_the_upgrade(
        host_ns: Netns, tmp_path):
    """Converting an earlier version's RECONCILER-* chains (decision 046) while Docker's
    chains live in the other iptables backend: refused, nothing changed. Without chains to
    convert there is nothing to mix: our table is in neither backend, and the mark shim
    passes the other one's drops (SPEC §12)."""
    active = host_ns.run("iptables", "-V").stdout
    other = "iptables-legacy" if "nf_tables" in active else "iptables-nft"
    if shutil.which(other) is None:
        pytest.skip(f"{other} is not installed")
    for chain in ("DOCKER", "DOCKER-USER"):  # what dockerd of the other backend leaves here
        host_ns.run(other, "-N", chain)
    # what an earlier version left in the backend it used
    host_ns.run("iptables", "-N", "RECONCILER-FORWARD")
    host_ns.run("iptables", "-A", "RECONCILER-FORWARD", "-d", "10.217.0.0/24", "-o", BRIDGE,
                "-m", "comment", "--comment", "reconciler:subnet=hn", "-j", "DROP")
    host_ns.run("iptables", "-I", "FORWARD", "1", "-m", "comment", "--comment", "reconciler",
                "-j", "RECONCILER-FORWARD")
    old = host_ns.iptables_save(4)
    cfg = write(tmp_path, "s.yaml", _state(None))
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 1 and r.err.count("\n") == 1 and r.err.startswith("error: "), r.all
    assert "Docker's chains (DOCKER, DOCKER-USER) are in the" in r.err, r.err
    assert host_ns.link(BRIDGE) is None and "RECONCILER" not in host_ns.our_rules(4)
    strip = lambda s: [ln for ln in s.splitlines() if not ln.startswith("#")]  # noqa: E731
    assert strip(host_ns.iptables_save(4)) == strip(old)
    # with Docker's chains in our backend too, it is Docker's and ours: go ahead
    host_ns.run("iptables", "-N", "DOCKER")
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    assert "converting the RECONCILER-* iptables chains" in r.out, r.out
    assert "RECONCILER-FORWARD" not in host_ns.iptables_save(4)
    # nothing to convert: a fresh apply goes ahead with Docker's chains only in the other
    assert host_ns.reconcile("destroy", "--yes").rc == 0
    host_ns.run("iptables", "-X", "DOCKER")
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    assert "reconciler:subnet=hn" in host_ns.our_rules(4)


def test_write_errors_are_one_line(host_ns: Netns, tmp_path):
    cfg = write(tmp_path, "s.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    r = host_ns.reconcile("plan", cfg, "--out", "/dev/full")
    assert r.rc == 1 and r.err.splitlines()[-1] == (
        "error: /dev/full: cannot write the plan here: No space left on device"), r.all
    ro = tmp_path / "ro"
    ro.mkdir()
    shell = (f"mount -t tmpfs -o ro tmpfs {ro} && exec {sys.executable} -m reconciler "
             f"--netns {host_ns.name} \"$@\"")
    results = {}
    for args, env in ((["plan", cfg, "--out", f"{ro}/p.json"], {}),
                      (["apply", cfg], {"RECONCILER_LOCK_DIR": f"{ro}/run"})):
        p = subprocess.run(["unshare", "-m", "sh", "-c", shell, "sh", *args], capture_output=True,
                           text=True, timeout=120, cwd=REPO, env={**os.environ, **env})
        results[args[0]] = p
        assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
        assert "Read-only file system" in p.stderr and "internal error" not in p.stderr, p.stderr
    assert "cannot make the run directory" in results["apply"].stderr
    assert host_ns.link(BRIDGE) is None
