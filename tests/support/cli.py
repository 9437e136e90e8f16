"""Running the CLI the way a user does: ``python -m reconciler`` as a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from tests.support.host import REPO


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def all(self) -> str:
        return self.out + self.err


def reconcile(*args: str, netns: str | None = None, timeout: float = 300,
              env: dict[str, str] | None = None, cwd: str | None = None) -> Result:
    """Run the CLI the way a user does: a separate process."""
    cmd = [sys.executable, "-m", "reconciler"]
    if netns:
        cmd += ["--netns", netns]
    full_env = dict(os.environ)
    full_env.update(env or {})
    # this tree's package, whatever the venv has installed
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, full_env.get("PYTHONPATH")]))
    # stdin is no terminal (``pytest -s`` keeps the caller's): ``destroy`` asks nothing
    p = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout,
                       env=full_env, stdin=subprocess.DEVNULL, cwd=cwd)
    return Result(p.returncode, p.stdout, p.stderr)
