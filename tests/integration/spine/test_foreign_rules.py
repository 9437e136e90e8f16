"""Someone else's rules are read and written back byte for byte, whatever their bytes."""

from __future__ import annotations

import subprocess

from tests.support.host import Netns, unique, write


def _save(ns: Netns) -> bytes:
    return subprocess.run(["ip", "netns", "exec", ns.name, "iptables-save"],
                          capture_output=True, check=True, timeout=60).stdout


def _config(tmp_path: object) -> str:
    """One allocation with a port map, on a bridge of its own."""
    alloc, bridge = unique("f"), unique("fb")[:15]
    return write(tmp_path, "f.yaml", f"""version: 1
bridges: [{{name: {bridge}}}]
subnets: [{{name: fr, bridge: {bridge}, cidr: 10.219.0.0/24}}]
allocs:
  - {{id: {alloc}, subnet: fr, ports: [{{host: 18080, to: 80}}]}}
""")


def test_a_foreign_rule_comment_that_is_not_utf8_is_no_internal_error(host_ns: Netns,
                                                                       tmp_path) -> None:
    """A rule comment of bytes that are not UTF-8 (``iptables -m comment --comment
    $'caf\\xe9'``) made every observation an "internal error: UnicodeDecodeError"; now
    plan and apply work around it and leave it as it was (``iptables-save``'s bytes)."""
    comment = b"caf\xe9 by another tool"
    subprocess.run([b"ip", b"netns", b"exec", host_ns.name.encode(), b"iptables", b"-A",
                    b"FORWARD", b"-m", b"comment", b"--comment", comment, b"-j", b"ACCEPT"],
                   check=True, timeout=60)
    before = _save(host_ns)
    assert comment in before
    cfg = _config(tmp_path)
    plan = host_ns.reconcile("plan", cfg, "--no-agent")
    assert plan.rc == 2 and "internal error" not in plan.all, plan.all
    applied = host_ns.reconcile("apply", cfg, "--no-probe")
    assert applied.rc == 0, applied.all
    after = _save(host_ns)
    foreign = [line for line in before.splitlines() if comment in line]
    assert foreign and all(line in after.splitlines() for line in foreign)
    again = host_ns.reconcile("plan", cfg, "--no-agent")
    assert again.rc == 0, again.all
    assert host_ns.reconcile("destroy", "--yes").rc == 0


def test_a_foreign_rule_that_is_not_utf8_named_as_a_probes_cause_is_said(host_ns: Netns,
                                                                          tmp_path) -> None:
    """Named as the cause of a failed probe, such a rule is printed (escaped) whatever
    the locale's stdout encoding: it was an internal error (UnicodeEncodeError) with a
    strict one (any UTF-8 locale but C.UTF-8)."""
    cfg = _config(tmp_path)
    assert host_ns.reconcile("apply", cfg, "--no-probe").rc == 0
    subprocess.run([b"ip", b"netns", b"exec", host_ns.name.encode(), b"iptables", b"-I",
                    b"FORWARD", b"-d", b"10.219.0.0/24", b"-m", b"comment", b"--comment",
                    b"caf\xe9", b"-j", b"DROP"], check=True, timeout=60)
    r = host_ns.reconcile("verify", cfg, env={"PYTHONIOENCODING": "utf-8:strict"})
    assert r.rc == 1 and "internal error" not in r.all, r.all
    assert "probe failed" in r.all and "caf" in r.all, r.all
    assert host_ns.reconcile("destroy", "--yes").rc == 0
