"""Nothing a local user does stops the agent (issue 25, item 7): a watched directory that
vanishes while it is read, a squatter on the status address, a flood of clients from many
loopback sources, values of root-only files in ``/status``, a namespace that reuses a dead
one's inode. Pure logic and loopback only."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
from typing import Any

import pytest

from reconciler.agent import status
from reconciler.agent.files import FileWatcher
from reconciler.agent.logs import RateLimit
from reconciler.cli.apply import is_saved_plan
from reconciler.cli.commands import main as cli_main
from reconciler.config import paths as config_paths
from reconciler.config.load import load
from reconciler.domain import ownership
from reconciler.domain.docker import declared_scope_matches
from reconciler.domain.errors import ConfigError
from reconciler.drivers import nsfs

# ----------------------------------------------------------------- a vanishing directory


def _vanishing_listdir(monkeypatch: pytest.MonkeyPatch, victim: str) -> None:
    """Make ``os.listdir`` of the config loader remove ``victim`` first: what `rm -rf` does
    between the loader's look at the path and its listing."""
    real = os.listdir

    def listdir(path: Any = ".") -> list[str]:
        if os.path.abspath(str(path)) == os.path.abspath(victim):
            shutil.rmtree(victim, ignore_errors=True)
        return real(path)

    monkeypatch.setattr(config_paths.os, "listdir", listdir)


def test_a_directory_that_vanishes_while_listed_is_one_config_error(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "a.yaml").write_text("version: 1\n")
    _vanishing_listdir(monkeypatch, str(conf))
    with pytest.raises(ConfigError) as exc:
        config_paths.expand_paths([str(conf)])
    assert str(exc.value) == f"{conf}: no such file or directory"


def test_validate_of_a_vanishing_directory_is_one_error_line(tmp_path, monkeypatch, capsys):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "a.yaml").write_text("version: 1\n")
    _vanishing_listdir(monkeypatch, str(conf))
    rc = cli_main(["validate", str(conf)])
    err = capsys.readouterr().err
    assert rc == 1 and err == f"error: {conf}: no such file or directory\n", err


def test_a_saved_plan_that_vanishes_while_looked_at_is_no_saved_plan(tmp_path, monkeypatch):
    gone = str(tmp_path / "plan.json")
    monkeypatch.setattr(os.path, "isfile", lambda _p: True)  # there when looked at
    assert is_saved_plan([gone]) is False


def test_a_watched_directory_made_again_is_watched_again(tmp_path):
    """The watch on a directory dies with it: the one made in its place is watched anew (its
    return, seen in the parent, asks for a pass too)."""
    conf = tmp_path / "conf"
    conf.mkdir()
    heard: list[str] = []
    event = threading.Event()

    def on_change(path: str) -> None:
        heard.append(path)
        event.set()

    watcher = FileWatcher([str(conf)], on_change)
    watcher.start()
    try:
        shutil.rmtree(conf)
        conf.mkdir()
        assert event.wait(10), "the directory's return asked for nothing"
        watcher.ensure()  # what the pass it asked for does first
        heard.clear()
        event.clear()
        (conf / "a.yaml").write_text("version: 1\n")
        deadline = time.monotonic() + 10
        while str(conf / "a.yaml") not in heard and time.monotonic() < deadline:
            event.wait(0.5)
            event.clear()
        assert str(conf / "a.yaml") in heard, f"not heard in the new directory: {heard}"
    finally:
        watcher.close()


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


# ----------------------------------------------------------------- a scope's identity


def test_the_host_id_names_inode_and_cookie_and_accepts_the_inode_alone_as_before():
    host = nsfs.current_id()
    inode, _, cookie = host.partition("-")
    assert inode == str(nsfs.current_inode()) and cookie.isdigit(), host
    assert ownership.host_inode(host) == inode
    assert ownership.alloc_ns_marks(host) == (
        f"managed-by=reconciler alloc-of={host}", f"managed-by=reconciler alloc-of={inode}")
    assert ownership.alloc_ns_marks(inode) == (f"managed-by=reconciler alloc-of={inode}",)
    # the probes' vantage stays on the inode: its names do not move with the cookie
    assert ownership.probe_vantage_names(host) == ownership.probe_vantage_names(inode)


def test_an_earlier_versions_unnamed_scope_counts_for_declared_networks_only_by_its_inode():
    scope = "netns-inode/4026532301-24955"
    assert declared_scope_matches(scope, scope)
    assert declared_scope_matches("netns-inode/4026532301", scope)
    assert not declared_scope_matches("netns-inode/4026532302", scope)
    assert not declared_scope_matches("netns/a", "netns/a-1")
    assert not declared_scope_matches("host", scope)
