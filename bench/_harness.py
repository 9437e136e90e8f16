"""Shared pieces of the comparison benchmarks: our side through the CLI, in throwaway namespaces.

Every run of ours gets a throwaway "host" network namespace ``<prefix>-host``
and the CLI is run as ``python -m reconciler --netns <prefix>-host …``, so the
bridge, veths and iptables rules never touch the real host. Allocation
namespaces are named ``<prefix>-<i>`` (they live under /run/netns like
``ip netns add`` ones). ``Sandbox`` removes all of it on exit, even on failure.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reconciler.drivers import netns  # noqa: E402

BRIDGE = "rbbr0"
SUBNET = "rb-net"
LOCK_DIR = os.environ.get("RECONCILER_LOCK_DIR", "/run/reconciler")


#: a Linux bridge takes at most 1023 ports (BR_MAX_PORTS = 1024, port 0 reserved): the
#: 1024th veth fails with EXFULL ("Exchange full"), so big N is spread over several bridges
MAX_PER_BRIDGE = 1000


def alloc_yaml(n: int, prefix: str, cidr: str = "10.88.0.0/16", *, allocs: bool = True,
               port_base: int = 20000, per_bridge: int = MAX_PER_BRIDGE, ports: int = 2,
               first_base: int | None = None) -> str:
    """``n`` allocs with 2 tcp port maps (host base+2i → 80, +1 → 443) on one bridge and subnet.

    Above ``per_bridge`` allocations, bridge/subnet k (``rbbr<k>``, the k-th /16 after
    ``cidr``) serves allocs k*per_bridge… — one bridge cannot hold more than 1023 ports.
    ``ports`` other than 2: host base+ports*i+j → 80, 443, then 8002, 8003, …;
    ``first_base``: alloc 0's host ports start there instead (one allocation's change).
    """
    net = ipaddress.ip_network(cidr)
    groups = max(1, -(-n // per_bridge))
    if net.num_addresses - 3 < min(n, per_bridge):
        raise ValueError(f"{cidr} is too small for {min(n, per_bridge)} allocations")
    lines = ["version: 1", "bridges:"]
    lines += [f"  - name: {BRIDGE[:-1]}{k}" for k in range(groups)]
    lines.append("subnets:")
    for k in range(groups):
        sub = ipaddress.ip_network((int(net.network_address) + k * net.num_addresses,
                                    net.prefixlen))
        lines += [f"  - name: {SUBNET}{k or ''}", f"    bridge: {BRIDGE[:-1]}{k}",
                  f"    cidr: {sub}"]
    if allocs and n:
        lines.append("allocs:")
        for i in range(n):
            h = port_base + ports * i if i or first_base is None else first_base
            k = i // per_bridge
            lines += [f"  - id: {prefix}-{i}", f"    subnet: {SUBNET}{k or ''}", "    ports:"]
            lines += [f"      - {{host: {h + j}, to: {(80, 443)[j] if j < 2 else 8000 + j}}}"
                      for j in range(ports)]
    return "\n".join(lines) + "\n"


def docker_yaml(names: Sequence[str]) -> str:
    lines = ["version: 1", "docker_networks:"]
    for name in names:
        lines += [f"  - name: {name}", "    ipv6: true"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CliRun:
    seconds: float
    maxrss_mb: float
    rc: int
    stdout: str
    stderr: str


_COMPILED: set[str] = set()


def byte_compile(src: str) -> None:
    """Byte-compile the package under test once, as installing it does (pip, the .deb).

    Without it a run under PYTHONDONTWRITEBYTECODE (set in the shells here) compiles
    all ~260 modules from source every time: ~90 ms of each CLI run at N=0 (0.38 ->
    0.29 s), which an installed reconciler never pays. RECONCILER_BENCH_NO_PYC=1 skips
    it (the figures before this was done). Stale bytecode is never used: Python checks
    each file's mtime.
    """
    if src in _COMPILED or os.environ.get("RECONCILER_BENCH_NO_PYC") == "1":
        return
    _COMPILED.add(src)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(src, "reconciler")],
                   check=False, stdout=subprocess.DEVNULL)


def run_cli(args: Sequence[str], *, ok: Sequence[int] = (0,), env: dict[str, str] | None = None,
            python_args: Sequence[str] = (), timeout: float | None = None) -> CliRun:
    """``python -m reconciler ARGS``: wall time and peak RSS of exactly that child (wait4).

    With ``timeout`` the child is killed (SIGKILL) after that many seconds: exit -9.
    """
    cmd = [sys.executable, *python_args, "-m", "reconciler", *args]
    # RECONCILER_BENCH_SRC: run another copy of the package (A/B of a patched tree)
    src = os.environ.get("RECONCILER_BENCH_SRC", str(ROOT))
    byte_compile(src)
    full_env = dict(os.environ, PYTHONPATH=src, NO_COLOR="1", **(env or {}))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env=full_env, cwd=src)  # cwd comes first on sys.path
        timer = threading.Timer(timeout, proc.kill) if timeout else None
        if timer:
            timer.start()
        try:
            _pid, status, usage = os.wait4(proc.pid, 0)
        finally:
            if timer:
                timer.cancel()
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        res = CliRun(seconds, usage.ru_maxrss / 1024, proc.returncode,
                     out.read().decode(errors="replace"), err.read().decode(errors="replace"))
    if res.rc not in ok:
        tail = (res.stderr or res.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd[1:])}: exit {res.rc}\n  " + "\n  ".join(tail))
    return res


_HELP: dict[str, str] = {}


def cli_supports(command: str, option: str) -> bool:
    """Whether the CLI under test (``RECONCILER_BENCH_SRC`` or this checkout) has ``option``:
    an A/B against an older tree must not hand it options it does not know."""
    if command not in _HELP:
        _HELP[command] = run_cli([command, "--help"]).stdout
    return option in _HELP[command]


def host_dump(host: str) -> float:
    """The host-level dump (``ip -j link``, ``ip -j addr``, ``iptables-save``) inside ``host``."""
    with netns.enter(host):
        t0 = time.perf_counter()
        for cmd in (["ip", "-j", "link"], ["ip", "-j", "addr"], ["iptables-save"]):
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - t0


def process_hwm_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) of a running process, in MB."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def children_maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def free_port() -> int:
    """A loopback TCP port free right now (for an agent's ``--status-addr``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent_status(addr: str) -> dict[str, Any] | None:
    """The agent's ``/status`` document at ``addr`` (no proxy), or None while it does not answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{addr}/status", timeout=2) as r:
            doc: dict[str, Any] = json.loads(r.read())
            return doc
    except OSError:
        return None


class Sandbox:
    """A throwaway host namespace plus a temp dir; ``close`` removes everything it may have made."""

    def __init__(self, tag: str = "rb") -> None:
        self.prefix = f"{tag}{secrets.token_hex(3)}"
        self.host = f"{self.prefix}-host"
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        #: its own state directory (pending changes, plan files): never /var/lib/reconciler
        self.env = {"RECONCILER_STATE_DIR": str(self.tmp / "state")}
        netns.create(self.host)
        self.host_inode = netns.namespace_inode(self.host)
        subprocess.run(["ip", "-n", self.host, "link", "set", "lo", "up"], check=True)

    def write(self, name: str, text: str) -> str:
        path = self.tmp / name
        path.write_text(text)
        return str(path)

    def cli(self, *args: str, env: dict[str, str] | None = None, **kw: object) -> CliRun:
        return run_cli(["--netns", self.host, *args], env={**self.env, **(env or {})},
                       **kw)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def agent(self, path: str, timeout: float = 120.0) -> Iterator[int]:
        """A ``reconcile watch`` of ``path`` in the sandbox (it answers plans); yields its pid.

        Returns once the agent's plan socket exists and its first pass is logged,
        so its start-up work does not compete with what is measured next.
        """
        from reconciler.agent.planview.protocol import socket_path

        src = os.environ.get("RECONCILER_BENCH_SRC", str(ROOT))
        log = self.tmp / "agent.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "reconciler", "--netns", self.host, "watch", path,
                 "--status-addr", "off", "--allow-insecure-config", "--interval", "3600"],
                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONPATH=src, **self.env), cwd=src)
        try:
            sock = socket_path(self.host_inode or 0)
            deadline = time.monotonic() + timeout
            while not (os.path.exists(sock) and "pass 1 " in log.read_text()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the agent did not come up:\n{log.read_text()[-2000:]}")
                time.sleep(0.05)
            yield proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def leftovers(self) -> list[str]:
        return [n for n in netns.list_names() if n.startswith(f"{self.prefix}-")]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if netns.is_namespace_mount(self.host):
                run_cli(["--netns", self.host, "destroy", "--yes"], ok=(0, 1), env=self.env)
        for name in self.leftovers():  # allocation namespaces, then the host (veths go with it)
            if name != self.host:
                with contextlib.suppress(Exception):
                    netns.delete(name)
        with contextlib.suppress(Exception):
            netns.delete(self.host)
        if self.host_inode is not None:  # what a killed reconciler of the sandbox left
            for name in ("netns-{}.lock", "plan-{}.lock", "plan-{}.sock",
                         "probe-vantage-{}.lock"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(LOCK_DIR, name.format(self.host_inode)))
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"
