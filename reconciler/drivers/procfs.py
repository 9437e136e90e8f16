"""What /proc tells: the listening sockets of this network namespace, and which processes
are in which network namespace."""

from __future__ import annotations

import os
import re
import socket

#: /proc/thread-self/net: /proc/net is the main thread's namespace, which another
#: thread (the plan server's, the watch loop's) may not share at that moment
_PROC_NET = (("tcp", "/proc/thread-self/net/tcp", "0A"),
             ("tcp", "/proc/thread-self/net/tcp6", "0A"),
             ("udp", "/proc/thread-self/net/udp", "07"),
             ("udp", "/proc/thread-self/net/udp6", "07"))


def parse_proc_net(text: str, listen_state: str) -> set[tuple[str, int]]:
    """Parse (local address, port) of sockets in ``listen_state`` from /proc/net/{tcp,udp}[6]
    (pure)."""
    out = set()
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 4 or parts[3] != listen_state:
            continue
        addr, _, port = parts[1].rpartition(":")
        out.add((addr, int(port, 16)))
    return out


def parse_tcp_listeners(text: str) -> list[tuple[str, int, int, int]]:
    """Parse (local address in /proc's hex, port, uid, socket inode) of each listening socket of
    /proc/net/tcp[6] (pure)."""
    out = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10 or parts[3] != "0A" or not parts[7].isdigit() \
                or not parts[9].isdigit():
            continue
        addr, _, port = parts[1].rpartition(":")
        out.append((addr, int(port, 16), int(parts[7]), int(parts[9])))
    return out


def proc_net_address(hexaddr: str) -> str:
    """Return the address /proc/net/tcp[6] writes in hex (each 32-bit word in host order, which
    is little-endian here) as text: ``0100007F`` -> ``127.0.0.1`` (pure)."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words)


def tcp_listeners(port: int) -> list[tuple[str, int, int]]:
    """List (local address, uid, socket inode) of the TCP sockets listening on ``port`` in this
    thread's network namespace."""
    out = []
    for proto, path, _state in _PROC_NET:
        if proto != "tcp":
            continue
        try:
            with open(path) as fh:
                text = fh.read()
        except OSError:
            continue
        out += [(proc_net_address(addr), uid, inode)
                for addr, p, uid, inode in parse_tcp_listeners(text) if p == port]
    return out


def socket_holders(inode: int, proc: str = "/proc") -> list[int]:
    """List the pids that hold the socket ``inode`` open (those whose fds we may read)."""
    want = f"socket:[{inode}]"
    pids = []
    for pid in (p for p in os.listdir(proc) if p.isdigit()):
        try:
            fds = os.listdir(f"{proc}/{pid}/fd")
        except OSError:
            continue
        if any(_readlink(f"{proc}/{pid}/fd/{fd}") == want for fd in fds):
            pids.append(int(pid))
    return sorted(pids)


def listening_ports() -> frozenset[tuple[str, int]]:
    """List (proto, port) of every listening TCP socket and bound UDP socket in this namespace."""
    found: set[tuple[str, int]] = set()
    for proto, path, state in _PROC_NET:
        try:
            with open(path) as fh:
                text = fh.read()
        except OSError:
            continue
        found |= {(proto, port) for _addr, port in parse_proc_net(text, state)}
    return frozenset(found)



_NET_LINK = re.compile(r"^net:\[(\d+)\]$")


def netns_inode_of(link: str) -> int | None:
    """Read the inode in a ``/proc/PID/ns/net`` link's text (``net:[4026532301]``) (pure)."""
    m = _NET_LINK.match(link)
    return int(m.group(1)) if m else None


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:  # gone meanwhile, or a kernel thread we may not read
        return None


def netns_members(proc: str = "/proc") -> dict[int, tuple[int, ...]]:
    """Map each network namespace inode -> the pids whose process (or one of its threads) is in it.

    One ``readlink`` per process and, for processes with more than one thread, one per
    thread (a thread can ``setns`` alone): ~2 ms for 100 processes. Taken once per run
    by the caller, whatever the number of namespaces it asks about.
    """
    members: dict[int, set[int]] = {}
    try:
        pids = [int(p) for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        links = [_readlink(f"{proc}/{pid}/ns/net")]
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            tids = []
        if len(tids) > 1:
            links += [_readlink(f"{proc}/{pid}/task/{tid}/ns/net") for tid in tids]
        for link in links:
            inode = netns_inode_of(link) if link else None
            if inode is not None:
                members.setdefault(inode, set()).add(pid)
    return {inode: tuple(sorted(pids)) for inode, pids in members.items()}


def process_name(pid: int, proc: str = "/proc") -> str:
    """Return the ``comm`` of a process (``?`` when it is gone)."""
    try:
        with open(f"{proc}/{pid}/comm") as fh:
            return fh.read().strip() or "?"
    except OSError:
        return "?"
