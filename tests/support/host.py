"""The sandbox "host" of an integration test, names unique to this run, and ``sh``.

The fixture that makes a sandbox (``host_ns``) and the leak check live in
``tests/integration/conftest.py``; this module holds what tests call on them.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tests.support import nsexec

if TYPE_CHECKING:
    from tests.support.cli import Result

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")

#: every name a test makes starts with this, so leak checks see only this process's objects
#: (imported once per pytest process: each xdist worker has its own)
SESSION = f"rt{secrets.token_hex(2)}"


def is_root() -> bool:
    return os.geteuid() == 0


def unique(prefix: str = "") -> str:
    """A name unique to this test run, at most 15 characters (IFNAMSIZ)."""
    return f"{SESSION}{prefix}-{secrets.token_hex(3)}"


def sh(*args: str, check: bool = True, input: str | None = None, cwd: str | None = None,
       timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a command (never a shell), capture its output as text; raise on failure."""
    return subprocess.run(list(args), capture_output=True, text=True, check=check, input=input,
                          timeout=timeout, cwd=cwd)


def write(tmp_path: object, name: str, text: str) -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as fh:
        fh.write(text)
    return path


def save(path: str, text: str) -> None:
    """Save the way editors do: a temp file in the same directory, then rename."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, every: float = 0.05,
             what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something true (returned); AssertionError at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def ip_json(ns: str, *args: str) -> list[dict[str, Any]]:
    """``ip -n NS -j -d ARGS`` parsed: the independent view tests check against."""
    out = sh("ip", "-n", ns, "-j", "-d", *args).stdout
    return json.loads(out) if out.strip() else []


def ip_link(ns: str, name: str) -> dict[str, Any] | None:
    for link in ip_json(ns, "link", "show"):
        if link["ifname"] == name:
            return link
    return None


def netns_names() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


def host_link_names() -> set[str]:
    """Names of the links of the namespace pytest runs in (the machine's own)."""
    return {link["ifname"] for link in json.loads(sh("ip", "-j", "link", "show").stdout)}


class Netns:
    """A throwaway network namespace acting as "the host" for one test.

    Namespaces the test makes besides (an allocation's, a client's) are named
    :meth:`ns` so that teardown finds them by the sandbox's prefix.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def ns(self, suffix: str) -> str:
        """The name of another namespace of this test (removed with the sandbox)."""
        return f"{self.name}-{suffix}"

    def leftovers(self) -> list[str]:
        """This sandbox's namespaces under /run/netns (itself and :meth:`ns` names)."""
        return sorted(n for n in netns_names()
                      if n == self.name or n.startswith(self.name + "-"))

    def run(self, *args: str, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        return sh("nsenter", f"--net=/run/netns/{self.name}", *args, check=check, input=input)

    def ip_json(self, *args: str) -> list[dict[str, Any]]:
        return ip_json(self.name, *args)

    def link(self, name: str) -> dict[str, Any] | None:
        return ip_link(self.name, name)

    def mtu(self, name: str) -> int | None:
        link = self.link(name)
        return int(link["mtu"]) if link else None

    def bridges(self) -> set[str]:
        out = sh("ip", "-n", self.name, "-j", "link", "show", "type", "bridge").stdout
        return {lk["ifname"] for lk in json.loads(out or "[]")}

    def addrs(self, name: str) -> list[str]:
        for link in self.ip_json("addr", "show"):
            if link["ifname"] == name:
                return sorted(f"{a['local']}/{a['prefixlen']}" for a in link["addr_info"]
                              if a.get("scope") != "link")
        return []

    def iptables_save(self, family: int = 4) -> str:
        return self.run("iptables-save" if family == 4 else "ip6tables-save").stdout

    def our_rules(self, family: int = 4) -> str:
        """Read our nftables table (``nft -j``) in the planner's rule form, one ``-A CHAIN rule``
        line per rule, as the iptables chains of earlier versions read."""
        import json

        from reconciler.domain import nftable
        from reconciler.planner import nftview
        out = self.run("nft", "-j", "list", "table", "inet", "reconciler", check=False)
        if out.returncode != 0:
            return ""
        state = nftable.parse_table(json.loads(out.stdout))
        chains = nftview.view(state, family).chains
        text = "".join(f"-A {chain} {r}\n" for (_t, chain), rules in sorted(chains.items())
                       for r in rules)
        # quoted as iptables-save quotes a comment with a colon
        return re.sub(r"--comment (reconciler:\S+)", r'--comment "\1"', text)

    def firewall_text(self, family: int = 4) -> str:
        """Return ``iptables-save`` followed by our table's rules (:meth:`our_rules`)."""
        return self.iptables_save(family) + self.our_rules(family)

    def inode(self) -> int:
        return os.stat(f"/run/netns/{self.name}").st_ino

    def lock_path(self) -> str:
        from reconciler.engine.lock import LOCK_DIR

        return os.path.join(LOCK_DIR, f"netns-{self.inode()}.lock")

    def reconcile(self, *args: str, **kw: Any) -> Result:
        from tests.support.cli import reconcile

        return reconcile(*args, netns=self.name, **kw)


def forget_run_files(inode: int | None) -> None:
    """Remove what a killed reconciler of namespace ``inode`` left under /run/reconciler.

    Lock files are unlinked by whoever releases them, and the plan socket by the
    agent that stops; a test that SIGKILLs one leaves them behind. Held locks stay.
    """
    if inode is None:
        return
    run_dir = os.environ.get("RECONCILER_LOCK_DIR", "/run/reconciler")
    for name in (f"netns-{inode}.lock", f"plan-{inode}.lock", f"plan-{inode}.sock",
                 f"status-{inode}.sock",
                 f"probe-vantage-{inode}.lock"):
        path = os.path.join(run_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if name.endswith(".lock"):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except OSError:
            pass  # held by a live process, or gone meanwhile
        finally:
            os.close(fd)


def remove_vantage(inode: int, *, orphan: bool = False) -> str | None:
    """Remove the probes' external vantage of the host namespace ``inode`` (``rcprobe-INODE``,
    only when it carries the vantage's mark) and that host's run files; its name, or None
    when there was none.

    Its name holds the host's inode, and nothing else ties it to the host: a host deleted
    while a prober that was SIGKILLed (or is still running) held it leaves it under
    /run/netns for good, its veth gone with the host. A reboot takes it away with the rest;
    a test that deletes a sandbox (or simulates a reboot of one) must too. ``orphan``: the
    host of that inode is gone and the inode may be another's since, so only a vantage
    whose veth went with a dead host (no ``eth0``) is removed.
    """
    from reconciler.domain.ownership import PROBE_VANTAGE_ALIAS, probe_vantage_names
    from reconciler.drivers import netns
    from reconciler.drivers.probe import vantage

    name = probe_vantage_names(str(inode))[0]
    if name not in netns_names() or vantage.namespace_mark(name) != PROBE_VANTAGE_ALIAS:
        return None
    if orphan and sh("ip", "-n", name, "link", "show", "dev", "eth0",
                     check=False).returncode == 0:
        return None
    netns.delete(name)
    forget_run_files(inode)
    return name


#: prints ``<inode>-<cookie>`` of the namespace it runs in (SO_NETNS_COOKIE, Linux >= 5.14)
_ID = ("import os,socket,struct\n"
       "s=socket.socket(socket.AF_UNIX,socket.SOCK_DGRAM)\n"
       "c=struct.unpack('=Q',s.getsockopt(socket.SOL_SOCKET,71,8))[0]\n"
       "print(f\"{os.stat('/proc/self/ns/net').st_ino}-{c}\")")


def netns_id(name: str) -> str:
    """Return the id the reconciler marks a sandbox's allocations with: ``<inode>-<cookie>``
    of ``/run/netns/NAME``, read by a process of its own in that namespace (not our code)."""
    return nsexec.run(name, _ID).stdout.strip()
