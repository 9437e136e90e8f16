"""Helper scripts run inside a namespace: ``nsenter --net=NS python -c CODE ARGS``, as forks.

The tests' helper scripts (listeners, connect scans, one-shot clients: ``allocs.py``,
``traffic.py``, ``host.py``, ``cells.py`` and a few test modules) used to start an
interpreter each time, through ``ip netns exec`` or ``nsenter``; a 20-round test started
80 of them. :func:`run` and :func:`popen` have the session's fork server
(``tests/support/forkserver.py``) fork a child that joins the namespace itself (setns(2)
in a single-threaded child, as nsenter does before it execs) and runs ``CODE`` as
``python -c`` would, with ``sys.argv`` ``["-c", *ARGS]``.

When the server does not serve (``RECONCILER_TEST_FORKSERVER=0``, the caller's thread in
other namespaces, another user) they run ``nsenter --net=... python -c`` instead. What a
fork does not redo from ``ip netns exec``: a private mount namespace with the
namespace's own /sys and /etc/netns files; no helper reads them (they open sockets).

See docs/decisions/053-helpers-as-forks.md.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import IO, Any

from tests.support.forkserver import SERVER, Forked, base_env

PIPE, DEVNULL = subprocess.PIPE, subprocess.DEVNULL

#: Popen or its fork twin: both have pid, poll, wait, kill, communicate and the pipes
Process = Any


def ns_path(ns: str) -> str:
    """``ns`` as a path: a name under /run/netns, or already a path (``/proc/PID/ns/net``)."""
    return ns if ns.startswith("/") else f"/run/netns/{ns}"


def enter_args(net: str, mnt: str | None = None, wd: str | None = None) -> list[str]:
    """The nsenter prefix of the same thing, for the subprocess fallback."""
    args = ["nsenter", f"--net={ns_path(net)}"]
    if mnt:
        args.append(f"--mount={mnt}")
    if wd:
        args.append(f"--wd={wd}")
    return args


def _enter(net: str, mnt: str | None) -> list[list[str]]:
    return [["net", ns_path(net)]] + ([["mnt", mnt]] if mnt else [])


def run(ns: str, code: str, *args: str, check: bool = True, input: str | None = None,
        timeout: float = 120, mnt: str | None = None, cwd: str | None = None,
        env: dict[str, str] | None = None, module: str | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """What ``python -c CODE ARGS`` (``-m MODULE`` when ``module``) prints inside network
    namespace ``ns`` (and mount namespace ``mnt``, a path), as ``sh`` gives it: text
    output, CalledProcessError when ``check`` and it fails, TimeoutExpired. ``cwd`` is
    resolved where the caller is, as ``nsenter --wd`` does."""
    env = env if env is not None else base_env()
    py = ["-m", module] if module else ["-c", code]
    argv = [sys.executable, *py, *args]
    done = None
    if SERVER.serves(env):
        done = SERVER.run(list(args), env, cwd, timeout, module=module or "reconciler",
                          code=None if module else code, enter=_enter(ns, mnt),
                          input=input.encode() if input else None)
    if done is None:
        return _checked(subprocess.run([*enter_args(ns, mnt, cwd), *argv], capture_output=True,
                                       text=True, input=input, timeout=timeout, env=env,
                                       cwd=None if mnt else cwd), check)
    rc, out, err = done
    return _checked(subprocess.CompletedProcess(argv, rc, _text(out), _text(err)), check)


def _checked(p: subprocess.CompletedProcess[str], check: bool) -> subprocess.CompletedProcess[str]:
    if check and p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, p.args, p.stdout, p.stderr)
    return p


def _text(data: bytes) -> str:
    """Decode as ``subprocess.run(text=True)`` does (locale encoding, universal newlines)."""
    import locale

    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


def popen(ns: str, code: str, *args: str, stdin: int | None = None, stdout: int | None = PIPE,
          stderr: int | None = None, mnt: str | None = None, cwd: str | None = None,
          env: dict[str, str] | None = None, module: str | None = None) -> Process:
    """``subprocess.Popen(nsenter --net=NS python -c CODE ARGS, text=True)``, as a fork
    when the server serves: each of stdin/stdout/stderr is PIPE, DEVNULL or None (the
    caller's). Stop it with ``close`` (:class:`Forked`) or kill and wait."""
    env = env if env is not None else base_env()
    py = ["-m", module] if module else ["-c", code]
    if SERVER.serves(env):
        proc = _forked(ns, code, list(args), stdin, stdout, stderr, mnt, cwd, env, module)
        if proc is not None:
            return proc
    return subprocess.Popen([*enter_args(ns, mnt, cwd), sys.executable, *py, *args],
                            stdin=stdin, stdout=stdout, stderr=stderr, text=True, env=env,
                            cwd=None if mnt else cwd)


def _forked(ns: str, code: str, args: list[str], stdin: int | None, stdout: int | None,
            stderr: int | None, mnt: str | None, cwd: str | None, env: dict[str, str],
            module: str | None) -> Forked | None:
    theirs: list[int] = []
    ours: list[IO[Any] | None] = []
    with contextlib.ExitStack() as closing:
        for fd, how in enumerate((stdin, stdout, stderr)):
            if how == PIPE:
                r, w = os.pipe()
                mine, child = (w, r) if fd == 0 else (r, w)
                closing.callback(os.close, child)
                ours.append(open(mine, "w" if fd == 0 else "r",  # noqa: SIM115 (the caller's)
                                 encoding=None, errors=None))
                theirs.append(child)
            elif how == DEVNULL:
                null = os.open(os.devnull, os.O_RDWR)
                closing.callback(os.close, null)
                ours.append(None)
                theirs.append(null)
            else:
                ours.append(None)
                theirs.append(fd)
        proc = SERVER.spawn(args, env, cwd, theirs, module=module or "reconciler",
                            code=None if module else code, enter=_enter(ns, mnt))
    if proc is None:
        for f in ours:
            if f is not None:
                f.close()
        return None
    proc.stdin, proc.stdout, proc.stderr = ours
    return proc
