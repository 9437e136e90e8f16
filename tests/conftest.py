"""Shared fixtures: throwaway network namespaces, the CLI, and leak checks."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")


def is_root() -> bool:
    return os.geteuid() == 0


#: where pytest's tmp_path directories go when /tmp is the default: the watch agent refuses
#: desired-state files under a directory others can write (the sticky /tmp included), so the
#: tests keep theirs in one only root can write
TRUSTED_TEMPROOT = "/var/lib/reconciler-tests"


def pytest_configure(config: pytest.Config) -> None:
    if is_root() and not os.environ.get("PYTEST_DEBUG_TEMPROOT") and \
            config.option.basetemp is None:
        os.makedirs(TRUSTED_TEMPROOT, mode=0o700, exist_ok=True)
        os.chmod(TRUSTED_TEMPROOT, 0o700)
        os.environ["PYTEST_DEBUG_TEMPROOT"] = TRUSTED_TEMPROOT
    if is_root() and not os.environ.get("RECONCILER_STATE_DIR"):
        # pending changes and journals of this run's sandboxes: never the host's own
        os.makedirs(TRUSTED_TEMPROOT, mode=0o700, exist_ok=True)
        os.environ["RECONCILER_STATE_DIR"] = os.path.join(TRUSTED_TEMPROOT, f"state-{SESSION}")
        config.add_cleanup(lambda: shutil.rmtree(os.environ["RECONCILER_STATE_DIR"],
                                                 ignore_errors=True))


#: every name a test makes starts with this, so leak checks see only this run's objects
SESSION = f"rt{secrets.token_hex(2)}"


def unique(prefix: str = "") -> str:
    """A name unique to this test run, at most 15 characters (IFNAMSIZ)."""
    return f"{SESSION}{prefix}-{secrets.token_hex(3)}"


def sh(*args: str, check: bool = True,
       input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, input=input,
                          timeout=120)


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def all(self) -> str:
        return self.out + self.err


def reconcile(*args: str, netns: str | None = None, timeout: float = 300,
              env: dict[str, str] | None = None) -> Result:
    """Run the CLI the way a user does: a separate process."""
    cmd = [sys.executable, "-m", "reconciler"]
    if netns:
        cmd += ["--netns", netns]
    full_env = dict(os.environ)
    full_env.update(env or {})
    # stdin is no terminal (``pytest -s`` keeps the caller's): ``destroy`` asks nothing
    p = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout,
                       env=full_env, stdin=subprocess.DEVNULL)
    return Result(p.returncode, p.stdout, p.stderr)


class Netns:
    """A throwaway network namespace acting as "the host" for one test."""

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, *args: str, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        return sh("nsenter", f"--net=/run/netns/{self.name}", *args, check=check, input=input)

    def ip_json(self, *args: str) -> list[dict]:  # type: ignore[type-arg]
        out = sh("ip", "-n", self.name, "-j", "-d", *args).stdout
        return json.loads(out) if out.strip() else []

    def link(self, name: str) -> dict | None:  # type: ignore[type-arg]
        for link in self.ip_json("link", "show"):
            if link["ifname"] == name:
                return link
        return None

    def addrs(self, name: str) -> list[str]:
        for link in self.ip_json("addr", "show"):
            if link["ifname"] == name:
                return sorted(f"{a['local']}/{a['prefixlen']}" for a in link["addr_info"]
                              if a.get("scope") != "link")
        return []

    def iptables_save(self, family: int = 4) -> str:
        return self.run("iptables-save" if family == 4 else "ip6tables-save").stdout

    def reconcile(self, *args: str, **kw: object) -> Result:
        return reconcile(*args, netns=self.name, **kw)  # type: ignore[arg-type]


def _netns_names() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


def forget_run_files(inode: int | None) -> None:
    """Remove what a killed reconciler of namespace ``inode`` left under /run/reconciler.

    Lock files are unlinked by whoever releases them, and the plan socket by the
    agent that stops; a test that SIGKILLs one leaves them behind. Held locks stay.
    """
    import fcntl

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


@pytest.fixture
def host_ns() -> Iterator[Netns]:
    """A fresh network namespace standing in for the host; removed even on failure."""
    if not is_root():
        pytest.skip("needs root")
    name = unique()
    before = _netns_names()
    sh("ip", "netns", "add", name)
    sh("ip", "-n", name, "link", "set", "lo", "up")
    inode = os.stat(f"/run/netns/{name}").st_ino
    ns = Netns(name)
    try:
        yield ns
    finally:
        # Allocation namespaces are global (/run/netns/ID) although the host is a
        # sandbox: tear down what the reconciler made there before the sandbox goes.
        if _netns_names() - before - {name}:
            reconcile("destroy", "--lock-timeout", "20", netns=name, timeout=120)
        sh("ip", "netns", "del", name, check=False)
        forget_run_files(inode)


@pytest.fixture(autouse=True)
def no_leaked_namespaces(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves a new /run/netns entry behind fails."""
    before = _netns_names()
    yield
    leaked = {n for n in _netns_names() - before if n.startswith(SESSION)}
    if leaked:
        for n in leaked:
            sh("ip", "netns", "del", n, check=False)
        pytest.fail(f"test leaked network namespaces: {sorted(leaked)}")


def write(tmp_path: object, name: str, text: str) -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as fh:
        fh.write(text)
    return path
