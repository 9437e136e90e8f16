"""Docker without a daemon: Docker payloads captured from a real dockerd 20.10.24
(``tests/unit/drivers/docker/fixtures/``), and an in-memory fake of the SDK's low-level
API, which also lets tests provoke daemon answers this host cannot produce (IPv6
missing). The ``fake_docker`` fixture (``tests/unit/conftest.py``) hands out a driver
over it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import docker.errors

from reconciler.domain.docker import (
    OPT_MASQUERADE,
    OPT_MTU,
)
from reconciler.domain.live import LiveDockerNetwork
from reconciler.domain.model import DockerNetwork, DockerNetworkName
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from tests.support.host import REPO

FIXTURES = Path(REPO) / "tests" / "unit" / "drivers" / "docker" / "fixtures"


OURS = {DOCKER_LABEL: DOCKER_LABEL_VALUE}


def load(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


#: error texts of a real dockerd, per kind, in the SDK's and the CLI's wording
ERRORS = load("errors.json")

#: what the daemon answers when it cannot set up IPv6 for a network
KIND_IPV6_ERRORS = [
    "Error response from daemon: Cannot read IPv6 setup for bridge br-1234: open "
    "/proc/sys/net/ipv6/conf/br-1234/disable_ipv6: no such file or directory",
    "Error response from daemon: Failed to Setup IP tables: Unable to enable NAT rule:  "
    "(iptables failed: ip6tables --wait -t nat -I POSTROUTING ...: exit status 3)",
    "Error response from daemon: setting default policy to DROP in FORWARD chain failed:  "
    "(iptables failed: ip6tables --wait -P FORWARD DROP: exit status 3)",
]


def spec(name: str = "kind", **kw: Any) -> DockerNetwork:
    return DockerNetwork(name=DockerNetworkName(name), **kw)


def live(**kw: Any) -> LiveDockerNetwork:
    base: dict[str, Any] = dict(
        id="a" * 64, name="kind", driver="bridge", labels=dict(OURS),
        options={OPT_MASQUERADE: "true", OPT_MTU: "1500"}, enable_ipv6=False,
        internal=False, subnets=("172.18.0.0/16",), containers=0,
    )
    base.update(kw)
    return LiveDockerNetwork(**base)


def api_error(text: str, cls: type[docker.errors.APIError] = docker.errors.APIError
              ) -> docker.errors.APIError:
    return cls(f'500 Server Error: ("{text}")', explanation=text)


class FakeAPI:
    """Just enough of ``docker.APIClient`` for the network driver."""

    def __init__(self) -> None:
        self.nets: dict[str, dict[str, Any]] = {}
        self.create_errors: list[str] = []  # raised by the next create calls, in order
        self.calls: list[tuple[str, Any]] = []
        self.containers: dict[str, dict[str, Any]] = {}
        self._next = 0
        self.add("bridge", options={OPT_MTU: "1500"}, id_="b" * 64)

    def add(self, name: str, *, labels: dict[str, str] | None = None, containers: int = 0,
            options: dict[str, str] | None = None, subnets: tuple[str, ...] = (),
            ipv6: bool = False, id_: str | None = None) -> str:
        self._next += 1
        nid = id_ or f"{self._next:02d}" + "0" * 62
        self.nets[nid] = {
            "Id": nid, "Name": name, "Driver": "bridge", "EnableIPv6": ipv6, "Internal": False,
            "IPAM": {"Config": [{"Subnet": s} for s in subnets]},
            "Containers": {f"{nid[:4]}c{i}": {"Name": f"c{i}"} for i in range(containers)},
            "Options": options or {}, "Labels": labels or {},
        }
        return nid

    def _find(self, ref: str) -> dict[str, Any]:
        for n in self.nets.values():
            if ref in (n["Id"], n["Name"]) or (len(ref) >= 12 and n["Id"].startswith(ref)):
                return n
        raise api_error(f"network {ref} not found", docker.errors.NotFound)

    def networks(self, names: Any = None, ids: Any = None, filters: Any = None) -> list[Any]:
        self.calls.append(("networks", filters))
        out = []
        for n in self.nets.values():
            if filters and "name" in filters and not re.search(filters["name"], n["Name"]):
                continue
            out.append({**n, "Containers": {}})
        return out

    def inspect_network(self, ref: str) -> dict[str, Any]:
        self.calls.append(("inspect", ref))
        return self._find(ref)

    def create_network(self, name: str, **kw: Any) -> dict[str, str]:
        self.calls.append(("create", (name, kw)))
        if self.create_errors:
            raise api_error(self.create_errors.pop(0))
        pools = kw["ipam"]["Config"] if kw.get("ipam") else []
        subnets = tuple(p["Subnet"] for p in pools) or ("172.20.0.0/16",)
        nid = self.add(name, labels=kw.get("labels"), options=kw.get("options"),
                       subnets=subnets, ipv6=kw.get("enable_ipv6", False))
        return {"Id": nid, "Warning": ""}

    def inspect_container(self, ref: str) -> dict[str, Any]:
        return self.containers.get(ref) or {"Id": ref, "Name": "/" + ref,
                                            "NetworkSettings": {"Networks": {}}}

    def remove_network(self, ref: str) -> None:
        self.calls.append(("remove", ref))
        n = self._find(ref)
        del self.nets[n["Id"]]


class FakeClient:
    def __init__(self) -> None:
        self.api = FakeAPI()

    def close(self) -> None:
        pass
