"""Planning of Docker networks (pure): kind's semantics, only ever touching what we own.

Docker cannot change a network in place, so a difference is a replace
(``-/+``); replacing a network with containers attached is refused unless the
user opts in (``--force-replace``), and then the executor re-attaches them
with their addresses and aliases. Several networks with one name are deduped
when all are ours. Networks are global to the daemon: one that another
reconciler made (another ``SCOPE_LABEL``: the host's, another sandbox's) is a
conflict, never replaced, deduped or pruned. Pruning removes owned networks of
this reconciler's scope that no file declares any more.

See docs/decisions/019-docker-scope-label.md.
"""

from __future__ import annotations

from reconciler.domain.docker import (
    PROTECTED_NETWORKS,
    SCOPE_LABEL,
    declared_scope_matches,
    network_scope,
    sort_duplicates,
    spec_to_json,
    ula_subnet,
)
from reconciler.domain.live import LiveDocker, LiveDockerNetwork
from reconciler.domain.model import DockerNetwork
from reconciler.domain.ops import DockerDedupe, DockerEnsure, DockerRemove, DockerReplace, encode
from reconciler.domain.plan import Action, AttrChange, Change, Op
from reconciler.planner.context import PlanContext
from reconciler.planner.docker_diff import diff_network, ipv6_fell_back

KIND = "docker_network"


def _view(n: LiveDockerNetwork) -> dict[str, object]:
    return {"id": n.id, "driver": n.driver, "labels": dict(sorted(n.labels.items())),
            "options": dict(sorted(n.options.items())), "ipv6": n.enable_ipv6,
            "internal": n.internal, "subnets": list(n.subnets), "containers": n.containers}


def _short(net_id: str) -> str:
    return net_id[:12]


def _unavailable_line(docker: LiveDocker | None) -> str:
    why = (docker.error if docker is not None else None) or "Docker was not observed"
    if why.startswith("docker daemon"):  # the driver's "docker daemon unreachable at ..."
        why = why[len("docker "):]
    elif why.startswith("docker: "):
        why = why[len("docker: "):]
    return f"docker: {why} — docker networks not planned"


def plan_docker_networks(ctx: PlanContext) -> list[Change]:
    """Plan every declared Docker network, and the prunes of owned ones no longer declared."""
    docker = ctx.live.docker
    if docker is None and not ctx.desired.docker_networks:
        return []  # nothing declared and the daemon is absent: host-only run
    if docker is not None and not docker.available and not ctx.desired.docker_networks:
        # nothing declared: only pruning was at stake, so say so rather than fail the run
        ctx.warnings.append(_unavailable_line(docker).replace(
            "docker networks not planned", "owned docker networks not checked for pruning"))
        return []
    if docker is None or not docker.available:
        # Plan nothing for Docker rather than something half-known; the host
        # resources still plan and apply, and the run exits non-zero.
        ctx.errors.append(_unavailable_line(docker))
        ctx.observed["docker"] = {"available": False}
        return []
    by_name: dict[str, list[LiveDockerNetwork]] = {}
    for n in docker.networks:
        by_name.setdefault(n.name, []).append(n)
    changes = [_plan_network(ctx, docker, spec, sort_duplicates(by_name.get(name, ())))
               for name, spec in sorted(ctx.desired.docker_networks.items())]
    changes += _plan_pruned(ctx, docker, by_name)
    return changes


def _create_attrs(spec: DockerNetwork, default_mtu: int | None,
                  picked: dict[str, str]) -> tuple[AttrChange, ...]:
    def shown(field: str, net: object) -> str:
        return f"{net} (auto from {picked[field]})" if field in picked else str(net)

    attrs = [AttrChange("subnet", None,
                        shown("subnet", spec.subnet) if spec.subnet else "(Docker picks)")]
    if spec.subnet6 is not None:
        attrs.append(AttrChange("subnet6", None, shown("subnet6", spec.subnet6)))
    elif spec.ipv6:
        attrs.append(AttrChange("subnet6", None, f"{ula_subnet(spec.name, 0)} (derived)"))
    if spec.mtu is not None:
        attrs.append(AttrChange("mtu", None, spec.mtu))
    elif default_mtu is not None:
        attrs.append(AttrChange("mtu", None, f"{default_mtu} (Docker's default bridge)"))
    attrs += [AttrChange("masquerade", None, spec.masquerade),
              AttrChange("internal", None, spec.internal)]
    attrs += [AttrChange(f"labels.{k}", None, v) for k, v in spec.labels]
    return tuple(attrs)


def _plan_network(ctx: PlanContext, docker: LiveDocker, spec: DockerNetwork,
                  found: list[LiveDockerNetwork]) -> Change:
    name = spec.name
    src = str(spec.source)
    address = f"{KIND}/{name}"
    ctx.observed[address] = {"default_mtu": docker.default_mtu,
                             "networks": [_view(n) for n in found]}
    if name in PROTECTED_NETWORKS:  # the loader refuses these; never plan on them anyway
        ctx.blocked.add(address)
        return Change(KIND, name, Action.CONFLICT, "is one of Docker's own networks",
                      source=src)
    overlap = ctx.overlaps.get(address)
    if overlap is not None:
        ctx.blocked.add(address)
        return Change(KIND, name, Action.CONFLICT, overlap, source=src)
    if not found:
        return Change(KIND, name, Action.CREATE, "not present",
                      _create_attrs(spec, docker.default_mtu, ctx.picked.get(address, {})),
                      (encode(DockerEnsure(spec_to_json(spec), docker.default_mtu,
                                           docker.scope)),), src)

    elsewhere = [n for n in found if n.owned
                 and not declared_scope_matches(network_scope(n.labels), docker.scope)]
    if elsewhere:
        # Docker networks are global to the daemon: another reconciler's (the host's, or
        # another sandbox's) is not ours to replace, dedupe or prune, and two of them
        # declaring one name would otherwise take it from each other at every pass
        ctx.blocked.add(address)
        listed = ", ".join(f"{_short(n.id)} of {network_scope(n.labels)!r}" for n in elsewhere)
        return Change(KIND, name, Action.CONFLICT,
                      f"exists but belongs to another reconciler ({SCOPE_LABEL} {listed}; "
                      f"this one is {docker.scope!r}): it is left alone (give the network "
                      "another name here)", source=src)
    ops: list[Op] = []
    reasons: list[str] = []
    if len(found) > 1:
        foreign = [n for n in found if not n.owned]
        if foreign:
            ctx.blocked.add(address)
            listed = ", ".join(f"{_short(n.id)}{'' if n.owned else ' (not ours)'}"
                               for n in found)
            return Change(KIND, name, Action.CONFLICT,
                          f"{len(found)} networks share this name ({listed}) and "
                          f"{len(foreign)} were not created by the reconciler; they are left "
                          "alone (remove the extra ones)", source=src)
        busy = [n for n in found[1:] if n.containers]
        if busy:
            ctx.blocked.add(address)
            listed = ", ".join(f"{_short(n.id)} ({n.containers})" for n in busy)
            return Change(KIND, name, Action.CONFLICT,
                          f"{len(found)} networks share this name and the ones to remove have "
                          f"containers attached: {listed}; keeping {_short(found[0].id)} (most "
                          "containers, then lowest ID) needs them detached first", source=src)
        ops.append(encode(DockerDedupe(name)))
        reasons.append(f"{len(found) - 1} duplicate{'s' if len(found) > 2 else ''}, keeping "
                       f"{_short(found[0].id)} (most containers, then lowest ID)")
    live = found[0]

    adopting = False
    if not live.owned:
        if not ctx.adopted(KIND, name):
            ctx.blocked.add(address)
            return Change(KIND, name, Action.CONFLICT,
                          f"exists ({_short(live.id)}) but was not created by the reconciler; "
                          f"it is left alone (--adopt {KIND}/{name} re-creates it with the "
                          "reconciler's label)", source=src)
        adopting = True

    diffs = diff_network(spec, live, docker.default_mtu)
    attrs = [AttrChange(field, before, after) for field, before, after, _ in diffs]
    if ipv6_fell_back(spec, live) and (spec.ipv6 or spec.subnet6 is not None):
        ctx.warnings.append(f"docker network {name} is IPv4-only: the Docker daemon could not "
                            "set up IPv6 when it was created (remove the network to retry)")
    if not diffs and not adopting:
        if not ops:
            return Change(KIND, name, Action.NOOP, source=src)
        return Change(KIND, name, Action.UPDATE, "; ".join(reasons), (), tuple(ops), src)

    if adopting:
        attrs.insert(0, AttrChange("owner", "foreign", "reconciler"))
        reasons.append("adopt: re-create it with the reconciler's label")
    if diffs:
        reasons.append(", ".join(f for f, *_ in diffs) + " differ; Docker cannot change a "
                       "network in place")
    if live.containers and not (ctx.options.force_replace or spec.replace_allowed):
        # ours, not a conflict: the replace is refused, and only this network is blocked
        ctx.blocked.add(address)
        return Change(KIND, name, Action.CONFLICT,
                      f"replace refused: {live.containers} container"
                      f"{'s' if live.containers != 1 else ''} attached ("
                      + "; ".join(reasons) + "); `--force-replace` (or `replace: allowed` "
                      "on the network) disconnects them, re-creates the network and "
                      "reconnects them with the same addresses and aliases",
                      tuple(attrs), source=src)
    if live.containers:
        reasons.append(f"{live.containers} container"
                       f"{'s' if live.containers != 1 else ''} will be reconnected")
    ops.append(encode(DockerReplace(spec_to_json(spec), docker.default_mtu, docker.scope,
                                    live.id, reconnect=live.containers > 0, adopt=adopting)))
    return Change(KIND, name, Action.REPLACE, "; ".join(reasons), tuple(attrs), tuple(ops), src)


def _plan_pruned(ctx: PlanContext, docker: LiveDocker,
                 by_name: dict[str, list[LiveDockerNetwork]]) -> list[Change]:
    """Plan the removal of owned networks of our scope that no file declares any more."""
    changes = []
    for name, nets in sorted(by_name.items()):
        if name in ctx.desired.docker_networks or name in PROTECTED_NETWORKS:
            continue
        mine = sort_duplicates(n for n in nets
                               if n.owned and network_scope(n.labels) == docker.scope)
        if not mine:
            continue
        address = f"{KIND}/{name}"
        ctx.observed[address] = {"networks": [_view(n) for n in mine]}
        if not ctx.options.prune:
            continue
        busy = sum(n.containers for n in mine)
        if busy:
            # Ours, so not a conflict that blocks the run: pruning it is merely postponed.
            ctx.warnings.append(
                f"docker network {name}: no longer declared, but {busy} "
                f"container{'s are' if busy != 1 else ' is'} attached; not removed yet "
                "(it is removed once they are detached)")
            continue
        changes.append(Change(
            KIND, name, Action.DELETE, "no longer declared",
            (AttrChange("subnets", ",".join(s for n in mine for s in n.subnets) or None,
                        None),),
            tuple(encode(DockerRemove(n.id, name)) for n in mine)))
    return changes
