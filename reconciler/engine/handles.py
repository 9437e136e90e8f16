"""The drivers of one host (the network namespace we act on), made on first use and shared.

Observation reads through them and ``HostOps`` changes through them, so one
pass keeps one netlink socket (and its cached sockets into allocation
namespaces), one iptables driver per family and one Docker client.

See docs/decisions/006-plans-are-values.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reconciler.drivers.iptables import IptablesDriver
from reconciler.drivers.netlink.client import Netlink
from reconciler.drivers.netlink.conntrack import Conntrack
from reconciler.drivers.nft.driver import NftDriver

if TYPE_CHECKING:
    from reconciler.drivers.docker.client import DockerDriver


class HostHandles:
    """Lazily made driver handles; ``close`` releases what was made."""

    def __init__(self, netlink: Netlink | None = None,
                 docker: DockerDriver | None = None,
                 conntrack: Conntrack | None = None) -> None:
        self._netlink = netlink
        self._ipt: dict[int, IptablesDriver] = {}
        self._docker = docker
        self._conntrack = conntrack
        #: made now, at start-up, while the process holds few fds (``drivers.nft.lib``)
        self._nft = NftDriver()

    @property
    def netlink(self) -> Netlink:
        if self._netlink is None:
            self._netlink = Netlink()
        return self._netlink

    def iptables(self, family: int) -> IptablesDriver:
        if family not in self._ipt:
            self._ipt[family] = IptablesDriver(family)
        return self._ipt[family]

    @property
    def nft(self) -> NftDriver:
        """Our nftables table's driver (libnftables in this process, or ``nft``)."""
        return self._nft

    @property
    def conntrack(self) -> Conntrack:
        """The conntrack table of this namespace, opened by the first port map that moves."""
        if self._conntrack is None:
            self._conntrack = Conntrack()
        return self._conntrack

    @property
    def docker(self) -> DockerDriver:
        """The Docker driver, made on first use; its client is reused across passes."""
        if self._docker is None:
            # the Docker SDK (with requests/urllib3) costs ~80 ms to import (bench/RESULTS.md,
            # -X importtime): only runs that touch a Docker network pay it
            from reconciler.drivers.docker.client import DockerDriver  # noqa: PLC0415

            self._docker = DockerDriver()
        return self._docker

    def open_namespaces(self) -> frozenset[str]:
        """Return the allocation namespaces a cached netlink socket keeps alive (none before first
        use)."""
        return self._netlink.cached_names() if self._netlink is not None else frozenset()

    def close(self) -> None:
        if self._netlink is not None:
            self._netlink.close()
            self._netlink = None
        if self._conntrack is not None:
            self._conntrack.close()
            self._conntrack = None
        if self._docker is not None:
            self._docker.close()
            self._docker = None
