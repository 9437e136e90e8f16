"""The external probe vantage against the real kernel: two probers on one host share it, a
namespace that only looks like it is left alone, SIGTERM in the middle of `verify` and
`destroy` after a prober that died remove it. Checked with ``ip`` and ``/run/netns``, not
the prober's own view."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from reconciler.config.load import load
from reconciler.drivers import netns
from reconciler.engine.observe import Observer
from reconciler.engine.probes import Prober
from tests.support.host import Netns, sh
from tests.support.probing import failures, setup

pytestmark = pytest.mark.root


def _host_inode(host: Netns) -> str:
    return str(os.stat(f"/run/netns/{host.name}").st_ino)


def _vantages(host: Netns) -> list[str]:
    """The probes' namespaces of this sandbox under /run/netns (``ip netns list``)."""
    ino = _host_inode(host)
    return [ln.split()[0] for ln in sh("ip", "netns", "list").stdout.splitlines()
            if ln.startswith(f"rcprobe-{ino}")]


def _vantage_links(host: Netns) -> list[str]:
    out = sh("ip", "-n", host.name, "-o", "link", "show").stdout
    return [ln.split(":")[1].strip().split("@")[0] for ln in out.splitlines()
            if ln.split(":")[1].strip().startswith("rcprobe")]


def test_two_probers_on_one_host_do_not_take_each_others_vantage(
        host_ns: Netns, tmp_path: object) -> None:
    """An agent's prober lives on while a CLI's comes and goes: the agent's external probes
    keep holding, and the last one to close removes the vantage."""
    path, _allocs = setup(host_ns, tmp_path)
    desired = load([path])
    with netns.enter(host_ns.name):
        obs = Observer()
        agent, cli = Prober(obs.handles), Prober(obs.handles)
        try:
            live = obs.observe(desired)
            assert failures(agent.run(desired, live, external=True)) == []
            assert failures(cli.run(desired, live, external=True)) == []
            cli.close()
            assert failures(agent.run(desired, live, external=True)) == []
            # somebody removes it under the agent: the next run makes it again
            for name in _vantages(host_ns):
                sh("ip", "netns", "del", name)
            assert failures(agent.run(desired, live, external=True)) == []
        finally:
            cli.close()
            agent.close()
            obs.handles.close()
    assert _vantages(host_ns) == []
    assert _vantage_links(host_ns) == []


def test_a_namespace_named_like_the_vantage_but_not_marked_is_left_alone(
        host_ns: Netns, tmp_path: object) -> None:
    path, _allocs = setup(host_ns, tmp_path)
    desired = load([path])
    name = f"rcprobe-{_host_inode(host_ns)}"
    sh("ip", "netns", "add", name)
    try:
        inode = os.stat(f"/run/netns/{name}").st_ino
        with netns.enter(host_ns.name):
            obs = Observer()
            prober = Prober(obs.handles)
            try:
                results = prober.run(desired, obs.observe(desired), external=True)
            finally:
                prober.close()
                obs.handles.close()
        assert os.stat(f"/run/netns/{name}").st_ino == inode, "a foreign namespace was replaced"
        assert "eth0" not in sh("ip", "-n", name, "-o", "link", "show").stdout
        external = [r for r in results if r.path in ("external", "direct") and not r.skipped]
        assert external and all(not r.ok and "not ours" in str(r.cause) for r in external)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _verify(host: Netns, path: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "reconciler", "--netns", host.name, "verify",
                             path, "--probe-timeout", "3s"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_sigterm_in_the_middle_of_verify_removes_the_vantage(
        host_ns: Netns, tmp_path: object) -> None:
    path, _allocs = setup(host_ns, tmp_path)
    # the external probes wait their full timeout: time to be killed while the vantage is up
    host_ns.run("iptables", "-I", "FORWARD", "-s", "169.254.250.2", "-j", "DROP")
    try:
        p = _verify(host_ns, path)
        deadline = time.monotonic() + 20
        while not _vantages(host_ns) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.02)
        assert _vantages(host_ns), "the vantage never came up"
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=30)
        assert p.returncode != 0
        assert "Traceback" not in err, err
    finally:
        host_ns.run("iptables", "-D", "FORWARD", "-s", "169.254.250.2", "-j", "DROP")
    assert _vantages(host_ns) == []
    assert _vantage_links(host_ns) == []


def test_destroy_removes_the_vantage_a_dead_prober_left(
        host_ns: Netns, tmp_path: object) -> None:
    path, _allocs = setup(host_ns, tmp_path)
    crash = (
        "import os, sys\n"
        "from reconciler.config.load import load\n"
        "from reconciler.drivers import netns\n"
        "from reconciler.engine.observe import Observer\n"
        "from reconciler.engine.probes import Prober\n"
        "d = load([sys.argv[2]])\n"
        "with netns.enter(sys.argv[1]):\n"
        "    obs = Observer()\n"
        "    Prober(obs.handles).run(d, obs.observe(d), external=True)\n"
        "os._exit(9)\n")
    r = subprocess.run([sys.executable, "-c", crash, host_ns.name, path], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 9, r.stderr
    assert _vantages(host_ns), "the crash left no vantage to clean up"
    shown = host_ns.reconcile("show")
    assert "rcprobe" in shown.out, shown.all
    d = host_ns.reconcile("destroy", "--yes")
    assert d.rc == 0, d.all
    assert _vantages(host_ns) == []
    assert _vantage_links(host_ns) == []
