"""Read desired-state YAML files into a validated ``DesiredState``.

Three stages, each reporting every problem it finds with ``file:line:col``:
YAML parsing (positions kept for every value), JSON Schema validation, then
semantic checks that a schema cannot express (references, overlaps, clashes).
"""

from __future__ import annotations

import fnmatch
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from reconciler.config.build import SECTIONS, Collector, read_settings
from reconciler.config.checks import cross_checks
from reconciler.config.document import parse_document
from reconciler.config.paths import expand_paths, read_bytes
from reconciler.config.schema import validate_schema
from reconciler.domain.errors import ConfigError, ConfigErrors
from reconciler.domain.model import DesiredState, Settings

if TYPE_CHECKING:
    pass


def load(paths: Sequence[str], *, hostname: str | None = None) -> DesiredState:
    """Load, validate and merge desired-state files; raise ConfigErrors listing every problem.

    A file with ``hosts:`` patterns that do not match ``hostname`` is still validated but
    contributes nothing.
    """
    sources: list[tuple[str, str, bytes | ConfigError]] = []
    for f in expand_paths(paths):
        try:
            sources.append((f, os.path.abspath(f), read_bytes(f)))
        except ConfigError as exc:
            sources.append((f, os.path.abspath(f), exc))
    return load_sources(sources, hostname=hostname)


def load_sources(sources: Sequence[tuple[str, str, bytes | ConfigError]], *,
                 hostname: str | None = None) -> DesiredState:
    """:func:`load` of files already read: (name as given, absolute path, bytes or the error).

    The plan agent loads what a client read in its own working directory this way.
    """
    host = hostname if hostname is not None else socket.gethostname()
    c = Collector()
    hashes: list[tuple[str, str]] = []
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
            continue
        if "settings" in data:
            c.guard(read_settings, c, doc, data["settings"])
        for section, build in SECTIONS:
            for i, raw in enumerate(data.get(section, [])):
                c.guard(build, c, doc, (section, i), raw)
    if not c.errors:
        c.errors.extend(cross_checks(c))
    if c.errors:
        raise ConfigErrors(c.errors) if len(c.errors) > 1 else c.errors[0]
    return DesiredState(c.bridges, c.subnets, c.allocs, c.docker,
                        c.settings or Settings(), tuple(f for f, _a, _r in sources),
                        tuple(hashes))

