"""Bridges and subnets against the real kernel and iptables, each test in its own namespace.

Results are checked with `ip -j` and `iptables-save`, never with our own observer.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from tests.support.cli import reconcile
from tests.support.host import EXAMPLES, Netns, ip_json, sh, write

pytestmark = pytest.mark.root


def _addresses(ns: Netns) -> list[tuple[str, str, int]]:
    """Links and addresses, without flags that change on their own (IPv6 DAD "tentative")."""
    return sorted((link["ifname"], a["local"], a["prefixlen"])
                  for link in ns.ip_json("addr", "show") for a in link.get("addr_info", []))
EXAMPLE = os.path.join(EXAMPLES, "bridge-subnet.yaml")


def test_apply_example_then_plan_is_empty(host_ns: Netns):
    r = host_ns.reconcile("plan", EXAMPLE)
    assert r.rc == 2, r.all
    assert "+ bridge rcl0" in r.out and "+ subnet rcl-net" in r.out
    assert "Plan: " in r.out
    assert host_ns.link("rcl0") is None  # plan changed nothing

    r = host_ns.reconcile("apply", EXAMPLE)
    assert r.rc == 0, r.all
    link = host_ns.link("rcl0")
    assert link is not None
    assert link["linkinfo"]["info_kind"] == "bridge"
    assert link["mtu"] == 1500 and "UP" in link["flags"]
    assert link.get("ifalias") == "managed-by=reconciler"
    assert host_ns.addrs("rcl0") == ["172.26.64.1/20", "fd00:a:b::1/64"]
    v4 = host_ns.firewall_text(4)
    isolate = host_ns.run("nft", "list", "chain", "inet", "reconciler", "isolate").stdout
    assert "hook forward priority filter - 10" in isolate  # before every other filter chain
    # isolation ports (the default): replies and DNAT in, the subnet itself, the rest dropped
    assert ("-A RECONCILER-FORWARD -d 172.26.64.0/20 -o rcl0 -m conntrack --ctstate "
            "RELATED,ESTABLISHED,DNAT -m comment --comment "
            '"reconciler:subnet=rcl-net" -j ACCEPT') in v4
    assert ("-A RECONCILER-FORWARD -d 172.26.64.0/20 -o rcl0 -m comment --comment "
            '"reconciler:subnet=rcl-net" -j DROP') in v4
    assert ("-A RECONCILER-POSTROUTING -s 172.26.64.0/20 ! -d 172.26.64.0/20 -m comment "
            '--comment "reconciler:subnet=rcl-net" -j MASQUERADE') in v4
    assert "-A RECONCILER-FORWARD -d fd00:a:b::/64 -o rcl0" in host_ns.firewall_text(6)
    assert host_ns.run("cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip() == "1"

    before = (_addresses(host_ns), host_ns.firewall_text(4))
    r = host_ns.reconcile("plan", EXAMPLE)
    assert r.rc == 0, r.all
    assert "No changes." in r.out
    r = host_ns.reconcile("apply", EXAMPLE)
    assert r.rc == 0
    after = (_addresses(host_ns), host_ns.firewall_text(4))
    strip = lambda s: [ln for ln in s[1].splitlines() if not ln.startswith("#")]  # noqa: E731
    assert before[0] == after[0] and strip(before) == strip(after)


def test_mtu_change_plans_update_and_applies(host_ns: Netns, tmp_path):
    host_ns.reconcile("apply", EXAMPLE)
    with open(EXAMPLE) as fh:
        text = fh.read()
    text = text.replace("mtu: 1500", "mtu: 1400")
    changed = write(tmp_path, "changed.yaml", text)
    r = host_ns.reconcile("plan", changed)
    assert r.rc == 2
    assert "~ bridge rcl0" in r.out and "mtu: 1500 -> 1400" in r.out
    assert host_ns.reconcile("apply", changed).rc == 0
    assert host_ns.link("rcl0")["mtu"] == 1400


def test_removing_resources_plans_delete_and_removes_them(host_ns: Netns, tmp_path):
    host_ns.reconcile("apply", EXAMPLE)
    only_bridge = write(tmp_path, "b.yaml", "version: 1\nbridges: [{name: rcl0, mtu: 1500}]\n")
    r = host_ns.reconcile("plan", only_bridge)
    assert r.rc == 2 and "- subnet rcl-net" in r.out
    assert host_ns.reconcile("apply", only_bridge).rc == 0
    assert host_ns.addrs("rcl0") == []
    assert "RECONCILER" not in host_ns.firewall_text(4)
    empty = write(tmp_path, "e.yaml", "version: 1\n")
    r = host_ns.reconcile("apply", empty)
    assert r.rc == 0 and "- bridge rcl0" in r.out
    assert host_ns.link("rcl0") is None


def test_no_prune_keeps_what_files_dropped(host_ns: Netns, tmp_path):
    host_ns.reconcile("apply", EXAMPLE)
    empty = write(tmp_path, "e.yaml", "version: 1\n")
    r = host_ns.reconcile("plan", "--no-prune", empty)
    assert r.rc == 0, r.all
    assert host_ns.reconcile("apply", "--no-prune", empty).rc == 0
    assert host_ns.link("rcl0") is not None


@pytest.mark.real_process  # the exit code and error shape of a real process
def test_foreign_bridge_is_a_conflict_and_left_untouched(host_ns: Netns):
    host_ns.run("ip", "link", "add", "rcl0", "mtu", "1450", "type", "bridge")
    host_ns.run("ip", "addr", "add", "192.168.77.1/24", "dev", "rcl0")
    before = host_ns.run("ip", "-d", "addr", "show", "rcl0").stdout
    r = host_ns.reconcile("plan", EXAMPLE)
    assert r.rc == 1
    assert "! bridge rcl0" in r.out and "--adopt bridge/rcl0" in r.out
    r = host_ns.reconcile("apply", EXAMPLE)
    assert r.rc == 1 and "bridge rcl0" in r.err and "blocked" in r.err and "Traceback" not in r.all
    assert host_ns.run("ip", "-d", "addr", "show", "rcl0").stdout == before
    assert "RECONCILER" not in host_ns.firewall_text(4)
    # destroy never touches it either
    assert host_ns.reconcile("destroy", "--yes").rc == 0
    assert host_ns.link("rcl0") is not None


def test_non_bridge_link_with_bridge_name_is_a_conflict(host_ns: Netns):
    # (this kernel has no dummy module; a veth is just as much "not a bridge")
    host_ns.run("ip", "link", "add", "rcl0", "type", "veth", "peer", "name", "rcl0p")
    r = host_ns.reconcile("apply", "--adopt", "bridge/rcl0", EXAMPLE)
    assert r.rc == 1 and "bridge rcl0: a veth link named rcl0 exists and is not a bridge" in r.err
    assert host_ns.link("rcl0")["linkinfo"]["info_kind"] == "veth"


def test_adopt_takes_over_a_foreign_bridge(host_ns: Netns):
    host_ns.run("ip", "link", "add", "rcl0", "type", "bridge")
    host_ns.run("ip", "addr", "add", "192.168.77.1/24", "dev", "rcl0")
    r = host_ns.reconcile("apply", "--adopt", "bridge/rcl0", EXAMPLE)
    assert r.rc == 0, r.all
    assert host_ns.link("rcl0").get("ifalias") == "managed-by=reconciler"
    # the foreign address outside the subnet is kept
    assert "192.168.77.1/24" in host_ns.addrs("rcl0")
    assert host_ns.reconcile("plan", EXAMPLE).rc == 0


def test_saved_plan_applies_and_is_refused_when_stale(host_ns: Netns, tmp_path):
    out = str(tmp_path / "plan.json")
    r = host_ns.reconcile("plan", "--out", out, EXAMPLE)
    assert r.rc == 2
    with open(out) as fh:
        saved = json.load(fh)
    assert saved["summary"]["create"] >= 2
    host_ns.run("ip", "link", "add", "rcl0", "type", "bridge")  # the world moved on
    r = host_ns.reconcile("apply", out)
    assert r.rc == 1 and "stale" in r.err
    host_ns.run("ip", "link", "del", "rcl0")
    r = host_ns.reconcile("apply", out)
    assert r.rc == 0, r.all
    assert host_ns.link("rcl0") is not None


def test_a_saved_plan_records_its_scope_and_is_refused_in_another(host_ns: Netns, tmp_path):
    out = str(tmp_path / "plan.json")
    r = host_ns.reconcile("plan", "--out", out, EXAMPLE)
    assert r.rc == 2 and f"`reconcile --netns {host_ns.name} apply {out}`" in r.err, r.all
    with open(out) as fh:
        scope = json.load(fh)["scope"]
    assert scope["netns"] == host_ns.name and scope["id"].startswith(f"{host_ns.inode()}-")
    other = host_ns.ns("other")
    sh("ip", "netns", "add", other)
    r = reconcile("apply", out, netns=other)
    assert r.rc == 1 and r.err.count("\n") == 1, r.all
    assert f"network namespace {host_ns.name} (--netns {host_ns.name})" in r.err, r.err
    assert f"not in network namespace {other} (--netns {other})" in r.err, r.err
    assert f"`reconcile --netns {host_ns.name} apply {out}`" in r.err, r.err
    assert ip_json(other, "link", "show", "type", "bridge") == []
    # without the name (an agent answered the plan): the namespace is found by its inode
    with open(out) as fh:
        doc = json.load(fh)
    del doc["scope"]["netns"]
    with open(out, "w") as fh:
        json.dump(doc, fh)
    r = reconcile("apply", out, netns=other)
    assert r.rc == 1 and f"network namespace {host_ns.name} (--netns" in r.err, r.err
    assert host_ns.reconcile("apply", out).rc == 0


@pytest.mark.real_process  # the exit code and error shape of a real process
def test_a_plan_saved_by_an_earlier_version_is_refused_by_name(host_ns: Netns, tmp_path):
    # what the version before derived MACs saved: the same changes without "mac"; the live
    # state is the same, so "the live state changed" would send the operator looking for
    # a change that never happened
    out = str(tmp_path / "plan.json")
    assert host_ns.reconcile("plan", "--out", out, EXAMPLE).rc == 2
    with open(out) as fh:
        saved = json.load(fh)
    stripped = 0
    for change in saved["changes"]:
        change["attrs"] = [a for a in change["attrs"] if a["field"] != "mac"]
        for op in change["ops"]:
            stripped += op["args"].pop("mac", None) is not None
    assert stripped >= 1
    with open(out, "w") as fh:
        json.dump(saved, fh)
    r = host_ns.reconcile("apply", out)
    assert r.rc == 1 and "made by another version" in r.err, r.all
    assert "Traceback" not in r.all and host_ns.link("rcl0") is None


def test_plan_json_output(host_ns: Netns):
    r = host_ns.reconcile("plan", "--output", "json", EXAMPLE)
    assert r.rc == 2
    doc = json.loads(r.out)
    kinds = {(c["kind"], c["name"], c["action"]) for c in doc["changes"]}
    assert ("bridge", "rcl0", "create") in kinds and ("subnet", "rcl-net", "create") in kinds
    assert doc["summary"]["create"] >= 2


def test_drift_is_healed(host_ns: Netns):
    host_ns.reconcile("apply", EXAMPLE)
    host_ns.run("ip", "addr", "del", "172.26.64.1/20", "dev", "rcl0")
    host_ns.run("nft", "flush", "chain", "inet", "reconciler", "masq")
    host_ns.run("nft", "delete", "element", "inet", "reconciler", "ports4",
                '{ "rcl0" . 172.26.64.0/20 }')
    r = host_ns.reconcile("plan", EXAMPLE)
    assert r.rc == 2 and "~ subnet rcl-net" in r.out and "firewall nftables" in r.out
    assert host_ns.reconcile("apply", EXAMPLE).rc == 0
    assert "172.26.64.1/20" in host_ns.addrs("rcl0")
    assert host_ns.reconcile("plan", EXAMPLE).rc == 0


def test_bridge_deleted_out_of_band_is_recreated(host_ns: Netns):
    host_ns.reconcile("apply", EXAMPLE)
    host_ns.run("ip", "link", "del", "rcl0")
    r = host_ns.reconcile("plan", EXAMPLE)
    assert "+ bridge rcl0" in r.out
    assert host_ns.reconcile("apply", EXAMPLE).rc == 0
    assert host_ns.addrs("rcl0") == ["172.26.64.1/20", "fd00:a:b::1/64"]


def test_forward_policy_drop_still_forwards_to_the_subnet(host_ns: Netns):
    """Like dockerd does: policy DROP on FORWARD; one rule accepting our mark, ahead of the
    drop, is what lets our traffic through (ahead of theirs: the chain has no drop rule)."""
    host_ns.run("iptables", "-P", "FORWARD", "DROP")
    host_ns.run("iptables", "-N", "DOCKER-USER")
    host_ns.run("iptables", "-A", "FORWARD", "-j", "DOCKER-USER")
    assert host_ns.reconcile("apply", EXAMPLE).rc == 0
    rules = host_ns.run("iptables", "-S", "FORWARD").stdout
    assert "-P FORWARD DROP" in rules
    assert "-A FORWARD -m mark --mark 0x2000/0x2000 " in rules, rules
    assert "-A FORWARD -j DOCKER-USER" in rules  # theirs, kept
    assert host_ns.run("iptables", "-C", "FORWARD", "-m", "mark", "--mark", "0x2000/0x2000",
                       "-m", "comment", "--comment", "reconciler:shim", "-j", "ACCEPT",
                       check=False).returncode == 0  # iptables -C reads it back


@pytest.mark.real_process  # the exit code and error shape of a real process
def test_bad_input_changes_nothing_on_the_host(host_ns: Netns, tmp_path):
    bad = write(tmp_path, "bad.yaml", "version: 1\nbridges:\n  - name: rcl0\n    mtu: lots\n")
    before = (_addresses(host_ns), host_ns.firewall_text(4))
    for cmd in ("plan", "apply"):
        r = host_ns.reconcile(cmd, bad)
        assert r.rc == 1 and f"{bad}:4:" in r.err and "Traceback" not in r.all
    after = (_addresses(host_ns), host_ns.firewall_text(4))
    assert before[0] == after[0]


def test_two_applies_at_once_are_serialised(host_ns: Netns):
    results = []

    def run() -> None:
        results.append(host_ns.reconcile("apply", EXAMPLE))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.rc for r in results] == [0, 0, 0], [r.all for r in results]
    assert host_ns.run("nft", "list", "tables").stdout.count("inet reconciler") == 1
    drops = [ln for ln in host_ns.firewall_text(4).splitlines()
             if ln.startswith("-A RECONCILER-FORWARD") and ln.endswith("-j DROP")]
    assert len(drops) == 1, drops  # one subnet's isolation drop, once
    assert host_ns.reconcile("plan", EXAMPLE).rc == 0


def test_lock_timeout_fails_clearly(host_ns: Netns):
    import subprocess
    import sys
    holder = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{host_ns.name}", sys.executable, "-c",
         "import time\nfrom reconciler.engine.lock import host_lock\n"
         "with host_lock():\n    print('held', flush=True)\n    time.sleep(30)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        r = host_ns.reconcile("apply", "--lock-timeout", "0.5", EXAMPLE)
        assert r.rc == 1 and "another reconcile" in r.err
        assert host_ns.link("rcl0") is None
    finally:
        holder.kill()
        holder.wait()


def test_destroy_removes_everything_managed(host_ns: Netns):
    host_ns.reconcile("apply", EXAMPLE)
    r = host_ns.reconcile("destroy", "--yes")
    assert r.rc == 0, r.all
    assert host_ns.link("rcl0") is None
    assert "RECONCILER" not in host_ns.firewall_text(4) + host_ns.firewall_text(6)
    shown = json.loads(host_ns.reconcile("show", "--output", "json").out)
    assert shown["links"] == [] and shown["netns"] == []
    assert not any(shown["firewall"].values())


@pytest.mark.real_process  # the exit code and error shape of a real process
def test_netns_that_does_not_exist_is_a_clear_error():
    from tests.support.cli import reconcile
    from tests.support.host import unique
    r = reconcile("plan", EXAMPLE, netns=unique())
    assert r.rc == 1 and "Traceback" not in r.all and r.err.startswith("error:")


def test_plan_alias_after_global_options(host_ns: Netns):
    import subprocess
    import sys
    for extra in ((), ("--color", "never")):
        p = subprocess.run([sys.executable, "-m", "reconciler", "--netns", host_ns.name, *extra,
                            "--plan", EXAMPLE], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        assert "+ bridge rcl0" in p.stdout


def test_lock_dir_problem_is_one_clear_error(host_ns: Netns):
    r = host_ns.reconcile("apply", EXAMPLE, env={"RECONCILER_LOCK_DIR": "/etc/hostname/x"})
    assert r.rc == 1 and "cannot make the run directory /etc/hostname/x: /etc/hostname is not " \
        "a directory" in r.err and "internal error" not in r.err


def test_foreign_rules_referring_to_our_old_chains_are_never_touched(host_ns: Netns, tmp_path):
    """An earlier version's chain with someone's jump to it: the upgrade builds the table,
    removes our jump and empties the chain, keeps it (their rule needs it) and says so."""
    host_ns.run("iptables", "-N", "RECONCILER-FORWARD")
    host_ns.run("iptables", "-A", "RECONCILER-FORWARD", "-d", "172.26.64.0/20", "-o", "rcl0",
                "-m", "comment", "--comment", "reconciler:subnet=rcl-net", "-j", "DROP")
    host_ns.run("iptables", "-I", "FORWARD", "1", "-m", "comment", "--comment", "reconciler",
                "-j", "RECONCILER-FORWARD")
    # someone adds their own jump to our chain, with a comment that needs quoting
    host_ns.run("iptables", "-A", "FORWARD", "-m", "comment", "--comment", "added by ops team",
                "-j", "RECONCILER-FORWARD")
    r = host_ns.reconcile("apply", EXAMPLE)
    assert r.rc == 0, r.all
    assert "converting the RECONCILER-* iptables chains" in r.out, r.out
    assert "added by ops team" in r.all and "kept" in r.all, r.all
    assert host_ns.reconcile("plan", EXAMPLE).rc == 0
    save = host_ns.iptables_save(4)
    assert ":RECONCILER-FORWARD" in save and "-A RECONCILER-FORWARD" not in save
    assert '--comment "added by ops team" -j RECONCILER-FORWARD' in save
    assert "--comment reconciler -j RECONCILER-FORWARD" not in save
    r = host_ns.reconcile("destroy", "--yes")
    assert r.rc == 0, r.all
    assert host_ns.run("nft", "list", "table", "inet", "reconciler", check=False).returncode != 0
    empty = write(tmp_path, "e.yaml", "version: 1\n")
    assert host_ns.reconcile("plan", empty).rc == 0


def test_saved_plan_keeps_its_options_and_works_from_another_directory(host_ns: Netns,
                                                                       tmp_path):
    import shutil
    assert host_ns.reconcile("apply", EXAMPLE).rc == 0
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copy(EXAMPLE, work / "net.yaml")
    (work / "empty.yaml").write_text("version: 1\n")
    out = str(tmp_path / "plan.json")
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "reconciler", "--netns", host_ns.name, "plan",
                        "--no-prune", "--out", out, "empty.yaml"], cwd=work,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr  # nothing to do without pruning
    with open(out) as fh:
        assert json.load(fh)["options"]["prune"] is False
    r = host_ns.reconcile("apply", out)  # from another directory, with the plan's options
    assert r.rc == 0, r.all
    assert host_ns.link("rcl0") is not None
    r = host_ns.reconcile("apply", "--no-prune", out)
    assert r.rc == 1 and "options it was planned with" in r.err


@pytest.mark.parametrize(("key", "value"), [("adopt", 5), ("adopt", [1]), ("prune", "no"),
                                            ("force_replace", [])])
@pytest.mark.real_process  # the exit code and error shape of a real process
def test_saved_plan_with_a_malformed_option_is_one_clear_line(host_ns: Netns, tmp_path,
                                                               key, value):
    out = tmp_path / "plan.json"
    assert host_ns.reconcile("plan", EXAMPLE, "--out", str(out)).rc == 2
    doc = json.loads(out.read_text())
    doc["options"][key] = value
    out.write_text(json.dumps(doc, indent=2))
    r = host_ns.reconcile("apply", str(out))
    assert r.rc == 1, r.all
    assert f"options.{key} must be" in r.err and str(out) in r.err, r.err
    assert "internal error" not in r.all and "Traceback" not in r.all
    assert host_ns.link("rcl0") is None  # nothing changed


def test_global_options_after_the_command_act_where_they_say(host_ns: Netns):
    """`reconcile apply FILE --netns S` acts in S, never on the host (an option on both
    parsers once parsed as netns=None), and -v and --output work after the command too."""
    r = reconcile("apply", "--no-probe", EXAMPLE, "--netns", host_ns.name)
    assert r.rc == 0, r.all
    assert host_ns.link("rcl0") is not None
    assert ip_link_on_host("rcl0") is None
    r = reconcile("show", "--netns", host_ns.name, "--output", "json")
    assert r.rc == 0 and "rcl0" in json.loads(r.out)["bridges"][0]["name"], r.all
    r = reconcile("--no-color", "plan", EXAMPLE, "-v", "--netns", host_ns.name, "--no-agent")
    assert r.rc == 0 and "No changes" in r.out, r.all


def ip_link_on_host(name: str) -> object:
    return sh("ip", "link", "show", name, check=False).stdout.strip() or None
