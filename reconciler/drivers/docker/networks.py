"""Docker networks with kind's semantics, through the Docker SDK: read, create, remove.

``DockerNetworks`` holds the client, the mapping of every SDK failure to one
clear line (``_errors``) and kind's create-and-probe logic; ``client.DockerDriver``
adds the replace that keeps containers attached, and the checkpoints. The pure
parts live beside them (``payloads``, ``failures``, ``results``).

The reference behaviour is kind's ``ensureNetwork``: a bridge network with IP
masquerade, the MTU of Docker's default ``bridge`` network, an IPv6 ULA /64
derived from sha1(name, attempt), an IPv4-only fallback when the daemon cannot
do IPv6, probing of further subnets on pool overlap, and "already exists" /
"No such network" races treated as benign. Unlike kind, we only ever delete or
re-create networks that carry our ownership label.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import docker
import docker.errors
import requests.exceptions
from docker.types import IPAMConfig, IPAMPool

from reconciler.domain.docker import (
    IPV6_FALLBACK_LABEL,
    OPT_MASQUERADE,
    OPT_MTU,
    PROTECTED_NETWORKS,
    SCOPE_LABEL,
    network_scope,
    sort_duplicates,
    ula_subnet,
)
from reconciler.domain.docker import flag as _flag
from reconciler.domain.docker import split_subnets as _networks_of
from reconciler.domain.errors import (
    ConflictError,
    DriverError,
    ReconcilerError,
    TemporaryError,
)
from reconciler.domain.live import LiveDocker, LiveDockerNetwork
from reconciler.domain.model import DockerNetwork
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.drivers.docker.failures import (
    Unreachable,
    explanation,
    is_connection_failure,
    one_line,
    unreachable_reason,
)
from reconciler.drivers.docker.payloads import (
    NetworkInspect,
    is_already_exists,
    is_ipv4_pool_exhausted,
    is_ipv6_unavailable,
    is_no_such_network,
    is_pool_overlap,
    parse_default_mtu,
    parse_network,
)
from reconciler.drivers.docker.replacement import CreateArgs
from reconciler.drivers.docker.results import DedupeResult, EnsureResult

#: kind's probing budget: attempt 0 plus four more derived subnets.
MAX_ATTEMPTS = 5


DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"


class DockerNetworks:
    """Docker networks with kind's semantics, through the SDK's low-level API.

    The client is created on first use from the environment (``DOCKER_HOST``,
    ``DOCKER_TLS_VERIFY``, ``DOCKER_CERT_PATH``) with a short timeout; tests may
    pass one in. Every method raises only ``ReconcilerError`` subclasses,
    except ``observe``, which never raises.
    """

    def __init__(self, client: docker.DockerClient | None = None, *, timeout: float = 10.0,
                 environment: Mapping[str, str] | None = None) -> None:
        self._client = client
        self._timeout = timeout
        self._environment = dict(os.environ if environment is None else environment)

    # -- plumbing -----------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """Where the daemon is expected (for messages)."""
        return self._environment.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            try:
                self._client = docker.DockerClient.from_env(
                    timeout=int(max(1, self._timeout)), environment=self._environment)
            except docker.errors.DockerException as exc:
                raise Unreachable(unreachable_reason(exc)) from exc
        return self._client

    @property
    def _api(self) -> Any:
        return self.client.api

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _unreachable_message(self, reason: str) -> str:
        return f"docker daemon unreachable at {self.endpoint}: {reason}"

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Map SDK and connection failures to one-line reconciler errors."""
        try:
            yield
        except ReconcilerError:
            raise
        except Unreachable as exc:
            raise TemporaryError(f"{what}: {self._unreachable_message(str(exc))}",
                                 delay=1.0) from None
        except docker.errors.APIError as exc:
            raise DriverError(f"{what}: {one_line(explanation(exc))}") from None
        except (docker.errors.DockerException, requests.exceptions.RequestException,
                OSError) as exc:
            if is_connection_failure(exc):
                raise TemporaryError(
                    f"{what}: {self._unreachable_message(unreachable_reason(exc))}",
                    delay=1.0) from None
            raise DriverError(f"{what}: {type(exc).__name__}: {exc}") from None

    # -- reading ------------------------------------------------------------

    def _inspect(self, net_id: str) -> NetworkInspect | None:
        """Inspect one network; None when it is gone (benign, as in kind)."""
        try:
            attrs: NetworkInspect = self._api.inspect_network(net_id)
        except docker.errors.APIError as exc:
            if is_no_such_network(explanation(exc)):
                return None
            raise
        return attrs

    def _with_name(self, name: str) -> list[NetworkInspect]:
        """Inspect payloads of every network called exactly ``name``, kind's order."""
        listed = self._api.networks(filters=_name_filters(name))
        found = []
        for entry in listed:
            if entry.get("Name") != name:  # the daemon's name filter is a regexp search
                continue
            attrs = self._inspect(entry["Id"])
            if attrs is not None:
                found.append(attrs)
        order = {n.id: i for i, n in enumerate(sort_duplicates(parse_network(a) for a in found))}
        return sorted(found, key=lambda a: order[a.get("Id", "")])

    def observe(self, names: Iterable[str]) -> LiveDocker:
        """Observe the networks called ``names`` plus every network we own, and the default MTU.

        Never raises: when the daemon is down or refuses, the result is
        ``LiveDocker(available=False, error=...)`` with one clear line.
        """
        wanted = set(names)
        try:
            listed: list[dict[str, Any]] = self._api.networks()
            networks: list[LiveDockerNetwork] = []
            default_mtu: int | None = None
            for entry in listed:
                name = entry.get("Name", "")
                labels = entry.get("Labels") or {}
                is_ours = labels.get(DOCKER_LABEL) == DOCKER_LABEL_VALUE
                if name != "bridge" and name not in wanted and not is_ours:
                    continue
                attrs = self._inspect(entry["Id"])
                if attrs is None:
                    continue
                if name == "bridge":
                    default_mtu = parse_default_mtu(attrs)
                    if name not in wanted and not is_ours:
                        continue
                networks.append(parse_network(attrs))
        except Unreachable as exc:
            return LiveDocker(available=False, error=self._unreachable_message(str(exc)))
        except docker.errors.APIError as exc:
            why = one_line(explanation(exc))
            return LiveDocker(available=False, error=f"docker: listing networks failed: {why}")
        except (docker.errors.DockerException, requests.exceptions.RequestException,
                OSError) as exc:
            if is_connection_failure(exc):
                return LiveDocker(available=False,
                                  error=self._unreachable_message(unreachable_reason(exc)))
            return LiveDocker(available=False,
                              error=f"docker: observing networks failed: {exc}")
        networks.sort(key=lambda n: (n.name, -n.containers, n.id))
        return LiveDocker(available=True, default_mtu=default_mtu, networks=tuple(networks))

    def default_mtu(self) -> int | None:
        """Return the MTU of Docker's default ``bridge`` network (None when unknown)."""
        with self._errors("docker network bridge: inspect"):
            attrs = self._inspect("bridge")
        return None if attrs is None else parse_default_mtu(attrs)

    # -- removing -----------------------------------------------------------

    def _remove_ids(self, name: str, ids: Iterable[str]) -> tuple[str, ...]:
        removed = []
        for net_id in ids:
            with self._errors(f"docker network {name}: remove {net_id[:12]}"):
                try:
                    self._api.remove_network(net_id)
                except docker.errors.APIError as exc:
                    if not is_no_such_network(explanation(exc)):
                        raise
                    continue
            removed.append(net_id)
        return tuple(removed)

    def remove(self, network_id_or_name: str) -> bool:
        """Delete one network we own. False when it was already gone.

        Refuses (``ConflictError``) Docker's own networks, networks without our
        label, several networks sharing the name, and networks with containers
        attached.
        """
        ref = network_id_or_name
        what = f"docker network {ref}: remove"
        if ref in PROTECTED_NETWORKS:
            raise ConflictError(f"{what}: refusing to remove Docker's own network")
        with self._errors(what):
            matches = self._with_name(ref)
            if not matches:
                attrs = self._inspect(ref)
                if attrs is None:
                    return False
                matches = [attrs]
        if len(matches) > 1:
            ids = ", ".join(a.get("Id", "")[:12] for a in matches)
            raise ConflictError(f"{what}: {len(matches)} networks share this name ({ids}); "
                                "dedupe first")
        live = parse_network(matches[0])
        what = f"docker network {live.name}: remove"
        if live.name in PROTECTED_NETWORKS:
            raise ConflictError(f"{what}: refusing to remove Docker's own network")
        if not live.owned:
            raise ConflictError(f"{what}: not managed by reconciler "
                                f"(no label {DOCKER_LABEL}={DOCKER_LABEL_VALUE})")
        if live.containers:
            names = _container_names(matches[0])
            raise ConflictError(f"{what}: {live.containers} container(s) attached ({names})")
        return bool(self._remove_ids(live.name, [live.id]))

    def dedupe(self, name: str) -> DedupeResult:
        """Keep kind's first of several networks called ``name``; remove the rest.

        Only when every candidate is ours; otherwise ``ConflictError`` names them.
        """
        with self._errors(f"docker network {name}: list"):
            found = [parse_network(a) for a in self._with_name(name)]
        return self._dedupe_found(name, found)

    def _dedupe_found(self, name: str, found: list[LiveDockerNetwork]) -> DedupeResult:
        found = sort_duplicates(found)
        if len(found) < 2:
            return DedupeResult(kept=found[0] if found else None)
        scopes = sorted({network_scope(n.labels) for n in found if n.owned})
        if len(scopes) > 1:
            raise ConflictError(f"docker network {name}: networks of several reconcilers share "
                                f"this name ({SCOPE_LABEL} {', '.join(scopes)}); refusing to "
                                "remove another reconciler's")
        foreign = [n for n in found if not n.owned]
        if foreign or name in PROTECTED_NETWORKS:
            listed = ", ".join(f"{n.id[:12]}{'' if n.owned else ' (not ours)'}" for n in found)
            raise ConflictError(f"docker network {name}: {len(found)} networks share this name "
                                f"({listed}); refusing to remove networks we do not own")
        removed = self._remove_ids(name, [n.id for n in found[1:]])
        return DedupeResult(kept=found[0], removed=removed)

    # -- creating -----------------------------------------------------------

    def _create(self, args: CreateArgs) -> str:
        """Make one create call; returns the new ID. APIError propagates."""
        pools = []
        if args.subnet is not None:
            pools.append(IPAMPool(subnet=str(args.subnet), gateway=args.gateway))
        if args.subnet6 is not None:
            pools.append(IPAMPool(subnet=str(args.subnet6), gateway=args.gateway6))
        result: dict[str, Any] = self._api.create_network(
            args.name,
            driver="bridge",
            options=args.options,
            ipam=IPAMConfig(pool_configs=pools) if pools else None,
            check_duplicate=True,  # as the docker CLI does: the daemon says "already exists"
            internal=args.internal,
            labels=args.labels,
            enable_ipv6=args.subnet6 is not None,
        )
        return str(result.get("Id", ""))

    @staticmethod
    def _base_args(spec: DockerNetwork, default_mtu: int | None) -> CreateArgs:
        options = {OPT_MASQUERADE: _flag(spec.masquerade)}
        mtu = spec.mtu if spec.mtu is not None else default_mtu
        if mtu is not None and mtu > 0:
            options[OPT_MTU] = str(mtu)
        labels = dict(spec.labels)
        labels[DOCKER_LABEL] = DOCKER_LABEL_VALUE
        return CreateArgs(name=spec.name, options=options, labels=labels,
                           internal=spec.internal, subnet=spec.subnet)

    def _named(self, name: str) -> list[LiveDockerNetwork]:
        return [parse_network(a) for a in self._with_name(name)]

    def _subnet_in_use(self, subnet: ipaddress.IPv4Network) -> str | None:
        """Return the name of a network whose IPv4 subnet overlaps ``subnet``."""
        for entry in self._api.networks():
            v4, _ = _networks_of(parse_network(entry).subnets)
            if any(net.overlaps(subnet) for net in v4):
                return str(entry.get("Name", ""))
        return None

    def ensure(self, spec: DockerNetwork, default_mtu: int | None) -> EnsureResult:
        """Ensure the network exists afterwards, exactly once (kind's ensureNetwork).

        An existing network (ours) is kept as it is — comparing its settings is
        ``diff_network``'s job. Raises ``ConflictError`` when a network with
        this name exists that we do not own.
        """
        name = spec.name
        with self._errors(f"docker network {name}: ensure"):
            existing = self._named(name)
            if existing:
                self._check_scope(f"docker network {name}: ensure", spec, existing)
                return self._kept(name, existing)
            return self._create_probing(self._base_args(spec, default_mtu), spec)

    @staticmethod
    def _check_scope(what: str, spec: DockerNetwork,
                     networks: Iterable[LiveDockerNetwork]) -> None:
        """Raise ``ConflictError`` when one of ``networks`` is another reconciler's: its scope label
        is not the one ``spec`` carries (the planner says so first; this is the last word
        at the moment of the change)."""
        mine = dict(spec.labels).get(SCOPE_LABEL)
        for n in networks:
            if mine is not None and n.owned and network_scope(n.labels) != mine:
                raise ConflictError(f"{what}: {n.id[:12]} belongs to another reconciler "
                                    f"({SCOPE_LABEL} {network_scope(n.labels)!r}, not "
                                    f"{mine!r}); left alone")

    def _kept(self, name: str, existing: list[LiveDockerNetwork],
              **extra: Any) -> EnsureResult:
        if len(existing) == 1 and not existing[0].owned:
            raise ConflictError(f"docker network {name}: exists ({existing[0].id[:12]}) but is "
                                f"not managed by reconciler (no label "
                                f"{DOCKER_LABEL}={DOCKER_LABEL_VALUE})")
        result = self._dedupe_found(name, existing)
        assert result.kept is not None
        return EnsureResult(name=name, network_id=result.kept.id, created=False,
                            removed_duplicates=result.removed, **extra)

    def _create_probing(self, base: CreateArgs, spec: DockerNetwork,
                        pinned6: ipaddress.IPv6Network | None = None) -> EnsureResult:
        """Create with kind's probing; called inside ``_errors``."""
        name = spec.name
        explicit6 = pinned6 or spec.subnet6
        derived = explicit6 is None and spec.ipv6
        attempts = MAX_ATTEMPTS if derived else 1
        for attempt in range(attempts):
            subnet6 = explicit6 or (ula_subnet(name, attempt) if derived else None)
            args = replace_args(base, subnet6=subnet6)
            try:
                net_id = self._create(args)
            except docker.errors.APIError as exc:
                raw = explanation(exc)
                msg = one_line(raw)
                if is_already_exists(raw):
                    return self._after_create(name, None, subnet6, attempt if derived else None)
                if subnet6 is not None and attempt == 0 and is_ipv6_unavailable(raw):
                    if not derived:
                        raise DriverError(
                            f"docker network {name}: subnet6 {subnet6} declared but the Docker "
                            f"daemon cannot set up IPv6: {msg}") from None
                    return self._create_ipv4_fallback(base, spec, msg)
                if is_ipv4_pool_exhausted(raw):
                    raise DriverError(
                        f"docker network {name}: Docker's default IPv4 address pools are "
                        f"exhausted; declare `subnet:` or remove unused networks ({msg})"
                    ) from None
                if is_pool_overlap(raw):
                    # kind: perhaps another process created the network meanwhile
                    existing = self._named(name)
                    if existing:
                        return self._kept(name, existing)
                    if base.subnet is not None:
                        other = self._subnet_in_use(base.subnet)
                        if other is not None:
                            raise DriverError(f"docker network {name}: subnet {base.subnet} "
                                              f"overlaps docker network {other}") from None
                    if not derived:
                        shown = f"subnet6 {subnet6}" if subnet6 is not None else (
                            f"subnet {base.subnet}")
                        raise DriverError(f"docker network {name}: {shown} overlaps an "
                                          f"address pool in use ({msg})") from None
                    continue
                raise
            return self._after_create(name, net_id, subnet6, attempt if derived else None)
        raise DriverError("exhausted attempts trying to find a non-overlapping subnet "
                          f"for docker network {name}")

    def _create_ipv4_fallback(self, base: CreateArgs, spec: DockerNetwork,
                              why: str) -> EnsureResult:
        warning = (f"docker network {spec.name}: the Docker daemon cannot set up IPv6 "
                   f"({one_line(why)}); created it IPv4-only")
        labels = {**base.labels, IPV6_FALLBACK_LABEL: "true"}
        try:
            net_id = self._create(replace_args(base, subnet6=None, labels=labels))
        except docker.errors.APIError as exc:
            if not is_already_exists(explanation(exc)):
                raise
            net_id = None
        result = self._after_create(spec.name, net_id, None, None)
        return result_with(result, ipv6_fallback=True, warnings=result.warnings + (warning,))

    def _after_create(self, name: str, net_id: str | None,
                      subnet6: ipaddress.IPv6Network | None,
                      attempt: int | None) -> EnsureResult:
        """Re-list and remove duplicates (kind's createNetworkNoDuplicates tail)."""
        existing = self._named(name)
        if not existing:
            raise DriverError(f"docker network {name}: created but not found afterwards")
        if net_id is None:  # somebody else created it: same as "exists"
            return self._kept(name, existing)
        result = self._dedupe_found(name, existing)
        assert result.kept is not None
        return EnsureResult(name=name, network_id=result.kept.id,
                            created=result.kept.id == net_id,
                            subnet6=str(subnet6) if subnet6 is not None else None,
                            attempt=attempt, removed_duplicates=result.removed)


def _name_filters(name: str) -> dict[str, str] | None:
    """Return an anchored name filter (the daemon matches a Go regexp), as kind uses.

    None (list everything) for a name with characters we would have to escape;
    callers compare names exactly either way.
    """
    if re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        return {"name": "^" + name.replace(".", "\\.") + "$"}
    return None


def _container_names(attrs: NetworkInspect) -> str:
    return ", ".join(sorted(str(ep.get("Name", cid[:12]))
                            for cid, ep in (attrs.get("Containers") or {}).items()))


def replace_args(args: CreateArgs, **changes: Any) -> CreateArgs:
    """Return ``args`` with ``changes`` (``dataclasses.replace``, typed for the caller)."""
    return replace(args, **changes)


def result_with(result: EnsureResult, **changes: Any) -> EnsureResult:
    """Return ``result`` with ``changes`` (``dataclasses.replace``, typed for the caller)."""
    return replace(result, **changes)
