"""Markers that prove the reconciler created an object.

They live on the objects themselves, so they survive a restart of the
reconciler and need no side file that could be lost or go stale.
"""

from __future__ import annotations

#: IFLA_IFALIAS of every link we create (bridges, alloc veths).
LINK_ALIAS = "managed-by=reconciler"

#: IFA_PROTO of every address we add (kernel >= 5.18 keeps it; ``ip -d addr``
#: shows it as ``proto 0x52``). 0x52 is 'R' and no routing daemon uses it.
ADDR_PROTO = 0x52

#: rtm_protocol of every route we add inside allocation namespaces.
ROUTE_PROTO = 0x52

#: Docker label on every network we create.
DOCKER_LABEL = "io.reconciler.managed"
DOCKER_LABEL_VALUE = "true"

#: Prefix of every iptables chain we own, and the comment on our jump rules.
CHAIN_PREFIX = "RECONCILER-"
RULE_COMMENT = "reconciler"


def is_owned_alias(alias: str | None) -> bool:
    return alias == LINK_ALIAS
