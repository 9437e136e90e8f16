"""Every attribute the planner manages is recorded by the checkpoint and applied by the fake host.

A link attribute lives in four parallel records (``model``, ``live``, ``ops``,
``checkpoint``) with nothing tying them: forgetting the checkpoint ships a revert
that silently keeps the new value. This guard ties them, from the code itself:

- the op classes the planner can emit are what ``reconciler/planner`` imports from
  ``domain.ops`` (read from its source), and their fields are their dataclass fields;
  each field is either recorded by a field of the checkpoint (``RECORDED``) or says
  why it is no attribute (``NOT_RECORDED``), and each field of ``LinkPoint`` and
  ``AllocPoint`` records something; nothing is left out silently either way;
- on the fake host, for each change below, the planner's plan is applied, the
  checkpoint taken before it is restored, and then the planner has nothing to do
  that it did not have to do before the change (every attribute it compares is
  back), ``take`` gives the checkpoint again, and between them the changes run every
  recorded field of every op (so each row of ``RECORDED`` is exercised by a revert).
  One restore plan must do it: stricter than ``engine.safechange.revert``, which
  checks and restores again up to 3 rounds (a restore plan that mispredicts costs a
  round there; an attribute no record holds is never put back).

Docker networks are recorded whole (``NetworkPoint``) and restored through the Docker
driver, which the fake host does not play: their ops are out of scope here.
"""

from __future__ import annotations

import ast
import dataclasses
import ipaddress
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

import reconciler.planner
from reconciler.domain.checkpoint import AllocPoint, Checkpoint, LinkPoint
from reconciler.domain.errors import ConfigError
from reconciler.domain.live import LiveNeighbour, LiveState
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
from reconciler.domain.ops import OPS, TypedOp, decode
from reconciler.domain.ownership import alloc_veth_name
from reconciler.domain.plan import Plan
from reconciler.engine.reconcile import Reconciler
from reconciler.planner import PlanOptions, make_plan
from reconciler.planner.checkpoint import observation, restore_plan, sysctl_keys, take
from reconciler.ui.options import refuse_adopt_under_window
from tests.support.fakehost import FakeHost

PLANNER = pathlib.Path(reconciler.planner.__file__).resolve().parent


def planner_ops() -> frozenset[type[TypedOp]]:
    """The op classes the planner can emit: every one its modules import from domain.ops."""
    names = {a.name for p in PLANNER.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.ImportFrom) and node.module == "reconciler.domain.ops"
             for a in node.names}
    return frozenset(cls for cls in OPS.values() if cls.__name__ in names)


#: the planner's ops the fake host plays (Docker's are the Docker driver's: see above)
IN_SCOPE = frozenset(cls for cls in planner_ops() if not cls.NAME.startswith("docker."))

#: (op, field) -> the checkpoint fields that record what it sets
RECORDED: dict[tuple[str, str], tuple[str, ...]] = {
    ("LinkAddBridge", "mtu"): ("LinkPoint.mtu",),
    ("LinkAddBridge", "mac"): ("LinkPoint.mac",),
    ("LinkSet", "mtu"): ("LinkPoint.mtu",),
    ("LinkSet", "up"): ("LinkPoint.up",),
    ("LinkSet", "master"): ("LinkPoint.master",),
    ("LinkSetHairpin", "on"): ("LinkPoint.hairpin",),
    ("LinkSetMac", "mac"): ("LinkPoint.mac", "AllocPoint.eth0_mac"),
    ("AddrAdd", "address"): ("LinkPoint.addresses", "AllocPoint.addresses"),
    ("AddrDel", "address"): ("LinkPoint.addresses", "AllocPoint.addresses"),
    ("RouteDelDefault", "version"): ("AllocPoint.gateways",),
    ("NetnsCreate", "mark"): ("AllocPoint.mark",),
    ("AllocAttach", "bridge"): ("LinkPoint.master",),
    ("AllocAttach", "mtu"): ("LinkPoint.mtu", "AllocPoint.eth0_mtu"),
    ("AllocAttach", "hairpin"): ("LinkPoint.hairpin",),
    ("AllocAttach", "mac"): ("AllocPoint.eth0_mac",),
    ("AllocConfigure", "addresses"): ("AllocPoint.addresses",),
    ("AllocConfigure", "gateways"): ("AllocPoint.gateways",),
    ("AllocConfigure", "mtu"): ("AllocPoint.eth0_mtu",),
    ("AllocConfigure", "mark"): ("AllocPoint.mark",),
    ("SysctlSet", "value"): ("Checkpoint.sysctls",),
    ("FirewallNft", "add"): ("Checkpoint.firewall",),
    ("FirewallNft", "delete"): ("Checkpoint.firewall",),

}

#: what names the object an op acts on (recorded as the key of its record)
IDENTITY = "names what it acts on"

#: (op, field) -> why it sets no attribute a revert must put back
NOT_RECORDED: dict[tuple[str, str], str] = {
    ("LinkAddBridge", "name"): IDENTITY,
    ("LinkSet", "name"): IDENTITY,
    ("LinkSet", "netns"): IDENTITY,
    # adopting is refused under a confirm window (checked below), and what was foreign
    # at the checkpoint is never deleted by a revert (Checkpoint.foreign)
    ("LinkSet", "owned"): "adoption: refused under --confirm-within",
    ("LinkDelete", "name"): IDENTITY,
    ("LinkDelete", "netns"): IDENTITY,
    ("LinkSetHairpin", "name"): IDENTITY,
    ("LinkSetMac", "name"): IDENTITY,
    ("LinkSetMac", "netns"): IDENTITY,
    # our entries follow the allocations' eth0 (AllocPoint.eth0_mac): the planner derives
    # them, the restore of an eth0 announces it; the changes below check that a revert
    # leaves the planner no neighbour entry to fix that it did not have to before
    ("NeighReplace", "link"): IDENTITY,
    ("NeighReplace", "address"): IDENTITY,
    ("NeighReplace", "mac"): "derived from AllocPoint.eth0_mac",
    ("NeighDelete", "link"): IDENTITY,
    ("NeighDelete", "address"): IDENTITY,
    ("AddrAdd", "link"): IDENTITY,
    ("AddrAdd", "netns"): IDENTITY,
    ("AddrDel", "link"): IDENTITY,
    ("AddrDel", "netns"): IDENTITY,
    ("RouteDelDefault", "netns"): IDENTITY,
    ("NetnsCreate", "name"): IDENTITY,
    ("NetnsCreate", "replace_stale"): "how: an empty /run/netns file is replaced",
    ("NetnsDelete", "name"): IDENTITY,
    ("AllocAttach", "netns"): IDENTITY,
    ("AllocAttach", "veth"): IDENTITY,
    ("AllocConfigure", "netns"): IDENTITY,
    ("AllocConfigure", "ipv6"): "not read (see its declaration)",
    ("AllocConfigure", "announce"): "how: a gratuitous ARP and NA, no state",
    ("SysctlSet", "key"): IDENTITY,
    ("FirewallNft", "rebuild"): "how the entries are written (the whole table at once), no state",
    ("FirewallNft", "mark"): "derived from settings.firewall_mark, read back as the table's",
    ("FirewallNft", "drop_table"): "how no entry is left: the table goes, no state",
    ("FirewallNft", "cleanup4"): "earlier versions' chains: gone for good after the upgrade",
    ("FirewallNft", "cleanup6"): "earlier versions' chains: gone for good after the upgrade",
    ("FirewallShim", "family"): IDENTITY,
    ("FirewallShim", "legacy"): IDENTITY,
    ("FirewallShim", "chain"): IDENTITY,
    # the shim is derived from what is declared and another manager's chain: the pass after
    # a revert plans it again (planner.shim), nothing of it is the user's to put back
    ("FirewallShim", "rule"): "derived from the subnets and settings.firewall_mark",
    ("FirewallShim", "position"): "derived: ahead of the chain's first drop",
    ("ConntrackDelete", "family"): IDENTITY,
    ("ConntrackDelete", "maps"): "flows the rules left stale: a restore deletes its own",
}

#: checkpoint fields no op field sets: the record's key, or set by an op as a whole
SET_WITHOUT_A_FIELD: dict[str, str] = {
    "LinkPoint.name": IDENTITY,
    "LinkPoint.kind": "LinkAddBridge makes a bridge, AllocAttach a veth",
    "AllocPoint.name": IDENTITY,
    "AllocPoint.eth0_up": "AllocConfigure brings eth0 up",
}

RECORDS = {cls.__name__: cls for cls in (LinkPoint, AllocPoint, Checkpoint)}


def op_fields(cls: type[TypedOp]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name != "key_order"]


def record_fields() -> set[str]:
    return {f"{name}.{f.name}" for name, cls in RECORDS.items() for f in dataclasses.fields(cls)}


# -- what is recorded, from the code ---------------------------------------------------------


def test_the_planner_emits_ops_the_guard_covers() -> None:
    """The import scan finds the ops (an empty scope would make the rest vacuous)."""
    names = {cls.__name__ for cls in IN_SCOPE}
    assert {"LinkAddBridge", "LinkSet", "AddrAdd", "AllocAttach", "AllocConfigure"} <= names


def test_every_field_of_every_op_the_planner_emits_is_recorded_or_says_why_not() -> None:
    missing = [f"{cls.__name__}.{f}" for cls in sorted(IN_SCOPE, key=lambda c: c.__name__)
               for f in op_fields(cls)
               if (cls.__name__, f) not in RECORDED and (cls.__name__, f) not in NOT_RECORDED]
    assert not missing, (f"{', '.join(missing)}: which checkpoint field records it (a revert "
                         "puts it back)? Add it to LinkPoint/AllocPoint and to RECORDED, or "
                         "say in NOT_RECORDED why it sets nothing to put back")
    known = {(cls.__name__, f) for cls in IN_SCOPE for f in op_fields(cls)}
    stale = sorted(f"{o}.{f}" for o, f in (set(RECORDED) | set(NOT_RECORDED)) - known)
    assert not stale, f"{', '.join(stale)}: no such field of an op the planner emits"


def test_every_recording_field_is_a_field_of_the_checkpoint() -> None:
    fields = record_fields()
    wrong = sorted(f"{o}.{f} -> {r}" for (o, f), records in RECORDED.items() for r in records
                   if r not in fields)
    assert not wrong, f"{', '.join(wrong)}: the checkpoint has no such field (was it removed?)"


@pytest.mark.parametrize("record", [LinkPoint, AllocPoint])
def test_every_field_of_a_link_or_allocation_record_records_something(record: type) -> None:
    named = {r for records in RECORDED.values() for r in records} | set(SET_WITHOUT_A_FIELD)
    idle = sorted(f"{record.__name__}.{f.name}" for f in dataclasses.fields(record)
                  if f"{record.__name__}.{f.name}" not in named)
    assert not idle, f"{', '.join(idle)}: which op field does it record?"


def test_adoption_under_a_confirm_window_is_refused() -> None:
    """Why ``LinkSet.owned`` needs no record: a change under a window never adopts."""
    with pytest.raises(ConfigError):
        refuse_adopt_under_window(PlanOptions(adopt=frozenset({"bridge/br0"})), 60.0)


# -- what a revert puts back, on the fake host -----------------------------------------------


def _bridge(name: str = "br0", mtu: int | None = 1500, hairpin: bool = True) -> Bridge:
    return Bridge(BridgeName(name), mtu, hairpin)


def _subnet(cidr: str = "10.0.0.0/24", cidr6: str | None = "fd00::/64",
            bridge: str = "br0") -> Subnet:
    net = ipaddress.IPv4Network(cidr)
    net6 = ipaddress.IPv6Network(cidr6) if cidr6 else None
    return Subnet(SubnetName("net"), BridgeName(bridge), net, net.network_address + 1, net6,
                  net6.network_address + 1 if net6 else None, None)


def _state(*bridges: Bridge, subnet: Subnet | None = None,
           allocs: tuple[str, ...] = ("a", "b")) -> DesiredState:
    """Bridges, one subnet, allocations: the first with a tcp and an auto udp port map."""
    made = [Alloc(AllocId(aid), SubnetName("net"), None, None,
                  (PortMap(8080, 80, "tcp", None), PortMap(None, 81, "udp", None))
                  if i == 0 else ()) for i, aid in enumerate(allocs)]
    return DesiredState(bridges={b.name: b for b in bridges or (_bridge(),)},
                        subnets={SubnetName("net"): subnet or _subnet()},
                        allocs={a.id: a for a in made}, settings=Settings((20000, 32000)))


Tamper = Callable[[FakeHost], None]


@dataclass(frozen=True)
class Change:
    """From ``before`` (converged, then ``tamper``ed) the change applies ``after``."""

    name: str
    before: DesiredState
    after: DesiredState
    tamper: Tamper | None = None
    options: PlanOptions = field(default_factory=PlanOptions)


def _down(host: FakeHost) -> None:
    host.links["br0"] = dataclasses.replace(host.links["br0"], up=False)


def _unpinned(host: FakeHost) -> None:
    host.links["br0"] = dataclasses.replace(host.links["br0"], mac="aa:00:00:00:00:01",
                                            mac_pinned=False)


def _wrong_neighbour(host: FakeHost) -> None:
    address = str(host.netns["a"].links["eth0"].addresses[0].address.ip)
    host.neighbours = [n for n in host.neighbours if n.address != address]
    host.neighbours.append(LiveNeighbour(host.links["br0"].index, address,
                                         "aa:00:00:00:00:02", False))


def _veth_elsewhere(host: FakeHost) -> None:
    host.add_link("other", "bridge")
    veth = alloc_veth_name("a")
    host.links[veth] = dataclasses.replace(host.links[veth], master="other", hairpin=True)


def _forward_drops(host: FakeHost) -> None:
    host.fw[4].policies[("filter", "FORWARD")] = "DROP"  # dockerd's: the shim goes in


BASE = _state()
JUMBO = _state(_bridge(mtu=9000))
TWO_BRIDGES = _state(_bridge(), _bridge("br1"))

CHANGES = [
    Change("bridge MTU changed", BASE, _state(_bridge(mtu=9000))),
    Change("hairpin off", BASE, _state(_bridge(hairpin=False))),
    Change("hairpin on", _state(_bridge(hairpin=False)), BASE),
    Change("a bridge and an allocation added", BASE,
           _state(_bridge(), _bridge("br1"), allocs=("a", "b", "c"))),
    Change("an allocation and a bridge pruned", TWO_BRIDGES, _state(allocs=("a",))),
    Change("a new allocation takes a pruned one's address", BASE, _state(allocs=("c", "b"))),
    Change("the last ports of a bridge pruned", JUMBO, dataclasses.replace(JUMBO, allocs={})),
    Change("IPv6 dropped", BASE, _state(subnet=_subnet(cidr6=None))),
    Change("IPv6 added", _state(subnet=_subnet(cidr6=None)), BASE),
    Change("subnet re-addressed", BASE, _state(subnet=_subnet("10.1.0.0/24", "fd00:1::/64"))),
    Change("subnet moved to another bridge", TWO_BRIDGES,
           _state(_bridge(), _bridge("br1"), subnet=_subnet(bridge="br1"))),
    Change("a down bridge brought up", BASE, BASE, _down),
    Change("a bridge MAC pinned", BASE, BASE, _unpinned),
    Change("a neighbour entry of another MAC replaced", BASE, BASE, _wrong_neighbour),
    Change("a veth put back on its bridge", BASE, BASE, _veth_elsewhere),
    Change("the mark shim put in a dropping FORWARD", BASE, BASE, _forward_drops),
]


def _plan(host: FakeHost, desired: DesiredState) -> Plan:
    return make_plan(desired, host.observe(desired), PlanOptions())


def _todo(plan: Plan) -> set[str]:
    """What a plan would do, one line per change (its address, action and attributes)."""
    return {f"{c.address} {c.action.value} "
            + ", ".join(f"{a.field}: {a.before} -> {a.after}" for a in c.attrs)
            for c in plan.actionable}


def _converged(desired: DesiredState) -> FakeHost:
    host = FakeHost()
    result = Reconciler(host, runner=host, sleep=lambda _s: None).apply(  # type: ignore[arg-type]
        desired, PlanOptions())
    assert result.ok and not _plan(host, desired).has_changes
    return host


#: what the kernel says of a bridge's sysctls the fake host was never asked to set
KERNEL_SYSCTLS = {"route_localnet": "0", "addr_gen_mode": "1", "accept_dad": "1"}


def _observed(host: FakeHost, desired: DesiredState) -> LiveState:
    """An observation as ``engine.safechange`` makes it for a checkpoint: with the per-bridge
    sysctls it records, which the engine reads from /proc when observation did not."""
    live = host.observe(desired)
    extra = {k: KERNEL_SYSCTLS[k.rsplit("/", 1)[1]] for k in sysctl_keys(live)
             if k not in live.sysctls}
    return dataclasses.replace(live, sysctls={**live.sysctls, **extra})


@dataclass
class Reverted:
    checkpoint: Checkpoint
    again: Checkpoint
    todo_before: set[str]
    todo_after: set[str]
    ran: list[TypedOp]


def _revert(change: Change) -> Reverted:
    """Converge to ``before``, record the checkpoint the apply of ``after`` records, apply,
    then revert as ``engine.safechange.revert`` does (everything owned observed)."""
    host = _converged(change.before)
    if change.tamper is not None:
        change.tamper(host)
    todo_before = _todo(_plan(host, change.before))
    checkpoint = take(_observed(host, change.after))
    host.log.clear()
    result = Reconciler(host, runner=host, sleep=lambda _s: None).apply(  # type: ignore[arg-type]
        change.after, change.options)
    assert result.ok, [o.error for o in result.failed]
    # applied by the fake host: what the planner set is what it then sees
    assert not _plan(host, change.after).has_changes, _todo(_plan(host, change.after))
    seen = observation(checkpoint)  # what engine.safechange.observe_for declares
    for c in restore_plan(checkpoint, _observed(host, seen)).actionable:
        for op in c.ops:
            host.run(op)
    return Reverted(checkpoint, take(_observed(host, seen)), todo_before,
                    _todo(_plan(host, change.before)), [decode(op) for op in host.log])


@pytest.fixture(scope="module")
def reverted() -> dict[str, Reverted]:
    return {c.name: _revert(c) for c in CHANGES}


#: (test, change) -> a gap this guard found and that is not mended yet (strict: a mend
#: makes the test pass, and then the mark must go)
KNOWN_GAPS: dict[tuple[str, str], str] = {}


def _cases(test: str) -> list[object]:
    return [pytest.param(c.name, marks=pytest.mark.xfail(strict=True,
                                                         reason=KNOWN_GAPS[(test, c.name)]))
            if (test, c.name) in KNOWN_GAPS else c.name for c in CHANGES]


@pytest.mark.parametrize("name", _cases("nothing new"))
def test_a_revert_leaves_the_planner_nothing_new_to_do(reverted: dict[str, Reverted],
                                                       name: str) -> None:
    """Every attribute the planner compares is back: what it would do after the revert it
    had to do before the change (a bridge pinned, a stale entry replaced stay done)."""
    r = reverted[name]
    new = sorted(r.todo_after - r.todo_before)
    assert not new, f"{name}: after the revert the planner still has to do: {new}"


@pytest.mark.parametrize("name", _cases("checkpoint back"))
def test_a_revert_gives_the_checkpoint_back(reverted: dict[str, Reverted], name: str) -> None:
    r = reverted[name]
    assert r.again == r.checkpoint


def _set(op: TypedOp, name: str) -> bool:
    """The op sets field ``name``: it holds something other than its default."""
    f = next(f for f in dataclasses.fields(op) if f.name == name)
    value = getattr(op, name)
    return f.default is dataclasses.MISSING or value != f.default


def _ran(reverted: dict[str, Reverted]) -> Iterator[tuple[str, str]]:
    for r in reverted.values():
        for op in r.ran:
            for name in op_fields(type(op)):
                if _set(op, name):
                    yield type(op).__name__, name


def test_the_changes_run_every_recorded_field_and_every_op_in_scope(
        reverted: dict[str, Reverted]) -> None:
    """Each row of RECORDED is exercised by an apply or a revert above, and the fake host
    played every op the planner emits (it refuses ops it does not know)."""
    ran = set(_ran(reverted))
    unexercised = sorted(f"{o}.{f}" for o, f in RECORDED if (o, f) not in ran)
    assert not unexercised, f"{', '.join(unexercised)}: add a change above that sets it"
    played = {o for o, _f in ran}
    unplayed = sorted(cls.__name__ for cls in IN_SCOPE) if not played else sorted(
        cls.__name__ for cls in IN_SCOPE if cls.__name__ not in played)
    assert not unplayed, f"{', '.join(unplayed)}: no change above runs it on the fake host"
