"""Impact counts a client's flow from any source port, and never the probes' own.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.allocs import subnet_config as _config
from tests.support.host import Netns, unique
from tests.support.traffic import client_of

pytestmark = pytest.mark.root




# ------------------------------------------------------------------ item 6: impact's flows

#: accepts on argv[1] and keeps every connection open, answering its first line
HOLD = r"""
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
kept = []
def conn(c):
    kept.append(c); c.makefile("rb").readline(); c.sendall(b"held\n")
print("ready", flush=True)
while True:
    c, _ = s.accept(); threading.Thread(target=conn, args=(c,), daemon=True).start()
"""

#: one connection from source port argv[3] to argv[1]:argv[2], held open until killed
DIAL_FROM = r"""
import socket, sys, time
c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
c.bind(("0.0.0.0", int(sys.argv[3]))); c.settimeout(5); c.connect((sys.argv[1], int(sys.argv[2])))
c.sendall(b"hi\n"); print(c.makefile("rb").readline().decode().strip(), flush=True)
time.sleep(3600)
"""


@contextlib.contextmanager
def _process(*argv: str) -> Iterator[str]:
    p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 15)
        yield p.stdout.readline().strip() if ready else "no answer"
    finally:
        p.kill()
        p.wait()


def test_impact_counts_a_clients_flow_from_the_probes_port_range(
        host_ns: Netns, tmp_path: Any) -> None:
    """A client of another host whose ephemeral port is in 61000-61999 is a real flow; one
    from the host itself on such a port is what a probe looks like, and is left out."""
    host_ip, port = "10.236.9.1", 18195
    aid, bridge = unique("f") + "-a", unique("b")
    mapped = _config(tmp_path, bridge, "10.236.0.0/24",
                     [{"id": aid, "ports": [{"host": port, "to": 80}]}], "mapped.yaml")
    closed = _config(tmp_path, bridge, "10.236.0.0/24", [{"id": aid}], "closed.yaml")
    assert host_ns.reconcile("apply", "--no-probe", mapped).rc == 0
    with client_of(host_ns, host_ip=host_ip, client_ip="10.236.9.2") as client, \
            _process("nsenter", f"--net=/run/netns/{aid}", sys.executable, "-c", HOLD,
                     "80") as ready, \
            _process("nsenter", f"--net=/run/netns/{client.name}", sys.executable, "-c",
                     DIAL_FROM, host_ip, str(port), "61234") as remote, \
            _process("nsenter", f"--net=/run/netns/{host_ns.name}", sys.executable, "-c",
                     DIAL_FROM, host_ip, str(port), "61235") as local:
        assert (ready, remote, local) == ("ready", "held", "held")
        r = host_ns.reconcile("plan", "--no-agent", "--output", "json", closed)
        assert r.rc == 2, r.all
        impacts = {(i["type"], i["name"]): i for c in json.loads(r.out)["changes"]
                   for i in c["impact"]}
        assert impacts[("port_map", f"{port}/tcp")]["flows"] == 1, impacts


