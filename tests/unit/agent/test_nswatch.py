"""The /run/netns watcher on a directory of its own: names, a directory that comes late,
goes, is renamed or replaced, and shutting down (real inotify, no namespaces needed)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from reconciler.agent.sources import NetnsDirWatcher
from reconciler.drivers.nswatch import IN_CREATE, RunDirWatch


class Reasons:
    def __init__(self) -> None:
        self.items: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, reason: str) -> None:
        with self.lock:
            self.items.append(reason)

    def wait_for(self, pred: Callable[[list[str]], bool], timeout: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if pred(self.items):
                    return list(self.items)
            time.sleep(0.02)
        raise AssertionError(f"timed out; reasons so far: {self.items}")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "netns"
    d.mkdir()
    return d


def watcher(d: Path, reasons: Reasons, held: Callable[[], frozenset[str]] = frozenset
            ) -> NetnsDirWatcher:
    w = NetnsDirWatcher(reasons, str(d), held=held, retry=0.05)
    w.set_names({"web-1"})
    return w


def test_names_that_matter_ask_for_a_pass_and_others_do_not(run_dir: Path) -> None:
    reasons = Reasons()
    w = watcher(run_dir, reasons, held=lambda: frozenset({"kept"}))
    try:
        (run_dir / "someone-else").touch()
        (run_dir / "web-1").touch()
        reasons.wait_for(lambda r: "netns created web-1" in r)
        (run_dir / "web-1").unlink()
        (run_dir / "kept").touch()
        got = reasons.wait_for(lambda r: "netns deleted web-1" in r and "netns created kept" in r)
        assert not any("someone-else" in r for r in got)
    finally:
        w.close()


def test_a_directory_that_comes_later_is_watched_and_says_so(tmp_path: Path) -> None:
    d = tmp_path / "netns"
    reasons = Reasons()
    w = watcher(d, reasons)
    try:
        time.sleep(0.1)
        d.mkdir()
        (d / "web-1").touch()
        reasons.wait_for(lambda r: "netns created web-1" in r or
                         "netns directory watched again" in r)
    finally:
        w.close()


def test_a_replaced_directory_is_watched_again_and_the_gap_asks_for_a_pass(
        run_dir: Path) -> None:
    reasons = Reasons()
    w = watcher(run_dir, reasons)
    try:
        shutil.rmtree(run_dir)
        run_dir.mkdir()
        (run_dir / "web-1").touch()  # maybe inside the gap: the pass asked for covers it
        reasons.wait_for(lambda r: "netns directory watched again" in r)
        (run_dir / "web-1").unlink()
        reasons.wait_for(lambda r: "netns deleted web-1" in r)
    finally:
        w.close()


def test_a_directory_renamed_away_is_not_watched_any_more(run_dir: Path) -> None:
    reasons = Reasons()
    w = watcher(run_dir, reasons)
    try:
        moved = run_dir.parent / "moved-away"
        run_dir.rename(moved)
        run_dir.mkdir()
        reasons.wait_for(lambda r: "netns directory watched again" in r)
        before = len(reasons.items)
        (moved / "web-1").touch()  # the old directory: not /run/netns any more
        (run_dir / "other").touch()
        time.sleep(0.3)
        assert not any("web-1" in r for r in reasons.items[before:])
    finally:
        w.close()


def test_a_failing_callback_does_not_end_the_watch(run_dir: Path) -> None:
    reasons = Reasons()
    calls = {"n": 0}

    def flaky() -> frozenset[str]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("boom")
        return frozenset({"x"})

    w = watcher(run_dir, reasons, held=flaky)
    try:
        (run_dir / "x").touch()
        time.sleep(0.2)
        (run_dir / "x").unlink()
        reasons.wait_for(lambda r: "netns deleted x" in r)
    finally:
        w.close()


def test_close_stops_the_thread_at_once(run_dir: Path) -> None:
    w = watcher(run_dir, Reasons())
    t0 = time.monotonic()
    w.close()
    assert time.monotonic() - t0 < 0.4  # woken, not waiting out its 0.5 s select
    assert not w._thread.is_alive()


def test_raw_watch_reports_names_and_a_lost_watch(run_dir: Path) -> None:
    watch = RunDirWatch(str(run_dir))
    try:
        assert watch.watching
        (run_dir / "a").touch()
        events = watch.drain()
        assert any(m & IN_CREATE and n == "a" for m, n in events)
        os.rmdir(run_dir / "a") if (run_dir / "a").is_dir() else (run_dir / "a").unlink()
        shutil.rmtree(run_dir)
        watch.drain()
        assert not watch.watching
        assert not watch.rewatch() and watch.error == 2  # ENOENT
        run_dir.mkdir()
        assert watch.rewatch()
    finally:
        watch.close()
