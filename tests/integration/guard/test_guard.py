"""Guard rails against the real kernel (issue 15 items 4 and 6), each test in its own sandbox.

Files for other hosts never prune, ``--adopt`` says what it deletes and refuses the
namespace the reconciler runs in, deletions check the mark on the object itself, and
``apply`` and ``destroy`` ask on a terminal. Results are read with ``ip -j`` and ``/proc``, never
with our own observer.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.support.agent import confdir
from tests.support.host import REPO, Netns, save, unique, wait_for, write
from tests.support.terminal import on_a_terminal

pytestmark = pytest.mark.root

BRIDGE = "version: 1\nbridges: [{name: %s, mtu: 1400}]\n"


# ------------------------------------------------------------------ hosts: patterns


def test_files_for_other_hosts_prune_nothing_in_plan_and_apply(host_ns: Netns,
                                                               tmp_path: Any) -> None:
    br = "rg" + unique()[-6:]
    mine = write(tmp_path, "mine.yaml", BRIDGE % br)
    assert host_ns.reconcile("apply", mine).rc == 0
    assert host_ns.link(br) is not None
    other = write(tmp_path, "other.yaml", "hosts: ['db-*']\n" + BRIDGE % br)
    for command in ("plan", "apply"):
        r = host_ns.reconcile(command, other, "--hostname", "web-1", "--no-agent"
                              if command == "plan" else "--no-probe")
        assert r.rc == 1, r.all
        assert r.err.count("\n") == 1 and r.err.startswith("error: "), r.err
        assert "db-*" in r.err and "'web-1'" in r.err and "other.yaml" in r.err
        assert host_ns.link(br) is not None, f"{command} pruned the bridge"
    # the deliberate way to empty a host still works
    empty = write(tmp_path, "empty.yaml", "version: 1\nhosts: ['web-*']\nbridges: []\n")
    r = host_ns.reconcile("apply", other, empty, "--hostname", "web-1")
    assert r.rc == 0, r.all
    assert host_ns.link(br) is None


def test_watch_keeps_the_last_good_state_when_no_file_is_for_this_host(
        host_ns: Netns, agents: Any, tmp_path: Any) -> None:
    d = confdir(tmp_path)
    f = os.path.join(d, "net.yaml")
    save(f, "hosts: ['web-*']\n" + BRIDGE % "rtgw0")
    agent = agents(host_ns, [d], "--hostname", "web-3")
    agent.converged()
    assert host_ns.mtu("rtgw0") == 1400
    save(f, "hosts: ['web1-*']\n" + BRIDGE % "rtgw0")  # a typo in the pattern
    doc = agent.wait_status(lambda s: s.get("config_error"), what="the config error")
    # /status is anyone's: it names the key, never the files' values (the log is root's)
    public = doc["config_error"]["message"]
    assert "hosts" in public and "web1-*" not in public and "web-3" not in public, public
    time.sleep(1.0)  # a pass or two more: nothing may be pruned
    assert host_ns.mtu("rtgw0") == 1400
    assert any("web1-*" in ln for ln in agent.lines), agent.log_text()
    save(f, "hosts: ['web-*']\nversion: 1\nbridges: []\n")  # on purpose
    wait_for(lambda: host_ns.link("rtgw0") is None, 15, what="the bridge pruned on purpose")
    assert agent.stop() == 0


# ------------------------------------------------------------------ destroy asks on a terminal


def test_destroy_asks_on_a_terminal_and_only_yes_goes_on(host_ns: Netns,
                                                          tmp_path: Any) -> None:
    br = "rg" + unique()[-6:]
    assert host_ns.reconcile("apply", write(tmp_path, "a.yaml", BRIDGE % br)).rc == 0
    rc, screen = on_a_terminal(host_ns.name, "destroy", answer="no")
    assert rc == 1, screen
    assert f"- bridge {br}" in screen and "Only 'yes' will be accepted" in screen
    assert "cancelled" in screen
    assert host_ns.link(br) is not None
    rc, screen = on_a_terminal(host_ns.name, "destroy", answer="yes")
    assert rc == 0, screen
    assert host_ns.link(br) is None
    # the plan stands above the question: after the answer only what it came to (SPEC §13)
    assert screen.count(f"- bridge {br}: no longer declared") == 1, screen
    assert screen.count("Plan: 0 to create") == 2, screen


def test_destroy_never_asks_with_yes_or_without_a_terminal(host_ns: Netns,
                                                           tmp_path: Any) -> None:
    br = "rg" + unique()[-6:]
    f = write(tmp_path, "a.yaml", BRIDGE % br)
    assert host_ns.reconcile("apply", f).rc == 0
    rc, screen = on_a_terminal(host_ns.name, "destroy", "--yes", answer=None)
    assert rc == 0 and "Enter a value" not in screen, screen
    assert host_ns.link(br) is None
    assert host_ns.reconcile("apply", f).rc == 0
    # a pipe (scripts, CI): stdin is not a terminal, no one can answer: refused without
    # --yes, nothing destroyed and nothing waits; with --yes it goes on
    p = subprocess.run([sys.executable, "-m", "reconciler", "--netns", host_ns.name, "destroy"],
                       input="", capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 1 and "Enter a value" not in p.stdout + p.stderr, p.stderr
    assert p.stderr.count("\n") == 1 and "--yes" in p.stderr, p.stderr
    assert host_ns.link(br) is not None
    assert host_ns.reconcile("destroy", "--dry-run").rc == 2  # looking needs no --yes
    assert host_ns.reconcile("destroy", "--yes").rc == 0
    assert host_ns.link(br) is None


# ------------------------------------------------------------------ apply asks on a terminal


def test_apply_asks_on_a_terminal_before_it_deletes(host_ns: Netns, tmp_path: Any) -> None:
    br, br2 = "rg" + unique()[-6:], "rh" + unique()[-6:]
    both = write(tmp_path, "both.yaml",
                 f"version: 1\nbridges: [{{name: {br}}}, {{name: {br2}}}]\n")
    # creating only: nothing to ask, it goes on
    rc, screen = on_a_terminal(host_ns.name, "apply", "--no-probe", both, answer=None)
    assert rc == 0 and "Enter a value" not in screen, screen
    one = write(tmp_path, "one.yaml", BRIDGE % br)
    rc, screen = on_a_terminal(host_ns.name, "apply", "--no-probe", one, answer="no")
    assert rc == 1, screen
    assert f"- bridge {br2}" in screen and "Only 'yes' will be accepted" in screen, screen
    assert "Apply cancelled" in screen and host_ns.link(br2) is not None
    rc, screen = on_a_terminal(host_ns.name, "apply", "--no-probe", one, answer="yes")
    assert rc == 0, screen
    assert host_ns.link(br2) is None and host_ns.mtu(br) == 1400
    assert screen.count(f"- bridge {br2}: no longer") == 1, screen  # not again after "yes"


def test_apply_never_asks_with_yes_without_a_terminal_or_for_a_saved_plan(
        host_ns: Netns, tmp_path: Any) -> None:
    br, br2 = "rg" + unique()[-6:], "rh" + unique()[-6:]
    both = write(tmp_path, "both.yaml",
                 f"version: 1\nbridges: [{{name: {br}}}, {{name: {br2}}}]\n")
    one = write(tmp_path, "one.yaml", BRIDGE % br)
    assert host_ns.reconcile("apply", "--no-probe", both).rc == 0
    rc, screen = on_a_terminal(host_ns.name, "apply", "--yes", "--no-probe", one, answer=None)
    assert rc == 0 and "Enter a value" not in screen, screen
    assert host_ns.link(br2) is None
    assert host_ns.reconcile("apply", "--no-probe", both).rc == 0
    saved = os.path.join(str(tmp_path), "plan.json")
    assert host_ns.reconcile("plan", "--no-agent", one, "--out", saved).rc == 2
    rc, screen = on_a_terminal(host_ns.name, "apply", "--no-probe", saved, answer=None)
    assert rc == 0 and "Enter a value" not in screen, screen
    assert host_ns.link(br2) is None
    # a script: stdin no terminal, it proceeds as it always did
    assert host_ns.reconcile("apply", "--no-probe", both).rc == 0
    assert host_ns.reconcile("apply", "--no-probe", one).rc == 0
    assert host_ns.link(br2) is None


# ------------------------------------------------------------------ --adopt


def _alloc_file(tmp_path: Any, aid: str, br: str) -> str:
    return write(tmp_path, "alloc.yaml",
                 f"version: 1\nbridges: [{{name: {br}}}]\nsubnets:\n"
                 f"  - {{name: net, bridge: {br}, cidr: 10.77.0.0/24}}\n"
                 f"allocs:\n  - {{id: {aid}, subnet: net, address: 10.77.0.9}}\n")


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=60)


def test_adopt_shows_every_deletion_it_implies_without_verbose(host_ns: Netns,
                                                               tmp_path: Any) -> None:
    aid, br = unique("f"), "rg" + unique()[-6:]
    _sh("ip", "netns", "add", aid)
    try:
        # someone's namespace: an eth0 of its own (a veth whose peer is in there too, not
        # ours) with an address
        _sh("ip", "-n", aid, "link", "add", "eth0", "type", "veth", "peer", "name", "side0")
        _sh("ip", "-n", aid, "addr", "add", "10.77.0.50/24", "dev", "eth0")
        _sh("ip", "-n", aid, "link", "set", "eth0", "up")
        path = _alloc_file(tmp_path, aid, br)
        r = host_ns.reconcile("plan", "--no-agent", "--adopt", f"alloc/{aid}", path)
        assert r.rc == 2, r.all
        block = re.split(r"\n(?!      )", r.out[r.out.index(f"alloc {aid}"):])[0]
        assert "eth0" in block and "10.77.0.50/24" in block, r.out
        assert "delete" in block, r.out
        r = host_ns.reconcile("apply", "--no-probe", "--adopt", f"alloc/{aid}", path)
        assert r.rc == 0, r.all
        links = _sh("ip", "-n", aid, "-j", "-d", "addr", "show").stdout
        assert "side0" not in links and "10.77.0.50" not in links  # gone, as the plan said
        assert "10.77.0.9" in links
    finally:
        host_ns.reconcile("destroy", "--yes")
        _sh("ip", "netns", "del", aid, check=False)


def test_adopt_refuses_the_namespace_the_reconciler_runs_in(host_ns: Netns,
                                                             tmp_path: Any) -> None:
    """``--netns X`` adopting alloc X would put X's own veth into X: a loop, then destroy
    would unmount the namespace the sandbox is."""
    br = "rg" + unique()[-6:]
    path = _alloc_file(tmp_path, host_ns.name, br)
    lo_before = host_ns.link("lo")
    r = host_ns.reconcile("apply", "--no-probe", "--adopt", f"alloc/{host_ns.name}", path)
    assert r.rc == 1, r.all
    assert f"alloc {host_ns.name}" in r.err and "runs in" in r.err, r.err
    kinds = {lk["ifname"]: (lk.get("linkinfo") or {}).get("info_kind")
             for lk in host_ns.ip_json("link", "show")}
    assert "veth" not in kinds.values() and "eth0" not in kinds, kinds
    assert host_ns.link("lo") == lo_before
    r = host_ns.reconcile("destroy", "--yes")
    assert r.rc == 0 and os.path.exists(f"/run/netns/{host_ns.name}"), r.all


def test_adopt_of_a_name_nothing_declares_is_an_error(host_ns: Netns, tmp_path: Any) -> None:
    br = "rg" + unique()[-6:]
    path = write(tmp_path, "a.yaml", BRIDGE % br)
    for command in ("plan", "apply"):
        r = host_ns.reconcile(command, "--adopt", "bridge/nosuch0", "--adopt", f"bridge/{br}",
                              path)
        assert r.rc == 1, r.all
        assert "bridge/nosuch0" in r.err and "declare" in r.err, r.err
        assert f"bridge/{br}" not in r.err
        assert host_ns.link(br) is None


# ------------------------------------------------------------------ deletions need the mark


def _veth_name(aid: str) -> str:
    import hashlib

    return "vr" + hashlib.sha1(aid.encode()).hexdigest()[:12]


def test_a_foreign_link_with_the_veths_name_is_left_alone(host_ns: Netns,
                                                          tmp_path: Any) -> None:
    aid, br = unique("v"), "rg" + unique()[-6:]
    name = _veth_name(aid)
    host_ns.run("ip", "link", "add", name, "type", "bridge")  # someone's, by that name
    path = _alloc_file(tmp_path, aid, br)
    try:
        r = host_ns.reconcile("apply", "--no-probe", path)
        assert r.rc == 1, r.all
        assert f"alloc {aid}" in r.err and name in r.err and "not the reconciler's" in r.err
        link = host_ns.link(name)
        assert link is not None and link["linkinfo"]["info_kind"] == "bridge"
    finally:
        host_ns.reconcile("destroy", "--yes")
        _sh("ip", "netns", "del", aid, check=False)


def test_an_unmarked_empty_namespace_file_is_left_alone(host_ns: Netns, tmp_path: Any) -> None:
    aid, br = unique("e"), "rg" + unique()[-6:]
    path = f"/run/netns/{aid}"
    with open(path, "w"):
        pass  # what `ip netns add` leaves between its create and its mount
    try:
        r = host_ns.reconcile("apply", "--no-probe", _alloc_file(tmp_path, aid, br))
        assert r.rc == 1, r.all
        assert f"alloc {aid}" in r.err and "no mark on the file" in r.err, r.err
        assert os.path.isfile(path) and os.stat(path).st_size == 0
        assert _sh("findmnt", "-n", path, check=False).stdout == ""  # still no namespace
    finally:
        host_ns.reconcile("destroy", "--yes")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_temporary_bridges_are_removed_only_with_their_mark(host_ns: Netns,
                                                            tmp_path: Any) -> None:
    from reconciler.domain.ownership import temp_bridge_mac

    theirs, ours = "rcltmp0a1b2c3d", "rcltmp5e6f7a8b"
    host_ns.run("ip", "link", "add", theirs, "type", "bridge")
    host_ns.run("ip", "link", "add", ours, "address", temp_bridge_mac(ours), "type", "bridge")
    f = write(tmp_path, "a.yaml", "version: 1\n")
    r = host_ns.reconcile("apply", "--no-prune", "--no-probe", f)
    assert r.rc == 0, r.all
    assert host_ns.link(ours) is None  # a leftover of ours: garbage, --no-prune or not
    assert host_ns.link(theirs) is not None
    r = host_ns.reconcile("apply", "--no-probe", f)
    assert r.rc == 0 and host_ns.link(theirs) is not None, r.all
    assert host_ns.reconcile("destroy", "--yes").rc == 0
    assert host_ns.link(theirs) is not None


def test_a_new_bridge_is_marked_at_every_step_of_its_creation(host_ns: Netns,
                                                              tmp_path: Any) -> None:
    """The temporary bridge is created with its mark (the MAC) in the creation itself:
    watched with `ip monitor`, every link the creation shows is marked."""
    from reconciler.domain.ownership import bridge_mac, temp_bridge_mac

    br = "rg" + unique()[-6:]
    mon = subprocess.Popen(["ip", "-n", host_ns.name, "-o", "monitor", "link"],
                           stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)
        assert host_ns.reconcile("apply", "--no-probe",
                                 write(tmp_path, "a.yaml", BRIDGE % br)).rc == 0
        time.sleep(0.3)
    finally:
        mon.terminate()
        out, _ = mon.communicate(timeout=10)
    temp = [ln for ln in out.splitlines() if "rcltmp" in ln]
    assert temp, out
    first = temp[0]
    name = first.split(":")[1].strip().split("@")[0]
    assert temp_bridge_mac(name) in first, first
    assert host_ns.link(br)["address"] == bridge_mac(br)
    assert host_ns.link(br)["ifalias"] == "managed-by=reconciler"
