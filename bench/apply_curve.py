"""Cost per allocation of ``reconcile apply`` as N grows, with the multicast the bridges saw.

As root: ``python3 bench/apply_curve.py [--n 250 500 1000 2000] [--runs 1] [--ipv6] [--ports 2]``

For each N, in a throwaway host namespace (bench/_harness.py ``Sandbox``):
one ``reconcile apply --no-probe`` of N allocations from nothing (``--ports`` tcp port
maps each, default 2 as in the other benchmarks; ``--ipv6``: dual-stack
subnets). A Linux bridge takes at most 1,023 ports (the loader refuses more,
``MAX_BRIDGE_PORTS``), so allocations are put 1,000 to a bridge: N ≤ 1000 is
one bridge and one /16, N = 2000 is two bridges and two /16s.

Printed side by side per N: wall time of the apply (one ``python -m
reconciler`` process, interpreter start-up included), cost per alloc, the
same net of the apply of the file with no allocations (bridges and subnets
only: the constant), each as a ratio to the smallest N; the multicast frames
the bridges received during the apply (``rx multicast`` of ``ip -s -j link``:
every DAD probe, MLD report or router solicitation an allocation or host
veth sends is flooded to the bridge too); and a census taken after the
timing with ``ip -j``: allocations whose ``eth0`` has an IPv6 link-local
address, and host veths with one. Load (``/proc/loadavg``) is printed
before and after each apply: the machine is shared, compare within one run.
After each run the script waits (up to 60 s) until the kernel has destroyed
the sandbox's namespaces (``net_namespace`` in /proc/slabinfo back to what
it was before the run), which it does in the background, under the RTNL
lock, for seconds: the next run must not compete with that.

Everything is removed afterwards (the sandbox's ``reconcile destroy``, then
the namespaces). ``RECONCILER_BENCH_SRC`` is not needed for an A/B: run this
file from the checkout to measure (the CLI runs with that checkout's code).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Sandbox, cli_supports  # noqa: E402

PER_BRIDGE = 1000  # < 1,023, the most ports a Linux bridge takes


def curve_yaml(n: int, prefix: str, *, ipv6: bool, ports: int, groups: int) -> str:
    """``groups`` bridges/subnets (``rcbr<k>``, 10.<100+k>.0.0/16), allocs 1000 to a bridge."""
    lines = ["version: 1", "bridges:"]
    lines += [f"  - name: rcbr{k}" for k in range(groups)]
    lines.append("subnets:")
    for k in range(groups):
        lines += [f"  - name: rc-net{k}", f"    bridge: rcbr{k}",
                  f"    cidr: 10.{100 + k}.0.0/16"]
        if ipv6:
            lines.append(f"    cidr6: fd00:5ca1:{k:x}::/64")
    if n:
        lines.append("allocs:")
    for i in range(n):
        lines += [f"  - id: {prefix}-{i}", f"    subnet: rc-net{i // PER_BRIDGE}"]
        if ports:
            lines.append("    ports:")
            lines += [f"      - {{host: {20000 + ports * i + p}, to: {80 + p}}}"
                      for p in range(ports)]
    return "\n".join(lines) + "\n"


def live_namespaces() -> int | None:
    """Network namespaces the kernel still holds (active ``net_namespace`` slab objects)."""
    try:
        with open("/proc/slabinfo") as fh:
            for line in fh:
                if line.startswith("net_namespace "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def settle(baseline: int | None, timeout: float = 60.0) -> float:
    """Wait until the kernel holds no more namespaces than ``baseline`` (+8); seconds waited.

    ``ip netns del`` returns at once and the kernel destroys namespaces (and
    their veths, under the RTNL lock) in the background for seconds after a
    big sandbox: a run started meanwhile would compete with that cleanup.
    """
    t0 = time.monotonic()
    while baseline is not None and time.monotonic() - t0 < timeout:
        live = live_namespaces()
        if live is None or live <= baseline + 8:
            break
        time.sleep(0.2)
    return time.monotonic() - t0


def loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def bridge_multicast(host: str) -> dict[str, int]:
    """rx multicast frames of each bridge in ``host`` (``ip -s -j link``)."""
    out = subprocess.run(["ip", "-n", host, "-s", "-j", "-d", "link", "show", "type", "bridge"],
                         capture_output=True, text=True, check=True).stdout
    return {lk["ifname"]: int(lk["stats64"]["rx"]["multicast"]) for lk in json.loads(out or "[]")}


def link_local_census(host: str, allocs: list[str]) -> tuple[int, int, int]:
    """(allocs whose eth0 has an fe80:: address, host veths with one, bridges with one)."""
    def has_ll(ns: str, *dev: str) -> list[str]:
        out = subprocess.run(["ip", "-n", ns, "-j", "-6", "addr", "show", *dev, "scope", "link"],
                             capture_output=True, text=True, check=False).stdout
        return [lk["ifname"] for lk in json.loads(out or "[]") if lk.get("addr_info")]

    inside = sum(1 for a in allocs if has_ll(a, "dev", "eth0"))
    names = has_ll(host)
    return (inside, sum(1 for n in names if n.startswith("vr")),
            sum(1 for n in names if n.startswith("rcbr")))


@dataclass(frozen=True)
class Run:
    n: int
    seconds: float
    multicast: int
    ll_allocs: int
    ll_veths: int
    ll_bridges: int
    load_before: str
    load_after: str


def one(n: int, *, ipv6: bool, ports: int, census: bool, timeout: float) -> Run:
    groups = max(1, -(-n // PER_BRIDGE))
    baseline = live_namespaces()
    try:
        return _one(n, groups, ipv6=ipv6, ports=ports, census=census, timeout=timeout)
    finally:
        # the next run must not compete with the kernel destroying this one's namespaces
        waited = settle(baseline)
        if waited > 1:
            print(f"N={n}: waited {waited:.1f} s for its namespaces to go", file=sys.stderr)


def _one(n: int, groups: int, *, ipv6: bool, ports: int, census: bool, timeout: float) -> Run:
    with Sandbox("rcc") as sb:
        path = sb.write("allocs.yaml", curve_yaml(n, sb.prefix, ipv6=ipv6, ports=ports,
                                                  groups=groups))
        before = loadavg()
        # probes off, like for like with the CNI chain (bench/compare.py does the same)
        probes = cli_supports("apply", "--no-probe")
        res = sb.cli("apply", path, *(("--no-probe",) if probes else ()), timeout=timeout)
        after = loadavg()
        mc = sum(bridge_multicast(sb.host).values())
        ll = (link_local_census(sb.host, [f"{sb.prefix}-{i}" for i in range(n)])
              if census else (-1, -1, -1))
        return Run(n, res.seconds, mc, *ll, before, after)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[250, 500, 1000, 2000])
    ap.add_argument("--runs", type=int, default=1, help="runs per N; median (default 1)")
    ap.add_argument("--ipv6", action="store_true", help="dual-stack subnets (cidr6)")
    ap.add_argument("--ports", type=int, default=2, help="tcp port maps per alloc (default 2)")
    ap.add_argument("--no-census", action="store_true",
                    help="skip counting link-local addresses after each apply")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", metavar="FILE", help="also write the rows here (bench/plots.py)")
    ap.add_argument("--plot", metavar="DIR",
                    help="also draw apply-curve.png (needs matplotlib) into DIR; needs --json")
    opts = ap.parse_args(argv)
    if opts.plot and not opts.json:
        ap.error("--plot draws from the JSON: give --json FILE too")
    # killed (timeout, kill PID): leave through the sandboxes' clean-up, not around it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = sorted(set(opts.n))
    if sizes[-1] > 10 * PER_BRIDGE or opts.ports * sizes[-1] > 40000:
        ap.error("at most 10,000 allocations and 40,000 port maps")
    kw = {"ipv6": opts.ipv6, "ports": opts.ports, "timeout": opts.timeout}
    base = statistics.median(one(0, census=False, **kw).seconds  # type: ignore[arg-type]
                             for _ in range(opts.runs))
    print(f"N=0 (bridges and subnets only): {base:.2f} s", file=sys.stderr)
    rows: list[Run] = []
    for n in sizes:
        runs = []
        for r in range(opts.runs):
            runs.append(one(n, census=not opts.no_census, **kw))  # type: ignore[arg-type]
            x = runs[-1]
            print(f"N={n} run {r + 1}: {x.seconds:.2f} s, {x.multicast} multicast frames, "
                  f"load {x.load_before} -> {x.load_after}", file=sys.stderr)
        runs.sort(key=lambda x: x.seconds)
        rows.append(runs[len(runs) // 2])
    stack = "dual stack" if opts.ipv6 else "IPv4 only"
    print(f"\napply from nothing, {stack}, {opts.ports} tcp port map(s) per alloc, "
          f"{PER_BRIDGE} allocs per bridge; median of {opts.runs} run(s); "
          f"N=0 apply {base:.2f} s")
    print(f"{'N':>5} {'bridges':>7} {'apply':>8} {'ms/alloc':>9} {'ratio':>6} "
          f"{'net ms/alloc':>12} {'ratio':>6} {'multicast rx':>12} {'LL allocs':>9} "
          f"{'LL veths':>8} {'LL bridges':>10}  load before -> after")
    first = rows[0]
    for x in rows:
        per = x.seconds / x.n * 1000
        net = max(x.seconds - base, 0.0) / x.n * 1000
        per0 = first.seconds / first.n * 1000
        net0 = max(first.seconds - base, 1e-9) / first.n * 1000
        print(f"{x.n:>5} {max(1, -(-x.n // PER_BRIDGE)):>7} {x.seconds:>6.2f} s {per:>9.2f} "
              f"{per / per0:>6.2f} {net:>12.2f} {net / net0:>6.2f} {x.multicast:>12} "
              f"{x.ll_allocs:>9} {x.ll_veths:>8} {x.ll_bridges:>10}  "
              f"{x.load_before} -> {x.load_after}")
    if opts.json:
        write_json(opts.json, rows, base, runs=opts.runs, ipv6=opts.ipv6, ports=opts.ports)
    if opts.plot:
        import plots
        for path in plots.draw([opts.json], opts.plot):
            print(f"drew {path}")
    return 0


def write_json(path: str, rows: list[Run], base: float, **options: object) -> None:
    """The medians per N, as bench/plots.py reads them back."""
    from compare import meta
    with open(path, "w") as fh:
        json.dump({"kind": "apply_curve", "meta": meta(), "options": options,
                   "base_seconds": base, "rows": [dataclasses.asdict(r) for r in rows]},
                  fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
