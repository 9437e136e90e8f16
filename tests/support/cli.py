"""Running the CLI the way a user does: ``python -m reconciler`` as a process of its own.

``reconcile(...)`` runs the command as a fork of the session's pre-imported fork server
(``tests/support/forkserver.py``): a process of its own, without the interpreter start.
``real=True``, a test marked ``@pytest.mark.real_process``, or ``RECONCILER_TEST_FORKSERVER=0``
in the environment run a real ``python -m reconciler`` subprocess instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from tests.support.forkserver import SERVER
from tests.support.host import REPO

#: set by the ``real_process`` marker's fixture (tests/conftest.py) for the running test
REAL_PROCESS = {"on": False}


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def all(self) -> str:
        return self.out + self.err


def _text(data: bytes) -> str:
    """Decode as ``subprocess.run(text=True)`` does (locale encoding, universal newlines)."""
    import locale

    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


def reconcile(*args: str, netns: str | None = None, timeout: float = 300,
              env: dict[str, str] | None = None, cwd: str | None = None,
              real: bool = False, module: str = "reconciler") -> Result:
    """Run the CLI the way a user does: a separate process (a fork server's child unless
    ``real``: see the module docstring). ``module``: another ``python -m`` entry point
    that runs the CLI (``tests.support.killpoints``, ``tests.support.faults``)."""
    argv = ["--netns", netns] if netns else []
    argv += list(args)
    full_env = dict(os.environ)
    full_env.update(env or {})
    # this tree's package, whatever the venv has installed
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, full_env.get("PYTHONPATH")]))
    if not (real or REAL_PROCESS["on"]) and SERVER.serves(full_env):
        done = SERVER.run(argv, full_env, cwd, timeout, module)
        if done is not None:
            rc, out, err = done
            return Result(rc, _text(out), _text(err))
    # stdin is no terminal (``pytest -s`` keeps the caller's): ``destroy`` asks nothing
    p = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
                       text=True, timeout=timeout, env=full_env, stdin=subprocess.DEVNULL,
                       cwd=cwd)
    return Result(p.returncode, p.stdout, p.stderr)
