"""The hidden-namespace check: mountinfo read, and preflight's refusal.
"""

from __future__ import annotations

import pytest

from reconciler.domain.errors import PreconditionError
from reconciler.domain.ops import NetnsCreate, encode
from reconciler.domain.plan import Action, Change, Plan
from reconciler.drivers import netns, nsfs
from reconciler.engine import reconcile

# ------------------------------------------------------------------ the hidden namespaces

#: /proc/1/mountinfo of a host with two namespaces under /run/netns (and Docker's, elsewhere)
MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
46 27 254:0 /run/netns /run/netns rw,relatime shared:2 - ext4 /dev/vda rw
48 46 0:4 net:[4026532180] /run/netns/web-1 rw shared:4 - nsfs nsfs rw
49 46 0:4 net:[4026532384] /run/netns/dns rw shared:3 - nsfs nsfs rw
108 27 0:4 net:[4026532187] /run/docker/netns/3bf80fada064 rw - nsfs nsfs rw
""".splitlines()


def test_the_namespace_mounts_under_run_netns_are_read_from_mountinfo() -> None:
    assert netns.nsfs_mount_points(MOUNTINFO, "/run/netns") == {"web-1", "dns"}
    assert netns.nsfs_mount_points(["garbage", ""], "/run/netns") == set()


def _creating(name: str) -> Plan:
    return Plan((Change("alloc", name, Action.CREATE, "not present", (),
                        (encode(NetnsCreate(name, False, None)),)),))


def test_preflight_refuses_where_the_allocations_namespaces_are_hidden(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[list[str], str | None]] = []

    def hidden(names: object, *, marked: str | None = None) -> list[str]:
        asked.append((sorted(names), marked))  # type: ignore[call-overload]
        return ["web-1"]

    monkeypatch.setattr(netns, "private_mount_namespace_problem", lambda: None)
    monkeypatch.setattr(netns, "hidden_namespaces", hidden)
    monkeypatch.setattr(nsfs, "current_inode", lambda: 4026531840)
    with pytest.raises(PreconditionError, match=r"/run/netns/web-1 is a live network namespace"):
        reconcile.preflight(_creating("web-1"))
    assert asked == [(["web-1"], "managed-by=reconciler alloc-of=4026531840")]


