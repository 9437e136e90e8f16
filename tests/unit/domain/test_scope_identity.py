"""The host id names inode and cookie; an earlier version's marks count only where proven.
"""

from __future__ import annotations

from reconciler.domain import ownership
from reconciler.domain.docker import declared_scope_matches
from reconciler.drivers import nsfs

# ----------------------------------------------------------------- a scope's identity


def test_the_host_id_names_inode_and_cookie_and_accepts_the_inode_alone_as_before():
    host = nsfs.current_id()
    inode, _, cookie = host.partition("-")
    assert inode == str(nsfs.current_inode()) and cookie.isdigit(), host
    assert ownership.host_inode(host) == inode
    assert ownership.alloc_ns_marks(host) == (
        f"managed-by=reconciler alloc-of={host}", f"managed-by=reconciler alloc-of={inode}")
    assert ownership.alloc_ns_marks(inode) == (f"managed-by=reconciler alloc-of={inode}",)
    # the probes' vantage stays on the inode: its names do not move with the cookie
    assert ownership.probe_vantage_names(host) == ownership.probe_vantage_names(inode)


def test_an_earlier_versions_unnamed_scope_counts_for_declared_networks_only_by_its_inode():
    scope = "netns-inode/4026532301-24955"
    assert declared_scope_matches(scope, scope)
    assert declared_scope_matches("netns-inode/4026532301", scope)
    assert not declared_scope_matches("netns-inode/4026532302", scope)
    assert not declared_scope_matches("netns/a", "netns/a-1")
    assert not declared_scope_matches("host", scope)

