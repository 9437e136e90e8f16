"""Lifetime soak: seeded random rounds of what a host lives through, probed after each.

Run as root: ``python bench/lifetime.py [--rounds 300] [--seed N] [--no-docker]``
(``RECONCILER_SOAK=1`` makes the default 300 rounds; without it, 30). The bounded
version runs in CI: tests/integration/lifetime/test_soak.py.

The sandbox (bench/_lifetime_host.py) is a network namespace of its own with its own
``RECONCILER_STATE_DIR`` and a private dockerd, so nothing here touches the machine's
host networking, /var/lib/reconciler or dockerd. It declares bridges and subnets
(``cidr: auto``, ``cidr6: auto``), allocations (each with a ``host: auto`` port map)
and Docker networks (``subnet: auto``), and a ``reconcile watch`` agent keeps them.
Each round is one of:

* ``reboot``: the agent killed, dockerd stopped, every namespace and link of the soak
  deleted; the state directory, the files and dockerd's data kept; the host namespace
  made again, dockerd and the agent started;
* ``agent-kill``: the agent SIGKILLed, an allocation's veth deleted while it is down,
  the agent started again;
* ``dockerd-restart``: the private dockerd stopped and started;
* ``conflict``: a foreign bridge taking a newly declared bridge's name, or a foreign
  route over a live subnet, together with drift elsewhere (a veth deleted, an
  allocation added on another subnet); the unrelated drift must heal while the conflict
  stands; then the conflict is removed and everything must heal;
* ``edit``: the files edited: an allocation, a subnet or a Docker network added with
  a name that sorts first, one removed, or an allocation renamed.

After each round: everything declared is present (heal time per event kind), ``reconcile
verify`` exits 0, a port map answers from the host's loopback and from another
allocation (a listener inside the allocation), and every identity is read back with
``ip -j``, ``nft -j`` and ``docker network inspect``: the IPv4/IPv6 address and
MAC of each allocation, its auto port, the auto prefixes of subnets and Docker networks.
A value that differs from the one first seen, for a resource declared ever since, is an
identity moved (one removed and declared again later under the same name is a new
one). Prints ``[figures]`` lines; exits 1 when an invariant breaks. Why it reads the
host and not the state directory, and the other choices:
docs/decisions/051-lifetime-soak-reads-the-host.md; what it found: docs/lifetime.md.
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import math
import os
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _lifetime_host import Sandbox, Snapshot, sh  # noqa: E402

KINDS = ("reboot", "agent-kill", "dockerd-restart", "conflict", "edit")
WEIGHTS = (2, 2, 1, 1, 3)
#: the opening's fixed variants, counted under their kind
ALIASES = {"add-first": "edit", "conflict-bridge": "conflict"}
#: how long any heal may take before the round fails (event-driven heals take ~1 s)
HEAL_DEADLINE = 40.0
#: how long drift unrelated to a standing conflict may take to heal before the round
#: counts as "blocked by an unrelated resource" (the agent's resync interval is below it)
UNRELATED_DEADLINE = 12.0
INTERVAL = 5.0
BASE = 5000


@dataclass
class Desired:
    """The files' content: subnet (and its bridge) numbers, allocations, networks."""

    prefix: str
    pool: int  # second octet of the pools
    subnets: list[int] = field(default_factory=list)
    allocs: dict[int, int] = field(default_factory=dict)  # alloc number -> subnet number
    networks: list[int] = field(default_factory=list)

    def sub(self, n: int) -> str:
        return f"{self.prefix}-s{n:04d}"

    def bridge(self, n: int) -> str:
        return f"{self.prefix}b{n:04d}"

    def alloc(self, n: int) -> str:
        return f"{self.prefix}-{n:04d}"

    def net(self, n: int) -> str:
        return f"{self.prefix}-d{n:04d}"

    def yaml(self) -> str:
        p, lines = self.pool, ["version: 1", "bridges:"]
        lines += [f"  - {{name: {self.bridge(s)}}}" for s in self.subnets]
        lines.append("subnets:")
        lines += [f"  - {{name: {self.sub(s)}, bridge: {self.bridge(s)}, cidr: auto, "
                  f"pool: 10.{p}.0.0/16, size: 24, cidr6: auto, pool6: \"fd00:{p}::/48\"}}"
                  for s in self.subnets]
        lines.append("allocs:" if self.allocs else "allocs: []")
        lines += [f"  - {{id: {self.alloc(a)}, subnet: {self.sub(s)}, "
                  "ports: [{host: auto, to: 8080}]}" for a, s in sorted(self.allocs.items())]
        if self.networks:
            lines.append("docker_networks:")
            lines += [f"  - {{name: {self.net(d)}, subnet: auto, pool: 10.{p + 1}.0.0/16, "
                      "size: 24, labels: {soak: lifetime}}" for d in self.networks]
        return "\n".join(lines) + "\n"

    def bridges(self) -> dict[str, str]:
        return {self.bridge(s): self.sub(s) for s in self.subnets}

    def resources(self) -> set[tuple[str, str]]:
        return ({("subnet", self.sub(s)) for s in self.subnets}
                | {("alloc", self.alloc(a)) for a in self.allocs}
                | {("docker", self.net(d)) for d in self.networks})

    def first(self) -> int:
        """A number below every one used so far of any kind: a name that sorts first."""
        used = [*self.subnets, *self.allocs, *self.networks]
        return min(used, default=BASE) - 1


@dataclass
class Figures:
    seed: int
    rounds: int = 0
    by_kind: collections.Counter[str] = field(default_factory=collections.Counter)
    heal: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    moved: dict[tuple[str, str, str], tuple[int, str, str, str]] = field(default_factory=dict)
    duplicates: int = 0
    blocked: int = 0  # conflict rounds where unrelated drift did not heal in time
    conflicts: int = 0
    verify_failed: int = 0
    port_failed: int = 0
    not_converged: int = 0
    errors: int = 0  # rounds where a step of the soak itself failed
    leaks: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)

    def moved_by_kind(self) -> collections.Counter[str]:
        return collections.Counter(kind for _r, kind, _a, _b in self.moved.values())

    def broken(self) -> list[str]:
        """Every invariant that broke, in words (empty: all held)."""
        out = []
        if self.moved:
            out.append(f"{len(self.moved)} identities moved")
        for what, n in (("duplicate addresses", self.duplicates),
                        ("conflict rounds blocked by an unrelated resource", self.blocked),
                        ("rounds that did not converge", self.not_converged),
                        ("verify failures", self.verify_failed),
                        ("port maps not reached", self.port_failed),
                        ("rounds with a failed soak step", self.errors),
                        ("leaks", len(self.leaks))):
            if n:
                out.append(f"{n} {what}")
        return out

    def lines(self) -> list[str]:
        kinds = " ".join(f"{k} {self.by_kind[k]}" for k in KINDS)
        moved = ", ".join(f"{k} {n}" for k, n in self.moved_by_kind().most_common())
        heal = "; ".join(f"{k} p50 {pct(v, 50):.2f}s p99 {pct(v, 99):.2f}s (n={len(v)})"
                         for k, v in sorted(self.heal.items()))
        return [
            f"lifetime soak: {self.rounds} rounds ({kinds}), seed {self.seed}, "
            f"{self.seconds:.0f}s wall, load {self.load[0]:.1f} -> {self.load[1]:.1f}",
            f"lifetime invariants: identities moved {len(self.moved)}"
            + (f" ({moved})" if moved else "")
            + f", duplicate addresses {self.duplicates}, passes blocked by an unrelated "
            f"resource {self.blocked}/{self.conflicts} conflict rounds, not converged "
            f"{self.not_converged}, verify failed {self.verify_failed}, port maps not "
            f"reached {self.port_failed}, leaks {len(self.leaks)}, soak steps failed "
            f"{self.errors}",
            f"lifetime heal: {heal}",
        ]


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (of a handful of samples, p99 is the largest)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(len(s) * p / 100) - 1))]


class Soak:
    """The rounds over one sandbox; :meth:`run` returns the figures."""

    def __init__(self, seed: int, prefix: str, docker: bool = True,
                 log: Callable[[str], None] = print) -> None:
        self.rng = random.Random(seed)
        self.fig = Figures(seed)
        self.log = log
        self.docker = docker
        self.want = Desired(prefix, self.rng.randrange(150, 240, 2))
        self.first_seen: dict[tuple[str, str, str], str] = {}
        self.box: Sandbox | None = None
        self.note = ""  # what the round did, for its log line

    # -- files -------------------------------------------------------------------

    def save(self) -> None:
        """Write the files; forget what was first seen of a resource they drop."""
        assert self.box is not None
        tmp = os.path.join(self.box.conf, ".lifetime.yaml.tmp")
        with open(tmp, "w") as fh:
            fh.write(self.want.yaml())
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.box.config)
        # its leases go with it (SPEC §11): declared again later, the name reused (names
        # count down from the lowest in use), it is a new resource with new picks
        declared = self.want.resources()
        self.first_seen = {k: v for k, v in self.first_seen.items()
                           if (k[0], k[1]) in declared}

    # -- convergence -------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        assert self.box is not None
        return self.box.observe([self.want.alloc(a) for a in self.want.allocs],
                                self.want.bridges())

    def missing(self, snap: Snapshot, skip: set[tuple[str, str]]) -> list[str]:
        """What is not (yet) as declared: absent values, undeclared objects of ours."""
        w, out = self.want, []
        need = {"subnet": ("v4", "v6"), "alloc": ("v4", "v6", "mac", "port"),
                "docker": ("v4",) if self.docker else ()}
        for kind, name in sorted(w.resources() - skip):
            out += [f"{kind} {name} {what}" for what in need[kind]
                    if (kind, name, what) not in snap.values]
        declared = {w.alloc(a) for a in w.allocs}
        blocked = {n for _k, n in skip}
        out += [f"undeclared namespace {n}" for n in sorted(snap.allocs - declared - blocked)]
        out += [f"undeclared bridge {b}" for b in
                sorted(snap.bridges - set(w.bridges()) - set(self.box.foreign if self.box
                                                                else ()))]
        out += [f"undeclared docker network {n}"
                for n in sorted(snap.networks - {w.net(d) for d in w.networks})]
        return out

    def heal(self, kind: str, t0: float, skip: set[tuple[str, str]] = frozenset(),  # type: ignore[assignment]
             deadline: float = HEAL_DEADLINE, verify: bool = True) -> Snapshot | None:
        """Wait until everything declared (but ``skip``) is present and, with ``verify``,
        ``reconcile verify`` passes; record the time since ``t0`` under ``kind``."""
        assert self.box is not None
        last: list[str] = []
        while time.monotonic() - t0 < deadline:
            if not self.box.agent_alive():
                self.fig.details.append(f"round {self.fig.rounds}: the agent died:\n"
                                        + self.box.tail("agent"))
                self.box.start_agent(INTERVAL)
            snap = self.snapshot()
            last = self.missing(snap, skip)
            if not last and verify:
                v = self.box.cli("verify", self.box.config)
                if v.returncode != 0:
                    last = [f"verify exit {v.returncode}: {(v.stdout + v.stderr)[-600:]}"]
            if not last:
                self.fig.heal[kind].append(time.monotonic() - t0)
                return snap
            # fine-grained while a heal is expected, coarser later: polls are processes too
            time.sleep(0.1 if time.monotonic() - t0 < 3 else 0.5)
        self.fig.details.append(f"round {self.fig.rounds} ({kind}): not healed in "
                                f"{deadline:.0f}s: {'; '.join(last)[:1500]}")
        return None

    def check(self, kind: str, snap: Snapshot | None) -> None:
        """The invariants after a round: identities, duplicates, port maps."""
        if snap is None:
            self.fig.not_converged += 1
            if any("verify exit" in d for d in self.fig.details[-1:]):
                self.fig.verify_failed += 1
            snap = self.snapshot()
        declared = self.want.resources()
        for key, value in sorted(snap.values.items()):
            if (key[0], key[1]) not in declared or key[2].startswith("gw"):
                continue
            first = self.first_seen.setdefault(key, value)
            if value != first and key not in self.fig.moved:
                self.fig.moved[key] = (self.fig.rounds, kind, first, value)
                self.fig.details.append(f"round {self.fig.rounds} ({kind}): {' '.join(key)} "
                                        f"moved {first} -> {value}")
        addrs = snap.addresses()
        dups = [a for a, n in collections.Counter(addrs).items() if n > 1]
        prefixes = snap.prefixes()
        for i, (a, pa) in enumerate(prefixes):
            for b, pb in prefixes[i + 1:]:
                if ipaddress.ip_network(pa).overlaps(ipaddress.ip_network(pb)):
                    dups.append(f"{a} {pa} overlaps {b} {pb}")
        if dups:
            self.fig.duplicates += len(dups)
            self.fig.details.append(f"round {self.fig.rounds} ({kind}): duplicates {dups}")
        self.probe_ports(kind, snap)

    def probe_ports(self, kind: str, snap: Snapshot) -> None:
        """One allocation's port map from the host's loopback and from another allocation
        (through that one's gateway): a listener inside it must answer both."""
        assert self.box is not None
        live = [a for a in sorted(self.want.allocs)
                if ("alloc", self.want.alloc(a), "port") in snap.values]
        if not live:
            return
        target = self.rng.choice(live)
        aid = self.want.alloc(target)
        vantages = [(self.box.host, "127.0.0.1")]
        others = [a for a in live if a != target]
        if others:
            src = self.rng.choice(others)
            gw = snap.values.get(("subnet", self.want.sub(self.want.allocs[src]), "gwv4"))
            if gw:
                vantages.append((self.want.alloc(src), gw))
        failed = self.box.port_reaches(aid, snap.values[("alloc", aid, "port")], vantages)
        if failed:
            self.fig.port_failed += len(failed)
            self.fig.details.append(f"round {self.fig.rounds} ({kind}): port map of {aid} "
                                    f"not reached from {failed}")

    # -- rounds --------------------------------------------------------------------

    def reboot(self) -> Snapshot | None:
        assert self.box is not None
        self.box.power_off()
        t0 = time.monotonic()
        self.box.power_on()
        self.box.start_agent(INTERVAL)
        return self.heal("reboot", t0)

    def agent_kill(self) -> Snapshot | None:
        assert self.box is not None
        self.box.kill_agent()
        self.box.forget_run_files()
        if self.want.allocs:  # drift while nobody watches: one allocation's veth deleted
            victim = self.want.alloc(self.rng.choice(sorted(self.want.allocs)))
            sh("ip", "-n", victim, "link", "del", "eth0", check=False)
        t0 = time.monotonic()
        self.box.start_agent(INTERVAL)
        return self.heal("agent-restart", t0)

    def dockerd_restart(self) -> Snapshot | None:
        assert self.box is not None
        if not self.docker:
            return self.heal("dockerd-restart", time.monotonic())
        t0 = time.monotonic()
        self.box.stop_dockerd()
        self.box.start_dockerd()
        return self.heal("dockerd-restart", t0)

    def conflict(self, variant: str = "") -> Snapshot | None:
        """A foreign object in a declared resource's way, and drift elsewhere meanwhile:
        ``variant`` "bridge" or "route" (default: one drawn with the seed)."""
        assert self.box is not None
        w, box, rng = self.want, self.box, self.rng
        self.fig.conflicts += 1
        blocked: set[tuple[str, str]] = set()
        foreign: list[tuple[str, ...]] = []
        variant = variant or rng.choice(("bridge", "route"))
        if variant == "bridge" or len(w.subnets) < 2:
            # a foreign bridge holds the name of a bridge the files are about to declare
            s = w.first()
            box.foreign.append(w.bridge(s))
            sh("ip", "-n", box.host, "link", "add", w.bridge(s), "type", "bridge")
            a = s - 1
            w.subnets.append(s)
            w.allocs[a] = s
            blocked |= {("subnet", w.sub(s)), ("alloc", w.alloc(a))}
            foreign.append(("link", "del", w.bridge(s)))
            what = self.note = f"foreign bridge {w.bridge(s)}"
        else:
            # a foreign route over part of a live subnet, through a link of its own (a bridge
            # without ports: the dummy driver is not in every kernel)
            s = rng.choice(sorted(w.subnets))
            prefix = self.snapshot().values.get(("subnet", w.sub(s), "v4"))
            dummy = f"{w.prefix}fx"
            box.foreign.append(dummy)
            sh("ip", "-n", box.host, "link", "add", dummy, "type", "bridge")
            sh("ip", "-n", box.host, "link", "set", dummy, "up")
            if prefix:
                # a /29 near the start of it: inside, not the gateway, maybe allocations'
                net = ipaddress.ip_network(prefix)
                inner = f"{net.network_address + 8}/29"
                sh("ip", "-n", box.host, "route", "add", inner, "dev", dummy)
            blocked |= {("subnet", w.sub(s))} | {("alloc", w.alloc(a))
                                                 for a, t in w.allocs.items() if t == s}
            foreign.append(("link", "del", dummy))
            what = self.note = f"foreign route over {prefix} ({w.sub(s)})"
        # drift elsewhere while it stands: a new allocation, a deleted veth
        free = [t for t in w.subnets if ("subnet", w.sub(t)) not in blocked]
        t0 = time.monotonic()
        if free:
            w.allocs[w.first()] = rng.choice(free)
            victims = [a for a, t in w.allocs.items() if t in free]
            sh("ip", "-n", w.alloc(rng.choice(victims)), "link", "del", "eth0", check=False)
        self.save()
        snap = self.heal("conflict-unrelated", t0, skip=blocked, deadline=UNRELATED_DEADLINE,
                         verify=False)
        if snap is None:
            self.fig.blocked += 1
            self.fig.details.append(f"round {self.fig.rounds}: with {what} standing, "
                                    "unrelated drift was not healed")
        t1 = time.monotonic()
        for args in foreign:
            sh("ip", "-n", box.host, *args, check=False)
        box.foreign.clear()
        return self.heal("conflict-cleared", t1)

    def conflict_bridge(self) -> Snapshot | None:
        return self.conflict("bridge")

    def edit(self) -> Snapshot | None:
        """Add with a name that sorts first, remove, or rename; one of them."""
        w, rng = self.want, self.rng
        choices = ["add-alloc", "add-subnet", "rename-alloc", "remove-alloc", "remove-subnet"]
        if self.docker:
            choices += ["add-network", "remove-network"]
        what = self.note = rng.choice(choices)
        if what == "add-alloc" or (what.startswith("remove") and len(w.allocs) <= 3):
            w.allocs[w.first()] = rng.choice(w.subnets)
        elif what == "add-subnet" or (what == "remove-subnet" and len(w.subnets) <= 2):
            s = w.first()
            w.subnets.append(s)
            w.allocs[s - 1] = s
        elif what == "rename-alloc":
            old = rng.choice(sorted(w.allocs))
            w.allocs[w.first()] = w.allocs.pop(old)
        elif what == "remove-alloc":
            del w.allocs[rng.choice(sorted(w.allocs))]
        elif what == "remove-subnet":
            s = rng.choice(sorted(w.subnets))
            w.subnets.remove(s)
            for a in [a for a, t in w.allocs.items() if t == s]:
                del w.allocs[a]
        elif what == "add-network" or len(w.networks) <= 1:
            w.networks.append(w.first())
        else:
            w.networks.remove(rng.choice(w.networks))
        t0 = time.monotonic()
        self.save()
        return self.heal("edit", t0)

    def add_first(self) -> Snapshot | None:
        """An allocation and a subnet (with one of its own) whose names sort first."""
        w = self.want
        w.allocs[w.first()] = min(w.subnets)
        s = w.first()
        w.subnets.append(s)
        w.allocs[s - 1] = s
        if self.docker:
            w.networks.append(w.first())
        t0 = time.monotonic()
        self.save()
        return self.heal("edit", t0)

    # -- the run ---------------------------------------------------------------------

    def schedule(self, rounds: int) -> list[str]:
        """The opening shows the reboot renumbering (names sorting first, then a reboot) and
        every kind once; the rest is drawn with the seed, by a generator of its own: the
        rounds' own draws do not depend on how many rounds there are, so ``--rounds N`` with
        a seed replays the first N rounds of a longer run with that seed."""
        opening = ["add-first", "reboot", "conflict-bridge", "agent-kill", "dockerd-restart",
                   "edit"]
        kinds = random.Random(f"{self.fig.seed} schedule")
        rest = kinds.choices(KINDS, WEIGHTS, k=max(0, rounds - len(opening)))
        return (opening + rest)[:rounds]

    def run(self, rounds: int) -> Figures:
        w, fig = self.want, self.fig
        w.subnets = [BASE + 10, BASE + 11]
        w.allocs = {BASE + 20 + i: w.subnets[i % 2] for i in range(4)}
        w.networks = [BASE + 30, BASE + 31] if self.docker else []
        t_start, load0 = time.monotonic(), os.getloadavg()[0]
        self.box = Sandbox(w.prefix, self.docker)
        try:
            self.save()
            self.box.start_agent(INTERVAL)
            self.check("start", self.heal("start", t_start))
            actions = {"reboot": self.reboot, "agent-kill": self.agent_kill,
                       "dockerd-restart": self.dockerd_restart, "conflict": self.conflict,
                       "edit": self.edit, "add-first": self.add_first,
                       "conflict-bridge": self.conflict_bridge}
            for kind in self.schedule(rounds):
                fig.rounds += 1
                fig.by_kind[ALIASES.get(kind, kind)] += 1
                before = len(fig.details)
                try:
                    self.check(kind, actions[kind]())
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    # a step of the soak itself failed (a tool, a timeout): say so, go on
                    fig.errors += 1
                    fig.details.append(f"round {fig.rounds} ({kind}): soak step failed: {exc!r}")
                self.log(f"round {fig.rounds}/{rounds} {kind}"
                         + (f" ({self.note})" if self.note else "") + ": "
                         + ("; ".join(fig.details[before:]) or "ok"))
                self.note = ""
        finally:
            fig.leaks = self.box.close()
            fig.seconds = time.monotonic() - t_start
            fig.load = (load0, os.getloadavg()[0])
        fig.details += [f"leak: {leak}" for leak in fig.leaks]
        return fig


def main() -> int:
    soak_env = os.environ.get("RECONCILER_SOAK", "") not in ("", "0")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300 if soak_env else 30)
    ap.add_argument("--seed", type=int, default=None, help="default: a random one, printed")
    ap.add_argument("--no-docker", action="store_true", help="no private dockerd, no networks")
    ap.add_argument("--quiet", action="store_true", help="no line per round")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root", file=sys.stderr)
        return 1
    seed = a.seed if a.seed is not None else secrets.randbelow(1_000_000)
    print(f"lifetime soak: seed {seed}, {a.rounds} rounds", flush=True)
    soak = Soak(seed, f"lt{secrets.token_hex(2)}", docker=not a.no_docker,
                log=(lambda _line: None) if a.quiet else (lambda line: print(line, flush=True)))
    fig = soak.run(a.rounds)
    for line in fig.details if a.quiet else fig.details[-len(fig.leaks):] if fig.leaks else []:
        print(line)
    for line in fig.lines():
        print(f"[figures] {line}")
    broken = fig.broken()
    if broken:
        print("invariants broken: " + ", ".join(broken))
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
