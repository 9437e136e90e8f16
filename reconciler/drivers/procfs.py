"""What /proc tells about this network namespace: its listening sockets."""

from __future__ import annotations

#: /proc/thread-self/net: /proc/net is the main thread's namespace, which another
#: thread (the plan server's, the watch loop's) may not share at that moment
_PROC_NET = (("tcp", "/proc/thread-self/net/tcp", "0A"),
             ("tcp", "/proc/thread-self/net/tcp6", "0A"),
             ("udp", "/proc/thread-self/net/udp", "07"),
             ("udp", "/proc/thread-self/net/udp6", "07"))


def parse_proc_net(text: str, listen_state: str) -> set[tuple[str, int]]:
    """(local address, port) of sockets in ``listen_state`` from /proc/net/{tcp,udp}[6] (pure)."""
    out = set()
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 4 or parts[3] != listen_state:
            continue
        addr, _, port = parts[1].rpartition(":")
        out.add((addr, int(port, 16)))
    return out


def listening_ports() -> frozenset[tuple[str, int]]:
    """(proto, port) of every listening TCP socket and bound UDP socket in this namespace."""
    found: set[tuple[str, int]] = set()
    for proto, path, state in _PROC_NET:
        try:
            with open(path) as fh:
                text = fh.read()
        except OSError:
            continue
        found |= {(proto, port) for _addr, port in parse_proc_net(text, state)}
    return frozenset(found)

