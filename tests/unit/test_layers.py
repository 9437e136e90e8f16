"""The layer contract (.importlinter) is kept, and it does catch the edges it forbids.

Each case copies the package, adds one forbidden import and runs lint-imports on
the copy: a contract that a back edge cannot break would guard nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINT = os.path.join(os.path.dirname(sys.executable), "lint-imports")

pytestmark = pytest.mark.skipif(not os.path.exists(LINT), reason="import-linter not installed")


def lint(root: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": root}
    return subprocess.run([LINT, "--no-cache", "--config", os.path.join(root, ".importlinter")],
                          capture_output=True, text=True, timeout=120, cwd=root, env=env)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("layers"))
    shutil.copytree(os.path.join(REPO, "reconciler"), os.path.join(root, "reconciler"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, ".importlinter"), root)
    return root


def test_the_tree_keeps_every_contract(tree: str) -> None:
    p = lint(tree)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("domain/model.py", "import reconciler.engine.reconcile", "cli > agent > ui > engine"),
    ("engine/executor.py", "import reconciler.ui.render", "cli > agent > ui > engine"),
    ("cli/entry.py", "import yaml", "the `reconcile` fast path stays stdlib-only"),
    ("cli/entry.py", "import reconciler.drivers.netlink.client",
     "the `reconcile` fast path stays stdlib-only"),
    ("drivers/netlink/read.py", "import reconciler.drivers.docker.client",
     "driver packages are independent"),
    ("planner/allocs/plan.py", "import subprocess", "the planner is pure"),
    ("engine/observe.py", "import docker", "only drivers.docker imports the Docker SDK"),
    ("agent/status.py", "import reconciler.agent.loop", "agent: process > loop"),
    ("cli/safe.py", "import reconciler.cli.apply", "cli: entry > commands"),
    ("agent/planview/protocol.py", "import reconciler.agent.planview.view", "plan view:"),
    ("config/paths.py", "import reconciler.config.load", "config: load > checks"),
    ("engine/observe.py", "import yaml", "only config reads YAML"),
    ("drivers/netlink/wire.py", "import reconciler.drivers.netlink.client", "netlink:"),
    ("drivers/probe/capture.py", "import reconciler.drivers.probe.runner", "probe driver:"),
    ("planner/allocs/live.py", "import reconciler.planner.allocs.plan", "allocs planner:"),
])
def test_a_forbidden_edge_breaks_its_contract(tree: str, module: str, line: str,
                                              contract: str) -> None:
    path = os.path.join(tree, "reconciler", module)
    with open(path) as fh:
        original = fh.read()
    try:
        with open(path, "a") as fh:
            fh.write(f"\n{line}  # noqa\n")
        p = lint(tree)
    finally:
        with open(path, "w") as fh:
            fh.write(original)
    assert p.returncode != 0, p.stdout
    broken = [ln for ln in p.stdout.splitlines() if " BROKEN" in ln]
    assert any(contract in ln for ln in broken), p.stdout


@pytest.mark.parametrize(("module", "absent"), [
    ("reconciler.cli.entry", ("yaml", "jsonschema", "docker", "watchdog", "prometheus_client",
                              "reconciler.engine", "reconciler.planner",
                              "reconciler.drivers.netlink", "reconciler.ui.parser")),
    # validate, status and completion start without the engine, the planner, the agent or
    # the Docker SDK (plan and apply import the engine themselves)
    ("reconciler.cli.commands", ("docker", "watchdog", "prometheus_client", "jsonschema",
                                 "shtab", "reconciler.agent.loop", "reconciler.engine.reconcile",
                                 "reconciler.planner", "reconciler.domain.ops")),
    # an agent that declares no Docker network does not load the SDK (~8 MB resident)
    ("reconciler.agent.process", ("docker",)),
])
def test_lazy_imports_stay_lazy(module: str, absent: tuple[str, ...]) -> None:
    """What the measured lazy imports keep out of each start-up (checked at run time:
    import-linter sees a function-level import like any other)."""
    code = (f"import sys, {module}\n"
            f"print(sorted(m for m in sys.modules if m in {absent!r}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", f"{module} imported {p.stdout.strip()}"
