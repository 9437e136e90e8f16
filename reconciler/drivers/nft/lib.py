"""Run nft commands in this process through libnftables (ctypes), JSON in and out.

libnftables waits on its netlink socket with ``select()``: a socket whose fd is 1024 or
above overflows the fd_set and glibc aborts the whole process. The context is made at
start-up, while the process holds few fds, and its socket's fd checked; a context that
cannot be made so (no library, or the fd too high) is None and the caller runs ``nft``.

The socket lives in the network namespace of the thread that made the context, whatever
namespace a later caller's thread is in (``netns.enter``): :meth:`LibNft.here` tells a
caller whether the context reaches its own namespace's table.

See docs/decisions/045-nftables-table-of-our-own.md.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading

from reconciler.drivers import nsfs

#: libnftables' ``NFT_CTX_OUTPUT_JSON``; input is then read as JSON first
_OUTPUT_JSON = 1 << 4
FD_SETSIZE = 1024


#: ``NETLINK_NETFILTER``: the socket libnftables opens in ``nft_ctx_new``
_NETLINK_NETFILTER = 12


def _sockets() -> set[int]:
    """Return this process's socket fds (the listing's own fd is a directory: not counted)."""
    out: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for n in names:
        try:
            if os.readlink(f"/proc/self/fd/{n}").startswith("socket:"):
                out.add(int(n))
        except (OSError, ValueError):
            continue
    return out


def _netfilter_socket_problem() -> str | None:
    """Say why libnftables could not open its socket here, or None.

    ``nft_ctx_new`` calls ``exit()`` when its netlink socket cannot be opened (no nfnetlink
    in the kernel or sandbox, AF_NETLINK filtered, no fd left): the whole process would end
    with rc 3. Try the same socket first; the lowest free fd is also the one it would get.
    """
    try:
        probe = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
    except OSError as exc:
        return f"netfilter netlink socket: {exc.strerror or exc}"
    fd = probe.fileno()
    probe.close()
    if fd >= FD_SETSIZE:
        return f"libnftables' socket would get fd {fd} (>= {FD_SETSIZE})"
    return None


class LibNft:
    """A libnftables context; one command buffer at a time (a lock)."""

    def __init__(self, lib: ctypes.CDLL, ctx: int) -> None:
        self._lib = lib
        self._ctx = ctx
        self._lock = threading.Lock()
        #: the inode of the namespace the socket was made in: the socket keeps that
        #: namespace alive, so no other live namespace has this inode while it is open
        self.netns = nsfs.current_inode()

    def here(self) -> bool:
        """Tell whether the calling thread is in the namespace of the context's socket."""
        return nsfs.current_inode() == self.netns

    @classmethod
    def open(cls, name: str = "libnftables.so.1") -> tuple[LibNft | None, str]:
        """Return a context and "", or None and why it cannot be used here."""
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            return None, f"{name}: {exc}"
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        problem = _netfilter_socket_problem()
        if problem is not None:
            return None, problem
        before = _sockets()
        ctx = lib.nft_ctx_new(0)  # NFT_CTX_DEFAULT: opens its netlink socket now
        if not ctx:
            return None, "nft_ctx_new failed"
        lib.nft_ctx_output_set_flags(ctx, _OUTPUT_JSON)
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        new = _sockets() - before
        high = sorted(fd for fd in new if fd >= FD_SETSIZE)
        if high or not new:
            # checked before the socket is ever used: select() on it would abort us
            lib.nft_ctx_free(ctx)
            return None, (f"libnftables' socket got fd {high[0]} (>= {FD_SETSIZE})" if high
                          else "libnftables opened no socket at nft_ctx_new")
        return cls(lib, ctx), ""

    def run(self, command: str) -> tuple[int, str, str]:
        """Run one buffer (JSON or nft syntax) as one transaction: (rc, output, error)."""
        with self._lock:
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, command.encode())
            out = self._lib.nft_ctx_get_output_buffer(self._ctx) or b""
            err = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
        return rc, out.decode(errors="replace"), err.decode(errors="replace")

    def close(self) -> None:
        with self._lock:
            if self._ctx:
                self._lib.nft_ctx_free(self._ctx)
                self._ctx = 0
