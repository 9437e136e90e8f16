"""bench/lifetime.py's identity check, fed snapshots by hand: which value differences
count as an identity moved, without a sandbox or any round run."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

from tests.support.host import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))

from _lifetime_host import Snapshot  # noqa: E402
from lifetime import Soak  # noqa: E402


def soak(tmp_path) -> Soak:
    """A soak over two subnets with one allocation each, its files written under tmp_path."""
    s = Soak(2612, "ltu")
    s.want.subnets = [5010, 5011]
    s.want.allocs = {4987: 5010, 5020: 5011}
    s.box = SimpleNamespace(conf=str(tmp_path), config=str(tmp_path / "lifetime.yaml"))
    s.save()
    return s


def seen(s: Soak, **v4: str) -> Snapshot:
    """The host as read back: the declared allocations' IPv4 addresses (no ports: no probe)."""
    return Snapshot(values={("alloc", s.want.alloc(int(a[1:])), "v4"): v
                            for a, v in v4.items()})


def test_an_allocation_removed_then_declared_again_under_its_name_is_a_new_one(tmp_path):
    # seed 2612 round 62: alloc 4987 made on one subnet (round 56), removed with it (58),
    # declared again on another subnet (62): its new address is no move
    s = soak(tmp_path)
    s.check("edit", seen(s, a4987="10.172.0.2", a5020="10.172.1.2"))
    del s.want.allocs[4987]
    s.save()
    s.check("edit", seen(s, a5020="10.172.1.2"))
    s.want.allocs[4987] = 5011
    s.save()
    s.check("conflict", seen(s, a4987="10.172.1.9", a5020="10.172.1.2"))
    assert s.fig.moved == {}, s.fig.details


def test_a_value_of_an_allocation_declared_all_along_that_differs_is_a_move(tmp_path):
    s = soak(tmp_path)
    s.check("edit", seen(s, a4987="10.172.0.2", a5020="10.172.1.2"))
    s.want.allocs[4986] = 5011  # another resource's edit keeps what was first seen
    s.save()
    s.check("reboot", seen(s, a4987="10.172.0.3", a5020="10.172.1.2"))
    assert s.fig.moved == {("alloc", "ltu-4987", "v4"): (0, "reboot", "10.172.0.2",
                                                          "10.172.0.3")}


def test_fewer_rounds_with_a_seed_replay_the_first_rounds_of_a_longer_run():
    # the same kinds in the same order, and the rounds' own draws (which edit, which
    # subnet a conflict hits) from the same point whatever the number of rounds
    short, long = Soak(2612, "lts"), Soak(2612, "ltl")
    assert long.schedule(300)[:62] == short.schedule(62)
    assert short.rng.getstate() == long.rng.getstate()
