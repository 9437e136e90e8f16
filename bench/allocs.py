"""Allocations through the CLI, as a user runs it: apply, no-op plan, destroy.

As root: ``python3 bench/allocs.py [--n 100 500] [--runs 3] [--profile DIR]``

For each N: one bridge and subnet with N allocations, 2 tcp port maps each,
built inside a throwaway host namespace with ``reconcile --netns H apply``;
then a no-op ``reconcile plan`` (must exit 0) planned in-process, the
host-level dump in the same namespace for comparison (``ip -j link`` + ``ip -j
addr`` + ``iptables-save``), the same plan answered by a running ``reconcile
watch`` (median of 5 after its first observation) and ``reconcile destroy``.
Each run gets a fresh sandbox, removed even on failure; the table shows
medians over the runs (interpreter start-up included, as a user sees it). ``--profile DIR`` also
writes cProfile output of each step of the last run, for ``python -m pstats``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _harness import Sandbox, alloc_yaml, fmt_s, host_dump, run_cli  # noqa: E402

STEPS = ("apply", "plan", "dump", "agent plan", "destroy")


def one_run(n: int, profile: Path | None) -> dict[str, float]:
    with Sandbox("rba") as sb:
        path = sb.write("allocs.yaml", alloc_yaml(n, sb.prefix))

        def cli(step: str, *args: str) -> float:
            if profile is not None:
                return _profiled(sb, profile, step, n, args)
            return sb.cli(*args).seconds

        t: dict[str, float] = {}
        t["apply"] = cli("apply", "apply", path)
        t["plan"] = cli("plan", "plan", "--no-agent", path)  # exit 0 or raises: no diff allowed
        t["dump"] = host_dump(sb.host)
        with sb.agent(path):  # the same plan answered by a running `reconcile watch`
            sb.cli("plan", path, env={"RECONCILER_AGENT": "require"})  # its first observation
            t["agent plan"] = statistics.median(
                sb.cli("plan", path, env={"RECONCILER_AGENT": "require"}).seconds
                for _ in range(5))
        t["destroy"] = cli("destroy", "destroy", "--yes")
        left = [x for x in sb.leftovers() if x != sb.host]
        if left:
            raise RuntimeError(f"destroy left {len(left)} namespaces behind, e.g. {left[:3]}")
        return t


def _profiled(sb: Sandbox, profile: Path, step: str, n: int, args: tuple[str, ...]) -> float:
    out = profile / f"{step}-{n}.prof"
    code = ("import cProfile, sys; from reconciler.cli.commands import main; "
            "sys.argv = ['reconcile'] + sys.argv[3:]; "  # after '-m reconciler'
            f"cProfile.run('rc = main()', {str(out)!r}); sys.exit(rc)")
    return run_cli(["--netns", sb.host, *args], python_args=("-c", code)).seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[100, 500], metavar="N")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="write cProfile data of each step of the last run here")
    args = ap.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.n:
        runs = [one_run(n, args.profile if i == args.runs - 1 else None)
                for i in range(args.runs)]
        med = {s: statistics.median(r[s] for r in runs) for s in STEPS}
        rows.append((n, med))
        print(f"N={n}: " + ", ".join(f"{s} {fmt_s(med[s])}" for s in STEPS), file=sys.stderr)
    print(f"\nallocs (2 tcp port maps each), median of {args.runs} run(s), CLI incl. start-up\n")
    head = ("N", "apply", "per alloc", "no-op plan", "host dump", "plan/dump",
            "plan via agent", "agent/dump", "destroy")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for n, m in rows:
        print(f"| {n} | {fmt_s(m['apply'])} | {m['apply'] / n * 1000:.1f} ms | "
              f"{fmt_s(m['plan'])} | {fmt_s(m['dump'])} | {m['plan'] / m['dump']:.1f}x | "
              f"{fmt_s(m['agent plan'])} | {m['agent plan'] / m['dump']:.1f}x | "
              f"{fmt_s(m['destroy'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
