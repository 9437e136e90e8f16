"""The tests' helper scripts as forks inside a namespace (tests/support/nsexec.py).

A fork that joins a namespace must be what ``nsenter --net=... python -c`` is there: the
namespace's own network (its inode, its links), the arguments and the exit code; one
line and exit code 1 for a namespace that is not there; the same through a cell's mount
namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.support import nsexec
from tests.support.forkserver import SERVER, base_env
from tests.support.host import Netns, unique

pytestmark = pytest.mark.root

#: the namespaces it runs in, by inode, and its argv; exits with argv[1]
WHERE = ("import json, os, socket, sys\n"
         "print(json.dumps({'net': os.stat('/proc/self/ns/net').st_ino,\n"
         "                  'mnt': os.stat('/proc/self/ns/mnt').st_ino,\n"
         "                  'links': sorted(n for _, n in socket.if_nameindex()),\n"
         "                  'argv': sys.argv[1:], 'cwd': os.getcwd()}))\n"
         "sys.exit(int(sys.argv[1]))\n")


def test_a_fork_in_a_namespace_is_what_nsenter_python_c_is(host_ns: Netns) -> None:
    assert SERVER.serves(base_env()), "the fork server does not serve the tests"
    forked = nsexec.run(host_ns.name, WHERE, "3", "a b", check=False)
    real = subprocess.run([*nsexec.enter_args(host_ns.name), sys.executable, "-c", WHERE,
                           "3", "a b"], capture_output=True, text=True, timeout=60,
                          env=base_env())
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (real.returncode, real.stdout, real.stderr)
    seen = json.loads(forked.stdout)
    assert seen["net"] == host_ns.inode() != os.stat("/proc/self/ns/net").st_ino
    assert seen["argv"] == ["3", "a b"] and forked.returncode == 3


def test_a_listener_fork_serves_inside_the_namespace(host_ns: Netns) -> None:
    host_ns.run("ip", "link", "set", "lo", "up")
    serve = ("import socket\ns = socket.create_server(('127.0.0.1', 7001))\n"
             "print('ready', flush=True)\nc, _ = s.accept(); c.sendall(b'hi'); c.close()\n")
    p = nsexec.popen(host_ns.name, serve, stdout=nsexec.PIPE)
    try:
        assert p.stdout.readline().strip() == "ready"
        got = nsexec.run(host_ns.name, "import socket\n"
                         "print(socket.create_connection(('127.0.0.1', 7001), 5).recv(9))")
        assert got.stdout.strip() == "b'hi'"
        assert p.wait(30) == 0
    finally:
        p.kill()
        p.wait()


def test_a_namespace_that_is_not_there_is_one_line_and_exit_1() -> None:
    r = nsexec.run(unique("gone"), "print('ran')", check=False)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, r


def test_a_fork_joins_a_mount_namespace_after_the_network_one(host_ns: Netns,
                                                              tmp_path: Any) -> None:
    """As nsenter --net --mount --wd: both namespace files and the working directory are
    opened where the caller is, then the network namespace is joined, then the mount one
    (where a tmpfs covers the directory and holds a file the caller cannot see)."""
    keeper = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               "mount -t tmpfs tmpfs \"$1\" && touch \"$1/inside\" && "
                               "echo ready && exec sleep 1000", "sh", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    see = WHERE.replace("'cwd': os.getcwd()", "'cwd': os.getcwd(), "
                        "'inside': os.path.exists(sys.argv[2])")
    inside = str(tmp_path / "inside")
    try:
        assert keeper.stdout is not None and keeper.stdout.readline().strip() == "ready"
        mnt = f"/proc/{keeper.pid}/ns/mnt"
        forked = nsexec.run(host_ns.name, see, "0", inside, mnt=mnt, cwd=str(tmp_path))
        real = subprocess.run([*nsexec.enter_args(host_ns.name, mnt, str(tmp_path)),
                               sys.executable, "-c", see, "0", inside], capture_output=True,
                              text=True, timeout=60, env=base_env())
        assert (forked.returncode, forked.stdout, forked.stderr) == \
            (real.returncode, real.stdout, real.stderr)
        seen = json.loads(forked.stdout)
        assert seen["net"] == host_ns.inode() and seen["mnt"] == os.stat(mnt).st_ino
        assert seen["inside"] and not os.path.exists(inside)
    finally:
        keeper.kill()
        keeper.wait()
