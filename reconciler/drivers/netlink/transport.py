"""One blocking rtnetlink socket: requests with extended ACKs, dumps, errors as driver errors."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterable

from reconciler.domain.errors import DriverError, TemporaryError
from reconciler.drivers.netlink.wire import (
    HDR,
    I32,
    NETLINK_CAP_ACK,
    NETLINK_EXT_ACK,
    NETLINK_GET_STRICT_CHK,
    NETLINK_ROUTE,
    NLM_F_ACK,
    NLM_F_ACK_TLVS,
    NLM_F_CAPPED,
    NLM_F_DUMP,
    NLM_F_DUMP_INTR,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSGERR_ATTR_MSG,
    SOL_NETLINK,
    cstr,
    parse_attrs,
    split_messages,
)

_RECV_SIZE = 1 << 16


_TEMPORARY = {errno.EBUSY, errno.EAGAIN, errno.EINTR, errno.ENOBUFS}


def netlink_error(code: int, what: str, detail: str = "") -> DriverError:
    text = f"{what}: {os.strerror(code)}" + (f" ({detail})" if detail else "")
    err: DriverError = TemporaryError(text) if code in _TEMPORARY else DriverError(text)
    err.errno = code
    return err


class Socket:
    """A blocking rtnetlink socket bound to the namespace it was created in.

    ``protocol`` NETLINK_NETFILTER makes the same socket speak ctnetlink (``conntrack``).
    """

    def __init__(self, protocol: int = NETLINK_ROUTE) -> None:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                             protocol)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            for opt in (NETLINK_EXT_ACK, NETLINK_CAP_ACK, NETLINK_GET_STRICT_CHK):
                with contextlib.suppress(OSError):  # older kernels: plain ACKs, no filtering
                    sock.setsockopt(SOL_NETLINK, opt, 1)
            sock.bind((0, 0))
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def _send(self, kind: int, flags: int, body: bytes) -> int:
        self.seq = (self.seq + 1) & 0xFFFFFFFF or 1
        self.sock.send(HDR.pack(16 + len(body), kind, flags | NLM_F_REQUEST, self.seq, 0) + body)
        return self.seq

    def request(self, kind: int, flags: int, body: bytes, what: str) -> list[bytes]:
        """Send one request with NLM_F_ACK; return replies before the ACK; raise on error."""
        seq = self._send(kind, flags | NLM_F_ACK, body)
        replies: list[bytes] = []
        while True:
            data = self.sock.recv(_RECV_SIZE)
            for raw in split_messages(data):
                length, mtype, mflags, mseq, _ = HDR.unpack_from(raw, 0)
                if mseq != seq:
                    continue  # left over from an interrupted earlier request
                if mtype == NLMSG_ERROR:
                    code = -I32.unpack_from(raw, 16)[0]
                    if code:
                        raise netlink_error(code, what, _ext_ack(raw, mflags))
                    return replies
                replies.append(raw)

    def request_many(self, kind: int, flags: int, bodies: Iterable[bytes],
                     window: int = 256) -> list[int]:
        """Send many requests of one kind with NLM_F_ACK, ``window`` of them per send (the
        kernel runs each message of a buffer and acks each); the errno of each (0: done), in
        order. One round trip per window instead of one per request: the probes delete
        thousands of conntrack entries after each run."""
        codes: list[int] = []
        batch: list[bytes] = []
        for body in bodies:
            batch.append(body)
            if len(batch) == window:
                codes += self._window(kind, flags, batch)
                batch = []
        if batch:
            codes += self._window(kind, flags, batch)
        return codes

    def _window(self, kind: int, flags: int, bodies: list[bytes]) -> list[int]:
        seqs: dict[int, int] = {}
        buf = bytearray()
        for i, body in enumerate(bodies):
            self.seq = (self.seq + 1) & 0xFFFFFFFF or 1
            seqs[self.seq] = i
            buf += HDR.pack(16 + len(body), kind, flags | NLM_F_REQUEST | NLM_F_ACK,
                            self.seq, 0) + body
            buf += bytes(-len(buf) % 4)  # every message starts aligned
        self.sock.send(bytes(buf))
        codes = [-1] * len(bodies)
        left = len(bodies)
        while left:
            data = self.sock.recv(_RECV_SIZE)
            for raw in split_messages(data):
                _len, mtype, _mflags, mseq, _ = HDR.unpack_from(raw, 0)
                at = seqs.get(mseq)
                if at is None or mtype != NLMSG_ERROR or codes[at] != -1:
                    continue
                codes[at] = -I32.unpack_from(raw, 16)[0]
                left -= 1
        return codes

    def dump(self, kind: int, body: bytes, what: str, attempts: int = 3) -> list[bytes]:
        """Run a dump; retried when the kernel flags it inconsistent (NLM_F_DUMP_INTR)."""
        for _ in range(attempts):
            seq = self._send(kind, NLM_F_DUMP, body)
            out: list[bytes] = []
            intr = False
            done = False
            while not done:
                data = self.sock.recv(_RECV_SIZE)
                for raw in split_messages(data):
                    _len, mtype, mflags, mseq, _ = HDR.unpack_from(raw, 0)
                    if mseq != seq:
                        continue
                    if mflags & NLM_F_DUMP_INTR:
                        intr = True
                    if mtype == NLMSG_DONE:
                        code = -I32.unpack_from(raw, 16)[0] if len(raw) >= 20 else 0
                        if code:
                            raise netlink_error(code, what, _ext_ack(raw, mflags))
                        done = True
                        break
                    if mtype == NLMSG_ERROR:
                        code = -I32.unpack_from(raw, 16)[0]
                        raise netlink_error(code or errno.EIO, what, _ext_ack(raw, mflags))
                    out.append(raw)
            if not intr:
                return out
        raise TemporaryError(f"{what}: dump kept changing under us")


def _ext_ack(raw: bytes, flags: int) -> str:
    """Return the text of the kernel's extended-ACK message, if any."""
    if not flags & NLM_F_ACK_TLVS:
        return ""
    if flags & NLM_F_CAPPED or len(raw) < 36:
        off = 20 + 16
    else:
        off = 20 + ((HDR.unpack_from(raw, 20)[0] + 3) & ~3)
    msg = parse_attrs(raw, off).get(NLMSGERR_ATTR_MSG)
    return cstr(msg) if msg else ""

