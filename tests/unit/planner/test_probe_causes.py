"""The causes the probes' diagnosis names for what issue 26 saw fail without a word (pure):
per-interface forwarding off, another manager's DNAT of a mapped host port, and an
``isolation: open`` subnet never blamed on "isolation is ports"."""

from __future__ import annotations

from reconciler.domain.nftable import TableState
from reconciler.domain.probes import ProbeSpec
from reconciler.planner import nftforeign
from reconciler.planner.probes import Facts, Sighting, classify, foreign_hits, table_problem

NEVER = Sighting(reached=False, answer="timeout")


def _spec(path: str = "hairpin", *, expect: bool = True, family: int = 4) -> ProbeSpec:
    vantage = {"hairpin": "alloc", "host": "host"}.get(path, "external")
    dst = "192.168.251.1" if family == 4 else "fd00:251::1"
    return ProbeSpec("a", path, "tcp", family, vantage, dst, 8080, 8080, 80, expect)  # type: ignore[arg-type]


def test_forwarding_off_on_the_interface_a_probe_arrives_on_is_named() -> None:
    """``net.ipv4.conf.BRIDGE.forwarding=0`` with ip_forward on: IPv4 forwards nothing that
    arrives on the bridge; main said only "never arrived"."""
    facts = Facts(sysctls={"net/ipv4/ip_forward": "1", "net/ipv4/conf/rb0/forwarding": "0",
                           "net/ipv4/conf/eth9/forwarding": "0"},
                  bridge="rb0", ingress=("rb0",))
    assert classify(_spec(), NEVER, facts).line == (
        "forwarding is off on rb0 (net.ipv4.conf.rb0.forwarding=0): IPv4 forwards nothing "
        "that arrives there")
    # from the host itself nothing is forwarded in: not the cause
    assert "forwarding" not in classify(_spec("host"), NEVER, facts).line
    # an interface the probe does not arrive on is not named
    other = Facts(sysctls={"net/ipv4/conf/eth9/forwarding": "0"}, bridge="rb0",
                  ingress=("rb0",))
    assert "forwarding" not in classify(_spec(), NEVER, other).line


BEFORE = """*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
[0:0] -A OUTPUT -p tcp -m tcp --dport 8080 -j DNAT --to-destination 10.9.9.9:80
[0:0] -A OUTPUT -p tcp -m tcp --dport 9999 -j DNAT --to-destination 10.9.9.9:80
[0:0] -A OUTPUT -m addrtype --dst-type LOCAL -m comment --comment reconciler -j RECONCILER-DNAT
COMMIT
"""


def test_a_foreign_dnat_of_the_mapped_host_port_is_named() -> None:
    """Another manager's DNAT of the host port, ahead of our jump, in iptables-nft (main
    counted only DROP/REJECT there, and said "never arrived")."""
    after = BEFORE.replace("[0:0] -A OUTPUT -p tcp -m tcp --dport 8080",
                           "[1:60] -A OUTPUT -p tcp -m tcp --dport 8080").replace(
        "[0:0] -A OUTPUT -p tcp -m tcp --dport 9999", "[5:300] -A OUTPUT -p tcp -m tcp --dport 9999")
    hits = tuple(foreign_hits(4, BEFORE, after))
    line = classify(_spec("host"), NEVER, Facts(hits=hits)).line
    assert line == ("a foreign rule sends it elsewhere: nat/OUTPUT: -A OUTPUT -p tcp -m tcp "
                    "--dport 8080 -j DNAT --to-destination 10.9.9.9:80"), line
    # a DNAT of another port, whose counter rose with other traffic, is no cause
    only_other = tuple(h for h in hits if "9999" in h.rule)
    assert "elsewhere" not in classify(_spec("host"), NEVER, Facts(hits=only_other)).line


def test_an_open_subnet_is_never_blamed_on_isolation_ports() -> None:
    """``direct`` on an ``isolation: open`` subnet is expected to arrive; arriving without an
    answer back is a broken return path, not "although the subnet's isolation is ports"."""
    spec = _spec("direct", expect=True)
    arrived = Sighting(reached=True, answer="timeout")
    line = classify(spec, arrived, Facts()).line
    assert "isolation is ports" not in line and "nothing came back" in line, line
    # with isolation ports (expected not to arrive) it still is
    assert "isolation is ports" in classify(_spec("direct", expect=False), arrived, Facts()).line


RULESET = """table ip filter { # handle 9
\tchain FORWARD { # handle 1
\t\ttype filter hook forward priority filter; policy drop;
\t\tip daddr 10.0.0.2 drop # handle 3
\t}
}
table inet foo { # handle 5
\tset s { # handle 2
\t\ttype ipv4_addr
\t\telements = { 10.0.0.1, 10.0.0.2 }
\t}
\tchain fwd { # handle 1
\t\ttype filter hook forward priority filter; policy accept;
\t\tip daddr 10.0.0.2 drop # handle 3
\t\tip daddr 10.7.0.0/16 drop # handle 5
\t\ttcp dport 9999 counter packets 0 bytes 0 drop # handle 4
\t}
\tchain out { # handle 6
\t\ttype filter hook output priority filter; policy drop;
\t}
}
"""


def test_a_drop_in_another_managers_nftables_table_is_named() -> None:
    """A table made with ``nft`` (not iptables-nft's ``ip filter``, read through iptables-save
    already): main never looked, and said only "never arrived"."""
    names = frozenset({"10.0.0.2", "8080", "80"})
    found = nftforeign.drops(RULESET, RULESET.replace("packets 0", "packets 3"), family=4,
                             forwarded=True, names=names)
    # the counter that rose first, then the rule naming the address; never iptables-nft's
    # table, a rule naming other addresses, or the output hook's policy (not on the path)
    assert [r.where() for r in found] == [
        "nftables inet foo/fwd (hook forward): tcp dport 9999 drop",
        "nftables inet foo/fwd (hook forward): ip daddr 10.0.0.2 drop"]
    local = nftforeign.drops(RULESET, RULESET, family=4, forwarded=False, names=names)
    assert [r.where() for r in local][-1] == "nftables inet foo/out (hook output): policy drop"
    assert nftforeign.drops(RULESET, RULESET, family=6, forwarded=True,
                            names=frozenset({"fd00::2"})) == []
    facts = Facts(nft_drops=tuple(r.where() for r in found))
    assert classify(_spec(), NEVER, facts).line == (
        "a foreign rule drops it: nftables inet foo/fwd (hook forward): tcp dport 9999 drop")


def test_a_hand_edit_of_our_table_is_named_with_its_chain() -> None:
    """Issue 26 item 8: a rule added to our table's isolation chain drops a declared path
    (its rules carry no counters); the cause names the table and what differs from the
    skeleton, and a pass heals it. A foreign drop whose counter rose stays the cause."""
    edited = TableState(exists=True, intact=False, broken="chain isolate holds 7 rules, not 6")
    problem = table_problem(edited)
    cause = classify(_spec("external"), NEVER, Facts(table=problem))
    assert cause.line == ("our table inet reconciler is not as built (chain isolate holds 7 "
                          "rules, not 6): a pass rebuilds it"), cause.line
    assert cause.ours
    assert table_problem(TableState(exists=False)) == "is gone"
    # as built, or unread (no nft here): nothing to say
    assert table_problem(TableState(exists=True, intact=True)) == ""
    assert table_problem(TableState(available=False, error="no nft")) == ""
    assert "our table" not in classify(_spec("external"), NEVER, Facts()).line
    foreign = Facts(table=problem, nft_drops=("nftables inet foo/fwd (hook forward): drop",))
    assert classify(_spec(), NEVER, foreign).line.startswith("a foreign rule drops it")
