"""Nothing a config file says can inject into iptables-restore input or command arguments.

The property test generates desired-state files — clean ones and ones with
shell/iptables metacharacters, newlines, quotes and unicode in every string —
and for every file the loader accepts checks each op the planner produces:
every restore-script line has the expected structure and only safe tokens,
every namespace name, sysctl key and link name is one path component of
safe characters. ``_SAFE_TOKEN`` itself is checked against an independent
definition, so anchoring tricks (``$`` matching before a final newline)
cannot bypass it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tempfile
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.config.load import load
from reconciler.domain.errors import ConfigError, DriverError
from reconciler.domain.live import LiveChainSet, LiveDocker, LiveState
from reconciler.domain.model import Bridge, BridgeName, DesiredState, Subnet, SubnetName
from reconciler.domain.nftable import TableState
from reconciler.domain.ops import (
    AllocAttach,
    AllocConfigure,
    FirewallNft,
    NetnsCreate,
    NetnsDelete,
    SysctlSet,
    decode,
)
from reconciler.drivers import netns, sysctl
from reconciler.planner import PlanOptions, make_plan
from reconciler.planner.firewall import _SAFE_TOKEN, RuleSet
from tests.support.figures import SOAK, report

SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:/=!,+[]-")
NASTY = [
    "a\n", "a\n-A INPUT -j ACCEPT", "b0 -j ACCEPT", "x;rm -rf /", "$(reboot)", "`id`", "a|b",
    "a&b", "a>b", "\"q\"", "'q'", "a#b", "-j", "--comment", "*filter", "COMMIT", "a\rb",
    "a\tb", "a\x00b", "a\x0bb", "a\x85b", "a\u2028b", "é", "\u202eevil", "a b", "..", "a/b",
    "a\\nb", "%s%n", "{a}", "a\n\n", "\n", " ", "",
]
RESTORE_LINE = re.compile(
    r"\*(filter|nat|mangle)|COMMIT|:RECONCILER-[A-Z]+ - \[0:0\]"
    r"|-A RECONCILER-[A-Z]+( \S+)+"
    r"|-I (FORWARD|INPUT|POSTROUTING|PREROUTING|OUTPUT) 1( \S+)+"
    r"|-D (FORWARD|INPUT|POSTROUTING|PREROUTING|OUTPUT)( \S+)+"
    r"|-[FX] RECONCILER-[A-Z]+")
TARGETS = re.compile(r"ACCEPT|DROP|RETURN|MARK|MASQUERADE|DNAT|RECONCILER-[A-Z]+")
LINK_NAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")
EXAMPLES = 3000 if SOAK else 300


def safe_token(t: str) -> bool:
    """The definition _SAFE_TOKEN must implement, written without a regex."""
    return bool(t) and all(ch in SAFE_CHARS for ch in t)


# ----------------------------------------------------------------- the guard itself


@pytest.mark.parametrize("token", [n for n in NASTY if not safe_token(n)])
def test_nasty_tokens_are_refused(token: str):
    with pytest.raises(ValueError, match="unsafe iptables token"):
        RuleSet(4).add("RECONCILER-FORWARD", ("-o", token, "-j", "ACCEPT"))


@settings(max_examples=EXAMPLES * 3, deadline=None)
@given(st.text(min_size=0, max_size=12)
       | st.text(alphabet=sorted(SAFE_CHARS), min_size=1, max_size=8).map(lambda s: s + "\n"))
def test_safe_token_guard_matches_its_definition(token: str):
    rs = RuleSet(4)
    if safe_token(token):
        rs.add("RECONCILER-FORWARD", (token,))
        assert rs.chains["RECONCILER-FORWARD"] == [token]
    else:
        with pytest.raises(ValueError):
            rs.add("RECONCILER-FORWARD", (token,))
    assert bool(_SAFE_TOKEN.fullmatch(token)) == safe_token(token)


def test_a_desired_state_that_skipped_the_loader_still_cannot_inject():
    """Defence in depth: the planner refuses to write a restore line from a bad name."""
    net = ipaddress.IPv4Network("10.9.0.0/24")
    evil = "br0\n-A INPUT -j ACCEPT"
    desired = DesiredState(
        bridges={BridgeName(evil): Bridge(BridgeName(evil), None)},
        subnets={SubnetName("n"): Subnet(SubnetName("n"), BridgeName(evil), net,
                                         net.network_address + 1, None, None, None, True)})
    with pytest.raises(ValueError, match="unsafe iptables token"):
        make_plan(desired, LiveState(firewall4=LiveChainSet(True), firewall6=LiveChainSet(True)))


@pytest.mark.parametrize("name", ["x\n", "x\n/y", "../x", "x y", "x;y", ""])
def test_namespace_names_and_sysctl_keys_are_checked_whole(name: str):
    with pytest.raises(DriverError):
        netns.check_name(name)
    with pytest.raises(DriverError):
        sysctl._path(f"net/ipv4/conf/{name}")


# ----------------------------------------------------------------- files -> plans


def names() -> st.SearchStrategy[str]:
    return st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    nb = draw(st.integers(1, 3))
    doc: dict[str, Any] = {"version": 1, "bridges": [], "subnets": [], "allocs": []}
    for i in range(nb):
        b: dict[str, Any] = {"name": f"b{i}{draw(names())}"[:15]}
        if draw(st.booleans()):
            b["mtu"] = draw(st.integers(68, 9000))
        if draw(st.booleans()):
            b["hairpin"] = draw(st.booleans())
        doc["bridges"].append(b)
        s: dict[str, Any] = {"name": f"s{i}{draw(names())}", "bridge": b["name"],
                             "cidr": f"10.{i}.0.0/24", "masquerade": draw(st.booleans())}
        if draw(st.booleans()):
            s["cidr6"] = f"fd00:{i}::/64"
        doc["subnets"].append(s)
        for j in range(draw(st.integers(0, 3))):
            ports = [{"host": draw(st.sampled_from(["auto", 1000 + 10 * i + j])),
                      "to": draw(st.integers(1, 65535)),
                      "protocol": draw(st.sampled_from(["tcp", "udp", "both"]))}]
            if draw(st.booleans()):
                ports[0]["host_ip"] = draw(st.sampled_from(["127.0.0.1", "::1", "10.99.0.1"]))
            doc["allocs"].append({"id": f"a{i}-{j}{draw(names())}", "subnet": s["name"],
                                  "ports": ports})
    if draw(st.booleans()):
        doc["docker_networks"] = [{"name": f"d{draw(names())}", "labels": {"team": "x"}}]
    if draw(st.booleans()):  # poison one string anywhere in the document
        strings = _string_paths(doc)
        path = draw(st.sampled_from(strings))
        nasty = draw(st.sampled_from(NASTY) | st.text(max_size=20)
                     | st.sampled_from(NASTY).map(lambda n: "ok" + n))
        _set(doc, path, nasty)
    return doc


def _string_paths(data: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in _string_paths(v, (*path, k))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in _string_paths(v, (*path, i))]
    return [path] if isinstance(data, str) else []


def _set(data: Any, path: tuple[Any, ...], value: str) -> None:
    for p in path[:-1]:
        data = data[p]
    data[path[-1]] = value


STALE = LiveChainSet(True, {
    ("filter", "FORWARD"): ("-m comment --comment reconciler -j RECONCILER-FORWARD",),
    ("filter", "RECONCILER-FORWARD"): ("-d 10.250.0.0/24 -o old -m comment --comment "
                                       "reconciler:subnet=old -j ACCEPT",),
    ("nat", "RECONCILER-OLD"): ()})


def check_ops(desired: DesiredState, live: LiveState) -> int:
    """Every op of the plan is safe; returns the number of restore lines checked."""
    declared = {f"{k}={n}" for k, names_ in (("subnet", desired.subnets), ("alloc", desired.allocs),
                                             ("bridge", desired.bridges))
                for n in names_}
    lines = 0
    plan = make_plan(desired, live, PlanOptions())
    for change in plan.changes:
        for op in change.ops:
            a = op.args
            typed = decode(op)
            if isinstance(typed, FirewallNft):
                add, delete = typed.entries()  # each checked: values of their types only
                lines += len(add) + len(delete)
                assert all(e.owner in declared | {"subnet=old"} for e in add + delete)
                for line in (typed.cleanup4 + typed.cleanup6).splitlines():
                    lines += 1
                    assert RESTORE_LINE.fullmatch(line), line
                    toks = line.split(" ")
                    assert all(safe_token(t) for t in toks[1:]), line
                    if line.startswith(("-A", "-I", "-D")):
                        assert toks.count("-j") == 1 and TARGETS.fullmatch(
                            toks[toks.index("-j") + 1]), line
                        comments = [toks[i + 1] for i, t in enumerate(toks) if t == "--comment"]
                        assert len(comments) == 1, line
                        owner = comments[0].partition(":")[2]
                        assert comments[0] == "reconciler" or owner in declared | {
                            "subnet=old"}, line
            elif isinstance(typed, SysctlSet):
                sysctl._path(typed.key)  # raises unless one safe net/... path
                assert re.fullmatch(r"[01]", typed.value)
            elif isinstance(typed, NetnsCreate | NetnsDelete):
                netns.check_name(typed.name)
            elif isinstance(typed, AllocAttach | AllocConfigure):
                netns.check_name(typed.netns)
            for key in ("name", "link", "veth", "bridge", "master"):
                if isinstance(a.get(key), str) and not op.name.startswith(("docker.", "netns.")):
                    assert LINK_NAME.fullmatch(a[key]), (op.name, a)
    return lines


def test_no_accepted_file_can_inject(request: pytest.FixtureRequest):
    counts: Counter[str] = Counter()
    tmpdir = tempfile.mkdtemp(prefix="rt-sec-")
    path = os.path.join(tmpdir, "state.yaml")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(documents())
    def prop(doc: dict[str, Any]) -> None:
        with open(path, "w") as fh:
            json.dump(doc, fh)  # JSON is YAML; \uXXXX escapes carry any character through
        try:
            desired = load([path], hostname="h")
        except ConfigError as exc:
            counts["rejected"] += 1
            assert str(exc).startswith(path)
            return
        counts["accepted"] += 1
        docker = LiveDocker(available=True, default_mtu=1500)
        for fw in (LiveChainSet(True), STALE):
            counts["lines"] += check_ops(desired, LiveState(
                host_id="1", table=TableState(), old4=fw, old6=fw, docker=docker))

    prop()
    report(request, f"{sum(counts.values()) - counts['lines']} generated files: "
                    f"{counts['accepted']} accepted and planned, {counts['rejected']} rejected; "
                    f"{counts['lines']} table entries and restore lines checked, 0 unsafe")
    assert counts["accepted"] >= EXAMPLES // 5 and counts["rejected"] >= EXAMPLES // 10
