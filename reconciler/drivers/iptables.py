"""iptables through ``iptables-save`` / ``iptables-restore --noflush``.

Why iptables and not a table of our own in nftables: Docker (and firewalld,
and most hosts) filter FORWARD through iptables, and in netfilter an ACCEPT
in one base chain does not stop a DROP in another. Only a rule inside the
same ``filter FORWARD`` chain that Docker sets to policy DROP can let our
subnets' traffic through, so we place one jump there and keep everything
else in chains we own (prefix ``RECONCILER-``). Each run changes all owned
chains of a family in one ``iptables-restore`` transaction: atomic, one
process, however many rules change. We use whichever backend the
``iptables`` command on PATH uses (nf_tables on Debian), and refuse to run
when the other backend holds Docker's rules, since the two hide rules from
each other.

See docs/decisions/007-start-up-costs.md.
See docs/decisions/014-iptables-owned-chains.md.
See docs/decisions/035-iptables-legacy-named.md.
See docs/decisions/048-mark-shim.md.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence

from reconciler.domain.errors import DriverError, PreconditionError, TemporaryError
from reconciler.domain.live import LiveChainSet

RESTORE_WAIT_SECONDS = "10"
_TOOLS = {4: ("iptables-save", "iptables-restore", "iptables"),
          6: ("ip6tables-save", "ip6tables-restore", "ip6tables")}


_TOKEN = re.compile(r'"([^"]*)"|(\S+)')


def _split(line: str) -> tuple[str, ...]:
    """Split iptables-save lines as shlex.split does; a regex for the usual quoting, 4x faster."""
    if "\\" in line or "'" in line:
        return tuple(shlex.split(line))
    return tuple(plain or quoted for quoted, plain in _TOKEN.findall(line))


_PLAIN = re.compile(r'^[^\s"\'\\]+$')


def _quote(token: str) -> str:
    """Quote a token as iptables-restore reads it back."""
    if _PLAIN.match(token):
        return token
    return '"' + token.replace("\\", "\\\\").replace('"', '\\"') + '"'


def parse_save(text: str) -> LiveChainSet:
    """Parse ``iptables-save`` output (pure).

    Each rule is kept as its tokens after ``-A CHAIN``, joined by single spaces,
    in a canonical quoting: plain tokens bare, any token with a space or quote in
    double quotes. Ours never need quotes, so they compare equal to what the
    planner renders; anyone else's can be written back into a restore script
    (``-D CHAIN <rule>``) exactly as it was.
    """
    chains: dict[tuple[str, str], list[tuple[str, ...]]] = {}
    policies: dict[tuple[str, str], str] = {}
    table = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or line == "COMMIT":
            continue
        if line.startswith("*"):
            table = line[1:]
            continue
        if line.startswith(":"):
            name, policy, *_ = line[1:].split()
            chains.setdefault((table, name), [])
            policies[(table, name)] = policy
            continue
        if line.startswith("-A "):
            tokens = _split(line)
            chains.setdefault((table, tokens[1]), []).append(tokens[2:])
    return LiveChainSet(
        available=True,
        chains={k: tuple(" ".join(_quote(t) for t in r) for r in v) for k, v in chains.items()},
        policies=policies,
    )


def backend_of(version_output: str) -> str:
    """Read the backend from ``iptables -V``: "nf_tables" or "legacy"."""
    if "nf_tables" in version_output:
        return "nf_tables"
    return "legacy"


class IptablesDriver:
    """Reads and atomically rewrites the rules of one address family."""

    def __init__(self, family: int) -> None:
        self.family = family
        self.save_cmd, self.restore_cmd, self.cmd = _TOOLS[family]

    def available(self) -> bool:
        return all(shutil.which(c) is not None for c in (self.save_cmd, self.restore_cmd))

    def observe(self) -> LiveChainSet:
        return self.start_observe()()

    def start_observe(self) -> Callable[[], LiveChainSet]:
        """Start ``iptables-save`` and return what waits for it and parses its output.

        The observation reads the kernel's links and namespaces while the save runs in
        its own process (on another CPU where there is one): the two saves of an
        observation were ~25 ms of wall time spent waiting on them one after the other.
        """
        if not self.available():
            unavailable = LiveChainSet(available=False, error=f"{self.save_cmd} is not installed")
            return lambda: unavailable
        try:
            # surrogateescape: someone's rule comment need not be UTF-8 (it is written
            # back byte for byte by restore, which encodes the same way)
            proc = subprocess.Popen([self.save_cmd], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    errors="surrogateescape")
        except OSError as exc:
            failed = LiveChainSet(available=False, error=f"{self.save_cmd}: {exc}")
            return lambda: failed

        def finish() -> LiveChainSet:
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired as exc:
                proc.kill()
                proc.communicate()
                return LiveChainSet(available=False, error=f"{self.save_cmd}: {exc}")
            if proc.returncode != 0:
                msg = (stderr.strip().splitlines() or ["failed"])[-1]
                return LiveChainSet(available=False, error=f"{self.save_cmd}: {msg}")
            return parse_save(stdout)

        return finish

    def restore(self, script: str) -> None:
        """Apply a ``--noflush`` restore script as one transaction."""
        try:
            out = subprocess.run([self.restore_cmd, "--noflush", "--wait", RESTORE_WAIT_SECONDS],
                                 input=script, capture_output=True, text=True,
                                 errors="surrogateescape", timeout=60)
        except FileNotFoundError:
            raise PreconditionError(f"{self.restore_cmd} is not installed") from None
        except subprocess.TimeoutExpired:
            raise TemporaryError(f"{self.restore_cmd} timed out", delay=1.0) from None
        if out.returncode == 4 or "xtables lock" in out.stderr:
            raise TemporaryError(f"{self.restore_cmd}: xtables lock busy", delay=0.5)
        if out.returncode != 0:
            detail = " ".join(out.stderr.split())[:300] or f"exit status {out.returncode}"
            raise DriverError(f"{self.restore_cmd} failed: {detail}")

    def shim(self, legacy: bool, chain: str, rule: str, position: int) -> None:
        """Insert the mark shim at ``position`` of ``chain`` (filter), or delete it (0), with
        ``iptables`` itself (``iptables-legacy`` for ``legacy``): the rule is then exactly as
        that tool writes it, so the chain's owner can still ``-C``, ``-D`` and save it (an
        nft expression of our own there would make ``iptables`` call the chain incompatible).
        A delete of a rule already gone does nothing.

        See docs/decisions/048-mark-shim.md.
        """
        cmd = self.cmd + ("-legacy" if legacy else "")
        tokens = _split(rule)
        if position == 0:
            if self._run_shim(cmd, ["-C", chain, *tokens], check=False) != 0:
                return
            self._run_shim(cmd, ["-D", chain, *tokens])
        else:
            self._run_shim(cmd, ["-I", chain, str(position), *tokens])

    def _run_shim(self, cmd: str, args: list[str], *, check: bool = True) -> int:
        try:
            out = subprocess.run([cmd, "-w", RESTORE_WAIT_SECONDS, "-t", "filter", *args],
                                 capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise PreconditionError(f"{cmd} is not installed") from None
        except subprocess.TimeoutExpired:
            raise TemporaryError(f"{cmd} timed out", delay=1.0) from None
        if out.returncode == 4 or "xtables lock" in out.stderr:
            raise TemporaryError(f"{cmd}: xtables lock busy", delay=0.5)
        if check and out.returncode != 0:
            detail = " ".join(out.stderr.split())[:300] or f"exit status {out.returncode}"
            raise DriverError(f"{cmd} {' '.join(args[:2])}: {detail}")
        return out.returncode

    def backend(self) -> str | None:
        try:
            out = subprocess.run([self.cmd, "-V"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return backend_of(out.stdout + out.stderr)

    def observe_legacy(self) -> LiveChainSet | None:
        """Read iptables-legacy's rules beside the nf_tables backend we write, or None: no
        legacy table in this namespace (one /proc read, no process: the usual host), or legacy is
        the backend we write ourselves (its rules are then what :meth:`observe` reads).

        Both backends filter (and NAT) every packet: a legacy DROP on a declared path stops
        it whatever our rules say, and nothing in nf_tables shows it. The legacy tables have
        no change notification: this is read on every pass and plan.
        """
        if not _legacy_tables(self.family) or active_backend(self.family) != "nf_tables":
            return None
        save = ("iptables" if self.family == 4 else "ip6tables") + "-legacy-save"
        if shutil.which(save) is None:
            return LiveChainSet(available=False, error=f"{save} is not installed")
        try:
            out = subprocess.run([save], capture_output=True, text=True,
                                 errors="surrogateescape", timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return LiveChainSet(available=False, error=f"{save}: {exc}")
        if out.returncode != 0:
            msg = (out.stderr.strip().splitlines() or ["failed"])[-1]
            return LiveChainSet(available=False, error=f"{save}: {msg}")
        return parse_save(out.stdout)


def other_backend_problem(active: str, docker_chains_elsewhere: Sequence[str]) -> str | None:
    """Return a clear message when Docker's chains live in the backend we are not using."""
    if not docker_chains_elsewhere:
        return None
    other = "legacy" if active == "nf_tables" else "nf_tables"
    return (f"iptables uses the {active} backend but Docker's chains "
            f"({', '.join(docker_chains_elsewhere[:3])}) are in the {other} backend; the two hide "
            "rules from each other. Switch `update-alternatives --config iptables` to match "
            "Docker, then run again")


#: the kernel's list of iptables-legacy tables in the current network namespace
LEGACY_TABLES = {4: "/proc/net/ip_tables_names", 6: "/proc/net/ip6_tables_names"}


def _legacy_tables(family: int) -> bool:
    """Tell whether this namespace holds any iptables-legacy table (no process: a /proc read)."""
    try:
        with open(LEGACY_TABLES[family]) as fh:
            return bool(fh.read().strip())
    except OSError:
        return False  # x_tables not loaded: no legacy table anywhere


def active_backend(family: int) -> str | None:
    """Return "nf_tables" or "legacy": the backend of the ``iptables-save`` on PATH (where its link
    leads: ``xtables-nft-multi``), else what ``iptables -V`` says; None if neither tells."""
    save = _TOOLS[family][0]
    real = os.path.basename(os.path.realpath(shutil.which(save) or save))
    if "legacy" in real:
        return "legacy"
    if "nft" in real:
        return "nf_tables"
    return IptablesDriver(family).backend()


def docker_chains(chains: LiveChainSet) -> list[str]:
    """Return the names of Docker's chains (``DOCKER``, ``DOCKER-USER``, ...) in one backend's
    rules."""
    return sorted({c for (_t, c) in chains.chains if c.startswith("DOCKER")})


def check_backend_mismatch(family: int = 4) -> str | None:
    """Detect EDGE-CASES #26: our iptables and Docker's rules on different backends.

    dockerd writes its chains with whichever ``iptables`` it runs: with the nf_tables
    backend they are tables ``ip filter``/``ip nat`` in nftables, which iptables-nft-save
    shows and iptables-legacy-save does not; with the legacy backend they are x_tables,
    listed in /proc/net/ip_tables_names, which only iptables-legacy-save shows. Rules in
    the two hide each other, and an ACCEPT of ours in one cannot undo Docker's FORWARD
    DROP in the other: refuse, naming the chains. Per network namespace, as Docker's
    rules are (a ``--netns`` sandbox never sees the host's dockerd). Cheap when there is
    nothing to find: the nf_tables side asks the kernel's table list first.
    """
    active = active_backend(family)
    if active is None:
        return None
    if active == "nf_tables" and not _legacy_tables(family):
        return None
    prefix = "iptables" if family == 4 else "ip6tables"
    other_save = f"{prefix}-legacy-save" if active == "nf_tables" else f"{prefix}-nft-save"
    if shutil.which(other_save) is None:
        return None
    try:
        out = subprocess.run([other_save], capture_output=True, text=True,
                             errors="surrogateescape", timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    theirs = docker_chains(parse_save(out.stdout))
    if not theirs:
        return None
    # Docker's chains in both backends (a switch of alternatives left the old ones): ours
    # holds them too, so Docker runs with our backend now
    if docker_chains(IptablesDriver(family).observe()):
        return None
    return other_backend_problem(active, theirs)
