"""Probe values: which packet a probe sends, and what came of it (pure, SPEC §7).

A probe proves from inside the host that packets flow: the gateway answers from
inside an allocation's namespace, and a connection through each port map
arrives in the allocation's namespace along each path a client can take. The
planner decides which probes exist and what is expected (``planner.probes``),
``drivers.probe`` sends them and watches for them, the engine
(``engine.probes.Prober``) puts the two together.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

#: every path a probe can take, in the order results are reported
#: gateway: echo to the subnet's gateway from inside the alloc; host: the host itself to a host
#: address of its own through the map; localhost: the host to 127.0.0.1 through the map;
#: hairpin: the alloc to its own host port; external: a namespace of ours standing in for
#: another host, through the map (PREROUTING/FORWARD); direct: that namespace straight to the
#: alloc's address and container port (reached only with ``isolation: open``)
PATHS = ("gateway", "host", "localhost", "hairpin", "external", "direct")

Path = Literal["gateway", "host", "localhost", "hairpin", "external", "direct"]
ProbeProto = Literal["icmp", "tcp", "udp"]
#: where a probe's packet starts: the host (the namespace the reconciler acts on), inside the
#: allocation, or the external vantage namespace
Vantage = Literal["host", "alloc", "external"]

#: source ports of every TCP/UDP probe (inclusive): outside the kernel's default ephemeral
#: range (``ip_local_port_range`` 32768-60999) and the ``host: auto`` range, so no connection
#: the host makes by itself takes one and flow counts and logs can tell probes apart
PROBE_PORTS = (61000, 61999)

#: the external vantage link: the host end is .1, the vantage namespace .2 (link-local, and
#: reserved in the address space: no declared prefix may overlap it)
VANTAGE_NET = ipaddress.IPv4Network("169.254.250.0/30")
VANTAGE_HOST = str(VANTAGE_NET.network_address + 1)
VANTAGE_PEER = str(VANTAGE_NET.network_address + 2)
#: what a declared prefix that overlaps ``VANTAGE_NET`` is told it overlaps
VANTAGE_RESERVED = f"{VANTAGE_NET}, reserved for the probes' external vantage link"
#: the vantage link's IPv6 pair, so IPv6 maps are probed from outside too: host ::1, vantage
#: ::2 of a /126 (::0, the subnet-router anycast, is not used, as .0 of the /30 is not).
#: Link-local fe80::/10 cannot stand in for another host: the kernel refuses to forward a
#: packet with a link-local source (and NAT to one), so it would never reach an allocation.
#: A unique-local (RFC 4193) prefix whose 40-bit global ID is the first 40 bits of
#: SHA-1("reconciler probe vantage") instead: fixed, so every host and plan reserves the
#: same prefix with no state, and random-looking, so it meets nobody's ULA by accident.
VANTAGE_NET6 = ipaddress.IPv6Network("fd18:d6bc:22af::/126")
VANTAGE6_HOST = str(VANTAGE_NET6.network_address + 1)
VANTAGE6_PEER = str(VANTAGE_NET6.network_address + 2)
VANTAGE6_RESERVED = f"{VANTAGE_NET6}, reserved for the probes' external vantage link"
#: both, for the address space (the same reservation per family)
VANTAGE_NETS: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str], ...] = (
    (VANTAGE_NET, VANTAGE_RESERVED), (VANTAGE_NET6, VANTAGE6_RESERVED))


@dataclass(frozen=True)
class ProbeSpec:
    """One probe to send: where from, to what, and what counts as its arrival.

    ``dst``/``dport`` is what the sender addresses (the host port of a map, the
    gateway); ``to`` is the port the packet must carry when it arrives in the
    allocation's namespace (the map's container port), None for an echo.
    """

    alloc: str
    path: Path
    proto: ProbeProto
    family: int
    vantage: Vantage
    dst: str
    #: the port probed (what results report): the map's host port, the container port for
    #: "direct" (it goes to the allocation's own address), None for "gateway"
    port: int | None = None
    dport: int | None = None  # destination port the sender uses
    to: int | None = None  # the container port the capture must see
    #: reached is the expected outcome (False: "direct" under ``isolation: ports``, "hairpin"
    #: on a bridge that declares ``hairpin: false``)
    expect: bool = True
    skipped: str | None = None  # why the path cannot exist here: not sent, reported skipped
    #: why it must not be sent (a namespace that is not this host's allocation): not sent,
    #: reported failed with this cause
    refused: str | None = None
    #: the address the packet leaves from, when it is known before sending (the echo: the
    #: alloc's own), so the conntrack entry it makes can be found afterwards
    src: str | None = None
    #: the echo: also send one this many bytes long (the IP packet: eth0's MTU) with DF, so
    #: a smaller MTU on the way (a black hole) fails the probe where a small echo passes
    size: int = 0

    @property
    def key(self) -> tuple[str, str, str, int, int | None]:
        return (self.alloc, self.path, self.proto, self.family, self.port)


@dataclass(frozen=True)
class ProbeResult:
    """What one probe found. ``ok``: the outcome was the expected one (reached, or for
    ``direct`` under ``isolation: ports``, not reached)."""

    alloc: str
    path: str  # one of PATHS
    proto: str  # "icmp" | "tcp" | "udp"
    port: int | None  # the port probed: the host port, the container port for "direct"
    ok: bool
    skipped: bool = False  # the path cannot exist here (e.g. no host address in a bare sandbox)
    cause: str | None = None  # one line for people: why it failed (or why it was skipped)
    #: from sending to the prober seeing it arrive (or giving up): an upper bound of the
    #: path's latency, which includes the run's own work on the other probes
    ms: float = 0.0
    family: int = 4
    ours: bool = False  # the cause is something a reconcile pass owns and heals

    def to_json(self) -> dict[str, object]:
        return {"alloc": self.alloc, "path": self.path, "proto": self.proto,
                "port": self.port, "ok": self.ok, "skipped": self.skipped,
                "cause": self.cause, "ms": round(self.ms, 3), "family": self.family}

    def describe(self) -> str:
        """Return ``alloc web-1: hairpin tcp/8080: CAUSE`` — the line an apply error or a log
        shows."""
        where = self.proto if self.port is None else f"{self.proto}/{self.port}"
        v6 = " (IPv6)" if self.family == 6 else ""
        return f"alloc {self.alloc}: {self.path} {where}{v6}: {self.cause or 'ok'}"


def sort_key(r: ProbeResult) -> tuple[str, int, int, str, int]:
    """Order results for the report: by alloc, path (PATHS order), family, proto, port."""
    return (r.alloc, PATHS.index(r.path), r.family, r.proto, r.port or 0)
