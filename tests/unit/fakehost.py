"""An in-memory host for unit tests: it runs plan ops and is observed like the real one."""

from __future__ import annotations

import dataclasses
import ipaddress
import shlex
from dataclasses import dataclass, field

from reconciler.domain.live import (
    LiveAddress,
    LiveChainSet,
    LiveLink,
    LiveNetns,
    LiveRoute,
    LiveState,
)
from reconciler.domain.model import DesiredState
from reconciler.domain.ownership import LINK_ALIAS, alloc_ns_alias
from reconciler.domain.plan import Op

HOST_ID = "4026531840"


@dataclass
class FakeNetns:
    """An allocation namespace: its links by name and its routes."""

    nsid: int
    links: dict[str, LiveLink] = field(default_factory=dict)
    routes: list[LiveRoute] = field(default_factory=list)
    usable: bool = True

    def live(self, name: str) -> LiveNetns:
        if not self.usable:
            return LiveNetns(name, usable=False)
        return LiveNetns(name, True, tuple(self.links.values()), tuple(self.routes), self.nsid)


class FakeFirewall:
    """Interprets the iptables-restore --noflush scripts the planner writes."""

    BUILTIN = {"filter": ("INPUT", "FORWARD", "OUTPUT"),
               "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")}

    def __init__(self) -> None:
        self.chains: dict[tuple[str, str], list[str]] = {}
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
        return LiveChainSet(True, {k: tuple(v) for k, v in self.chains.items()})


class FakeHost:
    """Observer + OpRunner in one, over in-memory state."""

    def __init__(self) -> None:
        self.links: dict[str, LiveLink] = {}
        self.fw = {4: FakeFirewall(), 6: FakeFirewall()}
        self.sysctls = {"net/ipv4/ip_forward": "0", "net/ipv6/conf/all/forwarding": "0"}
        self.ops = self
        self.log: list[Op] = []
        self._next_index = 10
        #: /run/netns as this host's reconciler would see it (allocation namespaces)
        self.netns: dict[str, FakeNetns] = {}
        self.listening: set[tuple[str, int]] = set()
        self.host_id = HOST_ID
        self._next_nsid = 0

    # Observer interface
    def observe(self, desired: DesiredState) -> LiveState:
        mark = alloc_ns_alias(self.host_id)
        # like the real observer: declared names, and undeclared ones that carry our mark
        netns = {name: ns.live(name) for name, ns in sorted(self.netns.items())
                 if name in desired.allocs or (ns.usable and "lo" in ns.links
                                               and ns.links["lo"].alias == mark)}
        return LiveState(host_id=self.host_id, links=dict(self.links),
                         firewall4=self.fw[4].live(), firewall6=self.fw[6].live(),
                         sysctls=dict(self.sysctls), netns=netns,
                         listening=frozenset(self.listening) if desired.allocs
                         else frozenset())

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
        a = op.args
        if op.name == "link.add_bridge":
            if a["name"] not in self.links:
                self._next_index += 1
                self.links[a["name"]] = LiveLink(a["name"], self._next_index, "bridge",
                                                 a.get("mtu") or 1500, True, True)
        elif op.name == "link.set":
            link = self.links[a["name"]]
            master = a.get("master", link.master)
            self.links[a["name"]] = dataclasses.replace(
                link, mtu=a.get("mtu", link.mtu), up=a.get("up", link.up),
                owned=True if a.get("owned") else link.owned, master=master or None,
                # the kernel: a new bridge port starts with hairpin off
                hairpin=(False if master else None) if master != link.master
                else link.hairpin)
        elif op.name == "link.delete":
            self._delete_link(a["name"], a.get("netns"))
        elif op.name == "link.set_hairpin":
            link = self.links[a["name"]]
            assert link.master is not None, "hairpin of a link that is no bridge port"
            self.links[a["name"]] = dataclasses.replace(link, hairpin=a["on"])
        elif op.name == "netns.create":
            self._create_netns(a["name"], a.get("replace_stale", False), a.get("mark"))
        elif op.name == "netns.delete":
            ns = self.netns.pop(a["name"], None)
            if ns is not None:  # its veth goes with it (the kernel does it asynchronously)
                self.links = {n: lk for n, lk in self.links.items()
                              if lk.kind != "veth" or lk.peer_netnsid != ns.nsid}
        elif op.name == "alloc.attach":
            self._attach(a["veth"], a["netns"], a["bridge"], a.get("mtu"), a["hairpin"])
        elif op.name == "alloc.configure":
            self._configure(a)
        elif op.name == "route.del_default":
            ns = self.netns[a["netns"]]
            ns.routes = [r for r in ns.routes if not (
                r.dst == "default" and r.gateway is not None
                and ipaddress.ip_address(r.gateway).version == a["version"])]
        elif op.name in ("addr.add", "addr.del"):
            links = self.links if a.get("netns") is None else self.netns[a["netns"]].links
            link = links[a["link"]]
            iface = ipaddress.ip_interface(a["address"])
            addrs = [x for x in link.addresses if x.address != iface]
            if op.name == "addr.add":
                addrs.append(LiveAddress(iface, True))
            links[a["link"]] = dataclasses.replace(link, addresses=tuple(addrs))
        elif op.name == "sysctl.set":
            self.sysctls[a["key"]] = a["value"]
        elif op.name == "firewall.restore":
            self.fw[a["family"]].restore(a["script"])
        else:
            raise AssertionError(f"fake host does not know op {op.name}")

    # allocation namespaces, as the kernel would do them
    def _create_netns(self, name: str, replace_stale: bool, mark: str | None) -> None:
        ns = self.netns.get(name)
        if ns is not None and ns.usable:
            return
        if ns is not None and not replace_stale:
            raise AssertionError(f"netns {name}: empty file and no replace_stale")
        self._next_nsid += 1
        lo = LiveLink("lo", 1, "", 65536, mark is not None, False, alias=mark)
        self.netns[name] = FakeNetns(self._next_nsid, {"lo": lo})

    def _delete_link(self, name: str, netns: str | None) -> None:
        if netns is None:
            link = self.links.pop(name, None)
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
                hairpin: bool) -> None:
        ns = self.netns[netns]
        assert ns.usable and bridge in self.links
        if veth in self.links:
            assert self.links[veth].peer_netnsid == ns.nsid, "orphan veth (EDGE 8)"
        else:
            assert "eth0" not in ns.links, "eth0 already exists (EDGE 9)"
            self._next_index += 1
            ns.links["eth0"] = LiveLink("eth0", 2, "veth", mtu or 1500, False, False)
        self._next_index += 1
        self.links[veth] = LiveLink(veth, self._next_index, "veth", mtu or 1500, True, True,
                                    alias=LINK_ALIAS, master=bridge, hairpin=hairpin,
                                    peer_netnsid=ns.nsid)

    def _configure(self, a: dict[str, object]) -> None:
        ns = self.netns[str(a["netns"])]
        ns.links["lo"] = dataclasses.replace(ns.links["lo"], up=True, alias=a.get("mark"))
        eth0 = ns.links["eth0"]
        addrs = list(eth0.addresses)
        for x in a["addresses"]:  # type: ignore[attr-defined]
            iface = ipaddress.ip_interface(x)
            if all(y.address != iface for y in addrs):
                addrs.append(LiveAddress(iface, True))
        mtu = a.get("mtu")
        ns.links["eth0"] = dataclasses.replace(
            eth0, up=True, owned=True, alias=LINK_ALIAS, addresses=tuple(addrs),
            mtu=mtu if isinstance(mtu, int) else eth0.mtu)
        for gw in a["gateways"]:  # type: ignore[attr-defined]
            ns.routes = [r for r in ns.routes if not (
                r.dst == "default" and r.gateway is not None
                and ipaddress.ip_address(r.gateway).version == ipaddress.ip_address(gw).version)]
            ns.routes.append(LiveRoute("default", str(gw), True))
