"""docs/firewall-table.md shows the table a small desired state builds, as nft lists it."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "firewall-table.md"

#: the example: one subnet (isolation ports, masquerade) on bridge br-web with two port maps
EXAMPLE = """
from reconciler.domain import nftable
from reconciler.domain.nftable import Entry as E
from reconciler.drivers.nft.driver import NftDriver
s, a, b = "subnet=web", "alloc=web-1", "bridge=br-web"
NftDriver().apply(nftable.rebuild(0x2000, [
    E("pm4", ("tcp", "8080"), ("10.88.0.2", "80"), a),
    E("pmip4", ("127.0.0.1", "tcp", "5432"), ("10.88.0.2", "5432"), a),
    E("pm6", ("tcp", "8080"), ("fd88::2", "80"), a),
    E("ports4", ("br-web", "10.88.0.0/24"), (), s),
    E("intra4", ("br-web", "10.88.0.0/24", "10.88.0.0/24"), (), s),
    E("egress4", ("br-web", "10.88.0.0/24"), (), s),
    E("masq4", ("10.88.0.0/24",), (), s),
    E("hairpin4", ("br-web", "10.88.0.0/24", "10.88.0.0/24"), (), s),
    E("lomasq", ("br-web",), (), s),
    E("guarded", ("br-web",), (), b),
], exists=False))
"""


def generated() -> str:
    """Build the example's table in a namespace of our own and return ``nft list table``."""
    ns = f"rtdoc-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", EXAMPLE], check=True)
        return subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "inet",
                               "reconciler"], check=True, capture_output=True,
                              text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)


def test_the_documented_ruleset_is_what_the_example_builds() -> None:
    text = DOC.read_text()
    m = re.search(r"<!-- generated: test_table_doc -->\n```\n(.*?)```", text, re.S)
    assert m, "docs/firewall-table.md lost its generated block"
    assert m.group(1) == generated(), "regenerate the block with: " + generated()
