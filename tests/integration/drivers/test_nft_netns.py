"""The nft driver acts on the calling thread's namespace, not the one its context was made in.

libnftables' context is made once per process; its netlink socket stays in the namespace
of the thread that made it. An in-process caller inside ``netns.enter`` (the probes'
tests, a library user) must still read and change its own namespace's table. Checked
with ``nft -j list table inet reconciler`` in each namespace, not with the driver.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.support.host import Netns, sh

pytestmark = pytest.mark.root

SCRIPT = """
import sys
from reconciler.domain import nftable
from reconciler.domain.nftable import Entry
from reconciler.drivers import netns
from reconciler.drivers.nft.driver import NftDriver
first, second = sys.argv[1:]
with netns.enter(first):
    made_in_first = NftDriver()  # the process's one context: its socket is in "first"
    print("first", made_in_first.in_process)
with netns.enter(second):
    d = NftDriver()
    print("second", d.in_process)
    d.apply(nftable.rebuild(0x2000, [
        Entry("pm4", ("tcp", "18080"), ("10.77.0.2", "80"), "alloc=a0")], exists=False))
    state = d.observe()
    print("read", sorted(e.set + ":" + "/".join(e.key) for e in state.entries))
"""


def _elements(ns: str) -> list[str] | None:
    """The pm4_port map's elements in ``ns`` as nft lists them; None: no table there."""
    out = sh("ip", "netns", "exec", ns, "nft", "-j", "list", "table", "inet", "reconciler",
             check=False)
    if out.returncode != 0:
        return None
    found = []
    for obj in json.loads(out.stdout)["nftables"]:
        m = obj.get("map")
        if m is not None and m["name"] == "pm4_port":
            # [{"elem": {"val": {"concat": ["tcp", 18080]}, "comment": ...}}, 80]
            found += [json.dumps(elem) for elem in m.get("elem", ())]
    return found


def test_a_driver_in_another_namespace_than_the_context_changes_its_own(
        host_ns: Netns) -> None:
    first = host_ns.ns("ctx")
    sh("ip", "netns", "add", first)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), first, host_ns.name],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # the table was written where the caller was, not where the context was made
    assert _elements(first) is None
    elements = _elements(host_ns.name)
    assert elements is not None and len(elements) == 1 and "18080" in elements[0], elements
    # and read back from there; the context stays in-process where it was made
    assert out.stdout.splitlines() == [
        "first True", "second False", "read ['pm4:tcp/18080']"], out.stdout
