"""Read desired-state YAML files into a validated ``DesiredState``.

Three stages, each reporting every problem it finds with ``file:line:col``:
YAML parsing (positions kept for every value), JSON Schema validation, then
semantic checks that a schema cannot express (references, overlaps, clashes).

See docs/decisions/003-guard-rails-before-the-planner.md.
"""

from __future__ import annotations

import fnmatch
import os
import socket
from collections.abc import Sequence
from typing import Any

from reconciler.config.build import SECTIONS, Collector, read_settings
from reconciler.config.checks import cross_checks
from reconciler.config.document import parse_document
from reconciler.config.paths import expand_paths, read_bytes
from reconciler.config.schema import validate_schema
from reconciler.domain.errors import ConfigError, ConfigErrors
from reconciler.domain.model import DesiredState, Settings


def load(paths: Sequence[str], *, hostname: str | None = None,
         for_host: bool = True) -> DesiredState:
    """Load, validate and merge desired-state files; raise ConfigErrors listing every problem.

    A file with ``hosts:`` patterns that do not match ``hostname`` is still validated but
    contributes nothing. When every file has patterns and none matches, that is an error
    (``NoFileForHost``) unless ``for_host`` is false (``validate``): an empty
    desired state would prune everything the host has, and a typo in a pattern or a
    renamed host must not do that. A matching file with empty lists empties a host.
    """
    sources: list[tuple[str, str, bytes | ConfigError]] = []
    for f in expand_paths(paths):
        try:
            sources.append((f, os.path.abspath(f), read_bytes(f)))
        except ConfigError as exc:
            sources.append((f, os.path.abspath(f), exc))
    return load_sources(sources, hostname=hostname, for_host=for_host)


class NoFileForHost(ConfigError):
    """Every file has ``hosts:`` patterns and none matches this host (see :func:`load`)."""

    def __init__(self, host: str, unmatched: Sequence[tuple[str, Sequence[str]]]) -> None:
        self.host = host
        listed = "; ".join(f"{f}: {', '.join(p) or '(none)'}" for f, p in unmatched)
        super().__init__(f"no desired-state file is for host {host!r}: the hosts: patterns "
                         f"({listed}) match other hosts; nothing planned or pruned (a file "
                         "whose hosts: matches this host, with empty lists, empties it)",
                         public="no desired-state file is for this host: their hosts: "
                                "patterns match other hosts; nothing planned or pruned")


def load_sources(sources: Sequence[tuple[str, str, bytes | ConfigError]], *,
                 hostname: str | None = None, for_host: bool = True) -> DesiredState:
    """Run :func:`load` on files already read: (name as given, absolute path, bytes or the error).

    The plan agent loads what a client read in its own working directory this way.
    """
    host = hostname if hostname is not None else socket.gethostname()
    c = Collector()
    hashes: list[tuple[str, str]] = []
    #: files left out by their hosts: patterns, and whether any file is for this host
    unmatched: list[tuple[str, Sequence[str]]] = []
    matched = False
    for f, abspath, raw in sources:
        try:
            if isinstance(raw, ConfigError):
                raise raw
            doc = parse_document(raw, f)
        except ConfigError as exc:
            c.errors.append(exc)
            continue
        hashes.append((abspath, doc.sha256))
        schema_errors = validate_schema(doc)
        if schema_errors:
            c.errors.extend(schema_errors)
            continue
        data: dict[str, Any] = doc.data
        patterns = data.get("hosts")
        if patterns is not None and not any(fnmatch.fnmatchcase(host, p) for p in patterns):
            unmatched.append((f, patterns))
            continue
        matched = True
        if "settings" in data:
            c.guard(read_settings, c, doc, data["settings"])
        for section, build in SECTIONS:
            for i, raw in enumerate(data.get(section, [])):
                c.guard(build, c, doc, (section, i), raw)
    if not c.errors:
        c.errors.extend(cross_checks(c))
    if not c.errors and for_host and unmatched and not matched:
        c.errors.append(NoFileForHost(host, unmatched))
    if c.errors:
        raise ConfigErrors(c.errors) if len(c.errors) > 1 else c.errors[0]
    return DesiredState(c.bridges, c.subnets, c.allocs, c.docker,
                        c.settings or Settings(), tuple(f for f, _a, _r in sources),
                        tuple(hashes))

