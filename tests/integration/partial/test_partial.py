"""Partial progress against the real kernel and dockerd (SPEC §11, issue 25 items 2 and 7):
one resource that cannot converge blocks itself and what depends on it; everything else
is applied by `apply` and healed by `watch`. Checked with `ip -j` and the CLI's words."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from reconciler.domain.ownership import alloc_veth_name
from tests.support.agent import Agent
from tests.support.dockerscratch import DockerScratch
from tests.support.host import Netns, save, sh, unique, wait_for, write

pytestmark = pytest.mark.root


def config(good: str, foreign: str | None, allocs: list[str], extra: str = "") -> str:
    """Bridge ``good`` with a subnet and ``allocs``; ``foreign`` (a bridge someone else made)
    declared with a subnet and one allocation of its own."""
    text = f"version: 1\nbridges:\n  - {{name: {good}}}\n"
    subs = f"subnets:\n  - {{name: {good}-n, bridge: {good}, cidr: 10.231.0.0/24}}\n"
    al = "allocs:\n" + "".join(f"  - {{id: {a}, subnet: {good}-n}}\n" for a in allocs)
    if foreign is not None:
        text += f"  - {{name: {foreign}}}\n"
        subs += f"  - {{name: {foreign}-n, bridge: {foreign}, cidr: 10.232.0.0/24}}\n"
        al += f"  - {{id: {foreign}a, subnet: {foreign}-n}}\n"
    return text + subs + (al if allocs or foreign else "") + extra


def test_apply_with_a_foreign_bridge_applies_the_rest(host_ns: Netns, tmp_path: Any) -> None:
    good, foreign, a = unique("g"), unique("f"), unique("a")
    host_ns.run("ip", "link", "add", foreign, "type", "bridge")
    path = write(tmp_path, "h.yaml", config(good, foreign, [a]))
    p = host_ns.reconcile("plan", path, "--output", "json", "--no-agent")
    assert p.rc == 1, p.all
    blocked = {f"{b['kind']}/{b['name']}": b for b in json.loads(p.out)["blocked"]}
    assert set(blocked) == {f"bridge/{foreign}", f"subnet/{foreign}-n", f"alloc/{foreign}a"}
    assert "--adopt" in blocked[f"bridge/{foreign}"]["reason"]
    r = host_ns.reconcile("apply", path)
    assert r.rc == 1, r.all
    assert "Blocked (3)" in r.out and f"bridge {foreign}: exists but was not created" in r.out
    assert f"bridge {foreign}" in r.err and "Traceback" not in r.all, r.all
    # the rest is there, checked with ip; the foreign bridge is as it was
    assert good in host_ns.bridges()
    assert os.path.exists(f"/run/netns/{a}") and not os.path.exists(f"/run/netns/{foreign}a")
    assert host_ns.addrs(foreign) == [] and host_ns.link(foreign) is not None
    # verify says blocked, and probes what is not (the allocation on the good bridge holds)
    v = host_ns.reconcile("verify", path)
    assert v.rc == 1 and "Verify: failed: 3 resource(s) blocked." in v.out, v.all
    assert "probe(s) failed" not in v.out, v.all
    # and a second run changes nothing more: exit 1 for what is still blocked, nothing else
    again = host_ns.reconcile("plan", path, "--no-agent")
    assert again.rc == 1 and "0 to create, 0 to update" in again.out, again.all
    # a window is all or nothing: refused, nothing changed
    w = host_ns.reconcile("apply", write(tmp_path, "w.yaml", config(good, foreign, [])),
                          "--confirm-within", "1m")
    assert w.rc == 1 and "refuses a plan with 3 blocked resource(s); nothing changed" in w.err
    assert os.path.exists(f"/run/netns/{a}")


def start(host_ns: Netns, tmp_path: Any, text: str) -> tuple[Agent, str]:
    conf = tmp_path / "conf"
    conf.mkdir(mode=0o755)
    (conf / "h.yaml").write_text(text)
    return Agent(host_ns, [str(conf)], "--interval", "3600", "--probe-interval", "off"), \
        str(conf / "h.yaml")


def heals_around(agent: Agent, host_ns: Netns, path: str, blocked: str, words: str,
                 good: str, more: str, new: str) -> dict[str, Any]:
    """Wait until ``blocked`` shows in the agent's status with ``words``; then a bridge
    deleted by hand comes back, and the allocation ``new`` added in ``more`` is made; an
    invalid edit fixed logs that it cleared, once. The status at the end."""
    def shown(d: dict[str, Any]) -> bool:
        return (d.get("last_pass") or {}).get("result") == "blocked" and any(
            b["resource"] == blocked for b in d.get("blocked") or ())

    doc = agent.wait_status(shown, 60, what=f"{blocked} blocked")
    (entry,) = [b for b in doc["blocked"] if b["resource"] == blocked]
    assert words in entry["reason"], entry
    assert doc["consecutive_failures"] == 0, doc
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises(urllib.error.HTTPError) as refused:
        opener.open(f"http://{agent.addr}/readyz", timeout=5)
    ready = refused.value.read().decode()
    assert refused.value.code == 503 and blocked in ready, ready
    assert "reconciler_blocked_resources" in (agent.get("/metrics") or "")
    host_ns.run("ip", "link", "del", good)
    wait_for(lambda: good in host_ns.bridges(), 30, what="the deleted bridge back")
    save(path, more)
    wait_for(lambda: os.path.exists(f"/run/netns/{new}"), 30, what="the new allocation made")
    save(path, "version: 1\nbridges: [\n")
    agent.wait_status(lambda d: d.get("config_error"), 30, what="the config error")
    save(path, more)
    agent.wait_status(lambda d: not d.get("config_error"), 30, what="the error cleared")
    wait_for(lambda: "config error cleared" in agent.log_text(), 10, what="the cleared line")
    assert agent.log_text().count("config error cleared") == 1
    return agent.wait_status(shown, 30, what="blocked again")


def test_watch_heals_around_a_foreign_bridge(host_ns: Netns, tmp_path: Any) -> None:
    good, foreign, a, b = unique("g"), unique("f"), unique("a"), unique("b")
    host_ns.run("ip", "link", "add", foreign, "type", "bridge")
    agent, path = start(host_ns, tmp_path, config(good, foreign, [a]))
    try:
        doc = heals_around(agent, host_ns, path, f"bridge/{foreign}", "--adopt", good,
                           config(good, foreign, [a, b]), b)
        listed = {x["resource"] for x in doc["blocked"]}
        assert listed == {f"bridge/{foreign}", f"subnet/{foreign}-n", f"alloc/{foreign}a"}
        st = host_ns.reconcile("status", "--addr", agent.addr)
        assert "blocked: 3 resource(s)" in st.out, st.all
        assert f"bridge/{foreign}: blocked: exists but was not created by the reconciler" \
            in st.out, st.all
    finally:
        agent.stop()


def test_watch_heals_around_a_docker_network_it_may_not_replace(
        host_ns: Netns, tmp_path: Any, docker_scratch_image: DockerScratch) -> None:
    good, a, b = unique("g"), unique("a"), unique("b")
    net = docker_scratch_image.name("n")
    first = config(good, None, [a], f"docker_networks:\n  - {{name: {net}}}\n")
    r = host_ns.reconcile("apply", write(tmp_path, "first.yaml", first))
    assert r.rc == 0, r.all
    docker_scratch_image.attach(docker_scratch_image.container("c"), net)
    mtu = f"docker_networks:\n  - {{name: {net}, mtu: 1400}}\n"
    agent, path = start(host_ns, tmp_path, config(good, None, [a], mtu))
    try:
        doc = heals_around(agent, host_ns, path, f"docker_network/{net}",
                           "replace refused: 1 container attached", good,
                           config(good, None, [a, b], mtu), b)
        reason = next(x["reason"] for x in doc["blocked"])
        assert "--force-replace" in reason and "not created by the reconciler" not in reason
    finally:
        agent.stop()


def test_a_workload_rewriting_its_lo_alias_blocks_nothing(host_ns: Netns,
                                                           tmp_path: Any) -> None:
    """Issue 25 item 7: a workload with NET_ADMIN inside its allocation rewrites ``lo``'s
    alias; ownership rests on the mark on /run/netns/ID, which it cannot write."""
    good, a, b = unique("g"), unique("a"), unique("b")
    path = write(tmp_path, "h.yaml", config(good, None, [a, b]))
    assert host_ns.reconcile("apply", path).rc == 0
    os.system(f"ip -n {a} link set lo alias 'mine now'")  # noqa: S605 - fixed argv, test names
    p = host_ns.reconcile("plan", path, "--no-agent")
    assert p.rc == 0 and "conflict" not in p.all and "blocked" not in p.all.lower(), p.all
    r = host_ns.reconcile("apply", path)
    assert r.rc == 0, r.all


def test_a_workload_flapping_its_eth0_backs_off_alone(host_ns: Netns, tmp_path: Any) -> None:
    """Issue 25 item 7: a workload flapping its own ``eth0`` is its allocation's business:
    the agent holds that allocation back on its own backoff and never backs off as a whole,
    so another allocation's veth deleted by hand comes back."""
    good, a, b = unique("g"), unique("a"), unique("b")
    agent, _path = start(host_ns, tmp_path, config(good, None, [a, b]))
    stop = threading.Event()

    def flap() -> None:
        while not stop.is_set():
            sh("ip", "-n", a, "link", "set", "eth0", "down", check=False)
            stop.wait(0.05)

    flapper = threading.Thread(target=flap, daemon=True)
    try:
        agent.converged(60)
        flapper.start()
        agent.wait_status(lambda d: any(x["resource"] == f"alloc/{a}"
                                        for x in d.get("blocked") or ()), 60,
                          what=f"alloc/{a} held back")
        veth = alloc_veth_name(b)
        host_ns.run("ip", "link", "del", veth)
        wait_for(lambda: host_ns.link(veth) is not None, 30, what="the other veth back")
        doc = agent.status() or {}
        assert doc.get("consecutive_failures") == 0, doc
        assert "failed; retrying" not in agent.log_text(), agent.log_text()
    finally:
        stop.set()
        if flapper.is_alive():
            flapper.join()
        agent.stop()
