"""A host with no ``iptables`` binary (and no DROP to shim): apply, verify and heal work,
through our nftables table alone (SPEC §12, issue 26 item 4).

The binaries are removed in the sandbox's own mount namespace only (its private copy of
/etc/alternatives, where every iptables tool's link leads); the machine keeps its own.
Traffic goes only to addresses inside namespaces the test made.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.support.cells import TOOLS, Cell
from tests.support.host import Netns, unique, write
from tests.support.traffic import HOST_IP, client_of, fetch, scan, serving

pytestmark = pytest.mark.root


def test_apply_verify_and_heal_without_iptables(tmp_path: Any) -> None:
    if not all(shutil.which(t) for t in ("unshare", "nsenter", "nft")):
        pytest.skip("needs unshare, nsenter and nft")
    c = Cell("nft", "no-dockerd", "none", str(tmp_path))
    try:
        for tool in (*TOOLS, "iptables-legacy", "iptables-nft"):
            c.run("rm", "-f", f"/etc/alternatives/{tool}")
        gone = c.run("sh", "-c", "command -v iptables iptables-save ip6tables", check=False)
        assert gone.stdout.strip() == "", gone.stdout  # nothing left to run in the sandbox
        a = unique("g")
        cfg = write(tmp_path, "noipt.yaml", f"""version: 1
bridges: [{{name: rnoi0}}]
subnets: [{{name: noi, bridge: rnoi0, cidr: 10.232.0.0/24}}]
allocs:
  - id: {a}
    subnet: noi
    ports: [{{host: 8080, to: 80}}]
""")
        r = c.reconcile("apply", cfg)
        assert r.returncode == 0, r.stdout + r.stderr
        assert c.reconcile("verify", cfg).returncode == 0
        info = Netns(a).ip_json("addr", "show", "eth0")[0]["addr_info"]
        addr = next(x["local"] for x in info if x["family"] == "inet")
        with client_of(c.host) as client, serving(a, (22, 80)):
            assert fetch(client, HOST_IP, 8080) == "ok 80"
            assert fetch(client, addr, 80) == ""  # the port behind the map: not directly
            assert scan(client, addr, [22, 80]) == []
            c.run("nft", "flush", "table", "inet", "reconciler")  # someone empties it
            assert scan(client, addr, [22, 80]) == [22, 80]  # what the table kept closed
            v = c.reconcile("verify", cfg)
            assert v.returncode == 1, v.stdout + v.stderr
            r = c.reconcile("apply", cfg)
            assert r.returncode == 0, r.stdout + r.stderr
            assert "table inet reconciler differs" in r.stdout, r.stdout
            assert fetch(client, HOST_IP, 8080) == "ok 80"
            assert scan(client, addr, [22, 80]) == []
            assert c.reconcile("verify", cfg).returncode == 0
    finally:
        c.close()
