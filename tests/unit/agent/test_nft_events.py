"""nf_tables notifications without a kernel: parsing, the commit filter, the watcher thread.

The byte layouts are those the kernel sent for ``iptables-nft -A``, ``iptables-nft -F``
and ``nft flush ruleset`` in a fresh namespace (nlmsghdr, nfgenmsg, attribute 1 =
the table; NEWGEN closes each commit); the real socket is exercised by
tests/integration/watch/test_agent.py and the coexistence matrix.
"""

from __future__ import annotations

import socket
import struct
import threading

from reconciler.agent.sources import NftCommitFilter, NftWatcher
from reconciler.drivers.netlink import wire
from reconciler.drivers.netlink.parse import NftNotice, parse_nft_notices

NEWTABLE, DELTABLE, NEWCHAIN, DELCHAIN, NEWRULE, DELRULE = 0, 2, 3, 5, 6, 8


def nft_msg(msg: int, family: int, table: str | None = None, *,
            subsys: int = wire.NFNL_SUBSYS_NFTABLES) -> bytes:
    body = wire.NFGENMSG.pack(family, 0, 0)
    if table is not None:
        body += wire.str_attr(wire.NFTA_TABLE, table)
    return struct.pack("=IHHII", 16 + len(body), (subsys << 8) | msg, 0, 0, 0) + body


def newgen(gen: int) -> bytes:
    body = wire.NFGENMSG.pack(0, 0, socket.htons(gen & 0xFFFF))
    body += wire.attr(wire.NFTA_GEN_ID, struct.pack("!I", gen))
    return struct.pack("=IHHII", 16 + len(body),
                       (wire.NFNL_SUBSYS_NFTABLES << 8) | wire.NFT_MSG_NEWGEN, 0, 0, 0) + body


IPV4, IPV6, INET = socket.AF_INET, socket.AF_INET6, 1


def test_parse_nft_notices_of_commits() -> None:
    data = (nft_msg(NEWTABLE, IPV4, "filter") + nft_msg(NEWCHAIN, IPV4, "filter")
            + nft_msg(NEWRULE, IPV4, "filter") + newgen(2) + nft_msg(DELRULE, IPV6, "nat")
            + newgen(3))
    assert parse_nft_notices(data) == [
        NftNotice(IPV4, "filter"), NftNotice(IPV4, "filter"), NftNotice(IPV4, "filter"),
        NftNotice(0, None, commit=True), NftNotice(IPV6, "nat"),
        NftNotice(0, None, commit=True)]


def test_parse_nft_notices_skips_garbage_and_other_subsystems() -> None:
    assert parse_nft_notices(b"") == []
    assert parse_nft_notices(b"\x01\x02\x03") == []
    assert parse_nft_notices(nft_msg(NEWRULE, IPV4, "filter")[:-3]) == []  # truncated
    ctnetlink = nft_msg(0, IPV4, "x", subsys=1)
    assert parse_nft_notices(ctnetlink + newgen(4)) == [NftNotice(0, None, commit=True)]
    assert parse_nft_notices(nft_msg(NEWRULE, IPV4)) == [NftNotice(IPV4, None)]


def test_a_commit_is_relevant_when_it_touches_an_iptables_table_of_ours() -> None:
    f = NftCommitFilter()
    assert f.feed(parse_nft_notices(nft_msg(DELRULE, IPV4, "filter") + newgen(5))) == [
        "nftables commit to ip filter"]
    # nft flush ruleset: chains, then tables of both families
    flush = (nft_msg(DELCHAIN, IPV4, "filter") + nft_msg(DELTABLE, IPV4, "filter")
             + nft_msg(DELTABLE, IPV6, "nat") + newgen(6))
    assert f.feed(parse_nft_notices(flush)) == ["nftables commit to ip filter, ip6 nat"]
    # other tools' own tables and families, and iptables tables we keep nothing in
    # our own table: an element deleted, the table flushed or dropped is drift
    assert f.feed(parse_nft_notices(nft_msg(DELRULE, INET, "reconciler") + newgen(7))) == [
        "nftables commit to inet reconciler"]
    assert f.feed(parse_nft_notices(nft_msg(DELTABLE, INET, "reconciler")
                                    + nft_msg(DELRULE, IPV4, "filter") + newgen(7))) == [
        "nftables commit to inet reconciler, ip filter"]
    # mangle holds nothing of ours any more (the table marks); a table named reconciler in
    # another family is not ours
    for other in (nft_msg(NEWRULE, INET, "firewalld"), nft_msg(NEWRULE, IPV4, "raw"),
                  nft_msg(NEWRULE, IPV4, "mangle"), nft_msg(NEWRULE, IPV4, "reconciler"),
                  nft_msg(NEWRULE, 7, "filter"), nft_msg(NEWRULE, IPV6, "kube-proxy")):
        assert f.feed(parse_nft_notices(other + newgen(7))) == []


def test_a_commit_split_across_datagrams_is_judged_when_it_ends() -> None:
    f = NftCommitFilter()
    assert f.feed(parse_nft_notices(nft_msg(DELRULE, IPV6, "filter"))) == []
    assert f.feed(parse_nft_notices(nft_msg(NEWRULE, INET, "firewalld"))) == []
    assert f.feed(parse_nft_notices(newgen(8))) == ["nftables commit to ip6 filter"]
    assert f.feed(parse_nft_notices(newgen(9))) == []  # an empty commit after it: nothing


def test_the_watcher_asks_for_a_pass_per_relevant_commit() -> None:
    stop = threading.Event()
    heard: list[str] = []
    got = threading.Event()

    def on_drift(reason: str) -> None:
        heard.append(reason)
        got.set()

    w = NftWatcher(on_drift, stop)
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    w._sock = ours
    w._thread = threading.Thread(target=w._run, daemon=True)
    w._thread.start()
    try:
        kernel.send(nft_msg(NEWRULE, INET, "firewalld") + newgen(10))
        kernel.send(nft_msg(DELRULE, IPV4, "nat"))
        kernel.send(newgen(11))
        assert got.wait(5.0)
    finally:
        stop.set()
        w.close()
        kernel.close()
    assert heard == ["nftables commit to ip nat"]
