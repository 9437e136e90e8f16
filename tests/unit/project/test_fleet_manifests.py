"""The shipped manifests gate a rollout (SPEC §10), checked offline.

The DaemonSet is validated against the Kubernetes API schemas (kubernetes-validate,
strict: an unknown field is an error, not silently dropped by the API server); the
Nomad job is parsed by python-hcl2, which checks HCL *syntax* only — Nomad's own
job schema is not available offline, so what the job must hold is asserted here
field by field. Both then must gate: readiness on /readyz, one host at a time, the
revision pinned so that a new commit is a new rollout, the agent refusing any other
checkout, revert records on a persistent host path.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any

import hcl2
import kubernetes_validate
import yaml

from reconciler.ui.parser import build_parser
from tests.support.host import REPO

DAEMONSET = os.path.join(REPO, "examples", "kubernetes", "daemonset.yaml")
NOMAD = os.path.join(REPO, "examples", "nomad", "reconciler.nomad.hcl")
UNIT = os.path.join(REPO, "examples", "systemd", "reconciler.service")
COMMIT = re.compile(r"[0-9a-f]{40}")
#: the Kubernetes minor version the DaemonSet is validated against (its schemas ship in
#: kubernetes-validate's wheel: no network)
K8S = "1.30"


def _daemonset() -> dict[str, Any]:
    with open(DAEMONSET) as fh:
        docs = list(yaml.safe_load_all(fh))
    assert len(docs) == 1
    doc: dict[str, Any] = docs[0]
    return doc


def _watch_args(argv: list[str], env: dict[str, str]) -> Any:
    """The agent's argv as our own parser reads it, after the engine's substitution."""
    out = []
    for a in argv:
        for k, v in env.items():
            a = a.replace(k, v)
        out.append(a)
    args = build_parser().parse_args(out)
    assert args.command == "watch"
    return args


def test_daemonset_is_valid_against_the_kubernetes_schemas() -> None:
    for version in (K8S, kubernetes_validate.latest_version()):
        kubernetes_validate.validate(_daemonset(), version, strict=True)


def test_a_schema_violation_is_caught() -> None:
    """The validator is not a rubber stamp: a probe with a typo'd field is refused."""
    ds = _daemonset()
    agent = ds["spec"]["template"]["spec"]["containers"][0]
    agent["readinessProbe"]["exec"]["comand"] = ["reconcile"]
    try:
        kubernetes_validate.validate(ds, K8S, strict=True)
    except kubernetes_validate.ValidationError as exc:
        assert "comand" in str(exc)
    else:
        raise AssertionError("an unknown field passed strict validation")


def test_daemonset_gates_the_rollout_on_readyz_one_node_at_a_time() -> None:
    ds = _daemonset()
    spec = ds["spec"]
    assert spec["updateStrategy"]["type"] == "RollingUpdate"
    rolling = spec["updateStrategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 1 and rolling.get("maxSurge", 0) == 0
    assert spec["minReadySeconds"] >= 30  # ready must last past a probe run
    pod = spec["template"]["spec"]
    agent = next(c for c in pod["containers"] if c["name"] == "reconciler")
    # through the agent's root-only socket: no local user can answer in its name
    assert agent["readinessProbe"]["exec"]["command"] == ["reconcile", "status", "--probe",
                                                          "readyz"]
    # alive is not ready
    assert agent["livenessProbe"]["exec"]["command"][-2:] == ["--probe", "healthz"]
    args = _watch_args(agent["args"], {"$(NODE_NAME)": "node-1", "$(REVISION)": "0" * 40})
    assert args.status_addr == "127.0.0.1:9477"


def test_daemonset_pins_the_revision_and_the_agent_expects_it() -> None:
    ds = _daemonset()
    template = ds["spec"]["template"]
    key = "reconciler.example.com/revision"
    assert COMMIT.fullmatch(template["metadata"]["annotations"][key])
    pod = template["spec"]
    field = f"metadata.annotations['{key}']"

    def revision_env(c: dict[str, Any]) -> bool:
        return any(e["name"] == "REVISION" and e["valueFrom"]["fieldRef"]["fieldPath"] == field
                   for e in c.get("env", ()))

    syncs = [c for c in pod["initContainers"] + pod["containers"] if "git-sync" in c["image"]]
    assert syncs, "git-sync makes the checkout"
    for c in syncs:  # exactly the pinned commit, once: no branch pulled behind the rollout
        assert "--ref=$(REVISION)" in c["args"] and "--one-time" in c["args"], c["name"]
        assert revision_env(c) and c in pod["initContainers"], c["name"]
    agent = next(c for c in pod["containers"] if c["name"] == "reconciler")
    assert revision_env(agent)
    args = _watch_args(agent["args"], {"$(NODE_NAME)": "node-1", "$(REVISION)": "a" * 40})
    assert args.expect_revision == "a" * 40


def test_daemonset_keeps_revert_records_on_a_persistent_host_path() -> None:
    pod = _daemonset()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    agent = next(c for c in pod["containers"] if c["name"] == "reconciler")
    mount = next(m for m in agent["volumeMounts"] if m["mountPath"] == "/var/lib/reconciler")
    assert volumes[mount["name"]]["hostPath"]["path"] == "/var/lib/reconciler"
    assert not mount.get("readOnly")


# --------------------------------------------------------------------------- Nomad


def _unquote(v: Any) -> Any:
    """python-hcl2 keeps a string's quotes (so expressions can be told apart): drop them."""
    if isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] == '"':
        return v[1:-1]
    if isinstance(v, list):
        return [_unquote(x) for x in v]
    if isinstance(v, dict):
        return {_unquote(k): _unquote(x) for k, x in v.items()
                if k not in ("__is_block__", "__comments__")}
    return v


def _nomad() -> dict[str, Any]:
    with open(NOMAD) as fh:
        doc: dict[str, Any] = _unquote(hcl2.load(fh))  # a syntax error raises here
    return doc


def _one(blocks: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    if name is None:
        assert len(blocks) == 1
        return blocks[0]
    found = [b[name] for b in blocks if name in b]
    assert len(found) == 1, name
    return found[0]


def test_an_hcl_syntax_error_is_caught() -> None:
    """python-hcl2 checks syntax (only): a lost closing brace is refused."""
    with open(NOMAD) as fh:
        text = fh.read()
    cut = text.rindex("}")
    try:
        hcl2.loads(text[:cut])
    except Exception as exc:  # lark's UnexpectedToken/UnexpectedEOF: any parse error will do
        assert type(exc).__module__.startswith(("lark", "hcl2")), type(exc)
    else:
        raise AssertionError("an unbalanced job parsed")


def test_nomad_job_is_a_system_job_that_gates_on_readyz() -> None:
    doc = _nomad()
    job = _one(doc["job"], "reconciler")
    assert job["type"] == "system"
    update = _one(job["update"])
    assert update["max_parallel"] == 1 and update["health_check"] == "checks"
    assert update["auto_revert"] is True and update["min_healthy_time"] == "60s"
    group = _one(job["group"], "reconciler")
    port = _one(_one(group["network"])["port"], "status")
    service = _one(group["service"])
    assert service["port"] == "status" and service["address"] == "127.0.0.1"
    check = _one(service["check"])
    assert (check["type"], check["path"]) == ("http", "/readyz")
    agent = _one(group["task"], "reconciler")
    args = _watch_args(_one(agent["config"])["args"],
                       {"${node.unique.name}": "client-1", "${NOMAD_META_revision}": "b" * 40,
                        "${NOMAD_PORT_status}": str(port["static"])})
    assert args.status_addr == f"127.0.0.1:{port['static']}"
    assert args.expect_revision == "b" * 40
    with open(NOMAD) as fh:  # the file says which Nomad version gates system jobs
        assert "Nomad 1.11.0 or later" in fh.read()


def test_nomad_job_pins_the_revision_in_its_meta() -> None:
    doc = _nomad()
    variable = _one(doc["variable"], "revision")
    assert COMMIT.fullmatch(variable["default"])
    job = _one(doc["job"], "reconciler")
    assert _one(job["meta"])["revision"] == "${var.revision}"
    group = _one(job["group"], "reconciler")
    tasks = {name: t for block in group["task"] for name, t in block.items()}
    syncs = [t for t in tasks.values() if "git-sync" in _one(t["config"])["image"]]
    assert syncs
    for t in syncs:  # once, before the agent, at exactly that commit
        args = _one(t["config"])["args"]
        assert "--ref=${NOMAD_META_revision}" in args and "--one-time" in args
        assert _one(t["lifecycle"]) == {"hook": "prestart", "sidecar": False}
    mounts = _one(tasks["reconciler"]["config"])["mount"]
    state = [m for m in mounts if m["target"] == "/var/lib/reconciler"]
    assert state and state[0]["type"] == "bind" and state[0]["source"] == "/var/lib/reconciler"


def test_nomad_jobs_git_volume_is_never_filled_and_made_roots_alone() -> None:
    """Docker fills a new volume from git-sync's /git (65533:65533, mode 2775), which the
    agent refuses: every mount says no_copy, and a prestart task chowns and chmods the
    volume's root (tests/integration/fleet/test_nomad_volume.py runs it against Docker)."""
    group = _one(_one(_nomad()["job"], "reconciler")["group"], "reconciler")
    tasks = {name: t for block in group["task"] for name, t in block.items()}
    mounts = [m for t in tasks.values() for m in _one(t["config"]).get("mount", [])
              if m["source"] == "reconciler-git"]
    assert len(mounts) == 3 and all(_one(m["volume_options"])["no_copy"] is True
                                    for m in mounts), mounts
    perms = tasks["git-perms"]
    assert _one(perms["lifecycle"]) == {"hook": "prestart", "sidecar": False}
    assert _one(perms["config"])["args"][-1] == "chown 0:0 /git && chmod 0755 /git"


def test_systemd_unit_keeps_state_under_var_lib() -> None:
    """systemd has no rollout of its own: the unit keeps the state directory persistent and
    the deploy tool gates on /readyz (docs/fleet-with-watch.md)."""
    with open(UNIT) as fh:
        lines = [ln.strip() for ln in fh if ln.strip() and not ln.startswith("#")]
    assert "StateDirectory=reconciler" in lines and "StateDirectoryMode=0700" in lines
    exec_start = next(ln for ln in lines if ln.startswith("ExecStart="))
    args = build_parser().parse_args(shlex.split(exec_start.split("=", 1)[1])[1:])
    assert args.command == "watch"
