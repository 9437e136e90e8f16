"""What the live state says of an allocation: its namespace, veth pair and addresses.

See docs/decisions/001-ownership-on-the-objects.md.
"""

from __future__ import annotations

import ipaddress

from reconciler.domain.live import LiveLink, LiveNetns, LiveState
from reconciler.domain.ownership import ALLOC_IFNAME, alloc_ns_marks, host_inode
from reconciler.planner.context import PlanContext

IPAddr = ipaddress.IPv4Address | ipaddress.IPv6Address


def is_ours(ctx: PlanContext, ns: LiveNetns | None) -> bool:
    """Return whether ``ns`` is an allocation namespace of this host (``owned_ns``)."""
    return owned_ns(ctx.live.host_id, ns)


def owned_ns(host_id: str, ns: LiveNetns | None) -> bool:
    """Tell whether ``ns`` is an allocation namespace of the host ``host_id``: its file under
    /run/netns carries our mark, which nothing inside the namespace can write (a workload
    with NET_ADMIN can rewrite ``lo``'s alias). Only a file without a mark (made before
    files were marked) falls back to ``lo``'s alias: our mark, or an earlier version's
    (observation reads an undeclared namespace with that one only when its veth pair joins
    it to this host, ``ownership.alloc_ns_marks``)."""
    if ns is None or not ns.usable:
        return False
    if ns.file_mark is not None:
        return ns.file_mark in alloc_ns_marks(host_id)
    lo = inner_link(ns, "lo")
    return lo is not None and lo.alias in alloc_ns_marks(host_id)


def veth_pair_ok(ns: LiveNetns, veth: LiveLink | None) -> bool:
    """Tell whether the allocation's veth pair is whole: the host end and ``eth0`` inside, one
    pair."""
    eth0 = inner_link(ns, ALLOC_IFNAME)
    return (veth is not None and eth0 is not None and eth0.kind == "veth"
            and veth.kind == "veth" and (ns.nsid is None or veth.peer_netnsid in
                                         (None, ns.nsid)))


def inner_link(ns: LiveNetns | None, name: str) -> LiveLink | None:
    if ns is None:
        return None
    return next((lk for lk in ns.links if lk.name == name), None)


def is_own_namespace(ctx: PlanContext, ns: LiveNetns | None) -> bool:
    """Tell whether ``ns`` is the namespace the reconciler runs in (``--netns X``'s X, or the host's
    own bind-mounted under /run/netns): never an allocation's, to adopt, fill or delete. Its own
    veth in it would be a loop, and deleting it unmounts the sandbox itself."""
    return (ns is not None and ns.inode is not None
            and str(ns.inode) == host_inode(ctx.live.host_id))


def veth_is_ours(ctx: PlanContext, aid: str, veth: LiveLink, ns: LiveNetns | None) -> bool:
    """Tell whether the host link named ``alloc_veth_name(aid)`` may be changed or deleted. Its name
    proves nothing (anyone may call a link ``vr`` + 12 hex): a veth that carries our mark,
    or a veth whose peer is inside this allocation's namespace (ours, or being adopted) —
    what a crash between the veth's creation and its marking leaves."""
    if veth.kind != "veth":
        return False
    if veth.owned:
        return True
    return (ns is not None and ns.usable and ns.nsid is not None
            and veth.peer_netnsid == ns.nsid
            and (is_ours(ctx, ns) or ctx.adopted("alloc", aid)))


def peer_held(live: LiveState, veth: LiveLink) -> str | None:
    """Return the name of the live namespace under /run/netns that holds the peer of ``veth``
    while it is not read as an allocation of ours (``LiveState.peer_namespaces``), or None:
    such a veth is no orphan, whatever the marks say."""
    return live.peer_namespaces.get(veth.peer_netnsid) if veth.peer_netnsid is not None else None


def peer_held_warning(veth: str, namespace: str) -> str:
    return (f"veth {veth}: its peer is in /run/netns/{namespace}, a live namespace without "
            "this host's mark: left alone, not an orphan")


def describe_link(lk: LiveLink) -> str:
    """Describe a link for a plan line, ``veth 10.77.0.50/24``: what a deletion takes with it."""
    addrs = " ".join(sorted(str(x.address) for x in lk.addresses))
    return f"{lk.kind or 'link'}{' ' + addrs if addrs else ''}"


def live_addr(ctx: PlanContext, aid: str, version: int) -> IPAddr | None:
    ns = ctx.live.netns.get(aid)
    if not is_ours(ctx, ns):
        return None
    eth0 = inner_link(ns, ALLOC_IFNAME)
    for a in (eth0.addresses if eth0 else ()):
        if a.owned and a.address.version == version:
            return a.address.ip
    return None
