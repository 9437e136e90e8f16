"""Where a CLI run's time goes: phase timers around the pipeline, optionally cProfile.

As root, against an existing namespace and file (e.g. one ``scaling.py --keep``
or ``compare.py`` left, or your own):

    python3 bench/profile_cli.py --netns H plan FILE          # phase table
    python3 bench/profile_cli.py --netns H apply FILE --cprofile 25

Runs ``reconciler.cli.main`` in this process with timers wrapped around the
functions the pipeline goes through (inclusive times: nested rows are part of
their parent), after timing the imports the command needs. The host is changed
only as the given command would change it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import os
import pstats
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOTALS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
ORDER: list[str] = []


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if label not in ORDER:
        ORDER.append(label)

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            TOTALS[label] += time.perf_counter() - t0
            CALLS[label] += 1
    return wrapper


def wrap(owner: Any, attr: str, label: str) -> None:
    if hasattr(owner, attr):
        setattr(owner, attr, _timed(label, getattr(owner, attr)))


def instrument() -> float:
    """Import what the CLI imports (timed), then wrap the pipeline's functions."""
    t0 = time.perf_counter()
    from reconciler import planner as planner_pkg
    from reconciler.cli import apply as cli_apply
    from reconciler.cli import commands as cli
    from reconciler.config import load as loader
    from reconciler.domain import plan as plan_mod
    from reconciler.drivers import iptables, sysctl
    from reconciler.drivers.netlink import client as links
    from reconciler.engine import executor, observe, reconcile
    from reconciler.planner import docker, firewall, hostlinks
    from reconciler.planner.allocs import plan as allocs
    imports = time.perf_counter() - t0
    with contextlib.suppress(ImportError):  # the Docker SDK: imported on first use
        t0 = time.perf_counter()
        from reconciler.drivers.docker import client as docker_networks  # noqa: F401
        imports += time.perf_counter() - t0

    wrap(cli, "load_desired", "load")
    wrap(cli_apply, "load_desired", "load")
    wrap(loader, "parse_document", "  parse_document (yaml compose + build)")
    wrap(loader, "validate_schema", "  validate_schema")
    wrap(reconcile.Reconciler, "observe", "observe")
    wrap(links.Netlink, "dump_links", "  host links+addrs (netlink)")
    wrap(iptables.IptablesDriver, "observe", "  iptables-save + parse (per family)")
    wrap(iptables, "parse_save", "    parse_save")
    wrap(sysctl, "read", "  sysctl reads")
    wrap(observe.Observer, "observe_allocs", "  allocation namespaces")
    wrap(links.Netlink, "observe_netns", "    observe_netns")
    wrap(links.Netlink, "peek_lo_alias", "    peek_lo_alias (undeclared ns)")
    wrap(observe, "listening_ports", "  listening ports (/proc/net)")
    wrap(observe.Observer, "observe_docker", "  docker (SDK import + API)")
    wrap(reconcile, "make_plan", "make_plan")
    wrap(hostlinks, "plan_bridge", "  plan_bridge")
    wrap(hostlinks, "plan_subnet", "  plan_subnet")
    wrap(allocs, "plan_allocs", "  plan_allocs")
    wrap(allocs, "assign_addresses", "    assign_addresses")
    wrap(allocs, "assign_ports", "    assign_ports")
    wrap(allocs, "_view", "    _view (observed view per alloc)")
    wrap(firewall, "owner_of", "      firewall.owner_of")
    wrap(hostlinks, "annotate_rules", "  annotate_rules")
    wrap(docker, "plan_docker_networks", "  plan_docker_networks")
    wrap(firewall, "diff", "  firewall.diff")
    wrap(planner_pkg, "fingerprint", "  fingerprint")
    wrap(plan_mod, "fingerprint", "  fingerprint")
    wrap(executor.Executor, "execute", "execute")
    wrap(reconcile.Reconciler, "verify", "verify (observe + plan again)")
    wrap(cli_apply, "render_text", "render_text")
    return imports


def wrap_ops() -> None:
    """Time each op kind the executor runs."""
    from reconciler.engine.hostops import HostOps

    orig = HostOps.run

    def run(self: Any, op: Any) -> None:
        label = f"  op {op.name}"
        if label not in ORDER:
            ORDER.append(label)
        t0 = time.perf_counter()
        try:
            orig(self, op)
        finally:
            TOTALS[label] += time.perf_counter() - t0
            CALLS[label] += 1
    HostOps.run = run  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--netns", required=True, metavar="NAME")
    ap.add_argument("--src", metavar="DIR",
                    help="import the reconciler package from DIR instead (A/B of a patched copy)")
    ap.add_argument("--cprofile", type=int, metavar="N", default=0,
                    help="also print the top N functions by own time and by cumulative time")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="plan FILE | apply FILE | destroy")
    opts = ap.parse_args(argv)
    if opts.src:
        sys.path.insert(0, str(Path(opts.src).resolve()))
    t_start = time.perf_counter()
    # Enter first, like the CLI: the Docker SDK must not start threads before setns.
    from reconciler.drivers import netns
    netns.enter_process_netns(opts.netns)
    imports = instrument()
    wrap_ops()
    from reconciler.cli import commands as cli

    prof = cProfile.Profile() if opts.cprofile else None
    sink = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sink):
        if prof:
            prof.enable()
        rc = cli.main(list(opts.args))
        if prof:
            prof.disable()
    run = time.perf_counter() - t0
    total = time.perf_counter() - t_start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{' '.join(opts.args)} in {opts.netns}: exit {rc}, {total:.3f} s in-process "
          f"(+ interpreter start-up), peak RSS {rss:.0f} MB"
          + (" — cProfile on: times inflated" if prof else ""))
    print(f"{'phase (inclusive)':<44} {'seconds':>9} {'% run':>6} {'calls':>8}")
    print(f"{'imports (cli, loader, planner, drivers)':<44} {imports:9.3f} "
          f"{imports / total * 100:5.1f}% {'':>8}")
    for label in ORDER:
        if CALLS.get(label):
            print(f"{label:<44} {TOTALS[label]:9.3f} {TOTALS[label] / total * 100:5.1f}% "
                  f"{CALLS[label]:8d}")
    # verify's own observe/make_plan calls are counted in those rows already
    rest = run - sum(TOTALS[x] for x in ORDER if not x.startswith((" ", "verify")))
    print(f"{'rest of the command':<44} {rest:9.3f}")
    if prof:
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(opts.cprofile)
            text = out.getvalue()
            print(text[text.find("   ncalls"):].replace(str(Path(sys.prefix)), "<py>")
                  .replace(os.getcwd() + "/", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
