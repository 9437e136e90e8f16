"""Bad-input fuzzing of the loader and of `reconcile validate`.

Whatever bytes a desired-state file holds — random structures, wrong types,
huge numbers, unicode and control characters, shell/iptables metacharacters
in names, mutations of valid files, random bytes, alias bombs, deep nesting,
huge files — loading it either succeeds or raises one ``ConfigError`` whose
every line names the file; `validate` exits 1 with no traceback; and no case
takes longer than a bound. The number of cases is printed (``[figures]``);
``RECONCILER_SOAK=1`` runs ten times as many.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.cli import commands as cli
from reconciler.config.load import load
from reconciler.config.paths import MAX_FILE_BYTES
from reconciler.domain.errors import ConfigError
from tests.support.figures import SOAK, report
from tests.support.host import EXAMPLES

SCALE = 10 if SOAK else 1
CASE_SECONDS = 10.0  # per case; the slowest legitimate refusal (a huge file) takes ~2 s
META = "&*!|>%@`{}[]:#-?,'\"\n\t\r\\$;<()~ \x00\x1b\u2028\x85é"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
KEYS = ["version", "bridges", "subnets", "allocs", "docker_networks", "settings", "hosts", "name",
        "bridge", "cidr", "cidr6", "gateway", "range", "id", "subnet", "address", "ports", "host",
        "to", "protocol", "host_ip", "mtu", "hairpin", "labels", "ipv6", "pool", "size", "pool6",
        "size6", "<<"]
VALID = """\
version: 1
bridges:
  - name: nomad
    mtu: 1500
    hairpin: true
subnets:
  - name: nomad-net
    bridge: nomad
    cidr: 172.26.64.0/20
    cidr6: fd00:a:b::/64
    range: {start: 172.26.64.10, end: 172.26.79.250}
allocs:
  - id: web-1
    subnet: nomad-net
    address: 172.26.64.10
    ports:
      - {host: 8080, to: 80}
      - {host: auto, to: 9000, protocol: both, host_ip: 127.0.0.1}
docker_networks:
  - name: kind
    ipv6: true
    labels: {team: infra}
"""


class Hang(BaseException):
    """A case ran too long (a BaseException: `except Exception` in the CLI must not eat it)."""


@contextlib.contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Fail the case (instead of hanging the suite) if it runs longer than ``seconds``."""
    def fire(_sig: int, _frame: object) -> None:
        raise Hang(f"case took longer than {seconds}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Fuzz:
    """Runs cases against the loader and the CLI, counting outcomes."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="rt-fuzz-")
        self.path = os.path.join(self.dir, "state.yaml")
        self.counts: Counter[str] = Counter()
        self.slowest = 0.0

    def case(self, data: bytes | str, *, must_fail: bool = False,
             seconds: float = CASE_SECONDS) -> None:
        with open(self.path, "wb") as fh:
            fh.write(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
        t0 = time.monotonic()
        with time_bound(seconds):
            try:
                load([self.path], hostname="h")
                accepted = True
            except ConfigError as exc:
                accepted = False
                lines = str(exc).splitlines()
                assert lines and all(ln.startswith(self.path) for ln in lines), str(exc)
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli.main(["validate", self.path])
        self.slowest = max(self.slowest, time.monotonic() - t0)
        text = out.getvalue() + err.getvalue()
        # the CLI's own wording starts a line; the input itself may be echoed in a message
        assert "Traceback" not in text and not any(
            ln.startswith("internal error:") for ln in text.splitlines()), text
        assert rc == (0 if accepted else 1), text
        if not accepted:
            assert all(ln.startswith(f"error: {self.path}") for ln in err.getvalue().splitlines()
                       if ln), text
        assert not (must_fail and accepted), data
        self.counts["accepted" if accepted else "rejected"] += 1


@pytest.fixture
def fuzz(request: pytest.FixtureRequest) -> Iterator[Fuzz]:
    f = Fuzz()
    yield f
    total = sum(f.counts.values())
    report(request, f"{total} cases: {f.counts['rejected']} rejected cleanly, "
                    f"{f.counts['accepted']} accepted, 0 tracebacks, 0 hangs; "
                    f"slowest {f.slowest:.2f}s")


def run(prop: Callable[..., None], n: int, *strategies: st.SearchStrategy[Any]) -> None:
    settings(max_examples=n * SCALE, deadline=None, derandomize=not SOAK, database=None,
             suppress_health_check=list(HealthCheck))(given(*strategies)(prop))()


# ----------------------------------------------------------------- strategies

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10**18)
           | st.floats() | st.text(max_size=40) | st.sampled_from(
               ["auto", "tcp", "both", "1.2.3.4", "10.0.0.0/8", "fd00::/64", "1e309", "0x10",
                "-1", "65536", "yes", "~", "null", "!!binary AAAA", "nomad", "a" * 300]))
keys = st.sampled_from(KEYS) | st.text(max_size=12)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(keys, inner, max_size=4), max_leaves=20)
documents = st.dictionaries(keys, values, max_size=6).map(
    lambda d: {"version": 1, **d} if "v" in str(sorted(map(str, d))) else d)


@st.composite
def mutations(draw: st.DrawFn) -> str:
    seeds = [VALID]
    for f in sorted(os.listdir(EXAMPLES)):
        if f.endswith(".yaml"):
            with open(os.path.join(EXAMPLES, f)) as fh:
                seeds.append(fh.read())
    text = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(1, 5))):
        if not text:
            break
        i = draw(st.integers(0, len(text) - 1))
        j = min(len(text), i + draw(st.integers(1, 20)))
        op = draw(st.sampled_from(["insert", "delete", "replace", "dupline", "swap", "meta"]))
        lines = text.splitlines(keepends=True)
        if op == "insert":
            text = text[:i] + draw(st.text(max_size=10)) + text[i:]
        elif op == "delete":
            text = text[:i] + text[j:]
        elif op == "replace":
            text = text[:i] + draw(st.text(min_size=1, max_size=3)) + text[i + 1:]
        elif op == "meta":
            text = text[:i] + "".join(draw(st.lists(st.sampled_from(list(META)), min_size=1,
                                                        max_size=4))) + text[i:]
        elif op == "dupline" and lines:
            k = draw(st.integers(0, len(lines) - 1))
            text = "".join(lines[:k + 1] + [lines[k]] + lines[k + 1:])
        elif op == "swap" and len(lines) > 1:
            a, b = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[a], lines[b] = lines[b], lines[a]
            text = "".join(lines)
    return text


nasty_names = (st.tuples(st.lists(st.sampled_from(list(META)), min_size=1, max_size=6).map("".join),
                          st.integers(0, 3)).map(
    lambda t: [t[0], "ok" + t[0], t[0] + "ok", "o" + t[0] + "k"][t[1]])
    | st.text(max_size=80).map(lambda s: "n" * 64 + s)
    | st.just("-j") | st.just("")).filter(
        lambda n: n in ("-j", "") or len(n) > 63 or any(c not in NAME_CHARS for c in n))


# ----------------------------------------------------------------- cases


def test_random_structures(fuzz: Fuzz):
    def prop(doc: dict[str, Any], flow: bool, unicode: bool) -> None:
        fuzz.case(yaml.safe_dump(doc, default_flow_style=flow, allow_unicode=unicode))

    run(prop, 400, documents, st.booleans(), st.booleans())


def test_mutations_of_valid_files(fuzz: Fuzz):
    def prop(text: str) -> None:
        fuzz.case(text)

    run(prop, 600, mutations())


def test_random_bytes(fuzz: Fuzz):
    def prop(data: bytes) -> None:
        fuzz.case(data)

    run(prop, 200, st.binary(max_size=2000)
        | st.binary(max_size=500).map(lambda b: b"version: 1\nbridges:\n  - name: " + b))


def test_adversarial_names_are_always_refused(fuzz: Fuzz):
    """A metacharacter, newline, control or over-long name in any identity field: refused."""
    fields = [("bridges", 0, "name"), ("subnets", 0, "name"), ("subnets", 0, "bridge"),
              ("allocs", 0, "id"), ("allocs", 0, "subnet"), ("docker_networks", 0, "name")]

    def prop(where: tuple[str, int, str], name: str, quote: bool) -> None:
        doc = yaml.safe_load(VALID)
        doc[where[0]][where[1]][where[2]] = name
        # JSON is YAML: its \\uXXXX escapes carry any character into the value
        fuzz.case(json.dumps(doc) if quote else yaml.safe_dump(doc), must_fail=True)

    run(prop, 300, st.sampled_from(fields), nasty_names, st.booleans())


def _bomb(levels: int, width: int) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "version: 1\n" + "\n".join(lines) + "\n"


HUGE = [
    ("alias bomb", _bomb(10, 10)),
    ("merge-key bomb", "version: 1\nb: &b {x: 1}\n" + "".join(
        f"b{i}: &b{i} {{<<: [*b{'' if i == 0 else i - 1}], y{i}: 1}}\n" for i in range(200))),
    ("recursive alias", "version: 1\nbridges: &a [*a]\n"),
    ("deep flow nesting", "version: 1\nbridges: " + "[" * 50_000 + "]" * 50_000 + "\n"),
    ("deep block nesting", "version: 1\nx:\n" + "".join(" " * i + "- \n" for i in range(3000))),
    ("deep mapping nesting", "version: 1\nx: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n"),
    ("many small items", "version: 1\nbridges:\n" + "  - {name: b}\n" * 500_000),
    ("many keys", "version: 1\n" + "".join(f"k{i}: 1\n" for i in range(400_000))),
    ("over the size limit", "version: 1\n#" + "x" * MAX_FILE_BYTES + "\n"),
    ("one huge scalar", "version: 1\nbridges:\n  - name: " + "a" * (MAX_FILE_BYTES - 40) + "\n"),
    ("huge integer", "version: 1\nbridges:\n  - {name: b, mtu: " + "9" * 5000 + "}\n"),
    ("huge float", "version: 1\nbridges:\n  - {name: b, mtu: 1e309}\n"),
    ("nan mtu", "version: 1\nbridges:\n  - {name: b, mtu: .nan}\n"),
    ("python tag", "version: 1\nbridges: !!python/object/apply:os.system ['true']\n"),
    ("binary tag", "version: 1\nbridges:\n  - name: !!binary aGVsbG8=\n"),
    ("timestamp", "version: 1\nbridges:\n  - name: 2001-12-14t21:59:43.10-05:00\n"),
    ("two documents", "version: 1\n---\nversion: 1\n"),
    ("BOM and NUL", "\ufeffversion: 1\nbridges:\n  - name: \"b\\0\"\n"),
    ("invalid UTF-8", b"version: 1\nbridges:\n  - name: \xff\xfe\n"),
    ("empty", ""),
    ("only a comment", "# nothing\n"),
    ("a scalar", "42\n"),
    ("a list", "- version: 1\n"),
    ("non-string key", "version: 1\n? [a, b]\n: 1\n"),
    ("null key", "version: 1\n~: 1\n"),
    ("duplicate key", "version: 1\nversion: 1\n"),
    ("port out of range", "version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, "
                          "cidr: 10.0.0.0/24}]\nallocs: [{id: a, subnet: s, ports: "
                          "[{host: 99999999999999999999999, to: 0}]}]\n"),
    ("cidr with newline", "version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, "
                          "cidr: \"10.0.0.0/24\\n\"}]\n"),
    ("label value with control", "version: 1\ndocker_networks: [{name: d, labels: "
                                 "{a: \"x\\u001b[31m\"}}]\n"),
]


def test_adversarial_files(fuzz: Fuzz):
    cases = list(HUGE)
    if SOAK:  # the costliest refusal: just under the parser pre-check, stopped by the builder
        cases.append(("just under the node pre-check", "version: 1\nbridges:\n"
                      + "  - {name: b}\n" * 130_000))
    for what, text in cases:
        try:
            fuzz.case(text, must_fail=True, seconds=60.0 if what.startswith("just") else 30.0)
        except (AssertionError, Hang) as exc:
            raise AssertionError(f"{what}: {exc}") from None
