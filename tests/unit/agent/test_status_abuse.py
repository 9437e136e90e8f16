"""The agent's status against its readers: one log budget for all clients, no values of
root-only files for anyone, and a `reconcile status` that trusts no answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading

import pytest

from reconciler.agent import status
from reconciler.agent.logs import RateLimit
from reconciler.cli.commands import main as cli_main
from reconciler.config.load import load
from reconciler.domain.errors import ConfigError

# ----------------------------------------------------------------- the log's rate


def test_the_log_rate_is_bounded_over_all_clients_and_says_what_it_held_back():
    now = [0.0]
    limit = RateLimit(rate=1.0, burst=20, clock=lambda: now[0])
    logger = logging.getLogger("reconciler.test-rate")
    records = [logger.makeRecord(logger.name, logging.WARNING, __file__, 1,
                                 "closed a connection from 127.0.%d.%d", (i // 250, i % 250),
                                 None) for i in range(1000)]
    passed = [r for r in records if limit.filter(r)]
    assert len(passed) == 20
    now[0] = 0.5
    assert limit.flush() == 0  # no line may be written yet: the count is kept
    now[0] = 1.0
    late = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "one more", (), None)
    assert limit.filter(late)
    assert late.getMessage() == ("one more (980 more line(s) like these suppressed before "
                                 "this one: log rate limit)")
    assert not any(limit.filter(r) for r in records[:10])
    now[0] = 2.0
    assert limit.flush() == 10 and limit.flush() == 0


# ----------------------------------------------------------------- no values in /status

SECRET_STATE = """version: 1
bridges:
  - {name: nomad, mtu: "s3cr3t-mtu"}
  - {name: "s3cr3t-name!"}
docker_networks:
  - {name: dn, labels: {token: "s3cr3t-label\\x01"}}
allocs:
  - {id: web, subnet: sn, address: s3cr3t-address}
"""


def test_config_errors_for_anyone_name_positions_and_keys_never_values(tmp_path):
    path = str(tmp_path / "a.yaml")
    with open(path, "w") as fh:
        fh.write(SECRET_STATE)
    with pytest.raises(ConfigError) as exc:
        load([path])
    assert "s3cr3t" in str(exc.value)  # root's own view: the whole message
    public = exc.value.public_text()
    assert "s3cr3t" not in public, public
    assert f"{path}:6:" in public and "docker_networks[0].labels.token: control character " \
        "U+0001 is not allowed" in public, public
    broken = str(tmp_path / "b.yaml")
    with open(broken, "w") as fh:
        fh.write("version: 1\nbridges: [{name: nomad}\n  s3cr3t-yaml: [\n")
    with pytest.raises(ConfigError) as exc:
        load([broken])
    assert "s3cr3t" not in exc.value.public_text()
    assert exc.value.public_text().startswith(f"{broken}:") and "invalid YAML" in \
        exc.value.public_text()
    schema_only = str(tmp_path / "c.yaml")
    with open(schema_only, "w") as fh:
        fh.write('version: 1\nbridges:\n  - {name: nomad, mtu: "s3cr3t-mtu"}\n'
                 '  - {name: "s3cr3t-name!"}\n')
    with pytest.raises(ConfigError) as exc:
        load([schema_only])
    assert exc.value.public_text().splitlines() == [
        f"{schema_only}:3:24: bridges[0].mtu: must be of type integer",
        f"{schema_only}:4:12: bridges[1].name: not allowed here: A kernel interface name: "
        "1-15 characters of [A-Za-z0-9_.-] (IFNAMSIZ)."], exc.value.public_text()


def test_status_for_anyone_drops_the_whole_config_error():
    doc = {"config_error": {"message": "a.yaml:3:24: bridges[0].mtu: must be of type "
                                       "integer", "detail": "a.yaml:3:24: 's3cr3t' ...",
                            "since": 1.0}, "paths": ["a.yaml"]}
    public = status.public_view(doc)
    assert "s3cr3t" not in json.dumps(public) and public["paths"] == ["a.yaml"]
    assert public["config_error"]["message"].startswith("a.yaml:3:24: bridges[0].mtu:")
    assert "s3cr3t" in status.render(doc)  # what root's `reconcile status` prints


# ----------------------------------------------------------------- `reconcile status`


class _Answer:
    """A server on loopback that answers every request with ``body`` (then closes), counting
    the bytes it got out."""

    def __init__(self, body: bytes | None = None, stream: int = 0) -> None:
        self.body = body
        self.stream = stream  # bytes of an endless-looking answer, sent as long as read
        self.sent = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            c, _ = self.sock.accept()
            with c:
                c.recv(4096)
                c.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n")
                if self.body is not None:
                    c.sendall(self.body)
                chunk = b" " * 65536
                while self.sent < self.stream:
                    self.sent += c.send(chunk)

    def close(self) -> None:
        self.sock.close()
        self._thread.join(timeout=10)


def test_status_reads_a_bounded_answer(capsys):
    huge = _Answer(b'{"pid": 1, "x": "', stream=256 * 1024 * 1024)
    try:
        rc = cli_main(["status", "--addr", huge.addr])
    finally:
        huge.close()
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "bad answer" in err, err
    assert huge.sent < 64 * 1024 * 1024, f"the client read {huge.sent} bytes"


@pytest.mark.parametrize("body", [b'{"pid": ', b"[1, 2]", b'{"paths": 5, "revision": 7}',
                                  b'"\xff\xfe"', b"[" * 100_000])
def test_status_of_a_malformed_answer_is_one_error_line(body, capsys):
    answer = _Answer(body)
    try:
        rc = cli_main(["status", "--addr", answer.addr])
    finally:
        answer.close()
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and err.startswith("error: bad answer"), err


def test_status_prints_no_terminal_escapes_of_the_answer(capsys):
    doc = {"pid": 1, "hostname": "\x1b]0;pwned\x07\x1b[2J", "state": "running",
           "paths": ["/etc/\x1b[31mred"], "last_pass": {"result": "ok", "error": "\x9b1m"},
           "errors": []}
    answer = _Answer(json.dumps(doc).encode())
    try:
        rc = cli_main(["status", "--addr", answer.addr])
    finally:
        answer.close()
    out = capsys.readouterr().out
    assert rc == 0 and "\x1b" not in out and "\x07" not in out and "\x9b" not in out, out
    assert "\\x1b]0;pwned\\x07" in out, out


