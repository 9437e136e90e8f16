"""The probe surface against the real kernel: apply probes what it changed, `reconcile verify`
(config + probes, changes nothing), and the watch agent's probe interval.

Each test runs in its own sandbox (``host_ns``); breakages are foreign rules and link
flags set with the ordinary tools inside it. The independent view is `iptables-save`,
`ip -j` and /run/netns; traffic goes only to namespaces the test made.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import pytest

from reconciler.domain.ownership import alloc_ns_alias
from tests.support.agent import Agent
from tests.support.host import Netns, netns_id, sh, unique, wait_for, write

pytestmark = pytest.mark.root

BRIDGE = "rver0"
HOST_PORT, TO = 18080, 80
RAW_DROP = ("-t", "raw", "PREROUTING", "-p", "tcp", "--dport", str(HOST_PORT), "-j", "DROP")


def _cfg(tmp_path: Any, alloc: str, *, ports: bool = True, name: str = "v.yaml") -> str:
    maps = f"\n    ports: [{{host: {HOST_PORT}, to: {TO}}}]" if ports else ""
    return write(tmp_path, name, f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: ver, bridge: {BRIDGE}, cidr: 10.216.0.0/24}}]
allocs:
  - id: {alloc}
    subnet: ver{maps}
""")


def _raw_drop(host: Netns, verb: str) -> None:
    table, rest = RAW_DROP[:2], RAW_DROP[2:]
    host.run("iptables", *table, verb, rest[0], *rest[1:])


def _ours(host: Netns) -> list[str]:
    """Namespaces under /run/netns marked as this sandbox's (``lo``'s alias names its inode):
    its allocations, and a vantage namespace left behind would be one too. Others' namespaces
    come and go on this shared machine meanwhile."""
    mark = alloc_ns_alias(netns_id(host.name))
    found = []
    for name in sorted(os.listdir("/run/netns")):
        if name == host.name:
            continue
        out = sh("ip", "-n", name, "-j", "link", "show", "lo", check=False).stdout
        try:
            lo = json.loads(out or "[]")
        except ValueError:
            continue  # gone meanwhile
        if lo and lo[0].get("ifalias") == mark:
            found.append(name)
    return found


def _state(host: Netns) -> tuple[str, str, list[str]]:
    """What verify must leave as it was: rules (without counters), links, our namespaces."""
    rules = "\n".join(ln for ln in host.iptables_save(4).splitlines() if ln.startswith("-A"))
    links = json.dumps(sorted((lk["ifname"], lk.get("flags"), lk.get("mtu"))
                              for lk in host.ip_json("link", "show")))
    return rules, links, _ours(host)


def test_apply_probes_what_it_changed(host_ns: Netns, tmp_path: Any) -> None:
    alloc = unique("v")
    cfg = _cfg(tmp_path, alloc)
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    assert re.search(r"^Probes: \d+ held, 0 failed", r.out, re.M), r.out
    # nothing changed: nothing to probe
    r = host_ns.reconcile("apply", cfg, "--output", "json")
    assert r.rc == 0, r.all
    doc = json.loads(r.out)
    assert doc["ok"] and doc["probes"] == [] and doc["outcomes"] == []


def test_apply_json_counts_first_lists_failed_probes_and_shows_the_moved_map(
        host_ns: Netns, tmp_path: Any) -> None:
    """SPEC §13: a port map edit is on the allocation (old and new maps); apply --output json
    starts with the counts and lists the probes that failed (none here) unless --probes all."""
    alloc = unique("v")
    assert host_ns.reconcile("apply", _cfg(tmp_path, alloc)).rc == 0
    with open(_cfg(tmp_path, alloc, name="moved.yaml")) as fh:
        moved = write(tmp_path, "moved.yaml",
                      fh.read().replace(f"host: {HOST_PORT}", f"host: {HOST_PORT + 1}"))
    r = host_ns.reconcile("plan", moved, "--no-agent")
    assert r.rc == 2 and (f"  ~ alloc {alloc}: changed: ports\n      ports: "
                          f"{HOST_PORT}/tcp->{TO} => {HOST_PORT + 1}/tcp->{TO}\n") in r.out, r.out
    r = host_ns.reconcile("apply", moved, "--output", "json")
    assert r.rc == 0, r.all
    doc = json.loads(r.out)
    assert list(doc)[:2] == ["counts", "ok"] and doc["ok"] is True
    counts = doc["counts"]
    assert counts["applied"] >= 2 and counts["failed"] == 0, counts  # the alloc, the firewall
    assert counts["probes"]["held"] > 0 and counts["probes"]["failed"] == 0, counts
    assert doc["probes"] == [] and doc["probes_listed"] == "failed"
    (change,) = [c for c in doc["plan"]["changes"] if c["kind"] == "alloc"]
    (ports,) = change["attrs"]
    assert ports["removed"] == [{"host": HOST_PORT, "protocol": "tcp", "to": TO, "host_ip": None}]
    assert ports["added"] == [{"host": HOST_PORT + 1, "protocol": "tcp", "to": TO,
                               "host_ip": None}]
    r = host_ns.reconcile("apply", _cfg(tmp_path, alloc), "--output", "json", "--probes", "all")
    doc = json.loads(r.out)
    assert r.rc == 0 and len(doc["probes"]) == doc["counts"]["probes"]["total"] > 0, r.all


@pytest.mark.real_process  # the exit code and error shape of a real process
def test_a_failed_probe_fails_the_apply_naming_alloc_path_and_cause(host_ns: Netns,
                                                                     tmp_path: Any) -> None:
    """A foreign raw DROP on the host port is outside what the config covers: apply converges
    and, before probes, said nothing (exit 0); now the hairpin probe fails it (exit 1)."""
    alloc = unique("v")
    _raw_drop(host_ns, "-I")
    r = host_ns.reconcile("apply", _cfg(tmp_path, alloc))
    assert r.rc == 1, r.all
    lines = [ln for ln in r.err.splitlines() if ln.startswith("error: probe failed: ")]
    assert any(f"alloc {alloc} path hairpin (tcp {HOST_PORT})" in ln for ln in lines), r.err
    assert all(ln.count(":") >= 2 and ln.split(": ", 2)[2].strip() for ln in lines)
    assert "Traceback" not in r.all
    # the config itself converged: plan has nothing to do; --no-probe applies and exits 0
    assert host_ns.reconcile("plan", _cfg(tmp_path, alloc), "--no-agent").rc == 0
    r = host_ns.reconcile("apply", _cfg(tmp_path, alloc, ports=False), "--no-probe")
    assert r.rc == 0 and "Probes:" not in r.out, r.all


def test_verify_exit_codes_output_and_json_shape(host_ns: Netns, tmp_path: Any) -> None:
    alloc = unique("v")
    cfg = _cfg(tmp_path, alloc)
    assert host_ns.reconcile("apply", cfg).rc == 0
    before = _state(host_ns)

    r = host_ns.reconcile("verify", cfg)
    assert r.rc == 0 and "Verify: ok." in r.out, r.all
    r = host_ns.reconcile("verify", cfg, "--output", "json")
    doc = json.loads(r.out)
    assert r.rc == 0 and set(doc) == {"ok", "config", "probes"} and doc["ok"] is True
    assert doc["config"] == {"ok": True, "changes": [], "blocked": []}  # SPEC §11
    assert doc["probes"], "no probe ran"
    for p in doc["probes"]:
        assert {"alloc", "path", "proto", "port", "ok", "skipped", "cause", "ms"} <= set(p)
    # the external vantage is on by default in a sandbox (--netns), and can be turned off
    assert {p["path"] for p in doc["probes"]} >= {"gateway", "localhost", "hairpin", "external",
                                                   "direct"}
    inside = json.loads(host_ns.reconcile("verify", cfg, "--no-probe-external",
                                          "--output", "json").out)
    assert inside["ok"] and not {"external", "direct"} & {p["path"] for p in inside["probes"]}
    assert _state(host_ns) == before, "verify changed the host"

    # a probe failure only: config matches, exit 1, the output says it is the probes
    _raw_drop(host_ns, "-I")
    try:
        r = host_ns.reconcile("verify", cfg)
        assert r.rc == 1, r.all
        assert "Config: matches" in r.out and "probe failed: alloc" in r.out, r.out
        assert re.search(r"^Verify: failed: \d+ probe\(s\) failed\.$", r.out, re.M), r.out
        doc = json.loads(host_ns.reconcile("verify", cfg, "--output", "json").out)
        assert doc["ok"] is False and doc["config"]["ok"] is True
        assert any(not p["ok"] and not p["skipped"] and p["cause"] for p in doc["probes"])
        # --no-probe compares the config only
        assert host_ns.reconcile("verify", cfg, "--no-probe").rc == 0
    finally:
        _raw_drop(host_ns, "-D")

    # a config difference only: exit 1, the output says it is the config
    other = _cfg(tmp_path, alloc, ports=False, name="other.yaml")
    r = host_ns.reconcile("verify", other, "--no-probe")
    assert r.rc == 1 and "Config: differs" in r.out and "Verify: failed: the config differs." \
        in r.out, r.all
    doc = json.loads(host_ns.reconcile("verify", other, "--output", "json").out)
    assert doc["config"]["ok"] is False
    assert doc["config"]["changes"] and all(
        {"kind", "name", "action", "reason"} <= set(c) for c in doc["config"]["changes"])
    assert _state(host_ns)[0] == before[0], "verify changed the rules"


@pytest.mark.real_process  # the exit code and error shape of a real process
def test_verify_of_a_file_that_does_not_load_is_one_line(host_ns: Netns, tmp_path: Any) -> None:
    bad = write(tmp_path, "bad.yaml", "version: 1\nbridges: [{name: 1}]\n")
    r = host_ns.reconcile("verify", bad)
    assert r.rc == 1 and r.err.startswith(f"error: {bad}:") and "Traceback" not in r.all


# --------------------------------------------------------------------------- watch


def _metric(agent: Agent, alloc: str) -> dict[str, float]:
    text = agent.get("/metrics") or ""
    out = {}
    for ln in text.splitlines():
        m = re.match(r'reconciler_probe_failures\{alloc="([^"]+)",path="([^"]+)"\} (\S+)', ln)
        if m and m.group(1) == alloc:
            out[m.group(2)] = float(m.group(3))
    return out


def test_watch_reports_a_foreign_cause_and_clears_it(host_ns: Netns, tmp_path: Any) -> None:
    alloc = unique("v")
    d = str(tmp_path / "conf")
    os.makedirs(d, mode=0o755)
    _cfg(tmp_path / "conf", alloc)
    agent = Agent(host_ns, [d], "--probe-interval", "1s", "--interval", "3600")  # type: ignore[arg-type]
    try:
        agent.converged()
        agent.wait_status(lambda doc: (doc.get("probes") or {}).get("held"), 10,
                          what="a first probe run")
        _raw_drop(host_ns, "-I")
        try:
            doc = agent.wait_status(lambda doc: (doc.get("probes") or {}).get("failed"), 10,
                                    what="the probe failure in the status")
            failures = doc["probes"]["failures"]
            assert {f["alloc"] for f in failures} == {alloc} and all(f["cause"] for f in failures)
            wait_for(lambda: _metric(agent, alloc).get("hairpin") == 1.0, 5,
                     what="reconciler_probe_failures{path=hairpin}")
            assert any("probe failed: alloc " + alloc in (r.get("msg") or "")
                       for r in agent.logs()), agent.log_text()
        finally:
            _raw_drop(host_ns, "-D")
        agent.wait_status(lambda doc: (doc.get("probes") or {}).get("failed") == 0, 10,
                          what="the failure cleared")
        wait_for(lambda: not _metric(agent, alloc), 5, what="the gauge's labels gone")
        assert agent.stop() == 0
    finally:
        agent.kill()


def test_watch_heals_a_cause_it_owns_with_a_pass(host_ns: Netns, tmp_path: Any) -> None:
    """route_localnet turned off on the bridge: no event the agent follows says so (hairpin
    off would be: the link event starts a pass at once), the resync is an hour away; the
    localhost probe fails, the cause is ours, a pass turns it back on."""
    alloc = unique("v")
    d = str(tmp_path / "conf")
    os.makedirs(d, mode=0o755)
    _cfg(tmp_path / "conf", alloc)
    agent = Agent(host_ns, [d], "--probe-interval", "1s", "--interval", "3600")  # type: ignore[arg-type]
    key = f"/proc/sys/net/ipv4/conf/{BRIDGE}/route_localnet"

    def localnet() -> bool:
        return host_ns.run("cat", key).stdout.strip() == "1"

    try:
        agent.converged()
        # the echoes of the first apply's own changes start a pass or two: let them pass
        agent.wait_status(lambda doc: (doc.get("probes") or {}).get("held"), 10,
                          what="a first probe run")
        time.sleep(1.0)
        assert localnet()
        host_ns.run("sh", "-c", f"echo 0 > {key}")
        t0 = time.monotonic()
        wait_for(localnet, 15, what="route_localnet back on")
        took = time.monotonic() - t0
        # the heal pass logs once it verified (after the sysctl is back): wait for its line
        heal = wait_for(lambda: [r for r in agent.logs() if "probe failure" in r.get("reasons",
                                                                                       [])],
                        10, what=f"the probe failure's pass (healed after {took:.1f}s)")
        assert heal[0]["result"] == "applied", heal
        assert any("the reconciler owns this: running a pass" in (r.get("msg") or "")
                   for r in agent.logs()), agent.log_text()
        assert agent.stop() == 0
    finally:
        agent.kill()
