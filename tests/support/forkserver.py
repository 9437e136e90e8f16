"""Run ``reconcile`` commands as forks of one pre-imported process (the tests' fork server).

Starting ``python -m reconciler`` costs an interpreter start and its imports (~0.3 s on
the CI machine) for every command a test runs; the integration tests run about 450 of
them. The fork server is a process started once per test session (lazily, by the first
command) that has imported the whole ``reconciler`` package and forks one child per
command. Each child is made to look like a fresh ``python -m reconciler`` process before
it runs: its own argv, environment, working directory and umask, the caller's
stdin/stdout/stderr (file descriptors handed over with ``SCM_RIGHTS``), default signal
dispositions, and on the way out what the interpreter does at exit (non-daemon threads
joined, ``atexit`` handlers, streams flushed). The caller gets its exit status as a
``subprocess`` return code (negative: killed by that signal) and kills it on a timeout.

Why forks, not threads that ``setns``: ``--netns`` is refused once a second thread
exists, firewalld and legacy-iptables detection read the main thread's namespace, and
logging, stdout, the environment and the umask belong to the process. The server itself
never starts a thread, and refuses to fork if one exists.

What a fork cannot reproduce, the client runs as a real subprocess instead
(``serves`` says which): a different interpreter-start environment (``PYTHON*``, locale
variables, ``RECONCILER_LOCK_DIR`` which a module reads at import), a caller in other
namespaces than the server's (a thread inside ``netns.enter``), another user. Tests that
are about the process itself (the entry point, signals, exit codes, packaging, long-running
``watch`` agents) use a real subprocess on purpose: see tests/README.md.

Protocol (one connection per command): the client sends a JSON request with three file
descriptors (stdin, stdout, stderr); the server forks a waiter, which forks the command and
writes two lines back: the command's pid, then its wait status.

See docs/decisions/040-tests-fork-server.md.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

#: environment variables read before or while the package is imported: a request whose
#: values differ from the server's runs as a real subprocess
_START_ENV_PREFIXES = ("PYTHON", "LC_", "LANG")
_START_ENV_NAMES = frozenset({"LANGUAGE", "RECONCILER_LOCK_DIR", "TZ"})
_NAMESPACES = ("net", "mnt", "pid", "user", "uts", "ipc")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(_START_ENV_PREFIXES) or k in _START_ENV_NAMES}


def _namespaces() -> dict[str, int]:
    """Inodes of the calling thread's namespaces (a subprocess would inherit these)."""
    return {n: os.stat(f"/proc/thread-self/ns/{n}").st_ino for n in _NAMESPACES}


# --- the server ---------------------------------------------------------------------------

def _preimport() -> None:
    """Import every module of the package, so that no command pays for an import."""
    import importlib
    import pkgutil

    import reconciler

    for mod in pkgutil.walk_packages(reconciler.__path__, "reconciler."):
        if not mod.name.endswith("__main__"):
            importlib.import_module(mod.name)
    for extra in ("jsonschema", "docker", "yaml", "ctypes", "runpy", "selectors", "json",
                  "urllib.request"):
        with contextlib.suppress(ImportError):
            importlib.import_module(extra)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fresh_streams() -> None:
    """Give the child new sys.std* objects on fds 0-2, as the interpreter makes at start
    (encodings and error handlers as the server's own interpreter chose them from the same
    start environment)."""
    model = {0: sys.__stdin__, 1: sys.__stdout__, 2: sys.__stderr__}

    def text(fd: int, mode: str, line: bool) -> io.TextIOWrapper:
        like = model[fd]
        raw = io.FileIO(fd, mode, closefd=False)
        buf: Any = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buf, encoding=like.encoding if like else None,
                                errors=like.errors if like else None, line_buffering=line)

    sys.stdin = sys.__stdin__ = text(0, "r", False)
    sys.stdout = sys.__stdout__ = text(1, "w", os.isatty(1))
    sys.stderr = sys.__stderr__ = text(2, "w", True)


#: setns(2) flags of the namespaces a request may enter (``nsenter --net= --mount=``)
_CLONE = {"net": 0x40000000, "mnt": 0x00020000}


def _enter(paths: list[list[str]]) -> None:
    """Join the namespaces ``[[kind, path], ...]`` as nsenter does: every file opened first
    (resolved where the caller is), then the network namespace before the mount one."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fds = [(kind, os.open(path, os.O_RDONLY | os.O_CLOEXEC)) for kind, path in paths]
    for kind, fd in sorted(fds, key=lambda kf: list(_CLONE).index(kf[0])):
        if libc.setns(fd, _CLONE[kind]) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {kind} {dict(paths)[kind]}: {os.strerror(err)}")
        os.close(fd)


def _run_code(code: str) -> None:
    """Run ``code`` as ``python -c`` does: in a fresh ``__main__`` module."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    exec(compile(code, "<string>", "exec"), main.__dict__)  # noqa: S102 (python -c)


def _run_command(req: dict[str, Any], fds: list[int], closing: list[socket.socket]) -> None:
    """In the forked child: become the requested process, run the CLI (or the ``code`` of a
    ``python -c``), exit. Never returns."""
    rc = 1
    try:
        for s in closing:
            s.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)  # inheritable, like a spawned process's 0-2
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.umask(req["umask"])
        os.environ.clear()
        os.environ.update(req["env"])
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                    signal.SIGUSR2, signal.SIGALRM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it
        _fresh_streams()
        try:
            # as nsenter: the directory is opened where the caller is, entered after
            wd = os.open(req["cwd"], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            _enter(req.get("enter") or [])
            os.fchdir(wd)
            os.close(wd)
        except OSError as exc:
            print(f"forkserver: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        code = req.get("code")
        if code is None:
            sys.argv = ["-m", *req["argv"]]
            sys.path[0] = req["cwd"]  # what `python -m` puts first
        else:
            sys.argv = ["-c", *req["argv"]]
            sys.path[0] = ""  # what `python -c` puts first
        import runpy

        try:
            if code is None:
                runpy.run_module(req.get("module", "reconciler"), run_name="__main__",
                                 alter_sys=True)
            else:
                _run_code(code)
            rc = 0
        except SystemExit as exc:
            code = exc.code
            if code is None:
                rc = 0
            elif isinstance(code, int):
                rc = code & 0xFF
            else:
                print(code, file=sys.stderr)
                rc = 1
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            rc = 130
        except BaseException:
            sys.excepthook(*sys.exc_info())
            rc = 1
        import threading

        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: join threads
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                rc = 120  # as the interpreter does when flushing stdout fails at exit
    finally:
        os._exit(rc)


def _wait_status(info: Any) -> int:
    """The wait status ``waitpid`` would give for a ``waitid`` result."""
    if info.si_code == os.CLD_EXITED:
        return int((info.si_status & 0xFF) << 8)
    return int(info.si_status) | (0x80 if info.si_code == os.CLD_DUMPED else 0)


def _serve_one(listener: socket.socket, conn: socket.socket) -> None:
    """Read one request; fork the waiter that forks and reports the command."""
    fds: list[int] = []
    try:
        conn.settimeout(10)
        head = b""
        while not head.endswith(b"\n"):
            data, got, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
            if not data:
                return
            head += data
            fds += got
        req = json.loads(head)
        if len(fds) != 3 or _threads() != 1:
            conn.sendall(b"refused\n")
            return
        waiter = os.fork()
        if waiter == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                listener.close()
                pid = os.fork()
                if pid == 0:
                    _run_command(req, fds, [conn])
                for fd in fds:
                    os.close(fd)
                conn.settimeout(None)
                conn.sendall(f"{pid}\n".encode())
                # not reaped until the client hangs up: while it may still signal the pid,
                # the pid cannot be another process's
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
                conn.sendall(f"{_wait_status(info)}\n".encode())
                with contextlib.suppress(OSError):
                    while conn.recv(4096):
                        pass
                os.waitpid(pid, 0)
            finally:
                os._exit(0)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        conn.close()


def serve(path: str) -> None:
    """Pre-import, listen on ``path``, fork per request until the parent goes away."""
    parent = os.getppid()
    _preimport()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # waiters are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the client connects once everything is imported
    listener.listen(64)
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 1.0)
        if ready:
            conn, _ = listener.accept()
            # a client gone or garbled runs a subprocess; the server takes the next one
            with contextlib.suppress(OSError, ValueError):
                _serve_one(listener, conn)
    listener.close()


# --- the client ---------------------------------------------------------------------------

class Server:
    """The session's fork server: started on first use, stopped at exit."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.path = ""
        self.start_env: dict[str, str] = {}
        self.namespaces: dict[str, int] = {}
        self.uid = -1
        self.broken = os.environ.get("RECONCILER_TEST_FORKSERVER", "1") == "0"

    def start(self, env: dict[str, str]) -> bool:
        tmp = tempfile.mkdtemp(prefix="rc-forkserver-")
        self.path = os.path.join(tmp, "sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forkserver", self.path], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
            cwd=_REPO)
        self.start_env = _start_env(env)
        self.namespaces = _namespaces()
        self.uid = os.geteuid()
        atexit.register(self.stop)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.broken = True
                self.stop()
                return False
            time.sleep(0.02)
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a fork of the server is the process ``env`` would start here."""
        if self.broken:
            return False
        if self.proc is None and not self.start(base_env()):
            return False
        assert self.proc is not None
        if self.proc.poll() is not None:
            self.broken = True  # it died: real subprocesses from now on
            return False
        return (_start_env(env) == self.start_env and os.geteuid() == self.uid
                and _namespaces() == self.namespaces)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None, fds: list[int], *,
              module: str = "reconciler", code: str | None = None,
              enter: list[list[str]] | None = None) -> Forked | None:
        """Start ``python -m MODULE *argv`` (or ``python -c CODE *argv``) with ``fds`` as its
        stdin, stdout and stderr, after joining the namespaces ``enter`` (``[[kind, path]]``,
        kind "net" or "mnt", as nsenter does); None when the server could not take it."""
        req = {"module": module, "code": code, "argv": argv, "env": env, "enter": enter or [],
               "cwd": os.path.abspath(cwd or os.getcwd()), "umask": _umask()}
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(10)
            sock.connect(self.path)
            socket.send_fds(sock, [json.dumps(req).encode() + b"\n"], fds)
            lines = _Lines(sock)
            first = lines.next()
        except OSError:
            sock.close()
            return None
        if not first.isdigit():
            sock.close()
            return None  # refused or gone before forking
        sock.settimeout(None)
        return Forked(sock, lines, int(first), ["-c" if code is not None else module, *argv])

    def run(self, argv: list[str], env: dict[str, str], cwd: str | None, timeout: float,
            module: str = "reconciler", *, code: str | None = None,
            enter: list[list[str]] | None = None,
            input: bytes | None = None) -> tuple[int, bytes, bytes] | None:
        """Run ``python -m reconciler *argv`` (or as :meth:`spawn` says): (returncode, stdout,
        stderr), or None when the server could not take it (the caller runs a subprocess).
        Raises TimeoutExpired."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                tempfile.TemporaryFile() as stdin:
            if input:
                stdin.write(input)
                stdin.flush()
                stdin.seek(0)
            proc = self.spawn(argv, env, cwd, [stdin.fileno(), out.fileno(), err.fileno()],
                              module=module, code=code, enter=enter)
            if proc is None:
                return None
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(["reconcile", *argv], timeout) from None
            out.seek(0)
            err.seek(0)
            return rc, out.read(), err.read()


class Forked:
    """A command running as a fork of the server, with what the tests use of
    ``subprocess.Popen``: pid, poll, wait, signals, the caller's ends of its pipes.

    The server reaps the command only once this object has read its exit status and
    hung up: until then its pid cannot name another process, so signalling it is safe.
    """

    def __init__(self, sock: socket.socket, lines: _Lines, pid: int, args: list[str]) -> None:
        self._sock, self._lines = sock, lines
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self.stdin: Any = None
        self.stdout: Any = None
        self.stderr: Any = None

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._lines.buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._sock], [], [], left)
            if not ready:
                return None
            data = self._sock.recv(4096)
            if not data:
                raise RuntimeError(f"fork server lost command {self.pid} ({self.args})")
            self._lines.buf += data
        last = self._lines.next()
        if not last.lstrip(b"-").isdigit():
            raise RuntimeError(f"fork server lost command {self.pid} ({self.args})")
        self.returncode = os.waitstatus_to_exitcode(int(last))
        self._sock.close()  # the server reaps it now
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        rc = self._status(timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return rc

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: str | bytes | None = None,
                    timeout: float | None = None) -> tuple[Any, Any]:
        """Write ``input``, close stdin, read stdout and stderr to their end, wait."""
        import threading

        if self.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                if input:
                    self.stdin.write(input)
                self.stdin.close()
        got: dict[str, Any] = {}

        def drain(name: str) -> None:
            with getattr(self, name) as stream:
                got[name] = stream.read()

        readers = [threading.Thread(target=drain, args=(n,), daemon=True)
                   for n in ("stdout", "stderr") if getattr(self, n) is not None]
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.start()
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return got.get("stdout"), got.get("stderr")

    def close(self) -> None:
        """Kill it if it runs, close the pipes, wait: what a test's ``finally`` does."""
        self.kill()
        self.wait()
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Lines:
    """Read newline-terminated lines from a socket (no makefile: it dies on a timeout)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def next(self) -> bytes:
        while b"\n" not in self.buf:
            data = self.sock.recv(4096)
            if not data:
                line, self.buf = self.buf, b""
                return line.strip()
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return line.strip()


def base_env() -> dict[str, str]:
    """The session's environment with this tree first on PYTHONPATH: what the server starts
    with (not the first request's, which may carry a test's own variables)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO, env.get("PYTHONPATH")]))
    return env


def _umask() -> int:
    with open("/proc/thread-self/status") as fh:
        for line in fh:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    raise RuntimeError("no Umask in /proc/thread-self/status")


SERVER = Server()


def report() -> int:
    """Print this process's state (what a forked child must share with a fresh process)."""
    print(json.dumps({
        "argv": sys.argv[1:], "cwd": os.getcwd(), "umask": _umask(),
        "env": os.environ.get("FORKSERVER_PROBE"), "stdin": sys.stdin.read(),
        "tty": [os.isatty(fd) for fd in (0, 1, 2)], "threads": _threads(),
        "sigint": str(signal.getsignal(signal.SIGINT)),
        "sigpipe": str(signal.getsignal(signal.SIGPIPE)),
        "sigchld": str(signal.getsignal(signal.SIGCHLD)),
        "encoding": [sys.stdout.encoding, sys.stdout.errors, sys.stderr.errors],
    }, sort_keys=True))
    print("to stderr", file=sys.stderr)
    return 3


if __name__ == "__main__":
    if sys.argv[1:2] == ["--report"]:
        raise SystemExit(report())
    if sys.argv[1:2] == ["--sleep"]:  # a command that outlives its timeout
        time.sleep(float(sys.argv[2]))
        raise SystemExit(0)
    serve(sys.argv[1])
