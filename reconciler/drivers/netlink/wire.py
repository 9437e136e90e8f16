"""The rtnetlink wire format: constants, attributes, message framing (the only nlmsghdr codec).

See docs/decisions/008-raw-rtnetlink.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

NETLINK_ROUTE = 0


SOL_NETLINK = 270


NETLINK_CAP_ACK = 10


NETLINK_EXT_ACK = 11


NETLINK_GET_STRICT_CHK = 12


NLMSG_ERROR = 2


NLMSG_DONE = 3


NLM_F_REQUEST = 0x1




NLM_F_ACK = 0x4


NLM_F_ECHO = 0x8  # a request's result is sent back (RTM_NEWLINK: the new link)


NLM_F_DUMP_INTR = 0x10


NLM_F_DUMP = 0x300


NLM_F_REPLACE = 0x100


NLM_F_EXCL = 0x200


NLM_F_CREATE = 0x400


NLM_F_CAPPED = 0x100  # on NLMSG_ERROR: request payload not echoed


NLM_F_ACK_TLVS = 0x200  # on NLMSG_ERROR: extended ACK attributes follow


NLMSGERR_ATTR_MSG = 1


NLA_F_NESTED = 0x8000


NLA_TYPE_MASK = 0x3FFF


RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK, RTM_SETLINK = 16, 17, 18, 19


RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22


RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 24, 25, 26


RTM_NEWNEIGH, RTM_DELNEIGH, RTM_GETNEIGH = 28, 29, 30


RTM_NEWRULE, RTM_DELRULE, RTM_GETRULE = 32, 33, 34


RTM_NEWNSID, RTM_GETNSID = 88, 90


IFF_UP = 0x1


IFLA_ADDRESS = 1


IFLA_IFNAME = 3


IFLA_MTU = 4


IFLA_LINK = 5


IFLA_MASTER = 10


IFLA_PROTINFO = 12


IFLA_LINKINFO = 18


IFLA_AF_SPEC = 26


IFLA_INET_CONF = 1  # in IFLA_AF_SPEC / AF_INET: IPV4_DEVCONF_* values, one u32 each


IPV4_DEVCONF_ARP_NOTIFY = 22  # net.ipv4.conf.<link>.arp_notify


IFLA_INET6_ADDR_GEN_MODE = 8


IN6_ADDR_GEN_MODE_NONE = 1



IFLA_IFALIAS = 20


IFLA_NET_NS_FD = 28


IFLA_EXT_MASK = 29


IFLA_LINK_NETNSID = 37


IFLA_TARGET_NETNSID = 46


IFLA_INFO_KIND = 1


IFLA_INFO_DATA = 2


IFLA_INFO_SLAVE_KIND = 4


IFLA_INFO_SLAVE_DATA = 5


VETH_INFO_PEER = 1


IFLA_BRPORT_STATE = 1  # STP state of a bridge port


BR_STATE_FORWARDING = 3


IFLA_BRPORT_MODE = 4  # hairpin


RTEXT_FILTER_SKIP_STATS = 1 << 3


IFA_ADDRESS = 1


IFA_LOCAL = 2


IFA_FLAGS = 8


IFA_TARGET_NETNSID = 10


IFA_PROTO = 11


IFA_F_NODAD = 0x02


RTA_DST = 1


RTA_OIF = 4


RTA_GATEWAY = 5


RTA_TABLE = 15


RT_TABLE_MAIN = 254


RT_TABLE_LOCAL = 255


#: a FIB rule's attribute: its table when the id does not fit the header's byte
FRA_TABLE = 15


#: a FIB rule's action "lookup TABLE" (the others: goto, nop, blackhole, unreachable...)
FR_ACT_TO_TBL = 1


RTN_UNICAST = 1


RT_SCOPE_UNIVERSE = 0


RTM_F_CLONED = 0x200


NDA_DST = 1


NDA_LLADDR = 2


NDA_PROTOCOL = 12  # u8: who made the entry (kernel >= 5.2 keeps it, ``ip neigh`` "proto")


NUD_REACHABLE = 0x02


NUD_STALE = 0x04


NUD_NOARP = 0x40


NUD_PERMANENT = 0x80


NETNSA_NSID = 1


NETNSA_FD = 3


AF_BRIDGE = 7


NTF_MASTER = 0x04  # ndmsg flag: an fdb entry of the bridge the port belongs to


#: ndmsg flag (``ip neigh ... extern_learn``): the entry was learnt by a control plane, not
#: by the kernel. Created from netlink with it, an entry is exempt from the neighbour GC
#: (``neigh_add`` -> ``___neigh_create(..., exempt_from_gc)``, kernel >= 5.0): it does not
#: count toward gc_thresh1/2/3 (one table per family for every namespace: 1000 allocations'
#: entries alone passed the default 1024, so every creation ran the forced GC and lookups
#: failed with "neighbour table overflow") and the periodic GC never removes it, while its
#: states (STALE, DELAY, PROBE, REACHABLE) and lladdr updates from ARP/ND run as usual.
#: What the kernel never collects we must: see ``planner.allocs`` (stale neighbours).
NTF_EXT_LEARNED = 0x10


#: nf_tables over NETLINK_NETFILTER: message type = (subsystem << 8) | message
NFNL_SUBSYS_NFTABLES = 10


NFT_MSG_NEWGEN, NFT_MSG_GETGEN = 15, 16  # NEWGEN also ends each commit's notifications


#: in every nf_tables object message (table, chain, rule, set, element, object, flowtable)
#: attribute 1 names the table
NFTA_TABLE = 1


NFTA_GEN_ID = 1


HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid


IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change


IFADDR = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index


RTMSG = struct.Struct("=BBBBBBBBI")  # family dst_len src_len tos table proto scope type flags


#: struct fib_rule_hdr: family dst_len src_len tos table res1 res2 action flags (RTMSG's layout)
FIB_RULE_HDR = RTMSG


RTGEN = struct.Struct("=Bxxx")


NDMSG = struct.Struct("=BxxxiHBB")  # ndmsg: family, ifindex, state, flags, type
NFGENMSG = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big endian)
#: the netlink protocol of nfnetlink (nf_tables notices, ctnetlink)
NETLINK_NETFILTER = 12


NLA = struct.Struct("=HH")


U32 = struct.Struct("=I")


I32 = struct.Struct("=i")


HDR_SIZES = {
    RTM_NEWLINK: IFINFO, RTM_DELLINK: IFINFO, RTM_GETLINK: IFINFO, RTM_SETLINK: IFINFO,
    RTM_NEWADDR: IFADDR, RTM_DELADDR: IFADDR, RTM_GETADDR: IFADDR,
    RTM_NEWROUTE: RTMSG, RTM_DELROUTE: RTMSG, RTM_GETROUTE: RTMSG,
    RTM_NEWNSID: RTGEN, RTM_GETNSID: RTGEN,
    RTM_NEWNEIGH: NDMSG, RTM_DELNEIGH: NDMSG, RTM_GETNEIGH: NDMSG,
    RTM_NEWRULE: FIB_RULE_HDR, RTM_DELRULE: FIB_RULE_HDR, RTM_GETRULE: FIB_RULE_HDR,
}


def attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return NLA.pack(n, kind) + payload + b"\0" * (-n & 3)


def nested(kind: int, *parts: bytes) -> bytes:
    return attr(kind | NLA_F_NESTED, b"".join(parts))


def str_attr(kind: int, value: str) -> bytes:
    return attr(kind, value.encode() + b"\0")


def u32_attr(kind: int, value: int) -> bytes:
    return attr(kind, U32.pack(value))


def u8_attr(kind: int, value: int) -> bytes:
    return attr(kind, bytes((value,)))


def parse_attrs(buf: bytes, off: int = 0, end: int | None = None) -> dict[int, bytes]:
    """Parse the TLV attributes of ``buf[off:end]`` by type (nested/byte-order flags stripped)."""
    if end is None:
        end = len(buf)
    out: dict[int, bytes] = {}
    unpack = NLA.unpack_from
    while off + 4 <= end:
        n, kind = unpack(buf, off)
        if n < 4 or off + n > end:
            break  # malformed (the kernel never sends one): what came before stands
        out[kind & NLA_TYPE_MASK] = buf[off + 4:off + n]
        off += (n + 3) & ~3
    return out


def cstr(value: bytes) -> str:
    return value.split(b"\0", 1)[0].decode("utf-8", "replace")


@dataclass(frozen=True)
class NlMsg:
    """One rtnetlink message: header type/flags, the fixed family header, attributes."""

    type: int
    flags: int
    header: tuple[int, ...]
    attrs: dict[int, bytes]

    @classmethod
    def decode(cls, raw: bytes) -> NlMsg:
        """Decode one complete message (nlmsghdr included), e.g. from a fixture."""
        length, kind, flags, _seq, _pid = HDR.unpack_from(raw, 0)
        fixed = HDR_SIZES[kind]
        header = fixed.unpack_from(raw, 16)
        return cls(kind, flags, header, parse_attrs(raw, 16 + ((fixed.size + 3) & ~3), length))


def split_messages(buf: bytes) -> list[bytes]:
    """Split a datagram into complete raw messages (nlmsghdr included)."""
    out = []
    off = 0
    while off + 16 <= len(buf):
        length = HDR.unpack_from(buf, off)[0]
        if length < 16:
            break
        out.append(buf[off:off + length])
        off += (length + 3) & ~3
    return out

