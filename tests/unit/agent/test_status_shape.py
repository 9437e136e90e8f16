"""`reconcile status --output json` is a stable shape (SPEC §10): the table in
docs/fleet-with-watch.md and what an agent serves are the same set of keys.

The document is collected from an agent (fake reconciler, real git checkout) in every
state that fills a part of it — converged with probes holding, a probe failing, an
address overlap, an invalid commit — and flattened to dotted keys (``last_pass.result``,
``errors[].resource``). A key the agent adds without documenting it, or a documented
key it stops serving, fails here. The safe-change seam's keys (``pending``,
``reverted_revision``) are documented already; they may be absent until that branch
is merged, and are required from then on (``SEAM`` goes away).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from reconciler.agent import revision as revision_mod
from reconciler.agent import status
from reconciler.domain.errors import ReconcilerError
from reconciler.domain.probes import ProbeResult
from reconciler.planner.hostspace import LiveOverlap
from tests.support.agentfake import run_pass
from tests.support.host import REPO

DOC = os.path.join(REPO, "docs", "fleet-with-watch.md")
#: free-form or repeated objects: documented as one key, not flattened further
OPAQUE = {"event_sources", "config_error.revision", "last_pass.revision", "probes.revision"}
#: keys of the safe-change seam (helper "revert"): documented, served once it is merged
SEAM = {"pending", "pending.deadline", "pending.revision", "reverted_revision"}


def flatten(doc: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(doc, dict):
        for k, v in doc.items():
            key = f"{prefix}{k}"
            out.add(key)
            if key not in OPAQUE:
                out |= flatten(v, key + ".")
    elif isinstance(doc, list):
        for item in doc:
            if isinstance(item, dict):
                out |= flatten(item, prefix[:-1] + "[].")
    return out


def documented() -> set[str]:
    with open(DOC) as fh:
        text = fh.read()
    section = text.split("## The status document", 1)[1].split("\n## ", 1)[0]
    keys = re.findall(r"^\| `([^`]+)` \|", section, re.M)
    assert len(keys) == len(set(keys)), "a key documented twice"
    return set(keys)


def served(srv: status.StatusServer) -> dict[str, Any]:
    return status.fetch(srv.address)


def test_the_documented_keys_are_exactly_what_the_agent_serves(
        probing_agent: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:  # noqa: F811
    build, broken, prober = probing_agent
    conf = tmp_path / "conf"  # probing_agent's files: made a real git checkout here
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid",
           "-c", "commit.gpgsign=false"]
    for args in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-q", "-m", "one"]):
        subprocess.run([*git, *args], cwd=conf, check=True, capture_output=True, timeout=30)
    monkeypatch.setattr("reconciler.agent.loop.git_revision", revision_mod.git_revision)
    agent = build()
    sock = status.bind("127.0.0.1:0")
    srv = status.StatusServer(sock, agent.board, agent.metrics, agent.healthy,
                              ready=agent.ready)
    srv.start()
    seen: set[str] = set()
    try:
        agent.board.update(state="running")
        run_pass(agent, "startup")
        good = served(srv)
        assert good["ready"]["ready"] is True and good["revision"]["committed_at"] > 0
        seen |= flatten(good)
        broken["a1"] = ProbeResult("a1", "host", "tcp", 8080, False, cause="a foreign DROP")
        run_pass(agent, "probe")
        agent.on_overlaps([LiveOverlap(owned="10.9.0.0/24 on br0",
                                       foreign="route 10.9.0.0/25 on vpn0")])
        seen |= flatten(served(srv))
        (conf / "a.yaml").write_text("version: 1\nbridges: [{name: [}\n")
        run_pass(agent, "files changed")
        bad = served(srv)
        assert bad["config_error"] and bad["ready"]["ready"] is False
        seen |= flatten(bad)
        def refuse(*_a: Any, **_k: Any) -> Any:
            raise ReconcilerError("conflict: 10.9.0.0/24 overlaps route 10.9.0.0/25 on vpn0")

        monkeypatch.setattr(agent.reconciler, "plan", refuse)
        agent.run_pass(["resync"])  # a failed pass: errors[] entries
        failed = served(srv)
        assert failed["errors"] == [{"resource": "pass", "error": "conflict: 10.9.0.0/24 "
                                     "overlaps route 10.9.0.0/25 on vpn0"}]
        seen |= flatten(failed)
        seen |= flatten(served(srv))
    finally:
        srv.close()
    docs = documented()
    assert seen - docs == set(), f"served but not documented: {sorted(seen - docs)}"
    missing = docs - seen - SEAM
    assert missing == set(), f"documented but not served: {sorted(missing)}"


def test_reconcile_status_output_json_is_the_served_document(probing_agent: Any) -> None:  # noqa: F811
    build, broken, prober = probing_agent
    agent = build()
    agent.board.update(state="running")
    run_pass(agent, "startup")
    sock = status.bind("127.0.0.1:0")
    srv = status.StatusServer(sock, agent.board, agent.metrics, agent.healthy,
                              ready=agent.ready)
    srv.start()
    try:
        p = subprocess.run([sys.executable, "-m", "reconciler", "status", "--addr",
                            srv.address, "--output", "json"], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc == served(srv) | {"ready": doc["ready"]}  # same keys and values
        assert {"revision", "state", "last_pass", "errors", "probes", "ready"} <= set(doc)
    finally:
        srv.close()
