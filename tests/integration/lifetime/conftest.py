"""The lifetime soak's run, shared by the tests that check its invariants one by one."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

import pytest

from tests.support.figures import SOAK, report
from tests.support.host import REPO, SESSION

sys.path.insert(0, os.path.join(REPO, "bench"))
from lifetime import Figures, Soak  # noqa: E402

#: CI's bounded run: the opening (names sorting first then a reboot, a foreign bridge
#: conflict, an agent kill, a dockerd restart, an edit) and two seeded rounds more
ROUNDS = 300 if SOAK else 8


@pytest.fixture(scope="module")
def soak_run(request: pytest.FixtureRequest) -> Iterator[Figures]:
    """Run the soak once (seeded; ``RECONCILER_SOAK_SEED`` overrides) and print its figures."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if shutil.which("dockerd") is None:
        pytest.skip("needs dockerd (a private one runs inside the sandbox)")
    seed = int(os.environ.get("RECONCILER_SOAK_SEED", "25"))
    fig = Soak(seed, f"{SESSION}l", log=lambda _line: None).run(ROUNDS)
    for line in fig.lines():
        report(request, line, named=False)
    yield fig
