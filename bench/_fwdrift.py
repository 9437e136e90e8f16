"""Firewall drift healed by a running agent (issue 26 item 6): ``drift_heal.py --firewall``.

Each reload runs in a coexistence cell (tests/support/cells.py: a network namespace
and a mount namespace of its own, with a private /run, its own /etc/ufw and
/etc/alternatives, a private dockerd): never the machine's firewall or dockerd.

The nft cell (iptables-nft; a private dockerd and ufw with default deny when
installed) takes, interleaved, each round in a rotated order:

* ``flush ours``: our firewall state emptied in one transaction: our own
  nftables table when there is one (a table whose name holds "reconciler"),
  else every ``RECONCILER-*`` chain (an ``iptables-restore --noflush`` that
  declares them);
* ``nft flush ruleset``; ``dockerd restart``; ``ufw reload``.

The legacy cell (iptables-legacy, no dockerd: no events there) takes ``flush
ours`` and is healed at the agent's resync (``--interval`` 4 s, cells.py).

Two figures per reload: **event → healed**, per pass that applied something, from
the first nf_tables commit the agent logged since its previous pass ended (on
legacy: the reload's start) to that pass's end, the worst of them per reload (one
clock: the agent's own JSON log, ``-vv``); and **traffic failed**, the window in
which declared traffic did not connect, from probe rounds run in a thread from
before the reload until after it (in-process sockets, 0.1 s timeout: one round is
the resolution). Declared traffic: a client through the host's address to a port
map (the forward path, behind dockerd's FORWARD DROP and ufw's deny) and
127.0.0.1 on the host. "kept": no pass applied anything (nothing of ours was
broken); traffic that failed with no pass applying anything is an error.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from reconciler.drivers import netns
from tests.support.cells import BRIDGE, Cell, have
from tests.support.host import unique, write
from tests.support.traffic import HOST_IP, client_of, listening

DEADLINE = 30.0
TARGET = 1.0  # p99 of event → healed, seconds
TRUSTED = "/var/lib/reconciler-bench"


def load() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def traffic_ok(client: str, host: str) -> bool:
    """Both declared paths connect within 0.1 s: client → host:1080, host → 127.0.0.1:1443."""
    socks = []
    for ns, addr, port in ((client, HOST_IP, 1080), (host, "127.0.0.1", 1443)):
        with netns.enter(ns):
            s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect((addr, port))
        socks.append(s)
    deadline = time.monotonic() + 0.1
    pending, ok = list(socks), True
    while pending and ok:
        left = deadline - time.monotonic()
        _, ready, _ = select.select([], pending, [], max(left, 0))
        if not ready:
            ok = False
        for s in ready:
            pending.remove(s)
            ok = ok and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    for s in socks:
        s.close()
    return ok


def cell_input(c: Cell, text: str, *args: str) -> None:
    """Run ``args`` inside the cell with ``text`` on its stdin; raise when it fails."""
    p = subprocess.run([*c.enter(), *args], input=text, capture_output=True, text=True,
                       timeout=60, env=c.env, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {p.returncode}: {p.stderr}")


def flush_ours(c: Cell) -> None:
    """Empty our firewall state in one transaction, whichever backend the tree has."""
    tables = c.run("nft", "list", "tables", check=False).stdout.splitlines()
    ours = [t.split()[1:3] for t in tables if t.startswith("table ") and "reconciler" in t.lower()]
    if ours:
        cell_input(c, "".join(f"flush table {fam} {name}\n" for fam, name in ours),
                   "nft", "-f", "-")
        return
    for save, restore in (("iptables-save", "iptables-restore"),
                          ("ip6tables-save", "ip6tables-restore")):
        # --noflush: a chain declared again is emptied; every table in one commit each
        blocks: dict[str, list[str]] = {}
        table = ""
        for line in c.run(save).stdout.splitlines():
            if line.startswith("*"):
                table = line
            elif line.startswith(":RECONCILER-"):
                blocks.setdefault(table, []).append(f"{line.split()[0]} - [0:0]")
        if blocks:
            cell_input(c, "".join(f"{t}\n" + "\n".join(ls) + "\nCOMMIT\n"
                                  for t, ls in blocks.items()), restore, "--noflush")


#: the reloads ``--reloads`` chooses from (``legacy``: ``flush ours`` in the legacy cell)
RELOADS = ("flush-ours", "nft-flush", "dockerd", "ufw", "legacy")


def reloads(c: Cell, chosen: set[str]) -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {}
    if "flush-ours" in chosen or c.backend == "legacy":
        out["flush ours"] = lambda: flush_ours(c)
    if c.backend == "nft" and "nft-flush" in chosen:
        out["nft flush ruleset"] = lambda: c.run("nft", "flush", "ruleset")
    if c.docker == "dockerd":
        out["dockerd restart"] = lambda: (c.stop_dockerd(), c.start_dockerd())
    if c.manager == "ufw":
        out["ufw reload"] = lambda: c.run("ufw", "reload")
    return out


class Traffic:
    """Probes the declared paths in a thread from before a reload until it is stopped."""

    def __init__(self, client: str, host: str) -> None:
        self.client, self.host = client, host
        self.samples: list[tuple[float, bool]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            ok = traffic_ok(self.client, self.host)
            self.samples.append((time.time(), ok))
            if ok:
                time.sleep(0.01)

    def ok_after(self, t: float) -> bool:
        return any(ok for ts, ok in self.samples if ts > t)

    def window(self) -> float | None:
        """From the first failed round to the first passing round after the last failed one
        (None: no round failed)."""
        self.stop.set()
        self.thread.join(5)
        fails = [ts for ts, ok in self.samples if not ok]
        if not fails:
            return None
        back = min((ts for ts, ok in self.samples if ok and ts > max(fails)), default=max(fails))
        return back - min(fails)


def heal_once(c: Cell, reload: Callable[[], Any], client: str) -> dict[str, Any]:
    """One reload and its heal: the agent's event → healed per healing pass (the worst of
    them), and the window in which declared traffic failed."""
    since = time.time()
    traffic = Traffic(client, c.host.name)
    try:
        reload()
        returned = time.time()
        while not traffic.ok_after(returned):
            if time.time() - returned > DEADLINE:
                raise RuntimeError(f"not healed after {DEADLINE:.0f} s:\n{c.agent_log_text()}")
            time.sleep(0.01)
    finally:
        window = traffic.window()
    passed_at = time.time()
    time.sleep(1.0)  # a pass under way when traffic came back logs once its verify is done
    logged = [r for r in c.agent_log() if r["ts"] >= since]
    passes = [r for r in logged if "pass_number" in r]
    events = [r["ts"] for r in logged if str(r.get("msg", "")).startswith("drift: nftables")]
    res: dict[str, Any] = {"window": window, "reload": returned - since}
    heals, prev_end, reasons = [], since, set()
    for r in passes:
        start = r["ts"] - float(r["duration_seconds"])
        if r.get("result") == "applied" and r["ts"] <= passed_at + 1.0:
            # from the first commit heard since the previous pass ended to this one's end
            heard = [t for t in events if prev_end <= t <= start]
            first = min(heard) if heard and c.backend == "nft" else (
                since if c.backend != "nft" else start)
            heals.append(r["ts"] - first)
            res["pass_s"] = max(res.get("pass_s", 0.0), float(r["duration_seconds"]))
            reasons.update(r["reasons"])
        prev_end = r["ts"]
    if window is not None and not heals:
        raise RuntimeError(f"traffic failed for {window:.2f} s and no pass applied anything:"
                           f"\n{c.agent_log_text()}")
    if heals:
        res["healed"] = max(heals)
        res["passes"] = len(heals)
        res["mode"] = "+".join(sorted(reasons))
    return res


@contextlib.contextmanager
def cell(backend: str, docker: str, manager: str, base: str) -> Iterator[tuple[Cell, str]]:
    """A started cell with one allocation applied, its listeners, a client and the agent."""
    c = Cell(backend, docker, manager, base)
    try:
        c.start()
        a = unique("x")
        cfg = write(base, "s.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: cox, bridge: {BRIDGE}, cidr: 10.219.0.0/24, isolation: ports}}]
allocs:
  - id: {a}
    subnet: cox
    ports: [{{host: 1080, to: 80}}, {{host: 1443, to: 443, host_ip: 127.0.0.1}}]
""")
        r = c.reconcile("apply", "--no-probe", cfg)
        if r.returncode != 0:
            raise RuntimeError(f"apply in the {backend} cell: {r.stdout}{r.stderr}")
        with client_of(c.host) as client, listening(a, 80, 443):
            if not traffic_ok(client.name, c.host.name):
                raise RuntimeError(f"the {backend} cell's port maps do not connect after apply")
            c.start_agent(cfg)
            yield c, client.name
    finally:
        c.close()


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank): the largest value below 100 samples."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run(rounds: int, chosen: set[str]) -> int:
    """The chosen firewall reloads, interleaved; the table of figures. 0 when all healed."""
    need = ("unshare", "nsenter", "iptables-nft", "nft")
    if not have(*need):
        print(f"needs {', '.join(need)}")
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleans up as an error does
    docker = "dockerd" if "dockerd" in chosen and have("dockerd", "docker") else "no-dockerd"
    manager = "ufw" if "ufw" in chosen and have("ufw") else "none"
    legacy = "legacy" in chosen and have("iptables-legacy")
    for what, there in (("dockerd", docker == "dockerd"), ("ufw", manager == "ufw"),
                        ("legacy", legacy)):
        if what in chosen and not there:
            print(f"{what}: not installed here, not measured")
    # the agent refuses files under a directory others can write, and a cell sees its own
    # /run: a directory only root can write, seen from inside the cells too
    os.makedirs(TRUSTED, mode=0o700, exist_ok=True)
    base = tempfile.mkdtemp(prefix="fwdrift-", dir=TRUSTED)
    for sub in ("nft", "legacy"):
        os.makedirs(os.path.join(base, sub))
    state = os.path.join(base, "state")
    old_state = os.environ.get("RECONCILER_STATE_DIR")
    os.environ["RECONCILER_STATE_DIR"] = state  # the cells' processes inherit it
    print(f"firewall drift: nft cell ({docker}, {manager} manager)"
          + (", legacy cell" if legacy else ", no iptables-legacy: no legacy cell")
          + f"; {rounds} round(s); load at start {load()}")
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        with contextlib.ExitStack() as stack:
            cells = [stack.enter_context(cell("nft", docker, manager,
                                              os.path.join(base, "nft")))]
            if legacy:
                cells.append(stack.enter_context(cell("legacy", "no-dockerd", "none",
                                                      os.path.join(base, "legacy"))))
            work = [(c, client, what, fn) for c, client in cells
                    for what, fn in reloads(c, chosen).items()]
            for r in range(rounds):
                k = r % len(work)
                for c, client, what, fn in work[k:] + work[:k]:
                    key = f"{c.backend}: {what}"
                    res = heal_once(c, fn, client)
                    results.setdefault(key, []).append(res)
                    win = res["window"]
                    print(f"  round {r + 1} {key}: "
                          + (f"healed {res['healed'] * 1000:.0f} ms ({res['mode']}, "
                             f"{res['passes']} pass(es), longest {res['pass_s'] * 1000:.0f} ms), "
                             if "healed" in res else "kept (no pass applied anything), ")
                          + ("traffic never failed" if win is None else
                             f"traffic failed for {win * 1000:.0f} ms")
                          + f" (reload {res['reload']:.2f} s)")
    finally:
        if old_state is None:
            os.environ.pop("RECONCILER_STATE_DIR", None)
        else:
            os.environ["RECONCILER_STATE_DIR"] = old_state
        shutil.rmtree(base, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(TRUSTED)  # when no other run uses it
    print(f"\nfirewall drift healed by the running agent, {rounds} round(s) interleaved "
          f"(load at end {load()})")
    print(f"{'reload':<24} {'event → healed: median':>23} {'p99':>8} "
          f"{'traffic failed: median':>23} {'max':>8} {'kept':>5}  target")
    for key, rs in results.items():
        healed = [x["healed"] for x in rs if "healed" in x]
        traffic = [x["window"] or 0.0 for x in rs]
        kept = sum(1 for x in rs if "healed" not in x)
        target = ("resync (no events): measured" if key.startswith("legacy") else
                  f"p99 < {TARGET:.0f} s: " + ("met" if healed and p99(healed) < TARGET else
                                               "met (nothing broke)" if not healed else
                                               "MISSED"))
        print(f"{key:<24} "
              + (f"{statistics.median(healed) * 1000:>20.0f} ms {p99(healed) * 1000:>5.0f} ms"
                 if healed else f"{'—':>23} {'—':>8}")
              + f" {statistics.median(traffic) * 1000:>20.0f} ms {max(traffic) * 1000:>5.0f} ms"
              f" {kept:>5}  {target}")
    return 0
