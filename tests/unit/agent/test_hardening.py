"""Local users cannot steer the agent: trusted paths, run files, reserved names, the status
server under a flood of idle connections (all on this machine's loopback)."""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import time
import urllib.request
from typing import Any

import pytest

from reconciler.agent import status
from reconciler.agent.revision import check_permissions, resolution
from reconciler.config.load import load
from reconciler.domain.errors import ConfigError, PreconditionError
from reconciler.domain.ownership import alloc_veth_name, reserved_link_name
from reconciler.drivers import iptables, rundir
from reconciler.planner.hostlinks import is_temp_bridge_name

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (owners and modes)")


def _tree(tmp_path: Any) -> tuple[str, str]:
    """A trusted conf dir and a world-writable dir beside it."""
    conf, ww = tmp_path / "conf", tmp_path / "ww"
    conf.mkdir(mode=0o755)
    ww.mkdir()
    os.chmod(ww, 0o1777)
    os.chmod(tmp_path, 0o755)
    return str(conf), str(ww)


# ----------------------------------------------------------------- paths


def test_resolution_follows_each_link_and_lists_every_directory(tmp_path):
    conf, ww = _tree(tmp_path)
    real = os.path.join(ww, "real.yaml")
    with open(real, "w") as fh:
        fh.write("version: 1\n")
    os.symlink("../ww/real.yaml", os.path.join(conf, "a.yaml"))
    seen = [p for p, _st in resolution(os.path.join(conf, "a.yaml"))]
    assert seen[0] == "/" and conf in seen and ww in seen and seen[-1] == real
    assert os.path.join(conf, "a.yaml") not in seen  # the link itself: its directory counts


def test_a_loop_of_links_is_one_error(tmp_path):
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    with pytest.raises(OSError) as exc:
        resolution(str(tmp_path / "a"))
    assert exc.value.errno == errno.ELOOP


@root_only
def test_a_link_into_a_world_writable_directory_is_refused_even_sticky(tmp_path):
    conf, ww = _tree(tmp_path)
    with open(os.path.join(ww, "real.yaml"), "w") as fh:
        fh.write("version: 1\n")
    os.chmod(os.path.join(ww, "real.yaml"), 0o644)
    os.symlink(os.path.join(ww, "real.yaml"), os.path.join(conf, "a.yaml"))
    for mode in (0o1777, 0o777, 0o775):
        os.chmod(ww, mode)
        with pytest.raises(PreconditionError) as exc:
            check_permissions([conf])
        msg = str(exc.value)
        assert msg.startswith(f"{ww} (on the way to {conf}/a.yaml): refusing to watch")
        assert "writable by group or others" in msg and "\n" not in msg
        assert ("sticky" in msg) == bool(mode & stat.S_ISVTX)
    os.chmod(ww, 0o755)
    chain = check_permissions([conf])
    assert (ww, os.stat(ww).st_dev, os.stat(ww).st_ino) in chain


@root_only
def test_the_directory_holding_a_link_counts_and_so_does_every_parent(tmp_path):
    conf, _ww = _tree(tmp_path)
    with open(os.path.join(conf, "a.yaml"), "w") as fh:
        fh.write("version: 1\n")
    check_permissions([os.path.join(conf, "a.yaml")])
    os.chmod(tmp_path, 0o757)  # a parent of the conf dir, writable by others
    with pytest.raises(PreconditionError, match="writable by group or others"):
        check_permissions([os.path.join(conf, "a.yaml")])
    os.chmod(tmp_path, 0o755)
    os.chown(conf, 65534, 65534)  # another user's directory
    with pytest.raises(PreconditionError, match="belongs to uid 65534"):
        check_permissions([conf])


@root_only
def test_the_check_returns_what_it_checked_so_a_flip_is_seen(tmp_path):
    conf, _ww = _tree(tmp_path)
    for name in ("one", "two"):
        os.mkdir(tmp_path / name)
        (tmp_path / name / "a.yaml").write_text("version: 1\n")
    os.symlink(str(tmp_path / "one"), os.path.join(conf, "current"))
    before = check_permissions([os.path.join(conf, "current")])
    os.symlink(str(tmp_path / "two"), os.path.join(conf, "next"))
    os.rename(os.path.join(conf, "next"), os.path.join(conf, "current"))  # git-sync's swap
    assert check_permissions([os.path.join(conf, "current")]) != before


# ----------------------------------------------------------------- run files


def test_run_directory_problems():
    st = os.lstat("/")
    assert rundir.dir_problem(st, st.st_uid) is None
    assert rundir.dir_problem(st, st.st_uid + 1) == f"it belongs to uid {st.st_uid}, not uid " \
                                                    f"{st.st_uid + 1}"


@root_only
def test_run_directory_is_made_private_and_checked(tmp_path):
    d = str(tmp_path / "run")
    assert rundir.ensure_dir(d) == d
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    os.chmod(d, 0o777)
    with pytest.raises(PreconditionError, match="writable by group or others"):
        rundir.ensure_dir(d)
    os.rmdir(d)
    os.symlink(str(tmp_path), d)
    with pytest.raises(PreconditionError, match="it is a symlink"):
        rundir.ensure_dir(d)


def test_run_files_are_never_opened_through_a_link(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    link = tmp_path / "netns-1.lock"
    os.symlink(str(target), link)
    with pytest.raises(OSError) as exc:
        rundir.open_file(str(link))
    assert exc.value.errno == errno.ELOOP
    assert "is a symlink; refusing to follow it" in rundir.describe_open_error(str(link),
                                                                               exc.value)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        rundir.open_file(str(tmp_path / "fifo"))
    assert target.read_text() == "keep me\n"


# ----------------------------------------------------------------- names


@pytest.mark.parametrize("name", [alloc_veth_name("web-1"), "vr0123456789ab", "rcltmp0a1b2c3d"])
def test_reserved_link_names_are_refused_at_validate(tmp_path, name: str):
    f = tmp_path / "a.yaml"
    f.write_text(f"version: 1\nbridges:\n  - name: {name}\n")
    with pytest.raises(ConfigError) as exc:
        load([str(f)])
    msg = str(exc.value)
    assert msg.startswith(f"{f}:3:") and "reserves" in msg and "\n" not in msg


@pytest.mark.parametrize("name", ["vr0123456789a", "vr0123456789abc", "vrABCDEF012345", "rcltmp1",
                                  "rcltmpzzzzzzzz", "nomad", "vrbr0"])
def test_names_near_the_patterns_pass(name: str):
    assert reserved_link_name(name) is None


def test_the_planners_temporary_bridge_pattern_is_the_reserved_one():
    for name in ("rcltmp0a1b2c3d", "rcltmp0a1b2c3", "rcltmpabcdefgh", "rcltmp00000000x"):
        assert is_temp_bridge_name(name) == (reserved_link_name(name) is not None), name


# ----------------------------------------------------------------- backends


def test_backend_mismatch_message():
    msg = iptables.other_backend_problem("nf_tables", ["DOCKER", "DOCKER-USER"])
    assert msg is not None and "\n" not in msg
    assert "Docker's chains (DOCKER, DOCKER-USER) are in the legacy backend" in msg
    assert iptables.other_backend_problem("legacy", []) is None


# ----------------------------------------------------------------- status server


def _server(**limits: float) -> status.StatusServer:
    m = status.Metrics()
    board = status.StatusBoard(pass_count=1)
    srv = status.StatusServer(status.bind("127.0.0.1:0"), board, m, lambda: (True, "ok"))
    for k, v in limits.items():
        setattr(srv, k, v)
    srv.start()
    return srv


def _get(addr: str, path: str, timeout: float = 3.0) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{addr}{path}", timeout=timeout) as r:
        return r.status, r.read()


def test_idle_connections_cost_no_thread_and_healthz_still_answers(caplog):
    srv = _server(MAX_CONNECTIONS=32)
    host, port = srv.sock.getsockname()[:2]
    before = threading.active_count()
    idle = []
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, "reconciler.status"):
            for _ in range(300):
                idle.append(socket.create_connection((host, port), timeout=2))
            time.sleep(0.3)
            assert threading.active_count() == before
            t0 = time.monotonic()
            assert _get(srv.address, "/healthz") == (200, b"ok\n")
            assert time.monotonic() - t0 < 2
            deadline = time.monotonic() + 3
            while srv.open_connections > 32 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert srv.open_connections <= 32
        refused = [r for r in caplog.records if "closed a connection" in r.getMessage()]
        assert refused and all(r.exc_info is None for r in caplog.records)
        # one line a second per peer at most, with a count
        assert len(refused) <= time.monotonic() - started + 1, [r.getMessage() for r in refused]
        assert srv.metrics.status_refused._value.get() >= 300 - 32  # noqa: SLF001
    finally:
        for s in idle:
            s.close()
        srv.close()


def test_a_client_that_sends_nothing_is_closed_after_the_timeout():
    srv = _server(REQUEST_TIMEOUT=0.5)
    host, port = srv.sock.getsockname()[:2]
    try:
        s = socket.create_connection((host, port), timeout=3)
        t0 = time.monotonic()
        assert s.recv(100) == b""  # closed by the server
        assert 0.3 < time.monotonic() - t0 < 2.5
        s.close()
    finally:
        srv.close()


@pytest.mark.parametrize(("request_bytes", "code"), [
    (b"POST /status HTTP/1.1\r\n\r\n", b"405"), (b"GARBAGE\r\n\r\n", b"400"),
    (b"GET /nope HTTP/1.0\r\n\r\n", b"404"), (b"GET /status HTTP/1.0\r\nX: " + b"a" * 9000,
                                              b"431")])
def test_bad_requests_get_one_answer_and_no_traceback(caplog, request_bytes: bytes, code: bytes):
    srv = _server()
    host, port = srv.sock.getsockname()[:2]
    try:
        with caplog.at_level(logging.DEBUG):
            s = socket.create_connection((host, port), timeout=3)
            s.sendall(request_bytes)
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
            s.close()
        assert answer.split(b" ", 2)[1] == code
        assert all(r.exc_info is None for r in caplog.records)
        assert _get(srv.address, "/status")[0] == 200  # and it goes on serving
    finally:
        srv.close()


# ----------------------------------------------------------------- firewalld


def test_firewalld_bridges_outside_an_accepting_zone_get_the_one_command(monkeypatch):
    from reconciler.drivers import firewalld

    zones = {"br0": "", "br1": "trusted", "br2": "public"}
    targets = {"trusted": "ACCEPT", "public": "default"}

    def cmd(*args: str) -> Any:
        arg = args[0]
        if arg.startswith("--get-zone-of-interface="):
            zone = zones[arg.split("=", 1)[1]]
            return type("R", (), {"returncode": 0 if zone else 2, "stdout": zone + "\n"})()
        zone = arg.split("=", 1)[1]
        return type("R", (), {"returncode": 0,
                              "stdout": f"{zone}\n  target: {targets[zone]}\n  x: y\n"})()

    monkeypatch.setattr(firewalld, "running", lambda: True)
    monkeypatch.setattr(firewalld, "_cmd", cmd)
    msg = firewalld.bridges_problem(["br2", "br1", "br0"])
    assert msg is not None and "\n" not in msg and "bridge(s) br0, br2 " in msg
    assert ("run `firewall-cmd --permanent --zone=trusted --change-interface=br0 "
            "--change-interface=br2 && firewall-cmd --reload`") in msg
    assert firewalld.bridges_problem(["br1"]) is None
    monkeypatch.setattr(firewalld, "running", lambda: False)
    assert firewalld.bridges_problem(["br0"]) is None


def test_no_firewalld_process_here_means_no_process_is_run(monkeypatch):
    from reconciler.drivers import firewalld

    def boom(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("ran a process although no firewalld runs here")

    monkeypatch.setattr(firewalld.subprocess, "run", boom)
    monkeypatch.setattr(firewalld, "_process_here", lambda: False)
    assert firewalld.running() is False
