"""An in-memory host for unit tests: it runs plan ops and is observed like the real one."""

from __future__ import annotations

import dataclasses
import ipaddress
import shlex

from reconciler.live import LiveAddress, LiveChainSet, LiveLink, LiveState
from reconciler.model import DesiredState
from reconciler.plan import Op


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

    # Observer interface
    def observe(self, desired: DesiredState) -> LiveState:
        return LiveState(links=dict(self.links), firewall4=self.fw[4].live(),
                         firewall6=self.fw[6].live(), sysctls=dict(self.sysctls))

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
            self.links[a["name"]] = dataclasses.replace(
                link, mtu=a.get("mtu", link.mtu), up=a.get("up", link.up),
                owned=True if a.get("owned") else link.owned)
        elif op.name == "link.delete":
            self.links.pop(a["name"], None)
        elif op.name in ("addr.add", "addr.del"):
            link = self.links[a["link"]]
            iface = ipaddress.ip_interface(a["address"])
            addrs = [x for x in link.addresses if x.address != iface]
            if op.name == "addr.add":
                addrs.append(LiveAddress(iface, True))
            self.links[a["link"]] = dataclasses.replace(link, addresses=tuple(addrs))
        elif op.name == "sysctl.set":
            self.sysctls[a["key"]] = a["value"]
        elif op.name == "firewall.restore":
            self.fw[a["family"]].restore(a["script"])
        else:
            raise AssertionError(f"fake host does not know op {op.name}")
