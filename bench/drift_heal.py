"""Drift-to-healed latency of the watch agent: delete its bridge out of band, time the way back.

Run as root: ``python bench/drift_heal.py [--runs 7] [--allocs 0]``, and for the
firewall (issue 26 item 6: a flush of our rules, ``nft flush ruleset``, a dockerd
restart, a ufw reload, iptables-legacy drift; bench/_fwdrift.py says how):
``python bench/drift_heal.py --firewall [--runs 5]``

Everything happens in a throwaway "host" namespace ``rtb-<hex>``: the agent
runs as ``python -m reconciler --netns rtb-<hex> watch DIR`` with a long
``--interval`` (so only the netlink event can heal), the bridge is deleted
through netlink from inside that namespace, and two times are taken per run:

* back: deletion → the bridge exists again (polled every millisecond);
* healed: deletion → the agent's pass has finished and verified (its
  ``last_pass.finished_at`` in /status, same wall clock);

plus the agent's own pass duration. Reported as min / median / max over the
runs. With ``--allocs N`` the bridge carries N allocations whose veths must
be re-attached too. The agent, the allocations and the namespace are removed
on exit, even on failure.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import agent_status, free_port  # noqa: E402

from reconciler.drivers import netns  # noqa: E402
from reconciler.drivers.netlink import client as links  # noqa: E402

BRIDGE = "rbheal0"
ENV = dict(os.environ, PYTHONPATH=ROOT)


def desired(tag: str, allocs: int) -> str:
    lines = ["version: 1", "bridges:", f"  - name: {BRIDGE}", "subnets:",
             "  - name: heal-net", f"    bridge: {BRIDGE}", "    cidr: 10.93.0.0/16"]
    if allocs:
        lines.append("allocs:")
        lines += [f"  - {{id: rtb-{tag}-{i}, subnet: heal-net}}" for i in range(allocs)]
    return "\n".join(lines) + "\n"


def wait_status(addr: str, pred: Any, timeout: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = agent_status(addr)
        if doc is not None and pred(doc):
            return doc
        time.sleep(0.002)
    raise SystemExit(f"timed out waiting for {what}")


def settled(addr: str, quiet: float = 0.5, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until no pass has run for ``quiet`` seconds (echoes of the last heal are done)."""
    deadline = time.monotonic() + timeout
    last = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        doc = agent_status(addr)
        count = doc["pass_count"] if doc else None
        if count != last:
            last, since = count, time.monotonic()
        elif doc and time.monotonic() - since >= quiet:
            if (doc.get("last_pass") or {}).get("result") not in ("ok", "applied"):
                raise SystemExit(f"the agent is not converged: {doc.get('last_pass')}")
            return doc
        time.sleep(0.02)
    raise SystemExit("the agent did not settle")


def one_run(host: str, addr: str) -> tuple[float, float, float]:
    before = settled(addr)
    with netns.enter(host), links.Netlink() as nl:
        t_wall = time.time()
        t0 = time.monotonic()
        nl.delete_link(BRIDGE)
        while nl.link_index(BRIDGE) is None:
            if time.monotonic() - t0 > 30:
                raise SystemExit("the bridge did not come back within 30 s")
            time.sleep(0.001)
        back = time.monotonic() - t0
    doc = wait_status(addr, lambda d: d["pass_count"] > before["pass_count"]
                      and (d.get("last_pass") or {}).get("finished_at", 0) > t_wall
                      and d["last_pass"]["result"] in ("applied", "ok"), 30, "the healing pass")
    healed = doc["last_pass"]["finished_at"] - t_wall
    return back, healed, float(doc["last_pass"]["duration_seconds"])


def fmt(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return f"{ms[0]:7.1f} / {statistics.median(ms):7.1f} / {ms[-1]:7.1f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--allocs", type=int, default=0)
    ap.add_argument("--firewall", action="store_true",
                    help="the firewall reloads in coexistence cells instead (bench/_fwdrift.py)")
    ap.add_argument("--reloads", nargs="+", default=None,
                    help="with --firewall: which of flush-ours nft-flush dockerd ufw legacy "
                         "(default all)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("run as root (it creates a throwaway network namespace)", file=sys.stderr)
        return 1
    if args.firewall:
        import _fwdrift
        chosen = set(args.reloads or _fwdrift.RELOADS)
        if chosen - set(_fwdrift.RELOADS):
            ap.error(f"--reloads: one of {' '.join(_fwdrift.RELOADS)}")
        return _fwdrift.run(args.runs, chosen)
    tag = secrets.token_hex(3)
    host = f"rtb-{tag}"
    addr = f"127.0.0.1:{free_port()}"
    # not under /tmp: the agent refuses config under a directory others can write
    conf = tempfile.mkdtemp(prefix="drift-heal-", dir="/run")
    os.chmod(conf, 0o755)
    with open(os.path.join(conf, "net.yaml"), "w") as fh:
        fh.write(desired(tag, args.allocs))
    subprocess.run(["ip", "netns", "add", host], check=True)
    agent = None
    log = tempfile.TemporaryFile()  # noqa: SIM115 (read in the finally below)
    try:
        subprocess.run(["ip", "-n", host, "link", "set", "lo", "up"], check=True)
        agent = subprocess.Popen(
            [sys.executable, "-m", "reconciler", "--netns", host, "watch", conf,
             "--status-addr", addr, "--interval", "3600", "--log-format", "json"],
            stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
        t0 = time.monotonic()
        wait_status(addr, lambda d: (d.get("last_pass") or {}).get("result") == "applied",
                    120, "the first pass")
        print(f"agent up and converged in {time.monotonic() - t0:.2f}s "
              f"(1 bridge, 1 subnet, {args.allocs} allocs)")
        backs, heals, passes = [], [], []
        for i in range(args.runs):
            back, healed, dur = one_run(host, addr)
            backs.append(back)
            heals.append(healed)
            passes.append(dur)
            print(f"  run {i + 1}: bridge back {back * 1000:6.1f} ms, pass done "
                  f"{healed * 1000:6.1f} ms (pass {dur * 1000:5.1f} ms)")
        print(f"drift-to-healed, {args.runs} runs, min / median / max:")
        print(f"  bridge back:       {fmt(backs)}")
        print(f"  healing pass done: {fmt(heals)}")
        print(f"  pass duration:     {fmt(passes)}")
        return 0
    finally:
        if agent is not None:
            agent.send_signal(signal.SIGTERM)
            try:
                rc = agent.wait(15)
                if rc != 0:
                    log.seek(0)
                    print(f"agent exited {rc}:\n{log.read().decode()[-2000:]}", file=sys.stderr)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        subprocess.run([sys.executable, "-m", "reconciler", "--netns", host, "destroy", "--yes"],
                       capture_output=True, env=ENV, cwd=ROOT, check=False)
        for i in range(args.allocs):
            subprocess.run(["ip", "netns", "del", f"rtb-{tag}-{i}"], capture_output=True,
                           check=False)
        subprocess.run(["ip", "netns", "del", host], check=False)
        for name in os.listdir(conf):
            os.unlink(os.path.join(conf, name))
        os.rmdir(conf)
        log.close()


if __name__ == "__main__":
    raise SystemExit(main())
