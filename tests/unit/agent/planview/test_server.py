"""The plan server: the warm-up that fills an empty view, and a plan left to the CLI while
a journal is pending."""

from __future__ import annotations

from typing import Any

import pytest

from reconciler.domain.model import DesiredState
from reconciler.domain.plan import Plan
from reconciler.planner import PlanOptions


class RecordingView:
    def __init__(self) -> None:
        self.key: Any = None
        self.live: Any = None
        self.planned: list[Any] = []

    def plan(self, desired: DesiredState, key: Any, options: PlanOptions) -> Any:
        self.planned.append(key)
        self.key, self.live = key, object()
        return None, "observed"


def test_warm_up_fills_an_empty_view_and_never_evicts_a_clients_files(tmp_path: Any) -> None:
    import threading

    from reconciler.agent.planview.server import PlanServer

    own = tmp_path / "own.yaml"
    own.write_text("version: 1\nbridges: [{name: br0}]\n")
    server = PlanServer(threading.Event())
    view = RecordingView()
    server.view = view  # type: ignore[assignment]
    server.warm((str(own),), "h1")
    server._warm_up()
    assert len(view.planned) == 1  # empty view: observed for the agent's files
    server.warm((str(own),), "h1")
    server._warm_up()
    assert len(view.planned) == 1  # same files, view still theirs: nothing to do
    view.key = "a client's other files"
    own.write_text("version: 1\nbridges: [{name: br1}]\n")
    server.warm((str(own),), "h1")
    server._warm_up()
    assert len(view.planned) == 1  # the view serves a client: left alone
    view.key = view.planned[0]  # back to the agent's files, which changed since
    server.warm((str(own),), "h1")
    server._warm_up()
    assert len(view.planned) == 2 and view.planned[1] != view.planned[0]


def test_the_agent_leaves_a_plan_to_the_cli_while_a_journal_is_pending(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process `plan` prints a note per pending journal and exits 2; the agent's answer
    must not be "No changes" (exit 0) then: it declines, and the CLI plans itself."""
    import threading

    from reconciler.agent.planview import server as server_mod
    from reconciler.agent.planview.protocol import PROTOCOL, current_env, tool_paths
    from reconciler.engine.journal import DOCKER, Journals

    monkeypatch.setenv("RECONCILER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(server_mod.firewalld, "running", lambda: False)
    own = tmp_path / "own.yaml"
    own.write_text("version: 1\nbridges: [{name: br0}]\n")
    blob = own.read_bytes()

    class EmptyView(RecordingView):
        def plan(self, desired: DesiredState, key: Any, options: PlanOptions) -> Any:
            return Plan(), "observed"

    server = server_mod.PlanServer(threading.Event())
    server.view = EmptyView()  # type: ignore[assignment]
    server.tools = tool_paths()
    request = {"protocol": PROTOCOL, "code": server.code, "mnt": server.mnt,
               "net": server.net, "env": current_env(), "tools": tool_paths(),
               "argv": [str(own)], "paths": [str(own)], "hostname": "h1",
               "files": [[str(own), str(own), len(blob)]]}
    assert server.answer(request, [blob])["rc"] == 0  # nothing pending: the agent answers
    Journals().new(DOCKER, "kind").begin({"x": 1})
    with pytest.raises(server_mod.Declined, match="half done"):
        server.answer(request, [blob])
