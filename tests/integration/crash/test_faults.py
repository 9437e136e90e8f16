"""Host faults: the firewall flushed, a bridge deleted, a namespace unmounted, the xtables
lock held, Docker rewriting its chains, netlink errors injected — each healed by the
next apply or reported as one clear error, never a traceback or a half-made object.

Everything happens in a throwaway "host" namespace (``host_ns``); checks use ip,
``nft list table inet reconciler``, iptables and real traffic from a client namespace.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.support.cli import Result, reconcile
from tests.support.host import REPO, SESSION, Netns, unique, write
from tests.support.traffic import HOST_IP, client_of, fetch, listening

sys.path.insert(0, REPO)
from bench.soak_crash import Config, Host, leaks, veth_name  # noqa: E402

pytestmark = pytest.mark.root
BRIDGE = "rflt0"


def state(tmp_path: object, n: int = 3) -> Config:
    """A bridge, a subnet and ``n`` allocations; the first maps host port 8080 -> 80."""
    ids = tuple(unique("f") for _ in range(n))
    lines = ["version: 1", f"bridges: [{{name: {BRIDGE}}}]",
             f"subnets: [{{name: flt, bridge: {BRIDGE}, cidr: 10.211.0.0/24}}]", "allocs:"]
    for i, a in enumerate(ids):
        ports = ", ports: [{host: 8080, to: 80}, {host: auto, to: 81}]" if i == 0 else ""
        lines.append(f"  - {{id: {a}, subnet: flt{ports}}}")
    return Config(write(tmp_path, "state.yaml", "\n".join(lines) + "\n"), ids, ())


def as_host(ns: Netns) -> Host:
    """The soak's leak checker over a host_ns (no new namespace made)."""
    h = Host.__new__(Host)
    h.name, h.prefix = ns.name, f"{SESSION}f"
    h.inode = os.stat(f"/run/netns/{ns.name}").st_ino
    return h


def converged(ns: Netns, cfg: Config) -> None:
    r = ns.reconcile("plan", cfg.path)
    assert r.rc == 0, r.all
    assert leaks(as_host(ns), cfg) == []


def apply(ns: Netns, cfg: Config, **kw: object) -> None:
    r = ns.reconcile("apply", cfg.path, **kw)  # type: ignore[arg-type]
    assert r.rc == 0, r.all


def with_faults(ns: Netns, faults: str, *args: str) -> Result:
    """`reconcile ARGS` in ``ns``, its driver ops failing as ``faults`` says (faults.py)."""
    return reconcile(faults, "--netns", ns.name, *args, module="tests.support.faults")


def test_flushed_firewall_is_healed(host_ns: Netns, tmp_path):
    cfg = state(tmp_path)
    apply(host_ns, cfg)
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):  # everything of earlier versions, and the shim
            host_ns.run(tool, "-t", table, "-F")
            host_ns.run(tool, "-t", table, "-X")
    host_ns.run("nft", "delete", "table", "inet", "reconciler")
    assert "RECONCILER" not in host_ns.firewall_text(4)
    r = host_ns.reconcile("plan", cfg.path)
    assert r.rc == 2 and "firewall nftables" in r.out
    apply(host_ns, cfg)
    assert f"reconciler:alloc={cfg.allocs[0]}" in host_ns.firewall_text(4)
    converged(host_ns, cfg)
    if shutil.which("nft"):  # the nftables view of the same: everything gone at once
        host_ns.run("nft", "flush", "ruleset")
        assert "RECONCILER" not in host_ns.firewall_text(4)
        apply(host_ns, cfg)
        converged(host_ns, cfg)


def test_deleted_bridge_is_healed_with_its_ports(host_ns: Netns, tmp_path):
    cfg = state(tmp_path)
    apply(host_ns, cfg)
    host_ns.run("ip", "link", "del", BRIDGE)
    r = host_ns.reconcile("plan", cfg.path)
    assert r.rc == 2 and f"+ bridge {BRIDGE}" in r.out
    apply(host_ns, cfg)
    for a in cfg.allocs:
        assert host_ns.link(veth_name(a))["master"] == BRIDGE
    converged(host_ns, cfg)


def test_unmounted_namespace_is_replaced(host_ns: Netns, tmp_path):
    cfg = state(tmp_path)
    apply(host_ns, cfg)
    victim = cfg.allocs[1]
    subprocess.run(["umount", f"/run/netns/{victim}"], check=True)
    assert os.path.exists(f"/run/netns/{victim}")  # an empty file is left behind
    r = host_ns.reconcile("plan", cfg.path)
    assert r.rc == 2 and f"-/+ alloc {victim}" in r.out, r.out
    apply(host_ns, cfg)
    converged(host_ns, cfg)


def test_held_xtables_lock_is_waited_for(host_ns: Netns, tmp_path):
    """Another iptables user holds the machine-wide lock for 2 s: apply waits, succeeds."""
    cfg = state(tmp_path, 1)
    holder = subprocess.Popen(["flock", "/run/xtables.lock", "sleep", "2"])
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        apply(host_ns, cfg)
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    converged(host_ns, cfg)
    assert took < 30


@pytest.mark.parametrize("fault", ["netns.create:2", "alloc.attach:2", "alloc.configure:3",
                                   "link.add_bridge:1", "addr.add:1", "firewall.nft:1",
                                   "netns.delete:1"])
@pytest.mark.real_process  # the exit code and error shape of a real process
def test_injected_driver_error_is_reported_and_the_next_run_converges(
        host_ns: Netns, tmp_path, fault: str):
    cfg = before = state(tmp_path)
    if fault == "netns.delete:1":  # a failure while removing: prune the last alloc
        apply(host_ns, cfg)
        with open(cfg.path) as fh:
            fewer = fh.read().rsplit("\n  - ", 1)[0] + "\n"
        cfg = Config(write(tmp_path, "fewer.yaml", fewer), cfg.allocs[:-1], ())
    r = with_faults(host_ns, fault, "apply", cfg.path)
    op = fault.split(":")[0]
    assert r.rc == 1, r.all
    assert "Traceback" not in r.all and "internal error" not in r.all
    errors = [ln for ln in r.err.splitlines() if ln.startswith("error:")]
    # SPEC §11: the rest of the plan is applied and a last line counts what was blocked
    *errors, summary = errors
    assert re.fullmatch(r"error: \d+ resource\(s\) blocked: .*", summary), r.err
    assert errors and all("injected fault" in ln for ln in errors), r.err
    assert f"{op}: Operation not permitted" in errors[0]
    assert "failed" in r.out and "skipped" in r.out
    # no half-made object: no veth without its namespace, no temporary bridge (an alloc
    # whose removal failed is still whole)
    half = [f for f in leaks(as_host(host_ns), before)
            if "without a declared namespace" in f or "temporary" in f or "not marked" in f]
    assert half == []
    apply(host_ns, cfg)
    converged(host_ns, cfg)


def test_transient_busy_error_is_retried(host_ns: Netns, tmp_path):
    cfg = state(tmp_path)
    r = with_faults(host_ns, "alloc.attach:2:EBUSY", "-v", "apply", cfg.path)
    assert r.rc == 0, r.all
    assert "retrying" in r.err
    converged(host_ns, cfg)


def docker_rewrites_its_chains(ns: Netns, flush_forward: bool) -> None:
    """What dockerd does on (re)start: its chains first in FORWARD, policy DROP."""
    if flush_forward:
        ns.run("iptables", "-F", "FORWARD")
    for chain in ("DOCKER-USER", "DOCKER-FORWARD"):
        ns.run("iptables", "-N", chain, check=False)
        ns.run("iptables", "-F", chain)
    ns.run("iptables", "-A", "DOCKER-USER", "-j", "RETURN")
    ns.run("iptables", "-I", "FORWARD", "1", "-j", "DOCKER-FORWARD")
    ns.run("iptables", "-I", "FORWARD", "1", "-j", "DOCKER-USER")
    ns.run("iptables", "-P", "FORWARD", "DROP")


#: the mark shim as ``iptables -S`` prints it (SPEC §12, planner.shim)
SHIM = '-A FORWARD -m mark --mark 0x2000/0x2000 -m comment --comment "reconciler:shim" -j ACCEPT'


def test_docker_rewriting_its_chains_keeps_our_shim_and_traffic(host_ns: Netns, tmp_path):
    cfg = state(tmp_path, 1)
    apply(host_ns, cfg)
    with client_of(host_ns) as client, listening(cfg.allocs[0], 80):
        assert fetch(client, HOST_IP, 8080) == "ok 80"
        assert SHIM not in host_ns.run("iptables", "-S", "FORWARD").stdout  # nothing drops yet
        # dockerd's start: its policy DROP stops our traffic until a pass puts the shim there
        docker_rewrites_its_chains(host_ns, flush_forward=False)
        assert fetch(client, HOST_IP, 8080, timeout=1) == ""
        r = host_ns.reconcile("plan", cfg.path)
        assert r.rc == 2 and "filter/FORWARD" in r.out, r.all
        apply(host_ns, cfg)
        forward = host_ns.run("iptables", "-S", "FORWARD").stdout.splitlines()
        assert "-P FORWARD DROP" in forward and forward.count(SHIM) == 1, forward
        assert fetch(client, HOST_IP, 8080) == "ok 80"  # the shim lets our marked traffic by
        converged(host_ns, cfg)
        # our forward chain flushed (what flushing RECONCILER-FORWARD was): nothing is
        # marked, Docker's DROP stops the traffic, and a pass rebuilds the chain
        host_ns.run("nft", "flush", "chain", "inet", "reconciler", "isolate")
        assert fetch(client, HOST_IP, 8080, timeout=1) == ""
        r = host_ns.reconcile("plan", cfg.path)
        assert r.rc == 2 and "firewall nftables" in r.out, r.all
        apply(host_ns, cfg)
        assert fetch(client, HOST_IP, 8080) == "ok 80"
        converged(host_ns, cfg)
        # a restart that rebuilt FORWARD from scratch dropped the shim: traffic stops, apply heals
        docker_rewrites_its_chains(host_ns, flush_forward=True)
        assert fetch(client, HOST_IP, 8080, timeout=1) == ""
        apply(host_ns, cfg)
        assert fetch(client, HOST_IP, 8080) == "ok 80"
        forward = host_ns.run("iptables", "-S", "FORWARD").stdout.splitlines()
        assert "-A FORWARD -j DOCKER-USER" in forward and forward.count(SHIM) == 1, forward
        converged(host_ns, cfg)
