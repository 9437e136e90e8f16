"""Figures the reliability suite reports (cases tried, trials, leaks, ports reached).

They are printed on the terminal even while pytest captures output, prefixed
``[figures]`` so CI logs can be grepped, and nothing else depends on them.
"""

from __future__ import annotations

import os

import pytest

#: long variant of the reliability suite: ``RECONCILER_SOAK=1 pytest tests/...``
SOAK = os.environ.get("RECONCILER_SOAK", "") not in ("", "0")


def report(request: pytest.FixtureRequest, line: str, *, named: bool = True) -> None:
    """Write one ``[figures]`` line to the terminal, past pytest's output capture; prefixed
    with the test's name unless ``named`` is False (a summary line CI greps as it is)."""
    config = request.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    text = f"[figures] {request.node.name}: {line}" if named else f"[figures] {line}"
    if reporter is None or capman is None:
        print(text)
        return
    with capman.global_and_fixture_disabled():
        reporter.write_line(text)
