"""The agent's status: the listen address, the text rendering, and the server that
answers /status, /metrics and /healthz (on this machine's loopback)."""

from __future__ import annotations

import pytest

from reconciler.agent import status


def test_parse_addr() -> None:
    assert status.parse_addr("127.0.0.1:9477") == ("127.0.0.1", 9477)
    assert status.parse_addr("[::1]:80") == ("::1", 80)
    assert status.parse_addr("http://localhost:1/") == ("localhost", 1)
    for bad in ("9477", "host:", ":1", "h:99999", "h:x"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            status.parse_addr(bad)


def test_status_render() -> None:
    doc = {"pid": 1, "hostname": "h", "state": "running", "started_at": 0, "paths": ["/etc/r"],
           "revision": {"commit": "0123456789abcdef", "dirty": True},
           "desired": {"bridges": 1}, "pass_count": 3, "consecutive_failures": 0,
           "last_success_at": 95,
           "last_pass": {"number": 3, "result": "failed", "finished_at": 95,
                         "duration_seconds": 0.5, "reasons": ["files changed"],
                         "changes": {"applied": 1, "failed": 1}, "error": "boom"},
           "errors": [{"resource": "bridge/x", "error": "EPERM"}],
           "config_error": {"message": "/etc/r/a.yaml:3:5: bad", "since": 90}}
    text = status.render(doc, now=100)
    assert "commit 0123456789ab (dirty)" in text
    assert "last pass: #3 failed 5s ago" in text
    assert "bridge/x: EPERM" in text
    assert "  /etc/r/a.yaml:3:5: bad" in text
    assert not status.healthy_doc(doc)
    ok = {"last_pass": {"result": "ok"}, "errors": [], "config_error": None}
    assert status.healthy_doc(ok)


def test_status_server_serves_status_metrics_health() -> None:
    import urllib.request

    m = status.Metrics()
    m.passes.labels(result="ok").inc()
    board = status.StatusBoard(pass_count=1)
    sock = status.bind("127.0.0.1:0")
    srv = status.StatusServer(sock, board, m, lambda: (False, "stuck"))
    srv.start()
    addr = srv.address
    try:
        assert status.fetch(addr) == {"pass_count": 1}
        base = f"http://{addr}"
        body = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        assert 'reconciler_passes_total{result="ok"} 1.0' in body
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/healthz", timeout=5)
        assert err.value.code == 503
    finally:
        srv.close()
    with pytest.raises(Exception, match="cannot reach the watch agent"):
        status.fetch(addr, timeout=1)
