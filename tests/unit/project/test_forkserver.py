"""The tests' fork server runs a command as a fresh ``python -m reconciler`` would.

Each case runs once as a real subprocess and once as a fork of the server
(``tests/support/forkserver.py``); exit code, stdout and stderr must be the same. Only
commands that read no host state: the unit tests' tripwire stays meaningful.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.support.cli import reconcile
from tests.support.forkserver import SERVER
from tests.support.host import REPO

CASES = [
    ["--version"],
    ["--help"],
    ["plan", "--help"],
    ["--no-such-option"],                      # usage error: 2
    ["plan", "missing.yaml"],                  # relative to the cwd: 1, one line
    ["plan", "bad.yaml"],                      # a file that does not load: names file:line
    ["completion", "bash"],
]


@pytest.fixture
def cwd(tmp_path: Any) -> str:
    with open(os.path.join(tmp_path, "bad.yaml"), "w") as fh:
        fh.write("version: 1\nbridges:\n  - name: x\n    mtu: lots\n")
    return str(tmp_path)


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(c) for c in CASES])
def test_a_fork_of_the_server_answers_as_a_fresh_process(argv: list[str], cwd: str) -> None:
    env = {"NO_COLOR": "1"}
    real = reconcile(*argv, cwd=cwd, env=env, real=True)
    forked = reconcile(*argv, cwd=cwd, env=env)
    assert SERVER.proc is not None and SERVER.proc.poll() is None, "no fork server ran"
    assert (forked.rc, forked.out, forked.err) == (real.rc, real.out, real.err)


def test_the_child_has_the_callers_cwd_umask_env_stdin_and_signals(tmp_path: Any) -> None:
    """What the CLI cannot show: a fork and a fresh process report the same process state
    (``python -m tests.support.forkserver --report``)."""
    env = dict(os.environ, FORKSERVER_PROBE="42")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    argv = ["--report", "x y"]
    assert SERVER.serves(env), "the fork server does not serve this environment"
    old = os.umask(0o027)  # not the server's: the child must take the caller's
    try:
        real = subprocess.run([sys.executable, "-m", "tests.support.forkserver", *argv],
                              capture_output=True, cwd=tmp_path, env=env,
                              stdin=subprocess.DEVNULL, timeout=60)
        forked = SERVER.run(argv, env, str(tmp_path), 60, module="tests.support.forkserver")
    finally:
        os.umask(old)
    assert forked is not None, "the fork server did not take the command"
    assert (forked[0], forked[1], forked[2]) == (real.returncode, real.stdout, real.stderr)
    state = json.loads(real.stdout)
    assert state["cwd"] == str(tmp_path) and state["umask"] == 0o027 and state["env"] == "42"
    assert state["argv"] == ["--report", "x y"] and state["threads"] == 1


def test_a_timeout_kills_the_forked_command(tmp_path: Any) -> None:
    """As ``subprocess.run``: the command is killed and TimeoutExpired raised."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    assert SERVER.serves(env)
    with pytest.raises(subprocess.TimeoutExpired):
        SERVER.run(["--sleep", "60"], env, str(tmp_path), 0.5,
                   module="tests.support.forkserver")


#: what a ``python -c`` process reports of itself (argv, path head, module name, stdin)
C_REPORT = ("import json, os, sys\n"
            "print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'name': __name__,\n"
            "                  'stdin': sys.stdin.read(), 'cwd': os.getcwd()}))\n"
            "sys.exit(int(sys.argv[1]))\n")


def test_code_runs_as_python_c_would(tmp_path: Any) -> None:
    """``code``: a fork runs it as ``python -c CODE ARGS`` does (tests/support/nsexec.py)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    assert SERVER.serves(env)
    real = subprocess.run([sys.executable, "-c", C_REPORT, "4", "x y"], capture_output=True,
                          cwd=tmp_path, env=env, input=b"in put", timeout=60)
    forked = SERVER.run(["4", "x y"], env, str(tmp_path), 60, code=C_REPORT, input=b"in put")
    assert forked is not None, "the fork server did not take the code"
    assert (forked[0], forked[1], forked[2]) == (real.returncode, real.stdout, real.stderr)
    assert json.loads(real.stdout)["argv"] == ["-c", "4", "x y"] and real.returncode == 4


def test_a_forked_process_is_signalled_and_reports_how_it_ended(tmp_path: Any) -> None:
    """``spawn`` hands back a Popen-like: running (poll None), SIGTERM ends it with -15; its
    pid stays unreaped until the status is read, so the signal cannot hit another process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    assert SERVER.serves(env)
    r, w = os.pipe()
    with open(os.devnull, "rb") as null:
        proc = SERVER.spawn([], env, str(tmp_path), [null.fileno(), w, w],
                            code="import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    os.close(w)
    assert proc is not None
    with open(r) as out:
        assert out.readline().strip() == "ready"
        assert proc.poll() is None
        with open(f"/proc/{proc.pid}/status") as fh:
            assert "State:\tZ" not in fh.read()  # our command, alive
        proc.terminate()
        assert proc.wait(30) == -15
        proc.kill()  # after the end: a no-op, never another process
        assert out.read() == ""
