"""How big the output of a plan, an apply and a destroy is at a few hundred allocations.

As root: ``python3 bench/plan_output.py [--n 320] [--keep-dir DIR]``

In a throwaway host namespace: N allocations spread over 4 bridges and subnets
(IPv4 and IPv6), each with a tcp port map and a tcp+udp one, ten of them on a
floating ``host_ip`` (a plan warning each, until the address is added before the
apply); then

- ``plan`` of the create (text and JSON);
- ``apply`` of it;
- a 2-change edit (the host port of one map of two allocations) planned, and
  applied with ``--output json``;
- a bridge MTU change planned (every allocation on the bridge is touched);
- ``destroy --yes``.

It prints, per output: lines, the longest line and bytes (SPEC §13: no text line
over about 200 characters). ``RECONCILER_BENCH_SRC`` runs another tree (the
before/after of a change); ``--keep-dir`` keeps every output for reading.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Sandbox, cli_supports  # noqa: E402

BRIDGES = ("apps", "db", "web", "batch")
FLOATING = "192.0.2.10"  # TEST-NET-1: never an address of the sandbox


def desired(n: int, prefix: str, *, mtu: int = 1500, edits: int = 0) -> str:
    """N allocs over the bridges; ``edits``: the first so many move their tcp map's host port."""
    lines = ["version: 1", "bridges:"]
    lines += [f"  - {{name: {prefix}{b}, mtu: {mtu if b == 'apps' else 1500}}}"
              for b in BRIDGES]
    lines.append("subnets:")
    for k, b in enumerate(BRIDGES):
        lines += [f"  - name: {b}", f"    bridge: {prefix}{b}",
                  f"    cidr: 10.{90 + k}.0.0/16", f"    cidr6: fd00:{90 + k}::/64"]
    lines.append("allocs:")
    for i in range(n):
        host = 20000 + i + (5000 if i < edits else 0)
        ip = f", host_ip: {FLOATING}" if i % max(1, n // 10) == 0 and i // max(1, n // 10) < 10 \
            else ""
        lines += [f"  - id: {prefix}-{i}", f"    subnet: {BRIDGES[i % len(BRIDGES)]}",
                  "    ports:", f"      - {{host: {host}, to: 80{ip}}}",
                  f"      - {{host: {40000 + i}, to: 53, protocol: both}}"]
    return "\n".join(lines) + "\n"


def measure(text: str) -> str:
    lines = text.splitlines()
    longest = max((len(x) for x in lines), default=0)
    return f"{len(lines):>6} lines, longest {longest:>6}, {len(text.encode()):>9} bytes"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=320)
    ap.add_argument("--keep-dir", help="write every output here")
    opts = ap.parse_args(argv)
    if opts.n > 5000:
        ap.error("at most 5000 allocations (20000 + N host ports below 25000)")
    keep = Path(opts.keep_dir) if opts.keep_dir else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    print(f"load {os.getloadavg()[0]:.2f}, N={opts.n}, tree "
          f"{os.environ.get('RECONCILER_BENCH_SRC', 'this checkout')}")
    results: list[tuple[str, str]] = []

    def record(label: str, text: str) -> None:
        results.append((label, measure(text)))
        print(f"{label:<34} {results[-1][1]}", flush=True)
        if keep:
            (keep / (label.replace(" ", "_").replace("/", "_") + ".txt")).write_text(text)

    with Sandbox("rpo") as sb:
        n = opts.n
        full = sb.write("full.yaml", desired(n, sb.prefix))
        edit = sb.write("edit.yaml", desired(n, sb.prefix, edits=2))
        mtu = sb.write("mtu.yaml", desired(n, sb.prefix, mtu=1400))
        ok = (0, 2)
        record("plan (create) text", sb.cli("plan", full, ok=ok).stdout)
        record("plan (create) json", sb.cli("--output", "json", "plan", full, ok=ok).stdout)
        # the floating address arrives: the probes of its maps can pass
        subprocess.run(["ip", "-n", sb.host, "addr", "add", f"{FLOATING}/32", "dev", "lo"],
                       check=True)
        record("apply (create) text", sb.cli("apply", full).stdout)
        record("plan (2 port edits) text", sb.cli("plan", edit, ok=ok).stdout)
        record("plan (2 port edits) json", sb.cli("--output", "json", "plan", edit,
                                                  ok=ok).stdout)
        record("apply (2 port edits) json", sb.cli("--output", "json", "apply", edit).stdout)
        if cli_supports("apply", "--probes"):
            record("apply (2 back) json --probes all",
                   sb.cli("--output", "json", "apply", full, "--probes", "all").stdout)
        else:
            sb.cli("apply", full)
        record("plan (mtu apps) text", sb.cli("plan", mtu, ok=ok).stdout)
        record("plan (mtu apps) text -v", sb.cli("-v", "plan", mtu, ok=ok).stdout)
        if cli_supports("plan", "--compact"):
            record("plan (mtu apps) --compact", sb.cli("plan", "--compact", mtu, ok=ok).stdout)
        record("destroy --yes text", sb.cli("destroy", "--yes").stdout)
    print(f"load {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
