"""The breakage suite (SPEC §7): after a good apply in a sandbox, break the dataplane one
way at a time and check that `reconcile verify` fails (exit 1) and names the cause.

Each breakage is what an operator or another tool does to a host in real life —
forwarding turned off, a foreign DROP rule, strict rp_filter on an asymmetric
route, br_netfilter exposing a bridge-port rule, a route gone, route_localnet
off, hairpin off, a stale neighbour entry, an MTU black hole — injected with the
ordinary tools (`sysctl` through /proc, `iptables`, `nft`, `ip`) inside the sandbox,
and restored exactly before the next (the test checks `verify` holds again).
For each it also records whether `reconcile plan` alone (the config comparison)
shows anything, and for the causes the config does not cover asserts that plan
exits 0 with no changes: those are what the probes are for.

br_netfilter is built into this kernel; its ``bridge-nf-call-iptables`` is per
network namespace here (a new namespace starts at 1; writing it in the sandbox
leaves the machine's value alone, which the test checks) and is restored to the
sandbox's exact value.

Traffic goes only to addresses inside namespaces the test made (the sandbox, the
allocation, the client that gives the sandbox its host address, the vantage
namespace the probes make).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from reconciler.domain.ownership import alloc_veth_name
from reconciler.domain.probes import VANTAGE_PEER
from tests.support.figures import report
from tests.support.host import Netns, unique, write
from tests.support.traffic import client_of

pytestmark = pytest.mark.root

BRIDGE = "rbrk0"
CIDR, GATEWAY = "10.214.0.0/24", "10.214.0.1"
TCP_HOST, TCP_TO = 18080, 80
UDP_HOST, UDP_TO = 18053, 53
WRONG_MAC = "02:00:5e:00:de:ad"


@dataclass
class Sandbox:
    host: Netns
    alloc: str
    alloc_ip: str
    veth: str
    cfg: str

    def sh(self, *args: str) -> str:
        return self.host.run(*args).stdout

    def sysctl(self, key: str, value: str | None = None, ns: Netns | None = None) -> str:
        """Read (and with ``value`` write) /proc/sys/KEY in the sandbox (or ``ns``)."""
        path = "/proc/sys/" + key.replace(".", "/")
        where = ns or self.host
        old = where.run("cat", path).stdout.strip()
        if value is not None:
            where.run("sh", "-c", f"echo {value} > {path}")
        return old


Restore = Callable[[], None]


def _sysctl(key: str, value: str) -> Callable[[Sandbox], Restore]:
    def inject(box: Sandbox) -> Restore:
        k = key.format(bridge=BRIDGE, veth=box.veth)
        old = box.sysctl(k, value)

        def restore() -> None:
            box.sysctl(k, old)
        return restore
    return inject


def _run(box: Sandbox, *args: str) -> Restore:
    """A restore that runs one command in the sandbox."""
    def restore() -> None:
        box.sh(*args)
    return restore


def _rule(*rule: str) -> Callable[[Sandbox], Restore]:
    """``iptables [-t T] -I CHAIN ...`` now, the same rule ``-D`` after."""
    def inject(box: Sandbox) -> Restore:
        args = [a.format(ip=box.alloc_ip, port=TCP_HOST) for a in rule]
        table = args[:2] if args[0] == "-t" else []
        rest = args[len(table):]
        chain, spec = rest[0], rest[1:]
        box.sh("iptables", *table, "-I", chain, "1", *spec)
        return _run(box, "iptables", *table, "-D", chain, *spec)
    return inject


def _forwarding_off(box: Sandbox) -> Restore:
    return _sysctl("net.ipv4.ip_forward", "0")(box)


def _nft_table_drop(box: Sandbox) -> Restore:
    """Another manager's own nftables table (not iptables-nft's) dropping what is forwarded to
    the allocation: iptables-save never shows it."""
    box.sh("nft", "add", "table", "inet", "rbrkx")
    box.sh("nft", "add", "chain", "inet", "rbrkx", "brkfw",  # "fwd" is an nft keyword
           "{ type filter hook forward priority 0; policy accept; }")
    box.sh("nft", "add", "rule", "inet", "rbrkx", "brkfw", "ip", "daddr", box.alloc_ip, "drop")
    return _run(box, "nft", "delete", "table", "inet", "rbrkx")


def _our_table_edited(box: Sandbox) -> Restore:
    """A rule added by hand to our own table's isolation chain, dropping what is forwarded to
    the allocation: its rules carry no counters, and no other manager's table drops it."""
    out = box.sh("nft", "--echo", "--handle", "insert", "rule", "inet", "reconciler", "isolate",
                 "ip", "daddr", box.alloc_ip, "drop")
    m = re.search(r"# handle (\d+)", out)
    assert m is not None, out
    return _run(box, "nft", "delete", "rule", "inet", "reconciler", "isolate", "handle",
                m.group(1))


RP_TABLE = RP_MARK = 7714


def _asymmetric_route(box: Sandbox) -> Restore:
    """Policy routing that sends the way back to the external vantage's address out another
    link of the sandbox — except for what the allocations send (marked as it enters from the
    bridge), so their answers still take the vantage's link. The reverse-path check looks the
    way back up unmarked (``src_valid_mark`` is 0), so under strict rp_filter what arrives from
    the vantage fails it; without rp_filter this alone changes nothing a probe sees."""
    # no dummy driver in this kernel: a veth pair, both ends in the sandbox, is the other link
    away, peer = f"rbrk{unique()[-6:]}a", f"rbrk{unique()[-6:]}b"
    box.sh("ip", "link", "add", away, "type", "veth", "peer", "name", peer)
    box.sh("ip", "link", "set", away, "up")
    box.sh("ip", "link", "set", peer, "up")
    box.sh("ip", "route", "add", f"{VANTAGE_PEER}/32", "dev", away, "table", str(RP_TABLE))
    rule = ("not", "fwmark", hex(RP_MARK), "to", f"{VANTAGE_PEER}/32", "lookup", str(RP_TABLE),
            "priority", "100")
    box.sh("ip", "rule", "add", *rule)
    undo_mark = _rule("-t", "mangle", "PREROUTING", "-i", BRIDGE, "-j", "MARK", "--set-mark",
                      hex(RP_MARK))(box)

    def restore() -> None:
        undo_mark()
        box.sh("ip", "rule", "del", *rule)
        box.sh("ip", "link", "del", away)  # its peer and the table's route go with it
    return restore


def _rp_filter(box: Sandbox) -> Restore:
    """Strict rp_filter (all and default: a link's effective value is the larger of its own
    and all's) on the asymmetric route, which alone drops nothing (the control)."""
    undo_route = _asymmetric_route(box)
    old_all = box.sysctl("net.ipv4.conf.all.rp_filter", "1")
    old_default = box.sysctl("net.ipv4.conf.default.rp_filter", "1")

    def restore() -> None:
        box.sysctl("net.ipv4.conf.all.rp_filter", old_all)
        box.sysctl("net.ipv4.conf.default.rp_filter", old_default)
        undo_route()
    return restore


def _physdev_rule(value: str) -> Callable[[Sandbox], Restore]:
    """bridge-nf-call-iptables at ``value`` and a foreign rule only bridge-port traffic
    matches: at 0 the rule never sees a packet of a bridge port (physdev knows none; the
    control), at 1 it drops what enters FORWARD from a bridge port (the hairpin path)."""
    def inject(box: Sandbox) -> Restore:
        key = "net.bridge.bridge-nf-call-iptables"
        machine = _machine_brnf()
        old = box.sysctl(key, value)
        # in a chain of its own that FORWARD jumps to: a DROP in FORWARD itself gets the
        # mark shim ahead of it (planner.shim), and the control would see that as drift
        box.sh("iptables", "-N", "RBRKPHYS")
        box.sh("iptables", "-A", "RBRKPHYS", "-m", "physdev", "--physdev-is-in", "-j", "DROP")
        undo_jump = _rule("FORWARD", "-j", "RBRKPHYS")(box)

        def undo_rule() -> None:
            undo_jump()
            box.sh("iptables", "-F", "RBRKPHYS")
            box.sh("iptables", "-X", "RBRKPHYS")

        def restore() -> None:
            undo_rule()
            box.sysctl(key, old)
            # per network namespace on this kernel: the machine's own value never moved
            assert _machine_brnf() == machine
        return restore
    return inject


def _machine_brnf() -> str:
    """bridge-nf-call-iptables of the namespace the test runs in (the machine's)."""
    with open("/proc/sys/net/bridge/bridge-nf-call-iptables") as fh:
        return fh.read().strip()


def _route_gone(box: Sandbox) -> Restore:
    box.sh("ip", "route", "del", CIDR, "dev", BRIDGE)
    return _run(box, "ip", "route", "add", CIDR, "dev", BRIDGE, "proto", "kernel", "scope",
                "link", "src", GATEWAY)


def _hairpin_off(box: Sandbox) -> Restore:
    box.sh("ip", "link", "set", box.veth, "type", "bridge_slave", "hairpin", "off")
    return _run(box, "ip", "link", "set", box.veth, "type", "bridge_slave", "hairpin", "on")


def _stale_neighbour(box: Sandbox) -> Restore:
    """The bridge's neighbour entry for the allocation names a MAC that is not its eth0's
    (a veth re-created with a new MAC, an entry pinned by someone)."""
    box.sh("ip", "neigh", "replace", box.alloc_ip, "lladdr", WRONG_MAC, "dev", BRIDGE,
           "nud", "permanent")
    return _run(box, "ip", "neigh", "del", box.alloc_ip, "dev", BRIDGE)


def _mtu_black_hole(box: Sandbox) -> Restore:
    """The host end of the allocation's veth takes 1280 while eth0 sends 1500: what is larger
    is dropped on the way in, silently (no ICMP: the veth drops it); small packets pass."""
    old = json.loads(box.sh("ip", "-j", "link", "show", "dev", box.veth))[0]["mtu"]
    box.sh("ip", "link", "set", box.veth, "mtu", "1280")
    return _run(box, "ip", "link", "set", box.veth, "mtu", str(old))


@dataclass(frozen=True)
class Breakage:
    name: str
    inject: Callable[[Sandbox], Restore]
    #: what verify must say (a failed probe's cause matches it)
    cause: str
    #: the config comparison sees it too (plan shows a change) — recorded; when False, plan
    #: must show nothing: only the probes can tell
    config_covers: bool
    #: the harmless half of a two-part breakage: verify must still hold under it alone, so
    #: the named cause is the one that bites
    control: Callable[[Sandbox], Restore] | None = None


BREAKAGES = [
    Breakage("forwarding off", _forwarding_off, r"forwarding", True),
    # the plan shows the mark shim it needs in front of it (declared traffic then passes)
    Breakage("foreign DROP in FORWARD", _rule("FORWARD", "-d", "{ip}", "-j", "DROP"),
             r"DROP.*FORWARD|FORWARD.*DROP", True),
    Breakage("foreign DROP in raw PREROUTING",
             _rule("-t", "raw", "PREROUTING", "-p", "tcp", "--dport", "{port}", "-j", "DROP"),
             r"raw", False),
    Breakage("strict rp_filter", _rp_filter, r"rp_filter", False, _asymmetric_route),
    Breakage("bridge-nf-call-iptables with a physdev rule", _physdev_rule("1"),
             r"bridge-nf-call-iptables", False, _physdev_rule("0")),
    Breakage("missing route", _route_gone, r"route", False),
    Breakage("route_localnet off", _sysctl("net.ipv4.conf.{bridge}.route_localnet", "0"),
             r"route_localnet", True),
    Breakage("hairpin off", _hairpin_off, r"hairpin", True),
    Breakage("stale neighbour", _stale_neighbour, r"neighbou?r", False),
    Breakage("MTU black hole", _mtu_black_hole, r"MTU", False),
    # issue 26: verify failed but could not say why
    Breakage("forwarding off on the bridge alone",
             _sysctl("net.ipv4.conf.{bridge}.forwarding", "0"), r"forwarding is off on", False),
    Breakage("a foreign DNAT of the mapped host port",
             _rule("-t", "nat", "PREROUTING", "-p", "tcp", "--dport", "{port}", "-j", "DNAT",
                   "--to-destination", "192.0.2.1:9"), r"sends it elsewhere: nat/PREROUTING",
             False),
    Breakage("a drop in another manager's nftables table", _nft_table_drop,
             r"nftables inet rbrkx/brkfw \(hook forward\): ip daddr \S+ drop", False),
    # issue 26 item 8: the plan rebuilds the table; the probes name it and its chain
    Breakage("a drop added to our own table by hand", _our_table_edited,
             r"our table inet reconciler is not as built \(chain isolate", True),
]


@pytest.fixture
def applied(host_ns: Netns, tmp_path: Any) -> Iterator[Sandbox]:
    """A good apply: one allocation with a TCP and a UDP map; the sandbox has a host address
    (a client's link) so the host and hairpin paths exist; the external vantage is on (the
    sandbox default)."""
    alloc = unique("b")
    cfg = write(tmp_path, "b.yaml", f"""version: 1
bridges: [{{name: {BRIDGE}}}]
subnets: [{{name: brk, bridge: {BRIDGE}, cidr: {CIDR}}}]
allocs:
  - id: {alloc}
    subnet: brk
    ports: [{{host: {TCP_HOST}, to: {TCP_TO}}}, {{host: {UDP_HOST}, to: {UDP_TO}, protocol: udp}}]
""")
    with client_of(host_ns):
        r = host_ns.reconcile("apply", cfg)
        assert r.rc == 0, r.all
        addrs = Netns(alloc).addrs("eth0")
        assert addrs, "the allocation has no address"
        yield Sandbox(host_ns, alloc, addrs[0].split("/")[0], alloc_veth_name(alloc), cfg)


def _verify(box: Sandbox) -> tuple[int, dict[str, Any], str]:
    r = box.host.reconcile("verify", box.cfg, "--output", "json")
    try:
        doc = json.loads(r.out)
    except ValueError:
        raise AssertionError(f"verify printed no JSON (rc {r.rc}):\n{r.all}") from None
    return r.rc, doc, r.err


def _plan(box: Sandbox) -> tuple[int, list[str]]:
    r = box.host.reconcile("plan", box.cfg, "--no-agent", "--output", "json")
    assert r.rc in (0, 2), r.all
    return r.rc, [f"{c['kind']}/{c['name']}" for c in json.loads(r.out)["changes"]]


def test_every_injected_breakage_is_named(applied: Sandbox, request: pytest.FixtureRequest):
    rc, doc, err = _verify(applied)
    assert rc == 0 and doc["ok"], f"the good apply does not verify: {doc} {err}"
    paths = {p["path"] for p in doc["probes"] if not p["skipped"]}
    assert {"gateway", "host", "localhost", "hairpin", "external"} <= paths, doc["probes"]
    rows, problems, named = [], [], 0
    for b in BREAKAGES:
        if b.control is not None:
            undo = b.control(applied)
            try:
                control_rc, control_doc, _ = _verify(applied)
            finally:
                undo()
            if control_rc != 0:
                problems.append(f"{b.name}: its harmless half alone fails verify: "
                                f"{[p for p in control_doc['probes'] if not p['ok']]}")
        try:
            restore = b.inject(applied)
        except Exception as exc:  # counted as not named: the figure says so, the test fails
            rows.append(f"{b.name}: could not be injected: {type(exc).__name__}: {exc}")
            continue
        try:
            rc, doc, err = _verify(applied)
            plan_rc, changes = _plan(applied)
        finally:
            restore()
        failed = [p for p in doc["probes"] if not p["ok"] and not p["skipped"]]
        causes = [p["cause"] or "" for p in failed]
        is_named = rc == 1 and any(re.search(b.cause, c, re.IGNORECASE) for c in causes)
        named += is_named
        seen = "; ".join(sorted({f"{p['path']} {p['proto']}: {p['cause']}" for p in failed}))
        rows.append(f"{b.name}: verify rc {rc}, {'named' if is_named else 'NOT named'} "
                    f"({seen or 'no probe failed'}{'; ' + err.strip() if err.strip() else ''}); "
                    f"plan rc {plan_rc}{' ' + ', '.join(changes) if changes else ' (no changes)'}")
        if not b.config_covers and (plan_rc != 0 or changes):
            problems.append(f"{b.name}: the config does not cover it, yet plan shows {changes}")
        after, doc_after, _ = _verify(applied)
        if after != 0:
            problems.append(f"{b.name}: not restored exactly: {doc_after}")
            break  # what follows would measure this breakage, not its own
    for row in rows:
        report(request, row)
    report(request, f"probes: {named}/{len(BREAKAGES)} injected breakages named", named=False)
    assert not problems, "\n".join(problems)
    assert named == len(BREAKAGES), "\n".join(rows)
