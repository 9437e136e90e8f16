"""Clean transitions, pure parts: conntrack entries on the wire, which entries a change of
port maps leaves stale, the bridges whose last ports go, the holders of a namespace in /proc.

The real-kernel side is ``tests/integration/allocs/test_transitions.py``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import struct
from typing import Any

import pytest

from reconciler.domain.live import LiveChainSet, LiveLink
from reconciler.domain.model import (
    Alloc,
    AllocId,
    Bridge,
    BridgeName,
    DesiredState,
    PortMap,
    Settings,
    Subnet,
    SubnetName,
)
from reconciler.domain.ops import (
    ConntrackDelete,
    NetnsDelete,
    OpError,
    StaleMap,
    decode,
    encode,
)
from reconciler.domain.ownership import alloc_veth_name
from reconciler.domain.plan import Action, Op
from reconciler.drivers import netns, procfs
from reconciler.drivers.netlink import conntrack
from reconciler.drivers.netlink.conntrack import Entry, Tuple, parse_entry, stale_for
from reconciler.drivers.netlink.wire import parse_attrs
from reconciler.engine.handles import HostHandles
from reconciler.engine.hostops import HostOps
from reconciler.engine.reconcile import Reconciler
from reconciler.planner import PlanOptions, make_plan
from reconciler.planner import conntrack as stale
from reconciler.planner.firewall import DNAT, RuleSet
from tests.support.fakehost import FakeHost
from tests.support.recorders import Recorder

ip = ipaddress.ip_address

#: a real IPCTNL_MSG_CT_NEW of a dump (kernel 6.18): udp 127.0.0.1:40000 -> 127.0.0.1:5353,
#: DNATed by ``iptables -t nat -A OUTPUT -p udp --dport 5353 -j DNAT --to 127.0.0.2:53``
CAPTURED = bytes.fromhex(
    "a40000000001220001000000c90a0000020000003400018014000180080001007f000001080002007f00"
    "00011c0002800500010011000000060002009c4000000600030014e900003400028014000180080001"
    "007f000002080002007f0000011c00028005000100110000000600020000350000060003009c400000"
    "08000300000001a8080008000000000008000c001915cb7708000b0000000001080007000000001d")


# ------------------------------------------------------------------ the wire


def test_a_captured_entry_parses_to_its_tuples() -> None:
    e = parse_entry(CAPTURED)
    assert e == Entry(4, Tuple(ip("127.0.0.1"), ip("127.0.0.1"), 17, 40000, 5353),
                      Tuple(ip("127.0.0.2"), ip("127.0.0.1"), 17, 53, 40000),
                      zone=0, id=0x1915CB77, status=0x1A8)
    assert conntrack.describe(e) == \
        "udp 127.0.0.1:40000 -> 127.0.0.1:5353 (replies from 127.0.0.2:53)"


def _nla(kind: int, payload: bytes) -> bytes:
    """An attribute written by hand (not with the driver's codec)."""
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n & 3)


def _v6_tuple(src: str, dst: str, sport: int, dport: int) -> bytes:
    addrs = _nla(3, ip(src).packed) + _nla(4, ip(dst).packed)
    ports = _nla(1, b"\x06") + _nla(2, struct.pack("!H", sport)) + _nla(3, struct.pack("!H", dport))
    return _nla(1 | 0x8000, addrs) + _nla(2 | 0x8000, ports)


def test_an_ipv6_entry_in_a_zone_and_its_delete_request() -> None:
    body = (struct.pack("=BBH", 10, 0, 0)
            + _nla(1 | 0x8000, _v6_tuple("fd00::9", "fd00::1", 40000, 80))
            + _nla(2 | 0x8000, _v6_tuple("fd00:77::2", "fd00::9", 8080, 40000))
            + _nla(18, struct.pack("!H", 7)) + _nla(12, struct.pack("!I", 99)))
    raw = struct.pack("=IHHII", 16 + len(body), 0x100, 2, 1, 0) + body
    e = parse_entry(raw)
    assert e is not None and e.family == 6 and e.zone == 7 and e.id == 99
    assert (e.orig.src, e.orig.dport, e.reply.src, e.reply.sport) == (
        ip("fd00::9"), 80, ip("fd00:77::2"), 8080)
    # the delete names the entry by its original tuple, zone and id: parsed back the same
    req = conntrack.delete_request(e) + _nla(2 | 0x8000, _v6_tuple("fd00:77::2", "fd00::9",
                                                                  8080, 40000))
    again = parse_entry(struct.pack("=IHHII", 16 + len(req), 0x102, 5, 1, 0) + req)
    assert again == e


@pytest.mark.parametrize("raw", [b"", CAPTURED[:20], CAPTURED[:16] + b"\x02\0\0\0"])
def test_a_short_or_empty_message_is_no_entry(raw: bytes) -> None:
    assert parse_entry(raw) is None


# ------------------------------------------------------------------ the op


@pytest.mark.parametrize("text", ["udp/5353", "tcp/80@127.0.0.1", "udp/53>10.0.0.2:53",
                                  "udp/53@fd00::1>[fd00::2]:5353"])
def test_stale_map_texts_round_trip(text: str) -> None:
    assert str(StaleMap.parse(text)) == text
    op = ConntrackDelete(6 if ":" in text else 4, (text,))
    assert decode(encode(op)) == op


@pytest.mark.parametrize("maps", [["sctp/80"], ["udp/0"], ["udp/70000"], ["udp/x"],
                                  ["udp/53>10.0.0.2"], ["udp/53@nowhere"]])
def test_a_malformed_map_is_one_op_error(maps: list[str]) -> None:
    with pytest.raises(OpError, match="conntrack.delete: malformed"):
        decode(Op("conntrack.delete", {"family": 4, "maps": maps}))


# ------------------------------------------------------------------ which entries go


def _entry(dst: str, dport: int, reply_src: str, reply_sport: int, proto: int = 17) -> Entry:
    return Entry(4, Tuple(ip("10.98.0.2"), ip(dst), proto, 40000, dport),
                 Tuple(ip(reply_src), ip("10.98.0.2"), proto, reply_sport, 40000), 0, 1, 0)


LOCAL = frozenset({ip("10.98.0.1"), ip("192.0.2.1")})


@pytest.mark.parametrize(("entry", "gone"), [
    (_entry("10.98.0.1", 5353, "10.78.0.10", 53), True),     # NATed to A
    (_entry("10.98.0.1", 5353, "10.98.0.1", 5353), True),    # made while no map existed
    (_entry("127.0.0.1", 5353, "10.78.0.10", 53), True),     # loopback is local
    (_entry("10.98.0.1", 5353, "10.78.0.20", 53), False),    # already to B
    (_entry("10.98.0.1", 5354, "10.78.0.10", 53), False),    # another port
    (_entry("10.98.0.1", 5353, "10.78.0.10", 53, 6), False),  # another protocol
    (_entry("203.0.113.9", 5353, "203.0.113.9", 5353), False),  # forwarded to a remote port
])
def test_stale_entries_of_a_moved_map(entry: Entry, gone: bool) -> None:
    assert stale_for(StaleMap.parse("udp/5353>10.78.0.20:53"), entry, LOCAL) is gone


@pytest.mark.parametrize(("entry", "gone"), [
    (_entry("10.98.0.1", 8080, "10.78.0.10", 80, 6), True),     # NATed to the old alloc
    (_entry("10.98.0.1", 8080, "10.98.0.1", 8080, 6), False),   # a host service's own flow
])
def test_a_removed_tcp_map_takes_only_the_flows_its_dnat_rewrote(entry: Entry,
                                                                 gone: bool) -> None:
    assert stale_for(StaleMap.parse("tcp/8080"), entry, LOCAL) is gone


def test_a_map_on_one_host_address_takes_only_its_entries() -> None:
    m = StaleMap.parse("udp/5353@192.0.2.1")
    assert stale_for(m, _entry("192.0.2.1", 5353, "10.78.0.10", 53), LOCAL)
    assert not stale_for(m, _entry("10.98.0.1", 5353, "10.78.0.10", 53), LOCAL)


def _dnat(alloc: str, proto: str, port: int, dest: str, host_ip: str = "") -> str:
    match = f"-d {host_ip}/32 " if host_ip else ""
    return (f"{match}-p {proto} -m {proto} --dport {port} -m comment --comment "
            f"reconciler:alloc={alloc} -j DNAT --to-destination {dest}")


def _stale(want: list[str], have: list[str]) -> list[str]:
    rs = RuleSet(4)
    for r in want:
        rs.add_rule(DNAT, r)
    live = LiveChainSet(True, {("nat", DNAT): tuple(have)})
    return [str(m) for m in stale.stale_maps(rs, live)]


def test_maps_that_move_go_or_come() -> None:
    a53 = _dnat("a", "udp", 5353, "10.78.0.10:53")
    b53 = _dnat("b", "udp", 5353, "10.78.0.20:53")
    a80 = _dnat("a", "tcp", 8080, "10.78.0.10:80")
    lo = _dnat("a", "tcp", 8443, "10.78.0.10:443", "127.0.0.1")
    assert _stale([a53, a80, lo], [a53, a80, lo]) == []               # unchanged
    assert _stale([b53], [a53]) == ["udp/5353>10.78.0.20:53"]           # moved
    assert _stale([], [a53, a80, lo]) == ["tcp/8080", "tcp/8443@127.0.0.1", "udp/5353"]
    assert _stale([b53, a80], []) == ["udp/5353>10.78.0.20:53"]         # new: UDP only
    # the same map again under another owner (an alloc renamed): same destination, kept
    assert _stale([_dnat("c", "udp", 5353, "10.78.0.10:53")], [a53]) == []


# ------------------------------------------------------------------ the planner


def _desired(allocs: tuple[Alloc, ...], mtu: int | None = 9000) -> DesiredState:
    net = ipaddress.IPv4Network("10.0.0.0/24")
    s = Subnet(SubnetName("net"), BridgeName("br0"), net, net.network_address + 1, None,
               None, None)
    return DesiredState(bridges={BridgeName("br0"): Bridge(BridgeName("br0"), mtu, True)},
                        subnets={s.name: s}, allocs={a.id: a for a in allocs},
                        settings=Settings((20000, 32000)))


def _alloc(aid: str, *ports: PortMap) -> Alloc:
    return Alloc(AllocId(aid), SubnetName("net"), None, None, ports)


def _converged(desired: DesiredState) -> FakeHost:
    host = FakeHost()
    result = Reconciler(host, runner=host, sleep=lambda _s: None).apply(  # type: ignore[arg-type]
        desired, PlanOptions())
    assert result.ok
    return host


def test_a_map_that_moves_deletes_its_entries_after_the_restore() -> None:
    host = _converged(_desired((_alloc("a", PortMap(5353, 53, "udp", None)),)))
    assert host.conntrack_deleted == [(4, "udp/5353>10.0.0.2:53")]  # a new UDP map
    host.conntrack_deleted.clear()
    # b takes the address a leaves: the same destination would keep the entries
    moved = _desired((_alloc("b", PortMap(5353, 54, "udp", None)),))
    plan = make_plan(moved, host.observe(moved), PlanOptions())
    fw = next(c for c in plan.changes if c.kind == "firewall")
    assert [o.name for o in fw.ops] == ["firewall.nft", "conntrack.delete"]
    assert fw.ops[1].args == {"family": 4, "maps": ["udp/5353>10.0.0.2:54"]}
    Reconciler(host, runner=host, sleep=lambda _s: None).apply(  # type: ignore[arg-type]
        moved, PlanOptions())
    assert host.conntrack_deleted == [(4, "udp/5353>10.0.0.2:54")]
    assert not make_plan(moved, host.observe(moved), PlanOptions()).has_changes


def test_each_family_s_stale_entries_are_named_with_their_family() -> None:
    """Our table's change serves both families: its two conntrack lines once read the same
    (``conntrack: entries of tcp/8080 -> (none)`` twice)."""
    net, net6 = ipaddress.IPv4Network("10.0.0.0/24"), ipaddress.IPv6Network("fd00:9::/64")

    def dual(port: int) -> DesiredState:
        s = Subnet(SubnetName("net"), BridgeName("br0"), net, None, net6)
        return DesiredState(bridges={BridgeName("br0"): Bridge(BridgeName("br0"), None, True)},
                            subnets={s.name: s},
                            allocs={AllocId("a"): _alloc("a", PortMap(port, 80, "tcp", None))},
                            settings=Settings((20000, 32000)))

    host = _converged(dual(8080))
    moved = dual(8082)
    fw = next(c for c in make_plan(moved, host.observe(moved), PlanOptions()).changes
              if c.kind == "firewall")
    lines = [a.before for a in fw.attrs if a.field == "conntrack"]
    assert len(lines) == 2 and lines[0] != lines[1], lines
    assert [str(x).split()[0] for x in lines] == ["IPv4", "IPv6"], lines


def test_the_last_ports_of_a_bridge_go_first_and_its_mtu_is_set_again() -> None:
    host = _converged(_desired((_alloc("a"), _alloc("b"))))
    empty = _desired(())
    plan = make_plan(empty, host.observe(empty), PlanOptions())
    ops = [(c.kind, c.name, o.name) for c in plan.actionable for o in c.ops]
    veth_a, veth_b = alloc_veth_name("a"), alloc_veth_name("b")
    # (with each namespace, its bridge-side neighbour entry: the kernel never collects it)
    assert ops[:7] == [("alloc", "a", "link.set"), ("alloc", "a", "netns.delete"),
                       ("alloc", "a", "neigh.delete"),
                       ("alloc", "b", "link.set"), ("alloc", "b", "netns.delete"),
                       ("alloc", "b", "neigh.delete"), ("bridge", "br0", "link.set")]
    bridge = next(c for c in plan.changes if c.kind == "bridge")
    assert bridge.action is Action.UPDATE and bridge.ops[0].args == {"name": "br0", "mtu": 9000}
    assert [c.ops[0].args for c in plan.changes if c.kind == "alloc"] == [
        {"name": veth_a, "master": ""}, {"name": veth_b, "master": ""}]


@pytest.mark.parametrize("case", ["one alloc stays", "a foreign port stays", "mtu 1500",
                                  "no mtu"])
def test_a_bridge_that_keeps_a_port_or_has_the_kernel_default_is_left_alone(case: str) -> None:
    mtu = {"mtu 1500": 1500, "no mtu": None}.get(case, 9000)
    host = _converged(_desired((_alloc("a"), _alloc("b")), mtu))
    if case == "a foreign port stays":
        host.links["eth9"] = LiveLink("eth9", 99, "veth", 9000, True, False, master="br0")
    after = _desired((_alloc("a"),) if case == "one alloc stays" else (), mtu)
    plan = make_plan(after, host.observe(after), PlanOptions())
    assert all(c.action is not Action.UPDATE for c in plan.changes if c.kind == "bridge")
    assert all(o.name in ("netns.delete", "neigh.delete") for c in plan.changes
               if c.kind == "alloc" for o in c.ops)


# ------------------------------------------------------------------ holders in /proc


def test_netns_members_reads_processes_and_threads(tmp_path: object) -> None:
    root = str(tmp_path)

    def proc(pid: int, net: str, threads: dict[int, str] | None = None) -> None:
        os.makedirs(f"{root}/{pid}/ns")
        os.symlink(net, f"{root}/{pid}/ns/net")
        for tid, tnet in (threads or {pid: net}).items():
            os.makedirs(f"{root}/{pid}/task/{tid}/ns")
            os.symlink(tnet, f"{root}/{pid}/task/{tid}/ns/net")
        with open(f"{root}/{pid}/comm", "w") as fh:
            fh.write(f"p{pid}\n")

    proc(1, "net:[100]")
    proc(20, "net:[200]")
    proc(30, "net:[100]", {30: "net:[100]", 31: "net:[200]"})  # a thread that did setns
    os.makedirs(f"{root}/40/ns")  # gone meanwhile: no link
    os.makedirs(f"{root}/self")
    assert procfs.netns_members(root) == {100: (1, 30), 200: (20, 30)}
    assert procfs.process_name(20, root) == "p20"
    assert procfs.process_name(40, root) == "?"


@pytest.mark.parametrize(("link", "inode"), [("net:[4026532301]", 4026532301),
                                             ("mnt:[4026531841]", None), ("net:[]", None)])
def test_the_inode_of_a_namespace_link(link: str, inode: int | None) -> None:
    assert procfs.netns_inode_of(link) == inode


def test_the_fake_host_records_what_it_was_asked_to_delete() -> None:
    host = FakeHost()
    host.perform(ConntrackDelete(4, ("udp/53",)))
    assert host.conntrack_deleted == [(4, "udp/53")]
    assert dataclasses.asdict(StaleMap.parse("udp/53"))["keep"] is None


class _FakeSocket:
    """Answers every dump with the captured entry; records the filters asked for."""

    def __init__(self) -> None:
        self.dumps: list[tuple[int | None, int | None]] = []
        self.deleted: list[bytes] = []

    def dump(self, kind: int, body: bytes, what: str) -> list[bytes]:
        assert kind == conntrack.CT_GET
        attrs = parse_attrs(body, 4)
        proto = parse_attrs(parse_attrs(attrs.get(1, b"")).get(2, b""))
        num, port = proto.get(1), proto.get(3)
        self.dumps.append((num[0] if num else None,
                           struct.unpack("!H", port[:2])[0] if port else None))
        return [CAPTURED]

    def request(self, kind: int, flags: int, body: bytes, what: str) -> list[bytes]:
        assert kind == conntrack.CT_DELETE
        self.deleted.append(body)
        return []


def _table() -> tuple[conntrack.Conntrack, _FakeSocket]:
    ct = conntrack.Conntrack.__new__(conntrack.Conntrack)
    sock = _FakeSocket()
    ct._sock = sock  # type: ignore[assignment]  # noqa: SLF001
    ct._route = None  # noqa: SLF001
    return ct, sock


def test_few_ports_get_a_kernel_filtered_dump_each_many_one_per_protocol() -> None:
    ct, sock = _table()
    ct.delete_matching(4, lambda _e: False, ports={("udp", 53), ("tcp", 80)})
    assert sock.dumps == [(6, 80), (17, 53)]
    sock.dumps.clear()
    ct.delete_matching(4, lambda _e: False,
                       ports={("udp", p) for p in range(1000, 1009)} | {("tcp", 80)})
    assert sock.dumps == [(17, None), (6, 80)]


def test_what_the_predicate_picks_is_deleted_by_its_tuple() -> None:
    ct, sock = _table()
    gone = ct.delete_matching(4, lambda e: e.orig.dport == 5353, ports={("udp", 5353)})
    assert gone == [parse_entry(CAPTURED)] and len(sock.deleted) == 1
    e = gone[0]
    assert sock.deleted[0] == conntrack.delete_request(e)


# ------------------------------------------------------------------ HostOps: a held namespace


class _HeldNetlink(Recorder):
    """Records calls; ``get_link`` answers from ``links`` (the host's links by name)."""

    def __init__(self, label: str, calls: list[tuple[Any, ...]],
                 links: dict[str, LiveLink]) -> None:
        super().__init__(label, calls)
        self.links = links

    def get_link(self, name: str, ns: str | None = None) -> LiveLink | None:
        return self.links.get(name)


def _held_ops(monkeypatch: pytest.MonkeyPatch,
              members: dict[int, tuple[int, ...]], links: dict[str, LiveLink] | None = None
              ) -> tuple[HostOps, list[tuple[Any, ...]], list[int]]:
    log: list[tuple[Any, ...]] = []
    scans: list[int] = []
    if links is None:  # each allocation's veth, ours
        links = {alloc_veth_name(n): LiveLink(alloc_veth_name(n), 7, "veth", 1500, True, True)
                 for n in "abc"}
    ops = HostOps(HostHandles(netlink=_HeldNetlink("netlink", log, links)))  # type: ignore[arg-type]
    monkeypatch.setattr(netns, "namespace_inode", lambda name: 1000 + ord(name[0]))

    def scan() -> dict[int, tuple[int, ...]]:
        scans.append(1)
        return members

    monkeypatch.setattr(procfs, "netns_members", scan)
    monkeypatch.setattr(procfs, "process_name", lambda pid: f"p{pid}")
    return ops, log, scans


def test_a_held_namespace_loses_its_veth_and_its_holders_are_named(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    ops, log, scans = _held_ops(monkeypatch, {1000 + ord("a"): (4242, os.getpid())})
    ops.perform(NetnsDelete("a"))
    ops.perform(NetnsDelete("b"))  # not held: the namespace goes with its veth by itself
    assert [(c[1], c[2]) for c in log if c[1] != "get_link"] == [("delete_netns", ("a",)),
                                           ("delete_link", (alloc_veth_name("a"),)),
                                           ("delete_netns", ("b",))]
    assert scans == [1]  # one scan of /proc per pass, however many namespaces
    assert "alloc a: its namespace is still held by pid 4242 (p4242); removed its veth " \
           "and rules" in caplog.text
    ops.new_pass()
    ops.perform(NetnsDelete("c"))
    assert scans == [1, 1]


@pytest.mark.parametrize("link", [
    LiveLink(alloc_veth_name("a"), 7, "veth", 1500, True, False),  # a veth, not marked
    LiveLink(alloc_veth_name("a"), 7, "dummy", 1500, True, True),  # marked, but no veth
])
def test_a_held_namespace_spares_a_link_of_its_veths_name_that_is_not_ours(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        link: LiveLink) -> None:
    ops, log, _scans = _held_ops(monkeypatch, {1000 + ord("a"): (4242,)}, {link.name: link})
    ops.perform(NetnsDelete("a"))
    assert "delete_link" not in [c[1] for c in log], log
    assert f"the link {link.name} is no veth of ours: left alone" in caplog.text
