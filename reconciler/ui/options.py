"""Plan options from the command line (or from a saved plan).

See docs/decisions/003-guard-rails-before-the-planner.md.
See docs/decisions/032-probes-in-apply-and-watch.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from reconciler.domain.errors import ConfigError
from reconciler.engine.reconcile import ProbeRequest
from reconciler.planner.context import PlanOptions

#: the kinds ``--adopt KIND/NAME`` takes
ADOPT_KINDS = ("bridge", "subnet", "alloc", "docker_network")


def adopt_problem(address: object) -> str | None:
    """Return why ``address`` is not a ``KIND/NAME`` of :data:`ADOPT_KINDS`; None when it is."""
    if not isinstance(address, str):
        return "expected a KIND/NAME string"
    kind, _, name = address.partition("/")
    if kind not in ADOPT_KINDS or not name:
        return (f"expected KIND/NAME with KIND one of {', '.join(ADOPT_KINDS)} "
                "(e.g. bridge/nomad)")
    return None


#: why a window (``--confirm-within``) refuses ``--adopt`` (docs/safe-change.md)
ADOPT_UNDER_WINDOW = (
    "--adopt cannot be used with --confirm-within: a revert cannot give adopted objects back "
    "(they would stay ours, and what the change replaced inside them would stay gone); "
    "adopt first, then change under a window; nothing changed")


def refuse_adopt_under_window(options: PlanOptions, window: float | None) -> None:
    """Refuse ``--adopt`` (given, or in a saved plan's options) with a window: one ConfigError
    line before anything runs."""
    if window is not None and options.adopt:
        raise ConfigError(ADOPT_UNDER_WINDOW)


def plan_options(args: argparse.Namespace) -> PlanOptions:
    """Read the options `plan`, `apply` and `watch` were given (``--adopt`` checked here, and
    refused under ``--confirm-within``)."""
    adopt = frozenset(args.adopt or ())
    for a in sorted(adopt):
        problem = adopt_problem(a)
        if problem is not None:
            raise ConfigError(f"--adopt {a}: {problem}")
    options = PlanOptions(prune=not args.no_prune, adopt=adopt,
                          force_replace=getattr(args, "force_replace", False))
    refuse_adopt_under_window(options, getattr(args, "confirm_within", None))
    return options


def probe_request(args: argparse.Namespace) -> ProbeRequest | None:
    """Read the probes `apply`, `verify` and `watch` were asked for; None with ``--no-probe``.

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


def _is_bool(value: object) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _is_adopt_list(value: object) -> str | None:
    want = "must be a list of KIND/NAME strings"
    if not isinstance(value, list):
        return want
    for a in value:
        if adopt_problem(a) is not None:
            return f"{want} with KIND one of {', '.join(ADOPT_KINDS)} (not {a!r})"
    return None


#: every option a saved plan may carry, and its check (None: fine, else what is wrong).
#: A key not here is refused: a plan made with an option this version does not know
#: would be applied without it.
SAVED_OPTIONS: dict[str, Callable[[object], str | None]] = {
    "prune": _is_bool, "adopt": _is_adopt_list, "force_replace": _is_bool,
}


def saved_plan_options(options: Mapping[str, object], *, file: str | None = None) -> PlanOptions:
    """Read the options a saved plan (``plan --out``) was made with; a malformed one is one
    ``ConfigError`` line naming the file and the option (a saved plan is a file anyone may
    have edited)."""
    if not isinstance(options, Mapping):
        raise ConfigError("not a usable saved plan: options must be a mapping of option "
                          "names to values", file=file)
    for key in sorted(options, key=str):
        check = SAVED_OPTIONS.get(key) if isinstance(key, str) else None
        if check is None:
            raise ConfigError(f"not a usable saved plan: options.{key} is not an option of "
                              f"this version (it knows {', '.join(SAVED_OPTIONS)})", file=file)
        problem = check(options[key])
        if problem is not None:
            raise ConfigError(f"not a usable saved plan: options.{key} {problem}", file=file)
    adopt = options.get("adopt", [])
    assert isinstance(adopt, list)
    return PlanOptions(prune=bool(options.get("prune", True)), adopt=frozenset(adopt),
                       force_replace=bool(options.get("force_replace", False)))
