"""The plan agent's identity: the code, the installed distributions and the state
directory a client must share with the agent it asks."""

from __future__ import annotations

import os
from typing import Any

import pytest


def test_code_id_changes_with_installed_distributions(tmp_path: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.agent.planview.protocol import code_id

    site = tmp_path / "site-packages"
    (site / "PyYAML-6.0.2.dist-info").mkdir(parents=True)
    monkeypatch.setattr("sys.path", [str(site)])
    before = code_id()
    assert code_id() == before
    (site / "PyYAML-6.0.2.dist-info").rename(site / "PyYAML-6.0.3.dist-info")  # an upgrade
    assert code_id() != before


def test_code_identity_counts_every_subpackage(tmp_path, monkeypatch):
    """A client and an agent of different code must differ in code_id, whichever
    subpackage changed, a new one included (it once walked four fixed directories)."""
    from reconciler.agent.planview import protocol

    root = tmp_path / "reconciler"
    (root / "domain").mkdir(parents=True)
    (root / "domain" / "model.py").write_text("x = 1\n")
    monkeypatch.setattr(protocol, "PACKAGE_ROOT", str(root))
    before = protocol.code_id()
    (root / "newpkg" / "deeper").mkdir(parents=True)
    (root / "newpkg" / "deeper" / "mod.py").write_text("y = 2\n")
    assert protocol.code_id() != before
    after = protocol.code_id()
    (root / "newpkg" / "deeper" / "mod.py").write_text("y = 3  # same size? no: longer\n")
    assert protocol.code_id() != after


def test_code_identity_is_rooted_at_the_package():
    from reconciler.agent.planview import protocol

    assert os.path.isfile(os.path.join(protocol.PACKAGE_ROOT, "__main__.py"))
    assert "drivers/netlink/wire.py:" in protocol.code_id()


def test_the_state_directory_is_part_of_the_agents_identity() -> None:
    """The journals live there: an agent with another one would judge other journals."""
    from reconciler.agent.planview.protocol import ENV_KEYS

    assert "RECONCILER_STATE_DIR" in ENV_KEYS
