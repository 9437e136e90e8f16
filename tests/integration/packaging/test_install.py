"""scripts/install.sh and uninstall.sh (issue 27 item 5), into a throwaway venv and bin dir.

Install from a copy of this checkout, move the copy away (`reconcile` keeps working: a
wheel, not an editable install), install a newer build over it (the upgrade path), run
it again (idempotent), uninstall (what it made goes, it says what it leaves). Never
touches /opt/reconciler or /usr/local/bin: RECONCILER_VENV and RECONCILER_BIN_DIR point
into the test's directory. The venv reaches the dependencies of the venv running the
tests through a .pth file (as test_wheel.py does), so nothing is downloaded but the
build backend pip's build isolation fetches.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import venv
from pathlib import Path

import pytest

from tests.support.host import EXAMPLES, REPO

pytestmark = [pytest.mark.slow]

_SKIP = shutil.ignore_patterns(".git", "build", "dist", "wheelhouse", "*.egg-info",
                               "__pycache__", ".*_cache", ".hypothesis")


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(RECONCILER_VENV=str(tmp / "venv"), RECONCILER_BIN_DIR=str(tmp / "bin"),
               RECONCILER_SYSTEM_PACKAGES="0")
    return env


def _run(tmp: Path, *cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=300,
                          env=_env(tmp), cwd=cwd or tmp)


def _venv_with_the_tests_dependencies(path: Path) -> None:
    venv.EnvBuilder(with_pip=True).create(path)
    py = str(path / "bin" / "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    # plain path entries: .pth files there (an editable install's finder) stay inactive
    with open(os.path.join(purelib, "_host_deps.pth"), "w") as fh:
        fh.write("\n".join(site.getsitepackages()) + "\n")


def _bump(checkout: Path, version: str) -> None:
    for rel, pattern, repl in (("pyproject.toml", r'(?m)^version = "[^"]+"', f'version = "{version}"'),
                               ("reconciler/__init__.py", r'__version__ = "[^"]+"',
                                f'__version__ = "{version}"')):
        p = checkout / rel
        text, n = re.subn(pattern, repl, p.read_text())
        assert n == 1, rel
        p.write_text(text)


def test_install_move_upgrade_and_uninstall(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO, checkout, ignore=_SKIP)
    _venv_with_the_tests_dependencies(tmp_path / "venv")
    reconcile = tmp_path / "bin" / "reconcile"

    r = _run(tmp_path, "bash", str(checkout / "scripts" / "install.sh"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Installed reconcile 0.1.0" in r.stdout and "from a wheel" in r.stdout, r.stdout
    assert os.readlink(reconcile) == str(tmp_path / "venv" / "bin" / "reconcile")

    moved = tmp_path / "moved"
    checkout.rename(moved)  # the checkout is gone: an installed wheel does not care
    r = _run(tmp_path, str(reconcile), "--version")
    assert r.returncode == 0 and r.stdout.strip() == "reconcile 0.1.0", r.stdout + r.stderr
    where = _run(tmp_path, str(tmp_path / "venv" / "bin" / "python"), "-c",
                 "import reconciler; print(reconciler.__file__)")
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout + where.stderr
    r = _run(tmp_path, str(reconcile), "validate", os.path.join(EXAMPLES, "quickstart.yaml"))
    assert r.returncode == 0 and "1 file(s) valid" in r.stdout, r.stdout + r.stderr

    _bump(moved, "0.1.1")  # a newer checkout: running install.sh again is the upgrade
    for _ in range(2):  # and again: idempotent
        r = _run(tmp_path, "bash", str(moved / "scripts" / "install.sh"))
        assert r.returncode == 0, r.stdout + r.stderr
        r = _run(tmp_path, str(reconcile), "--version")
        assert r.stdout.strip() == "reconcile 0.1.1", r.stdout + r.stderr

    r = _run(tmp_path, "bash", str(moved / "scripts" / "uninstall.sh"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (tmp_path / "venv").exists() and not os.path.lexists(reconcile)
    assert "/var/lib/reconciler" in r.stdout and "/etc/reconciler" in r.stdout, r.stdout
    r = _run(tmp_path, "bash", str(moved / "scripts" / "install.sh"), "--uninstall")
    assert r.returncode == 0 and "Nothing to remove" in r.stdout, r.stdout + r.stderr


def test_uninstall_leaves_what_install_did_not_make(tmp_path: Path) -> None:
    (tmp_path / "venv").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "reconcile").write_text("someone else's\n")
    r = _run(tmp_path, "bash", os.path.join(REPO, "scripts", "uninstall.sh"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "venv").is_dir() and (tmp_path / "bin" / "reconcile").exists()
    assert "Left" in r.stdout and "Nothing to remove" in r.stdout, r.stdout
