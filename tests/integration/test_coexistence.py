"""The reconciler beside whatever manages the firewall: the coexistence matrix.

{iptables-nft, iptables-legacy} x {dockerd with FORWARD DROP, no dockerd} x {no manager,
firewalld, ufw with default deny}. Each cell is a network namespace of its own (the
cell's "host", with a client routed to it) and a mount namespace of its own: a private
/run (with /run/netns still shared, so allocation namespaces stay visible), private
copies of /etc/alternatives (the iptables backend), /etc/firewalld, /etc/ufw and
/etc/default/ufw. firewalld gets its own D-Bus system bus there; dockerd its own
data-root, exec-root, pidfile and socket. The machine's own firewall is never touched.

In every cell: port maps are reachable from the client, from the host and from
127.0.0.1; undeclared ports (of the host, and of the allocation's own address) are not;
the allocation reaches the client (its own traffic: firewalld rejects it until the
bridge is in a zone that accepts it, which apply refuses to leave unsaid);
and after each reload (the manager's, a dockerd restart, ``iptables -F``, ``nft flush
ruleset``) the next apply heals. CI runs the six ``CI_CELLS`` (every pair of values of two
axes meets in one); ``RECONCILER_SOAK=1`` all twelve.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import REPO, Netns, sh, unique, write
from tests.figures import SOAK, report
from tests.integration.traffic import CLIENT_IP, HOST_IP, client_of, fetch, listening, scan

pytestmark = pytest.mark.root

BACKENDS = ("nft", "legacy")
DOCKER = ("dockerd", "no-dockerd")
MANAGERS = ("none", "firewalld", "ufw")
ALL = [(b, d, m) for b in BACKENDS for d in DOCKER for m in MANAGERS]
#: CI's six: every pair of values of any two axes meets in one of them (about 70 s here;
#: all twelve take about 160 s)
CI_CELLS = [("nft", "dockerd", "none"), ("legacy", "no-dockerd", "none"),
            ("legacy", "dockerd", "firewalld"), ("nft", "no-dockerd", "firewalld"),
            ("nft", "dockerd", "ufw"), ("legacy", "no-dockerd", "ufw")]
CELLS = ALL if SOAK else CI_CELLS
RESULTS: dict[tuple[str, str, str], str] = {}
TRIED: set[tuple[str, str, str]] = set()

BRIDGE = "rcox0"
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


def _have(*tools: str) -> bool:
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
        self.env = {**os.environ, "PYTHONPATH": REPO}

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

    def reconcile(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(sys.executable, "-m", "reconciler", *args, check=False, timeout=300)

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
            self.reconcile("destroy", "--lock-timeout", "20")
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


@pytest.fixture(scope="module", autouse=True)
def matrix_table(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the cells: the matrix as a [figures] table of what each cell that ran did."""
    yield
    if not RESULTS:
        return
    report(request, f"coexistence matrix, {len(RESULTS)} of {len(ALL)} cells passed"
                    f"{'' if SOAK else ' (CI runs 6; RECONCILER_SOAK=1 all 12)'}:")
    for key in ALL:
        state = RESULTS.get(key, "FAILED" if key in TRIED else "not run")
        report(request, f"  {key[0]:6} | {key[1]:10} | {key[2]:9} | {state}")


@pytest.fixture
def cell(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Cell]:
    backend, docker, manager = request.param
    need = {"legacy": ("iptables-legacy",), "nft": ("iptables-nft", "nft")}[backend]
    need += {"dockerd": ("dockerd", "docker"), "no-dockerd": ()}[docker]
    need += {"none": (), "firewalld": ("firewalld", "firewall-cmd", "dbus-daemon"),
             "ufw": ("ufw",)}[manager]
    if not _have("unshare", "nsenter", *need):
        pytest.skip(f"needs {', '.join(need)} (scripts/install.sh --test)")
    TRIED.add((backend, docker, manager))
    c = Cell(backend, docker, manager, str(tmp_path))
    try:
        c.start()
        yield c
    finally:
        c.close()


def _check(c: Cell, alloc: str, addr: str, client: Netns) -> list[str]:
    """What does not hold in this cell right now (empty: all holds)."""
    bad = []
    if scan(client, HOST_IP, [22, 80, 443, 1080, 1443]) != [1080]:
        bad.append(f"client->host ports {scan(client, HOST_IP, [22, 80, 443, 1080, 1443])}")
    if scan(client, addr, [22, 80, 443]) != []:
        bad.append(f"client->allocation {scan(client, addr, [22, 80, 443])}")
    if fetch(c.host, HOST_IP, 1080) != "ok 80":
        bad.append("host->host address:1080")
    if fetch(c.host, "127.0.0.1", 1443) != "ok 443":
        bad.append("host->127.0.0.1:1443")
    if fetch(Netns(alloc), CLIENT_IP, 9999) != "ok 9999":  # what the allocation starts
        bad.append("allocation->client:9999")
    return bad


def _converge(c: Cell, cfg: str) -> tuple[int, str]:
    """apply; with firewalld, the one command the refusal names first. (rc, what it took)"""
    r = c.reconcile("apply", cfg)
    took = "apply"
    if r.returncode != 0 and "firewall-cmd --permanent" in r.stderr:
        cmd = r.stderr.split("run `", 1)[1].split("`", 1)[0]
        assert r.stderr.count("\n") == 1, r.stderr
        c.run("sh", "-c", cmd)
        r = c.reconcile("apply", cfg)
        took = f"refused, `{cmd.split(' && ')[0]} ...`, apply"
    assert r.returncode == 0, r.stdout + r.stderr
    return r.returncode, took


@pytest.mark.parametrize("cell", CELLS, indirect=True, ids=["/".join(c) for c in CELLS])
def test_coexistence_cell(cell: Cell, request: pytest.FixtureRequest) -> None:
    c = cell
    a = unique("x")
    cfg = write(c.dir, "s.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: cox, bridge: {BRIDGE}, cidr: 10.219.0.0/24}}]
allocs:
  - id: {a}
    subnet: cox
    ports: [{{host: 1080, to: 80}}, {{host: 1443, to: 443, host_ip: 127.0.0.1}}]
""")
    t0 = time.monotonic()
    _rc, took = _converge(c, cfg)
    assert c.run("iptables", "-V").stdout.count("legacy" if c.backend == "legacy" else "nf_tables")
    addr = next(x["local"] for x in Netns(a).ip_json("addr", "show", "eth0")[0]["addr_info"]
                if x["family"] == "inet")
    healed = []
    with client_of(c.host) as client, listening(a, 22, 80, 443), listening(client.name, 9999):
        bad = _check(c, a, addr, client)
        assert not bad, f"after {took}: {bad}"
        if c.manager == "firewalld":
            # why the refusal: out of the trusted zone (runtime only), firewalld's reject wins
            c.run("firewall-cmd", "--zone=trusted", f"--remove-interface={BRIDGE}")
            assert fetch(Netns(a), CLIENT_IP, 9999) == "", "firewalld let it through anyway"
            assert "firewall-cmd --permanent" in c.reconcile("apply", cfg).stderr
            c.run("firewall-cmd", "--zone=trusted", f"--add-interface={BRIDGE}")
        for what, reload in c.reloads():
            reload()
            broken = _check(c, a, addr, client)
            plan = c.reconcile("plan", cfg)
            _converge(c, cfg)
            bad = _check(c, a, addr, client)
            assert not bad, f"after {what} and apply: {bad}"
            healed.append(f"{what}: {'broke ' + str(len(broken)) if broken else 'kept'}"
                          f"{', plan ' + str(plan.returncode)}, healed")
    key = (c.backend, c.docker, c.manager)
    RESULTS[key] = f"ok ({took}; {'; '.join(healed)}) {time.monotonic() - t0:.0f}s"
    report(request, f"{'/'.join(key)}: {RESULTS[key]}")
