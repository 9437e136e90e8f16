"""`reconcile plan` answered by a running agent: same output as planning in-process, always.

The agent here watches a file that declares nothing for this host and runs
with --dry-run, so it never heals what a test breaks: every plan it answers
is compared with `plan --no-agent` right after each out-of-band change, one
change per kind of event source (netlink in an allocation namespace and in the
host, iptables, sysctl, a mount, /run/netns, a foreign namespace without an
nsid, the files themselves, Docker).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.agent import Agent, PlanAgent, plan_counts, same_as_in_process
from tests.support.cli import reconcile
from tests.support.host import REPO, SESSION, Netns, sh, unique, wait_for, write

pytestmark = pytest.mark.root

BRIDGE = "rcpa0"


def alloc_config(tmp_path: object, ids: list[str], *, extra_port: bool = False) -> str:
    lines = ["version: 1", f"bridges: [{{name: {BRIDGE}}}]", "subnets:",
             f"  - {{name: net, bridge: {BRIDGE}, cidr: 10.66.0.0/24, cidr6: 'fd00:66::/64'}}",
             "allocs:"]
    for i, a in enumerate(ids):
        ports = [{"host": 18080 + i, "to": 80}, {"host": "auto", "to": 443}]
        if extra_port and i == 0:
            ports.append({"host": 19000, "to": 9000})
        lines.append("  - " + json.dumps({"id": a, "subnet": "net", "ports": ports}))
    return write(tmp_path, "allocs.yaml", "\n".join(lines) + "\n")


#: another tool's link in the host (a VPN's): routes over the declared subnet go through it
FOREIGN = "rcpa-vpn0"


def foreign_veth(host: str) -> None:
    sh("ip", "-n", host, "link", "add", FOREIGN, "type", "veth", "peer", "name", FOREIGN + "p")
    for name in (FOREIGN, FOREIGN + "p"):
        sh("ip", "-n", host, "link", "set", name, "up")


def test_agent_plans_match_in_process_after_every_kind_of_change(plan_agent: PlanAgent,
                                                                 host_ns: Netns, tmp_path):
    a, b = unique("a"), unique("b")
    path = alloc_config(tmp_path, [a, b])
    assert host_ns.reconcile("apply", path).rc == 0
    r = same_as_in_process(plan_agent, path)
    assert r.rc == 0 and "No changes" in r.out

    def cached_answer() -> bool:
        # nothing changes now: the cached view answers (once IPv6 DAD, which the kernel
        # announces, has settled after the apply)
        before = plan_agent.counts().get("cached", 0)
        assert same_as_in_process(plan_agent, path).rc == 0
        return plan_agent.counts().get("cached", 0) == before + 1

    wait_for(cached_answer, 15, every=0.5, what="a plan answered from the cached view")

    def check(what: str, change: Callable[[], object], expect: str) -> None:
        change()
        r = same_as_in_process(plan_agent, path)
        assert r.rc == 2 and expect in r.out, f"{what}:\n{r.all}"
        fixed = host_ns.reconcile("apply", path)
        assert fixed.rc == 0, f"{what}: re-apply failed\n{fixed.all}"
        r = same_as_in_process(plan_agent, path)
        assert r.rc == 0, f"{what}: after re-apply\n{r.all}"

    observed = plan_agent.counts().get("observed", 0)
    # netlink inside an allocation namespace (heard through its nsid)
    check("route deleted in an alloc namespace",
          lambda: sh("ip", "-n", a, "route", "del", "default"), a)
    check("address deleted in an alloc namespace",
          lambda: sh("ip", "-n", b, "addr", "del", "10.66.0.3/24", "dev", "eth0"), b)
    check("eth0 down in an alloc namespace",
          lambda: sh("ip", "-n", a, "link", "set", "eth0", "down"), a)
    # netlink in the host
    check("bridge address deleted", lambda: sh("ip", "-n", host_ns.name, "addr", "flush",
                                               "dev", BRIDGE), "gateway")
    # nf_tables generation
    assert "alloc=" + a in host_ns.run("nft", "list", "map", "inet", "reconciler",
                                       "pm4_addr").stdout
    check("port map element deleted",
          lambda: host_ns.run("nft", "delete", "element", "inet", "reconciler", "pm4_addr",
                              "{ tcp . 18080 }"),
          "firewall")
    # sysctl (no event exists: read on every request)
    check("ip_forward off", lambda: host_ns.run("sysctl", "-qw", "net.ipv4.ip_forward=0"),
          "ip_forward")
    # a foreign route over the declared subnet (a datagram of route events only): a conflict
    foreign_veth(host_ns.name)
    sh("ip", "-n", host_ns.name, "route", "add", "10.66.0.128/25", "dev", FOREIGN)
    r = same_as_in_process(plan_agent, path)
    assert r.rc == 1 and f"overlaps route 10.66.0.128/25 on {FOREIGN}" in r.out, r.all
    sh("ip", "-n", host_ns.name, "route", "del", "10.66.0.128/25", "dev", FOREIGN)
    r = same_as_in_process(plan_agent, path)
    assert r.rc == 0, r.all
    counts = plan_agent.counts()
    # every change above was read back part by part: never the whole host again
    assert counts.get("observed", 0) == observed and counts.get("refreshed", 0) >= 9, counts
    # the files
    edited = alloc_config(tmp_path, [a, b], extra_port=True)
    r = same_as_in_process(plan_agent, edited)
    assert r.rc == 2 and "set pm4: 4 entries -> 5 entries" in r.out, r.all
    alloc_config(tmp_path, [a, b])
    assert same_as_in_process(plan_agent, path).rc == 0
    assert not plan_agent.counts().get("declined"), plan_agent.counts()


def test_unrelated_activity_on_the_host_does_not_cost_an_observation(
        plan_agent: PlanAgent, host_ns: Netns, tmp_path):
    """Other tools' links, namespaces and rules come and go: the plan stays fast and exact."""
    a = unique("a")
    path = alloc_config(tmp_path, [a])
    assert host_ns.reconcile("apply", path).rc == 0
    assert same_as_in_process(plan_agent, path).rc == 0
    observed = plan_agent.counts().get("observed", 0)
    other = unique("o")
    sh("ip", "netns", "add", other)
    try:
        cached = plan_agent.counts().get("cached", 0)
        sh("ip", "-n", host_ns.name, "link", "add", "rcpa-x0", "type", "veth", "peer", "name",
           "rcpa-x1", "netns", other)
        r = same_as_in_process(plan_agent, path)  # another tool's link: the plan stands
        assert r.rc == 0 and plan_agent.counts().get("cached", 0) == cached + 1, \
            plan_agent.counts()
        host_ns.run("iptables", "-A", "INPUT", "-p", "tcp", "--dport", "9", "-j", "ACCEPT")
        sh("ip", "-n", other, "link", "set", "lo", "up")
        r = same_as_in_process(plan_agent, path)
        assert r.rc == 0 and "No changes" in r.out, r.all
        sh("ip", "-n", host_ns.name, "link", "del", "rcpa-x0")
        assert same_as_in_process(plan_agent, path).rc == 0
    finally:
        sh("ip", "netns", "del", other, check=False)
    counts = plan_agent.counts()
    assert counts.get("observed", 0) == observed, counts


def test_unmount_with_the_namespace_kept_alive_is_seen(plan_agent: PlanAgent, host_ns: Netns,
                                                       tmp_path):
    """No netlink or inotify event: only the mount table says the name lost its namespace."""
    a = unique("a")
    path = alloc_config(tmp_path, [a])
    assert host_ns.reconcile("apply", path).rc == 0
    assert same_as_in_process(plan_agent, path).rc == 0
    holder = os.open(f"/run/netns/{a}", os.O_RDONLY)  # keeps the namespace and its veth alive
    try:
        sh("umount", "-l", f"/run/netns/{a}")  # lazy: our fd pins the mount
        # not compared with an in-process plan: the idle agent's own next pass removes
        # the empty, tagged file (crash debris of ours), so the two would race
        r = plan_agent.plan(path)
        assert r.rc == 2 and a in r.out, r.all
    finally:
        os.close(holder)
    assert host_ns.reconcile("apply", path).rc == 0
    assert same_as_in_process(plan_agent, path).rc == 0


def test_foreign_namespace_without_nsid_taking_our_mark_is_seen(plan_agent: PlanAgent,
                                                                host_ns: Netns, tmp_path):
    """A namespace with no nsid here sends no events here: its lo is read on every request."""
    a = unique("a")
    path = alloc_config(tmp_path, [a])
    assert host_ns.reconcile("apply", path).rc == 0
    other = unique("f")
    sh("ip", "netns", "add", other)
    try:
        assert same_as_in_process(plan_agent, path).rc == 0  # foreign: not ours, not planned
        mark = sh("ip", "-n", a, "-j", "link", "show", "lo").stdout
        alias = json.loads(mark)[0]["ifalias"]
        sh("ip", "-n", other, "link", "set", "lo", "alias", alias)
        r = same_as_in_process(plan_agent, path)
        assert r.rc == 2 and other in r.out, r.all  # now it looks like ours: pruned
    finally:
        sh("ip", "netns", "del", other, check=False)


def test_file_errors_and_unknown_options_are_worded_by_the_cli(plan_agent: PlanAgent,
                                                               host_ns: Netns, tmp_path):
    bad = write(tmp_path, "bad.yaml", "version: 1\nbridges:\n  - name: [\n")
    ours = plan_agent.plan(bad, mode="auto")
    local = reconcile("plan", "--no-agent", bad, netns=host_ns.name)
    assert (ours.rc, ours.out, ours.err) == (local.rc, local.out, local.err)
    assert ours.rc == 1 and "bad.yaml:" in ours.err
    missing = plan_agent.plan(os.path.join(str(tmp_path), "nope.yaml"), mode="auto")
    assert missing.rc == 1 and "no such file" in missing.err
    refused = plan_agent.plan(bad)  # require: the agent declines, the client says so
    assert refused.rc == 1 and "did not answer" in refused.err


@pytest.mark.real_process  # the exit code and error shape of a real process
def test_out_file_is_left_alone_when_the_plan_fails(plan_agent: PlanAgent, host_ns: Netns,
                                                    tmp_path):
    bad = write(tmp_path, "bad.yaml", "version: 1\nbridges: 7\n")
    out = write(tmp_path, "saved.json", "OLD")
    r = plan_agent.plan("--out", out, bad, mode="auto")
    assert r.rc == 1 and "bad.yaml" in r.err and "Traceback" not in r.all, r.all
    with open(out) as fh:
        assert fh.read() == "OLD"
    good = write(tmp_path, "good.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    full = plan_agent.plan("--out", "/dev/full", good)  # written after the answer: no space
    assert full.rc == 1 and full.err == ("error: /dev/full: cannot write the plan here: No "
                                         "space left on device\n"), full.all


def test_relative_paths_json_and_saved_plans(plan_agent: PlanAgent, host_ns: Netns, tmp_path):
    a = unique("a")
    path = alloc_config(tmp_path, [a])
    cmd = [sys.executable, "-m", "reconciler", "--netns", host_ns.name, "plan", "allocs.yaml"]
    env = dict(os.environ, RECONCILER_AGENT="require")
    env["PYTHONPATH"] = REPO
    out = os.path.join(str(tmp_path), "saved.json")
    p = subprocess.run([*cmd, "--out", out], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path), timeout=120)
    assert p.returncode == 2, p.stderr
    assert "# allocs.yaml:" in p.stdout  # named as typed, relative to the client's directory
    with open(out) as fh:
        saved = json.load(fh)
    assert saved["files"][0]["path"] == path
    r = host_ns.reconcile("apply", out)  # the saved plan is a real one: apply takes it
    assert r.rc == 0, r.all
    j = subprocess.run([*cmd, "--output", "json"], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path), timeout=120)
    assert j.returncode == 0 and json.loads(j.stdout)["summary"]["create"] == 0, j.stderr


@pytest.mark.docker
def test_docker_network_created_out_of_band_is_seen(plan_agent: PlanAgent, host_ns: Netns,
                                                    tmp_path):
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
    except Exception:
        pytest.skip("no Docker daemon")
    path = write(tmp_path, "net.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    assert host_ns.reconcile("apply", path).rc == 0
    assert same_as_in_process(plan_agent, path).rc == 0
    name = f"{SESSION}-pa-{os.getpid()}"
    net = client.networks.create(name, labels={"io.reconciler.managed": "true",
                                               "io.reconciler.scope": f"netns/{host_ns.name}"})
    try:
        r = same_as_in_process(plan_agent, path)
        assert r.rc == 2 and name in r.out, r.all  # ours in this scope, undeclared: pruned
    finally:
        net.remove()
    assert same_as_in_process(plan_agent, path).rc == 0


def test_mounts_elsewhere_do_not_cost_an_observation(plan_agent: PlanAgent, host_ns: Netns,
                                                     tmp_path):
    """Containers starting mount all the time: only mounts under /run/netns count."""
    path = write(tmp_path, "net.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    assert host_ns.reconcile("apply", path).rc == 0
    assert same_as_in_process(plan_agent, path).rc == 0
    where = os.path.join(str(tmp_path), "mnt")
    os.mkdir(where)

    def cached_after_a_mount() -> bool:
        before = plan_agent.counts().get("cached", 0)
        sh("mount", "-t", "tmpfs", "none", where)
        try:
            assert same_as_in_process(plan_agent, path).rc == 0
        finally:
            sh("umount", where)
        return plan_agent.counts().get("cached", 0) == before + 1

    wait_for(cached_after_a_mount, 15, every=0.5, what="a cached answer after a mount elsewhere")


def test_a_stopped_agent_costs_seconds_not_the_plan(plan_agent: PlanAgent, host_ns: Netns,
                                                    tmp_path):
    """An agent that does not acknowledge (stopped, wedged): the client plans itself."""
    import signal
    import time

    path = write(tmp_path, "net.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    plan_agent.agent.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = plan_agent.plan(path, mode="auto")
        took = time.monotonic() - t0
    finally:
        plan_agent.agent.proc.send_signal(signal.SIGCONT)
    assert r.rc == 2 and "+ bridge rcpa0" in r.out, r.all
    assert took < 60, took  # the acknowledgement timeout (10 s), not the reply timeout (300 s)


def test_a_listener_on_a_wanted_host_port_is_seen_by_the_agent(plan_agent: PlanAgent,
                                                               host_ns: Netns, tmp_path):
    """Listening sockets announce nothing: the agent reads them (of its namespace, from its
    own thread) on every request."""
    from tests.support.allocs import listening

    a = unique("a")
    path = alloc_config(tmp_path, [a])  # wants host port 18080, not applied
    first = same_as_in_process(plan_agent, path)
    assert first.rc == 2, first.all
    with listening(host_ns.name, "tcp:18080"):
        # the agent saw the socket: a plan-time error, which it leaves to the CLI to word
        seen = plan_agent.plan(path)
        assert seen.rc == 1 and "18080/tcp is already in use" in seen.err, seen.all
        ours = plan_agent.plan(path, mode="auto")
        local = reconcile("plan", "--no-agent", path, netns=host_ns.name)
        assert (ours.rc, ours.out, ours.err) == (local.rc, local.out, local.err)
    assert same_as_in_process(plan_agent, path).rc == 2


def test_the_agents_own_files_are_planned_from_a_warm_view(host_ns: Netns, tmp_path):
    """After a converged pass the agent observes for its own files: the first
    `reconcile plan` of them does not wait for a full read of the host."""
    conf = os.path.join(str(tmp_path), "conf")
    os.mkdir(conf)
    os.chmod(str(tmp_path), 0o755)
    os.chmod(conf, 0o755)
    path = write(conf, "net.yaml", f"version: 1\nbridges: [{{name: {BRIDGE}}}]\n")
    os.chmod(path, 0o644)
    agent = Agent(host_ns, [conf])  # type: ignore[arg-type]
    try:
        agent.converged()
        ino = os.stat(f"/run/netns/{host_ns.name}").st_ino
        from reconciler.agent.planview.protocol import socket_path

        wait_for(lambda: os.path.exists(socket_path(ino)), 15, what="the plan socket")
        import time

        time.sleep(2)  # the warm-up runs when the server is idle (it polls every 0.5 s)

        r = reconcile("plan", conf, netns=host_ns.name, env={"RECONCILER_AGENT": "require"})
        assert r.rc == 0, r.all
        counts = plan_counts(agent)
        assert counts.get("cached") == 1 and not counts.get("observed"), counts
    finally:
        assert agent.stop() == 0


# ------------------------------------------------------------------ random sequences


def test_random_changes_agent_and_in_process_plans_stay_identical(
        plan_agent: PlanAgent, host_ns: Netns, tmp_path, request: pytest.FixtureRequest):
    """Random out-of-band changes, several between plans, healed now and then: after each
    round the agent's answer equals the in-process plan. CI runs 25 rounds, the soak
    (RECONCILER_SOAK=1) 300; RECONCILER_SOAK_SEED picks the sequence."""
    import random

    from tests.support.figures import SOAK, report

    rounds = 300 if SOAK else 25
    seed = int(os.environ.get("RECONCILER_SOAK_SEED", "11"))
    rng = random.Random(seed)
    ids = [unique(f"s{i}") for i in range(6)]
    declared = ids[:4]
    path = alloc_config(tmp_path, declared)
    assert host_ns.reconcile("apply", path).rc == 0
    foreign: list[str] = []
    h = host_ns.name
    mark = json.loads(sh("ip", "-n", ids[0], "-j", "link", "show", "lo").stdout)[0]["ifalias"]

    def alloc_ns() -> str | None:
        live = [a for a in declared if os.path.exists(f"/run/netns/{a}")]
        return rng.choice(live) if live else None

    def run_in(ns: str | None, *cmd: str) -> None:
        if ns is not None:
            sh("ip", "-n", ns, *cmd, check=False)

    def new_foreign(marked: bool) -> None:
        name = unique("f")
        sh("ip", "netns", "add", name)
        foreign.append(name)
        if marked:
            sh("ip", "-n", name, "link", "set", "lo", "alias", mark)

    def delete_alloc_ns() -> None:
        """`ip netns del`; the kernel frees the namespace and its veth pair later, so wait
        for that: the two plans compared must not straddle it."""
        import hashlib

        a = alloc_ns()
        if a is None:
            return
        sh("ip", "netns", "del", a, check=False)
        veth = "vr" + hashlib.sha1(a.encode()).hexdigest()[:12]
        try:
            wait_for(lambda: sh("ip", "-n", h, "link", "show", veth, check=False).returncode != 0,
                     10, what=f"the kernel to remove {veth}")
        except AssertionError as exc:  # something keeps the namespace alive (a socket in it)
            log = "\n".join(plan_agent.agent.log_text().splitlines()[-12:])
            raise AssertionError(f"{exc}; the agent's last lines:\n{log}") from None

    def edit() -> None:
        nonlocal declared
        declared = sorted(rng.sample(ids, rng.randint(2, len(ids))))
        alloc_config(tmp_path, declared)

    foreign_veth(h)
    routes: list[str] = []

    def foreign_route() -> None:
        """Another tool's route over the declared subnet: the plan conflicts until it goes."""
        length = rng.randint(25, 30)
        dst = f"10.66.0.{rng.randrange(0, 256, 1 << (32 - length))}/{length}"
        if sh("ip", "-n", h, "route", "add", dst, "dev", FOREIGN, check=False).returncode == 0:
            routes.append(dst)

    changes: list[tuple[str, Callable[[], object]]] = [
        ("route del", lambda: run_in(alloc_ns(), "route", "del", "default")),
        ("addr flush", lambda: run_in(alloc_ns(), "addr", "flush", "dev", "eth0")),
        ("eth0 down", lambda: run_in(alloc_ns(), "link", "set", "eth0", "down")),
        ("bridge addr flush", lambda: sh("ip", "-n", h, "addr", "flush", "dev", BRIDGE,
                                         check=False)),
        ("bridge down", lambda: sh("ip", "-n", h, "link", "set", BRIDGE, "down", check=False)),
        ("port map flush", lambda: host_ns.run("nft", "flush", "map", "inet", "reconciler",
                                               "pm4_addr", check=False)),
        ("isolation flush", lambda: host_ns.run("nft", "flush", "set", "inet", "reconciler",
                                                "ports6", check=False)),
        ("forward chain flush", lambda: host_ns.run("nft", "flush", "chain", "inet",
                                                    "reconciler", "isolate", check=False)),
        ("ip_forward off", lambda: host_ns.run("sysctl", "-qw", "net.ipv4.ip_forward=0")),
        ("foreign veth", lambda: sh("ip", "-n", h, "link", "add", f"rcx{rng.randint(0, 9999)}",
                                    "type", "veth", "peer", "name",
                                    f"rcy{rng.randint(0, 9999)}", check=False)),
        ("foreign rule", lambda: host_ns.run("iptables", "-A", "INPUT", "-p", "udp",
                                             "--dport", str(rng.randint(1, 999)), "-j",
                                             "ACCEPT")),
        ("foreign netns", lambda: new_foreign(False)),
        ("foreign netns with our mark", lambda: new_foreign(True)),
        ("alloc netns deleted", delete_alloc_ns),
        ("files edited", edit),
        ("foreign route over the subnet", foreign_route),
    ]
    seen: dict[str, int] = {}
    try:
        for _ in range(rounds):
            for _ in range(rng.randint(1, 3)):
                what, change = rng.choice(changes)
                seen[what] = seen.get(what, 0) + 1
                change()
            same_as_in_process(plan_agent, path)
            if rng.random() < 0.4:
                for name in foreign:
                    sh("ip", "netns", "del", name, check=False)
                foreign.clear()
                for dst in routes:  # conflicts refuse the apply: the other tool gives way
                    sh("ip", "-n", h, "route", "del", dst, "dev", FOREIGN, check=False)
                routes.clear()
                fixed = host_ns.reconcile("apply", path)
                assert fixed.rc == 0, fixed.all
                assert same_as_in_process(plan_agent, path).rc == 0
    finally:
        for name in foreign:
            sh("ip", "netns", "del", name, check=False)
    counts = plan_agent.counts()
    report(request, f"{rounds} rounds (seed {seed}), {sum(seen.values())} changes of "
                    f"{len(seen)} kinds: agent == in-process every time; answers "
                    + ", ".join(f"{k} {int(v)}" for k, v in sorted(counts.items())))
    assert not counts.get("declined"), counts


def test_a_kept_namespace_deleted_by_someone_else_is_let_go(host_ns: Netns, tmp_path):
    """watch --no-prune keeps an undeclared namespace of ours, and its observer holds a
    socket into it; when someone deletes it, the agent must drop that socket at once, or
    it keeps the namespace (and its veth) alive until the next resync."""
    import hashlib

    a, b = unique("a"), unique("b")
    conf = os.path.join(str(tmp_path), "conf")
    os.mkdir(conf)
    os.chmod(str(tmp_path), 0o755)
    os.chmod(conf, 0o755)
    path = alloc_config(tmp_path, [a, b])
    assert host_ns.reconcile("apply", path).rc == 0
    with open(alloc_config(tmp_path, [a])) as fh:
        only_a = write(conf, "allocs.yaml", fh.read())
    os.chmod(only_a, 0o644)
    agent = Agent(host_ns, [conf], "--no-prune", "--interval", "3600")  # type: ignore[arg-type]
    try:
        agent.converged()
        veth = "vr" + hashlib.sha1(b.encode()).hexdigest()[:12]
        assert host_ns.link(veth) is not None  # kept: --no-prune
        sh("ip", "netns", "del", b)
        wait_for(lambda: host_ns.link(veth) is None, 10, every=0.1,
                 what=f"{veth} gone with its namespace")
    finally:
        assert agent.stop() == 0


def test_a_pending_journal_is_left_to_the_in_process_plan(plan_agent: PlanAgent,
                                                          host_ns: Netns, tmp_path: Any) -> None:
    """In-process `plan` notes a change a killed run left half done and exits 2; the agent
    must not answer "No changes" (exit 0) then, but leave the plan to the CLI."""
    from reconciler.engine.journal import ALLOC, Journals

    path = write(tmp_path, "empty.yaml", "version: 1\n")
    assert plan_agent.plan(path).rc == 0  # answered by the agent: nothing pending
    # what an adopt killed after its first op leaves (the agent runs --dry-run: it does
    # not finish journals)
    journal = Journals(f"netns/{host_ns.name}").new(ALLOC, unique("a"))
    journal.begin({"ops": [], "adopt": True})
    try:
        declined = plan_agent.counts().get("declined", 0)
        r = plan_agent.plan(path, mode="auto")
        assert r.rc == 2 and f"note: alloc {journal.name}: a change that a killed run" in r.err, \
            r.all
        assert plan_agent.counts().get("declined", 0) == declined + 1
        r = plan_agent.plan(path)  # RECONCILER_AGENT=require: says the agent declined
        assert r.rc == 1 and "half done" in r.err, r.all
    finally:
        journal.close()
    assert plan_agent.plan(path).rc == 0
