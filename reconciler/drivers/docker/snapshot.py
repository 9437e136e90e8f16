"""Docker networks as a checkpoint records them, and their re-creation by a revert.

``snapshot`` reads our networks of one scope with what a revert needs to rebuild them
exactly: driver options, labels, IPAM pools with their gateways, and each attached
container's addresses and aliases (the container's own view: the network's lists no
aliases). ``restore`` re-creates one such network and re-attaches the recorded
containers that still exist at their addresses (one removed meanwhile is gone: named,
not a failure); given the network a change made in its place, it first disconnects
that one's containers and removes it, and refuses when a container the checkpoint does
not list is attached to it (someone attached it in the window: a revert never takes a
network away from a container it did not record).

In its own module so that ``client`` (kind's semantics for declared networks) stays as
it is: ``DockerDriver.snapshot`` and ``DockerDriver.restore_network`` hand it their SDK
API client.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import docker.errors
import requests.exceptions
from docker.types import IPAMConfig, IPAMPool

from reconciler.domain.checkpoint import EndpointPoint, NetworkPoint
from reconciler.domain.docker import PROTECTED_NETWORKS, SCOPE_LABEL
from reconciler.domain.errors import ConflictError, DriverError, TemporaryError
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.drivers.docker.failures import explanation, is_connection_failure, one_line
from reconciler.drivers.docker.payloads import is_no_such_network


@contextmanager
def _errors(what: str) -> Iterator[None]:
    try:
        yield
    except docker.errors.APIError as exc:
        raise DriverError(f"{what}: {one_line(explanation(exc))}") from None
    except (docker.errors.DockerException, requests.exceptions.RequestException,
            OSError) as exc:
        if is_connection_failure(exc):
            raise TemporaryError(f"{what}: docker daemon unreachable ({exc})",
                                 delay=1.0) from None
        raise DriverError(f"{what}: {type(exc).__name__}: {exc}") from None


def _ip(value: object) -> str | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return str(ipaddress.ip_interface(value).ip)
    except ValueError:
        return None


def _point(api: Any, attrs: dict[str, Any]) -> NetworkPoint:
    name = str(attrs.get("Name", ""))
    endpoints = []
    for cid, ep in sorted((attrs.get("Containers") or {}).items()):
        try:
            cattrs = api.inspect_container(cid)
        except docker.errors.NotFound:
            continue  # gone meanwhile
        net = ((cattrs.get("NetworkSettings") or {}).get("Networks") or {}).get(name) or {}
        # Docker adds the short ID (and, on user networks, nothing else) on every connect
        aliases = tuple(sorted(a for a in (net.get("Aliases") or []) if a != cid[:12]))
        endpoints.append(EndpointPoint(cid, str(ep.get("Name") or ""),
                                       _ip(ep.get("IPv4Address")), _ip(ep.get("IPv6Address")),
                                       aliases))
    pools = tuple(sorted((str(p["Subnet"]), p.get("Gateway") or None)
                         for p in ((attrs.get("IPAM") or {}).get("Config") or [])
                         if p.get("Subnet")))
    return NetworkPoint(
        name, str(attrs.get("Id", "")), str(attrs.get("Driver", "bridge")),
        tuple(sorted((str(k), str(v)) for k, v in (attrs.get("Options") or {}).items())),
        tuple(sorted((str(k), str(v)) for k, v in (attrs.get("Labels") or {}).items())),
        bool(attrs.get("EnableIPv6", False)), bool(attrs.get("Internal", False)), pools,
        tuple(endpoints))


def snapshot(api: Any, scope: str) -> tuple[NetworkPoint, ...]:
    """Return our networks of ``scope`` (label ``io.reconciler.scope``) with their attachments."""
    with _errors("docker: reading networks for the checkpoint"):
        found = []
        for entry in api.networks(filters={"label": f"{DOCKER_LABEL}={DOCKER_LABEL_VALUE}"}):
            labels = entry.get("Labels") or {}
            if labels.get(SCOPE_LABEL) != scope:
                continue
            try:
                attrs = api.inspect_network(entry["Id"])
            except docker.errors.APIError as exc:
                if is_no_such_network(explanation(exc)):
                    continue
                raise
            found.append(_point(api, attrs))
    return tuple(sorted(found, key=lambda n: (n.name, n.id)))


@dataclass(frozen=True)
class Restored:
    """A re-created network: its new ID and the recorded containers that were gone."""

    id: str
    gone: tuple[str, ...] = ()


def restore(api: Any, point: NetworkPoint, replace_id: str = "") -> Restored:
    """Re-create ``point`` and attach its recorded containers that still exist; first
    remove ``replace_id`` (ours) after disconnecting its containers, all of which the
    checkpoint must list. The new network's ID, and the recorded containers that are
    gone (not re-attached)."""
    what = f"docker network {point.name}: restore"
    if point.name in PROTECTED_NETWORKS:
        raise ConflictError(f"{what}: refusing to touch Docker's own network")
    labels = dict(point.labels)
    if labels.get(DOCKER_LABEL) != DOCKER_LABEL_VALUE:
        raise ConflictError(f"{what}: the checkpoint's network is not ours")
    with _errors(what):
        if replace_id:
            _remove_replaced(api, point, replace_id, what)
        result = api.create_network(
            point.name, driver=point.driver or "bridge", options=dict(point.options),
            ipam=IPAMConfig(pool_configs=[IPAMPool(subnet=s, gateway=g) for s, g in point.pools])
            if point.pools else None,
            check_duplicate=True, internal=point.internal, labels=labels,
            enable_ipv6=point.ipv6)
        net_id = str(result.get("Id", ""))
        failures: list[str] = []
        gone: list[str] = []
        for ep in point.endpoints:
            label = ep.name or ep.container[:12]
            try:
                api.inspect_container(ep.container)
                api.connect_container_to_network(
                    ep.container, net_id, ipv4_address=ep.ipv4, ipv6_address=ep.ipv6,
                    aliases=list(ep.aliases) or None)
            except docker.errors.NotFound:
                gone.append(label)  # removed in the window: nothing to give it back to
            except docker.errors.APIError as exc:
                failures.append(f"{label}: {one_line(explanation(exc))}")
        if failures:
            raise DriverError(f"{what}: re-created, but could not re-attach "
                              + "; ".join(failures))
    return Restored(net_id, tuple(gone))


def _remove_replaced(api: Any, point: NetworkPoint, replace_id: str, what: str) -> None:
    try:
        current = api.inspect_network(replace_id)
    except docker.errors.APIError as exc:
        if not is_no_such_network(explanation(exc)):
            raise
        return
    if (current.get("Labels") or {}).get(DOCKER_LABEL) != DOCKER_LABEL_VALUE:
        raise ConflictError(f"{what}: {replace_id[:12]} is not ours")
    attached = current.get("Containers") or {}
    recorded = {ep.container for ep in point.endpoints}
    others = sorted(cid for cid in attached if cid not in recorded)
    if others:
        names = ", ".join(str((attached[c] or {}).get("Name") or "") or c[:12]
                          for c in others)
        raise ConflictError(
            f"{what}: its settings changed, but containers attached since the checkpoint "
            f"are on it ({names}, {', '.join(c[:12] for c in others)}): not disconnected, "
            "so it is not rebuilt (disconnect them, then revert again)")
    for cid in sorted(attached):
        api.disconnect_container_from_network(cid, replace_id, force=True)
    api.remove_network(replace_id)
