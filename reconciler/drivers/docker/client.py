"""The Docker driver: networks (``networks.DockerNetworks``), replace, checkpoints.

Only this package talks to the Docker daemon (the event stream is ``events``,
the one raw API call observation makes is ``rawapi``). ``DockerDriver`` observes
and changes networks through the SDK's low-level API and maps every daemon or
connection failure to one clear line (``DriverError`` / ``TemporaryError`` /
``ConflictError``). The rules the planner shares (subnet derivation, the
duplicate order) are ``reconciler.domain.docker``.

Docker cannot update a network: a change is a replace, and this module's
part is the one that keeps the attached containers — recorded first
(``Replacement``), disconnected, the network re-created, each container put
back with its addresses and aliases, every step reported so another process
can finish (``resume_replace``) or undo it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions

from reconciler.domain.checkpoint import NetworkPoint
from reconciler.domain.docker import (
    PROTECTED_NETWORKS,
    SCOPE_LABEL,
    network_scope,
    spec_from_json,
    spec_to_json,
)
from reconciler.domain.docker import split_subnets as _networks_of
from reconciler.domain.errors import (
    ConflictError,
    DriverError,
    ReconcilerError,
    StrandedConflict,
    TemporaryError,
)
from reconciler.domain.live import LiveDockerNetwork
from reconciler.domain.model import DockerNetwork
from reconciler.domain.ownership import DOCKER_LABEL, DOCKER_LABEL_VALUE
from reconciler.drivers.docker import snapshot
from reconciler.drivers.docker.failures import (
    explanation,
    is_connection_failure,
    one_line,
    unreachable_reason,
)
from reconciler.drivers.docker.networks import DockerNetworks, replace_args, result_with
from reconciler.drivers.docker.payloads import (
    NetworkInspect,
    is_no_such_network,
    parse_network,
)
from reconciler.drivers.docker.replacement import (
    ABANDON,
    NO_STEPS,
    CreateArgs,
    Endpoint,
    Replacement,
    Steps,
)
from reconciler.drivers.docker.results import EnsureResult
from reconciler.drivers.docker.snapshot import Restored

_T = TypeVar("_T")


class DockerDriver(DockerNetworks):
    """Docker networks with kind's semantics, through the SDK's low-level API.

    The client is created on first use from the environment (``DOCKER_HOST``,
    ``DOCKER_TLS_VERIFY``, ``DOCKER_CERT_PATH``) with a short timeout; tests may
    pass one in. Every method raises only ``ReconcilerError`` subclasses,
    except ``observe``, which never raises.

    Beside ``DockerNetworks``' reading, creating and removing: ``replace`` (with the
    containers attached) and the checkpoints of pending changes.
    """

    # -- replacing ----------------------------------------------------------

    def _endpoints(self, attrs: NetworkInspect) -> list[Endpoint]:
        endpoints = []
        net_name = attrs.get("Name", "")
        for cid, ep in sorted((attrs.get("Containers") or {}).items()):
            try:
                cattrs = self._api.inspect_container(cid)
            except docker.errors.NotFound:
                continue  # gone meanwhile
            settings = (cattrs.get("NetworkSettings") or {}).get("Networks") or {}
            net = settings.get(net_name) or {}
            # Docker adds the short ID itself on every connect.
            aliases = tuple(a for a in (net.get("Aliases") or []) if a != cid[:12])
            ipam = net.get("IPAMConfig") or {}
            endpoints.append(Endpoint(
                container_id=cid,
                container_name=str(ep.get("Name") or cattrs.get("Name", "").lstrip("/")),
                ipv4=_address(ep.get("IPv4Address"), ipaddress.IPv4Address),
                ipv6=_address(ep.get("IPv6Address"), ipaddress.IPv6Address),
                aliases=aliases,
                links=tuple(str(x) for x in net.get("Links") or ()),
                link_local_ips=tuple(str(x) for x in ipam.get("LinkLocalIPs") or ()),
                driver_opts=tuple(sorted((str(k), str(v)) for k, v in
                                         (net.get("DriverOpts") or {}).items())),
            ))
        return endpoints

    def replace(self, spec: DockerNetwork, live: LiveDockerNetwork, default_mtu: int | None,
                reconnect: bool, *, adopt: bool = False,
                steps: Steps = NO_STEPS) -> EnsureResult:
        """Delete ``live`` and create ``spec`` in its place (Docker cannot update).

        With containers attached: refuse (``ConflictError``) unless
        ``reconnect``; then record each container's addresses, aliases and
        endpoint settings (``Replacement``, handed to ``steps.begin`` before the
        first disconnect: the caller stores it durably), disconnect, re-create and
        re-attach them with the same addresses, reporting each step to ``steps``.
        The re-created network keeps the live IPv4/IPv6 subnets unless the file
        declares others, because Docker only accepts fixed addresses on networks
        with configured subnets. ``adopt`` allows replacing a network that lacks
        our label (it gets the label).
        """
        name = spec.name
        what = f"docker network {name}: replace"
        if live.name in PROTECTED_NETWORKS or name in PROTECTED_NETWORKS:
            raise ConflictError(f"{what}: refusing to touch Docker's own network")
        with self._errors(what):
            attrs = self._inspect(live.id)
            if attrs is None:  # gone meanwhile: plain ensure
                return self.ensure(spec, default_mtu)
            current = parse_network(attrs)
            self._check_scope(what, spec, [current])
            if not current.owned and not adopt:
                raise ConflictError(f"{what}: not managed by reconciler (no label "
                                    f"{DOCKER_LABEL}={DOCKER_LABEL_VALUE}); adopt it explicitly")
            endpoints = self._endpoints(attrs)
            if endpoints and not reconnect:
                raise ConflictError(
                    f"{what}: {len(endpoints)} container(s) attached "
                    f"({', '.join(e.container_name for e in endpoints)}); "
                    "re-create with reconnect to re-attach them")

            base = self._base_args(spec, default_mtu)
            if not endpoints:
                self._remove_ids(name, [current.id])
                return self._create_probing(base, spec)
            pinned6: ipaddress.IPv6Network | None = None
            live4, live6 = _networks_of(current.subnets)
            gateways = _gateways(attrs)
            if spec.subnet is None and live4:
                base = replace_args(base, subnet=live4[0], gateway=gateways.get(live4[0]))
            want_v6 = spec.ipv6 or spec.subnet6 is not None
            if want_v6 and spec.subnet6 is None and live6 and current.enable_ipv6:
                pinned6 = live6[0]
                base = replace_args(base, gateway6=gateways.get(pinned6))
            replacement = Replacement(
                name=name, old_id=current.id, spec=spec_to_json(spec), new=base,
                old=_old_args(attrs), endpoints=tuple(endpoints), pinned6=pinned6,
                default_mtu=default_mtu)
            steps.begin(replacement)
            return self._carry_out(replacement, steps, frozenset())

    def resume_replace(self, replacement: Replacement, done: frozenset[str],
                       steps: Steps = NO_STEPS) -> EnsureResult:
        """Carry on a replace another process started (it stored ``replacement`` and
        reported the steps ``done``) to its end: every container back on a network of
        that name with its addresses and aliases.

        The step after the last one reported may have happened too (the process died
        between doing it and reporting it): every step is idempotent. A container
        that no longer exists is named in ``EnsureResult.gone``; ``undone`` says the old
        network was restored because the new one could not be made.
        """
        with self._errors(f"docker network {replacement.name}: finish replace"):
            return self._carry_out(replacement, steps, done)

    def _carry_out(self, rep: Replacement, steps: Steps, done: frozenset[str]) -> EnsureResult:
        """Carry out the destructive steps of a replace from ``done`` on; called inside
        ``_errors``."""
        name = rep.name
        what = f"docker network {name}: replace"
        old_attrs = None if "remove" in done else self._inspect(rep.old_id)
        if old_attrs is not None and ABANDON in done:
            # a run gave the replace up and died (or the daemon went) putting them back
            return self._put_back(rep, steps, None)
        if old_attrs is not None:
            try:
                for ep in rep.endpoints:
                    if f"disconnect:{ep.container_id}" not in done:
                        self._disconnect(name, rep.old_id, ep)
                        steps.done(f"disconnect:{ep.container_id}")
                self._remove_ids(name, [rep.old_id])
            except TemporaryError:
                raise  # the daemon went away: the journal stays, the next try carries on
            except (ReconcilerError, docker.errors.APIError) as exc:
                # e.g. a container joined meanwhile: put ours back where they were
                steps.done(ABANDON)
                self._put_back(rep, steps, f"{what}: {one_line(explanation(exc))}"
                               if isinstance(exc, docker.errors.APIError) else str(exc))
                if isinstance(exc, ReconcilerError):
                    raise
                raise DriverError(f"{what}: {one_line(explanation(exc))}") from None
            steps.done("remove")
        undoing = "undo" in done
        net_id = next((s.split(":", 1)[1] for s in done if s.startswith("create:")), None)
        if net_id is not None and self._inspect(net_id) is None:
            net_id = None
        cause: str | None = None
        if net_id is not None:
            result = EnsureResult(name=name, network_id=net_id, created=True)
        else:
            others = [n for n in self._named(name) if n.id != rep.old_id]
            if others:  # made before the step could be reported, or somebody else's
                self._only_ours(rep, others)
                result = self._kept(name, others)
            elif undoing:
                result = EnsureResult(name=name, network_id=self._create(rep.old), created=True)
            else:
                try:
                    result = self._create_probing(rep.new, spec_from_json(rep.spec),
                                                  pinned6=rep.pinned6)
                except TemporaryError:
                    raise
                except ConflictError as exc:  # somebody's network of that name came first
                    raise StrandedConflict(_stranded(str(exc), rep)) from None
                except (ReconcilerError, docker.errors.APIError) as exc:
                    # the new network cannot be made: bring the old one back instead
                    cause = (one_line(explanation(exc))
                             if isinstance(exc, docker.errors.APIError) else str(exc))
                    steps.done("undo")
                    undoing = True
                    result = EnsureResult(name=name, network_id=self._create(rep.old),
                                          created=True)
                if not result.created:  # the same race, won by a network of ours or not
                    self._only_ours(rep, [n for n in self._named(name) if n.id != rep.old_id])
            steps.done(f"create:{result.network_id}")
        reconnected, gone, failures, warnings = self._reattach(rep, result.network_id, done,
                                                               steps)
        if failures:
            raise DriverError(f"{what}: re-created, but could not re-attach "
                              + "; ".join(failures))
        if cause is not None:
            raise DriverError(f"{what}: {cause}; restored the old network and reconnected "
                              f"{len(reconnected)} container(s)")
        return result_with(result, reconnected=tuple(reconnected), gone=tuple(gone),
                     undone=undoing, warnings=result.warnings + tuple(warnings))

    @staticmethod
    def _only_ours(rep: Replacement, networks: Iterable[LiveDockerNetwork]) -> None:
        """Raise ``StrandedConflict`` unless every one of ``networks`` is ours and of the scope the
        replace was made in: the containers are off their network, and attaching them to
        another reconciler's (or a foreign) network of that name is worse than waiting."""
        mine = network_scope(rep.new.labels)
        for n in networks:
            if not n.owned:
                why = (f"{n.id[:12]} of that name is not managed by reconciler (no label "
                       f"{DOCKER_LABEL}={DOCKER_LABEL_VALUE})")
            elif network_scope(n.labels) != mine:
                why = (f"{n.id[:12]} of that name belongs to another reconciler "
                       f"({SCOPE_LABEL} {network_scope(n.labels)!r}, not {mine!r})")
            else:
                continue
            raise StrandedConflict(_stranded(f"docker network {rep.name}: replace: {why}", rep))

    def _reattach(self, rep: Replacement, net_id: str, done: frozenset[str], steps: Steps
                  ) -> tuple[list[str], list[str], list[str], list[str]]:
        """Connect every endpoint of ``rep`` to ``net_id``: (reconnected, gone, failures,
        warnings), by container name."""
        name = rep.name
        new4, new6 = _networks_of(parse_network(self._inspect(net_id) or {}).subnets)
        reconnected: list[str] = []
        gone: list[str] = []
        failures: list[str] = []
        warnings: list[str] = []
        for ep in rep.endpoints:
            if f"connect:{ep.container_id}" not in done:
                on = self._attached_to(ep.container_id, name)
                if on is None:
                    gone.append(ep.container_name)
                    warnings.append(f"docker network {name}: container {ep.container_name} "
                                    "is gone; not reconnected")
                    continue
                if on != net_id:
                    try:
                        warnings += self._connect(net_id, name, ep, new4, new6)
                    except docker.errors.APIError as exc:
                        problem = self._connect_anyhow(net_id, name, ep, exc)
                        if problem is not None:
                            failures.append(problem)
                            continue
                        warnings.append(f"docker network {name}: container "
                                        f"{ep.container_name} reconnected without its "
                                        f"addresses ({one_line(explanation(exc))})")
                steps.done(f"connect:{ep.container_id}")
            reconnected.append(ep.container_name)
        return reconnected, gone, failures, warnings

    def _attached_to(self, container_id: str, name: str) -> str | None:
        """Return the ID of the network called ``name`` the container is on ("" none); None when
        the container is gone."""
        try:
            cattrs = self._api.inspect_container(container_id)
        except docker.errors.NotFound:
            return None
        nets = (cattrs.get("NetworkSettings") or {}).get("Networks") or {}
        return str((nets.get(name) or {}).get("NetworkID") or "")

    def _connect_anyhow(self, net_id: str, name: str, ep: Endpoint,
                        why: docker.errors.APIError) -> str | None:
        """Connect without the fixed addresses, refused (taken meanwhile): attached without them
        rather than not at all. The failure line, or None when it worked."""
        if ep.ipv4 is None and ep.ipv6 is None:
            return f"{ep.container_name}: {one_line(explanation(why))}"
        try:
            self._api.connect_container_to_network(ep.container_id, net_id,
                                                   aliases=list(ep.aliases) or None)
        except docker.errors.APIError as exc:
            return f"{ep.container_name}: {one_line(explanation(exc))}"
        return None

    def _put_back(self, rep: Replacement, steps: Steps, cause: str | None) -> EnsureResult:
        """Reconnect every container of ``rep`` that is off the old network to it (the replace
        was given up: ``ABANDON`` is recorded first). ``cause`` is why, when this run gave it
        up; None when finishing another run's.

        A container that cannot be put back (the daemon went away meanwhile) must not be
        forgotten: ``TemporaryError``, so the journal stays and the next try (the executor's
        retry, the next run) puts it back. The result says who is attached again.
        """
        name = rep.old.name
        net4, net6 = _networks_of(parse_network(self._inspect(rep.old_id) or {}).subnets)
        back: list[str] = []
        gone: list[str] = []
        left: list[str] = []
        for ep in rep.endpoints:
            try:
                on = self._attached_to(ep.container_id, name)
                if on is None:
                    gone.append(ep.container_name)
                    continue
                if on != rep.old_id:
                    self._connect(rep.old_id, name, ep, net4, net6)
                    steps.done(f"put-back:{ep.container_id}")
            except (docker.errors.DockerException, requests.exceptions.RequestException,
                    OSError) as exc:
                why = (unreachable_reason(exc) if is_connection_failure(exc) else
                       one_line(explanation(exc)) if isinstance(exc, docker.errors.APIError)
                       else f"{type(exc).__name__}: {exc}")
                left.append(f"{ep.container_name} ({why})")
                continue
            back.append(ep.container_name)
        if left:
            first = cause or f"docker network {rep.name}: replace: given up by another run"
            raise TemporaryError(f"{first}; could not put back {', '.join(left)}: the next "
                                 "run puts them back (journal kept)", delay=1.0)
        return EnsureResult(name=name, network_id=rep.old_id, created=False,
                            reconnected=tuple(back), gone=tuple(gone), undone=True)

    def _disconnect(self, name: str, net_id: str, ep: Endpoint) -> None:
        try:
            self._api.disconnect_container_from_network(ep.container_id, net_id, force=True)
        except docker.errors.APIError as exc:
            msg = explanation(exc)
            if not (is_no_such_network(msg) or "is not connected" in msg
                    or "No such container" in msg):
                raise

    def _connect(self, net_id: str, name: str, ep: Endpoint,
                 subnets4: Sequence[ipaddress.IPv4Network],
                 subnets6: Sequence[ipaddress.IPv6Network]) -> list[str]:
        warnings = []
        ipv4 = ep.ipv4
        if ipv4 is not None and not any(ipv4 in net for net in subnets4):
            warnings.append(f"docker network {name}: container {ep.container_name} lost "
                            f"address {ipv4} (outside the new subnet)")
            ipv4 = None
        ipv6 = ep.ipv6
        if ipv6 is not None and not any(ipv6 in net for net in subnets6):
            warnings.append(f"docker network {name}: container {ep.container_name} lost "
                            f"address {ipv6} (outside the new subnet)")
            ipv6 = None
        self._api.connect_container_to_network(
            ep.container_id, net_id,
            ipv4_address=str(ipv4) if ipv4 is not None else None,
            ipv6_address=str(ipv6) if ipv6 is not None else None,
            aliases=list(ep.aliases) or None,
            links=[tuple(x.split(":", 1)) for x in ep.links] or None,
            link_local_ips=list(ep.link_local_ips) or None,
            driver_opt=dict(ep.driver_opts) or None,
        )
        return warnings

    # -- checkpoints of pending changes (``snapshot``) -------------------------

    def snapshot(self, scope: str) -> tuple[NetworkPoint, ...]:
        """Return our networks of ``scope`` with their attachments, as a checkpoint records them."""
        return snapshot.snapshot(self._api, scope)

    def restore_network(self, point: NetworkPoint,
                        replace_id: str = "") -> Restored:
        """Re-create a network a checkpoint recorded (a revert); its new ID and the
        recorded containers that are gone (not re-attached)."""
        return snapshot.restore(self._api, point, replace_id)


def _old_args(attrs: NetworkInspect) -> CreateArgs:
    """Return the create call that makes the network ``attrs`` describes again (an undo)."""
    old = parse_network(attrs)
    v4, v6 = _networks_of(old.subnets)
    gateways = _gateways(attrs)
    return CreateArgs(name=old.name, options=dict(old.options), labels=dict(old.labels),
                      internal=old.internal, subnet=v4[0] if v4 else None,
                      gateway=gateways.get(v4[0]) if v4 else None,
                      subnet6=v6[0] if v6 and old.enable_ipv6 else None,
                      gateway6=gateways.get(v6[0]) if v6 and old.enable_ipv6 else None)


def _stranded(message: str, rep: Replacement) -> str:
    return (f"{message}; {len(rep.endpoints)} container(s) stay off the network until it is "
            "gone (journal kept)")


def _address(value: object, kind: type[_T]) -> _T | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        iface = ipaddress.ip_interface(value)
    except ValueError:
        return None
    return iface.ip if isinstance(iface.ip, kind) else None


def _gateways(attrs: NetworkInspect) -> dict[Any, str]:
    out: dict[Any, str] = {}
    for pool in (attrs.get("IPAM") or {}).get("Config") or []:
        subnet, gateway = pool.get("Subnet"), pool.get("Gateway")
        if subnet and gateway:
            try:
                out[ipaddress.ip_network(subnet, strict=False)] = gateway
            except ValueError:
                continue
    return out
