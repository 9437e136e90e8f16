"""YAML documents with a position for every value, and the guards that keep parsing bounded.

Alias bombs, deep nesting, huge files and control characters are refused,
never expanded. Errors are ``ConfigError``s naming ``file:line:col``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml

from reconciler.config.paths import MAX_FILE_BYTES
from reconciler.domain.errors import ConfigError
from reconciler.domain.model import Source

MAX_NODES = 200_000  # after alias expansion: stops "billion laughs"


MAX_MESSAGE = 160


MAX_DEPTH = 64  # a desired state nests 5 levels deep


Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Pos:
    line: int
    col: int


@dataclass
class Document:
    """One parsed file: plain data plus the position of every value and key."""

    file: str
    data: Any
    values: dict[Path, Pos]
    keys: dict[Path, Pos]
    sha256: str = ""  # of the bytes parsed (set by parse_document)

    def where(self, path: Path, *, key: bool = False) -> Pos:
        table = self.keys if key else self.values
        p = path
        while p:
            if p in table:
                return table[p]
            if not key and p in self.values:
                return self.values[p]
            p = p[:-1]
        return self.values.get((), Pos(1, 1))

    def source(self, path: Path) -> Source:
        return Source(self.file, self.where(path).line)

    def error(self, path: Path, message: str, *, key: bool = False,
              public: str | None = None) -> ConfigError:
        """Return the error ``message`` at ``path``; ``public`` words it without the file's
        values (``ConfigError.public_text``), when it can be."""
        pos = self.where(path, key=key)
        return ConfigError(message, file=self.file, line=pos.line, col=pos.col,
                           key=format_path(path), public=public)


def format_path(path: Iterable[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    if not text.isprintable():
        text = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Builder:
    """Turns a composed YAML node tree into plain data, recording positions."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.values: dict[Path, Pos] = {}
        self.keys: dict[Path, Pos] = {}
        self.count = 0
        self.constructor = yaml.constructor.SafeConstructor()

    def fail(self, node: yaml.Node, message: str, path: Path | None = None,
             public: str | None = None) -> ConfigError:
        return ConfigError(message, file=self.file, line=node.start_mark.line + 1,
                           col=node.start_mark.column + 1,
                           key=None if path is None else format_path(path), public=public)

    def build(self, node: yaml.Node, path: Path) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise self.fail(node, f"document too large: more than {MAX_NODES} values "
                                  "(after expanding aliases)",
                            public=f"document too large: more than {MAX_NODES} values")
        self.values.setdefault(path, Pos(node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            self.constructor.flatten_mapping(node)  # resolves "<<" merge keys
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = self.constructor.construct_object(key_node, deep=True) \
                    if isinstance(key_node, yaml.ScalarNode) else None
                if not isinstance(key, str):
                    raise self.fail(key_node, f"{format_path(path)}: keys must be strings, "
                                              f"got {clip(repr(key))}", path,
                                    "keys must be strings")
                if key in out:
                    first = self.keys[(*path, key)]
                    raise self.fail(key_node, f"{format_path((*path, key))}: duplicate key "
                                              f"(first at line {first.line})", (*path, key),
                                    f"duplicate key (first at line {first.line})")
                self.keys[(*path, key)] = Pos(key_node.start_mark.line + 1,
                                              key_node.start_mark.column + 1)
                out[key] = self.build(value_node, (*path, key))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        try:
            return self.constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, OverflowError) as exc:
            raise self.fail(node, f"{format_path(path)}: bad value: {clip(str(exc))}", path,
                            "bad value") from None


#: libyaml's parser when PyYAML has it, for the size pre-check (an order of magnitude faster)
_FAST_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


_NODE_EVENTS = (yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent,
                yaml.AliasEvent)


def _check_size(text: str, file: str) -> None:
    """Refuse deep nesting and more than MAX_NODES values before composing any Python object.

    Composing and building cost time and memory per node (a 7 MB file of small
    items took over a minute and ~1 GB before the builder's count stopped it);
    counting parser events is cheap. Syntax errors are left to the composer,
    which reports them.
    """
    count = depth = 0
    limit = 2 * MAX_NODES  # keys are nodes too; the builder counts values only
    try:
        for event in yaml.parse(text, Loader=_FAST_LOADER):
            line = event.start_mark.line + 1 if event.start_mark is not None else None
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:  # libyaml's composer recurses in C: it would crash
                    raise ConfigError("invalid YAML: nesting too deep", file=file, line=line)
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
            if isinstance(event, _NODE_EVENTS):
                count += 1
                if count > limit:
                    raise ConfigError(f"document too large: more than {limit} YAML nodes",
                                      file=file, line=line,
                                      public=f"document too large: more than {limit} YAML nodes")
    except yaml.YAMLError:
        return


def parse_yaml(text: str, file: str) -> Document:
    """Parse one YAML document keeping positions; any problem is a ConfigError."""
    _check_size(text, file)
    try:
        nodes = list(yaml.compose_all(text, Loader=_FAST_LOADER))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        if "nesting depth" in problem:  # newer libyaml has a depth limit of its own
            problem = "nesting too deep"
        # PyYAML's words may quote the file (a character, an alias, a tag): the position
        # is what readers who may not read the file get
        if mark is None:
            raise ConfigError(f"invalid YAML: {clip(problem)}", file=file,
                              public="invalid YAML") from None
        raise ConfigError(f"invalid YAML: {clip(problem)}", file=file, line=mark.line + 1,
                          col=mark.column + 1, public="invalid YAML") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {clip(str(exc))}", file=file,
                          public="invalid YAML") from None
    except RecursionError:
        raise ConfigError("invalid YAML: nesting too deep", file=file,
                          public="invalid YAML: nesting too deep") from None
    if not nodes:
        raise ConfigError("empty file: expected a mapping with 'version: 1'", file=file, line=1,
                          public="empty file: expected a mapping with 'version: 1'")
    if len(nodes) > 1:
        second = nodes[1]
        raise ConfigError("more than one YAML document in a file", file=file,
                          line=second.start_mark.line + 1,
                          public="more than one YAML document in a file")
    builder = _Builder(file)
    try:
        data = builder.build(nodes[0], ())
    except RecursionError:
        raise ConfigError("invalid YAML: nesting too deep", file=file,
                          public="invalid YAML: nesting too deep") from None
    return Document(file, data, builder.values, builder.keys)


def parse_document(raw: bytes, path: str) -> Document:
    """Parse one file's bytes as a positioned YAML document, named ``path`` in messages."""
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"file too large (over {MAX_FILE_BYTES} bytes)", file=path,
                          public=f"file too large (over {MAX_FILE_BYTES} bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", file=path,
                          public=f"not UTF-8 text (byte {exc.start})") from None
    doc = parse_yaml(text, path)
    doc.sha256 = hashlib.sha256(raw).hexdigest()
    return doc

