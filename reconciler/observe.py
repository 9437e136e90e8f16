"""Observation: read the live state through drivers into one ``LiveState`` value.

Read-only. Further kinds (alloc namespaces, Docker) add observers to ``EXTRA``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from reconciler.drivers import sysctl
from reconciler.hostops import HostOps
from reconciler.live import LiveState
from reconciler.model import DesiredState

#: sysctls every plan may need to compare
SYSCTL_KEYS = ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding")

ExtraObserver = Callable[["Observer", DesiredState, dict[str, Any]], None]
#: fn(observer, desired, fields) fills LiveState fields (e.g. "netns", "docker")
EXTRA: list[ExtraObserver] = []


class Observer:
    """Holds driver handles (sockets) across passes; ``observe`` is read-only."""

    def __init__(self, ops: HostOps | None = None) -> None:
        self.ops = ops or HostOps()

    def observe(self, desired: DesiredState, *, extra_sysctls: tuple[str, ...] = ()) -> LiveState:
        links = self.ops.netlink.dump_links()
        fields: dict[str, Any] = {
            "links": links,
            "firewall4": self.ops.iptables(4).observe(),
            "firewall6": self.ops.iptables(6).observe(),
            "sysctls": {k: v for k in (*SYSCTL_KEYS, *extra_sysctls)
                        if (v := sysctl.read(k)) is not None},
        }
        for fn in EXTRA:
            fn(self, desired, fields)
        return dataclasses.replace(LiveState(), **fields)
