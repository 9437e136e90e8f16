"""The systemd units in examples/systemd run valid commands and pass systemd-analyze."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from typing import Any

import pytest

from reconciler.ui.parser import build_parser
from tests.support.host import EXAMPLES

UNIT = os.path.join(EXAMPLES, "systemd", "reconciler.service")


def _unit_lines() -> list[str]:
    with open(UNIT) as fh:
        return [ln.strip() for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]


def test_systemd_unit_runs_a_valid_watch_command() -> None:
    import shlex

    from reconciler.ui.parser import build_parser

    exec_start = [ln for ln in _unit_lines() if ln.startswith("ExecStart=")]
    assert len(exec_start) == 1
    argv = shlex.split(exec_start[0].removeprefix("ExecStart="))
    assert os.path.basename(argv[0]) == "reconcile"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "watch" and args.status_addr.startswith("127.0.0.1:")
    # a private mount namespace would hide the /run/netns mounts of allocations
    for opt in ("PrivateTmp", "ProtectSystem", "ProtectHome", "ReadOnlyPaths", "MountFlags",
                "PrivateMounts", "TemporaryFileSystem", "BindPaths"):
        assert not any(ln.startswith(opt + "=") for ln in _unit_lines()), opt


def test_systemd_unit_starts_the_agent_whatever_the_record_and_lets_it_see_holders() -> None:
    """A corrupt or unrevertable pending record must not keep the agent from starting (it
    reports the record itself, in its status and at every pass); and a namespace held by a
    process of another user is found only with CAP_SYS_PTRACE (/proc/PID/ns/net)."""
    pre = [ln for ln in _unit_lines() if ln.startswith("ExecStartPre=")]
    assert pre and all(ln.removeprefix("ExecStartPre=").startswith("-") for ln in pre), pre
    caps = [ln for ln in _unit_lines() if ln.startswith("CapabilityBoundingSet=")]
    assert len(caps) == 1 and "CAP_SYS_PTRACE" in caps[0].split("=", 1)[1].split()
    # the plan agent's NETLINK_LISTEN_ALL_NSID (without it: EPERM, and plans in-process)
    assert "CAP_NET_BROADCAST" in caps[0].split("=", 1)[1].split()


def test_systemd_unit_verifies(tmp_path: Any) -> None:
    import shutil
    import subprocess
    import sys

    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze")
    with open(UNIT) as fh:
        text = fh.read().replace("/usr/local/bin/reconcile", f"{sys.executable} -m reconciler")
    unit = tmp_path / "reconciler.service"
    unit.write_text(text)
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    problems = [ln for ln in (p.stdout + p.stderr).splitlines() if "reconciler.service" in ln]
    assert p.returncode == 0 and not problems, p.stdout + p.stderr


UNITS = os.path.join(EXAMPLES, "systemd")


def test_the_units_revert_an_overdue_change_at_boot() -> None:
    for unit, key in (("reconciler.service", "ExecStartPre="),
                      ("reconciler-revert.service", "ExecStart=")):
        with open(os.path.join(UNITS, unit)) as fh:
            lines = [ln.strip() for ln in fh if ln.startswith(key)]
        assert len(lines) == 1, unit
        argv = shlex.split(lines[0].removeprefix(key))
        args = build_parser().parse_args(argv[1:])
        assert args.command == "revert" and args.if_overdue, unit


def test_the_revert_unit_verifies(tmp_path: Any) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze")
    with open(os.path.join(UNITS, "reconciler-revert.service")) as fh:
        text = fh.read().replace("/usr/local/bin/reconcile", f"{sys.executable} -m reconciler")
    unit = tmp_path / "reconciler-revert.service"
    unit.write_text(text)
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    problems = [ln for ln in (p.stdout + p.stderr).splitlines() if "reconciler-revert" in ln]
    assert p.returncode == 0 and not problems, p.stdout + p.stderr


def test_the_workload_unit_joins_the_allocation_and_verifies(tmp_path: Any) -> None:
    """docs/workloads.md: a service in an allocation's namespace (NetworkNamespacePath=);
    running it needs systemd as the init, which tests/integration/allocs/test_workloads.py
    does where it is."""
    with open(os.path.join(UNITS, "alloc-workload@.service")) as fh:
        text = fh.read()
    assert "NetworkNamespacePath=/run/netns/%i" in text.splitlines()
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze")
    unit = tmp_path / "alloc-workload@web-1.service"
    unit.write_text(text)
    with open(UNIT) as fh:  # what it requires, beside it
        agent = fh.read().replace("/usr/local/bin/reconcile", f"{sys.executable} -m reconciler")
    (tmp_path / "reconciler.service").write_text(agent)
    p = subprocess.run(["systemd-analyze", "verify", str(unit), str(tmp_path / "reconciler.service")],
                       capture_output=True, text=True, timeout=60)
    problems = [ln for ln in (p.stdout + p.stderr).splitlines() if "alloc-workload" in ln]
    assert p.returncode == 0 and not problems, p.stdout + p.stderr
