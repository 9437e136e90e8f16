"""Crash consistency: SIGKILL the reconciler at seeded random points, then converge.

Run as root (it uses a throwaway network namespace as "the host" and the local
dockerd): ``python bench/soak_crash.py [--trials 50] [--allocs 200]
[--networks 5] [--seed 7]``. tests/integration/crash/test_crash.py runs a few small
trials of the same engine in CI.

Each trial runs ``python -m reconciler -v --netns H <cmd>`` as a subprocess and
kills it with SIGKILL after a seeded random number of applied changes (plus a
random few milliseconds, to land inside an op), or during start-up. The
commands cycle through: apply everything (creation), apply half of it
(pruning), destroy (teardown). Then the same command runs again to
completion and the host is checked with system tools, not our observer:

* the run converged: ``plan`` exits 0;
* no host veth ``vr…`` without its declared, mounted namespace, and no
  declared namespace without its veth and ``eth0``;
* no namespace under a declared id (or our prefix) that is unmounted, unmarked
  or undeclared;
* no DNAT rule for an allocation that is not declared;
* no temporary ``rcltmp*`` bridge;
* no Docker network with our label and this sandbox's scope that is not
  declared, and each declared one exists exactly once.

It prints ``trials / converged / leaks``. Everything is removed at the end,
also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK_ALIAS = "managed-by=reconciler"  # reconciler.ownership, restated: checks stay independent
DOCKER_LABEL = "io.reconciler.managed"
SCOPE_LABEL = "io.reconciler.scope"
KINDS = ("apply-all", "apply-half", "destroy")
#: a kill between creating /run/netns/X and mounting the namespace on it (or between
#: unmounting and unlinking it) leaves an empty file; its xattr tag lets the next run remove it
EMPTY_FILE = "an empty file, not a namespace"


def sh(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check,
                          timeout=timeout)


def veth_name(alloc_id: str) -> str:
    return "vr" + hashlib.sha1(alloc_id.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Config:
    """One desired state of the soak, and what it declares."""

    path: str
    allocs: tuple[str, ...]
    networks: tuple[str, ...]


def write_config(directory: str, prefix: str, n_allocs: int, n_networks: int,
                 fraction: float = 1.0, name: str = "state.yaml") -> Config:
    """A bridge, a subnet, ``n_allocs`` allocations (every 4th with port maps) and networks."""
    allocs = [f"{prefix}-a{i}" for i in range(n_allocs)][: max(1, int(n_allocs * fraction))]
    networks = [f"{prefix}-d{i}" for i in range(n_networks)][: max(1, int(n_networks * fraction))]
    lines = ["version: 1", "bridges:", f"  - {{name: {prefix[:13]}b0, mtu: 1500}}", "subnets:",
             f"  - {{name: {prefix}-net, bridge: {prefix[:13]}b0, cidr: 10.201.0.0/20}}",
             "allocs:"]
    for i, a in enumerate(allocs):
        ports = f", ports: [{{host: {20000 + i}, to: 80}}, {{host: auto, to: 81}}]" \
            if i % 4 == 0 else ""
        lines.append(f"  - {{id: {a}, subnet: {prefix}-net{ports}}}")
    if networks:
        lines.append("docker_networks:")
        lines += [f"  - {{name: {n}, labels: {{soak: crash}}}}" for n in networks]
    path = os.path.join(directory, name)
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return Config(path, tuple(allocs), tuple(networks))


EMPTY = Config("", (), ())


class Host:
    """A throwaway network namespace acting as the host."""

    def __init__(self, name: str, prefix: str) -> None:
        self.name = name
        self.prefix = prefix
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        self.inode = os.stat(f"/run/netns/{name}").st_ino

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "reconciler", "--netns", self.name, *args],
                              capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def remove(self) -> None:
        """Destroy what the reconciler made (allocation namespaces are global), then the host."""
        try:
            self.cli("destroy", "--yes", "--lock-timeout", "30", timeout=600)
        finally:
            for n in os.listdir("/run/netns"):
                if n.startswith(f"{self.prefix}-a"):
                    sh("ip", "netns", "del", n, check=False)
            scope = f"label={SCOPE_LABEL}=netns/{self.name}"
            ids = sh("docker", "network", "ls", "-q", "--filter", scope, check=False).stdout
            for nid in ids.split():
                sh("docker", "network", "rm", nid, check=False)
            sh("ip", "netns", "del", self.name, check=False)

    def ip_json(self, *args: str, ns: str | None = None) -> list[dict]:  # type: ignore[type-arg]
        out = sh("ip", "-n", ns or self.name, "-j", "-d", *args, check=False).stdout
        return json.loads(out) if out.strip() else []


def _mounted_netns() -> set[str]:
    with open("/proc/self/mountinfo") as fh:
        return {ln.split()[4].rsplit("/", 1)[1] for ln in fh
                if ln.split()[4].startswith("/run/netns/")}


def leaks(host: Host, cfg: Config) -> list[str]:
    """Every leaked or half-made object, checked with ip, iptables-save and docker."""
    found: list[str] = []
    declared = set(cfg.allocs)
    links = host.ip_json("link", "show")
    veths = {lk["ifname"] for lk in links if lk.get("linkinfo", {}).get("info_kind") == "veth"
             and lk["ifname"].startswith("vr")}
    want_veths = {veth_name(a) for a in declared}
    found += [f"veth {v} without a declared namespace" for v in sorted(veths - want_veths)]
    found += [f"veth {v} missing" for v in sorted(want_veths - veths)]
    found += [f"temporary bridge {lk['ifname']}" for lk in links
              if lk["ifname"].startswith("rcltmp")]
    mounted = _mounted_netns()
    # alloc-of=<inode>-<cookie> (the cookie where the kernel gives one, 5.14 and later)
    mark = re.compile(rf"{re.escape(LINK_ALIAS)} alloc-of={host.inode}(-\d+)?")
    present = {n for n in os.listdir("/run/netns")
               if n.startswith(host.prefix) and n != host.name}
    found += [f"namespace {n} not declared" + ("" if n in mounted else f" ({EMPTY_FILE})")
              for n in sorted(present - declared)]
    for a in sorted(declared):
        if a not in present:
            found.append(f"namespace {a} missing")
            continue
        if a not in mounted:
            found.append(f"namespace {a} is an unmounted file")
            continue
        inside = {lk["ifname"]: lk for lk in host.ip_json("link", "show", ns=a)}
        if not mark.fullmatch(inside.get("lo", {}).get("ifalias") or ""):
            found.append(f"namespace {a} is not marked as ours")
        if "eth0" not in inside:
            found.append(f"namespace {a} has no eth0")
    dnat = sh("ip", "netns", "exec", host.name, "iptables-save", "-t", "nat").stdout
    owners = {ln.split("reconciler:alloc=", 1)[1].split()[0].strip('"') for ln in dnat.splitlines()
              if "reconciler:alloc=" in ln}
    found += [f"DNAT rule of undeclared alloc {o}" for o in sorted(owners - declared)]
    ls = sh("docker", "network", "ls", "--filter", f"label={DOCKER_LABEL}", "--filter",
            f"label={SCOPE_LABEL}=netns/{host.name}", "--format", "{{.Name}}").stdout.split()
    found += [f"docker network {n} not declared" for n in sorted(set(ls) - set(cfg.networks))]
    found += [f"docker network {n} exists {ls.count(n)} times" for n in cfg.networks
              if ls.count(n) != 1]
    return found


@dataclass
class Summary:
    trials: int = 0
    killed: int = 0  # killed mid-run (the others finished before the kill point)
    converged: int = 0
    leaks: int = 0
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        return (f"trials {self.trials} / converged {self.converged} / leaks {self.leaks} "
                f"({self.killed} killed mid-run, {self.seconds:.0f}s)")


def killed_run(host: Host, args: list[str], changes: int, rng: random.Random) -> bool:
    """Start ``reconcile -v … args`` and SIGKILL it at a random point; True if it was killed."""
    after = rng.randint(0, changes)  # applied changes to wait for (0: during start-up)
    jitter = rng.uniform(0.0, 0.03)
    p = subprocess.Popen([sys.executable, "-m", "reconciler", "-v", "--netns", host.name, *args],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert p.stderr is not None
    try:
        if after == 0:
            time.sleep(rng.uniform(0.1, 0.8))
        else:
            seen = 0
            for line in p.stderr:
                if line.startswith("INFO "):
                    seen += 1
                    if seen >= after:
                        break
            time.sleep(jitter)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=120)
        p.stderr.close()
    return p.returncode == -signal.SIGKILL


def soak(trials: int, n_allocs: int, n_networks: int, seed: int,
         log: Callable[[str], None] = print, prefix: str | None = None) -> Summary:
    """Run the trials in one throwaway host; always cleans up."""
    rng = random.Random(seed)
    prefix = prefix or f"rk{secrets.token_hex(2)}"
    workdir = tempfile.mkdtemp(prefix="rt-crash-")
    full = write_config(workdir, prefix, n_allocs, n_networks)
    half = write_config(workdir, prefix, n_allocs, n_networks, 0.5, "half.yaml")
    host = Host(f"{prefix}-host", prefix)
    summary = Summary()
    t0 = time.monotonic()
    try:
        state = EMPTY
        for trial in range(trials):
            kind = KINDS[trial % len(KINDS)]
            cfg, args = {"apply-all": (full, ["apply", full.path]),
                         "apply-half": (half, ["apply", half.path]),
                         "destroy": (EMPTY, ["destroy", "--yes"])}[kind]
            changes = len(set(cfg.allocs) ^ set(state.allocs)) + 6
            summary.trials += 1
            summary.killed += killed_run(host, args, changes, rng)
            again = host.cli(*args)
            plan = host.cli("plan", cfg.path) if cfg.path else host.cli("destroy", "--dry-run")
            ok = again.returncode == 0 and plan.returncode == 0
            if not ok:
                summary.details.append(f"trial {trial} ({kind}): did not converge: "
                                       f"{(again.stderr + plan.stdout)[-800:]}")
            found = leaks(host, cfg)
            summary.converged += ok
            summary.leaks += len(found)
            summary.details += [f"trial {trial} ({kind}): {f}" for f in found]
            log(f"trial {trial + 1}/{trials} {kind}: {'converged' if ok else 'NOT converged'}, "
                f"{len(found)} leaks" + "".join(f"\n  {f}" for f in found))
            state = cfg
    finally:
        host.remove()
        summary.seconds = time.monotonic() - t0
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--allocs", type=int, default=200)
    ap.add_argument("--networks", type=int, default=5)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root", file=sys.stderr)
        return 1
    s = soak(a.trials, a.allocs, a.networks, a.seed)
    for d in s.details:
        print(d)
    print(s.line())
    return 0 if s.converged == s.trials and s.leaks == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
