"""The real OpRunner: maps each plan op to the driver that performs it.

This is the single gate for side effects: nothing else in the reconciler
changes the host.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from reconciler.domain import ownership
from reconciler.domain.docker import SCOPE_LABEL, spec_from_json
from reconciler.domain.errors import DriverError, TemporaryError
from reconciler.domain.live import LiveDockerNetwork
from reconciler.domain.model import DockerNetwork
from reconciler.domain.plan import Op
from reconciler.drivers import sysctl
from reconciler.drivers.iptables import IptablesDriver
from reconciler.drivers.netlink.client import Netlink

if TYPE_CHECKING:
    from reconciler.drivers.docker.client import DockerDriver

log = logging.getLogger("reconciler")
Handler = Callable[[dict[str, Any]], None]


def _ifaces(values: list[str]) -> list[Any]:
    return [ipaddress.ip_interface(v) for v in values]


class HostOps:
    def __init__(self, netlink: Any | None = None) -> None:
        self._netlink = netlink
        self._ipt: dict[int, IptablesDriver] = {}
        self._docker: DockerDriver | None = None
        self._op_counts: dict[str, int] = {}  # for _inject_fault only
        self.handlers: dict[str, Handler] = {
            "link.add_bridge": self._add_bridge,
            "link.set": self._set_link,
            "link.delete": lambda a: self.netlink.delete_link(a["name"], a.get("netns")),
            "link.set_hairpin": lambda a: self.netlink.set_hairpin(a["name"], a["on"]),
            "addr.add": lambda a: self.netlink.add_address(
                a["link"], ipaddress.ip_interface(a["address"]), ns=a.get("netns")),
            "addr.del": lambda a: self.netlink.del_address(
                a["link"], ipaddress.ip_interface(a["address"]), ns=a.get("netns")),
            "route.del_default": lambda a: self.netlink.del_default_route(
                a["version"], ns=a["netns"]),
            "netns.create": lambda a: self.netlink.create_netns(
                a["name"], replace_stale=a.get("replace_stale", False), mark=a.get("mark")),
            "netns.delete": lambda a: self.netlink.delete_netns(a["name"]),
            "alloc.attach": lambda a: self.netlink.create_veth_into_netns(
                a["veth"], a["netns"], a["bridge"], a.get("mtu"), a["hairpin"]),
            "alloc.configure": lambda a: self.netlink.configure_inside(
                a["netns"], _ifaces(a["addresses"]),
                [ipaddress.ip_address(g) for g in a["gateways"]], mtu=a.get("mtu"),
                ipv6_link_local=a.get("ipv6", False), mark=a.get("mark")),
            "sysctl.set": lambda a: sysctl.write(a["key"], a["value"]),
            "firewall.restore": lambda a: self.iptables(a["family"]).restore(a["script"]),
        }
        self.handlers.update(self._docker_handlers())

    @property
    def netlink(self) -> Any:
        if self._netlink is None:
            self._netlink = Netlink()
        return self._netlink

    def iptables(self, family: int) -> IptablesDriver:
        if family not in self._ipt:
            self._ipt[family] = IptablesDriver(family)
        return self._ipt[family]

    def _add_bridge(self, a: dict[str, Any]) -> None:
        self.netlink.ensure_bridge(a["name"], a.get("mtu"), ownership.LINK_ALIAS)

    def _set_link(self, a: dict[str, Any]) -> None:
        kwargs: dict[str, Any] = {}
        if "mtu" in a:
            kwargs["mtu"] = a["mtu"]
        if "up" in a:
            kwargs["up"] = a["up"]
        if "master" in a:
            kwargs["master"] = a["master"]
        if "netns" in a:
            kwargs["ns"] = a["netns"]
        if a.get("owned"):
            kwargs["alias"] = ownership.LINK_ALIAS
        self.netlink.set_link(a["name"], **kwargs)

    @property
    def docker(self) -> DockerDriver:
        """The Docker driver, made on first use; its client is reused across passes."""
        if self._docker is None:
            # the Docker SDK (with requests/urllib3) costs ~80 ms to import (bench/RESULTS.md,
            # -X importtime): only runs that change a Docker network pay it
            from reconciler.drivers.docker.client import DockerDriver  # noqa: PLC0415

            self._docker = DockerDriver()
        return self._docker

    def _docker_handlers(self) -> dict[str, Handler]:
        return {
            "docker.ensure": self._docker_ensure,
            "docker.replace": self._docker_replace,
            "docker.dedupe": self._docker_dedupe,
            "docker.remove": self._docker_remove,
        }

    @staticmethod
    def _docker_spec(a: dict[str, Any]) -> DockerNetwork:
        """The declared network of an op, with the scope label of the networks we create."""
        try:
            spec = spec_from_json(a["spec"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DriverError(f"malformed docker op arguments: {exc!r}") from None
        if a.get("scope"):
            labels = {**dict(spec.labels), SCOPE_LABEL: str(a["scope"])}
            spec = dataclasses.replace(spec, labels=tuple(sorted(labels.items())))
        return spec

    @staticmethod
    def _docker_report(name: str, warnings: tuple[str, ...], removed: tuple[str, ...]) -> None:
        # e.g. kind's IPv4-only fallback: the user must see it, whatever the log level
        for w in warnings:
            log.warning("%s", w)
        if removed:
            log.info("docker network %s: removed duplicate(s) %s", name,
                     ", ".join(r[:12] for r in removed))

    def _docker_ensure(self, a: dict[str, Any]) -> None:
        spec = self._docker_spec(a)
        result = self.docker.ensure(spec, a.get("default_mtu"))
        self._docker_report(spec.name, result.warnings, result.removed_duplicates)

    def _docker_replace(self, a: dict[str, Any]) -> None:
        spec = self._docker_spec(a)
        # replace() re-inspects the network by ID; only the ID and name matter here
        live = LiveDockerNetwork(id=str(a["id"]), name=spec.name, driver="", labels={},
                                 options={}, enable_ipv6=False, internal=False, subnets=(),
                                 containers=0)
        result = self.docker.replace(spec, live, a.get("default_mtu"), bool(a.get("reconnect")),
                                     adopt=bool(a.get("adopt")))
        self._docker_report(spec.name, result.warnings, result.removed_duplicates)
        if result.reconnected:
            log.info("docker network %s: reconnected %s", spec.name,
                     ", ".join(result.reconnected))

    def _docker_dedupe(self, a: dict[str, Any]) -> None:
        result = self.docker.dedupe(str(a["name"]))
        self._docker_report(str(a["name"]), (), result.removed)

    def _docker_remove(self, a: dict[str, Any]) -> None:
        self.docker.remove(str(a["id"]))  # False when already gone: idempotent

    def run(self, op: Op) -> None:
        handler = self.handlers.get(op.name)
        if handler is None:
            raise DriverError(f"unknown operation {op.name!r} (plan from a newer version?)")
        self._inject_fault(op.name)
        handler(op.args)

    def _inject_fault(self, name: str) -> None:
        """TEST-ONLY fault injection, off unless ``RECONCILER_FAULTS`` is set.

        ``RECONCILER_FAULTS="alloc.attach:3,netns.create:1:EBUSY"``: the 3rd
        ``alloc.attach`` op of this process fails as the kernel's EPERM would
        (a ``DriverError``), the 1st ``netns.create`` as EBUSY would (a
        ``TemporaryError``, so the executor retries it). Used by
        tests/integration/test_faults.py; never set it on a real host.
        """
        spec = os.environ.get("RECONCILER_FAULTS")
        if not spec:
            return
        self._op_counts[name] = n = self._op_counts.get(name, 0) + 1
        for item in spec.split(","):
            op, _, rest = item.strip().partition(":")
            nth, _, code = rest.partition(":")
            if op == name and nth.isdigit() and int(nth) == n:
                code_n = getattr(errno, code or "EPERM", errno.EPERM)
                msg = f"{name}: {os.strerror(code_n)} (injected fault {n})"
                exc = TemporaryError(msg) if code_n == errno.EBUSY else DriverError(msg)
                exc.errno = code_n
                raise exc

    def close(self) -> None:
        if self._netlink is not None and hasattr(self._netlink, "close"):
            self._netlink.close()
        if self._docker is not None:
            self._docker.close()
