"""The desired-state files the agent watches: which paths matter, which directories are
watched, the permission checks, and git-sync's symlink swaps."""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest

from reconciler.agent.files import relevant_path, watch_dirs
from reconciler.agent.revision import check_permissions
from reconciler.domain.errors import PreconditionError


def test_relevant_paths(tmp_path: Any) -> None:
    d = str(tmp_path / "conf")
    f = str(tmp_path / "host.conf")
    named = [d, f]
    assert relevant_path(os.path.join(d, "a.yaml"), named)
    assert relevant_path(os.path.join(d, "b.yml"), named)
    assert relevant_path(f, named)
    assert relevant_path(d, named)  # the directory itself replaced
    for noise in (".a.yaml.swp", "a.yaml~", "4913", ".#a.yaml", "README.md"):
        assert not relevant_path(os.path.join(d, noise), named), noise
    assert not relevant_path(os.path.join(d, "sub", "c.yaml"), named)  # not read: not recursive
    assert not relevant_path(str(tmp_path / "other.conf"), named)


def test_watch_dirs(tmp_path: Any) -> None:
    d = tmp_path / "conf"
    d.mkdir()
    f = tmp_path / "x.yaml"
    assert watch_dirs([str(d), str(f)]) == [str(d), str(tmp_path)]


def test_strict_modes(tmp_path: Any) -> None:
    d = tmp_path / "conf"
    d.mkdir(mode=0o755)
    f = d / "a.yaml"
    f.write_text("version: 1\n")
    os.chmod(d, 0o755)
    os.chmod(f, 0o644)
    check_permissions([str(d)])
    os.chmod(f, 0o664)
    with pytest.raises(PreconditionError, match=r"a\.yaml: refusing to watch: file is writable "
                                                r"by group or others \(mode 0664\)"):
        check_permissions([str(d)])
    os.chmod(f, 0o644)
    os.chmod(d, 0o757)
    with pytest.raises(PreconditionError, match="directory is writable by group or others"):
        check_permissions([str(f)])
    os.chmod(d, 0o755)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o644


def test_file_watcher_follows_git_sync_style_symlink_swaps(tmp_path):
    """repo -> revN swapped again and again (git-sync, ConfigMap ..data): every swap is seen."""
    import os
    import threading
    import time

    from reconciler.agent.files import FileWatcher

    def rev(n: int) -> str:
        d = tmp_path / f"rev{n}" / "fleet"
        d.mkdir(parents=True)
        (d / "a.yaml").write_text(f"version: 1\n# {n}\n")
        return f"rev{n}"

    os.symlink(rev(1), tmp_path / "repo")
    seen = threading.Event()
    w = FileWatcher([str(tmp_path / "repo" / "fleet")], lambda _p: seen.set())
    w.start()
    try:
        for n in (2, 3, 4):
            target = rev(n)
            seen.clear()
            os.symlink(target, tmp_path / "tmp-link")
            os.replace(tmp_path / "tmp-link", tmp_path / "repo")  # the atomic swap
            assert seen.wait(5), f"swap to {target} not seen"
            w.ensure()  # what the agent does on every pass
            time.sleep(0.1)
            seen.clear()
            (tmp_path / target / "fleet" / "a.yaml").write_text("version: 1\n# edited\n")
            assert seen.wait(5), f"edit inside {target} not seen"
    finally:
        w.close()
