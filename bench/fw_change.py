"""What one allocation's change costs the firewall as the host fills up (issue 26 item 7).

As root: ``python3 bench/fw_change.py [--sizes 10 1000 5000] [--rounds 5]
[--phases change conn agent ports] [--ports-n 1000] [--ports 1 32] [--conn-count 2000]``

Whichever firewall backend the tree under test has (iptables chains, or its own
nftables table) is measured the same way, through the CLI and a running agent,
each size in a throwaway host namespace of its own (``_harness.Sandbox``: its own
``RECONCILER_STATE_DIR`` too), all removed on exit:

* change: one sandbox per size holds N allocations (2 tcp port maps each); each
  round moves allocation 0's host ports (and back the next round) with
  ``reconcile apply --no-probe``, the sizes in a rotated order (interleaved).
  Timed: the firewall transaction in the driver (``RECONCILER_BENCH_FIREWALL_TIMES``,
  reconciler/engine/optiming.py: the call into the driver, summed over the ops of
  the apply) and the apply's wall time. A TCP connection through the new host port
  to a listener in allocation 0 must succeed after each change (else it is an error).
* conn: connection set-up rate through one port map (the host's address on the
  bridge to the *last* allocation's first map, from the host namespace: the
  kernel's OUTPUT DNAT path) with the smallest and largest size declared: K
  connections opened and reset one after the other, per round.
* agent: a ``reconcile watch`` per sandbox (``--probe-interval off``: the idle
  agents of the other sizes do not probe while one is measured; each still probes
  what it applied); each round saves the file with
  allocation 0's ports moved and times the save → the agent's pass finished
  (``last_pass.finished_at`` of its /status), minus its debounce (0.5 s), and the
  agent's own firewall transaction.
* ports: ``--ports-n`` allocations with 1 port map each vs with 32, applied from
  nothing in a fresh sandbox per round (interleaved): apply wall and firewall
  transaction.

Medians of ``--rounds`` (at least 5 for a figure; fewer only to check the script
works), the load average from /proc/loadavg before and after, every figure beside
its target. The CNI comparison (apply of 500 ≥ 100x the chain) is
``bench/compare.py --n 500 --cni-runs 1 --no-docker``. Why this way:
docs/decisions/052-firewall-figures-measured-from-outside.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (  # noqa: E402
    MAX_PER_BRIDGE,
    ROOT,
    Sandbox,
    agent_status,
    alloc_yaml,
    free_port,
)

from reconciler.drivers import netns  # noqa: E402

TIMES_ENV = "RECONCILER_BENCH_FIREWALL_TIMES"
MOVED_BASE = 10000  # allocation 0's host ports on odd rounds (below every other map's)
DEBOUNCE = 0.5  # the agent's default (agent/passes.py)
TARGETS = {"ratio": 1.3, "ports": 1.5, "conn": 0.10}


def load() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def gateway(i: int) -> str:
    """The host's address on the bridge of allocation ``i`` (``alloc_yaml``'s layout)."""
    return f"10.{88 + i // MAX_PER_BRIDGE}.0.1"


def connect(host: str, addr: str, port: int, timeout: float = 2.0) -> bool:
    with netns.enter(host):
        s = socket.socket()
    s.settimeout(timeout)
    try:
        s.connect((addr, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


@contextlib.contextmanager
def listener(ns: str, port: int) -> Iterator[None]:
    """A TCP listener on ``port`` inside namespace ``ns`` that accepts and closes."""
    with netns.enter(ns):
        srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1024)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            srv.shutdown(socket.SHUT_RDWR)
        srv.close()
        thread.join(5)


def records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The firewall transaction records appended to ``path`` after ``offset``."""
    if not path.exists():
        return [], offset
    with open(path) as fh:
        fh.seek(offset)
        text = fh.read()
        return [json.loads(x) for x in text.splitlines() if x.strip()], fh.tell()


class Host:
    """One size: a sandbox with N allocations applied, a listener in allocation 0."""

    def __init__(self, n: int, ports: int = 2) -> None:
        self.n, self.ports = n, ports
        self.sb = Sandbox("rfw")
        self.times = self.sb.tmp / "firewall-times.jsonl"
        self.offset = 0
        self.moved = False
        self.file = self.sb.tmp / "allocs.yaml"
        self.file.write_text(self.yaml())

    def yaml(self) -> str:
        return alloc_yaml(self.n, self.sb.prefix, ports=self.ports,
                          first_base=MOVED_BASE if self.moved else None)

    def first_port(self) -> int:
        return MOVED_BASE if self.moved else 20000

    def apply(self, timeout: float) -> tuple[float, float, int]:
        """``apply --no-probe`` of the file: wall seconds, firewall seconds, firewall ops."""
        run = self.sb.cli("apply", str(self.file), "--no-probe", timeout=timeout,
                          env={TIMES_ENV: str(self.times)})
        recs, self.offset = records(self.times, self.offset)
        return run.seconds, sum(r["seconds"] for r in recs), len(recs)

    def move(self) -> None:
        self.moved = not self.moved
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(self.yaml())
        os.replace(tmp, self.file)  # as editors save

    def close(self) -> None:
        self.sb.close()


@contextlib.contextmanager
def agent(h: Host, timeout: float) -> Iterator[tuple[str, int]]:
    """A ``reconcile watch`` of the host's file with a status address; yields (addr, pid)."""
    addr = f"127.0.0.1:{free_port()}"
    src = os.environ.get("RECONCILER_BENCH_SRC", str(ROOT))
    log = open(h.sb.tmp / "agent.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "reconciler", "--netns", h.sb.host, "watch", str(h.file),
         "--status-addr", addr, "--allow-insecure-config", "--interval", "3600",
         "--probe-interval", "off"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=src,
        env=dict(os.environ, PYTHONPATH=src, **h.sb.env, **{TIMES_ENV: str(h.times)}))
    try:
        deadline = time.monotonic() + timeout
        while True:
            doc = agent_status(addr)
            if doc and (doc.get("last_pass") or {}).get("result") in ("ok", "applied"):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the agent did not converge: "
                                   + (h.sb.tmp / "agent.log").read_text()[-2000:])
            time.sleep(0.05)
        yield addr, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def agent_change(h: Host, addr: str, pid: int, timeout: float) -> tuple[float, float]:
    """Save the file with allocation 0 moved; seconds to the agent's converged pass, and the
    firewall seconds of that agent's passes meanwhile."""
    before = agent_status(addr)
    count = before["pass_count"] if before else 0
    _, h.offset = records(h.times, h.offset)
    t_wall = time.time()
    h.move()
    deadline = time.monotonic() + timeout
    while True:
        doc = agent_status(addr)
        last = (doc or {}).get("last_pass") or {}
        if (doc and doc["pass_count"] > count and last.get("finished_at", 0) > t_wall
                and last.get("result") in ("applied", "ok") and not doc.get("errors")):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agent did not converge on the change: {last}")
        time.sleep(0.005)
    recs, h.offset = records(h.times, h.offset)
    if not connect(h.sb.host, gateway(0), h.first_port()):
        raise RuntimeError(f"N={h.n}: the moved port map does not connect after the agent's pass")
    return last["finished_at"] - t_wall, sum(r["seconds"] for r in recs if r["pid"] == pid)


def conn_rate(h: Host, count: int) -> float:
    """Connections per second through the last allocation's first port map."""
    last = h.n - 1
    addr, port = gateway(last), 20000 + h.ports * last
    linger = struct.pack("ii", 1, 0)  # close = RST: no TIME_WAIT piling up
    with netns.enter(h.sb.host):
        socks = [socket.socket() for _ in range(count)]
    t0 = time.perf_counter()
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        s.settimeout(2.0)
        s.connect((addr, port))
        s.close()
    return count / (time.perf_counter() - t0)


def med(values: list[float]) -> float:
    return statistics.median(values)


def runs_ms(values: list[float]) -> str:
    return " / ".join(f"{v * 1000:.1f}" for v in values)


def rotated(items: list[Any], r: int) -> list[Any]:
    k = r % len(items)
    return items[k:] + items[:k]


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def phase_change(hosts: dict[int, Host], rounds: int, timeout: float) -> None:
    fw: dict[int, list[float]] = {n: [] for n in hosts}
    wall: dict[int, list[float]] = {n: [] for n in hosts}
    ops: dict[int, int] = {}
    for r in range(rounds):
        for n in rotated(sorted(hosts), r):
            h = hosts[n]
            h.move()
            w, f, k = h.apply(timeout)
            if not connect(h.sb.host, gateway(0), h.first_port()):
                raise RuntimeError(f"N={n}: the moved port map does not connect after apply")
            fw[n].append(f)
            wall[n].append(w)
            ops[n] = k
            print(f"  change round {r + 1} N={n}: firewall {f * 1000:.1f} ms ({k} op(s)), "
                  f"apply {w:.2f} s", file=sys.stderr)
    sizes = sorted(hosts)
    print(f"\n(1) one allocation's port maps changed, `apply --no-probe`, median of {rounds} "
          f"(load {load()})")
    print(f"{'N':>6} {'firewall transaction':>22} {'ops':>4} {'apply wall':>11}   runs (ms)")
    for n in sizes:
        print(f"{n:>6} {med(fw[n]) * 1000:>19.1f} ms {ops[n]:>4} {med(wall[n]):>9.2f} s   "
              f"{runs_ms(fw[n])}")
    lo, hi = sizes[0], sizes[-1]
    if hi != lo and med(fw[lo]) > 0:
        ratio = med(fw[hi]) / med(fw[lo])
        print(f"  firewall transaction N={hi} / N={lo}: {ratio:.2f}  "
              f"(target ≤ {TARGETS['ratio']}: {verdict(ratio <= TARGETS['ratio'])}); "
              f"absolute at N={hi}: {med(fw[hi]) * 1000:.1f} ms")


def phase_conn(hosts: dict[int, Host], rounds: int, count: int) -> None:
    sizes = [min(hosts), max(hosts)]
    rates: dict[int, list[float]] = {n: [] for n in sizes}
    with contextlib.ExitStack() as stack:
        for n in sizes:
            h = hosts[n]
            stack.enter_context(listener(f"{h.sb.prefix}-{n - 1}", 80))
            if not connect(h.sb.host, gateway(n - 1), 20000 + h.ports * (n - 1)):
                raise RuntimeError(f"N={n}: the last allocation's port map does not connect")
        for r in range(rounds):
            for n in rotated(sizes, r):
                rates[n].append(conn_rate(hosts[n], count))
                print(f"  conn round {r + 1} N={n}: {rates[n][-1]:.0f}/s", file=sys.stderr)
    print(f"\n(3) connection set-up through a port map ({count} connections a round, host → "
          f"bridge address → the last allocation), median of {rounds} (load {load()})")
    for n in sizes:
        print(f"{n:>6} allocations declared: {med(rates[n]):>8.0f} connections/s   runs "
              + " / ".join(f"{x:.0f}" for x in rates[n]))
    lo, hi = sizes
    if lo != hi:
        drop = 1 - med(rates[hi]) / med(rates[lo])
        print(f"  N={hi} vs N={lo}: {-drop * 100:+.1f} %  (target within "
              f"{TARGETS['conn'] * 100:.0f} %: {verdict(abs(drop) <= TARGETS['conn'])})")


def phase_agent(hosts: dict[int, Host], rounds: int, timeout: float) -> None:
    conv: dict[int, list[float]] = {n: [] for n in hosts}
    fw: dict[int, list[float]] = {n: [] for n in hosts}
    with contextlib.ExitStack() as stack:
        agents = {n: stack.enter_context(agent(h, timeout)) for n, h in hosts.items()}
        for r in range(rounds):
            for n in rotated(sorted(hosts), r):
                addr, pid = agents[n]
                c, f = agent_change(hosts[n], addr, pid, timeout)
                conv[n].append(c)
                fw[n].append(f)
                print(f"  agent round {r + 1} N={n}: converged {c * 1000:.0f} ms, firewall "
                      f"{f * 1000:.1f} ms", file=sys.stderr)
    print(f"\n(2) a running agent: save of the file → its pass converged, median of {rounds} "
          f"(load {load()})")
    print(f"{'N':>6} {'save → converged':>17} {'after debounce':>15} {'firewall (agent)':>17}")
    for n in sorted(hosts):
        print(f"{n:>6} {med(conv[n]) * 1000:>14.0f} ms {(med(conv[n]) - DEBOUNCE) * 1000:>12.0f}"
              f" ms {med(fw[n]) * 1000:>14.1f} ms")


def phase_ports(n: int, counts: list[int], rounds: int, timeout: float) -> None:
    wall: dict[int, list[float]] = {p: [] for p in counts}
    fw: dict[int, list[float]] = {p: [] for p in counts}
    for r in range(rounds):
        for p in rotated(counts, r):
            h = Host(n, ports=p)
            try:
                w, f, _ = h.apply(timeout)
            finally:
                h.close()
            wall[p].append(w)
            fw[p].append(f)
            print(f"  ports round {r + 1} {n}x{p}: apply {w:.2f} s, firewall {f * 1000:.0f} ms",
                  file=sys.stderr)
    print(f"\n(4) {n} allocations applied from nothing, `apply --no-probe`, median of {rounds} "
          f"(load {load()})")
    for p in counts:
        print(f"  {n} x {p:>2} port maps: apply {med(wall[p]):.2f} s, firewall transaction "
              f"{med(fw[p]) * 1000:.0f} ms   runs (s) "
              + " / ".join(f"{x:.2f}" for x in wall[p]))
    lo, hi = min(counts), max(counts)
    if lo != hi:
        ratio = med(wall[hi]) / med(wall[lo])
        print(f"  apply {n}x{hi} / {n}x{lo}: {ratio:.2f}  (target ≤ {TARGETS['ports']}: "
              f"{verdict(ratio <= TARGETS['ports'])}); firewall transaction "
              f"{med(fw[hi]) / max(med(fw[lo]), 1e-9):.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 1000, 5000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--phases", nargs="+", default=["change", "conn", "agent", "ports"],
                    choices=["change", "conn", "agent", "ports"])
    ap.add_argument("--ports-n", type=int, default=1000)
    ap.add_argument("--ports", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--conn-count", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="kill one command after this many seconds (default 1800)")
    opts = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("run as root (it creates throwaway network namespaces)", file=sys.stderr)
        return 1
    # SIGTERM (a run stopped from outside) cleans up as an exception does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = sorted(set(opts.sizes))
    if min(sizes) < 2:
        ap.error("sizes start at 2")
    print(f"fw_change: sizes {sizes}, {opts.rounds} round(s), phases {' '.join(opts.phases)}; "
          f"load at start {load()}")
    before = set(netns.list_names())
    hosts: dict[int, Host] = {}
    try:
        if {"change", "conn", "agent"} & set(opts.phases):
            for n in sizes:
                hosts[n] = Host(n)
                w, f, k = hosts[n].apply(opts.timeout)
                print(f"N={n} applied from nothing: {w:.2f} s (firewall {f * 1000:.0f} ms, "
                      f"{k} op(s))", file=sys.stderr)
            with listener(f"{hosts[sizes[0]].sb.prefix}-0", 80), contextlib.ExitStack() as st:
                for n in sizes[1:]:
                    st.enter_context(listener(f"{hosts[n].sb.prefix}-0", 80))
                if "change" in opts.phases:
                    phase_change(hosts, opts.rounds, opts.timeout)
                if "agent" in opts.phases:
                    phase_agent(hosts, opts.rounds, opts.timeout)
            if "conn" in opts.phases:
                phase_conn(hosts, opts.rounds, opts.conn_count)
        for h in hosts.values():
            h.close()
        hosts.clear()
        if "ports" in opts.phases:
            phase_ports(opts.ports_n, sorted(set(opts.ports)), opts.rounds, opts.timeout)
    finally:
        for h in hosts.values():
            h.close()
    left = sorted(x for x in set(netns.list_names()) - before if x.startswith("rfw"))
    print(f"\nload at end {load()}; left behind: {len(left)} namespace(s) of ours"
          + (f": {left[:5]}" if left else ""))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
