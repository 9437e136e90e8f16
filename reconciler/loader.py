"""Read desired-state YAML files into a validated ``DesiredState``.

Three stages, each reporting every problem it finds with ``file:line:col``:
YAML parsing (positions kept for every value), JSON Schema validation, then
semantic checks that a schema cannot express (references, overlaps, clashes).
"""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import ipaddress
import json
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import jsonschema

from reconciler.errors import ConfigError, ConfigErrors
from reconciler.model import (
    AddrRange,
    Alloc,
    AllocId,
    Bridge,
    BridgeName,
    DesiredState,
    DockerNetwork,
    DockerNetworkName,
    PortMap,
    Settings,
    Source,
    Subnet,
    SubnetName,
)
from reconciler.paths import MAX_FILE_BYTES, expand_paths, read_bytes

MAX_BRIDGE_PORTS = 1023  # the kernel's BR_MAX_PORTS (1024) less port number 0
MAX_NODES = 200_000  # after alias expansion: stops "billion laughs"
MAX_MESSAGE = 160
MAX_DEPTH = 64  # a desired state nests 5 levels deep
#: names /proc/sys/net/*/conf uses for itself: a link with these names would be ambiguous
RESERVED_IFNAMES = frozenset({"all", "default", ".", ".."})

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
    sha256: str = ""  # of the bytes parsed (set by read_file)

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

    def error(self, path: Path, message: str, *, key: bool = False) -> ConfigError:
        pos = self.where(path, key=key)
        return ConfigError(message, file=self.file, line=pos.line, col=pos.col)


def format_path(path: Iterable[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    if not text.isprintable():
        text = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- YAML


class _Builder:
    """Turns a composed YAML node tree into plain data, recording positions."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.values: dict[Path, Pos] = {}
        self.keys: dict[Path, Pos] = {}
        self.count = 0
        self.constructor = yaml.constructor.SafeConstructor()

    def fail(self, node: yaml.Node, message: str) -> ConfigError:
        return ConfigError(message, file=self.file, line=node.start_mark.line + 1,
                           col=node.start_mark.column + 1)

    def build(self, node: yaml.Node, path: Path) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise self.fail(node, f"document too large: more than {MAX_NODES} values "
                                  "(after expanding aliases)")
        self.values.setdefault(path, Pos(node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            self.constructor.flatten_mapping(node)  # resolves "<<" merge keys
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = self.constructor.construct_object(key_node, deep=True) \
                    if isinstance(key_node, yaml.ScalarNode) else None
                if not isinstance(key, str):
                    raise self.fail(key_node, f"{format_path(path)}: keys must be strings, "
                                              f"got {clip(repr(key))}")
                if key in out:
                    first = self.keys[(*path, key)]
                    raise self.fail(key_node, f"{format_path((*path, key))}: duplicate key "
                                              f"(first at line {first.line})")
                self.keys[(*path, key)] = Pos(key_node.start_mark.line + 1,
                                              key_node.start_mark.column + 1)
                out[key] = self.build(value_node, (*path, key))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        try:
            return self.constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, OverflowError) as exc:
            raise self.fail(node, f"{format_path(path)}: bad value: {clip(str(exc))}") from None


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
                                      file=file, line=line)
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
        if mark is None:
            raise ConfigError(f"invalid YAML: {clip(problem)}", file=file) from None
        raise ConfigError(f"invalid YAML: {clip(problem)}", file=file, line=mark.line + 1,
                          col=mark.column + 1) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {clip(str(exc))}", file=file) from None
    except RecursionError:
        raise ConfigError("invalid YAML: nesting too deep", file=file) from None
    if not nodes:
        raise ConfigError("empty file: expected a mapping with 'version: 1'", file=file, line=1)
    if len(nodes) > 1:
        second = nodes[1]
        raise ConfigError("more than one YAML document in a file", file=file,
                          line=second.start_mark.line + 1)
    builder = _Builder(file)
    try:
        data = builder.build(nodes[0], ())
    except RecursionError:
        raise ConfigError("invalid YAML: nesting too deep", file=file) from None
    return Document(file, data, builder.values, builder.keys)


# --------------------------------------------------------------------------- files


def read_file(path: str) -> Document:
    return parse_document(read_bytes(path), path)


def parse_document(raw: bytes, path: str) -> Document:
    """One file's bytes as a positioned YAML document, named ``path`` in messages."""
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"file too large (over {MAX_FILE_BYTES} bytes)", file=path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", file=path) from None
    doc = parse_yaml(text, path)
    doc.sha256 = hashlib.sha256(raw).hexdigest()
    return doc


# --------------------------------------------------------------------------- schema


@cache
def schema() -> dict[str, Any]:
    text = resources.files("reconciler").joinpath("schemas/reconciler.schema.json").read_text()
    result: dict[str, Any] = json.loads(text)
    return result


@cache
def _validator() -> jsonschema.protocols.Validator:
    import jsonschema  # ~50 ms to import: only invalid files (and tests) need it

    cls = jsonschema.validators.validator_for(schema())
    validator: jsonschema.protocols.Validator = cls(schema(), format_checker=cls.FORMAT_CHECKER)
    return validator


@cache
def _fast_check() -> Callable[[Any], bool]:
    """A compiled validator (fastjsonschema, ~20x faster on big files) that only says yes/no.

    Valid documents, the common case, never reach jsonschema; an invalid one is
    validated again by jsonschema, which words the errors. Without the package
    everything goes through jsonschema.
    """
    try:
        import fastjsonschema
    except ImportError:
        return lambda _data: False
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
                                           f"{clip(repr(key), 60)}{tip}", key=True)
    if err.validator == "required":
        return doc.error(path, f"{format_path(path)}: {clip(err.message)}")
    if err.validator == "pattern":
        what = err.schema.get("description", "") if isinstance(err.schema, dict) else ""
        msg = f"{clip(repr(err.instance), 60)} is not allowed here"
        return doc.error(path, f"{format_path(path)}: {msg}{': ' + what if what else ''}")
    if err.validator == "oneOf" and path and path[-1] == "host":
        return doc.error(path, f"{format_path(path)}: must be a port 1-65535 or 'auto', "
                               f"got {clip(repr(err.instance), 60)}")
    return doc.error(path, f"{format_path(path)}: {clip(err.message)}")


def _control_chars(doc: Document, data: Any, path: Path) -> Iterator[ConfigError]:
    """Strings holding control characters (a newline above all).

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
                                  f"U+{ord(bad):04X} is not allowed in {clip(repr(data), 60)}")


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


# --------------------------------------------------------------------------- semantics


_PREFIX_EXAMPLE = {4: "an IPv4 prefix like 172.26.64.0/20", 6: "an IPv6 prefix like fd00:a:b::/64"}
_OTHER_FIELDS = {4: "cidr6/subnet6 for IPv6", 6: "cidr/subnet for IPv4"}


def _prefix(doc: Document, path: Path, text: str,
            version: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise doc.error(path, f"{format_path(path)}: {clip(repr(text), 60)} is not "
                              f"{_PREFIX_EXAMPLE[version]}") from None
    if net.version != version:
        raise doc.error(path, f"{format_path(path)}: {text} is IPv{net.version}; use "
                              f"{_OTHER_FIELDS[version]}")
    if ipaddress.ip_interface(text).ip != net.network_address:
        raise doc.error(path, f"{format_path(path)}: {text} has host bits set; "
                              f"did you mean {net}?")
    return net


def _net4(doc: Document, path: Path, text: str) -> ipaddress.IPv4Network:
    net = _prefix(doc, path, text, 4)
    assert isinstance(net, ipaddress.IPv4Network)
    return net


def _net6(doc: Document, path: Path, text: str) -> ipaddress.IPv6Network:
    net = _prefix(doc, path, text, 6)
    assert isinstance(net, ipaddress.IPv6Network)
    return net


def _ip(doc: Document, path: Path, text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise doc.error(path, f"{format_path(path)}: {clip(repr(text), 60)} "
                              "is not an IP address") from None


@dataclass
class _Defined:
    doc: Document
    path: Path

    @property
    def source(self) -> Source:
        return self.doc.source(self.path)


class _Collector:
    """Accumulates resources across files, with duplicate-identity detection."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []
        self.seen: dict[tuple[str, str], _Defined] = {}
        self.bridges: dict[BridgeName, Bridge] = {}
        self.subnets: dict[SubnetName, Subnet] = {}
        self.allocs: dict[AllocId, Alloc] = {}
        self.docker: dict[DockerNetworkName, DockerNetwork] = {}
        self.settings: Settings | None = None
        self.settings_at: _Defined | None = None

    def claim(self, kind: str, name: str, doc: Document, path: Path) -> bool:
        here = _Defined(doc, path)
        first = self.seen.get((kind, name))
        if first is not None:
            self.errors.append(doc.error(path, f"{kind} {name!r} is defined twice: at "
                                               f"{first.source} and {here.source}"))
            return False
        self.seen[(kind, name)] = here
        return True

    def guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except ConfigErrors as exc:
            self.errors.extend(exc.errors)
        except ConfigError as exc:
            self.errors.append(exc)


def _bridge(c: _Collector, doc: Document, path: Path, raw: dict[str, Any]) -> None:
    name = raw["name"]
    if name in RESERVED_IFNAMES:
        raise doc.error((*path, "name"), f"{format_path((*path, 'name'))}: {name!r} is reserved "
                                         "by the kernel's /proc/sys/net and cannot name a link")
    if name.startswith("-"):
        raise doc.error((*path, "name"), f"{format_path((*path, 'name'))}: {name!r} starts with "
                                         "'-' and would read as an option to ip or iptables")
    if c.claim("bridge", name, doc, path):
        c.bridges[BridgeName(name)] = Bridge(BridgeName(name), raw.get("mtu"),
                                             raw.get("hairpin", True), doc.source(path))


def _subnet(c: _Collector, doc: Document, path: Path, raw: dict[str, Any]) -> None:
    name = raw["name"]
    cidr = _net4(doc, (*path, "cidr"), raw["cidr"])
    if cidr.prefixlen > 30:
        raise doc.error((*path, "cidr"), f"{format_path((*path, 'cidr'))}: /{cidr.prefixlen} "
                        "leaves no room for a gateway and allocations; use /30 or larger")
    gateway = ipaddress.IPv4Address(cidr.network_address + 1)
    if "gateway" in raw:
        gw = _ip(doc, (*path, "gateway"), raw["gateway"])
        if not isinstance(gw, ipaddress.IPv4Address) or gw not in cidr or gw in (
                cidr.network_address, cidr.broadcast_address):
            raise doc.error((*path, "gateway"), f"{format_path((*path, 'gateway'))}: {gw} is not "
                                                f"a host address of {cidr}")
        gateway = gw
    cidr6 = gateway6 = None
    if "cidr6" in raw:
        cidr6 = _net6(doc, (*path, "cidr6"), raw["cidr6"])
        if cidr6.prefixlen > 126:
            raise doc.error((*path, "cidr6"), f"{format_path((*path, 'cidr6'))}: /{cidr6.prefixlen}"
                            " is too small; use /126 or larger")
        gateway6 = ipaddress.IPv6Address(cidr6.network_address + 1)
    if "gateway6" in raw:
        if cidr6 is None:
            raise doc.error((*path, "gateway6"), f"{format_path((*path, 'gateway6'))}: "
                                                 "needs cidr6")
        gw6 = _ip(doc, (*path, "gateway6"), raw["gateway6"])
        if not isinstance(gw6, ipaddress.IPv6Address) or gw6 not in cidr6 or \
                gw6 == cidr6.network_address:
            raise doc.error((*path, "gateway6"), f"{format_path((*path, 'gateway6'))}: {gw6} is "
                                                 f"not a host address of {cidr6}")
        gateway6 = gw6
    rng = None
    if "range" in raw:
        rp = (*path, "range")
        start = _ip(doc, (*rp, "start"), raw["range"]["start"])
        end = _ip(doc, (*rp, "end"), raw["range"]["end"])
        for label, ip in (("start", start), ("end", end)):
            if not isinstance(ip, ipaddress.IPv4Address) or ip not in cidr or ip in (
                    cidr.network_address, cidr.broadcast_address):
                raise doc.error((*rp, label), f"{format_path((*rp, label))}: {ip} is not a host "
                                              f"address of {cidr}")
        assert isinstance(start, ipaddress.IPv4Address) and isinstance(end, ipaddress.IPv4Address)
        if start > end:
            raise doc.error(rp, f"{format_path(rp)}: start {start} is after end {end}")
        if start == end == gateway:
            raise doc.error(rp, f"{format_path(rp)}: holds only the gateway {gateway}")
        rng = AddrRange(start, end)
    if c.claim("subnet", name, doc, path):
        c.subnets[SubnetName(name)] = Subnet(
            SubnetName(name), BridgeName(raw["bridge"]), cidr, gateway, cidr6, gateway6, rng,
            raw.get("masquerade", True), doc.source(path))


def _host_ip(doc: Document, path: Path,
             text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """A port map's host address; the unspecified address means every address (None)."""
    if "%" in text:
        raise doc.error(path, f"{format_path(path)}: {clip(repr(text), 60)}: zone ids are not "
                              "supported; give a global or loopback address")
    ip = _ip(doc, path, text)
    if ip.is_unspecified:
        return None
    if ip.is_multicast or ip.is_link_local:
        raise doc.error(path, f"{format_path(path)}: {ip} is a multicast or link-local address; "
                              "a port map needs an address of this host")
    if ip.version == 6 and ip.is_loopback:
        raise doc.error(path, f"{format_path(path)}: {ip}: IPv6 loopback cannot be forwarded to "
                              "an allocation (Linux has no route_localnet for IPv6); use "
                              "127.0.0.1")
    return ip


def _alloc(c: _Collector, doc: Document, path: Path, raw: dict[str, Any]) -> None:
    aid = raw["id"]
    address = address6 = None
    if "address" in raw:
        a = _ip(doc, (*path, "address"), raw["address"])
        if not isinstance(a, ipaddress.IPv4Address):
            raise doc.error((*path, "address"), f"{format_path((*path, 'address'))}: must be IPv4")
        address = a
    if "address6" in raw:
        a6 = _ip(doc, (*path, "address6"), raw["address6"])
        if not isinstance(a6, ipaddress.IPv6Address):
            raise doc.error((*path, "address6"), f"{format_path((*path, 'address6'))}: "
                                                 "must be IPv6")
        address6 = a6
    ports: list[PortMap] = []
    for i, p in enumerate(raw.get("ports", [])):
        pp = (*path, "ports", i)
        host_ip = _host_ip(doc, (*pp, "host_ip"), p["host_ip"]) if "host_ip" in p else None
        ports.append(PortMap(None if p["host"] == "auto" else int(p["host"]), int(p["to"]),
                             p.get("protocol", "tcp"), host_ip))
    if c.claim("alloc", aid, doc, path):
        c.allocs[AllocId(aid)] = Alloc(AllocId(aid), SubnetName(raw["subnet"]), address,
                                       address6, tuple(ports), doc.source(path))


def _docker(c: _Collector, doc: Document, path: Path, raw: dict[str, Any]) -> None:
    name = raw["name"]
    if name in ("bridge", "host", "none"):
        raise doc.error((*path, "name"), f"{format_path((*path, 'name'))}: {name!r} is one of "
                                         "Docker's own networks and cannot be managed")
    subnet = _net4(doc, (*path, "subnet"), raw["subnet"]) if "subnet" in raw else None
    subnet6 = _net6(doc, (*path, "subnet6"), raw["subnet6"]) if "subnet6" in raw else None
    ipv6 = raw.get("ipv6")
    if subnet6 is not None and ipv6 is False:
        raise doc.error((*path, "ipv6"), f"{format_path((*path, 'ipv6'))}: is false but subnet6 "
                                         "is given")
    labels = raw.get("labels", {})
    reserved = sorted(k for k in labels if k.startswith("io.reconciler."))
    if reserved:
        raise doc.error((*path, "labels", reserved[0]),
                        f"{format_path((*path, 'labels'))}: {reserved[0]!r}: labels under "
                        "'io.reconciler.' are the reconciler's own (ownership, scope)",
                        key=True)
    if c.claim("docker network", name, doc, path):
        c.docker[DockerNetworkName(name)] = DockerNetwork(
            DockerNetworkName(name), bool(ipv6) or subnet6 is not None, subnet, subnet6,
            raw.get("mtu"), raw.get("masquerade", True), raw.get("internal", False),
            tuple(sorted(labels.items())), doc.source(path))


def _settings(c: _Collector, doc: Document, raw: dict[str, Any]) -> None:
    here = _Defined(doc, ("settings",))
    if c.settings_at is not None:
        raise doc.error(("settings",), f"settings are defined twice: at {c.settings_at.source} "
                                       f"and {here.source}")
    c.settings_at = here
    rng = raw.get("auto_port_range")
    port_range = Settings().auto_port_range
    if rng is not None:
        if rng["start"] > rng["end"]:
            raise doc.error(("settings", "auto_port_range"),
                            "settings.auto_port_range: start is after end")
        port_range = (rng["start"], rng["end"])
    c.settings = Settings(auto_port_range=port_range)


_SECTIONS = (("bridges", _bridge), ("subnets", _subnet), ("allocs", _alloc),
             ("docker_networks", _docker))


def _where(state: _Collector, kind: str, name: str) -> Source:
    return state.seen[(kind, name)].source


def _cross_checks(c: _Collector) -> Iterator[ConfigError]:
    """Checks across resources: references, overlaps, address and port clashes."""

    def err(kind: str, name: str, field: str, message: str) -> ConfigError:
        d = c.seen[(kind, name)]
        path = (*d.path, field)
        pos = d.doc.where(path)
        return ConfigError(message, file=d.doc.file, line=pos.line, col=pos.col)

    for s in c.subnets.values():
        if s.bridge not in c.bridges:
            yield err("subnet", s.name, "bridge",
                      f"subnet {s.name!r}: bridge {s.bridge!r} is not declared")
    # overlapping prefixes: among subnets, and against docker networks' declared subnets
    prefixes: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str, str, str]] = []
    for s in c.subnets.values():
        prefixes.append((s.cidr, "subnet", s.name, "cidr"))
        if s.cidr6 is not None:
            prefixes.append((s.cidr6, "subnet", s.name, "cidr6"))
    for d in c.docker.values():
        if d.subnet is not None:
            prefixes.append((d.subnet, "docker network", d.name, "subnet"))
        if d.subnet6 is not None:
            prefixes.append((d.subnet6, "docker network", d.name, "subnet6"))
    ordered = sorted(prefixes, key=lambda p: (p[0].version, int(p[0].network_address)))
    for i, (net, kind, name, field) in enumerate(ordered):
        for onet, okind, oname, ofield in ordered[i + 1:]:
            if onet.version != net.version or \
                    int(onet.network_address) > int(net.broadcast_address):
                break
            yield err(okind, oname, ofield,
                      f"{okind} {oname!r}: {ofield} {onet} overlaps {kind} {name!r} {field} "
                      f"{net} at {_where(c, kind, name)}")
    # a Linux bridge takes at most 1023 ports ("Exchange full" at the 1024th veth)
    per_bridge: dict[str, list[str]] = {}
    for a in c.allocs.values():
        sn = c.subnets.get(a.subnet)
        if sn is not None:
            per_bridge.setdefault(sn.bridge, []).append(a.id)
    for bridge_name, ids in sorted(per_bridge.items()):
        if len(ids) > MAX_BRIDGE_PORTS and ("bridge", bridge_name) in c.seen:
            yield err("bridge", bridge_name, "name",
                      f"bridge {bridge_name!r}: {len(ids)} allocations, but a Linux bridge takes "
                      f"at most {MAX_BRIDGE_PORTS} ports; spread them over more bridges")
    # allocations: references, addresses, ports
    addresses: dict[ipaddress.IPv4Address | ipaddress.IPv6Address, str] = {}
    ports: dict[tuple[str, int], list[tuple[Any, str, int]]] = {}
    for a in c.allocs.values():
        sn = c.subnets.get(a.subnet)
        if sn is None:
            yield err("alloc", a.id, "subnet",
                      f"alloc {a.id!r}: subnet {a.subnet!r} is not declared")
            continue
        if a.address is not None:
            if a.address not in sn.cidr or a.address in (sn.cidr.network_address,
                                                         sn.cidr.broadcast_address):
                yield err("alloc", a.id, "address",
                          f"alloc {a.id!r}: address {a.address} is not a host address of "
                          f"subnet {sn.name!r} ({sn.cidr})")
            elif a.address == sn.gateway:
                yield err("alloc", a.id, "address",
                          f"alloc {a.id!r}: address {a.address} is the gateway of "
                          f"subnet {sn.name!r}")
        if a.address6 is not None:
            if sn.cidr6 is None:
                yield err("alloc", a.id, "address6",
                          f"alloc {a.id!r}: address6 given but subnet {sn.name!r} has no cidr6")
            elif a.address6 not in sn.cidr6 or a.address6 in (sn.cidr6.network_address,
                                                             sn.gateway6):
                yield err("alloc", a.id, "address6",
                          f"alloc {a.id!r}: address6 {a.address6} is not a free host address "
                          f"of subnet {sn.name!r} ({sn.cidr6})")
        for addr, field in ((a.address, "address"), (a.address6, "address6")):
            if addr is None:
                continue
            if addr in addresses:
                holder = addresses[addr]
                yield err("alloc", a.id, field,
                          f"alloc {a.id!r}: {field} {addr} is already given to alloc {holder!r} "
                          f"at {_where(c, 'alloc', holder)}")
            else:
                addresses[addr] = a.id
        for i, p in enumerate(a.ports):
            if p.host_ip is not None and p.host_ip.version == 6 and sn.cidr6 is None:
                here = c.seen[("alloc", a.id)]
                pos = here.doc.where((*here.path, "ports", i, "host_ip"))
                yield ConfigError(f"alloc {a.id!r}: host_ip {p.host_ip} is IPv6 but subnet "
                                  f"{sn.name!r} has no cidr6", file=here.doc.file,
                                  line=pos.line, col=pos.col)
            if p.host is None:
                continue
            for proto in p.protocols:
                for (other_ip, other_id, other_i) in ports.get((proto, p.host), []):
                    if p.host_ip is None or other_ip is None or p.host_ip == other_ip:
                        here = c.seen[("alloc", a.id)]
                        pos = here.doc.where((*here.path, "ports", i))
                        yield ConfigError(
                            f"alloc {a.id!r}: host port {p.host}/{proto} is already mapped by "
                            f"alloc {other_id!r} (ports[{other_i}]) at "
                            f"{_where(c, 'alloc', other_id)}",
                            file=here.doc.file, line=pos.line, col=pos.col)
                        break
                ports.setdefault((proto, p.host), []).append((p.host_ip, a.id, i))


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
    c = _Collector()
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
            c.guard(_settings, c, doc, data["settings"])
        for section, build in _SECTIONS:
            for i, raw in enumerate(data.get(section, [])):
                c.guard(build, c, doc, (section, i), raw)
    if not c.errors:
        c.errors.extend(_cross_checks(c))
    if c.errors:
        raise ConfigErrors(c.errors) if len(c.errors) > 1 else c.errors[0]
    return DesiredState(c.bridges, c.subnets, c.allocs, c.docker,
                        c.settings or Settings(), tuple(f for f, _a, _r in sources),
                        tuple(hashes))
