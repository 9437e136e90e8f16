"""The wheel: it builds, carries the JSON schemas, and works installed outside the tree."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
import zipfile

import pytest

from tests.support.host import REPO

pytestmark = [pytest.mark.slow]


def test_wheel_builds_and_runs_from_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                        "--disable-pip-version-check", "-w", str(dist), REPO],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    wheels = list(dist.glob("reconciler-*.whl"))
    assert len(wheels) == 1, os.listdir(dist)
    with zipfile.ZipFile(wheels[0]) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
    assert "reconciler/schemas/reconciler.schema.json" in names
    assert "reconciler/__main__.py" in names and "reconciler/drivers/netns.py" in names
    assert "reconcile = reconciler.cli.entry:main" in entry_points
    assert not any(n.startswith("tests/") for n in names)

    # The dependencies come from this interpreter (no network); the package only from the
    # wheel, which must win over any editable install of the tree.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = str(env_dir / "bin" / "python")
    # this interpreter may itself be a venv (scripts/install.sh makes one): its packages
    # are plain path entries for the new one, so their .pth files (the editable install's
    # finder among them) stay inactive and the wheel is what gets imported
    new_site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
    with open(os.path.join(new_site, "_host_deps.pth"), "w") as fh:
        fh.write("\n".join(site.getsitepackages()) + "\n")
    p = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "-q",
                        "--no-deps", "--no-index", "--disable-pip-version-check",
                        str(wheels[0])], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    where = subprocess.run([py, "-c", "import reconciler; print(reconciler.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert where.stdout.startswith(str(env_dir)), where.stdout + where.stderr

    example = os.path.join(REPO, "examples", "quickstart.yaml")
    p = subprocess.run([str(env_dir / "bin" / "reconcile"), "validate", example],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "1 file(s) valid" in p.stdout
