"""Benchmark: ensure N Docker networks through our driver vs kind's way.

kind runs one ``docker`` CLI process per step. Per network its ensureNetwork
does: ``network ls --filter name=^X$`` (duplicates?), ``network inspect
bridge`` (MTU), ``network create -d=bridge -o ...masquerade -o ...mtu --ipv6
--subnet <ULA> X``, then ``network ls`` again (duplicates after create). When
the network already exists only the first ``ls`` runs. Our driver does the same
through the SDK in one process, reading the default MTU once.

Phases, each timed over all N networks: create, ensure again (no-op), remove
(kind itself never removes; its equivalent is one ``docker network rm`` each).
Each run uses fresh networks under a unique prefix; the median of the runs is
reported. Everything created is removed at the end, even on failure or ^C.

    python3 bench/docker_networks.py [--n 20] [--runs 5]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker  # noqa: E402

from reconciler.domain.docker import ula_subnet
from reconciler.domain.model import (
    DockerNetwork,  # noqa: E402
    DockerNetworkName,
)
from reconciler.drivers.docker.client import DockerDriver  # noqa: E402

PHASES = ("create", "ensure again (no-op)", "remove")


def docker_cli(*args: str) -> str:
    return subprocess.run(["docker", *args], check=True, capture_output=True, text=True).stdout


def kind_ensure(name: str) -> None:
    """kind's ensureNetwork, one CLI process per step (no probing needed here)."""
    if docker_cli("network", "ls", f"--filter=name=^{name}$", "--format={{.ID}}").strip():
        return  # exists (single network): kind is done
    out = docker_cli("network", "inspect", "bridge", "-f",
                     '{{ index .Options "com.docker.network.driver.mtu" }}').strip()
    args = ["network", "create", "-d=bridge",
            "-o", "com.docker.network.bridge.enable_ip_masquerade=true"]
    if out.isdigit() and int(out) > 0:
        args += ["-o", f"com.docker.network.driver.mtu={out}"]
    args += ["--ipv6", "--subnet", str(ula_subnet(name, 0)), name]
    docker_cli(*args)
    docker_cli("network", "ls", f"--filter=name=^{name}$", "--format={{.ID}}")


def kind_remove(name: str) -> None:
    docker_cli("network", "rm", name)


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_kind(names: list[str]) -> dict[str, float]:
    return {
        "create": timed(lambda: [kind_ensure(n) for n in names] and None),
        "ensure again (no-op)": timed(lambda: [kind_ensure(n) for n in names] and None),
        "remove": timed(lambda: [kind_remove(n) for n in names] and None),
    }


def run_ours(names: list[str]) -> dict[str, float]:
    specs = [DockerNetwork(name=DockerNetworkName(n), ipv6=True) for n in names]
    driver = DockerDriver()

    def ensure_all() -> None:
        mtu = driver.default_mtu()
        for s in specs:
            driver.ensure(s, mtu)

    try:
        return {
            "create": timed(ensure_all),
            "ensure again (no-op)": timed(ensure_all),
            "remove": timed(lambda: [driver.remove(n) for n in names] and None),
        }
    finally:
        driver.close()


def cleanup(client: docker.DockerClient, prefix: str) -> int:
    removed = 0
    for net in client.api.networks(filters={"name": prefix}):
        if net["Name"].startswith(prefix):
            try:
                client.api.remove_network(net["Id"])
                removed += 1
            except docker.errors.NotFound:
                pass
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="networks per run (default 20)")
    ap.add_argument("--runs", type=int, default=5, help="runs per side (default 5)")
    opts = ap.parse_args(argv)
    if opts.n > 25:
        ap.error("--n above 25 risks exhausting Docker's default IPv4 pools (30 networks)")

    client = docker.from_env(timeout=30)
    prefix = f"rtbd-{secrets.token_hex(3)}"
    results: dict[str, dict[str, list[float]]] = {
        side: {p: [] for p in PHASES} for side in ("kind", "ours")}
    try:
        for run in range(opts.runs):
            # alternate the order so neither side always runs on a warmer daemon
            sides = ("kind", "ours") if run % 2 == 0 else ("ours", "kind")
            for side in sides:
                names = [f"{prefix}-{side}{run}-{i:02d}" for i in range(opts.n)]
                try:
                    got = run_kind(names) if side == "kind" else run_ours(names)
                finally:
                    cleanup(client, f"{prefix}-{side}{run}-")
                for phase, seconds in got.items():
                    results[side][phase].append(seconds)
            print(f"run {run + 1}/{opts.runs} done", file=sys.stderr)
    finally:
        leaked = cleanup(client, prefix)
        client.close()
        if leaked:
            print(f"cleanup removed {leaked} leftover network(s)", file=sys.stderr)

    title = f"N={opts.n} networks, median of {opts.runs} runs"
    print(f"\n{title}")
    print(f"{'phase':<22} {'kind (docker CLI)':>25} {'reconciler (SDK)':>25} {'ratio':>7}")
    for phase in PHASES:
        k = statistics.median(results["kind"][phase])
        o = statistics.median(results["ours"][phase])
        cells = [f"{k:.3f} s ({k / opts.n * 1000:.1f} ms/net)",
                 f"{o:.3f} s ({o / opts.n * 1000:.1f} ms/net)"]
        print(f"{phase:<22} {cells[0]:>25} {cells[1]:>25} {k / o:>6.1f}x")
    print("ratio = kind time / reconciler time (above 1: we are faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
