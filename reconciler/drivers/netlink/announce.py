"""Announcing an allocation's addresses: ``arp_notify`` and ``ndisc_notify`` on its ``eth0``.

Whoever cached the old MAC of an address (the bridge's neighbour entry, the ARP
cache of a neighbour on the segment) must learn the new one at once, not when
its entry times out (tens of seconds). With both settings on, the kernel sends,
from inside the namespace, a gratuitous ARP request (sender = target = the
address, broadcast: it updates an existing entry even where ``arp_accept`` is
off) and an unsolicited neighbour advertisement (to ff02::1, hop limit 255,
override flag, target link-layer address option) for every address the link
has when its MAC changes or peers are to be notified (``inetdev_event``,
``ndisc_netdev_event``); ``Netlink.configure_inside`` sets ``eth0``'s MAC to its
own value for that, only when the plan says the allocation announces.

Each announcement is flooded to every port of the bridge, so announcing every
new allocation made a bulk create quadratic; the settings themselves cost
nothing on the wire: ``eth0`` is up before it has an address (nothing to
announce at NETDEV_UP), and its addresses are added without DAD (no NA when
they are).

``arp_notify`` is set in the netlink message that brings ``eth0`` up (IFLA_AF_SPEC,
``messages.arp_notify_on``). IPv6 has no netlink setter for ``ndisc_notify``:
:func:`enable_ndisc_notify` writes ``/proc/sys/net``, which is per network
namespace of whoever opens it, from inside the namespace, for allocations with
IPv6 only.

Why not frames of our own from an AF_PACKET socket: closing one waits for an
RCU grace period (``packet_release`` -> ``synchronize_net``), measured 9-13 ms
here, more than building the allocation costs. The kernel's frames are the same
frames, from the same place, for free.
"""

from __future__ import annotations

import contextlib
import os


def enable_ndisc_notify(ifname: str) -> None:
    """Turn ``ndisc_notify`` on for ``ifname`` of the namespace the calling thread is in.
    A missing file (no IPv6) is skipped."""
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(f"/proc/sys/net/ipv6/conf/{ifname}/ndisc_notify",
                     os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"1")
        finally:
            os.close(fd)
