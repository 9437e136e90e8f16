"""Crash consistency: SIGKILL the reconciler mid-apply, apply again, nothing leaked.

The engine is bench/soak_crash.py (the long soak: 50 trials of 200 allocations
and 5 Docker networks). Here a few seeded trials of 40 allocations and 2 Docker
networks; ``RECONCILER_SOAK=1`` runs the full soak instead. The replace-crash soak
(bench/soak_replace.py: `apply --force-replace` of a network with containers
pinging each other, killed at a random step of the replace) runs 4 trials here, 50
with ``RECONCILER_SOAK=1``.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.support.figures import SOAK, report
from tests.support.host import REPO, SESSION

sys.path.insert(0, REPO)
from bench.soak_crash import soak  # noqa: E402
from bench.soak_replace import replace_soak  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.docker]


def test_sigkill_at_random_points_then_apply_converges_without_leaks(
        request: pytest.FixtureRequest, docker_client: object):  # noqa: F811
    if os.geteuid() != 0:
        pytest.skip("needs root")
    trials, allocs, networks = (50, 200, 5) if SOAK else (5, 40, 2)
    seed = int(os.environ.get("RECONCILER_SOAK_SEED", "7"))
    s = soak(trials, allocs, networks, seed, log=lambda _line: None, prefix=f"{SESSION}k")
    report(request, f"{s.line()}; {allocs} allocs + {networks} docker networks, seed {seed}")
    assert s.killed >= 1  # the kill points really landed inside runs
    assert s.converged == s.trials, "\n".join(s.details)
    # an empty /run/netns file left by a kill between unmount and unlink is tagged with an
    # xattr, so the next run removes it: it is a leak like any other
    assert s.details == [], "\n".join(s.details)


def test_replace_killed_at_random_steps_under_load_leaves_no_container_detached(
        request: pytest.FixtureRequest, busybox_image: str) -> None:  # noqa: F811
    if os.geteuid() != 0:
        pytest.skip("needs root")
    trials = 50 if SOAK else 4
    seed = int(os.environ.get("RECONCILER_SOAK_SEED", "7"))
    s = replace_soak(trials, 4, 20, seed, image=busybox_image, log=lambda _line: None,
                     prefix=f"{SESSION}r")
    report(request, s.line(), named=False)
    report(request, f"replace-crash: {s.killed} of {s.trials} runs killed inside the replace, "
                    f"4 containers pinging, 20 allocs, seed {seed}, {s.seconds:.0f}s")
    assert s.killed == s.trials  # every kill point is inside the replace
    assert s.converged == s.trials and s.detached == 0, "\n".join(s.details)
