"""Docs and examples cannot drift: the generated reference, schema modelines, manifests, links."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import yaml

from reconciler.config.load import load
from tests.support.host import REPO

EXAMPLES = os.path.join(REPO, "examples")
SCHEMA = os.path.join(REPO, "schemas", "reconciler.schema.json")
NOT_RECONCILER = {"kubernetes", "nomad", "prometheus", "systemd"}
MODELINE = re.compile(r"^# yaml-language-server: \$schema=(\S+)$")


def _gen_reference():
    spec = importlib.util.spec_from_file_location(
        "gen_reference", os.path.join(REPO, "scripts", "gen-reference.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_is_generated_from_the_current_schema():
    with open(SCHEMA) as fh:
        expected = _gen_reference().render(json.load(fh))
    with open(os.path.join(REPO, "docs", "reference.md")) as fh:
        assert fh.read() == expected, "docs/reference.md is stale: run python3 scripts/gen-reference.py"


def test_reference_covers_every_schema_field():
    with open(SCHEMA) as fh:
        schema = json.load(fh)
    with open(os.path.join(REPO, "docs", "reference.md")) as fh:
        text = fh.read()
    for d in schema["$defs"].values():
        for key in d.get("properties", {}):
            assert f"| `{key}` |" in text, key


def _reconciler_examples() -> list[str]:
    out = []
    for root, dirs, files in os.walk(EXAMPLES):
        dirs[:] = sorted(d for d in dirs if d not in NOT_RECONCILER)
        out += [os.path.join(root, f) for f in sorted(files) if f.endswith((".yaml", ".yml"))]
    return out


@pytest.mark.parametrize("path", _reconciler_examples(),
                         ids=lambda p: os.path.relpath(p, EXAMPLES))
def test_example_has_a_modeline_to_the_schema(path):
    with open(path) as fh:
        first = fh.readline().rstrip("\n")
    m = MODELINE.match(first)
    assert m, f"{path}: first line must be `# yaml-language-server: $schema=…`"
    target = os.path.join(os.path.dirname(path), m.group(1))
    assert os.path.isfile(target), f"{path}: {m.group(1)} does not exist"
    assert os.path.samefile(target, SCHEMA), f"{path}: {m.group(1)} is not the reconciler schema"


@pytest.mark.parametrize(("hostname", "bridges", "allocs", "networks"), [
    ("edge-1", {"fleet0"}, {"edge-ingress"}, set()),
    ("ci-3", {"fleet0"}, set(), {"ci-kind"}),
    ("build-x", {"fleet0"}, set(), {"ci-kind"}),
    ("db-1", {"fleet0"}, set(), set()),
])
def test_fleet_gives_each_host_its_own_view(hostname, bridges, allocs, networks):
    d = load([os.path.join(EXAMPLES, "fleet")], hostname=hostname)
    assert set(d.bridges) == bridges and set(d.allocs) == allocs
    assert set(d.docker_networks) == networks


def test_kubernetes_daemonset_parses_and_has_what_the_agent_needs():
    with open(os.path.join(EXAMPLES, "kubernetes", "daemonset.yaml")) as fh:
        docs = list(yaml.safe_load_all(fh))
    assert [d["kind"] for d in docs] == ["DaemonSet"]
    pod = docs[0]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["hostPID"] is True
    agent = next(c for c in pod["containers"] if c["name"] == "reconciler")
    assert agent["args"][0] == "watch"
    assert agent["securityContext"]["privileged"] is True  # required for Bidirectional
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert mounts["/run/netns"]["mountPropagation"] == "Bidirectional"
    assert {"/run/reconciler", "/var/run/docker.sock", "/git"} <= set(mounts)
    assert mounts["/git"].get("readOnly") is True
    volumes = {v["name"] for v in pod["volumes"]}
    for c in pod["containers"] + pod["initContainers"]:
        assert {m["name"] for m in c.get("volumeMounts", ())} <= volumes


def test_nomad_job_is_balanced_and_has_what_the_agent_needs():
    with open(os.path.join(EXAMPLES, "nomad", "reconciler.nomad.hcl")) as fh:
        text = fh.read()
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    assert code.count("{") == code.count("}") and code.count("[") == code.count("]")
    assert code.count('"') % 2 == 0
    for needle in ('type        = "system"', 'network_mode = "host"', 'pid_mode     = "host"',
                   '"net_admin", "sys_admin", "net_broadcast"', 'propagation = "rshared"', '"/run/netns"',
                   '"/run/reconciler"', '"/var/run/docker.sock"', '"watch"'):
        assert needle in code, needle


def _markdown_files() -> list[str]:
    docs = os.path.join(REPO, "docs")
    return [os.path.join(REPO, "README.md")] + [
        os.path.join(docs, f) for f in sorted(os.listdir(docs)) if f.endswith(".md")]


@pytest.mark.parametrize("path", _markdown_files(), ids=os.path.basename)
def test_relative_links_in_docs_resolve(path):
    with open(path) as fh:
        text = fh.read()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert os.path.exists(os.path.join(os.path.dirname(path), target)), \
            f"{os.path.relpath(path, REPO)}: broken link {target}"


@pytest.mark.parametrize("guide,example", [
    ("nomad-style-allocs.md", "examples/nomad-allocs.yaml"),
    ("kind-style-networks.md", "examples/kind-network.yaml"),
    ("fleet-with-watch.md", "examples/fleet/"),
    ("address-space.md", "examples/address-space.yaml"),
])
def test_each_guide_points_at_its_example(guide, example):
    with open(os.path.join(REPO, "docs", guide)) as fh:
        assert f"(../{example})" in fh.read()
    assert os.path.exists(os.path.join(REPO, example))


#: a path of the test tree as prose names it: ``tests/unit/cli/test_entry.py``, a folder
TEST_PATH = re.compile(r"\btests/(?:unit|integration|support)/[A-Za-z0-9_./-]*[A-Za-z0-9_]")


def _prose_files() -> list[str]:
    """README, ARCHITECTURE, CONTRIBUTING, docs/, bench/, scripts, the package, the tests."""
    out = [os.path.join(REPO, f) for f in ("README.md", "ARCHITECTURE.md", "CONTRIBUTING.md",
                                           "pyproject.toml", os.path.join(".ci", "run"))]
    for top in ("docs", "bench", "scripts", "reconciler", "tests"):
        for root, _dirs, files in os.walk(os.path.join(REPO, top)):
            out += [os.path.join(root, f) for f in files
                    if f.endswith((".md", ".py", ".sh", ".toml"))]
    return [f for f in out if os.path.isfile(f)]


def test_every_test_path_the_docs_name_exists():
    """A moved or renamed test file leaves no stale path behind in the prose."""
    missing = []
    for path in _prose_files():
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        for m in TEST_PATH.finditer(text):
            name = m.group(0).split("::")[0]
            if not os.path.exists(os.path.join(REPO, name)):
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{os.path.relpath(path, REPO)}:{line}: {name}")
    assert not missing, "paths of the test tree that do not exist:\n" + "\n".join(missing)
