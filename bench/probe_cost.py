"""What the probes (SPEC §7) cost: apply with and without them, and a watch-style probe pass.

As root: ``python3 bench/probe_cost.py [--n 500] [--pass-n 1000] [--runs 3]``

In the same run, side by side (bench/_harness.py sandboxes, 2 tcp port maps per
allocation, the external vantage on: the sandbox default):

(a) ``reconcile apply`` of N allocations from nothing with ``--no-probe`` and
    with the probes (default), each in a fresh sandbox, the order alternating
    between runs: the probes' own wall time inside the apply (``probe_seconds``
    of ``apply --output json``) ÷ N is the figure with the target (at most ~3 ms
    per allocation at N=500); (with − without) ÷ N is printed beside it as a
    cross-check (two applies on a shared machine: noisy);
(b) in the sandbox of the apply with probes: ``reconcile verify`` with and
    without ``--no-probe`` (config comparison only): the same figure measured
    on one host, without the noise of two applies;
(c) a watch-style probe pass at ``--pass-n`` allocations: in a child process
    inside the sandbox, ``Reconciler.observe`` then ``Reconciler.probe`` of every
    allocation (what the agent's probe timer runs), the probe call timed apart
    from the observation, median of ``--passes``.

The load average (``/proc/loadavg``) is printed before and after: the machine is
shared, compare within one run. Everything is removed afterwards (checked: no
namespace of ours left under /run/netns).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _harness import ROOT, Sandbox, alloc_yaml, fmt_s  # noqa: E402

from reconciler.drivers import netns  # noqa: E402

TARGET_MS = 3.0  # probe wall time per allocation at N=500, at most (issue 13, item 6)

#: the child of (c): in the sandbox, observe then probe every allocation, ``passes`` times
PASS = r"""
import json, sys, time
from reconciler.config.load import load
from reconciler.drivers import netns
from reconciler.engine.reconcile import ProbeRequest, Reconciler
path, host, passes, external = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
netns.enter_process_netns(host)
desired = load([path])
rec = Reconciler()
out = []
try:
    for _ in range(passes):
        t0 = time.perf_counter()
        live = rec.observe(desired)
        t1 = time.perf_counter()
        results = rec.probe(desired, live, request=ProbeRequest(external=external))
        t2 = time.perf_counter()
        failed = sum(1 for r in results if not r.ok and not r.skipped)
        out.append({"observe": t1 - t0, "probe": t2 - t1, "probes": len(results),
                    "failed": failed, "skipped": sum(1 for r in results if r.skipped)})
finally:
    rec.close_probes()
print(json.dumps(out))
"""


def loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def apply_once(n: int, probes: bool) -> dict[str, float]:
    """A fresh sandbox: apply N allocations (with or without probes); with probes, also the
    verify pair of (b)."""
    with Sandbox("rpc") as sb:
        full = sb.write("allocs.yaml", alloc_yaml(n, sb.prefix))
        # exit 1 when a probe fails: counted and printed, not a crash of the benchmark
        run = sb.cli("apply", full, *(() if probes else ("--no-probe",)), "--output", "json",
                     ok=(0, 1))
        doc = json.loads(run.stdout)
        out = {"apply": run.seconds, "probes": float(len(doc.get("probes", []))),
               "probe_wall": float(doc.get("probe_seconds", 0.0)),
               "failed": float(sum(1 for p in doc.get("probes", [])
                                   if not p["ok"] and not p["skipped"]))}
        if probes:
            out["verify"] = sb.cli("verify", full, ok=(0, 1)).seconds
            out["verify_config"] = sb.cli("verify", full, "--no-probe").seconds
        left = [x for x in sb.leftovers() if x != sb.host]
        if len(left) != n:
            raise RuntimeError(f"expected {n} allocation namespaces, found {len(left)}")
    return out


def probe_pass(n: int, passes: int, external: bool) -> list[dict[str, float]]:
    with Sandbox("rpp") as sb:
        full = sb.write("allocs.yaml", alloc_yaml(n, sb.prefix))
        sb.cli("apply", full, "--no-probe")
        src = os.environ.get("RECONCILER_BENCH_SRC", str(ROOT))
        p = subprocess.run([sys.executable, "-c", PASS, full, sb.host, str(passes),
                            "1" if external else "0"], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=src), cwd=src, timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"probe pass: exit {p.returncode}\n{p.stderr[-2000:]}")
        runs: list[dict[str, float]] = json.loads(p.stdout)
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=500, help="allocations applied (default 500)")
    ap.add_argument("--pass-n", type=int, default=1000,
                    help="allocations of the watch-style probe pass (default 1000)")
    ap.add_argument("--runs", type=int, default=3, help="apply pairs (median; default 3)")
    ap.add_argument("--passes", type=int, default=5, help="probe passes (median; default 5)")
    ap.add_argument("--no-external", action="store_true",
                    help="the probe pass without the external vantage")
    ap.add_argument("--json", metavar="FILE", help="also write every raw figure here")
    opts = ap.parse_args(argv)
    before = set(netns.list_names())
    load_before = loadavg()
    print(f"load before: {load_before}", flush=True)
    t_start = time.monotonic()
    raw: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
    for run in range(opts.runs):
        for probes in ((False, True) if run % 2 == 0 else (True, False)):
            side = "with" if probes else "without"
            raw[side].append(apply_once(opts.n, probes))
            print(f"run {run + 1} {side}: " + ", ".join(f"{k}={v:.3f}" for k, v in
                                                        raw[side][-1].items()),
                  file=sys.stderr, flush=True)
    load_mid = loadavg()
    passes = probe_pass(opts.pass_n, opts.passes, not opts.no_external)
    load_after = loadavg()

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in raw[side])

    n = opts.n
    a_without, a_with = med("without", "apply"), med("with", "apply")
    diff_per_alloc = (a_with - a_without) / n * 1000
    per_alloc = med("with", "probe_wall") / n * 1000
    v_probe, v_config = med("with", "verify"), med("with", "verify_config")
    v_per_alloc = (v_probe - v_config) / n * 1000
    probe_s = statistics.median(p["probe"] for p in passes)
    observe_s = statistics.median(p["observe"] for p in passes)
    verdict = "met" if per_alloc <= TARGET_MS else "MISSED"
    print(f"\nN={n} allocations, 2 tcp port maps each, external vantage on — median of "
          f"{opts.runs} run(s)")
    print(f"(a) apply --no-probe            {fmt_s(a_without):>10}")
    print(f"    apply (probes what changed) {fmt_s(a_with):>10}   "
          f"{int(med('with', 'probes'))} probes, {int(med('with', 'failed'))} failed")
    print(f"    probe wall time in it       {fmt_s(med('with', 'probe_wall')):>10}   "
          f"{per_alloc:.2f} ms/alloc, target ≤{TARGET_MS:g} ms: {verdict}")
    print(f"    (with − without) ÷ N        {diff_per_alloc:>7.2f} ms   (cross-check)")
    print(f"(b) verify --no-probe           {fmt_s(v_config):>10}")
    print(f"    verify (config + probes)    {fmt_s(v_probe):>10}   "
          f"{v_per_alloc:.2f} ms/alloc more (every allocation probed)")
    print(f"(c) watch-style probe pass at {opts.pass_n}: probe {fmt_s(probe_s)} "
          f"({probe_s / opts.pass_n * 1000:.2f} ms/alloc, "
          f"{int(passes[0]['probes'])} probes, {int(passes[0]['failed'])} failed, "
          f"{int(passes[0]['skipped'])} skipped), observe before it {fmt_s(observe_s)} "
          f"— median of {len(passes)}")
    print(f"load (1/5/15 min): before {load_before}, after the applies {load_mid}, after the "
          f"pass {load_after}; {time.monotonic() - t_start:.0f} s in all")
    left = [x for x in sorted(set(netns.list_names()) - before) if x.startswith(("rpc", "rpp"))]
    print(f"left behind: {len(left)} namespace(s) of ours under /run/netns"
          + (f": {left[:5]}" if left else ""))
    if opts.json:
        data: dict[str, Any] = {"raw": raw, "passes": passes, "n": n, "pass_n": opts.pass_n}
        with open(opts.json, "w") as fh:
            json.dump(data, fh, indent=1)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
