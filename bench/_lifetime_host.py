"""The lifetime soak's sandbox: a host namespace, a private dockerd, the agent, what they see.

``bench/lifetime.py`` drives the rounds; this module holds the machinery they act on:

* the "host": a network namespace ``<prefix>-host`` that a simulated reboot deletes and
  makes again under the same name (the reconciler's scope, ``netns-NAME``, is the same, so
  its state directory carries over as ``/var/lib/reconciler`` does over a real reboot);
* a state directory of its own (``RECONCILER_STATE_DIR`` under the soak's temp dir),
  never the machine's ``/var/lib/reconciler``;
* a private dockerd running in the host namespace, in a mount namespace with a private
  ``/run`` (``/run/netns`` carried over: tests/support/privaterun.py), its data-root in
  the temp dir and its socket beside it (``DOCKER_HOST`` for the reconciler): restarting it
  never touches the machine's dockerd;
* the agent: ``reconcile watch`` of the soak's config directory;
* :meth:`Sandbox.observe`: every identity, read with ``ip -j``, ``iptables-save`` and the
  docker CLI, never with the reconciler's code or state files.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.support.host import remove_vantage  # noqa: E402
from tests.support.privaterun import private_run  # noqa: E402

SCOPE_LABEL = "io.reconciler.scope"
LOCK_DIR = os.environ.get("RECONCILER_LOCK_DIR", "/run/reconciler")

#: one TCP connection (argv: address, port): the line it reads, or why it failed
CONNECT = ("import socket,sys\ntry:\n s=socket.create_connection((sys.argv[1],int(sys.argv[2])),"
           "timeout=5)\n print(s.makefile().readline().strip())\nexcept OSError as e:\n"
           " print(f'failed: {e}')\n")
#: a listener on 0.0.0.0:PORT answering TOKEN to N connections (argv: port, token, n)
LISTEN = ("import socket,sys\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,"
          "socket.SO_REUSEADDR,1)\ns.bind(('0.0.0.0',int(sys.argv[1])))\ns.listen(8)\n"
          "s.settimeout(10)\nprint('ready',flush=True)\nfor _ in range(int(sys.argv[3])):\n"
          " try:\n  c,_a=s.accept()\n except OSError:\n  break\n"
          " c.sendall((sys.argv[2]+'\\n').encode())\n c.close()\n")
#: the IPv4 port maps of our nftables table (``inet reconciler``): maps keyed by
#: ``proto . port`` (or ``address . proto . port``), the owner in each element's comment
_PORT_MAPS = ("pm4_addr", "pmip4_addr")


def sh(*args: str, check: bool = True, timeout: float = 120,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check,
                          timeout=timeout, env=env)


def mounted_netns() -> set[str]:
    with open("/proc/self/mountinfo") as fh:
        return {ln.split()[4].rsplit("/", 1)[1] for ln in fh
                if ln.split()[4].startswith("/run/netns/")}


@dataclass
class Snapshot:
    """What the host shows: identity key -> value, and what is there that is not declared."""

    values: dict[tuple[str, str, str], str] = field(default_factory=dict)
    allocs: set[str] = field(default_factory=set)  # mounted namespaces of ours
    bridges: set[str] = field(default_factory=set)  # bridges named like ours
    networks: set[str] = field(default_factory=set)  # docker networks of this scope

    def addresses(self) -> list[str]:
        """Every single address held: allocations' (both families) and gateways'."""
        return [v for (kind, _n, what), v in self.values.items()
                if (kind == "alloc" and what in ("v4", "v6")) or what.startswith("gw")]

    def prefixes(self) -> list[tuple[str, str]]:
        return [(f"{kind} {n}", v) for (kind, n, what), v in self.values.items()
                if kind in ("subnet", "docker") and what in ("v4", "v6")]


class Sandbox:
    """The soak's host namespace, temp dir, state dir, private dockerd and agent."""

    def __init__(self, prefix: str, docker: bool = True) -> None:
        self.prefix = prefix
        self.host = f"{prefix}-host"
        self.dir = tempfile.mkdtemp(prefix=f"{prefix}-lifetime-")
        self.conf = os.path.join(self.dir, "conf")
        os.makedirs(self.conf, mode=0o755)
        self.config = os.path.join(self.conf, "lifetime.yaml")
        self.state = os.path.join(self.dir, "state")  # never /var/lib/reconciler
        self.docker_sock = os.path.join(self.dir, "docker.sock")
        self.docker = docker
        self.env = dict(os.environ, PYTHONPATH=os.environ.get("RECONCILER_BENCH_SRC", REPO),
                        RECONCILER_STATE_DIR=self.state, NO_COLOR="1",
                        DOCKER_HOST=f"unix://{self.docker_sock}")
        self.keeper: subprocess.Popen[str] | None = None
        self.dockerd: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.agent_runs = 0
        self.inodes: set[int] = set()
        self.foreign: list[str] = []  # links of a conflict injected and not yet removed
        self.make_host()
        if docker:
            # the private dockerd's mount namespace (/run/lock for it)
            self.keeper = private_run(self.dir, "/run/lock")
            self.start_dockerd()

    # -- the host namespace --------------------------------------------------

    def make_host(self) -> None:
        sh("ip", "netns", "add", self.host)
        sh("ip", "-n", self.host, "link", "set", "lo", "up")
        self.inodes.add(os.stat(f"/run/netns/{self.host}").st_ino)

    def ours(self) -> list[str]:
        """Names of the namespaces the soak made (allocations and the host) under /run/netns."""
        return sorted(n for n in os.listdir("/run/netns") if n.startswith(f"{self.prefix}-"))

    def power_off(self) -> None:
        """What a reboot does to the kernel: every namespace and link of the soak gone.

        Processes die first (the agent with SIGKILL, dockerd stopped); the state directory,
        the files and dockerd's data-root stay, as disks do.
        """
        self.kill_agent()
        self.stop_dockerd()
        # the probes' vantage the killed agent held goes too (it is named after the host's
        # inode only: left, it would stay under /run/netns for good)
        if os.path.exists(f"/run/netns/{self.host}"):
            remove_vantage(os.stat(f"/run/netns/{self.host}").st_ino)
        for name in self.ours():
            sh("ip", "netns", "del", name, check=False)
        self.foreign.clear()
        self.forget_run_files()

    def power_on(self) -> None:
        self.make_host()
        if self.docker:
            self.start_dockerd()

    def forget_run_files(self) -> None:
        """Unlink the lock and socket files a killed reconciler left (an unheld flock)."""
        for inode in self.inodes:
            for name in (f"netns-{inode}.lock", f"plan-{inode}.lock", f"plan-{inode}.sock",
                         f"status-{inode}.sock", f"probe-vantage-{inode}.lock"):
                path = os.path.join(LOCK_DIR, name)
                with contextlib.suppress(OSError):
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        if name.endswith(".lock"):
                            import fcntl
                            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        os.unlink(path)
                    finally:
                        os.close(fd)

    # -- processes -------------------------------------------------------------

    def start_dockerd(self) -> None:
        assert self.keeper is not None
        log = open(os.path.join(self.dir, "dockerd.log"), "ab")  # noqa: SIM115 (dockerd keeps it)
        self.dockerd = subprocess.Popen(
            ["nsenter", f"--mount=/proc/{self.keeper.pid}/ns/mnt",
             f"--net=/run/netns/{self.host}", "dockerd", "--data-root",
             os.path.join(self.dir, "docker"), "--exec-root", "/run/docker", "--pidfile",
             "/run/docker.pid", "-H", f"unix://{self.docker_sock}", "--storage-driver", "vfs",
             "--iptables=true"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 90
        while sh("docker", "-H", f"unix://{self.docker_sock}", "info", check=False,
                 timeout=30).returncode != 0:
            if self.dockerd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the private dockerd did not start:\n" + self.tail("dockerd"))
            time.sleep(0.1)

    def stop_dockerd(self) -> None:
        if self.dockerd is None:
            return
        self.dockerd.terminate()
        try:
            self.dockerd.wait(30)
        except subprocess.TimeoutExpired:
            self.dockerd.kill()
            self.dockerd.wait()
        self.dockerd = None

    def start_agent(self, interval: float) -> None:
        self.agent_runs += 1
        log = open(os.path.join(self.dir, "agent.log"), "ab")  # noqa: SIM115 (the agent keeps it)
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "reconciler", "--netns", self.host, "watch", self.conf,
             "--status-addr", "off", "--allow-insecure-config", "--log-format", "json",
             "--interval", str(interval)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
            cwd=self.env["PYTHONPATH"], start_new_session=True)
        log.close()

    def kill_agent(self) -> None:
        """SIGKILL: no clean-up of any kind, as a crash or a power cut."""
        if self.agent is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.agent.pid, signal.SIGKILL)
        self.agent.wait(30)
        self.agent = None

    def agent_alive(self) -> bool:
        return self.agent is not None and self.agent.poll() is None

    def tail(self, what: str, n: int = 2000) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.dir, f"{what}.log"),
                                                 errors="replace") as fh:
            return fh.read()[-n:]
        return ""

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "reconciler", "--netns", self.host, *args],
                              capture_output=True, text=True, timeout=timeout, env=self.env,
                              stdin=subprocess.DEVNULL, cwd=self.env["PYTHONPATH"])

    def docker_cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return sh("docker", "-H", f"unix://{self.docker_sock}", *args, check=check, timeout=60)

    # -- what the host shows -----------------------------------------------------

    def ip_json(self, ns: str, *args: str) -> list[dict]:  # type: ignore[type-arg]
        out = sh("ip", "-n", ns, "-j", *args, check=False).stdout
        with contextlib.suppress(ValueError):
            return json.loads(out) if out.strip() else []
        return []

    def port_maps(self) -> list[tuple[str, str]]:
        """Return (host port, alloc id) of each IPv4 port map in our nftables table, read
        with ``nft -j`` (one per map and protocol, as the DNAT rules of earlier versions)."""
        out = sh("ip", "netns", "exec", self.host, "nft", "-j", "list", "table", "inet",
                 "reconciler", check=False).stdout
        found: list[tuple[str, str]] = []
        with contextlib.suppress(ValueError):
            for o in json.loads(out or "{}").get("nftables", []):
                body = o.get("map") if isinstance(o, dict) else None
                if not body or body.get("name") not in _PORT_MAPS:
                    continue
                for raw, _value in body.get("elem", []):
                    elem = raw.get("elem", {}) if isinstance(raw, dict) else {}
                    key, owner = elem.get("val", {}).get("concat", []), elem.get("comment", "")
                    if owner.startswith("alloc=") and key:
                        found.append((str(key[-1]), owner[len("alloc="):]))
        return found

    def observe(self, allocs: list[str], bridges: dict[str, str]) -> Snapshot:
        """Read every identity with system tools: ``bridges`` maps bridge -> subnet name."""
        snap = Snapshot()
        for link in self.ip_json(self.host, "addr", "show"):
            name = link.get("ifname", "")
            if name.startswith(f"{self.prefix}b"):
                snap.bridges.add(name)
            sub = bridges.get(name)
            if sub is None:
                continue
            for a in link.get("addr_info", []):
                if a.get("scope") != "global":
                    continue
                fam = "v4" if a["family"] == "inet" else "v6"
                net = ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
                snap.values[("subnet", sub, fam)] = str(net)
                snap.values[("subnet", sub, f"gw{fam}")] = a["local"]
        mounted = mounted_netns()
        snap.allocs = {n for n in mounted if n.startswith(f"{self.prefix}-") and n != self.host}
        for aid in allocs:
            if aid not in mounted:
                continue
            for link in self.ip_json(aid, "addr", "show", "dev", "eth0"):
                if link.get("address"):
                    snap.values[("alloc", aid, "mac")] = link["address"]
                for a in link.get("addr_info", []):
                    if a.get("scope") == "global":
                        fam = "v4" if a["family"] == "inet" else "v6"
                        snap.values[("alloc", aid, fam)] = a["local"]
        for port, aid in self.port_maps():
            key = ("alloc", aid, "port")
            # one map per allocation: two rules for one (a half-healed state) shows as a change
            snap.values[key] = port if key not in snap.values else f"{snap.values[key]}+{port}"
        if self.docker and self.dockerd is not None:
            ids = self.docker_cli("network", "ls", "-q", "--filter",
                                  f"label={SCOPE_LABEL}=netns/{self.host}").stdout.split()
            if ids:
                out = self.docker_cli("network", "inspect", *ids).stdout
                with contextlib.suppress(ValueError):
                    for net in json.loads(out or "[]"):
                        snap.networks.add(net["Name"])
                        for cfg in (net.get("IPAM") or {}).get("Config") or []:
                            sub = cfg.get("Subnet", "")
                            fam = "v6" if ":" in sub else "v4"
                            snap.values[("docker", net["Name"], fam)] = sub
        return snap

    def port_reaches(self, aid: str, port: str, vantages: list[tuple[str, str]]) -> list[str]:
        """Connect to ``port`` from each (namespace, address) vantage while a listener runs in
        allocation ``aid`` on 8080; return the vantages that did not get its token."""
        token = f"lt-{aid}-{time.monotonic_ns()}"
        listener = subprocess.Popen(["ip", "netns", "exec", aid, sys.executable, "-c", LISTEN,
                                     "8080", token, str(len(vantages))],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        failed = []
        try:
            assert listener.stdout is not None
            if listener.stdout.readline().strip() != "ready":
                return [f"{ns}->{addr}:{port} (no listener in {aid})" for ns, addr in vantages]
            for ns, addr in vantages:
                got = sh("ip", "netns", "exec", ns, sys.executable, "-c", CONNECT, addr, port,
                         check=False).stdout.strip()
                if got != token:
                    failed.append(f"{ns}->{addr}:{port} ({got or 'nothing read'})")
        finally:
            listener.kill()
            listener.wait()
        return failed

    # -- the end -----------------------------------------------------------------

    def close(self) -> list[str]:
        """Remove everything the soak made; return what could not be removed (leaks)."""
        self.kill_agent()
        last = None
        if os.path.exists(f"/run/netns/{self.host}"):
            last = os.stat(f"/run/netns/{self.host}").st_ino
            with contextlib.suppress(Exception):
                self.cli("destroy", "--yes", "--lock-timeout", "30")
        for name in self.foreign:
            sh("ip", "-n", self.host, "link", "del", name, check=False)
        if self.docker and self.dockerd is not None:
            for net in self.docker_cli("network", "ls", "-q", "--filter",
                                       f"label={SCOPE_LABEL}=netns/{self.host}").stdout.split():
                self.docker_cli("network", "rm", net)
        self.stop_dockerd()
        if self.keeper is not None:
            self.keeper.kill()
            self.keeper.wait()
        left = self.ours()
        for name in left:
            sh("ip", "netns", "del", name, check=False)
        self.forget_run_files()
        shutil.rmtree(self.dir, ignore_errors=True)
        leaks = [f"namespace {n}" for n in self.ours()]
        leaks += [f"namespace {n} left by destroy" for n in left if n != self.host]
        # the probes' vantages of the hosts the soak had: one a reboot round left (an
        # orphan: those inodes may be other hosts' since), or the one destroy did not remove
        leaks += [f"probe vantage {v}" for i in sorted(self.inodes)
                  if (v := remove_vantage(i, orphan=i != last)) is not None]
        return leaks
