"""Plan options from the command line (or from a saved plan)."""

from __future__ import annotations

import argparse
from typing import Any

from reconciler.domain.errors import ConfigError
from reconciler.planner.context import PlanOptions


def plan_options(args: argparse.Namespace) -> Any:
    adopt = frozenset(args.adopt or ())
    kinds = ("bridge", "subnet", "alloc", "docker_network")
    for a in adopt:
        kind, _, name = a.partition("/")
        if kind not in kinds or not name:
            raise ConfigError(f"--adopt {a}: expected KIND/NAME with KIND one of "
                              f"{', '.join(kinds)} (e.g. bridge/nomad)")
    return PlanOptions(prune=not args.no_prune, adopt=adopt,
                       force_replace=getattr(args, "force_replace", False))

