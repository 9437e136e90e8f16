"""JSON values as the typed fields of a dataclass hold them, and words for a mismatch.

``ops.decode`` checks each argument of a wire op with these: a JSON list becomes
a tuple, a union tries each alternative, JSON ``true`` is no integer. Pure.
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Callable
from typing import Any, Union, get_args, get_origin


class Mismatch(Exception):
    """A JSON value is not of the type asked for."""


def as_type(tp: Any, value: object) -> object:
    """Return ``value`` as a field of type ``tp`` holds it (a JSON list becomes a tuple)."""
    return converter(tp)(value)


@functools.cache
def converter(tp: Any) -> Callable[[object], object]:
    """Return what :func:`as_type` does for ``tp``, worked out once per type: the executor decodes
    every op of a plan (1,500 at 500 allocations), and asking ``typing`` for each field's
    origin and arguments every time was most of it. Raises ``Mismatch``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        alts = tuple(converter(alt) for alt in get_args(tp))

        def union(value: object) -> object:
            for alt in alts:
                try:
                    return alt(value)
                except Mismatch:
                    pass
            raise Mismatch

        return union
    if origin is tuple:
        item = converter(get_args(tp)[0])

        def sequence(value: object) -> object:
            if isinstance(value, list | tuple):
                return tuple(item(v) for v in value)
            raise Mismatch

        return sequence
    if origin is dict:
        def mapping(value: object) -> object:
            if isinstance(value, dict) and all(isinstance(k, str) for k in value):
                return dict(value)
            raise Mismatch

        return mapping
    if tp is type(None):
        def none(value: object) -> object:
            if value is None:
                return None
            raise Mismatch

        return none

    def plain(value: object) -> object:
        if tp is int and isinstance(value, bool):  # JSON true is no number
            raise Mismatch
        if isinstance(value, tp):
            return value
        raise Mismatch

    return plain


def describe(tp: Any) -> str:
    """Name the type ``tp`` in words, for an error line (``a list of strings``)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in get_args(tp))
    if origin is tuple:
        return "a list of " + {str: "strings"}.get(get_args(tp)[0], "values")
    if origin is dict:
        return "an object"
    return {str: "a string", int: "an integer", bool: "true or false",
            type(None): "null"}.get(tp, str(tp))


def show(value: object) -> str:
    """Show ``value`` as JSON, cut to 60 characters, for an error line."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."
