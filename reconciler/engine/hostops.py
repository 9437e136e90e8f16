"""The real OpRunner: performs each plan op through the driver that does it.

This is the single gate for side effects: nothing else in the reconciler
changes the host. An op is decoded into its typed form
(``reconciler.domain.ops``) and dispatched on its class.

See docs/decisions/006-plans-are-values.md.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, assert_never

from reconciler.domain import nftable, ownership
from reconciler.domain.errors import DriverError, ReconcilerError, StrandedError, TemporaryError
from reconciler.domain.live import LiveDockerNetwork
from reconciler.domain.ops import (
    AddrAdd,
    AddrDel,
    AllocAttach,
    AllocConfigure,
    ConntrackDelete,
    DockerDedupe,
    DockerEnsure,
    DockerRemove,
    DockerReplace,
    DockerRestore,
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
from reconciler.domain.plan import Op
from reconciler.drivers import netns, procfs, sysctl
from reconciler.drivers.docker.replacement import Replacement
from reconciler.drivers.docker.results import EnsureResult
from reconciler.drivers.iptables import IptablesDriver
from reconciler.drivers.netlink.client import Netlink
from reconciler.engine import optiming
from reconciler.engine.handles import HostHandles
from reconciler.engine.journal import DOCKER, Journal, Journals, ReplaceSteps

if TYPE_CHECKING:
    from reconciler.drivers.docker.client import DockerDriver

log = logging.getLogger("reconciler")


class HostOps:
    """Performs plan ops through the host's drivers (``HostHandles``, shared with observation)."""

    def __init__(self, handles: HostHandles | None = None,
                 journals: Journals | None = None) -> None:
        self.handles = handles or HostHandles()
        #: where multi-step changes record what they need to be finished (engine/journal)
        self.journals = journals or Journals()
        #: network namespace inode -> pids in it, scanned once per pass (``new_pass``)
        self._members: dict[int, tuple[int, ...]] | None = None

    def new_pass(self) -> None:
        """Forget what was read of processes and bridges: a new plan is executed, it may be stale
        now."""
        self._members = None
        self.netlink.new_pass()

    @property
    def netlink(self) -> Netlink:
        return self.handles.netlink

    @property
    def docker(self) -> DockerDriver:
        return self.handles.docker

    def iptables(self, family: int) -> IptablesDriver:
        return self.handles.iptables(family)

    def run(self, op: Op) -> None:
        """Perform one plan op; ``OpError`` if it is not one of ours or is malformed."""
        typed = decode(op)
        optiming.timed(op.name, lambda: self.perform(typed))

    def perform(self, op: TypedOp) -> None:
        """Perform one typed op: one case per op class (mypy checks that none is missing)."""
        match op:
            case LinkAddBridge():
                self.netlink.ensure_bridge(op.name, op.mtu, ownership.LINK_ALIAS, mac=op.mac)
            case LinkSet():
                self.netlink.set_link(op.name, mtu=op.mtu, up=op.up, master=op.master,
                                      ns=op.netns,
                                      alias=ownership.LINK_ALIAS if op.owned else None)
            case LinkDelete():
                self.netlink.delete_link(op.name, op.netns)
            case LinkSetHairpin():
                self.netlink.set_hairpin(op.name, op.on)
            case LinkSetMac():
                self.netlink.set_mac(op.name, op.mac, op.netns)
            case NeighReplace():
                self.netlink.replace_neighbour(op.link, op.ip(), op.mac)
            case NeighDelete():
                self.netlink.delete_neighbour(op.link, op.ip())
            case AddrAdd():
                self._add_address(op)
            case AddrDel():
                self.netlink.del_address(op.link, op.interface(), ns=op.netns)
            case RouteDelDefault():
                self.netlink.del_default_route(op.version, ns=op.netns)
            case NetnsCreate():
                self.netlink.create_netns(op.name, replace_stale=op.replace_stale, mark=op.mark)
            case NetnsDelete():
                self._delete_netns(op.name)
            case AllocAttach():
                self.netlink.create_veth_into_netns(op.veth, op.netns, op.bridge, op.mtu,
                                                    op.hairpin, mac=op.mac)
            case AllocConfigure():
                # op.ipv6 is not read: eth0 never has a link-local address (see
                # Netlink.configure_inside); the field stays for the plans that carry it
                self.netlink.configure_inside(op.netns, op.interfaces(), op.gateway_ips(),
                                              mtu=op.mtu, mark=op.mark, announce=op.announce)
                if op.mark is not None:  # what ownership rests on: an adopted file has none
                    netns.ensure_file_mark(op.netns, op.mark)
            case SysctlSet():
                self._set_sysctl(op)
            case FirewallNft():
                self._firewall_nft(op)
            case FirewallShim():
                self.iptables(op.family).shim(op.legacy, op.chain, op.rule, op.position)
            case DockerEnsure():
                self._docker_ensure(op)
            case DockerReplace():
                self._docker_replace(op)
            case DockerDedupe():
                result = self.docker.dedupe(op.name)
                self._docker_report(op.name, (), result.removed)
            case DockerRemove():
                self.docker.remove(op.id)  # False when already gone: idempotent
            case DockerRestore():
                self._docker_restore(op)
            case ConntrackDelete():
                self._conntrack_delete(op)
            case _:
                assert_never(op)

    def _firewall_nft(self, op: FirewallNft) -> None:
        """Change our table in one transaction, then remove the iptables chains it replaces
        (their rules and ours overlap meanwhile: the same packets pass both the same way)."""
        add, delete = op.entries()
        if op.drop_table:
            commands = nftable.drop()
        elif op.rebuild:
            commands = nftable.rebuild(op.mark, add, exists=True)
        else:
            commands = (nftable.element_commands("delete", delete)
                        + nftable.element_commands("add", add))
        self.handles.nft.apply(commands)
        for family, script in ((4, op.cleanup4), (6, op.cleanup6)):
            if script:
                self.iptables(family).restore(script)

    def _add_address(self, op: AddrAdd) -> None:
        iface = op.interface()
        if iface.version == 6 and op.netns is None:
            # An IPv6 address on a host link is a subnet's gateway on its bridge (the only
            # AddrAdd the planner makes), and a bridge routing for an IPv6 subnet needs a
            # usable link-local address: the kernel sends the neighbour solicitations of
            # packets it forwards from it and sends none while it is tentative
            # (ndisc_send_ns), so the first connection from elsewhere to a new allocation
            # was lost. Bridges are created with address generation off
            # (Netlink.ensure_bridge); turn it on without DAD (on a segment of our own
            # allocations only a MAC clash could duplicate it) and the kernel makes it at
            # once. A link that has generation on is left as it is.
            conf = f"net/ipv6/conf/{op.link}"
            if sysctl.read(f"{conf}/addr_gen_mode") == "1":  # none
                default = sysctl.read("net/ipv6/conf/default/addr_gen_mode")
                sysctl.write(f"{conf}/accept_dad", "0")
                sysctl.write(f"{conf}/addr_gen_mode", default if default not in
                             (None, "1") else "0")
        self.netlink.add_address(op.link, iface, ns=op.netns)

    def _set_sysctl(self, op: SysctlSet) -> None:
        sysctl.write(op.key, op.value)
        parts = op.key.split("/")
        if (len(parts) == 5 and parts[:3] == ["net", "ipv6", "conf"]
                and parts[4] == "addr_gen_mode" and op.value == "1"
                and parts[3] not in ("all", "default")):
            # a revert turning a bridge's address generation back off (``_add_address``
            # turned it on): the kernel keeps the link-local address it made, which the
            # bridge did not have before
            self.netlink.del_link_local_addresses(parts[3])

    def _delete_netns(self, name: str) -> None:
        """Run ``ip netns del``; a namespace processes still hold also loses its veth, now.

        Unmounted, a namespace lives on while anything holds it (a process inside, an
        ``nsenter``) and so does its veth on the bridge: the next observation saw an
        orphan. The holders are named, since the namespace stays theirs. The alloc's
        rules went with the firewall transaction. Other holders (a socket another
        process opened inside) are not seen in /proc: their veth goes when they do.
        """
        try:
            inode = netns.namespace_inode(name)
        except OSError:
            inode = None
        if inode is not None and self._members is None:
            self._members = procfs.netns_members()
        holders = self._members.get(inode, ()) if inode is not None and self._members else ()
        holders = tuple(p for p in holders if p != os.getpid())
        self.netlink.delete_netns(name)
        if not holders:
            return
        # by its mark, not its name: a link someone else called vr<hex> is not our veth
        veth = ownership.alloc_veth_name(name)
        link = self.netlink.get_link(veth)
        ours = link is not None and link.kind == "veth" and link.owned
        if ours:
            self.netlink.delete_link(veth)
        named = ", ".join(f"pid {pid} ({procfs.process_name(pid)})" for pid in holders[:5])
        more = f" and {len(holders) - 5} more" if len(holders) > 5 else ""
        log.warning("alloc %s: its namespace is still held by %s%s; removed %s", name, named,
                    more, "its veth and rules" if ours else
                    f"its rules (the link {veth} is no veth of ours: left alone)")

    def _conntrack_delete(self, op: ConntrackDelete) -> None:
        gone = self.handles.conntrack.delete_port_flows(op.family, op.stale_maps())
        if gone:
            log.info("conntrack: deleted %d stale IPv%d entr%s of %s", len(gone), op.family,
                     "y" if len(gone) == 1 else "ies", ", ".join(op.maps))

    @staticmethod
    def _docker_report(name: str, warnings: tuple[str, ...], removed: tuple[str, ...]) -> None:
        # e.g. kind's IPv4-only fallback: the user must see it, whatever the log level
        for w in warnings:
            log.warning("%s", w)
        if removed:
            log.info("docker network %s: removed duplicate(s) %s", name,
                     ", ".join(r[:12] for r in removed))

    def _docker_ensure(self, op: DockerEnsure) -> None:
        spec = op.network()
        result = self.docker.ensure(spec, op.default_mtu)
        self._docker_report(spec.name, result.warnings, result.removed_duplicates)

    def _docker_replace(self, op: DockerReplace) -> None:
        """Replace a network; with containers attached, journalled (``engine/journal``).

        The journal is written before the first disconnect and removed once the
        replace reached its end (done, or undone and reported). It stays when the
        daemon went away midway (a ``TemporaryError``: also a container that could
        not be put back) or another's network of that name is in the way (a
        ``StrandedError``): the executor's retry of this op, or the next run, carries
        the same replace on from its last step rather than starting a new one on a
        network that may be gone already.
        """
        spec = op.network()
        interrupted = self.journals.find(DOCKER, spec.name)
        if interrupted is not None:
            result = self.resume_docker_replace(interrupted)
            if result.undone:  # ended, but not as this op asks: the change failed
                raise DriverError(f"docker network {spec.name}: replace: given up; "
                                  f"{len(result.reconnected)} container(s) back on the old "
                                  "network")
        else:
            # replace() re-inspects the network by ID; only the ID and name matter here
            live = LiveDockerNetwork(id=op.id, name=spec.name, driver="", labels={},
                                     options={}, enable_ipv6=False, internal=False,
                                     subnets=(), containers=0)
            steps = ReplaceSteps(self.journals, spec.name)
            try:
                result = self.docker.replace(spec, live, op.default_mtu, op.reconnect,
                                             adopt=op.adopt, steps=steps)
            except (TemporaryError, StrandedError):  # containers may still be detached
                raise
            except ReconcilerError:  # reached its end, reported: undone or failed for good
                steps.close()
                raise
            steps.close()
        self._docker_report(spec.name, result.warnings, result.removed_duplicates)
        if result.reconnected:
            log.info("docker network %s: reconnected %s", spec.name,
                     ", ".join(result.reconnected))

    def resume_docker_replace(self, journal: Journal) -> EnsureResult:
        """Carry the interrupted replace ``journal`` describes to its end; the journal is
        removed unless a ``TemporaryError`` (the daemon unreachable) or a ``StrandedError``
        (another's network of that name in the way) stopped it again.

        ValueError (or KeyError, TypeError) when its body is not a replacement this
        version wrote; nothing is changed then.
        """
        replacement = Replacement.from_json(journal.body)
        steps = ReplaceSteps(self.journals, journal.name, journal)
        try:
            result = self.docker.resume_replace(replacement, frozenset(journal.steps), steps)
        except (TemporaryError, StrandedError):
            raise
        except ReconcilerError:
            steps.close()
            raise
        steps.close()
        return result

    def _docker_restore(self, op: DockerRestore) -> None:
        point = op.point()
        gone = self.docker.restore_network(point, op.replace_id).gone
        back = [e.name or e.container[:12] for e in point.endpoints
                if (e.name or e.container[:12]) not in gone]
        if back:
            log.info("docker network %s: restored with %s", point.name, ", ".join(back))
        if gone:
            log.warning("docker network %s: restored; not re-attached, removed since the "
                        "checkpoint: %s", point.name, ", ".join(gone))
