"""Announcing an allocation's addresses: ``arp_notify`` and ``ndisc_notify`` on its ``eth0``.

Whoever cached the old MAC of an address (the bridge's neighbour entry, the ARP
cache of a neighbour on the segment) must learn the new one at once, not when
its entry times out (tens of seconds). With both settings on, the kernel sends,
from inside the namespace, a gratuitous ARP request (sender = target = the
address, broadcast: it updates an existing entry even where ``arp_accept`` is
off) and an unsolicited neighbour advertisement (to ff02::1, hop limit 255,
override flag, target link-layer address option) for every address the link
has when it comes up, and again when its MAC changes or peers are to be
notified (``inetdev_event``, ``ndisc_netdev_event``). ``Netlink.configure_inside``
adds the addresses before it brings ``eth0`` up for that.

Why not frames of our own from an AF_PACKET socket: closing one waits for an
RCU grace period (``packet_release`` -> ``synchronize_net``), measured 9-13 ms
here, more than building the allocation costs. The kernel's frames are the same
frames, from the same place, for free.

``/proc/sys/net`` is per network namespace of whoever opens it, so
:func:`enable_notify` runs inside the namespace (``create_netns``'s ``init``
sets the namespace's defaults, which its links are born with; a namespace made
by an earlier version is entered).
"""

from __future__ import annotations

import contextlib
import os


def enable_notify(ifname: str) -> None:
    """``arp_notify`` and ``ndisc_notify`` on for ``ifname`` (``default``: links made later)
    of the namespace the calling thread is in. A missing file (no IPv6) is skipped."""
    for key in (f"ipv4/conf/{ifname}/arp_notify", f"ipv6/conf/{ifname}/ndisc_notify"):
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(f"/proc/sys/net/{key}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
