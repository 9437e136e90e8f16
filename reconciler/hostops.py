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
#: further kinds add their ops here (op name -> factory taking the HostOps)
EXTRA_OPS: dict[str, Callable[[HostOps], Handler]] = {}


class HostOps:
    def __init__(self, netlink: Any | None = None) -> None:
        self._netlink = netlink
        self._ipt: dict[int, IptablesDriver] = {}
        self.handlers: dict[str, Handler] = {
            "link.add_bridge": self._add_bridge,
            "link.set": self._set_link,
            "link.delete": lambda a: self.netlink.delete_link(a["name"]),
            "addr.add": lambda a: self.netlink.add_address(
                a["link"], ipaddress.ip_interface(a["address"])),
            "addr.del": lambda a: self.netlink.del_address(
                a["link"], ipaddress.ip_interface(a["address"])),
            "sysctl.set": lambda a: sysctl.write(a["key"], a["value"]),
            "firewall.restore": lambda a: self.iptables(a["family"]).restore(a["script"]),
        }
        for name, factory in EXTRA_OPS.items():
            self.handlers[name] = factory(self)

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
        if a.get("owned"):
            kwargs["alias"] = ownership.LINK_ALIAS
        self.netlink.set_link(a["name"], **kwargs)

    def run(self, op: Op) -> None:
        handler = self.handlers.get(op.name)
        if handler is None:
            raise DriverError(f"unknown operation {op.name!r} (plan from a newer version?)")
        handler(op.args)

    def close(self) -> None:
        if self._netlink is not None and hasattr(self._netlink, "close"):
            self._netlink.close()
