"""An in-memory host for unit tests: it runs plan ops and is observed like the real one."""

from __future__ import annotations

import dataclasses
import ipaddress
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reconciler.domain.live import (
    DockerAddressSpace,
    LiveAddress,
    LiveChainSet,
    LiveLink,
    LiveNeighbour,
    LiveNetns,
    LiveRoute,
    LiveState,
)
from reconciler.domain.model import DesiredState
from reconciler.domain.nftable import Entry as NftEntry
from reconciler.domain.nftable import TableState
from reconciler.domain.ops import (
    AddrAdd,
    AddrDel,
    AllocAttach,
    AllocConfigure,
    ConntrackDelete,
    FirewallNft,
    FirewallShim,
    LinkAddBridge,
    LinkDelete,
    LinkSet,
    LinkSetHairpin,
    LinkSetMac,
    NeighDelete,
    NeighReplace,
    NetnsCreate,
    NetnsDelete,
    RouteDelDefault,
    SysctlSet,
    TypedOp,
    decode,
)
from reconciler.domain.ownership import LINK_ALIAS, NEIGH_PROTO, alloc_ns_alias
from reconciler.domain.plan import Op
from reconciler.drivers.netlink.conntrack import PROTOCOLS, Entry, IPAddress
from reconciler.planner import firewall, nftview

HOST_ID = "4026531840"


class FakeConntrack:
    """A conntrack table of entries the test puts there, read as the driver's ``flows``."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        #: each ``flows`` call: (family, addresses, ports)
        self.asked: list[tuple[int, frozenset[IPAddress], frozenset[tuple[str, int]]]] = []

    def flows(self, family: int, addresses: frozenset[IPAddress],
              ports: frozenset[tuple[str, int]]) -> list[Entry]:
        self.asked.append((family, frozenset(addresses), frozenset(ports)))
        names = {v: k for k, v in PROTOCOLS.items()}
        return [e for e in self.entries if e.family == family and e.orig.proto in names and (
            e.orig.src in addresses or e.reply.src in addresses
            or (names[e.orig.proto], e.orig.dport) in ports)]


@dataclass
class FakeNetns:
    """An allocation namespace: its links by name and its routes."""

    nsid: int
    links: dict[str, LiveLink] = field(default_factory=dict)
    routes: list[LiveRoute] = field(default_factory=list)
    usable: bool = True
    #: the xattr on the /run/netns file (what an empty one still carries)
    file_mark: str | None = None
    #: the namespace's inode (None: not the one the reconciler runs in)
    inode: int | None = None

    def live(self, name: str) -> LiveNetns:
        if not self.usable:
            return LiveNetns(name, usable=False, file_mark=self.file_mark)
        return LiveNetns(name, True, tuple(self.links.values()), tuple(self.routes), self.nsid,
                         inode=self.inode)


class FakeFirewall:
    """Interprets the iptables-restore --noflush scripts the planner writes."""

    BUILTIN = {"filter": ("INPUT", "FORWARD", "OUTPUT"),
               "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
               "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING")}

    def __init__(self) -> None:
        self.chains: dict[tuple[str, str], list[str]] = {}
        #: built-in chains' policies other than ACCEPT (a test sets dockerd's FORWARD DROP)
        self.policies: dict[tuple[str, str], str] = {}
        for t, chains in self.BUILTIN.items():
            for c in chains:
                self.chains[(t, c)] = []

    def restore(self, script: str) -> None:
        table = ""
        for line in script.splitlines():
            if not line or line == "COMMIT":
                continue
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                self.chains[(table, line[1:].split()[0])] = []
            else:
                toks = shlex.split(line)
                verb, chain, rest = toks[0], toks[1], toks[2:]
                rules = self.chains.setdefault((table, chain), [])
                if verb == "-A":
                    rules.append(" ".join(rest))
                elif verb == "-I":
                    rules.insert(int(rest[0]) - 1, " ".join(rest[1:]))
                elif verb == "-D":
                    rules.remove(" ".join(rest))  # ValueError like iptables' "bad rule"
                elif verb == "-F":
                    rules.clear()
                elif verb == "-X":
                    assert not rules
                    del self.chains[(table, chain)]
                else:
                    raise AssertionError(f"unexpected restore line {line!r}")

    def live(self) -> LiveChainSet:
        return LiveChainSet(True, {k: tuple(v) for k, v in self.chains.items()},
                            policies=dict(self.policies))


def table_from(fw4: LiveChainSet, fw6: LiveChainSet | None = None) -> TableState:
    """Our table holding the entries that rules of ours (in the planner's form) stand for."""
    sets = []
    for family, fw in ((4, fw4), (6, fw6)):
        rs = firewall.RuleSet(family)
        for (_t, chain), rules in (fw.chains.items() if fw is not None else ()):
            for r in rules:
                rs.add_rule(chain, r)
        sets.append(rs)
    entries = frozenset(nftview.entries_of(sets))
    return TableState(exists=bool(entries), intact=bool(entries), entries=entries)


class FakeTable:
    """Our nftables table as entries: what ``firewall.nft`` ops leave in it."""

    def __init__(self) -> None:
        self.exists = False
        self.entries: set[NftEntry] = set()
        #: the bit the table's rules OR into the mark (set by a rebuild)
        self.mark: int | None = None

    def apply(self, op: FirewallNft) -> None:
        add, delete = op.entries()
        if op.drop_table:
            self.exists, self.entries = False, set()
        elif op.rebuild:
            self.exists, self.entries, self.mark = True, set(add), op.mark
        else:
            assert self.exists, "elements changed in a table that does not exist"
            assert set(delete) <= self.entries, "deleting elements that are not there"
            self.entries = (self.entries - set(delete)) | set(add)

    def live(self) -> TableState:
        return TableState(exists=self.exists, intact=self.exists,
                          entries=frozenset(self.entries),
                          mark=self.mark if self.exists else None)


class FakeHost:
    """Observer + OpRunner in one, over in-memory state."""

    def __init__(self) -> None:
        self.links: dict[str, LiveLink] = {}
        #: iptables (Docker's chains, earlier versions' chains) and our table
        self.fw = {4: FakeFirewall(), 6: FakeFirewall()}
        self.table = FakeTable()
        self.sysctls = {"net/ipv4/ip_forward": "0", "net/ipv6/conf/all/forwarding": "0"}
        self.handles = self  # the observer and the runner in one
        self.log: list[Op] = []
        self._next_index = 10
        #: /run/netns as this host's reconciler would see it (allocation namespaces)
        self.netns: dict[str, FakeNetns] = {}
        self.listening: set[tuple[str, int]] = set()
        self.host_id = HOST_ID
        self._next_nsid = 0
        #: host routes besides the connected routes of the links' addresses (a VPN's...)
        self.routes: list[LiveRoute] = []
        self.docker_space: DockerAddressSpace | None = None
        #: the port maps whose conntrack entries runs asked to delete (no table here)
        self.conntrack_deleted: list[tuple[int, str]] = []
        #: neighbour entries of the host's links
        self.neighbours: list[LiveNeighbour] = []
        #: namespace -> the bridge of the veth pair just made into it: its configure seeds
        #: the bridge-side neighbour entries (``Netlink.configure_inside``)
        self._fresh: dict[str, str] = {}
        self.conntrack = FakeConntrack()
        #: the scope's lease table, as the state directory would keep it (``save``)
        self.leases: dict[str, dict[str, Any]] = {}

    def ours(self, family: int) -> dict[tuple[str, str], list[str]]:
        """Our table's entries of ``family`` in the planner's rule form, by (table, chain)."""
        return {k: list(v) for k, v in nftview.view(self.table.live(), family).chains.items()}

    # Observer interface
    def observe(self, desired: DesiredState) -> LiveState:
        mark = alloc_ns_alias(self.host_id)
        # like the real observer: declared names, and undeclared ones that carry our mark
        netns = {name: ns.live(name) for name, ns in sorted(self.netns.items())
                 if name in desired.allocs or (ns.usable and "lo" in ns.links
                                               and ns.links["lo"].alias == mark)}
        return LiveState(host_id=self.host_id, links=dict(self.links),
                         table=self.table.live(),
                         firewall4=nftview.view(self.table.live(), 4),
                         firewall6=nftview.view(self.table.live(), 6),
                         old4=self.fw[4].live(), old6=self.fw[6].live(),
                         sysctls=dict(self.sysctls), netns=netns,
                         listening=frozenset(self.listening) if desired.allocs
                         else frozenset(), routes=self._routes(desired),
                         docker_space=self.docker_space,
                         neighbours=self._neighbours(desired),
                         peer_namespaces={ns.nsid: name for name, ns in self.netns.items()
                                          if ns.usable and name not in netns},
                         leases={k: dict(v) for k, v in self.leases.items()})

    # LeaseStore interface
    def save(self, table: Mapping[str, Mapping[str, Any]]) -> None:
        self.leases = {k: dict(v) for k, v in table.items()}

    def _neighbours(self, desired: DesiredState) -> tuple[LiveNeighbour, ...]:
        """Like the real observer: entries on the declared bridges."""
        bridges = {lk.index for name, lk in self.links.items()
                   if name in desired.bridges and lk.kind == "bridge"}
        return tuple(n for n in self.neighbours if n.index in bridges)

    def _routes(self, desired: DesiredState) -> tuple[LiveRoute, ...]:
        """Like the kernel: a connected route per address, then the others; read only when
        something declares a prefix, as the real observer does."""
        if not (desired.subnets or desired.docker_networks):
            return ()
        connected = [LiveRoute(str(a.address.network), None, False, oif=lk.index)
                     for lk in self.links.values() for a in lk.addresses]
        return (*connected, *self.routes)

    # helpers to set up foreign objects
    def add_link(self, name: str, kind: str, *, owned: bool = False, mtu: int = 1500,
                 addresses: tuple[str, ...] = ()) -> None:
        self._next_index += 1
        self.links[name] = LiveLink(name, self._next_index, kind, mtu, True, owned,
                                    addresses=tuple(LiveAddress(ipaddress.ip_interface(a), False)
                                                    for a in addresses))

    # OpRunner interface
    def run(self, op: Op) -> None:
        self.log.append(op)
        self.perform(decode(op))

    def perform(self, op: TypedOp) -> None:
        match op:
            case LinkAddBridge():
                if op.name not in self.links:
                    self._next_index += 1
                    self.links[op.name] = LiveLink(op.name, self._next_index, "bridge",
                                                   op.mtu or 1500, True, True, mac=op.mac,
                                                   mac_pinned=op.mac is not None)
            case LinkSet():
                link = self.links[op.name]
                master = op.master if op.master is not None else link.master
                self.links[op.name] = dataclasses.replace(
                    link, mtu=op.mtu if op.mtu is not None else link.mtu,
                    up=op.up if op.up is not None else link.up,
                    owned=True if op.owned else link.owned, master=master or None,
                    # the kernel: a new bridge port starts with hairpin off
                    hairpin=(False if master else None) if master != link.master
                    else link.hairpin)
            case LinkDelete():
                self._delete_link(op.name, op.netns)
            case LinkSetMac() if op.netns is not None:
                inside = self.netns[op.netns].links
                inside[op.name] = dataclasses.replace(inside[op.name], mac=op.mac)
            case LinkSetMac():
                self.links[op.name] = dataclasses.replace(self.links[op.name], mac=op.mac,
                                                          mac_pinned=True)
            case NeighReplace():
                index = self.links[op.link].index
                self.neighbours = [n for n in self.neighbours
                                   if (n.index, n.address) != (index, op.address)]
                self.neighbours.append(LiveNeighbour(index, op.address, op.mac, False,
                                                     extern_learn=True,
                                                     protocol=NEIGH_PROTO))
            case NeighDelete():
                link = self.links.get(op.link)
                self.neighbours = [n for n in self.neighbours if link is None
                                   or (n.index, n.address) != (link.index, op.address)]
            case LinkSetHairpin():
                link = self.links[op.name]
                assert link.master is not None, "hairpin of a link that is no bridge port"
                self.links[op.name] = dataclasses.replace(link, hairpin=op.on)
            case NetnsCreate():
                self._create_netns(op.name, op.replace_stale, op.mark)
            case NetnsDelete():
                ns = self.netns.pop(op.name, None)
                if ns is not None:  # its veth goes with it (the kernel does it asynchronously)
                    self.links = {n: lk for n, lk in self.links.items()
                                  if lk.kind != "veth" or lk.peer_netnsid != ns.nsid}
            case AllocAttach():
                self._attach(op.veth, op.netns, op.bridge, op.mtu, op.hairpin, op.mac)
            case AllocConfigure():
                self._configure(op)
            case RouteDelDefault():
                ns = self.netns[op.netns]
                ns.routes = [r for r in ns.routes if not (
                    r.dst == "default" and r.gateway is not None
                    and ipaddress.ip_address(r.gateway).version == op.version)]
            case AddrAdd() | AddrDel():
                links = self.links if op.netns is None else self.netns[op.netns].links
                link = links[op.link]
                iface = op.interface()
                addrs = [x for x in link.addresses if x.address != iface]
                if isinstance(op, AddrAdd):
                    addrs.append(LiveAddress(iface, True))
                links[op.link] = dataclasses.replace(link, addresses=tuple(addrs))
            case SysctlSet():
                self.sysctls[op.key] = op.value
            case FirewallNft():
                self.table.apply(op)
                for family, script in ((4, op.cleanup4), (6, op.cleanup6)):
                    if script:
                        self.fw[family].restore(script)
            case FirewallShim():
                assert not op.legacy, "the fake host has no iptables-legacy"
                rules = self.fw[op.family].chains[("filter", op.chain)]
                if op.position:
                    rules.insert(op.position - 1, op.rule)
                elif op.rule in rules:
                    rules.remove(op.rule)
            case ConntrackDelete():
                self.conntrack_deleted += [(op.family, str(m)) for m in op.stale_maps()]
            case _:
                raise AssertionError(f"fake host does not know op {op.NAME}")

    # allocation namespaces, as the kernel would do them
    def _random_mac(self) -> str:
        """What the kernel gives a link created without a MAC (here: a new one each time)."""
        self._next_index += 1
        return f"0a:00:00:00:{self._next_index >> 8 & 0xff:02x}:{self._next_index & 0xff:02x}"

    def _create_netns(self, name: str, replace_stale: bool, mark: str | None) -> None:
        ns = self.netns.get(name)
        if ns is not None and ns.usable:
            return
        if ns is not None and not replace_stale:
            raise AssertionError(f"netns {name}: empty file and no replace_stale")
        self._next_nsid += 1
        lo = LiveLink("lo", 1, "", 65536, mark is not None, False, alias=mark)
        self.netns[name] = FakeNetns(self._next_nsid, {"lo": lo}, file_mark=mark)

    def _delete_link(self, name: str, netns: str | None) -> None:
        if netns is None:
            link = self.links.pop(name, None)
            if link is not None:  # like the kernel: its neighbour entries go with it
                self.neighbours = [n for n in self.neighbours if n.index != link.index]
            if link is not None and link.kind == "veth":  # the peer goes too
                for ns in self.netns.values():
                    if ns.nsid == link.peer_netnsid:
                        ns.links.pop("eth0", None)
                        ns.routes.clear()
        else:
            ns = self.netns[netns]
            if ns.links.pop(name, None) is not None:
                ns.routes.clear()
                self.links = {n: lk for n, lk in self.links.items()
                              if lk.kind != "veth" or lk.peer_netnsid != ns.nsid}

    def _attach(self, veth: str, netns: str, bridge: str, mtu: int | None,
                hairpin: bool, mac: str | None = None) -> None:
        ns = self.netns[netns]
        assert ns.usable and bridge in self.links
        if veth in self.links:
            assert self.links[veth].peer_netnsid == ns.nsid, "orphan veth (EDGE 8)"
        else:
            assert "eth0" not in ns.links, "eth0 already exists (EDGE 9)"
            self._next_index += 1
            ns.links["eth0"] = LiveLink("eth0", 2, "veth", mtu or 1500, False, False,
                                        mac=mac or self._random_mac())
            self._fresh[netns] = bridge
        self._next_index += 1
        self.links[veth] = LiveLink(veth, self._next_index, "veth", mtu or 1500, True, True,
                                    alias=LINK_ALIAS, master=bridge, hairpin=hairpin,
                                    peer_netnsid=ns.nsid)

    def _configure(self, op: AllocConfigure) -> None:
        ns = self.netns[op.netns]
        bridge = self.links.get(self._fresh.pop(op.netns, ""))
        mac = ns.links["eth0"].mac
        if bridge is not None and mac is not None:
            # like the kernel: created, never replaced; exempt from GC and marked ours
            have = {(n.index, n.address) for n in self.neighbours}
            self.neighbours += [LiveNeighbour(bridge.index, str(i.ip), mac, False,
                                              extern_learn=True, protocol=NEIGH_PROTO)
                                for i in op.interfaces() if (bridge.index, str(i.ip)) not in have]
        ns.links["lo"] = dataclasses.replace(ns.links["lo"], up=True, alias=op.mark)
        eth0 = ns.links["eth0"]
        addrs = list(eth0.addresses)
        for iface in op.interfaces():
            if all(y.address != iface for y in addrs):
                addrs.append(LiveAddress(iface, True))
        ns.links["eth0"] = dataclasses.replace(
            eth0, up=True, owned=True, alias=LINK_ALIAS, addresses=tuple(addrs),
            mtu=op.mtu if op.mtu is not None else eth0.mtu)
        for gw in op.gateway_ips():
            ns.routes = [r for r in ns.routes if not (
                r.dst == "default" and r.gateway is not None
                and ipaddress.ip_address(r.gateway).version == gw.version)]
            ns.routes.append(LiveRoute("default", str(gw), True))
