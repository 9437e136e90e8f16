"""Replace-crash soak: SIGKILL `apply --force-replace` of a Docker network with containers
attached, under load, at seeded random steps; the next plain `apply` must reattach them all.

Run as root with the local dockerd and an image that has busybox's ``sleep`` and
``ping`` (tests/support/dockerscratch.py builds ``reconciler-test-busybox:1``):
``python bench/soak_replace.py [--trials 50] [--containers 4] [--allocs 20] [--seed 7]``.
tests/integration/crash/test_crash.py runs a few trials in CI.

One throwaway network namespace is the host (``soak_crash.Host``). Every trial flips
the network's MTU (1400 <-> 1450: Docker cannot change it in place, so it is a replace)
and the allocations between all and half of them, so the killed run has host work
around the replace; the containers ping each other throughout (the load a replace
interrupts). The run is killed (``tests/support/killpoints.py``) just before or
right after one randomly chosen daemon request of the replace: a disconnect, the
removal, the create or a reconnect. Then ``apply`` runs to completion, and with
`docker inspect` (not our observer) every container must be on the network of that
name with the IPv4, IPv6 and aliases it had before the first trial; ``plan`` must be
empty and ``soak_crash.leaks`` find nothing. It prints ``trials / converged /
containers left detached``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.soak_crash import REPO, Config, Host, leaks, sh  # noqa: E402

IMAGE = "reconciler-test-busybox:1"


@dataclass
class ReplaceSummary:
    trials: int = 0
    killed: int = 0  # the kill landed (the others' replace never reached the kill point)
    converged: int = 0
    detached: int = 0  # containers found without the network (or without their addresses)
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        return (f"replace-crash: {self.trials} trials / {self.converged} converged / "
                f"{self.detached} containers left detached")


def write_file(directory: str, prefix: str, network: str, mtu: int, allocs: int,
               half: bool) -> Config:
    ids = [f"{prefix}-a{i}" for i in range(allocs)][: max(1, allocs // 2) if half else allocs]
    lines = ["version: 1", "bridges:", f"  - {{name: {prefix[:13]}b0}}", "subnets:",
             f"  - {{name: {prefix}-net, bridge: {prefix[:13]}b0, cidr: 10.203.0.0/22}}",
             "allocs:" if ids else "allocs: []"]
    lines += [f"  - {{id: {a}, subnet: {prefix}-net}}" for a in ids]
    lines += ["docker_networks:", f"  - {{name: {network}, ipv6: true, mtu: {mtu}}}"]
    path = os.path.join(directory, f"replace-{mtu}-{len(ids)}.yaml")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return Config(path, tuple(ids), (network,))


def docker_json(*args: str) -> Any:
    return json.loads(sh("docker", *args).stdout)


def endpoint(cid: str, network: str) -> tuple[str, str, str, tuple[str, ...]] | None:
    """(network id, IPv4, IPv6, aliases) of the container on ``network``; None: detached."""
    (attrs,) = docker_json("inspect", cid)
    ep = (attrs["NetworkSettings"]["Networks"] or {}).get(network)
    if ep is None:
        return None
    return (ep["NetworkID"], ep["IPAddress"], ep["GlobalIPv6Address"],
            tuple(sorted(set(ep["Aliases"] or []) - {cid[:12]})))


def kill_points(containers: int) -> list[str]:
    points = [f"disconnect:{i}" for i in range(1, containers + 1)] + ["remove:1", "create:1"]
    points += [f"connect:{i}" for i in range(1, containers + 1)]
    return points + [f"{p}:before" for p in points]


def killed_replace(host: Host, spec: str, path: str) -> bool:
    p = subprocess.run([sys.executable, "-m", "tests.support.killpoints", spec,
                        "--netns", host.name, "apply", "--force-replace", path],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    return p.returncode == -signal.SIGKILL


def replace_soak(trials: int, n_containers: int, n_allocs: int, seed: int,
                 image: str = IMAGE, log: Callable[[str], None] = print,
                 prefix: str | None = None) -> ReplaceSummary:
    """Run the trials in one throwaway host with its own network and containers; always
    cleans up."""
    rng = random.Random(seed)
    prefix = prefix or f"rr{secrets.token_hex(2)}"
    network = f"{prefix}-dn"
    workdir = tempfile.mkdtemp(prefix="rt-replace-")
    host = Host(f"{prefix}-host", prefix)
    summary = ReplaceSummary()
    containers: list[str] = []
    t0 = time.monotonic()
    try:
        mtu = 1400
        first = write_file(workdir, prefix, network, mtu, n_allocs, half=False)
        r = host.cli("apply", first.path)
        if r.returncode != 0:
            raise RuntimeError(f"the first apply failed: {r.stderr[-800:]}")
        for i in range(n_containers):
            name = f"{prefix}-c{i}"
            cid = sh("docker", "run", "-d", "--name", name, "--network", network,
                     "--network-alias", f"svc{i}", "--label", f"reconciler-soak={prefix}",
                     image, "sleep", "36000").stdout.strip()
            containers.append(cid)
        before = {c: endpoint(c, network) for c in containers}
        for i, c in enumerate(containers):  # the load: each pings the next, all along
            peer = before[containers[(i + 1) % len(containers)]]
            assert peer is not None
            sh("docker", "exec", "-d", c, "ping", "-i", "0.2", peer[1])
        points = kill_points(n_containers)
        for trial in range(trials):
            mtu = 1450 if mtu == 1400 else 1400
            cfg = write_file(workdir, prefix, network, mtu, n_allocs, half=trial % 2 == 0)
            point = rng.choice(points)
            summary.trials += 1
            summary.killed += killed_replace(host, point, cfg.path)
            again = host.cli("apply", cfg.path)
            plan = host.cli("plan", cfg.path)
            ok = again.returncode == 0 and plan.returncode == 0
            if not ok:
                summary.details.append(f"trial {trial} ({point}): did not converge: "
                                       f"{(again.stderr + plan.stdout)[-800:]}")
            ids = sh("docker", "network", "ls", "-q", "--no-trunc", "--filter",
                     f"name=^{network}$").stdout.split()
            wrong = []
            for c in containers:
                now = endpoint(c, network)
                old = before[c]
                assert old is not None
                if now is None or now[0] not in ids or now[1:3] != old[1:3] \
                        or not set(old[3]) <= set(now[3]):
                    wrong.append(f"{c[:12]}: {now} (was {old})")
            found = leaks(host, cfg)
            summary.converged += ok and not found
            summary.detached += len(wrong)
            summary.details += [f"trial {trial} ({point}): container {w}" for w in wrong]
            summary.details += [f"trial {trial} ({point}): {f}" for f in found]
            log(f"trial {trial + 1}/{trials} {point}: "
                f"{'converged' if ok else 'NOT converged'}, {len(wrong)} detached, "
                f"{len(found)} leaks")
    finally:
        for c in containers:
            sh("docker", "rm", "-f", c, check=False)
        host.remove()
        summary.seconds = time.monotonic() - t0
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--containers", type=int, default=4)
    ap.add_argument("--allocs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--image", default=IMAGE)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root", file=sys.stderr)
        return 1
    s = replace_soak(a.trials, a.containers, a.allocs, a.seed, a.image)
    for d in s.details:
        print(d)
    print(s.line())
    return 0 if s.converged == s.trials and s.detached == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
