"""`reconcile watch`: the host agent that keeps this host converged.

Level-triggered, the controller-runtime way: file changes, netlink and Docker
events, SIGHUP and a periodic resync only *request* a pass; requests
coalesce; a pass loads the files, observes, plans, and — only when there is
something to do — takes the host lock, applies and verifies. A failed pass is
retried with exponential backoff (capped); drift events wait out the backoff,
operator actions (file edits, SIGHUP) do not.

An invalid edit never changes what we converge to: the last good desired state
is kept and the error is shown in logs and status. The host lock is held only
while applying, never between passes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from reconciler import __version__
from reconciler.errors import ConfigError, LockedError, PreconditionError, ReconcilerError
from reconciler.executor import Outcome
from reconciler.lock import host_lock
from reconciler.model import DesiredState
from reconciler.paths import YAML_SUFFIXES, expand_paths
from reconciler.planner import PlanOptions
from reconciler.reconcile import Reconciler, load, residual_error
from reconciler.status import Metrics, StatusBoard, StatusServer

log = logging.getLogger("reconciler.watch")

#: reasons whose no-op passes are logged at debug level only
QUIET_REASONS = frozenset({"resync", "retry", "netlink drift", "netns drift", "docker drift"})

# --------------------------------------------------------------------------- scheduling


@dataclass
class _Request:
    due: float
    first: float
    bypass_backoff: bool


@dataclass
class Scheduler:
    """When the next pass should run. Pure: every method takes ``now``.

    Requests are keyed by reason; requesting again merges. ``trailing`` requests
    (file changes) move their due time to ``now + delay`` on every repeat, but
    never beyond ``first + max_wait``; others keep the earliest due time.
    """

    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    max_wait: float = 5.0
    failures: int = 0
    backoff_until: float = 0.0
    _pending: dict[str, _Request] = field(default_factory=dict)

    def request(self, reason: str, now: float, *, delay: float = 0.0, trailing: bool = False,
                bypass_backoff: bool = False) -> None:
        due = now + delay
        old = self._pending.get(reason)
        if old is None:
            self._pending[reason] = _Request(due, now, bypass_backoff)
            return
        if trailing:
            old.due = min(max(old.due, due), old.first + self.max_wait)
        else:
            old.due = min(old.due, due)
        old.bypass_backoff = old.bypass_backoff or bypass_backoff

    def set_resync(self, now: float, interval: float) -> None:
        """(Re)arm the periodic full resync ``interval`` seconds from now."""
        self._pending["resync"] = _Request(now + interval, now, False)

    def _effective(self, r: _Request) -> float:
        return r.due if r.bypass_backoff else max(r.due, self.backoff_until)

    def next_due(self) -> float | None:
        return min((self._effective(r) for r in self._pending.values()), default=None)

    def take(self, now: float) -> list[str]:
        """Reasons due now (removed); requests not yet due stay pending."""
        due = sorted(k for k, r in self._pending.items() if self._effective(r) <= now)
        for k in due:
            del self._pending[k]
        return due

    def pending(self) -> list[str]:
        return sorted(self._pending)

    def backoff_delay(self) -> float:
        return float(min(self.backoff_cap, self.backoff_base * 2.0 ** max(0, self.failures - 1)))

    def record(self, ok: bool, now: float) -> float:
        """Account for a finished pass; after a failure, schedule a retry. Returns its delay."""
        if ok:
            self.failures = 0
            self.backoff_until = 0.0
            self._pending.pop("retry", None)
            return 0.0
        self.failures += 1
        delay = self.backoff_delay()
        self.backoff_until = now + delay
        self.request("retry", now, delay=delay)
        return delay


class Trigger:
    """Thread-safe front of a :class:`Scheduler`: event sources call ``request``."""

    def __init__(self, scheduler: Scheduler, stop: threading.Event,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.stop = stop
        self.clock = clock
        self._cond = threading.Condition(threading.RLock())

    def request(self, reason: str, *, delay: float = 0.0, trailing: bool = False,
                bypass_backoff: bool = False) -> None:
        with self._cond:
            self.scheduler.request(reason, self.clock(), delay=delay, trailing=trailing,
                                   bypass_backoff=bypass_backoff)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def locked(self) -> threading.Condition:
        return self._cond

    def wait(self, max_sleep: float = 1.0) -> list[str] | None:
        """Block until a pass is due (its reasons) or stop is set (None)."""
        with self._cond:
            while not self.stop.is_set():
                now = self.clock()
                reasons = self.scheduler.take(now)
                if reasons:
                    return reasons
                nd = self.scheduler.next_due()
                timeout = max_sleep if nd is None else min(max_sleep, max(0.0, nd - now))
                self._cond.wait(timeout)
            return None


# --------------------------------------------------------------------------- files


def relevant_path(path: str, named: Sequence[str]) -> bool:
    """True when a changed path can alter what the loader reads from ``named`` paths."""
    ap = os.path.abspath(path)
    for n in named:
        an = os.path.abspath(n)
        if ap == an:
            return True
        if os.path.dirname(ap) == an:  # a file directly inside a named directory
            base = os.path.basename(ap)
            if base.endswith(YAML_SUFFIXES) and not base.startswith("."):
                return True
    return False


def watch_dirs(paths: Sequence[str]) -> list[str]:
    """The directories to watch (non-recursively) for the given file/directory paths."""
    out: list[str] = []
    for p in paths:
        ap = os.path.abspath(p)
        d = ap if os.path.isdir(ap) else os.path.dirname(ap)
        if d not in out:
            out.append(d)
    return out


def _links_on_the_way(path: str) -> list[str]:
    """Every symlink among the components of ``path``."""
    out = []
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        p = os.sep.join(parts[:i])
        if os.path.islink(p):
            out.append(p)
    return out


class FileWatcher:
    """Watchdog (inotify) on the directories holding the desired-state files."""

    def __init__(self, paths: Sequence[str], on_change: Callable[[str], None]) -> None:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer as FsObserver

        self.paths = list(paths)
        self.on_change = on_change
        self._observer = FsObserver()
        #: watched directory -> (the real directory inotify follows, the watch)
        self._scheduled: dict[str, tuple[str, Any]] = {}
        #: symlinks on the way to a watched directory (git-sync, ConfigMap ..data swaps)
        self._links: set[str] = set()
        outer = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in ("opened", "closed_no_write"):
                    return
                for p in (event.src_path, getattr(event, "dest_path", "")):
                    p = os.fsdecode(p) if p else ""
                    if p and (relevant_path(p, outer.paths) or p in outer._links):
                        outer.on_change(p)
                        return

        self._handler = Handler()

    def ensure(self) -> None:
        """Watch every directory that exists now (a deleted one is picked up when it returns).

        inotify follows symlinks once, at the time of the watch: when a link on the
        way to a watched directory is swapped (git-sync's ``repo`` link, a
        ConfigMap's ``..data``), the watch is moved to the new target, and the
        directory holding the link is watched too so that the swap itself wakes us.
        """
        wanted = set(watch_dirs(self.paths))
        for d in sorted(wanted):
            for link in _links_on_the_way(d):
                self._links.add(link)
                wanted.add(os.path.dirname(link))
        for d in sorted(wanted):
            if not os.path.isdir(d):
                continue
            real = os.path.realpath(d)
            current = self._scheduled.get(d)
            if current is not None and current[0] == real:
                continue
            if current is not None:
                with contextlib.suppress(KeyError, OSError):
                    self._observer.unschedule(current[1])
            try:
                watch = self._observer.schedule(self._handler, d, recursive=False)
                self._scheduled[d] = (real, watch)
            except OSError as exc:
                log.warning("cannot watch %s: %s", d, exc)

    def start(self) -> None:
        self.ensure()
        self._observer.start()

    def close(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=2.0)


# --------------------------------------------------------------------------- revision


def git_revision(paths: Sequence[str], timeout: float = 5.0) -> dict[str, Any] | None:
    """Commit and dirty flag of the git checkout holding ``paths[0]``, or None.

    Runs with optional locks off (never takes index.lock from under a user's
    git command) and fsmonitor off (no hook programs run on our behalf).
    """
    if not paths:
        return None
    first = os.path.abspath(paths[0])
    cwd = first if os.path.isdir(first) else os.path.dirname(first)
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
    base = ["git", "-c", "core.fsmonitor=false", "-C", cwd]

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run([*base, *args], capture_output=True, text=True, timeout=timeout,
                               env=env, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    head = git("rev-parse", "HEAD") if top else None
    if not top or not head:
        return None
    rel = [os.path.relpath(os.path.abspath(p), cwd) for p in paths]
    porcelain = git("status", "--porcelain", "--untracked-files=all", "--", *rel)
    return {"commit": head, "dirty": bool(porcelain), "toplevel": top}


def files_digest(files: Sequence[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0")
        try:
            with open(f, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
        except OSError:
            h.update(b"?")
    return h.hexdigest()


def describe_revision(rev: dict[str, Any]) -> str:
    if rev.get("commit"):
        return str(rev["commit"])[:12] + ("-dirty" if rev.get("dirty") else "")
    return "sha256:" + str(rev.get("files_sha256", ""))[:12]


# --------------------------------------------------------------------------- strict modes


def check_permissions(paths: Sequence[str]) -> None:
    """Refuse config that someone other than root (or us) could change, like sshd StrictModes.

    The files and the directories that hold them must not be writable by group
    or others and must belong to root or to the user running the agent.
    """
    try:
        files = expand_paths(paths)
    except ConfigError:
        files = [p for p in paths if os.path.exists(p)]
    targets: list[str] = []
    for p in [*paths, *files]:
        ap = os.path.abspath(p)
        for t in (ap, os.path.dirname(ap)) if not os.path.isdir(ap) else (ap,):
            if t not in targets and os.path.exists(t):
                targets.append(t)
    me = os.geteuid()
    for t in targets:
        st = os.stat(t)
        what = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PreconditionError(
                f"{t}: refusing to watch: {what} is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); run `chmod go-w {t}` or pass "
                "--allow-insecure-config")
        if st.st_uid not in (0, me):
            raise PreconditionError(
                f"{t}: refusing to watch: {what} belongs to uid {st.st_uid}, not root or uid "
                f"{me}; fix the owner or pass --allow-insecure-config")


# --------------------------------------------------------------------------- logs


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line (journald/Loki friendly)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("pass_number", "revision", "result", "reasons", "duration_seconds"):
            if hasattr(record, key):
                doc[key] = getattr(record, key)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(fmt: str, verbose: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
    # watchdog logs every inotify event at debug: a log file next to the config would loop
    logging.getLogger("watchdog").setLevel(logging.WARNING)


# --------------------------------------------------------------------------- the agent


@dataclass(frozen=True)
class WatchOptions:
    paths: tuple[str, ...]
    plan: PlanOptions = PlanOptions()
    interval: float = 60.0
    debounce: float = 0.5
    drift_debounce: float = 0.1
    backoff_base: float = 1.0
    backoff_cap: float = 60.0
    lock_timeout: float = 60.0
    hostname: str | None = None
    netlink: bool = True
    docker_events: bool = True
    #: refuse config writable by group/others at every load, not only at start
    strict: bool = True
    #: answer `reconcile plan` of this namespace on a unix socket (planserver)
    plan_server: bool = True
    #: observe and report drift, never change the host
    dry_run: bool = False


@dataclass
class PassReport:
    number: int
    reasons: list[str]
    result: str  # ok | applied | drift (--dry-run) | failed | config-error | interrupted
    started_at: float
    finished_at: float
    duration: float
    applied: int = 0
    failed: int = 0
    skipped: int = 0
    error: str | None = None
    errors: list[dict[str, str]] = field(default_factory=list)

    @property
    def converged(self) -> bool:
        return self.result in ("ok", "applied")


def _resource_errors(result: Any) -> list[dict[str, str]]:
    out = [{"resource": f"{o.change.kind}/{o.change.name}", "error": o.error or "failed"}
           for o in result.failed]
    out += [{"resource": "plan", "error": e} for e in result.plan.errors]
    if result.residual is not None and result.residual.has_changes:
        out += [{"resource": c.address, "error": "still differs after apply: "
                 + (c.reason or c.action.value)} for c in result.residual.actionable]
    return out


def _default_reconciler(stop: threading.Event) -> Reconciler:
    def sleep(seconds: float) -> None:
        stop.wait(seconds)  # SIGTERM cuts verify waits and retry delays short

    return Reconciler(stop=stop, sleep=sleep)


class Agent:
    """The watch loop. ``run()`` blocks until ``stop`` is set; call from the main thread."""

    def __init__(self, options: WatchOptions, *, stop: threading.Event | None = None,
                 board: StatusBoard | None = None, metrics: Metrics | None = None,
                 reconciler_factory: Callable[[threading.Event], Reconciler] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.options = options
        self.stop = stop or threading.Event()
        self.clock = clock
        self.wall = wall
        self.metrics = metrics or Metrics()
        self.hostname = options.hostname or socket.gethostname()
        self.board = board or StatusBoard()
        self.board.update(version=__version__, pid=os.getpid(), hostname=self.hostname,
                          paths=list(options.paths), state="starting", started_at=wall(),
                          pass_count=0, consecutive_failures=0, last_pass=None,
                          last_success_at=None, revision=None, errors=[], config_error=None,
                          desired=None, netns_inode=os.stat("/proc/thread-self/ns/net").st_ino,
                          event_sources={})
        self.scheduler = Scheduler(backoff_base=options.backoff_base,
                                   backoff_cap=options.backoff_cap,
                                   max_wait=max(5.0, 10 * options.debounce))
        self.trigger = Trigger(self.scheduler, self.stop, clock)
        self._factory = reconciler_factory or _default_reconciler
        self.reconciler = self._factory(self.stop)
        self.good: DesiredState | None = None
        self.good_revision: dict[str, Any] | None = None
        self.pass_count = 0
        self.heartbeat = clock()
        self.files: FileWatcher | None = None
        self.netlink: Any = None
        self.netns_dir: Any = None
        self.docker: Any = None
        self._loaded_sig: tuple[str, str] | None = None
        #: called with each pass's report (the plan server warms its view)
        self.after_pass: Callable[[PassReport], None] | None = None

    # -- event sources -------------------------------------------------------

    def on_file_change(self, path: str) -> None:
        log.debug("file changed: %s", path)
        self.trigger.request("files changed", delay=self.options.debounce, trailing=True,
                             bypass_backoff=True)

    def on_drift(self, source: str, reason: str) -> None:
        self.metrics.drift_events.labels(source=source).inc()
        log.debug("drift: %s", reason)
        self.trigger.request(f"{source} drift", delay=self.options.drift_debounce)

    def reload(self) -> None:
        """SIGHUP: reload now, and forget the backoff (an operator is looking)."""
        log.info("SIGHUP: reloading")
        with self.trigger.locked():
            self.scheduler.backoff_until = 0.0
        self.trigger.request("SIGHUP", bypass_backoff=True)

    def start_sources(self) -> None:
        self.files = FileWatcher(self.options.paths, self.on_file_change)
        self.files.start()
        sources: dict[str, str] = {"files": "watching " + ", ".join(watch_dirs(self.options.paths))}
        if self.options.netlink:
            from reconciler.drift import NetlinkWatcher

            try:
                nl = NetlinkWatcher(lambda r: self.on_drift("netlink", r), self.stop)
                nl.start()
                self.netlink = nl
                sources["netlink"] = "listening"
            except OSError as exc:
                log.warning("netlink drift events unavailable (%s); relying on the interval", exc)
                sources["netlink"] = f"unavailable: {exc}"
        if self.options.netlink:
            from reconciler.drift import NetnsDirWatcher

            self.netns_dir = NetnsDirWatcher(lambda r: self.on_drift("netns", r),
                                             held=self._held_namespaces)
        self.board.update(event_sources=sources)

    def _update_sources(self, desired: DesiredState) -> None:
        names: set[str] = set(desired.bridges)
        if self.netlink is not None:
            self.netlink.set_names(names)
        if self.netns_dir is not None:
            self.netns_dir.set_names(desired.allocs)
        if desired.docker_networks and self.options.docker_events:
            if self.docker is None:
                from reconciler.drift import DockerWatcher

                self.docker = DockerWatcher(lambda r: self.on_drift("docker", r), self.stop)
            self.docker.set_names(desired.docker_networks)
            self.docker.start()
            src = self.board.get("event_sources") or {}
            src["docker"] = "connected" if self.docker.connected else "connecting"
            self.board.update(event_sources=src)
        elif self.docker is not None:
            self.docker.set_names(())
        if self.files is not None:
            self.files.ensure()

    def _held_namespaces(self) -> frozenset[str]:
        """Namespaces the observer keeps a socket into: undeclared ones of ours, too.

        With --no-prune or --dry-run those are not deleted by us; if someone else
        deletes one, the held socket keeps it (and its veth) alive until the next
        pass drops the socket, so its deletion must start a pass.
        """
        ops = getattr(self.reconciler.observer, "ops", None)
        netlink = getattr(ops, "_netlink", None)
        held = getattr(netlink, "cached_names", None)
        return held() if callable(held) else frozenset()

    def close(self) -> None:
        for src in (self.files, self.netlink, self.netns_dir, self.docker):
            if src is not None:
                try:
                    src.close()
                except Exception as exc:  # shutting down: report, go on
                    log.debug("closing %s: %s", type(src).__name__, exc)
        try:
            self.reconciler.observer.ops.close()
        except Exception as exc:
            log.debug("closing drivers: %s", exc)

    # -- the loop ------------------------------------------------------------

    def run(self) -> None:
        self.board.update(state="running")
        self.trigger.request("startup", bypass_backoff=True)
        while True:
            self.heartbeat = self.clock()
            reasons = self.trigger.wait()
            if reasons is None:
                break
            report = self.run_pass(reasons)
            if self.after_pass is not None:
                self.after_pass(report)
            with self.trigger.locked():
                now = self.clock()
                if report.result == "failed":
                    delay = self.scheduler.record(False, now)
                    log.warning("pass %d failed; retrying in %.1fs", report.number, delay)
                elif report.result != "interrupted":
                    self.scheduler.record(report.result != "failed", now)
                self.scheduler.set_resync(now, self.options.interval)
            self.board.update(consecutive_failures=self.scheduler.failures)
            if self.stop.is_set():
                break
        self.board.update(state="stopped")

    def healthy(self) -> tuple[bool, str]:
        if self.stop.is_set():
            return False, "stopping"
        stale = self.clock() - self.heartbeat
        limit = 2 * self.options.interval + 2 * self.options.lock_timeout + 60
        if stale > limit:
            return False, f"loop stuck for {stale:.0f}s"
        return True, "ok"

    @contextmanager
    def _host_lock(self) -> Iterator[None]:
        """The host lock, waited for in small steps so that SIGTERM is not held up."""
        deadline = self.clock() + self.options.lock_timeout
        announced = False
        while True:
            stack = ExitStack()
            try:
                stack.enter_context(host_lock(0))
                break
            except LockedError as exc:
                if self.stop.is_set() or self.clock() >= deadline:
                    raise LockedError(f"{exc} (waited {self.options.lock_timeout:g}s)") from None
                if not announced:
                    log.info("waiting for the host lock: %s", exc)
                    announced = True
                self.stop.wait(0.1)
        with stack:
            yield

    def _load(self) -> tuple[DesiredState | None, dict[str, Any], str | None]:
        rev = git_revision(self.options.paths) or {}
        try:
            files = expand_paths(self.options.paths)
        except ConfigError:
            files = []
        rev["files_sha256"] = files_digest(files)
        try:
            if self.options.strict:
                check_permissions(self.options.paths)
            desired = load(self.options.paths, hostname=self.hostname)
        except (ConfigError, PreconditionError) as exc:
            return None, rev, str(exc)
        return desired, rev, None

    def run_pass(self, reasons: list[str]) -> PassReport:
        self.pass_count += 1
        n = self.pass_count
        t0, w0 = self.clock(), self.wall()
        report = PassReport(n, reasons, "ok", w0, w0, 0.0)
        desired, rev, config_error = self._load()
        if config_error is not None:
            self.metrics.config_errors.inc()
            self.metrics.config_valid.set(0)
            prev = self.board.get("config_error")
            since = prev["since"] if prev and prev.get("message") == config_error else w0
            self.board.update(config_error={"message": config_error, "since": since,
                                            "revision": rev})
            if not prev or prev.get("message") != config_error:
                keep = ("keeping the last good desired state"
                        f" ({describe_revision(self.good_revision)})"
                        if self.good_revision is not None else "nothing applied yet")
                for line in config_error.splitlines():
                    log.error("invalid desired state: %s", line)
                log.error("invalid desired state at %s; %s", describe_revision(rev), keep)
        else:
            assert desired is not None
            self.metrics.config_valid.set(1)
            sig = (describe_revision(rev), rev.get("files_sha256", ""))
            if sig != self._loaded_sig:
                log.info("desired state %s: %d bridges, %d subnets, %d allocs, "
                         "%d docker networks", describe_revision(rev), len(desired.bridges),
                         len(desired.subnets), len(desired.allocs), len(desired.docker_networks))
                self._loaded_sig = sig
            self.good, self.good_revision = desired, rev
            self.board.update(config_error=None)
        if self.good is None:
            report.result = "config-error"
            report.error = "no valid desired state yet"
            return self._finish(report, t0)
        self._update_sources(self.good)
        self.board.update(revision=self.good_revision, desired={
            "bridges": len(self.good.bridges), "subnets": len(self.good.subnets),
            "allocs": len(self.good.allocs), "docker_networks": len(self.good.docker_networks)})
        try:
            self._reconcile(self.good, report)
        except ReconcilerError as exc:
            report.result = "failed"
            report.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if not report.errors:
                report.errors = [{"resource": "pass", "error": line}
                                 for line in str(exc).splitlines()[:20]]
        except Exception as exc:  # a bug or a broken socket: start over with fresh drivers
            log.exception("pass %d: internal error", n)
            report.result = "failed"
            report.error = f"internal error: {type(exc).__name__}: {exc}"
            report.errors = [{"resource": "pass", "error": report.error}]
            try:
                self.reconciler.observer.ops.close()
            except Exception as close_exc:
                log.debug("closing drivers: %s", close_exc)
            self.reconciler = self._factory(self.stop)
        return self._finish(report, t0)

    def _reconcile(self, desired: DesiredState, report: PassReport) -> None:
        rec = self.reconciler
        plan = rec.plan(desired, self.options.plan)
        if plan.conflicts:
            report.errors = [{"resource": c.address, "error": "conflict: "
                              + (c.reason or "exists but is not managed by the reconciler")
                              + f" (adopt with --adopt {c.kind}/{c.name})"}
                             for c in plan.conflicts]
            raise ReconcilerError(f"{len(plan.conflicts)} conflict(s) with objects the "
                                  "reconciler does not own; nothing changed: "
                                  + ", ".join(c.address for c in plan.conflicts))
        if not plan.has_changes:
            if plan.errors:
                report.errors = [{"resource": "plan", "error": e} for e in plan.errors]
                raise ReconcilerError(plan.errors[0])
            return
        if self.options.dry_run:
            report.result = "drift"
            report.errors = [{"resource": c.address,
                              "error": f"differs ({c.action.value}): {c.reason}"}
                             for c in plan.actionable[:50]]
            log.info("pass %d: %d change(s) pending; --dry-run: not applied", report.number,
                     len(plan.actionable))
            return
        log.info("pass %d: %d change(s) to apply", report.number, len(plan.actionable))

        def on_outcome(o: Outcome) -> None:
            if o.status == "applied":
                self.metrics.changes.inc()

        with self._host_lock():
            result = rec.apply(desired, self.options.plan, on_outcome=on_outcome)
        report.applied = sum(1 for o in result.outcomes if o.status == "applied")
        report.failed = len(result.failed)
        report.skipped = sum(1 for o in result.outcomes if o.status == "skipped")
        report.errors = _resource_errors(result)
        if self.stop.is_set() and report.skipped:
            report.result = "interrupted"
            report.error = f"stopped: {report.skipped} change(s) skipped"
            return
        if result.failed:
            raise ReconcilerError(f"{report.failed} change(s) failed: "
                                  + "; ".join(f"{e['resource']}: {e['error']}"
                                              for e in report.errors[:3]))
        if result.residual is not None and result.residual.has_changes:
            raise ReconcilerError(str(residual_error(result.residual)))
        if result.plan.errors:
            raise ReconcilerError(result.plan.errors[0])
        report.result = "applied" if report.applied else "ok"

    def _finish(self, report: PassReport, t0: float) -> PassReport:
        report.duration = self.clock() - t0
        report.finished_at = self.wall()
        self.metrics.passes.labels(result=report.result).inc()
        self.metrics.duration.observe(report.duration)
        if report.result == "failed":
            self.metrics.failures.inc()
        if report.converged:
            self.metrics.last_success.set(report.finished_at)
            self.board.update(last_success_at=report.finished_at)
        rev = describe_revision(self.good_revision) if self.good_revision else "-"
        extra = {"pass_number": report.number, "revision": rev, "result": report.result,
                 "reasons": report.reasons, "duration_seconds": round(report.duration, 4)}
        msg = (f"pass {report.number} ({', '.join(report.reasons)}) at {rev}: {report.result}"
               f"{f', {report.applied} applied' if report.applied else ''}"
               f"{f', {report.failed} failed' if report.failed else ''}"
               f"{f', {report.skipped} skipped' if report.skipped else ''}"
               f" in {report.duration:.3f}s")
        if report.result == "failed":
            log.error("%s: %s", msg, report.error, extra=extra)
        elif report.result == "ok" and set(report.reasons) <= QUIET_REASONS:
            log.debug(msg, extra=extra)  # routine no-op passes: echoes of our changes, resyncs
        else:
            log.info(msg, extra=extra)
        self.board.update(
            pass_count=report.number,
            errors=report.errors if report.result != "config-error" else [],
            last_pass={"number": report.number, "reasons": report.reasons,
                       "result": report.result, "started_at": report.started_at,
                       "finished_at": report.finished_at,
                       "duration_seconds": round(report.duration, 4),
                       "changes": {"applied": report.applied, "failed": report.failed,
                                   "skipped": report.skipped},
                       "error": report.error})
        return report


# --------------------------------------------------------------------------- entry


def install_signals(agent: Agent) -> None:
    # A Python signal handler runs in the main thread between two bytecodes, possibly while
    # that thread holds the status board's or the trigger's lock: taking them here would
    # deadlock (or, with a re-entrant lock, mutate state mid-iteration). Only the stop event
    # is set directly (lock-free); everything else runs on a short-lived thread.
    def later(fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, name="signal", daemon=True).start()

    def terminate(signum: int, _frame: FrameType | None) -> None:
        if not agent.stop.is_set():
            log.info("%s: finishing the current change, then exiting",
                     signal.Signals(signum).name)
        agent.stop.set()

        def wind_down() -> None:
            agent.board.update(state="stopping")
            agent.trigger.wake()

        later(wind_down)

    def hup(_signum: int, _frame: FrameType | None) -> None:
        later(agent.reload)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    signal.signal(signal.SIGHUP, hup)


def _start_plan_server(agent: Agent) -> Any:
    """Serve `reconcile plan` from this agent; a failure only costs clients speed."""
    from reconciler.planserver import PlanServer

    plans = PlanServer(agent.stop, on_answer=lambda result: agent.metrics.plan_requests.labels(
        result=result).inc())
    try:
        started = plans.start()
    except OSError as exc:
        log.warning("not answering `reconcile plan` (%s); clients plan in-process", exc)
        plans.close()
        return None
    if started:
        def warm(report: PassReport) -> None:
            if report.converged:
                plans.warm(agent.options.paths, agent.options.hostname)

        agent.after_pass = warm
    src = agent.board.get("event_sources") or {}
    src["plan_server"] = plans.path if started else "another agent answers"
    agent.board.update(event_sources=src)
    return plans if started else None


def run(options: WatchOptions, status_socket: socket.socket | None) -> int:
    """Run the agent until SIGTERM/SIGINT; 0 on a clean stop."""
    agent = Agent(options)
    server = None
    if status_socket is not None:
        server = StatusServer(status_socket, agent.board, agent.metrics, agent.healthy)
    install_signals(agent)
    plans = None
    try:
        agent.start_sources()
        if options.plan_server:
            plans = _start_plan_server(agent)
        if server is not None:
            server.start()
            log.info("status on http://%s/status (metrics /metrics, health /healthz)",
                     server.address)
        log.info("watching %s (interval %gs, debounce %gs)", " ".join(options.paths),
                 options.interval, options.debounce)
        agent.run()
    finally:
        agent.stop.set()
        if server is not None:
            server.close()
        if plans is not None:
            plans.close()
        agent.close()
    log.info("stopped after %d pass(es)", agent.pass_count)
    return 0
