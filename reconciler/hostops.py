"""The real OpRunner: maps each plan op to the driver that performs it.

This is the single gate for side effects: nothing else in the reconciler
changes the host.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

from reconciler import ownership
from reconciler.drivers import sysctl
from reconciler.drivers.iptables import IptablesDriver
from reconciler.errors import DriverError
from reconciler.plan import Op

Handler = Callable[[dict[str, Any]], None]


def _ifaces(values: list[str]) -> list[Any]:
    return [ipaddress.ip_interface(v) for v in values]


class HostOps:
    def __init__(self, netlink: Any | None = None) -> None:
        self._netlink = netlink
        self._ipt: dict[int, IptablesDriver] = {}
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
            from reconciler.drivers.links import Netlink

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

    def _docker_handlers(self) -> dict[str, Handler]:
        return {}

    def run(self, op: Op) -> None:
        handler = self.handlers.get(op.name)
        if handler is None:
            raise DriverError(f"unknown operation {op.name!r} (plan from a newer version?)")
        handler(op.args)

    def close(self) -> None:
        if self._netlink is not None and hasattr(self._netlink, "close"):
            self._netlink.close()
