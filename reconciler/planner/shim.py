"""The mark shim: one accept of our mark where another manager's iptables chain drops (pure).

In netfilter an accept in one chain does not stop a drop in another: dockerd ≤ 28's
``FORWARD`` policy DROP, ufw's routed deny, or an iptables-legacy ``FORWARD`` DROP stop
declared traffic whatever our own rules say. Our nftables table ORs a mark bit into
exactly the traffic it accepts (``domain.fwmark``, ``domain.nftable``); here, for each
backend that has one (the ``iptables`` on PATH, and iptables-legacy beside nf_tables) and
each family with a declared subnet, the filter ``FORWARD`` chain is read and, where it
drops (its policy, or a DROP/REJECT rule of its own), one rule accepting that bit is kept
ahead of every DROP/REJECT rule there (not necessarily first: dockerd puts its
``DOCKER-USER`` jump back on top); the same in ``INPUT``, which the replies on our bridges
to the host's own connections pass (ufw's deny: our table's guard marks them). We never
create a table or chain for it: no such chain there, or nothing dropping in it, and
there is no shim. Its loss, its place behind a drop, a copy or an old bit are drift,
planned every pass; with nothing declared (or nothing dropping any more) it is removed.
It is written by ``iptables`` itself (``drivers.iptables.IptablesDriver.shim``).

firewalld is not edited: it keeps its own table, and the engine refuses with the exact
``firewall-cmd`` (docs/decisions/017).

See docs/decisions/048-mark-shim.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.domain import fwmark
from reconciler.domain.live import LiveChainSet, LiveState
from reconciler.domain.model import DesiredState
from reconciler.domain.ops import FirewallShim, encode
from reconciler.domain.plan import Action, AttrChange, Change
from reconciler.planner import fwpaths

TABLE, CHAIN = "filter", "FORWARD"
#: the filter chains a shim is kept in where they drop (our table marks what passes both)
CHAINS = (CHAIN, "INPUT")


def tool(family: int, legacy: bool) -> str:
    """Name the command that writes a backend's rules: ``iptables``, ``ip6tables-legacy`` ..."""
    return ("iptables" if family == 4 else "ip6tables") + ("-legacy" if legacy else "")


def drops(chains: LiveChainSet, chain: str = CHAIN) -> str | None:
    """Say what drops in a chain the shim serves (its policy, its first DROP/REJECT rule),
    or None: no such chain (never made for the shim), or nothing there drops."""
    if (TABLE, chain) not in chains.chains and (TABLE, chain) not in chains.policies:
        return None
    policy = chains.policies.get((TABLE, chain))
    if policy == "DROP":
        return "policy DROP"
    for r in chains.chains.get((TABLE, chain), ()):
        if fwpaths.target(r)[0] in fwpaths.DROPS:
            return f"-A {chain} {r}"
    return None


def needed(desired: DesiredState, family: int) -> bool:
    """Tell whether anything of ``family`` is forwarded for the desired state (a subnet)."""
    return any((s.cidr if family == 4 else s.cidr6) is not None
               for s in desired.subnets.values())


def wants(desired: DesiredState, chains: LiveChainSet, family: int,
          chain: str = CHAIN) -> bool:
    """Tell whether a backend's ``chain`` (``FORWARD``) needs the shim for ``desired``."""
    return chains.available and needed(desired, family) and drops(chains, chain) is not None


def with_shim(chains: LiveChainSet, bit: int,
              chain: str = CHAIN) -> dict[tuple[str, str], tuple[str, ...]]:
    """Return the chains as they will be once the shim is in place in ``chain`` (first; ours
    elsewhere in it gone): what ``planner.legacy`` walks for the declared paths."""
    out = dict(chains.chains)
    rest = tuple(r for r in out.get((TABLE, chain), ()) if not fwmark.is_shim(r))
    out[(TABLE, chain)] = (fwmark.shim_rule(bit), *rest)
    return out


@dataclass(frozen=True)
class _Seen:
    """Our shims in the chain (index, rule), and the first DROP/REJECT rule's index."""

    ours: tuple[tuple[int, str], ...]
    first_drop: int | None


def _seen(chains: LiveChainSet, chain: str) -> _Seen:
    rules = chains.chains.get((TABLE, chain), ())
    ours = tuple((i, r) for i, r in enumerate(rules) if fwmark.is_shim(r))
    first = next((i for i, r in enumerate(rules)
                  if fwpaths.target(r)[0] in fwpaths.DROPS), None)
    return _Seen(ours, first)


def plan_one(desired: DesiredState, chains: LiveChainSet, family: int, legacy: bool,
             bit: int, chain: str = CHAIN) -> Change | None:
    """Plan the shim of one backend, family and chain: None when it is as it should be."""
    seen = _seen(chains, chain)
    name = f"{tool(family, legacy)} {TABLE}/{chain}"
    want = fwmark.shim_rule(bit)
    if not wants(desired, chains, family, chain):
        if not seen.ours:
            return None
        why = ("nothing declared is forwarded" if not needed(desired, family)
               else "nothing in the chain drops any more")
        return Change("shim", name, Action.DELETE, why,
                      (AttrChange("shim", seen.ours[0][1], None),),
                      tuple(encode(FirewallShim(family, legacy, chain, r, 0))
                            for _i, r in seen.ours))
    exact = [i for i, r in seen.ours if r == want]
    behind = seen.first_drop is not None and exact and exact[0] > seen.first_drop
    if len(seen.ours) == 1 and exact and not behind:
        return None
    what = drops(chains, chain)
    if not seen.ours:
        action, was, reason = Action.CREATE, None, f"the chain drops ({what})"
    elif behind:
        action, was = Action.UPDATE, "behind a drop"
        reason = f"the shim is behind {what}: moved ahead of it"
    elif not exact:
        action, was, reason = Action.UPDATE, seen.ours[0][1], "the mark bit changed"
    else:
        action, was = Action.UPDATE, f"{len(seen.ours)} copies"
        reason = "more than one copy"
    ops = [FirewallShim(family, legacy, chain, r, 0) for _i, r in seen.ours]
    ops.append(FirewallShim(family, legacy, chain, want, 1))
    return Change("shim", name, action, reason, (AttrChange("shim", was, want),),
                  tuple(encode(o) for o in ops))


def plan_shims(desired: DesiredState, live: LiveState, bit: int) -> list[Change]:
    """Plan the shim of every backend, family and chain of ``CHAINS`` here: the iptables
    on PATH as ``iptables-save`` prints it (``old4``/``old6``; our own rules are in our
    nftables table), and iptables-legacy beside nf_tables."""
    out = []
    for family, active, legacy in ((4, live.old4, live.legacy4),
                                   (6, live.old6, live.legacy6)):
        for is_legacy, chains in ((False, active), (True, legacy)):
            if chains is None or not chains.available:
                continue
            for chain in CHAINS:
                c = plan_one(desired, chains, family, is_legacy, bit, chain)
                if c is not None:
                    out.append(c)
    return out
