"""The agent's text log lines are fitted like the plan (SPEC §13); JSON logs keep everything."""

from __future__ import annotations

import json
import logging

from reconciler.agent.logs import JsonLogFormatter, TextLogFormatter


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("reconciler", logging.ERROR, __file__, 1, msg, None, None)


def test_a_long_log_line_is_elided_to_200_characters_and_json_keeps_it() -> None:
    failed = "; ".join(f"alloc/a-{i}: probe failed" for i in range(200))
    msg = f"pass 7 (drift) at abc: failed: {failed}\nfirewall ipv4: " + ", ".join(
        f"udp/{40000 + i}" for i in range(300))
    lines = TextLogFormatter().format(_record(msg)).splitlines()
    assert len(lines) == 2 and all(len(x) <= 200 for x in lines), [len(x) for x in lines]
    assert lines[0].endswith(" chars)") and " ERROR pass 7 (drift) at abc: failed: " in lines[0]
    assert lines[1].startswith("firewall ipv4: udp/40000, udp/40001") and "more)" in lines[1]
    assert json.loads(JsonLogFormatter().format(_record(msg)))["msg"] == msg
