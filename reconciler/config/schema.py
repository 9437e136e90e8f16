"""JSON Schema validation of a document, with messages that name file, line and field.

See docs/decisions/007-start-up-costs.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import fastjsonschema

if TYPE_CHECKING:
    import jsonschema

import difflib
import hashlib
import json
from collections.abc import Callable, Iterator
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from reconciler.config.document import Document, Path, clip, format_path
from reconciler.domain.errors import ConfigError


@cache
def schema() -> dict[str, Any]:
    text = resources.files("reconciler").joinpath("schemas/reconciler.schema.json").read_text()
    result: dict[str, Any] = json.loads(text)
    return result


@cache
def _validator() -> jsonschema.protocols.Validator:
    import jsonschema  # noqa: PLC0415 (~50 ms to import: only invalid files need it)

    cls = jsonschema.validators.validator_for(schema())
    validator: jsonschema.protocols.Validator = cls(schema(), format_checker=cls.FORMAT_CHECKER)
    return validator


@cache
def _fast_check() -> Callable[[Any], bool]:
    """Return a compiled validator (fastjsonschema, ~20x faster on big files) that only says yes/no.

    Valid documents, the common case, never reach jsonschema; an invalid one is
    validated again by jsonschema, which words the errors.
    """
    compiled = _pregenerated()
    if compiled is None:
        try:
            compiled = fastjsonschema.compile(schema())
        except Exception:  # an unsupported keyword: keep the slow, exact path
            return lambda _data: False

    def check(data: Any) -> bool:
        try:
            compiled(data)
        except fastjsonschema.JsonSchemaException:
            return False
        return True

    return check


def _pregenerated() -> Callable[[Any], Any] | None:
    """Return the check ``scripts/gen-schema-check.py`` generated (``config/schema_check.py``),
    while it is of this schema: compiling the schema costs ~50 ms of every run.

    None when it is stale (the schema changed since), made by another fastjsonschema
    than the one installed, or will not import: then the schema is compiled as before.
    """
    try:
        from reconciler.config import schema_check  # noqa: PLC0415 (only when needed)
    except Exception:
        return None
    raw = resources.files("reconciler").joinpath("schemas/reconciler.schema.json").read_bytes()
    if (hashlib.sha256(raw).hexdigest() != schema_check.SCHEMA_SHA256
            or getattr(schema_check, "VERSION", None) != fastjsonschema.VERSION):
        return None
    validate: Callable[[Any], Any] = schema_check.validate
    return validate


def _public_words(err: jsonschema.ValidationError) -> str:
    """Word a schema error by the rule it breaks, never by the value (jsonschema's own message
    quotes it): ``ConfigError.public_text``."""
    rule, want = str(err.validator), err.validator_value
    if rule == "type":
        return f"must be of type {want}"
    if rule == "enum" and isinstance(want, list):
        return "must be one of " + ", ".join(repr(v) for v in want[:10])
    if rule in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        return f"out of range ({rule} {want})"
    if rule in ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                "maxProperties"):
        return f"wrong size ({rule} {want})"
    if rule == "format":
        return f"not a valid {want}"
    return f"does not satisfy the schema's {rule!r} rule"


def _schema_message(doc: Document, err: jsonschema.ValidationError) -> ConfigError:
    path: Path = tuple(err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        allowed = sorted((err.schema.get("properties") or {}).keys())  # type: ignore[union-attr]
        extra = [k for k in err.instance if k not in allowed]
        if extra:
            key = extra[0]
            hint = difflib.get_close_matches(key, allowed, n=1)
            tip = f" (did you mean '{hint[0]}'?)" if hint else f" (allowed: {', '.join(allowed)})"
            return doc.error((*path, key), f"{format_path((*path, key))}: unknown key "
                                           f"{clip(repr(key), 60)}{tip}", key=True,
                             public=f"unknown key{tip}")
    if err.validator == "required":  # names a key of the schema, never a value
        return doc.error(path, f"{format_path(path)}: {clip(err.message)}",
                         public=clip(err.message))
    if err.validator == "pattern":
        what = err.schema.get("description", "") if isinstance(err.schema, dict) else ""
        msg = f"{clip(repr(err.instance), 60)} is not allowed here"
        return doc.error(path, f"{format_path(path)}: {msg}{': ' + what if what else ''}",
                         public=f"not allowed here{': ' + what if what else ''}")
    if err.validator == "oneOf" and path and path[-1] == "host":
        return doc.error(path, f"{format_path(path)}: must be a port 1-65535 or 'auto', "
                               f"got {clip(repr(err.instance), 60)}",
                         public="must be a port 1-65535 or 'auto'")
    return doc.error(path, f"{format_path(path)}: {clip(err.message)}",
                     public=_public_words(err))


def _control_chars(doc: Document, data: Any, path: Path) -> Iterator[ConfigError]:
    """Find strings holding control characters (a newline above all).

    The schema's ``^...$`` patterns cannot refuse them: Python's ``$`` also
    matches before a final newline, so ``"nomad\\n"`` would pass as a name and
    end a line of iptables-restore input or a /proc/sys path.
    """
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _control_chars(doc, k, (*path, k))
            yield from _control_chars(doc, v, (*path, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _control_chars(doc, v, (*path, i))
    elif isinstance(data, str):
        bad = next((ch for ch in data if ord(ch) < 0x20 or 0x7f <= ord(ch) < 0xa0), None)
        if bad is not None:
            yield doc.error(path, f"{clip(format_path(path), 60)}: control character "
                                  f"U+{ord(bad):04X} is not allowed in {clip(repr(data), 60)}",
                            public=f"control character U+{ord(bad):04X} is not allowed")


def validate_schema(doc: Document) -> list[ConfigError]:
    if not isinstance(doc.data, dict):
        return [doc.error((), "expected a mapping with 'version: 1' at the top level")]
    control = list(_control_chars(doc, doc.data, ()))
    if control:
        return control
    if _fast_check()(doc.data):
        return []
    errors = sorted(_validator().iter_errors(doc.data),
                    key=lambda e: (doc.where(tuple(e.absolute_path)).line, str(e.message)))
    out: list[ConfigError] = []
    seen: set[str] = set()
    for e in errors:
        ce = _schema_message(doc, e)
        if str(ce) not in seen:
            seen.add(str(ce))
            out.append(ce)
    return out

