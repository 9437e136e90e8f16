"""The first apply of this version on a host holding the iptables chains of earlier versions
converts them to the table in one op, while traffic flows (SPEC §12, issue 26 item 5).

The earlier version's state is what it wrote for the same file: its ``RECONCILER-*``
chains with their rules (``planner.firewall``'s rule form, which our table's entries read
back as) and the jumps into them, written with ``iptables-restore`` as it did. A client
keeps connecting through the declared map and to an undeclared port during the upgrade:
every sample must reach the map and none the undeclared port. Traffic goes only to
addresses inside namespaces the test made.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from reconciler.domain.live import LiveChainSet
from reconciler.planner import firewall
from tests.support.figures import report
from tests.support.host import Netns, unique, write
from tests.support.traffic import HOST_IP, client_of, fetch, scan, serving

pytestmark = pytest.mark.root


def _earlier_version_script(host: Netns, family: int) -> str:
    """What an earlier version wrote for the rules our table holds now: chains and jumps."""
    rs = firewall.RuleSet(family)
    for line in host.our_rules(family).splitlines():
        _a, chain, rule = line.split(" ", 2)
        rs.add_rule(chain, rule.replace('"', ""), head=firewall.is_ingress(chain, rule))
    return firewall.diff(rs, LiveChainSet(True)).script


def test_upgrade_in_place_keeps_maps_open_and_the_rest_closed(
        host_ns: Netns, tmp_path: Any, request: pytest.FixtureRequest) -> None:
    a = unique("u")
    cfg = write(tmp_path, "up.yaml", f"""version: 1
bridges: [{{name: rupg0}}]
subnets: [{{name: upg, bridge: rupg0, cidr: 10.233.0.0/24}}]
allocs:
  - id: {a}
    subnet: upg
    ports: [{{host: 8080, to: 80}}, {{host: auto, to: 81}}]
""")
    r = host_ns.reconcile("apply", cfg)
    assert r.rc == 0, r.all
    before = host_ns.our_rules(4)
    auto = [ln for ln in before.splitlines() if ln.endswith(":81")]
    assert len(auto) == 1, before
    scripts = {f: _earlier_version_script(host_ns, f) for f in (4, 6)}
    host_ns.run("nft", "delete", "table", "inet", "reconciler")
    for f, tool in ((4, "iptables-restore"), (6, "ip6tables-restore")):
        if scripts[f]:
            host_ns.run(tool, "--noflush", input=scripts[f])
    assert "-j RECONCILER-FORWARD" in host_ns.iptables_save(4)
    info = Netns(a).ip_json("addr", "show", "eth0")[0]["addr_info"]
    addr = next(x["local"] for x in info if x["family"] == "inet")
    with client_of(host_ns) as client, serving(a, (22, 80)):
        # the earlier version's chains work: the map reaches it, port 22 does not
        assert fetch(client, HOST_IP, 8080) == "ok 80"
        assert scan(client, addr, [22, 80]) == []
        samples: list[tuple[str, list[int]]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((fetch(client, HOST_IP, 8080), scan(client, addr, [22, 80])))

        t = threading.Thread(target=sample)
        t.start()
        try:
            r = host_ns.reconcile("apply", cfg)
        finally:
            stop.set()
            t.join()
        assert r.rc == 0, r.all
        assert "converting the RECONCILER-* iptables chains" in r.out, r.out
        assert samples and all(s == ("ok 80", []) for s in samples), samples
        report(request, f"{len(samples)} samples during the upgrade's apply: each reached the "
                        "map, none port 22 or 80 directly")
        assert fetch(client, HOST_IP, 8080) == "ok 80"
        assert scan(client, addr, [22, 80]) == []
    for f in (4, 6):
        assert "RECONCILER" not in host_ns.iptables_save(f)
    assert host_ns.our_rules(4) == before  # the same rules, the auto port kept its number
    assert host_ns.reconcile("plan", cfg).rc == 0
