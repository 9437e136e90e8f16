"""Safe change against the real kernel (SPEC §8, issue 15 items 1 and 7): `apply
--confirm-within`, `reconcile confirm`, `reconcile revert`, the detached reverter.

Each test runs the real CLI in its own sandbox (``host_ns``, ``--netns``) with the state
directory conftest gives the run. What "restored" means is checked with independent
tools only: ``ip -j`` (links, their MTU, MAC, master, hairpin, flags and addresses, and
inside each of the sandbox's allocation namespaces eth0 and the routes), ``iptables-save``
/ ``ip6tables-save`` without counters and ``/proc/sys`` — never our own observer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from reconciler.domain.ownership import PROBE_VANTAGE_ALIAS
from tests.conftest import Netns, forget_run_files, sh, unique, write
from tests.figures import SOAK, report

pytestmark = pytest.mark.root

BRIDGE = "rsafe0"
PORT_A, PORT_B = 18110, 18111


def _before(tmp_path: Any, alloc: str) -> str:
    return write(tmp_path, "a.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: safe, bridge: {BRIDGE}, cidr: 10.221.0.0/24, cidr6: "fd00:221::/64"}}]
allocs:
  - id: {alloc}
    subnet: safe
    ports: [{{host: {PORT_A}, to: 80}}]
""")


def _after(tmp_path: Any, alloc: str, extra: str) -> str:
    """Everything the change can change: the bridge's MTU (the old file left it to the
    kernel), a port map moved, a new allocation with a port map, an address, a prune."""
    return write(tmp_path, "b.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}, mtu: 1400}}, {{name: {BRIDGE}x}}]
subnets: [{{name: safe, bridge: {BRIDGE}, cidr: 10.221.0.0/24}}]
allocs:
  - id: {alloc}
    subnet: safe
    address: 10.221.0.9
    ports: [{{host: {PORT_B}, to: 80}}]
  - id: {extra}
    subnet: safe
    ports: [{{host: {PORT_B + 1}, to: 80}}]
""")


def _host_view(host: Netns) -> dict[str, Any]:
    """The sandbox's links, addresses, rules and sysctls, from ip -j and iptables-save."""
    links = {}
    for lk in host.ip_json("addr", "show"):
        if lk["ifname"] == "lo" or lk.get("ifalias") == PROBE_VANTAGE_ALIAS:
            continue  # the probes' vantage (the reverter probes) is no part of the change
        info = lk.get("linkinfo") or {}
        slave = info.get("info_slave_data") or {}
        links[lk["ifname"]] = {
            "kind": info.get("info_kind"), "mtu": lk["mtu"], "mac": lk.get("address"),
            "up": "UP" in lk.get("flags", []), "master": lk.get("master"),
            "hairpin": slave.get("hairpin"), "alias": lk.get("ifalias"),
            "addresses": sorted(f"{a['local']}/{a['prefixlen']}" for a in lk["addr_info"]
                                if a.get("scope") != "link")}
    # our chains and our jumps into them (foreign rules are no part of the owned state)
    rules = {family: [ln for ln in host.iptables_save(family).splitlines()
                      if ln.startswith(("-A", ":RECONCILER")) and "RECONCILER" in ln]
             for family in (4, 6)}
    sysctls = {k: host.run("cat", f"/proc/sys/net/{k}").stdout.strip()
               for k in ("ipv4/ip_forward", "ipv6/conf/all/forwarding")}
    return {"links": links, "rules": rules, "sysctls": sysctls}


def _alloc_view(name: str) -> dict[str, Any] | None:
    p = sh("ip", "-n", name, "-j", "-d", "addr", "show", check=False)
    if p.returncode != 0:
        return None  # removed meanwhile (a revert is running)
    links = json.loads(p.stdout or "[]")
    eth0 = next((lk for lk in links if lk["ifname"] == "eth0"), None)
    routes = [json.loads(sh("ip", "-n", name, "-j", *fam, "route", "show",
                            check=False).stdout or "[]") for fam in ((), ("-6",))]
    return {
        "eth0": None if eth0 is None else {
            "mtu": eth0["mtu"], "mac": eth0.get("address"), "up": "UP" in eth0["flags"],
            "addresses": sorted(f"{a['local']}/{a['prefixlen']}" for a in eth0["addr_info"]
                                if a.get("scope") != "link")},
        "routes": sorted(f"{r['dst']} via {r.get('gateway')} proto {r.get('protocol')}"
                         for rs in routes for r in rs if r["dst"] == "default")}


#: the allocation namespaces a test may make (``_setup``): reading every namespace of this
#: shared machine (hundreds) to find the sandbox's would take seconds
NAMES: list[str] = []


def state(host: Netns) -> dict[str, Any]:
    """Everything the reconciler owns in the sandbox, read by independent tools."""
    present = [n for n in NAMES if os.path.exists(f"/run/netns/{n}")]
    allocs = {n: view for n in present if (view := _alloc_view(n)) is not None}
    return {**_host_view(host), "allocs": allocs}


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Where two states differ (each leaf by its path): the residual, counted."""
    out: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y), key=str):
                walk(x.get(k), y.get(k), f"{path}/{k}")
        elif x != y:
            out.append(f"{path}: {x!r} != {y!r}")

    walk(a, b, "")
    return out


def scope_dir(host: Netns) -> str:
    return os.path.join(os.environ["RECONCILER_STATE_DIR"], f"netns-{host.name}")


def pending_record(host: Netns) -> dict[str, Any] | None:
    try:
        with open(os.path.join(scope_dir(host), "pending.json")) as fh:
            rec: dict[str, Any] = json.load(fh)
            return rec
    except FileNotFoundError:
        return None


def reverts(host: Netns) -> dict[str, Any]:
    try:
        with open(os.path.join(scope_dir(host), "reverts.json")) as fh:
            rec: dict[str, Any] = json.load(fh)
            return rec
    except FileNotFoundError:
        return {"count": 0}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def wait_restored(host: Netns, want: dict[str, Any], timeout: float) -> float:
    """Seconds (wall clock, epoch) at which the sandbox's state first equals ``want``."""
    end = time.monotonic() + timeout
    while True:
        if not diff(state(host), want):
            return time.time()
        if time.monotonic() > end:
            raise AssertionError("not restored: " + "; ".join(diff(state(host), want)[:8]))
        time.sleep(0.1)


@pytest.fixture
def box(host_ns: Netns) -> Iterator[Netns]:
    """``host_ns``, and at the end no reverter of it left running and no record left (so
    its teardown's destroy is not refused)."""
    try:
        yield host_ns
    finally:
        rec = pending_record(host_ns)
        if rec is not None and rec.get("reverter_pid") and alive(rec["reverter_pid"]):
            os.kill(rec["reverter_pid"], signal.SIGKILL)
            wait_gone(rec["reverter_pid"])
        sh("rm", "-rf", scope_dir(host_ns))


def _apply(host: Netns, cfg: str, *args: str, **kw: Any) -> Any:
    r = host.reconcile("apply", cfg, *args, **kw)
    assert r.rc == 0, r.all
    return r


def _setup(box: Netns, tmp_path: Any) -> tuple[str, str, dict[str, Any], str]:
    alloc, extra = unique("s"), unique("s")
    NAMES[:] = [alloc, extra]
    a, b = _before(tmp_path, alloc), _after(tmp_path, alloc, extra)
    _apply(box, a)
    before = state(box)
    assert before["allocs"] and before["rules"][4], before
    return a, b, before, extra


def test_confirm_within_the_window_keeps_the_change(box: Netns, tmp_path: Any) -> None:
    _a, b, before, _extra = _setup(box, tmp_path)
    r = _apply(box, b, "--confirm-within", "3s")
    assert "Pending until" in r.out and "reconcile confirm" in r.out, r.all
    changed = state(box)
    assert diff(changed, before)
    rec = pending_record(box)
    assert rec is not None and alive(rec["reverter_pid"])
    c = box.reconcile("confirm")
    assert c.rc == 0 and "Confirmed" in c.out, c.all
    assert wait_gone(rec["reverter_pid"], 3.0), "the reverter outlived the confirm"
    time.sleep(max(0.0, rec["deadline"] - time.time()) + 1.0)
    assert not diff(state(box), changed), diff(state(box), changed)
    assert pending_record(box) is None and reverts(box)["count"] == 0
    again = box.reconcile("confirm")
    assert again.rc == 1 and "nothing is pending" in again.err, again.all
    # nothing pending: apply works again; with nothing to change there is nothing to confirm
    assert box.reconcile("apply", b).rc == 0
    r = box.reconcile("apply", b, "--confirm-within", "1m")
    assert r.rc == 0 and "nothing to confirm" in r.all and pending_record(box) is None, r.all


def test_no_confirm_restores_the_old_state_within_two_seconds(box: Netns,
                                                              tmp_path: Any) -> None:
    _a, b, before, _extra = _setup(box, tmp_path)
    _apply(box, b, "--confirm-within", "2s")
    rec = pending_record(box)
    assert rec is not None
    assert diff(state(box), before)
    at = wait_restored(box, before, timeout=rec["deadline"] - time.time() + 10)
    assert at - rec["deadline"] <= 2.0, f"restored at T+{at - rec['deadline']:.2f}s"
    assert wait_gone(rec["reverter_pid"], 5.0)
    assert pending_record(box) is None
    assert reverts(box)["count"] == 1 and "deadline" in reverts(box)["last_reason"]
    # confirm after the deadline is too late
    late = box.reconcile("confirm")
    assert late.rc == 1, late.all
    # the old files plan nothing: what was restored is what they made
    assert box.reconcile("plan", _a, "--no-agent").rc == 0


def test_revert_restores_at_once(box: Netns, tmp_path: Any) -> None:
    _a, b, before, _extra = _setup(box, tmp_path)
    _apply(box, b, "--confirm-within", "5m")
    rec = pending_record(box)
    assert rec is not None
    r = box.reconcile("revert")
    assert r.rc == 0 and "Reverted" in r.out, r.all
    assert not diff(state(box), before), diff(state(box), before)
    assert wait_gone(rec["reverter_pid"], 3.0)
    again = box.reconcile("revert")
    assert again.rc == 1 and "nothing is pending" in again.err, again.all
    assert box.reconcile("revert", "--if-overdue").rc == 0


def test_a_pending_change_refuses_another_apply(box: Netns, tmp_path: Any) -> None:
    a, b, before, _extra = _setup(box, tmp_path)
    _apply(box, b, "--confirm-within", "5m")
    changed = state(box)
    for args in (("apply", a), ("apply", a, "--confirm-within", "1m"), ("destroy",)):
        r = box.reconcile(*args)
        assert r.rc == 1, r.all
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and "pending until 20" in lines[0], r.err
        assert "nothing changed" in lines[0]
    assert not diff(state(box), changed)
    assert box.reconcile("revert").rc == 0
    assert not diff(state(box), before)


def test_kill_9_of_the_cli_still_reverts(box: Netns, tmp_path: Any) -> None:
    """The CLI and its whole process group (a lost ssh session) are SIGKILLed while it
    applies, right after it recorded the checkpoint: the reverter, in a session of its own,
    still restores everything at the deadline, the half-applied change included."""
    _a, b, before, _extra = _setup(box, tmp_path)
    cmd = [sys.executable, "-m", "reconciler", "--netns", box.name, "apply", b,
           "--confirm-within", "3s"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        end = time.monotonic() + 30
        while (rec := pending_record(box)) is None or not rec.get("reverter_pid"):
            assert time.monotonic() < end and proc.poll() is None, "no pending record"
            time.sleep(0.005)
        time.sleep(0.2)  # into the apply's ops (a kill before the first one is the same case)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    forget_run_files(os.stat(f"/run/netns/{box.name}").st_ino)  # the killed CLI's lock
    assert alive(rec["reverter_pid"]), "the reverter died with the CLI's session"
    assert wait_gone(rec["reverter_pid"], rec["deadline"] - time.time() + 10)
    at = time.time()
    assert at - rec["deadline"] <= 2.0, f"reverted at T+{at - rec['deadline']:.2f}s"
    assert not diff(state(box), before), diff(state(box), before)
    assert pending_record(box) is None and reverts(box)["count"] == 1


def _reboot(box: Netns, rec: dict[str, Any]) -> None:
    """What a reboot does to the sandbox: every process gone (the reverter), every network
    namespace and /run gone; the state directory stays."""
    os.kill(rec["reverter_pid"], signal.SIGKILL)
    assert wait_gone(rec["reverter_pid"])
    inode = os.stat(f"/run/netns/{box.name}").st_ino
    for name in NAMES:
        sh("ip", "netns", "del", name, check=False)
    sh("ip", "netns", "del", box.name)
    forget_run_files(inode)
    sh("ip", "netns", "add", box.name)
    sh("ip", "-n", box.name, "link", "set", "lo", "up")


@pytest.mark.parametrize("who", ["revert --if-overdue", "the next apply"])
def test_a_reboot_with_a_change_pending_is_reverted_first(box: Netns, tmp_path: Any,
                                                          who: str) -> None:
    a, b, before, _extra = _setup(box, tmp_path)
    boot1, boot2 = {"RECONCILER_BOOT_ID": "boot-1"}, {"RECONCILER_BOOT_ID": "boot-2"}
    _apply(box, b, "--confirm-within", "5m", env=boot1)
    rec = pending_record(box)
    assert rec is not None
    _reboot(box, rec)
    assert state(box)["links"] == {}
    # same boot: not overdue (the deadline is minutes away)
    r = box.reconcile("revert", "--if-overdue", env=boot1)
    assert r.rc == 0 and "Not overdue" in r.out, r.all
    if who == "revert --if-overdue":
        r = box.reconcile("revert", "--if-overdue", env=boot2)
        assert r.rc == 0 and "applied before a reboot" in r.out, r.all
        assert not diff(state(box), before), diff(state(box), before)
    else:
        r = box.reconcile("apply", a, env=boot2)
        assert r.rc == 0 and "overdue" in r.err and "Reverted" in r.out, r.all
        # reverted, then the old files applied on top: nothing left for them to do
        assert "No changes" in r.out, r.out
        assert not diff(state(box), before), diff(state(box), before)
    assert pending_record(box) is None and reverts(box)["count"] == 1


def test_probes_failing_inside_the_window_revert_early(box: Netns, tmp_path: Any) -> None:
    """The change held when it was applied; then its new port map stops answering (a
    foreign raw DROP): the reverter's probes see it and revert long before the deadline."""
    _a, b, before, _extra = _setup(box, tmp_path)
    drop = ("-t", "raw", "PREROUTING", "-p", "tcp", "--dport", str(PORT_B), "-j", "DROP")
    _apply(box, b, "--confirm-within", "60s")
    rec = pending_record(box)
    assert rec is not None
    t0 = time.time()
    box.run("iptables", "-t", "raw", "-I", *drop[2:])
    try:
        box.run("iptables", "-t", "raw", "-I", "OUTPUT", *drop[3:])
        assert wait_gone(rec["reverter_pid"], 30)
        at = time.time()
        assert not diff(state(box), before), diff(state(box), before)
    finally:
        box.run("iptables", "-t", "raw", "-D", *drop[2:], check=False)
        box.run("iptables", "-t", "raw", "-D", "OUTPUT", *drop[3:], check=False)
    assert at - t0 < 20, f"reverted {at - t0:.1f}s after the break"
    assert at < rec["deadline"] - 30
    assert pending_record(box) is None and reverts(box)["last_reason"] == "probes failed"


def test_a_checkpoint_that_cannot_be_written_changes_nothing(box: Netns, tmp_path: Any) -> None:
    _a, b, before, _extra = _setup(box, tmp_path)
    full = tmp_path / "full"
    full.mkdir(mode=0o700)
    sh("mount", "-t", "tmpfs", "-o", "size=16k,mode=0700", "tmpfs", str(full))
    try:
        os.mkdir(full / f"netns-{box.name}", 0o700)
        fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # ENOSPC: full, as wanted
            while os.write(fd, b"x" * 4096):
                pass
        os.close(fd)
        r = box.reconcile("apply", b, "--confirm-within", "1m",
                          env={"RECONCILER_STATE_DIR": str(full)})
    finally:
        sh("umount", str(full))
    assert r.rc == 1, r.all
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "cannot record the pending change" in lines[0], r.err
    assert "nothing changed" in lines[0] and "Traceback" not in r.all
    assert not diff(state(box), before), diff(state(box), before)


def test_revert_trials(box: Netns, tmp_path: Any, request: pytest.FixtureRequest) -> None:
    """Apply under a 2 s window, no confirm, again and again: each restored with residual 0
    (the independent view) within T+2 s. 5 trials here, 50 with RECONCILER_SOAK=1."""
    _a, b, before, _extra = _setup(box, tmp_path)
    trials = 50 if SOAK else 5
    restored, worst, residual = 0, 0.0, 0
    for _ in range(trials):
        _apply(box, b, "--confirm-within", "2s")
        rec = pending_record(box)
        assert rec is not None
        try:
            at = wait_restored(box, before, timeout=rec["deadline"] - time.time() + 10)
        except AssertionError:
            residual = max(residual, len(diff(state(box), before)))
            box.reconcile("revert")
            continue
        wait_gone(rec["reverter_pid"], 5.0)
        late = at - rec["deadline"]
        worst = max(worst, late)
        restored += late <= 2.0
    report(request, f"revert: {restored}/{trials} restored, residual {residual}, "
                    f"max T+{worst:.1f}s", named=False)
    assert restored == trials and residual == 0
    assert reverts(box)["count"] == trials


# -- watch --confirm-within --------------------------------------------------------------------

def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _agent(box: Netns, cfg_dir: str, window: str) -> Any:
    from tests.integration.test_watch import Agent

    return Agent(box, [cfg_dir], "--confirm-within", window,  # type: ignore[arg-type]
                 "--interval", "3600", "--probe-interval", "off")


def _settled(agent: Any, timeout: float = 40.0) -> dict[str, Any]:
    """The agent's status once nothing is pending and its last pass converged."""
    return agent.wait_status(  # type: ignore[no-any-return]
        lambda d: d.get("pending") is None and (d.get("last_pass") or {}).get("result")
        in ("ok", "applied") and "pending" in d, timeout, what="nothing pending")


def test_watch_confirms_a_new_revision_whose_probes_hold(box: Netns, tmp_path: Any) -> None:
    a, b, before, _extra = _setup(box, tmp_path)
    cfg = tmp_path / "cfg"
    cfg.mkdir(mode=0o755)
    (cfg / "hosts.yaml").write_text(_read(a))
    agent = _agent(box, str(cfg), "3s")
    try:
        _settled(agent)
        (cfg / "hosts.yaml").write_text(_read(b))
        doc = agent.wait_status(lambda d: d.get("pending") is not None, 20,
                                what="the new revision pending")
        assert doc["pending"]["revision"] and doc["pending"]["deadline"].endswith("Z")
        metrics = agent.get("/metrics")
        assert "reconciler_pending_change 1.0" in metrics, metrics
        doc = _settled(agent)
        assert doc["reverted_revision"] is None
        assert "confirmed revision" in agent.log_text()
        changed = state(box)
        assert diff(changed, before)
        time.sleep(GRACE_CHECK)  # past the reverter's own deadline: it stays
        assert not diff(state(box), changed)
        assert pending_record(box) is None and reverts(box)["count"] == 0
        metrics = agent.get("/metrics")
        assert "reconciler_pending_change 0.0" in metrics
        assert "reconciler_reverts_total 0.0" in metrics
    finally:
        agent.stop()


#: the agent's grace (agent/safewatch.GRACE) and a little: the reverter's deadline is past
GRACE_CHECK = 11.0


def test_watch_reverts_a_revision_whose_probes_fail_and_keeps_it_out(box: Netns,
                                                                    tmp_path: Any) -> None:
    a, b, before, _extra = _setup(box, tmp_path)
    cfg = tmp_path / "cfg"
    cfg.mkdir(mode=0o755)
    (cfg / "hosts.yaml").write_text(_read(a))
    agent = _agent(box, str(cfg), "30s")
    drop = ("-p", "tcp", "--dport", str(PORT_B), "-j", "DROP")
    try:
        _settled(agent)
        # the new revision's port map will not answer
        box.run("iptables", "-t", "raw", "-I", "PREROUTING", *drop)
        box.run("iptables", "-t", "raw", "-I", "OUTPUT", *drop)
        (cfg / "hosts.yaml").write_text(_read(b))
        doc = agent.wait_status(lambda d: d.get("reverted_revision") is not None, 40,
                                what="the revision reverted")
        assert doc["pending"] is None
        assert not diff(state(box), before), diff(state(box), before)
        assert reverts(box)["count"] == 1
        metrics = agent.get("/metrics")
        assert "reconciler_reverts_total 1.0" in metrics, metrics
        # not applied again while the files stay as they are
        agent.proc.send_signal(signal.SIGHUP)
        agent.wait_status(lambda d: "was reverted" in str((d.get("last_pass") or {})
                                                          .get("error")), 20,
                          what="the reverted revision held back")
        assert not diff(state(box), before)
        # the files change: applied (and confirmed later) again
        box.run("iptables", "-t", "raw", "-D", "PREROUTING", *drop)
        box.run("iptables", "-t", "raw", "-D", "OUTPUT", *drop)
        (cfg / "hosts.yaml").write_text(_read(b) + "# fixed\n")
        agent.wait_status(lambda d: d.get("pending") is not None, 20, what="pending again")
        assert diff(state(box), before)
    finally:
        box.run("iptables", "-t", "raw", "-D", "PREROUTING", *drop, check=False)
        box.run("iptables", "-t", "raw", "-D", "OUTPUT", *drop, check=False)
        agent.stop()


@pytest.mark.parametrize("then", ["confirm", "revert"])
def test_deleting_a_namespace_processes_hold_waits_for_the_confirm(box: Netns, tmp_path: Any,
                                                                   then: str) -> None:
    """A namespace with a process in it cannot be deleted and brought back: within the
    window its veth is down and its rules gone; confirm deletes it, a revert undoes the
    rest."""
    alloc, extra = unique("s"), unique("s")
    NAMES[:] = [alloc, extra]
    both = _after(tmp_path, alloc, extra)
    only = write(tmp_path, "only.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}, mtu: 1400}}, {{name: {BRIDGE}x}}]
subnets: [{{name: safe, bridge: {BRIDGE}, cidr: 10.221.0.0/24}}]
allocs:
  - id: {alloc}
    subnet: safe
    address: 10.221.0.9
    ports: [{{host: {PORT_B}, to: 80}}]
""")
    _apply(box, both)
    before = state(box)
    holder = subprocess.Popen(["ip", "netns", "exec", extra, "sleep", "600"])
    try:
        r = _apply(box, only, "--confirm-within", "5m")
        assert "deleted at `reconcile confirm`" in r.out, r.out
        during = state(box)
        veth = next(n for n in before["links"] if n not in during["links"] or
                    during["links"][n]["up"] != before["links"][n]["up"])
        assert during["links"][veth]["up"] is False, during["links"][veth]
        assert extra in during["allocs"], "deleted although processes hold it"
        assert not any(f"alloc={extra}" in ln for ln in during["rules"][4])
        r = box.reconcile(then)
        assert r.rc == 0, r.all
        after = state(box)
        if then == "confirm":
            assert "Made the postponed change" in r.out, r.out
            assert extra not in after["allocs"] and veth not in after["links"]
            assert box.reconcile("plan", only, "--no-agent").rc == 0
        else:
            assert not diff(after, before), diff(after, before)
    finally:
        holder.kill()
        holder.wait()


def test_the_agent_waits_for_an_operators_pending_change_and_reverts_it_when_overdue(
        box: Netns, tmp_path: Any) -> None:
    """An operator's `apply --confirm-within` holds the agent back (its passes change
    nothing, naming the deadline); its reverter killed, the agent's held pass starts
    another, which reverts it at its deadline (or the agent's next pass, whichever comes
    first); then the agent converges on its files."""
    a, b, before, _extra = _setup(box, tmp_path)
    cfg = tmp_path / "cfg"
    cfg.mkdir(mode=0o755)
    (cfg / "hosts.yaml").write_text(_read(a))
    from tests.integration.test_watch import Agent

    agent = Agent(box, [str(cfg)], "--interval", "3600",  # type: ignore[arg-type]
                  "--probe-interval", "off")
    try:
        agent.converged(30)
        _apply(box, b, "--confirm-within", "4s")
        rec = pending_record(box)
        assert rec is not None
        os.kill(rec["reverter_pid"], signal.SIGKILL)
        assert wait_gone(rec["reverter_pid"])
        changed = state(box)
        agent.proc.send_signal(signal.SIGHUP)
        doc = agent.wait_status(lambda d: (d.get("last_pass") or {}).get("result") == "pending"
                                and d.get("pending"), 20, what="the agent held back")
        assert "pending until" in doc["last_pass"]["error"], doc["last_pass"]
        assert not diff(state(box), changed), "the agent changed the host of a pending change"
        held = pending_record(box)
        assert held is not None
        time.sleep(max(0.0, held["deadline"] - time.time()) + 0.5)
        agent.proc.send_signal(signal.SIGHUP)
        agent.wait_status(lambda d: d.get("pending") is None and (d.get("last_pass") or {})
                          .get("result") in ("ok", "applied"), 30, what="reverted, converged")
        log = agent.log_text()
        assert "starting a new one" in log, log  # the held pass noticed the dead reverter
        assert not diff(state(box), before), diff(state(box), before)
        assert reverts(box)["count"] == 1 and pending_record(box) is None
    finally:
        agent.stop()


def _gen(host: Netns) -> dict[str, Any]:
    """The bridge's IPv6 address generation and its link-local addresses (ip -j)."""
    conf = f"/proc/sys/net/ipv6/conf/{BRIDGE}"
    link = host.ip_json("addr", "show", "dev", BRIDGE)[0]
    return {k: host.run("cat", f"{conf}/{k}").stdout.strip()
            for k in ("addr_gen_mode", "accept_dad")} | {
        "link_local": sorted(a["local"] for a in link["addr_info"]
                             if a.get("family") == "inet6" and a.get("scope") == "link")}


def test_a_revert_takes_back_the_ipv6_an_ipv6_gateway_turned_on(box: Netns,
                                                                 tmp_path: Any) -> None:
    """The change gives an existing bridge an IPv6 gateway: the apply turns its address
    generation on without DAD and the kernel makes a link-local address; the revert sets
    both sysctls back and the link-local address goes too (review 2, item 4)."""
    alloc = unique("s")
    NAMES[:] = [alloc]
    v4 = f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: safe, bridge: {BRIDGE}, cidr: 10.221.0.0/24{{v6}}}}]
allocs: [{{id: {alloc}, subnet: safe}}]
"""
    _apply(box, write(tmp_path, "a.yaml", v4.replace("{v6}", "")))
    before, gen = state(box), _gen(box)
    assert gen == {"addr_gen_mode": "1", "accept_dad": "1", "link_local": []}, gen
    _apply(box, write(tmp_path, "b.yaml", v4.replace("{v6}", ', cidr6: "fd00:221::/64"')),
           "--confirm-within", "5m")
    changed = _gen(box)
    assert changed["addr_gen_mode"] != "1" and changed["link_local"], changed
    r = box.reconcile("revert")
    assert r.rc == 0 and "Reverted" in r.out, r.all
    assert _gen(box) == gen
    assert not diff(state(box), before), diff(state(box), before)


def test_a_revert_leaves_what_only_has_an_allocations_names_alone(box: Netns,
                                                                  tmp_path: Any) -> None:
    """The change deleted an allocation; in the window someone made a veth with its veth's
    name, then an empty /run/netns file with its name: neither is ours, a revert deletes
    neither and fails with one line; once they are gone it completes (review 2, item 3)."""
    from reconciler.domain.ownership import alloc_veth_name

    alloc = unique("s")
    NAMES[:] = [alloc]
    cfg = f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: safe, bridge: {BRIDGE}, cidr: 10.221.0.0/24}}]
allocs: [{{id: {alloc}, subnet: safe}}]
"""
    _apply(box, write(tmp_path, "a.yaml", cfg))
    before = state(box)
    _apply(box, write(tmp_path, "b.yaml", cfg.split("allocs:")[0]), "--confirm-within", "5m")
    assert alloc not in state(box)["allocs"]
    veth, stale = alloc_veth_name(alloc), f"/run/netns/{alloc}"
    made = False
    try:
        box.run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth[:10]}p")
        r = box.reconcile("revert")
        assert r.rc == 1 and f"host link {veth} exists but is not the reconciler's" in r.err, \
            r.all
        assert box.link(veth) is not None and pending_record(box) is not None
        box.run("ip", "link", "del", veth)

        with open(stale, "x"):
            made = True
        # (the revert's observation lists no unmarked file: the driver's create refuses it)
        r = box.reconcile("revert")
        assert r.rc == 1 and f"{stale} exists" in r.err, r.all
        assert os.path.exists(stale) and os.path.getsize(stale) == 0
        assert not os.listxattr(stale) and pending_record(box) is not None
    finally:
        if made and not os.path.ismount(stale):  # ours, never a namespace a revert made
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        box.run("ip", "link", "del", veth, check=False)
    r = box.reconcile("revert")
    assert r.rc == 0 and "Reverted" in r.out, r.all
    assert not diff(state(box), before), diff(state(box), before)
