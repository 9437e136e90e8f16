"""Safe change against the real kernel, as independent tools see it: the host's state read
with ``ip -j``, ``nft -j list table inet reconciler``, ``iptables-save`` (without counters)
and ``/proc/sys``, never our own observer; the pending record and the reverter's process; a
before and an after desired state; an agent under ``--confirm-within``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from reconciler.domain.ownership import PROBE_VANTAGE_ALIAS
from tests.support.host import Netns, forget_run_files, sh, unique, write

BRIDGE = "rsafe0"


PORT_A, PORT_B = 18110, 18111


def config_before(tmp_path: Any, alloc: str) -> str:
    return write(tmp_path, "a.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: safe, bridge: {BRIDGE}, cidr: 10.221.0.0/24, cidr6: "fd00:221::/64"}}]
allocs:
  - id: {alloc}
    subnet: safe
    ports: [{{host: {PORT_A}, to: 80}}]
""")


def config_after(tmp_path: Any, alloc: str, extra: str | None, *, port: int = PORT_B,
                 name: str = "b.yaml") -> str:
    """Everything the change can change: the bridge's MTU (the old file left it to the
    kernel), a port map moved (to ``port``), a new allocation ``extra`` with a port map,
    an address, a prune. Without ``extra``: the same file that prunes it again."""
    text = f"""version: 1
bridges: [{{name: {BRIDGE}, mtu: 1400}}, {{name: {BRIDGE}x}}]
subnets: [{{name: safe, bridge: {BRIDGE}, cidr: 10.221.0.0/24}}]
allocs:
  - id: {alloc}
    subnet: safe
    address: 10.221.0.9
    ports: [{{host: {port}, to: 80}}]
"""
    if extra is not None:
        text += f"""  - id: {extra}
    subnet: safe
    ports: [{{host: {PORT_B + 1}, to: 80}}]
"""
    return write(tmp_path, name, text)


def _host_view(host: Netns) -> dict[str, Any]:
    """The sandbox's links, addresses, rules and sysctls, from ip -j, nft -j and iptables-save."""
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
    # our table, and in iptables only what names us (the shim's accept, chains of earlier
    # versions): foreign rules are no part of the owned state
    rules: dict[Any, list[str]] = {**_table_view(host), **{
        f"iptables{family}": [ln for ln in host.iptables_save(family).splitlines()
                              if ln.startswith(("-A", ":")) and "reconciler" in ln.lower()]
        for family in (4, 6)}}
    sysctls = {k: host.run("cat", f"/proc/sys/net/{k}").stdout.strip()
               for k in ("ipv4/ip_forward", "ipv6/conf/all/forwarding")}
    return {"links": links, "rules": rules, "sysctls": sysctls}


def _table_view(host: Netns) -> dict[Any, list[str]]:
    """Our table as ``nft -j list table inet reconciler`` shows it: per family (4, 6: the
    sets named so; 4 also the unsuffixed ones) every element with its comment, and under
    "chains" every rule's expressions (without handles); empty lists when there is none."""
    out: dict[Any, list[str]] = {4: [], 6: [], "chains": []}
    p = host.run("nft", "-j", "list", "table", "inet", "reconciler", check=False)
    if p.returncode != 0:
        return out
    for obj in json.loads(p.stdout)["nftables"]:
        body = obj.get("set") or obj.get("map")
        if body is not None:
            family = 6 if body["name"].split("_")[0].endswith("6") else 4
            out[family] += sorted(f"{body['name']}: {json.dumps(e, sort_keys=True)}"
                                  for e in body.get("elem", ()))
        elif "rule" in obj:
            r = obj["rule"]
            out["chains"].append(f"{r['chain']}: {json.dumps(r['expr'], sort_keys=True)}")
    return out


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


def make_overdue(host: Netns) -> dict[str, Any]:
    """Move the pending record's deadline into the past (the tests' clock seam): what a
    window waited out would leave, without waiting it out. Only for a record whose reverter
    is gone; the window's own timing is tested with real windows (tests/integration/
    safe_change/test_window.py)."""
    path = os.path.join(scope_dir(host), "pending.json")
    with open(path) as fh:
        rec: dict[str, Any] = json.load(fh)
    rec["deadline"] = min(rec["deadline"], time.time() - 0.5)
    tmp = path + ".test-tmp"
    with open(tmp, "w") as fh:
        json.dump(rec, fh)
    os.chmod(tmp, os.stat(path).st_mode & 0o777)
    os.replace(tmp, path)
    return rec


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


def apply_ok(host: Netns, cfg: str, *args: str, **kw: Any) -> Any:
    r = host.reconcile("apply", cfg, *args, **kw)
    assert r.rc == 0, r.all
    return r


def setup_change(box: Netns, tmp_path: Any) -> tuple[str, str, dict[str, Any], str]:
    alloc, extra = unique("s"), unique("s")
    NAMES[:] = [alloc, extra]
    a, b = config_before(tmp_path, alloc), config_after(tmp_path, alloc, extra)
    apply_ok(box, a)
    before = state(box)
    assert before["allocs"] and before["rules"][4], before
    return a, b, before, extra


def kill_apply_at_checkpoint(box: Netns, cfg: str, window: str,
                             then: float = 0.0) -> tuple[dict[str, Any], int]:
    """``apply cfg --confirm-within window`` SIGKILLed with its whole process group (a lost
    ssh session) once it has recorded the checkpoint and started its reverter, ``then``
    seconds later: the pending record and the CLI's exit status. The killed CLI's run
    files (its lock) are forgotten."""
    cmd = [sys.executable, "-m", "reconciler", "--netns", box.name, "apply", cfg,
           "--confirm-within", window]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        end = time.monotonic() + 30
        while (rec := pending_record(box)) is None or not rec.get("reverter_pid"):
            assert time.monotonic() < end and proc.poll() is None, "no pending record"
            time.sleep(0.005)
        if then:
            time.sleep(then)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    forget_run_files(os.stat(f"/run/netns/{box.name}").st_ino)
    return rec, proc.returncode


def read_text(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def window_agent(box: Netns, cfg_dir: str, window: str) -> Any:
    from tests.support.agent import Agent

    return Agent(box, [cfg_dir], "--confirm-within", window,  # type: ignore[arg-type]
                 "--interval", "3600", "--probe-interval", "off")


def settled(agent: Any, timeout: float = 40.0) -> dict[str, Any]:
    """The agent's status once nothing is pending and its last pass converged."""
    return agent.wait_status(  # type: ignore[no-any-return]
        lambda d: d.get("pending") is None and (d.get("last_pass") or {}).get("result")
        in ("ok", "applied") and "pending" in d, timeout, what="nothing pending")
