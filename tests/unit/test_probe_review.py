"""The independent review's probe findings, the pure and the agent's parts: which
namespaces may be probed, what ``hairpin: false`` and ``direct`` expect and report, the
names of the probes' vantage, the conflict wording, and the agent's probe timer against
the host lock. The kernel's side is tests/integration/test_probe_review.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from reconciler.agent.passes import PROBE
from reconciler.domain.errors import ConfigError
from reconciler.domain.ownership import alloc_ns_alias
from reconciler.domain.probes import VANTAGE_HOST
from reconciler.engine import lock
from reconciler.planner.probes import Vantage, probe_specs

from .test_probe_surface import probing_agent  # noqa: F401 (a fixture)
from .test_probes import BASE, alloc, applied, desired, load_text, pm


def test_an_alloc_id_in_the_vantage_pattern_is_refused_at_validate() -> None:
    for aid in ("rcprobe-4026531840", "rcprobe-4026531840-0a1b2c3d"):
        with pytest.raises(ConfigError, match="reserve"):
            load_text(BASE.replace("{id: a,", "{id: " + aid + ",") % ("10.0.0.0/24",
                                                                       "{host: 80, to: 80}"))
    load_text(BASE.replace("{id: a,", "{id: rcprobe,") % ("10.0.0.0/24", "{host: 80, to: 80}"))


def test_a_namespace_of_another_host_is_never_probed_inside() -> None:
    d = desired(alloc("a", pm(8080, 80)), alloc("b"), cidr6=None)
    live = applied(d).observe(d)
    ns = live.netns["a"]
    other = alloc_ns_alias("4026599999")
    links = tuple(dataclasses.replace(lk, alias=other) if lk.name == "lo" else lk
                  for lk in ns.links)
    live = dataclasses.replace(live, netns={**live.netns, "a": dataclasses.replace(
        ns, links=links)})
    specs = probe_specs(d, live, vantage=Vantage("v", VANTAGE_HOST))
    mine = [s for s in specs if s.alloc == "a"]
    assert [(s.path, s.refused) for s in mine] == [
        ("gateway", "namespace a is not this host's allocation")]
    assert all(s.refused is None for s in specs if s.alloc == "b")
    assert any(s.alloc == "b" and s.path == "gateway" for s in specs)


def test_hairpin_false_expects_the_hairpin_path_not_to_arrive() -> None:
    for hairpin in (True, False):
        d = desired(alloc("a", pm(8080, 80)), cidr6=None, hairpin=hairpin)
        specs = probe_specs(d, applied(d).observe(d))
        assert [s.expect for s in specs if s.path == "hairpin"] == [hairpin]
        assert all(s.expect for s in specs if s.path != "hairpin")


def test_without_br_netfilter_hairpin_false_cannot_stop_the_path_and_it_is_skipped() -> None:
    d = desired(alloc("a", pm(8080, 80)), cidr6=None, hairpin=False)
    live = applied(d).observe(d)
    (hp,) = [s for s in probe_specs(d, live, br_netfilter={4: False}) if s.path == "hairpin"]
    assert hp.skipped is not None and "br_netfilter" in hp.skipped
    (hp,) = [s for s in probe_specs(d, live, br_netfilter={4: True}) if s.path == "hairpin"]
    assert hp.skipped is None and hp.expect is False


def test_direct_reports_the_port_it_probes() -> None:
    d = desired(alloc("a", pm(8080, 80)), cidr6=None)
    specs = probe_specs(d, applied(d).observe(d), vantage=Vantage("v", VANTAGE_HOST))
    ports = {s.path: (s.port, s.dport) for s in specs if s.path in ("external", "direct")}
    assert ports == {"external": (8080, 8080), "direct": (80, 80)}


def test_a_subnet_on_the_reserved_prefix_is_refused_as_reserved_not_foreign() -> None:
    from reconciler.engine.reconcile import conflicts_line  # noqa: PLC0415 (the one under test)
    from reconciler.planner import addrspace  # noqa: PLC0415

    from .fakehost import FakeHost  # noqa: PLC0415

    d = load_text(BASE % ("169.254.250.0/29", "{host: 80, to: 80}"))
    found = addrspace.check(d, FakeHost().observe(d))
    reasons = list(found.conflicts.values())
    assert conflicts_line(reasons) == ("1 conflict(s) with the prefix reserved for the "
                                       "probes' vantage")
    assert "does not own" in conflicts_line([*reasons, "bridge br0: a foreign link"])


def test_the_probe_timer_skips_a_run_while_someone_holds_the_host_lock(
        probing_agent: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    build, _broken, prober = probing_agent
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    monkeypatch.setattr(lock, "LOCK_DIR", str(rundir))
    monkeypatch.setattr(lock, "lock_path", lambda: str(rundir / "netns-1.lock"))
    agent = build()
    agent.run_pass(["startup"])
    agent.probe_run()
    before = len(prober.calls)
    assert before >= 1
    caplog.set_level("DEBUG", logger="reconciler.watch")
    with lock.host_lock(1.0):
        agent.probe_run()
    assert len(prober.calls) == before, "probed while another held the host lock"
    assert "host lock" in caplog.text
    agent.probe_run()
    assert len(prober.calls) == before + 1
    assert PROBE  # the timer's reason the loop uses for these runs
