"""A mount namespace whose /run/netns hides the namespaces mounted before it is refused.

Built as the coexistence cells once built theirs: a private /run with /run/netns bound
back without its submounts. ``plan``, ``apply`` and ``gc`` refuse in one line, before
any change; ``ip`` and the files show nothing changed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from reconciler.domain.ownership import alloc_veth_name
from tests.support.allocs import subnet_config as _config
from tests.support.cli import Result
from tests.support.host import REPO, Netns, unique
from tests.support.privaterun import private_run

pytestmark = pytest.mark.root




# ------------------------------------------------------------------ item 3: mount namespaces

IS_NAMESPACE = ("import os,sys\n"
                "print(os.stat(sys.argv[1]).st_dev == os.stat('/proc/self/ns/net').st_dev)")


@contextlib.contextmanager
def hiding_cell(tmp_path: Any) -> Iterator[int]:
    """The pid whose mount namespace is the cell; the cell goes with it (its mounts too)."""
    keeper = private_run(str(tmp_path))
    try:
        yield keeper.pid
    finally:
        keeper.kill()
        keeper.wait()


def in_cell(pid: int, host: Netns, *args: str) -> Result:
    p = subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", f"--net=/run/netns/{host.name}",
                        *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": REPO}, stdin=subprocess.DEVNULL)
    return Result(p.returncode, p.stdout, p.stderr)


def test_a_mount_namespace_that_hides_earlier_namespaces_is_refused_before_any_change(
        host_ns: Netns, tmp_path: Any) -> None:
    """The namespaces mounted before the bind are empty files in the cell: the planner
    would read the live allocation as gone, delete its veth and fail on the busy file.
    Refused in one line instead, by plan and apply, and nothing changes."""
    aid, bridge = unique("m") + "-a", unique("b")
    path = _config(tmp_path, bridge, "10.231.7.0/24", [{"id": aid}])
    assert host_ns.reconcile("apply", "--no-probe", path).rc == 0
    veth = alloc_veth_name(aid)
    with hiding_cell(tmp_path) as cell:
        seen = in_cell(cell, host_ns, sys.executable, "-c", IS_NAMESPACE, f"/run/netns/{aid}")
        assert seen.out.strip() == "False", seen.all  # the construction hides it
        for command in ("plan", "apply"):
            r = in_cell(cell, host_ns, sys.executable, "-m", "reconciler", command, "--no-probe"
                        if command == "apply" else "--no-agent", path)
            assert r.rc == 1, r.all
            lines = [ln for ln in r.all.splitlines() if ln.startswith("error:")]
            assert len(lines) == 1 and f"/run/netns/{aid}" in lines[0] \
                and "mount namespace" in lines[0], r.all
            assert "applied" not in r.out and "Traceback" not in r.all, r.all
    assert host_ns.link(veth) is not None
    again = host_ns.reconcile("plan", "--no-agent", path)
    assert again.rc == 0, again.all


