"""How the CLI's cost grows with the number of allocations: time and peak RSS per N.

As root: ``python3 bench/scaling.py [--n 100 1000 5000] [--runs 1] [--timeout 1800]``

For each N (N allocs with 2 tcp port maps on one bridge with a /16 subnet — or
one bridge and /16 per 1,000 allocs: a Linux bridge takes at most 1,023 ports,
the 1,024th veth fails with "Exchange full"), in a throwaway host namespace:
``reconcile apply`` from nothing, a no-op ``reconcile plan`` in-process, the
same plan answered by a running ``reconcile watch`` (median of 3 after its
first observation; RSS is the client's), and the teardown (``apply`` of the
file without the allocs: prune; the bridges stay). Each is
one ``python -m reconciler`` process; time is wall clock, RSS is that child's
peak (wait4). Growth is judged per allocation: the cost per alloc at N divided
by the cost per alloc at the previous N — about 1 is linear, N_i/N_(i-1) would
be quadratic. Interpreter start-up and imports (~0.5 s) are a constant, so
per-alloc costs at small N overstate; the last column subtracts the cost
measured for N=0 (bridge + subnet only) first.

5000 namespaces need about 1 GB of kernel memory and 5,000 cached netlink
sockets (file descriptors) in the reconciler; a command that exceeds
``--timeout`` is killed and reported, and everything is removed afterwards.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import CliRun, Sandbox, alloc_yaml  # noqa: E402

PHASES = ("apply", "plan (no-op)", "plan via agent", "teardown (prune)")


def one(n: int, timeout: float) -> dict[str, CliRun]:
    with Sandbox("rcs") as sb:
        full = sb.write("allocs.yaml", alloc_yaml(n, sb.prefix, "10.88.0.0/16"))
        base = sb.write("base.yaml", alloc_yaml(n, sb.prefix, "10.88.0.0/16", allocs=False))
        out = {"apply": sb.cli("apply", full, timeout=timeout)}
        out["plan (no-op)"] = sb.cli("plan", full, timeout=timeout,
                                     env={"RECONCILER_AGENT": "off"})
        with sb.agent(full, timeout=timeout):  # answered by a running `reconcile watch`
            req = {"RECONCILER_AGENT": "require"}
            sb.cli("plan", full, timeout=timeout, env=req)  # its first observation
            answered = sorted((sb.cli("plan", full, timeout=timeout, env=req) for _ in range(3)),
                              key=lambda r: r.seconds)
            out["plan via agent"] = answered[1]
        out["teardown (prune)"] = sb.cli("apply", base, timeout=timeout)
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--runs", type=int, default=1, help="runs per N; median (default 1)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="kill a single command after this many seconds (default 1800)")
    opts = ap.parse_args(argv)
    sizes = sorted(set(opts.n))
    if sizes[-1] > 65000:
        ap.error("at most 65000 allocations fit the /16 and the port range")
    res: dict[int, dict[str, tuple[float, float]]] = {}
    for n in [0, *sizes]:
        runs: list[dict[str, CliRun]] = []
        for r in range(opts.runs):
            try:
                runs.append(one(n, opts.timeout))
            except RuntimeError as exc:
                print(f"N={n} run {r + 1}: {exc}", file=sys.stderr)
                break
            print(f"N={n} run {r + 1}: " + ", ".join(
                f"{k} {v.seconds:.2f} s / {v.maxrss_mb:.0f} MB" for k, v in runs[-1].items()),
                file=sys.stderr)
        if runs:
            res[n] = {p: (statistics.median(x[p].seconds for x in runs),
                          statistics.median(x[p].maxrss_mb for x in runs)) for p in PHASES}
    base = res.get(0)
    print(f"\nScaling, median of {opts.runs} run(s); ratio = cost per alloc at N / at the "
          "previous N (1.0 = linear)")
    print(f"{'phase':<18} {'N':>6} {'time':>10} {'per alloc':>11} {'ratio':>7} "
          f"{'ratio (−N=0 cost)':>18} {'peak RSS':>9}")
    for phase in PHASES:
        prev: tuple[int, float, float] | None = None
        for n in sizes:
            if n not in res:
                print(f"{phase:<18} {n:>6} {'failed/killed':>10}")
                continue
            t, rss = res[n][phase]
            t0 = base[phase][0] if base else 0.0
            ratio = ratio0 = "—"
            if prev is not None:
                pn, pt, pt0 = prev
                ratio = f"{(t / n) / (pt / pn):.2f}"
                if pt0 > 0:
                    ratio0 = f"{((t - t0) / n) / pt0:.2f}"
            print(f"{phase:<18} {n:>6} {t:>8.2f} s {t / n * 1000:>8.2f} ms {ratio:>7} "
                  f"{ratio0:>18} {rss:>6.0f} MB")
            prev = (n, t, max(t - t0, 0.0) / n)
    if base:
        print("N=0 (bridge + subnet only): " + ", ".join(
            f"{p} {base[p][0]:.2f} s / {base[p][1]:.0f} MB" for p in PHASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
