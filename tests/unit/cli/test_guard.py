"""Guard rails (issue 15 item 4 and 6): what must never turn into a silent prune or a crash.

Host-free: the loader, saved-plan options and the planner on built live states.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from reconciler.cli import commands as cli
from reconciler.config.load import load
from reconciler.domain.errors import ConfigError
from tests.support.dockerfake import OURS, spec
from tests.support.planning import alloc, converge, plan, state

BRIDGE = "version: 1\nbridges: [{name: brx}]\n"


def write(tmp_path: Any, name: str, text: str) -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as fh:
        fh.write(text)
    return path


# ------------------------------------------------------------------ hosts: patterns


def test_files_all_for_other_hosts_are_an_error_naming_patterns_and_host(tmp_path: Any) -> None:
    write(tmp_path, "web.yaml", "hosts: ['web-*', 'edge-?']\n" + BRIDGE)
    write(tmp_path, "db.yaml", "hosts: ['db-*']\nversion: 1\nbridges: [{name: brd}]\n")
    with pytest.raises(ConfigError) as exc:
        load([str(tmp_path)], hostname="cache-1")
    msg = str(exc.value)
    assert "\n" not in msg
    assert "'cache-1'" in msg
    assert "web-*" in msg and "edge-?" in msg and "db-*" in msg
    assert "web.yaml" in msg and "db.yaml" in msg


def test_a_matching_file_with_empty_lists_empties_the_host_on_purpose(tmp_path: Any) -> None:
    write(tmp_path, "web.yaml", "hosts: ['web-*']\n" + BRIDGE)
    write(tmp_path, "cache.yaml", "version: 1\nhosts: ['cache-*']\nbridges: []\n")
    desired = load([str(tmp_path)], hostname="cache-1")
    assert not desired.bridges and not desired.allocs


def test_a_file_without_hosts_counts_as_matching(tmp_path: Any) -> None:
    write(tmp_path, "web.yaml", "hosts: ['web-*']\n" + BRIDGE)
    write(tmp_path, "all.yaml", "version: 1\n")
    assert load([str(tmp_path)], hostname="cache-1").bridges == {}


def test_validate_reports_but_accepts_files_for_other_hosts(tmp_path: Any,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """validate checks files (CI machines are no fleet members): a note, exit 0."""
    path = write(tmp_path, "web.yaml", "hosts: ['web-*']\n" + BRIDGE)
    assert cli.main(["validate", path, "--hostname", "db-1"]) == 0
    out = capsys.readouterr().out
    assert "1 file(s) valid" in out and "no file is for host 'db-1'" in out


def test_plan_of_files_for_other_hosts_is_one_error_line(tmp_path: Any,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """Refused before anything is observed: no host access needed to say it."""
    path = write(tmp_path, "web.yaml", "hosts: ['web-*']\n" + BRIDGE)
    for command in ("plan", "apply"):
        assert cli.main([command, path, "--hostname", "db-1"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and "web-*" in err, err


# ------------------------------------------------------------------ saved plans' options


def _saved(tmp_path: Any, options: Any) -> str:
    src = write(tmp_path, "a.yaml", BRIDGE)
    import hashlib

    with open(src, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    plan = {"format_version": 1, "changes": [], "summary": {}, "live_fingerprint": "x",
            "files": [{"path": src, "sha256": digest}], "warnings": [], "errors": [],
            "options": options}
    return write(tmp_path, "plan.json", json.dumps(plan, indent=2))


@pytest.mark.parametrize(("options", "named"), [
    ({"prune": True, "adopt": 5, "force_replace": False}, "options.adopt"),
    ({"prune": True, "adopt": ["nomad"], "force_replace": False}, "options.adopt"),
    ({"prune": True, "adopt": ["router/nomad"], "force_replace": False}, "options.adopt"),
    ({"prune": True, "adopt": [["bridge/x"]], "force_replace": False}, "options.adopt"),
    ({"prune": "yes", "adopt": [], "force_replace": False}, "options.prune"),
    ({"prune": True, "adopt": [], "force_replace": 1}, "options.force_replace"),
    ({"prune": True, "adopt": [], "force_replace": False, "tolerate": 3}, "options.tolerate"),
    (5, "options"),
    ([], "options"),
    ("prune", "options"),
])
def test_saved_plan_with_a_malformed_option_is_one_line_naming_file_and_option(
        tmp_path: Any, capsys: pytest.CaptureFixture[str], options: Any, named: str) -> None:
    path = _saved(tmp_path, options)
    assert cli.main(["apply", path]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: {path}: ") and named in err, err
    assert "internal error" not in err and "Traceback" not in err


# ------------------------------------------------------------------ planner: marks, not names


def _fake_alloc_host() -> Any:
    from tests.support.fakehost import FakeHost
    return FakeHost()


def test_a_link_named_like_the_veth_that_is_not_ours_is_a_conflict_never_deleted() -> None:
    import dataclasses

    from reconciler.domain.ownership import alloc_veth_name
    from reconciler.domain.plan import Action

    veth = alloc_veth_name("a")
    for kind, owned in (("bridge", False), ("dummy", True), ("veth", False)):
        host = _fake_alloc_host()
        host.add_link(veth, kind, owned=owned)
        p = plan(host, state(alloc("a")))
        (c,) = [c for c in p.changes if c.kind == "alloc"]
        assert c.action is Action.CONFLICT and veth in c.reason and "not the reconciler's" \
            in c.reason, (kind, owned, c)
        assert not any(o.name == "link.delete" for ch in p.changes for o in ch.ops)
    # ours (marked, or its peer inside our namespace) is still healed
    host = _fake_alloc_host()
    converge(host, state(alloc("a")))
    host.links[veth] = dataclasses.replace(host.links[veth], owned=False, alias=None)
    (c,) = plan(host, state(alloc("a"))).actionable
    assert c.action is Action.UPDATE and "unmarked" in str(c.attrs)


def test_an_unmarked_empty_namespace_file_of_a_declared_alloc_is_a_conflict() -> None:
    from reconciler.domain.plan import Action
    from tests.support.fakehost import FakeNetns

    host = _fake_alloc_host()
    host.netns["a"] = FakeNetns(9, {}, [], usable=False)  # someone's `ip netns add` half-way
    (c,) = [c for c in plan(host, state(alloc("a"))).changes if c.kind == "alloc"]
    assert c.action is Action.CONFLICT and "no mark on the file" in c.reason
    assert not c.ops
    (c,) = [c for c in plan(host, state(alloc("a")), adopt=frozenset({"alloc/a"})).changes
            if c.kind == "alloc"]
    assert c.action is Action.REPLACE  # adopting it is saying so


def test_the_namespace_the_reconciler_runs_in_is_never_an_allocation() -> None:
    from reconciler.domain.live import LiveLink
    from reconciler.domain.model import DesiredState
    from reconciler.domain.ownership import alloc_ns_alias
    from reconciler.domain.plan import Action
    from tests.support.fakehost import HOST_ID, FakeNetns

    host = _fake_alloc_host()
    lo = LiveLink("lo", 1, "", 65536, True, False)
    host.netns["me"] = FakeNetns(0, {"lo": lo}, inode=int(HOST_ID))
    for opts in ({}, {"adopt": frozenset({"alloc/me"})}):
        p = plan(host, state(alloc("me")), **opts)
        (c,) = [c for c in p.changes if c.kind == "alloc"]
        assert c.action is Action.CONFLICT and "runs in" in c.reason and not c.ops
    # adopted by an earlier version (its lo marked as ours): destroy must not unmount it
    marked = LiveLink("lo", 1, "", 65536, True, False, alias=alloc_ns_alias(HOST_ID))
    host.netns["me"] = FakeNetns(0, {"lo": marked}, inode=int(HOST_ID))
    assert not plan(host, DesiredState()).actionable


def test_adopting_a_name_nothing_declares_is_an_error() -> None:
    from reconciler.domain.errors import PlanError

    with pytest.raises(PlanError) as exc:
        plan(_fake_alloc_host(), state(alloc("a")),
             adopt=frozenset({"alloc/a", "alloc/b", "bridge/nope", "subnet/net"}))
    assert "alloc/b, bridge/nope" in str(exc.value) and "alloc/a" not in str(exc.value)


def test_adopting_a_foreign_namespace_says_what_it_deletes_in_the_text_plan() -> None:
    import ipaddress

    from reconciler.domain.live import LiveAddress, LiveLink, LiveRoute
    from reconciler.ui.render import render_text
    from tests.support.fakehost import FakeNetns

    host = _fake_alloc_host()
    lo = LiveLink("lo", 1, "", 65536, True, False)
    eth0 = LiveLink("eth0", 2, "veth", 1500, True, False, addresses=(
        LiveAddress(ipaddress.ip_interface("192.168.5.7/24"), False),))
    eth1 = LiveLink("eth1", 3, "veth", 1500, True, False, addresses=(
        LiveAddress(ipaddress.ip_interface("192.168.6.7/24"), False),))
    host.netns["a"] = FakeNetns(9, {"lo": lo, "eth0": eth0, "eth1": eth1},
                                [LiveRoute("default", "192.168.6.1", False, oif=3)])
    text = render_text(plan(host, state(alloc("a")), adopt=frozenset({"alloc/a"})))
    assert "eth0 inside: veth 192.168.5.7/24 -> deleted" in text, text
    assert "default route: via 192.168.6.1 (replaced) -> via the gateway" in text, text


# ------------------------------------------------------------------ Docker: another scope's


def test_the_driver_refuses_another_scopes_network_at_the_moment_of_the_change(
        fake_docker: Any) -> None:
    """The planner says it first; the driver re-reads the network and has the last word."""
    from reconciler.domain.docker import SCOPE_LABEL
    from reconciler.domain.errors import ConflictError
    from reconciler.drivers.docker.payloads import parse_network

    drv, api = fake_docker
    mine = spec("kind", labels=((SCOPE_LABEL, "netns/me"),))
    old = api.add("kind", labels={**OURS, SCOPE_LABEL: "host"})
    for call in (lambda: drv.replace(mine, parse_network(api.nets[old]), 1500,
                                     reconnect=False, adopt=True),
                 lambda: drv.ensure(mine, 1500)):
        with pytest.raises(ConflictError, match="another reconciler"):
            call()
        assert old in api.nets
    api.add("kind", labels={**OURS, SCOPE_LABEL: "netns/me"})  # a duplicate of ours beside
    with pytest.raises(ConflictError, match="several reconcilers"):
        drv.dedupe("kind")
    assert old in api.nets


def test_adopting_a_subnet_says_which_foreign_address_it_deletes() -> None:
    from reconciler.domain.plan import Action
    from reconciler.ui.render import render_text

    host = _fake_alloc_host()
    host.add_link("br0", "bridge", owned=True, addresses=("10.0.0.200/25",))
    p = plan(host, state(), adopt=frozenset({"subnet/net"}))
    (c,) = [c for c in p.changes if c.kind == "subnet"]
    assert c.action in (Action.CREATE, Action.UPDATE)
    assert "address 10.0.0.200/25 (not ours)" in render_text(p), render_text(p)


@pytest.mark.parametrize("files", [
    [{"path": 5, "sha256": "x"}],
    [{"path": ["a"], "sha256": "x"}],
    [{"path": "a.yaml"}],
    ["a.yaml"],
    "a.yaml",
    [{"path": "a.yaml", "sha256": 7}],
])
def test_saved_plan_with_malformed_files_is_one_line_not_internal_error(
        tmp_path: Any, capsys: pytest.CaptureFixture[str], files: Any) -> None:
    plan = {"format_version": 1, "changes": [], "live_fingerprint": "", "files": files}
    path = write(tmp_path, "plan.json", json.dumps(plan))
    assert cli.main(["apply", path]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: {path}: not a saved plan: ") and "files" in err, err
    assert "internal error" not in err and "Traceback" not in err
