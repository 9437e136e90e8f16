"""The guides' examples apply, converge and tear down, in a throwaway namespace.

examples/kind-network.yaml and examples/allocs.yaml are applied by test_docker_cli.py
and test_allocs.py; this covers examples/nomad-allocs.yaml and examples/fleet/.
"""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

from tests.support.host import EXAMPLES, Netns, sh, unique

pytestmark = [pytest.mark.root]


def _converges(ns: Netns, path: str) -> None:
    p = ns.reconcile("plan", path)
    assert p.rc == 2, p.all
    p = ns.reconcile("apply", path)
    assert p.rc == 0, p.all
    p = ns.reconcile("plan", path)
    assert p.rc == 0, "not converged:\n" + p.all


def test_nomad_allocs_example(host_ns: Netns, tmp_path) -> None:
    with open(os.path.join(EXAMPLES, "nomad-allocs.yaml")) as fh:
        doc = yaml.safe_load(fh)
    ids = {a["id"]: unique("a") for a in doc["allocs"]}  # namespaces are global
    for a in doc["allocs"]:
        a["id"] = ids[a["id"]]
    path = tmp_path / "nomad-allocs.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        _converges(host_ns, str(path))
        assert "172.26.64.1/20" in host_ns.addrs("nomad0")
        assert "172.26.64.10/20" in Netns(ids["web-1"]).addrs("eth0")
        assert host_ns.reconcile("destroy", "--yes").rc == 0
        assert not any(os.path.exists(f"/run/netns/{i}") for i in ids.values())
    finally:
        for i in ids.values():
            sh("ip", "netns", "del", i, check=False)


def test_fleet_example_on_this_host(host_ns: Netns, tmp_path) -> None:
    # Only the files whose hosts: match this host apply; common.yaml matches every host.
    fleet = tmp_path / "fleet"
    shutil.copytree(os.path.join(EXAMPLES, "fleet"), fleet)
    os.chmod(fleet, 0o755)
    _converges(host_ns, str(fleet))
    assert "10.88.0.1/24" in host_ns.addrs("fleet0")
    assert host_ns.reconcile("destroy", "--yes").rc == 0
    assert host_ns.link("fleet0") is None
