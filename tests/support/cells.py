"""The coexistence matrix's cells: a network namespace and a mount namespace of their own.

Each cell has a private /run (with /run/netns still shared, so allocation namespaces stay
visible), private copies of /etc/alternatives (the iptables backend), /etc/firewalld,
/etc/ufw and /etc/default/ufw; firewalld gets its own D-Bus system bus there, dockerd its
own data-root, exec-root, pidfile and socket. The machine's own firewall is never touched.
``tests/integration/firewall`` builds its matrix and its position tests on them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from tests.support import nsexec
from tests.support.forkserver import base_env
from tests.support.host import REPO, Netns, sh, unique

BACKENDS = ("nft", "legacy")
DOCKER = ("dockerd", "no-dockerd")
MANAGERS = ("none", "firewalld", "ufw")
ALL = [(b, d, m) for b in BACKENDS for d in DOCKER for m in MANAGERS]
#: CI's six: every pair of values of any two axes meets in one of them (about 75 s on an
#: idle machine, 80-95 s beside other test runs; all twelve about 210 s beside them)
CI_CELLS = [("nft", "dockerd", "none"), ("legacy", "no-dockerd", "none"),
            ("legacy", "dockerd", "firewalld"), ("nft", "no-dockerd", "firewalld"),
            ("nft", "dockerd", "ufw"), ("legacy", "no-dockerd", "ufw")]

BRIDGE = "rcox0"
#: the agent's resync on iptables-nft: longer than the test, so only an event can heal
NFT_INTERVAL = 3600.0
#: on iptables-legacy (no events): short, and a heal must come within one of it, plus the
#: healing pass's own duration (seconds with firewalld: its firewall-cmd queries), plus
#: HEAL_MARGIN (a pass under way when the reload ended, the probe round, a loaded machine)
LEGACY_INTERVAL = 4.0
HEAL_MARGIN = 5.0
#: how long any heal may take before the cell fails (event-driven ones take well under 1 s)
HEAL_DEADLINE = 30.0
#: each cell's agent serves its status on a port of its own (STATUS_PORT + the cell's index)
STATUS_PORT = 9480

#: one TCP connection (argv: address, port, timeout): what it reads, '' when it fails
FETCH = ("import socket,sys\ntry:\n s=socket.create_connection((sys.argv[1],int(sys.argv[2])),"
         "timeout=float(sys.argv[3]))\n print(s.makefile().readline().strip())\n"
         "except OSError:\n print('')\n")
#: the agent's /status (argv: URL), past any proxy of the environment
STATUS = ("import sys,urllib.request as u\n"
          "print(u.build_opener(u.ProxyHandler({})).open(sys.argv[1],timeout=2).read().decode())")
TOOLS = ("iptables", "iptables-save", "iptables-restore",
         "ip6tables", "ip6tables-save", "ip6tables-restore")

#: the cell's mount namespace, kept by this shell until it is killed: argv DIR BACKEND
SETUP = r"""
set -eu
D=$1; BACKEND=$2
mkdir -p "$D/keep" "$D/etc-firewalld" "$D/etc-ufw" "$D/alt"
mount --make-private / 2>/dev/null || true
mount --bind /run/netns "$D/keep"          # the same shared peer group as the machine's
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/netns /run/dbus /run/firewalld /run/lock
mount --move "$D/keep" /run/netns
cp -a /etc/firewalld/. "$D/etc-firewalld/" && mount --bind "$D/etc-firewalld" /etc/firewalld
cp -a /etc/ufw/. "$D/etc-ufw/" && mount --bind "$D/etc-ufw" /etc/ufw
cp -a /etc/default/ufw "$D/default-ufw" && mount --bind "$D/default-ufw" /etc/default/ufw
cp -a /etc/alternatives/. "$D/alt/"
for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
  case $t in ip6*) base=ip6tables; rest=${t#ip6tables};; *) base=iptables; rest=${t#iptables};; esac
  if [ "$BACKEND" = legacy ]; then ln -sfn "/usr/sbin/$base-legacy$rest" "$D/alt/$t"
  else ln -sfn "/usr/sbin/$base-nft$rest" "$D/alt/$t"; fi
done
mount --bind "$D/alt" /etc/alternatives
echo ready
exec sleep 100000
"""


def have(*tools: str) -> bool:
    return all(shutil.which(t) for t in tools)


class Cell:
    """One cell of the matrix: its namespaces, its managers, its reconcile."""

    def __init__(self, backend: str, docker: str, manager: str, base: str) -> None:
        self.backend, self.docker, self.manager = backend, docker, manager
        self.dir = base
        self.host = Netns(unique("x"))
        self.procs: list[subprocess.Popen[str]] = []
        sh("ip", "netns", "add", self.host.name)
        sh("ip", "-n", self.host.name, "link", "set", "lo", "up")
        self.keeper = subprocess.Popen(["unshare", "-m", "--propagation", "unchanged", "sh",
                                        "-c", SETUP, "sh", base, backend],
                                       stdout=subprocess.PIPE, text=True)
        assert self.keeper.stdout is not None and self.keeper.stdout.readline().strip() == "ready"
        self.env = base_env()  # this tree's package first, as the fork server has it
        self.agent: subprocess.Popen[str] | None = None
        self.interval = LEGACY_INTERVAL if backend == "legacy" else NFT_INTERVAL
        self.status_port = STATUS_PORT + ALL.index((backend, docker, manager))

    def enter(self) -> list[str]:
        return ["nsenter", f"--mount=/proc/{self.keeper.pid}/ns/mnt",
                f"--net=/run/netns/{self.host.name}", f"--wd={REPO}"]

    def run(self, *args: str, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([*self.enter(), *args], capture_output=True, text=True,
                           timeout=timeout, env=self.env)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: {p.returncode}: {p.stdout}{p.stderr}")
        return p

    def spawn(self, *args: str, log: str) -> subprocess.Popen[str]:
        fh = open(os.path.join(self.dir, log), "w")  # noqa: SIM115 (the process keeps it)
        p = subprocess.Popen([*self.enter(), *args], stdout=fh, stderr=subprocess.STDOUT,
                             text=True, env=self.env)
        self.procs.append(p)
        return p

    def python(self, code: str, *args: str, module: str | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``python -c CODE`` (``-m MODULE``) inside the cell, as :meth:`run` would run it:
        a fork that joins the cell's namespaces (tests/support/nsexec.py)."""
        return nsexec.run(self.host.name, code, *args, module=module, check=False,
                          timeout=timeout, mnt=f"/proc/{self.keeper.pid}/ns/mnt", cwd=REPO,
                          env=self.env)

    def reconcile(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.python("", *args, module="reconciler", timeout=300)

    # -- the agent -----------------------------------------------------------

    def start_agent(self, cfg: str) -> None:
        """``reconcile watch`` inside the cell, JSON logs to agent.log (-vv: every event heard and
        every pass, no-op ones too); wait for its first converged pass."""
        self.agent = self.spawn(sys.executable, "-m", "reconciler", "-vv", "watch", cfg,
                                "--interval", str(self.interval), "--log-format", "json",
                                "--status-addr", f"127.0.0.1:{self.status_port}",
                                log="agent.log")

        def converged() -> bool:
            assert self.agent is not None and self.agent.poll() is None, self.agent_log_text()
            doc = self.status()
            return bool(doc and (doc.get("last_pass") or {}).get("result") in ("ok", "applied")
                        and not doc.get("errors"))

        self._wait(converged, 60, "the agent's first converged pass")
        doc = self.status()
        assert doc is not None
        assert doc["netns_inode"] == os.stat(f"/run/netns/{self.host.name}").st_ino, doc
        assert doc["event_sources"].get("nftables") == "listening", doc["event_sources"]

    def status(self) -> dict[str, Any] | None:
        """The agent's /status, None if it does not answer (ufw's DROP policy after ``iptables
        -F`` drops loopback to it too: only asked before the reloads)."""
        p = self.python(STATUS, f"http://127.0.0.1:{self.status_port}/status", timeout=20)
        if p.returncode != 0:
            return None
        doc: dict[str, Any] = json.loads(p.stdout)
        return doc

    def agent_log(self) -> list[dict[str, Any]]:
        out = []
        with open(os.path.join(self.dir, "agent.log")) as fh:
            for line in fh:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def agent_log_text(self) -> str:
        with open(os.path.join(self.dir, "agent.log")) as fh:
            return fh.read()[-3000:]

    def stop_agent(self) -> int | None:
        """SIGTERM (it finishes the change under way), SIGKILL if it does not exit in 15 s;
        its exit status (None: it had to be killed, or there was none)."""
        if self.agent is None:
            return None
        agent, rc = self.agent, None
        agent.terminate()
        try:
            rc = agent.wait(timeout=15)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        self.procs.remove(agent)
        self.agent = None
        return rc

    # -- managers ------------------------------------------------------------

    def start(self) -> None:
        """The manager first, then dockerd (which registers docker0 with a running firewalld)."""
        if self.manager == "firewalld":
            self.dbus = self.spawn("dbus-daemon", "--system", "--nofork", "--nopidfile",
                                   log="dbus.log")
            self._wait(lambda: self.run("test", "-S", "/run/dbus/system_bus_socket",
                                        check=False).returncode == 0, 20, "the cell's D-Bus")
            self.firewalld = self.spawn("firewalld", "--nofork", "--nopid", "--log-target",
                                        "console", log="firewalld.log")
            self._wait(lambda: self.run("firewall-cmd", "--state", check=False).returncode == 0,
                       60, "firewalld")
        elif self.manager == "ufw":
            self.run("ufw", "default", "deny", "incoming")
            self.run("ufw", "default", "deny", "routed")
            self.run("ufw", "--force", "enable")
        if self.docker == "dockerd":
            self.start_dockerd()

    def start_dockerd(self) -> None:
        self.dockerd = self.spawn(
            "dockerd", "--data-root", os.path.join(self.dir, "docker"), "--exec-root",
            "/run/docker", "--pidfile", "/run/docker.pid", "-H", "unix:///run/docker.sock",
            "--storage-driver", "vfs", "--iptables=true", log="dockerd.log")
        self._wait(lambda: self.run("docker", "-H", "unix:///run/docker.sock", "info",
                                    check=False, timeout=20).returncode == 0, 90, "dockerd")
        self.run("iptables", "-P", "FORWARD", "DROP")  # what dockerd sets on a real host

    def stop_dockerd(self) -> None:
        self.dockerd.terminate()
        try:
            self.dockerd.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.dockerd.kill()
            self.dockerd.wait()
        self.procs.remove(self.dockerd)

    def reloads(self) -> list[tuple[str, Any]]:
        """What each manager of this cell does to the rules of others, as callables."""
        out: list[tuple[str, Any]] = []
        if self.manager == "firewalld":
            out.append(("firewall-cmd --reload", lambda: self.run("firewall-cmd", "--reload")))
        if self.manager == "ufw":
            out.append(("ufw reload", lambda: self.run("ufw", "reload")))
        if self.docker == "dockerd":
            out.append(("dockerd restart", lambda: (self.stop_dockerd(), self.start_dockerd())))
        out.append(("iptables -F", lambda: (self.run("iptables", "-F"),
                                            self.run("iptables", "-t", "nat", "-F"))))
        if self.backend == "nft" and self.manager != "firewalld":
            out.append(("nft flush ruleset", lambda: self.run("nft", "flush", "ruleset")))
        return out

    def _wait(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                logs = {}
                for n in os.listdir(self.dir):
                    if n.endswith(".log"):
                        with open(os.path.join(self.dir, n)) as fh:
                            logs[n] = fh.read()[-800:]
                raise AssertionError(f"timed out waiting for {what}: {logs}")
            time.sleep(0.3)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_agent()  # first: it would put back what destroy removes
        with contextlib.suppress(Exception):
            self.reconcile("destroy", "--yes", "--lock-timeout", "20")
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.keeper.kill()
        self.keeper.wait()
        sh("ip", "netns", "del", self.host.name, check=False)
