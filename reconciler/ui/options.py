"""Plan options from the command line (or from a saved plan)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from reconciler.domain.errors import ConfigError
from reconciler.engine.reconcile import ProbeRequest
from reconciler.planner.context import PlanOptions


def plan_options(args: argparse.Namespace) -> PlanOptions:
    """The options `plan`, `apply` and `watch` were given (``--adopt`` checked here)."""
    adopt = frozenset(args.adopt or ())
    kinds = ("bridge", "subnet", "alloc", "docker_network")
    for a in adopt:
        kind, _, name = a.partition("/")
        if kind not in kinds or not name:
            raise ConfigError(f"--adopt {a}: expected KIND/NAME with KIND one of "
                              f"{', '.join(kinds)} (e.g. bridge/nomad)")
    return PlanOptions(prune=not args.no_prune, adopt=adopt,
                       force_replace=getattr(args, "force_replace", False))


def probe_request(args: argparse.Namespace) -> ProbeRequest | None:
    """The probes `apply`, `verify` and `watch` were asked for; None with ``--no-probe``.

    The external vantage point is on by default in a sandbox (``--netns``) and off on the
    host itself: it adds a namespace and a veth to the host, which a sandbox (and so every
    test, which runs in one) can afford and a production host should opt into. That is the
    whole rule for "tests": they run with ``--netns``.
    """
    if getattr(args, "no_probe", False):
        return None
    external = args.probe_external
    if external is None:
        external = bool(getattr(args, "netns", None))
    return ProbeRequest(external=bool(external), timeout=args.probe_timeout)


def saved_plan_options(options: Mapping[str, object], *, file: str | None = None) -> PlanOptions:
    """The options a saved plan (``plan --out``) was made with; a malformed one is one
    ``ConfigError`` line naming the file (a saved plan is a file anyone may have edited)."""
    def bad(key: str, want: str) -> ConfigError:
        return ConfigError(f"not a usable saved plan: options.{key} must be {want}", file=file)

    for key in ("prune", "force_replace"):
        if not isinstance(options.get(key, False), bool):
            raise bad(key, "true or false")
    adopt = options.get("adopt", [])
    if not isinstance(adopt, list | tuple) or not all(isinstance(a, str) for a in adopt):
        raise bad("adopt", "a list of KIND/NAME strings")
    return PlanOptions(prune=bool(options.get("prune", True)), adopt=frozenset(adopt),
                       force_replace=bool(options.get("force_replace", False)))
