"""Docker as the docker CLI shows it (never our observer), and a network of ours with
containers on it (the replace scenarios of the journal and gc tests)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from tests.support.dockerscratch import DockerScratch
from tests.support.host import Netns, write

#: the aliases of the 4 containers of :func:`four_attached`
ALIASES = (["web"], ["db", "cache"], [], ["api"])


def docker(*args: str, check: bool = True) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check,
                          timeout=60).stdout


def inspect(ref: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(docker("network", "inspect", ref))[0]
    return result


def ids(name: str) -> list[str]:
    return sorted(docker("network", "ls", "--no-trunc", "--filter", f"name=^{name}$",
                         "--format", "{{.ID}}").split())


def subnets(attrs: dict[str, Any]) -> list[str]:
    return [c["Subnet"] for c in attrs["IPAM"]["Config"] or []]


def bridge_mtu() -> str:
    return str(inspect("bridge")["Options"].get("com.docker.network.driver.mtu", ""))


def networks_file(tmp_path: Any, *nets: str, name: str = "d.yaml", extra: str = "") -> str:
    body = "version: 1\n" + extra
    if nets:
        body += "docker_networks:\n" + "".join(f"  - {n}\n" for n in nets)
    return write(tmp_path, name, body)


def endpoint(container: Any, network: str) -> dict[str, Any]:
    container.reload()
    return dict(container.attrs["NetworkSettings"]["Networks"][network])


def no_traceback(r: Any) -> None:
    assert "Traceback" not in r.all and "internal error" not in r.all, r.all


def attachment(container_id: str, network: str) -> dict[str, Any] | None:
    """The container's endpoint on ``network`` as `docker inspect` shows it (None: detached)."""
    (attrs,) = json.loads(docker("inspect", container_id))
    ep = (attrs["NetworkSettings"]["Networks"] or {}).get(network)
    if ep is None:
        return None
    return {"network_id": ep["NetworkID"], "ipv4": ep["IPAddress"],
            "ipv6": ep["GlobalIPv6Address"],
            "aliases": sorted(set(ep["Aliases"] or []) - {container_id[:12]})}


def journals(ns: Netns) -> list[str]:
    scope = os.path.join(os.environ["RECONCILER_STATE_DIR"], f"netns-{ns.name}")
    return sorted(n for n in os.listdir(scope) if n.startswith("journal-")) \
        if os.path.isdir(scope) else []


def four_attached(ns: Netns, scratch: DockerScratch, tmp_path: Any
                  ) -> tuple[str, str, dict[str, dict[str, Any]]]:
    """A network of ours with 4 containers on it; (its name, the changed file, endpoints)."""
    name = scratch.name("n")
    first = write(tmp_path, "a.yaml", f"version: 1\ndocker_networks:\n"
                                      f"  - {{name: {name}, ipv6: true}}\n")
    r = ns.reconcile("apply", first)
    assert r.rc == 0, r.all
    for i, aliases in enumerate(ALIASES):
        scratch.attach(scratch.container(f"c{i}"), name, aliases=aliases or None)
    before = {cid: attachment(cid, name) for cid in scratch.containers}
    for ep in before.values():
        assert ep is not None and ep["ipv4"] and ep["ipv6"], ep
    changed = write(tmp_path, "b.yaml", f"version: 1\ndocker_networks:\n"
                                        f"  - {{name: {name}, ipv6: true, mtu: 1400}}\n")
    return name, changed, before  # type: ignore[return-value]


def assert_all_reattached(name: str, before: dict[str, dict[str, Any]]) -> None:
    (net_id,) = ids(name)
    detached = [cid[:12] for cid in before if attachment(cid, name) is None]
    assert detached == [], f"containers left detached: {detached}"
    for cid, old in before.items():
        now = attachment(cid, name)
        assert now is not None and now["network_id"] == net_id, (cid[:12], now)
        assert (now["ipv4"], now["ipv6"]) == (old["ipv4"], old["ipv6"]), (cid[:12], old, now)
        assert set(old["aliases"]) <= set(now["aliases"]), (cid[:12], old, now)
