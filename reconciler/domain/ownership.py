"""Markers that prove the reconciler created an object.

They live on the objects themselves, so they survive a restart of the
reconciler and need no side file that could be lost or go stale.

See docs/decisions/001-ownership-on-the-objects.md.
See docs/decisions/010-stable-identities.md.
"""

from __future__ import annotations

import hashlib
import re

#: IFLA_IFALIAS of every link we create (bridges, alloc veths).
LINK_ALIAS = "managed-by=reconciler"

#: IFA_PROTO of every address we add (kernel >= 5.18 keeps it; ``ip -d addr``
#: shows it as ``proto 0x52``). 0x52 is 'R' and no routing daemon uses it.
ADDR_PROTO = 0x52

#: rtm_protocol of every route we add inside allocation namespaces.
ROUTE_PROTO = 0x52

#: NDA_PROTOCOL of every neighbour entry we make (seeded for a new allocation, or
#: replaced; kernel >= 5.2 keeps it, ``ip neigh`` shows ``proto 82``). With the
#: ``extern_learn`` flag they carry too, the mark that lets a plan delete one whose
#: allocation is gone (``planner.allocs.own_neighbour``).
NEIGH_PROTO = 0x52

#: Docker label on every network we create.
DOCKER_LABEL = "io.reconciler.managed"
DOCKER_LABEL_VALUE = "true"

#: Prefix of every iptables chain we own, and the comment on our jump rules.
CHAIN_PREFIX = "RECONCILER-"
RULE_COMMENT = "reconciler"


def is_owned_alias(alias: str | None) -> bool:
    return alias == LINK_ALIAS


def alloc_veth_name(alloc_id: str) -> str:
    """Return the host-side veth name of an allocation: ``vr`` + 12 hex of sha1(id) (14 < IFNAMSIZ).

    Deterministic, so a restarted reconciler finds its veths again; 48 bits of
    hash make a collision among thousands of allocations negligible.
    """
    return "vr" + hashlib.sha1(alloc_id.encode()).hexdigest()[:12]


#: prefix of the name a bridge has between its creation and its rename (drivers/netlink)
TEMP_BRIDGE_PREFIX = "rcltmp"

#: link names the reconciler gives its own objects: a declared link of such a name would be
#: taken for (or collide with) one of them, so the loader refuses it (pattern, what it is)
RESERVED_LINK_NAMES = (
    (re.compile(r"vr[0-9a-f]{12}"), "the host-side veth name of an allocation (vr + 12 hex)"),
    (re.compile(TEMP_BRIDGE_PREFIX + r"[0-9a-f]{8}"),
     "the temporary name of a bridge being created (rcltmp + 8 hex)"),
    (re.compile(r"rcprobe[0-9a-f]{8}"),
     "the host end of the probes' external vantage link (rcprobe + 8 hex)"),
)

#: alias of the host end of the probes' external vantage link, and the mark on its
#: namespace's file: ours, but not an allocation's (``LINK_ALIAS`` would have the planner
#: prune it as an orphan veth)
PROBE_VANTAGE_ALIAS = "managed-by=reconciler probe-vantage"


def probe_vantage_names(host_id: str) -> tuple[str, str]:
    """Return (namespace, host link) of the external probe vantage of the host ``host_id``.

    Per host (the network namespace we act on), so the host and its sandboxes each have
    their own and a crash's leftover is found again by the next run of the same host.
    One per host, not one per prober: the link's /30 and /126
    (``domain.probes.VANTAGE_NETS``) can be routed on one link only; several probers of a
    host share it under a lock
    (``engine.probes.VantageLease``).
    """
    host = host_inode(host_id)  # held only from inside the live namespace: the inode will do
    return (f"rcprobe-{host}",
            "rcprobe" + hashlib.sha1(host.encode()).hexdigest()[:8])


#: namespace names the reconciler gives its own namespaces that are not allocations: an
#: allocation of such an id would be taken for (and removed as) the probes' vantage
RESERVED_NETNS_NAMES = (
    (re.compile(r"rcprobe-[0-9]+(-.*)?"), "the probes' external vantage namespace "
                                          "(rcprobe-<host inode>)"),
)


def reserved_netns_name(name: str) -> str | None:
    """Return what reserved namespace pattern ``name`` is in, or None."""
    for pattern, what in RESERVED_NETNS_NAMES:
        if pattern.fullmatch(name):
            return what
    return None


def reserved_link_name(name: str) -> str | None:
    """Return what reserved pattern ``name`` is in, or None."""
    for pattern, what in RESERVED_LINK_NAMES:
        if pattern.fullmatch(name):
            return what
    return None


def alloc_ns_alias(host_id: str) -> str:
    """Return the alias of ``lo`` inside an allocation namespace, set before the namespace is
    mounted (and the mark on its file under /run/netns).

    It names the host (``nsfs.current_id``: the inode and the cookie of the network
    namespace the reconciler acts on) so two reconcilers on one machine — the host and
    a ``--netns`` sandbox — never take each other's allocations for their own, nor does
    a sandbox that got the inode of a deleted one take the dead one's.
    """
    return f"{LINK_ALIAS} alloc-of={host_id}"


def host_inode(host_id: str) -> str:
    """Return the inode part of a host id (``<inode>-<cookie>``; an id without a cookie is the
    inode: an earlier version's, or a kernel before 5.14)."""
    return host_id.partition("-")[0]


def alloc_ns_marks(host_id: str) -> tuple[str, ...]:
    """Return the marks that can say an allocation namespace is the host ``host_id``'s: its
    own, then the one versions before the cookie gave (the inode alone).

    The inode alone cannot tell this host from a deleted one that had its inode, so that
    old mark counts only where something else says the namespace is ours: it is declared,
    or its veth pair joins it to this host (``engine.observe``); a plan then marks it anew.
    """
    legacy = host_inode(host_id)
    if legacy == host_id:
        return (alloc_ns_alias(host_id),)
    return (alloc_ns_alias(host_id), alloc_ns_alias(legacy))


#: name of the allocation's interface inside its namespace
ALLOC_IFNAME = "eth0"


# -- stable MAC addresses ---------------------------------------------------------------

#: what a derived MAC hashes before the name: an allocation's ``eth0`` and a bridge differ,
#: so an allocation id and a bridge name that are the same string never share a MAC
ALLOC_MAC_PREFIX = b"reconciler/alloc-mac/"
BRIDGE_MAC_PREFIX = b"reconciler/bridge-mac/"
TEMP_BRIDGE_MAC_PREFIX = b"reconciler/temp-bridge-mac/"

#: a bridge with no port and no address of its own reports this (it follows its ports)
ZERO_MAC = "00:00:00:00:00:00"


def derived_mac(prefix: bytes, name: str) -> str:
    """Return a MAC of six bytes of sha256(prefix + name): locally administered, unicast.

    The first octet's two low bits are forced to ``10`` (bit 1 set: locally
    administered, so it can never be a vendor's address; bit 0 clear:
    unicast), which leaves 46 bits of hash. Pure and fixed: the same name
    gives the same MAC across heals, restarts and versions (a unit test pins
    one value).
    """
    raw = bytearray(hashlib.sha256(prefix + name.encode()).digest()[:6])
    raw[0] = (raw[0] & 0xFC) | 0x02
    return raw.hex(":")


def alloc_mac(alloc_id: str) -> str:
    """Return the MAC of an allocation's ``eth0``: whoever caches it (the bridge's neighbour
    entry, a client's) stays right when ``eth0`` is re-created."""
    return derived_mac(ALLOC_MAC_PREFIX, alloc_id)


def bridge_mac(name: str) -> str:
    """Return the MAC a bridge is created with: set, so it no longer follows its lowest port
    (and is not 00:00:00:00:00:00 without ports), and every allocation's cached
    gateway MAC stays right as allocations come and go."""
    return derived_mac(BRIDGE_MAC_PREFIX, name)


def temp_bridge_mac(temp_name: str) -> str:
    """Return the MAC a bridge has under its temporary name (``rcltmp`` + 8 hex), given in the
    creation message itself: the kernel ignores an alias there, so until the bridge is
    marked this MAC is the mark a crash leaves on it. A leftover is deleted only when it
    has it (46 bits of hash of its own name: no other tool's bridge has it by chance)."""
    return derived_mac(TEMP_BRIDGE_MAC_PREFIX, temp_name)
