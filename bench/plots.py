"""The benchmarks' figures as pictures, drawn from the JSON the benchmarks write.

``python3 bench/plots.py FILE.json… [--out-dir bench/figures]`` (several compare.py
files: the first one's run in full, the others faint beside it, so the spread of one
afternoon's runs shows)

Reads what ``bench/compare.py --json FILE`` writes (medians per N of ours and of the
CNI chain, same run) and draws:

- ``scaling.png``: set-up cost per allocation against N: ``reconcile apply
  --no-probe``, ``reconcile apply`` with its probes, and Nomad's CNI chain ADD
  (and teardown, per allocation: prune vs CNI DEL, in a second panel). The point of
  the comparison is the shape: our line stays flat where the chain's climbs.
- ``noop-plan.png``: the no-op ``reconcile plan`` against N, answered by a running
  agent and planned in-process, beside the host-level dump (``ip -j link``, ``ip -j
  addr``, ``iptables-save``) of the same namespace.

and from what ``bench/apply_curve.py --json FILE`` writes, ``apply-curve.png``: the
cost per allocation of one apply from nothing, against N (ours alone, up to
thousands), gross and net of the apply with no allocations.

matplotlib is a bench-only extra (``pip install '.[bench]'``), never a dependency of
the reconciler. Plotting reads only the JSON, so a figure can be drawn again, or a
test can draw a small one, without running the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

#: what each figure is called in the output directory
SCALING, NOOP_PLAN, APPLY_CURVE = "scaling.png", "noop-plan.png", "apply-curve.png"


class NotBenchJSON(ValueError):
    """A file that is not what compare.py or apply_curve.py writes."""


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display), or one clear line without it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib, a bench-only extra: "
                         "pip install '.[bench]' (or: pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read(path: str) -> dict[str, Any]:
    """A benchmark's JSON: ``{"kind": "compare"|"apply_curve", ...}`` (compare.py's older
    files have no kind: their ``medians`` say what they are)."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise NotBenchJSON(f"{path}: {exc}") from None
    if not isinstance(doc, dict):
        raise NotBenchJSON(f"{path}: not a benchmark's JSON (an object expected)")
    kind = doc.get("kind") or ("compare" if "medians" in doc else None)
    if kind not in ("compare", "apply_curve"):
        raise NotBenchJSON(f"{path}: neither compare.py's nor apply_curve.py's JSON")
    return {**doc, "kind": kind}


def _series(doc: dict[str, Any], side: str, key: str, *,
            per_alloc: bool = False, scale: float = 1000.0) -> tuple[list[int], list[float]]:
    """(N, value) of one median across the runs' sizes, in ms (per allocation if asked);
    sizes where that side or figure was not measured are left out."""
    xs, ys = [], []
    for n_text, med in sorted(doc["medians"].items(), key=lambda kv: int(kv[0])):
        n = int(n_text)
        figures = med.get(side) or {}
        if key not in figures or n == 0:
            continue
        xs.append(n)
        ys.append(figures[key] * scale / (n if per_alloc else 1))
    return xs, ys


def _style(ax: Any, title: str, ylabel: str, sizes: Sequence[int] = (), *,
           logy: bool = True) -> None:
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_title(title, fontsize=10)
    ax.set_xlabel("allocations (N), 2 tcp port maps each")
    ax.set_ylabel(ylabel)
    ax.set_xscale("log")
    if sizes:  # the sizes measured, as plain numbers, not powers of ten
        ax.set_xticks(sorted(set(sizes)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:  # from zero: a flat line looks flat
        ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _note(doc: dict[str, Any]) -> str:
    meta = doc.get("meta") or {}
    parts = [f"{k}: {v}" for k, v in meta.items() if k in ("when", "load")]
    return "; ".join(parts)


def _lines(ax: Any, docs: Sequence[dict[str, Any]], side: str, key: str, label: str,
           colour: str, marker: str, *, per_alloc: bool) -> int:
    """One series per run: the first run in full, the others faint and unlabelled (so the
    spread between runs of one afternoon shows); how many runs had it."""
    drawn = 0
    for i, doc in enumerate(docs):
        xs, ys = _series(doc, side, key, per_alloc=per_alloc)
        if not xs:
            continue
        if i == 0:
            ax.plot(xs, ys, marker=marker, color=colour, label=label)
        else:
            ax.plot(xs, ys, marker=marker, color=colour, alpha=0.3, linewidth=1,
                    markersize=4)
        drawn += 1
    return drawn


def _others(ax: Any, docs: Sequence[dict[str, Any]]) -> None:
    if len(docs) > 1:  # one legend entry says what the faint lines are
        ax.plot([], [], color="gray", alpha=0.3, linewidth=1,
                label=f"faint: {len(docs) - 1} other run(s), same series")


def _sizes(docs: Sequence[dict[str, Any]], *series: tuple[str, str]) -> list[int]:
    return [n for d in docs for side, key in series for n in _series(d, side, key)[0]]


def scaling(docs: Sequence[dict[str, Any]], out: str) -> str:
    """Set-up and teardown cost per allocation vs N: ours and the CNI chain's, each line
    from one run (the first of ``docs``; the others faint)."""
    plt = _pyplot()
    fig, (setup, teardown) = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = [(setup, "ours", "apply", "reconcile apply --no-probe", "tab:blue", "o"),
             (setup, "ours", "apply_probed", "reconcile apply (with its probes)", "tab:cyan",
              "s"),
             (setup, "cni", "setup", "Nomad's CNI chain: ADD", "tab:red", "^"),
             (teardown, "ours", "teardown", "reconcile apply (prune)", "tab:blue", "o"),
             (teardown, "cni", "teardown", "Nomad's CNI chain: DEL", "tab:red", "^")]
    drawn = sum(_lines(ax, docs, side, key, label, colour, marker, per_alloc=True)
                for ax, side, key, label, colour, marker in lines)
    if not drawn:
        raise NotBenchJSON("no set-up figures to draw")
    _others(setup, docs)
    sizes = _sizes(docs, ("ours", "apply"), ("cni", "setup"))
    _style(setup, "set-up: time per allocation", "ms per allocation", sizes)
    _style(teardown, "teardown: time per allocation", "ms per allocation", sizes)
    note = _note(docs[0])
    fig.suptitle("Per-allocation cost as N grows: ours and the CNI chain in one run "
                 "(medians)" + (f"\n{note}" if note else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def noop_plan(docs: Sequence[dict[str, Any]], out: str) -> str:
    """The no-op plan's wall time vs N, and the host dump it is measured against."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    drawn = sum(_lines(ax, docs, "ours", key, label, colour, marker, per_alloc=False)
                for key, label, colour, marker in (
                    ("agent_plan", "reconcile plan, answered by the agent", "tab:blue", "o"),
                    ("plan", "reconcile plan, in-process (no agent)", "tab:cyan", "s"),
                    ("agent_dump", "host dump: ip -j link, ip -j addr, iptables-save",
                     "tab:gray", "^")))
    if not drawn:
        raise NotBenchJSON("no no-op plan figures to draw")
    _others(ax, docs)
    note = _note(docs[0])
    _style(ax, "No-op plan vs the host dump (medians)" + (f"\n{note}" if note else ""),
           "wall time, ms", _sizes(docs, ("ours", "plan")))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def apply_curve(doc: dict[str, Any], out: str) -> str:
    """apply_curve.py's rows: ms per allocation (gross and net of N=0) vs N."""
    rows = sorted(doc.get("rows") or [], key=lambda r: r["n"])
    if not rows:
        raise NotBenchJSON("no apply_curve rows to draw")
    base = float(doc.get("base_seconds", 0.0))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    xs = [r["n"] for r in rows]
    ax.plot(xs, [r["seconds"] / r["n"] * 1000 for r in rows], marker="o", color="tab:blue",
            label="reconcile apply --no-probe, from nothing")
    ax.plot(xs, [max(r["seconds"] - base, 0.0) / r["n"] * 1000 for r in rows], marker="s",
            color="tab:cyan", label=f"the same net of N=0 ({base:.2f} s)")
    _style(ax, "One apply of N allocations: cost per allocation"
           + (f"\n{_note(doc)}" if _note(doc) else ""), "ms per allocation", xs, logy=False)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def draw(paths: Sequence[str], out_dir: str) -> list[str]:
    """Every figure the given JSON files hold, into ``out_dir``; the paths written.

    Several compare.py files make one pair of figures: the first file's run in full, the
    others faint beside it. Several apply_curve.py files: the last one's curve.
    """
    os.makedirs(out_dir, exist_ok=True)
    docs = [read(p) for p in paths]
    compares = [d for d in docs if d["kind"] == "compare"]
    curves = [d for d in docs if d["kind"] == "apply_curve"]
    written = []
    if compares:
        written.append(scaling(compares, os.path.join(out_dir, SCALING)))
        written.append(noop_plan(compares, os.path.join(out_dir, NOOP_PLAN)))
    if curves:
        written.append(apply_curve(curves[-1], os.path.join(out_dir, APPLY_CURVE)))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="what compare.py / apply_curve.py --json wrote")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "figures"),
                    help="where the PNGs go (default bench/figures)")
    opts = ap.parse_args(argv)
    try:
        for path in draw(opts.json, opts.out_dir):
            print(path)
    except NotBenchJSON as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
