"""Side by side: the reconciler's CLI vs the systems it replaces, same machine, same run.

As root: ``python3 bench/compare.py [--n 100 500 1000] [--runs 3] [--cni-runs R] [--cni-max-n 500]``

For each N (allocations, 2 tcp port maps each, one bridge and subnet):

(a) set-up: ``reconcile apply --no-probe`` vs Nomad's CNI chain ADD
    (bench/cni_chain.py), like for like: the chain proves nothing after it; and
    ``reconcile apply`` with its probes (SPEC §7, the default) in a second
    sandbox, beside it, with the probes' own wall time;
(b) teardown: ``reconcile apply`` of the file without the allocs (prune; the
    bridge and subnet stay, as the chain leaves its bridge) vs CNI DEL;
(c) no-op ``reconcile plan`` vs the host-level dump in the same namespace
    (``ip -j link`` + ``ip -j addr`` + ``iptables-save``, three processes):
    answered by a running ``reconcile watch`` of the same file (how hosts run
    the reconciler; median of 5 after its first observation, each paired with
    a dump), and planned in-process with no agent (``RECONCILER_AGENT=off``);
(d) peak RSS of the in-process no-op plan (``wait4`` rusage of the child),
    of the client the agent answers, and of the agent itself (VmHWM).

and once: (e) ensure 20 Docker networks, ``reconcile apply`` vs kind's way
(one ``docker`` CLI process per step, bench/docker_networks.py).

Ours runs as ``python -m reconciler --netns <throwaway> …`` (interpreter
start-up included, as the chain's plugin start-ups are); the chain runs in a
throwaway namespace of its own. Figures are medians of the runs; the ratios
are what matters on a noisy machine. Everything is removed afterwards (checked:
no namespace of ours under /run/netns, no Docker network of ours).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cni_chain  # noqa: E402
from _harness import (  # noqa: E402
    Sandbox,
    alloc_yaml,
    cli_supports,
    docker_yaml,
    fmt_s,
    host_dump,
    process_hwm_mb,
)

from reconciler.drivers import netns  # noqa: E402

AGENT_PLANS = 5  # no-op plans answered by the agent per run (median), each with a dump

TARGETS = {
    "apply500": 100.0,     # CNI set-up / our apply --no-probe, at N=500, at least (issue 18)
    "probed500": 50.0,     # CNI set-up / our apply with its probes, at N=500, at least
    "teardown500": 50.0,   # CNI DEL / our prune, at N=500, at least
    "plan1000": 3.0,       # our no-op plan / host dump, at N=1000, at most
    "rss1000": 150.0,      # MB, peak RSS of the no-op plan at N=1000, below
    "docker20": 1.0,       # kind CLI / ours, at least
}


def ours_probed_apply(n: int) -> dict[str, float]:
    """``reconcile apply`` with its probes, in a sandbox of its own (a fresh host, as (a))."""
    with Sandbox("rca") as sb:
        # exit 1 when a probe fails: the time still counts, the failures are printed
        run = sb.cli("apply", sb.write("allocs.yaml", alloc_yaml(n, sb.prefix)),
                     "--output", "json", ok=(0, 1))
        doc = json.loads(run.stdout)
        return {"apply_probed": run.seconds,
                "probe_wall": float(doc.get("probe_seconds", 0.0)),
                "probe_failed": float(sum(1 for p in doc.get("probes", [])
                                          if not p["ok"] and not p["skipped"]))}


def ours_allocs(n: int) -> dict[str, float]:
    probes = cli_supports("apply", "--no-probe")
    with Sandbox("rcb") as sb:
        full = sb.write("allocs.yaml", alloc_yaml(n, sb.prefix))
        base = sb.write("base.yaml", alloc_yaml(0, sb.prefix, allocs=False))
        apply = sb.cli("apply", full, *(("--no-probe",) if probes else ()))
        # exit 0: no changes (2 would be a diff: an error here)
        plan = sb.cli("plan", full, env={"RECONCILER_AGENT": "off"})
        dump = host_dump(sb.host)
        with sb.agent(full) as pid:  # the same plan, answered by a running `reconcile watch`
            first = sb.cli("plan", full, env={"RECONCILER_AGENT": "require"})  # it observes
            answered = [sb.cli("plan", full, env={"RECONCILER_AGENT": "require"})
                        for _ in range(AGENT_PLANS)]
            dumps = [host_dump(sb.host) for _ in range(AGENT_PLANS)]
            # another tool's link appears on the host: only the host's links are read again
            subprocess.run(["ip", "-n", sb.host, "link", "add", "rbx0", "type", "veth", "peer",
                            "name", "rbx1"], check=True)
            foreign = sb.cli("plan", full, env={"RECONCILER_AGENT": "require"})
            agent_rss = process_hwm_mb(pid)
        teardown = sb.cli("apply", base)
        left = [x for x in sb.leftovers() if x != sb.host]
        if left:
            raise RuntimeError(f"prune left {len(left)} allocation namespaces")
    probed = ours_probed_apply(n) if probes else {}
    return {**probed, "apply": apply.seconds, "apply_rss": apply.maxrss_mb, "plan": plan.seconds,
            "plan_rss": plan.maxrss_mb, "dump": dump, "teardown": teardown.seconds,
            "agent_first": first.seconds, "agent_foreign": foreign.seconds,
            "agent_plan": statistics.median(r.seconds for r in answered),
            "agent_dump": statistics.median(dumps),
            "agent_client_rss": max(r.maxrss_mb for r in answered), "agent_rss": agent_rss}


def cni(n: int) -> dict[str, float]:
    t = cni_chain.run(n, progress=n >= 200)
    k = min(50, n)
    return {"setup": t.setup, "teardown": t.teardown,
            "add_first": statistics.median(t.add_each[:k]),
            "add_last": statistics.median(t.add_each[-k:]),
            "execs_add": t.execs_add / n, "execs_del": t.execs_del / n}


def docker_side(n: int, runs: int) -> dict[str, dict[str, float]] | str:
    """Ensure ``n`` Docker networks: ours (apply, then apply again) vs kind's CLI steps."""
    try:
        import docker
        import docker_networks as dn
        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:  # no SDK, no daemon: the rest of the comparison still runs
        return f"skipped: {type(exc).__name__}: {exc}"
    prefix = f"rcd{secrets.token_hex(3)}"
    res: dict[str, dict[str, list[float]]] = {s: {"create": [], "again": []}
                                              for s in ("kind", "ours")}
    try:
        for run in range(runs):
            for side in (("kind", "ours") if run % 2 == 0 else ("ours", "kind")):
                names = [f"{prefix}-{side[0]}{run}-{i:02d}" for i in range(n)]
                try:
                    if side == "kind":
                        t0 = time.perf_counter()
                        for name in names:
                            dn.kind_ensure(name)
                        res[side]["create"].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        for name in names:
                            dn.kind_ensure(name)
                        res[side]["again"].append(time.perf_counter() - t0)
                    else:
                        with Sandbox("rcd") as sb:
                            f = sb.write("docker.yaml", docker_yaml(names))
                            res[side]["create"].append(sb.cli("apply", f).seconds)
                            res[side]["again"].append(sb.cli("apply", f).seconds)
                finally:
                    dn.cleanup(client, f"{prefix}-{side[0]}{run}-")
    finally:
        dn.cleanup(client, prefix)
        client.close()
    return {side: {k: statistics.median(v) for k, v in d.items()} for side, d in res.items()}


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.1f}x"


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(results: dict[int, dict[str, Any]], docker_res: Any, opts: argparse.Namespace) -> None:
    w = (40, 14, 16, 9, 24)
    head = ("measure", "reconciler", "reference", "ratio", "target")

    def row(*cells: str) -> None:
        print("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(cells)))

    for n, r in sorted(results.items()):
        o, c = r["ours"], r.get("cni")
        print(f"\nN={n} allocations, 2 tcp port maps each — median of {r['runs']} run(s) of ours"
              + (f", {r['cni_runs']} of the CNI chain" if c else ", CNI chain not run"))
        row(*head)
        setup_r = c["setup"] / o["apply"] if c else None
        td_r = c["teardown"] / o["teardown"] if c else None
        t_apply = (f"≥{TARGETS['apply500']:.0f}x: {_verdict(setup_r >= TARGETS['apply500'])}"
                   if n == 500 and setup_r else "")
        t_td = (f"≥{TARGETS['teardown500']:.0f}x: {_verdict(td_r >= TARGETS['teardown500'])}"
                if n == 500 and td_r else "")
        row("(a) set-up: apply --no-probe vs CNI ADD", fmt_s(o["apply"]), fmt_s(c and c["setup"]),
            _ratio(c and c["setup"], o["apply"]), t_apply)
        row("    per alloc", f"{o['apply'] / n * 1000:.2f} ms",
            f"{c['setup'] / n * 1000:.0f} ms" if c else "—", "", "")
        if "apply_probed" in o:
            probed_r = c["setup"] / o["apply_probed"] if c else None
            row("    with probes (the default)", fmt_s(o["apply_probed"]),
                fmt_s(c and c["setup"]), _ratio(c and c["setup"], o["apply_probed"]),
                f"≥{TARGETS['probed500']:.0f}x: {_verdict(probed_r >= TARGETS['probed500'])}"
                if n == 500 and probed_r else "")
            row("    of which probes, per alloc", f"{o['probe_wall'] / n * 1000:.2f} ms",
                f"{o['probe_failed']:.0f} failed", "",
                f"≤3 ms: {_verdict(o['probe_wall'] / n * 1000 <= 3.0)}" if n == 500 else "")
        if c:
            row("    CNI ADD first/last 50 (median)", "",
                f"{c['add_first'] * 1000:.0f}/{c['add_last'] * 1000:.0f} ms", "", "")
        row("(b) teardown: prune vs CNI DEL", fmt_s(o["teardown"]), fmt_s(c and c["teardown"]),
            _ratio(c and c["teardown"], o["teardown"]), t_td)
        ar = o["agent_plan"] / o["agent_dump"]
        t_plan = (f"≤{TARGETS['plan1000']:.0f}x: {_verdict(ar <= TARGETS['plan1000'])}"
                  if n == 1000 else "")
        row("(c) no-op plan vs host dump", fmt_s(o["agent_plan"]), fmt_s(o["agent_dump"]),
            f"{ar:.1f}x", t_plan)
        row("    first one, agent just started", fmt_s(o["agent_first"]), "", "", "")
        row("    after another tool's link came", fmt_s(o["agent_foreign"]), "", "", "")
        pr = o["plan"] / o["dump"]
        row("    same, no agent (in-process)", fmt_s(o["plan"]), fmt_s(o["dump"]),
            f"{pr:.1f}x", "")
        t_rss = (f"<{TARGETS['rss1000']:.0f} MB: "
                 f"{_verdict(o['plan_rss'] < TARGETS['rss1000'])}" if n == 1000 else "")
        row("(d) peak RSS, no-op plan in-process", f"{o['plan_rss']:.0f} MB", "", "", t_rss)
        row("    client / agent (resident)", f"{o['agent_client_rss']:.0f}/{o['agent_rss']:.0f} MB",
            "", "", "")
        row("    peak RSS, apply", f"{o['apply_rss']:.0f} MB", "", "", "")
    print("\nratios: reference time / ours for (a), (b), (e) (above 1: we are faster); "
          "ours / dump for (c) (below 3: target met)")
    if docker_res is None:
        return
    print(f"\n(e) ensure {opts.docker_n} Docker networks — median of {opts.runs} run(s)")
    if isinstance(docker_res, str):
        print(f"  {docker_res}")
        return
    row("measure", "reconciler", "kind (CLI)", "ratio", "target")
    k, o = docker_res["kind"], docker_res["ours"]
    ok = k["create"] / o["create"] >= TARGETS["docker20"]
    row("create: apply vs CLI steps", fmt_s(o["create"]), fmt_s(k["create"]),
        _ratio(k["create"], o["create"]), f"not slower: {_verdict(ok)}")
    row("ensure again (no-op)", fmt_s(o["again"]), fmt_s(k["again"]),
        _ratio(k["again"], o["again"]), "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[100, 500],
                    help="allocation counts (default 100 500; the issue's are 100 500 1000)")
    ap.add_argument("--runs", type=int, default=3, help="runs of ours (and of Docker); median")
    ap.add_argument("--cni-runs", type=int, default=None,
                    help="runs of the CNI chain (default: --runs up to N=200, 1 above: "
                         "set-up and teardown of 500 take ~5 min)")
    ap.add_argument("--cni-max-n", type=int, default=500,
                    help="skip the CNI chain above this N (default 500)")
    ap.add_argument("--docker-n", type=int, default=20, help="Docker networks (default 20)")
    ap.add_argument("--no-docker", action="store_true", help="skip (e)")
    ap.add_argument("--no-cni", action="store_true", help="ours only")
    ap.add_argument("--json", metavar="FILE", help="also write every raw figure here")
    ap.add_argument("--plot", metavar="DIR",
                    help="also draw the figures (bench/plots.py, needs matplotlib: the "
                         "bench extra) from that JSON into DIR; needs --json")
    opts = ap.parse_args(argv)
    if opts.plot and not opts.json:
        ap.error("--plot draws from the JSON: give --json FILE too")
    why = cni_chain.check_installed()
    if why and not opts.no_cni:
        ap.error(why)
    before = set(netns.list_names())
    raw: dict[int, dict[str, list[dict[str, float]]]] = {}
    results: dict[int, dict[str, Any]] = {}
    for n in opts.n:
        raw[n] = {"ours": [], "cni": []}
        do_cni = not opts.no_cni and n <= opts.cni_max_n
        cni_runs = opts.cni_runs if opts.cni_runs is not None else opts.runs if n <= 200 else 1
        for run in range(max(opts.runs, cni_runs if do_cni else 0)):
            # alternate which side goes first so neither always meets a warmer kernel
            sides = ["ours", "cni"] if run % 2 == 0 else ["cni", "ours"]
            for side in sides:
                if side == "ours" and run < opts.runs:
                    raw[n]["ours"].append(ours_allocs(n))
                elif side == "cni" and do_cni and run < cni_runs:
                    raw[n]["cni"].append(cni(n))
                else:
                    continue
                print(f"N={n} run {run + 1} {side}: "
                      + ", ".join(f"{k}={v:.3f}" for k, v in raw[n][side][-1].items()),
                      file=sys.stderr)
        med = {side: {k: statistics.median(d[k] for d in runs) for k in runs[0]
                      if all(k in d for d in runs)}  # a run whose probes failed has none
               for side, runs in raw[n].items() if runs}
        results[n] = {"ours": med["ours"], "cni": med.get("cni"), "runs": opts.runs,
                      "cni_runs": cni_runs}
    docker_res = None if opts.no_docker else docker_side(opts.docker_n, opts.runs)
    report(results, docker_res, opts)
    left = sorted(set(netns.list_names()) - before)
    left = [x for x in left if x.startswith(("rcb", "rcc", "rcd", "rca"))]
    print(f"\nleft behind: {len(left)} namespace(s) of ours under /run/netns"
          + (f": {left[:5]}" if left else ""))
    if opts.json:
        write_json(opts.json, raw, results, docker_res)
    if opts.plot:
        import plots
        for path in plots.draw([opts.json], opts.plot):
            print(f"drew {path}")
    return 1 if left else 0


def write_json(path: str, raw: dict[int, Any], results: dict[int, dict[str, Any]],
               docker_res: Any) -> None:
    """Every figure, as bench/plots.py reads it back (``medians``: per N, ours and cni)."""
    with open(path, "w") as fh:
        json.dump({"kind": "compare", "meta": meta(), "raw": raw, "medians": results,
                   "docker": docker_res}, fh, indent=1)


def meta() -> dict[str, str]:
    """When, which code (``git describe`` of the tree under test), the load at the end."""
    src = os.environ.get("RECONCILER_BENCH_SRC", str(Path(__file__).resolve().parent.parent))
    code = subprocess.run(["git", "-C", src, "describe", "--always", "--dirty"],
                          capture_output=True, text=True, check=False).stdout.strip()
    with open("/proc/loadavg") as fh:
        load = " ".join(fh.read().split()[:3])
    return {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "code": code or os.path.basename(src), "load": load}


if __name__ == "__main__":
    sys.exit(main())
