"""Impact before it happens (issue 15 item 2) against the real kernel and dockerd.

What a plan says it disrupts is compared with what an apply then disrupts, seen with
tools of their own: established TCP connections through each port map (do they still
answer, and from whom), a connection from inside each allocation to its gateway,
``/run/netns``, ``docker inspect``'s endpoints. Flow counts are checked against
connections the test holds open (and one from the host itself on a probe's reserved
source port, which is what a probe looks like and must not count). ``--max-disruption`` must refuse with nothing changed: ``iptables-save``,
our table (``nft list``) and ``ip -j`` the same before and after.

The host is a throwaway namespace (``host_ns``), the client another one routed to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.dockercli import endpoint, networks_file
from tests.support.dockerscratch import DockerScratch
from tests.support.host import SESSION, Netns, sh, unique, write
from tests.support.traffic import client_of

pytestmark = pytest.mark.root

HOST4, CLIENT4 = "10.97.0.1", "10.97.0.2"
BRIDGE, GATEWAY = "rcimp0", "10.79.0.1"
ADDR = {"a": "10.79.0.10", "b": "10.79.0.20", "c": "10.79.0.30"}
PORT_A, PORT_B, PORT_C = 18080, 18081, 18083
GATE_PORT = 7000  # a listener of the host's on every address: what allocations dial
PROBE_SPORT = 61500  # in the probes' reserved range: from the host, such a flow is a probe's

#: answers every line of every TCP connection with its tag (argv[1]) on port argv[2]
SERVE = r"""
import socket, sys, threading
tag, port = sys.argv[1].encode(), int(sys.argv[2])
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("0.0.0.0", port)); t.listen(16)
def conn(c):
    for _line in c.makefile("rb"):
        c.sendall(tag + b"\n")
print("ready", flush=True)
while True:
    c, _ = t.accept(); threading.Thread(target=conn, args=(c,), daemon=True).start()
"""

#: one TCP connection (from source port argv[3] unless 0) kept open; for each line on stdin
#: it sends one and prints the answer: the tag, "reset", "closed" or "timeout"
KEEP = r"""
import socket, sys
c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if int(sys.argv[3]):
    c.bind(("0.0.0.0", int(sys.argv[3])))
c.settimeout(3); c.connect((sys.argv[1], int(sys.argv[2])))
f = c.makefile("rb")
print("connected", flush=True)
for _cmd in sys.stdin:
    try:
        c.sendall(b"ping\n"); line = f.readline().decode().strip()
        print(line or "closed", flush=True)
    except ConnectionResetError:
        print("reset", flush=True)
    except socket.timeout:
        print("timeout", flush=True)
    except OSError as e:
        print(type(e).__name__, flush=True)
"""

#: a fresh TCP connection to argv[1]:argv[2]: prints the first answer line, or why not
DIAL = r"""
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5)
    c.sendall(b"ping\n"); print(c.makefile("rb").readline().decode().strip() or "closed")
except OSError as e:
    print(type(e).__name__)
"""


@contextlib.contextmanager
def serving(ns_path: str, tag: str, port: int) -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen(["nsenter", f"--net={ns_path}", sys.executable, "-c", SERVE, tag,
                          str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 10)
        assert ready and p.stdout.readline().strip() == "ready", f"listener {tag}"
        yield p
    finally:
        p.kill()
        p.wait()


class Kept:
    """An established connection from the client through a host port."""

    def __init__(self, client: str, port: int, sport: int = 0) -> None:
        self.port = port
        self.p = subprocess.Popen(["ip", "netns", "exec", client, sys.executable, "-c", KEEP,
                                   HOST4, str(port), str(sport)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.read() == "connected", self.p.stderr.read() if self.p.stderr else ""

    def read(self) -> str:
        assert self.p.stdout is not None
        ready, _, _ = select.select([self.p.stdout], [], [], 10)
        return self.p.stdout.readline().strip() if ready else "no answer"

    def ask(self) -> str:
        assert self.p.stdin is not None
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


def dial(ns: str, ip: str, port: int) -> str:
    return sh("ip", "netns", "exec", ns, sys.executable, "-c", DIAL, ip, str(port)).stdout.strip()


def config(allocs: dict[str, list[int]]) -> str:
    """One bridge and IPv4 subnet; each alloc at its fixed address with ports -> 80."""
    lines = ["version: 1", "bridges:", f"  - {{name: {BRIDGE}}}", "subnets:",
             f"  - {{name: net, bridge: {BRIDGE}, cidr: 10.79.0.0/24}}",
             "allocs:" if allocs else "allocs: []"]
    for aid, ports in allocs.items():
        lines.append("  - " + json.dumps({
            "id": aid, "subnet": "net", "address": ADDR[aid.rsplit("-", 1)[-1]],
            "ports": [{"host": p, "to": 80} for p in ports]}))
    return "\n".join(lines) + "\n"


def snapshot(host: Netns) -> dict[str, Any]:
    """The host as independent tools show it."""
    def save(family: int) -> list[str]:
        return [ln for ln in host.iptables_save(family).splitlines()
                if not ln.startswith("#") and not ln.startswith(":")]  # counters, dates

    table = host.run("nft", "list", "table", "inet", "reconciler", check=False).stdout
    return {"ipv4": save(4), "ipv6": save(6), "table": table.splitlines(),
            "links": [(lk["ifname"], lk.get("master"), lk["operstate"], lk.get("mtu"))
                      for lk in host.ip_json("link", "show")],
            "addrs": [(a["ifname"], sorted(x["local"] for x in a["addr_info"]))
                      for a in host.ip_json("addr", "show")],
            # this run's namespaces only: others share the machine's /run/netns
            "netns": sorted(n for n in os.listdir("/run/netns") if n.startswith(SESSION))}


def predicted(out: str) -> dict[tuple[str, str], dict[str, Any]]:
    plan = json.loads(out)
    return {(i["type"], i["name"]): i for c in plan["changes"] for i in c["impact"]}


@pytest.fixture
def client(host_ns: Netns) -> Iterator[str]:
    with client_of(host_ns, host_ip=HOST4, client_ip=CLIENT4) as c:
        yield c.name


def test_predicted_disconnections_are_exactly_the_observed_ones(
        host_ns: Netns, client: str, tmp_path: object) -> None:
    ids = {k: unique(k) + "-" + k for k in ADDR}
    a, b, c = ids["a"], ids["b"], ids["c"]
    path = write(tmp_path, "i.yaml", config({a: [PORT_A], b: [PORT_B], c: [PORT_C]}))
    r = host_ns.reconcile("apply", "--no-probe", path)
    assert r.rc == 0, r.all
    with contextlib.ExitStack() as stack:
        for aid, tag in ((a, "A"), (b, "B"), (c, "C")):
            stack.enter_context(serving(f"/run/netns/{aid}", tag, 80))
        holder_a = stack.enter_context(serving(f"/run/netns/{a}", "A", GATE_PORT + 1))
        stack.enter_context(serving(f"/run/netns/{host_ns.name}", "gw", GATE_PORT))
        kept = {name: Kept(client, port) for name, port in
                (("a", PORT_A), ("b", PORT_B), ("c", PORT_C))}
        probe_like = Kept(host_ns.name, PORT_A, PROBE_SPORT)
        for k in (*kept.values(), probe_like):
            stack.callback(k.close)
        assert {n: k.ask() for n, k in kept.items()} == {"a": "A", "b": "B", "c": "C"}
        assert probe_like.ask() == "A"

        # a pruned, b's map moved to c: 3 items, one of them a port map that moves
        second = config({b: [], c: [PORT_B, PORT_C]})
        write(tmp_path, "i.yaml", second)
        before = snapshot(host_ns)
        assert any("alloc=" in ln for ln in before["table"]), before  # our port maps there
        refused = host_ns.reconcile("apply", "--no-probe", "--max-disruption", "2", path)
        assert refused.rc == 1, refused.all
        err = [ln for ln in refused.err.splitlines() if ln.strip()]
        assert err == ["error: the plan disrupts 3 items (1 alloc, 2 port maps), more than "
                       "--max-disruption 2: refused, nothing changed"], refused.all
        assert "impact: alloc " + a in refused.out  # what it refused is shown
        assert snapshot(host_ns) == before
        assert {n: k.ask() for n, k in kept.items()} == {"a": "A", "b": "B", "c": "C"}
        r = host_ns.reconcile("plan", "--max-disruption", "2", path)
        assert r.rc == 1 and "more than --max-disruption 2" in r.err, r.all
        assert host_ns.reconcile("plan", "--max-disruption", "3", path).rc == 2

        saved = os.path.join(str(tmp_path), "saved.json")
        r = host_ns.reconcile("plan", "--output", "json", "--out", saved, path)
        assert r.rc == 2, r.all
        want = predicted(r.out)
        assert set(want) == {("alloc", a), ("port_map", f"{PORT_A}/tcp"),
                             ("port_map", f"{PORT_B}/tcp")}, want
        assert want[("alloc", a)]["addresses"] == [ADDR["a"]]
        # the client's connection to a; the host's own from a probe's port is not counted
        assert want[("alloc", a)]["flows"] == 1
        assert want[("port_map", f"{PORT_A}/tcp")]["flows"] == 1
        assert want[("port_map", f"{PORT_B}/tcp")]["flows"] == 1
        assert want[("port_map", f"{PORT_B}/tcp")]["effect"].startswith(f"moves from alloc {b}")
        text = host_ns.reconcile("plan", path).out
        assert f"impact: port map {PORT_A}/tcp: closed (it sent to alloc {a}" in text
        assert "Impact: 3 items disrupted (1 alloc, 2 port maps)." in text

        # flows move on their own: one more does not make the saved plan stale
        extra = Kept(client, PORT_A)
        stack.callback(extra.close)
        r = host_ns.reconcile("apply", "--no-probe", saved)
        assert r.rc == 0, r.all

        # observed: which port maps lost their established connection ...
        answers = {n: k.ask() for n, k in kept.items()}
        lost_maps = {f"{k.port}/tcp" for n, k in kept.items() if answers[n] != n.upper()}
        assert lost_maps == {name for kind, name in want if kind == "port_map"}, answers
        assert answers["b"] == "reset"  # its flow now meets c, which knows nothing of it
        assert dial(client, HOST4, PORT_B) == "C" and dial(client, HOST4, PORT_C) == "C"
        assert dial(client, HOST4, PORT_A) != "A"
        # ... and which allocations lost connectivity: a (held by its listener, so its
        # namespace lives on without a name) no longer reaches its gateway; b and c do
        reach = {aid: dial(aid, GATEWAY, GATE_PORT) for aid in (b, c)}
        reach[a] = sh("nsenter", f"--net=/proc/{holder_a.pid}/ns/net", sys.executable, "-c",
                      DIAL, GATEWAY, str(GATE_PORT)).stdout.strip()
        lost_allocs = {aid for aid, said in reach.items() if said != "gw"}
        assert lost_allocs == {name for kind, name in want if kind == "alloc"}, reach
        assert not os.path.exists(f"/run/netns/{a}")


def test_watch_refuses_a_pass_over_max_disruption(host_ns: Netns, tmp_path: object) -> None:
    """The agent: nothing changed, the status and the log say why."""
    from tests.support.agent import Agent, confdir

    a = unique("w") + "-a"
    conf = confdir(tmp_path)
    path = write(conf, "w.yaml", config({a: [PORT_A]}))
    assert host_ns.reconcile("apply", "--no-probe", path).rc == 0
    write(conf, "w.yaml", config({}))
    before = snapshot(host_ns)
    assert any("alloc=" in ln for ln in before["table"]), before
    agent = Agent(host_ns, [conf], "--max-disruption", "1", "--no-probe")  # type: ignore[arg-type]
    try:
        status = agent.wait_status(lambda s: (s.get("last_pass") or {}).get("result")
                                   == "failed", what="the refused pass")
        line = ("the plan disrupts 2 items (1 alloc, 1 port map), more than "
                "--max-disruption 1: refused, nothing changed")
        assert status["last_pass"]["error"] == line, status
        assert {"resource": f"alloc/{a}",
                "error": "would be disrupted: deleted: loses connectivity"} in status["errors"]
        assert line in agent.log_text()
        assert snapshot(host_ns) == before
    finally:
        assert agent.stop() == 0


def test_the_plan_agent_counts_flows_too(host_ns: Netns, client: str, tmp_path: object) -> None:
    """`reconcile plan` answered by a running agent counts the flows of each answer (they
    are read per request, never kept) and prints what the in-process plan prints."""
    from tests.support.agent import PlanAgent, same_as_in_process

    a = unique("p") + "-a"
    conf = os.path.join(str(tmp_path), "files")
    os.mkdir(conf)
    path = write(conf, "p.yaml", config({a: [PORT_A]}))
    assert host_ns.reconcile("apply", "--no-probe", path).rc == 0
    agent = PlanAgent(host_ns, tmp_path)
    try:
        write(conf, "p.yaml", config({}))
        with serving(f"/run/netns/{a}", "A", 80):
            first = agent.plan(path)
            assert first.rc == 2 and f"impact: port map {PORT_A}/tcp" in first.out, first.all
            assert "no established flows" in first.out, first.out
            held = Kept(client, PORT_A)
            try:
                assert held.ask() == "A"
                again = same_as_in_process(agent, path)
                assert f"{PORT_A}/tcp" in again.out and "; 1 established flow" in again.out, \
                    again.out
            finally:
                held.close()
    finally:
        assert agent.agent.stop() == 0


#: in a namespace of its own: UDP datagrams from 127.0.0.2 and 127.0.0.3 to 127.0.0.1 (each a
#: conntrack entry), then the entries a kernel-filtered dump returns, unfiltered here
FILTERED_DUMP = r"""
import ipaddress, json, socket, time
from reconciler.drivers.netlink import conntrack as ct
for src in ("127.0.0.2", "127.0.0.3", "127.0.0.3"):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((src, 0))
    u.sendto(b"x", ("127.0.0.1", 5999)); u.close()
time.sleep(0.1)
table = ct.Conntrack()
def raw(**kw):
    body = ct.NFGENMSG.pack(socket.AF_INET, 0, 0) + ct.dump_filter(**kw)
    return sorted(str(e.orig.src) + ">" + str(e.reply.src)
                  for m in table._sock.dump(ct.CT_GET, body, "test")
                  if (e := ct.parse_entry(m)) is not None)
three, lo = ipaddress.ip_address("127.0.0.3"), ipaddress.ip_address("127.0.0.1")
print(json.dumps({"all": raw(), "orig": raw(orig_src=three), "reply": raw(reply_src=three),
                  "reply_lo": raw(reply_src=lo),
                  "flows": sorted(str(e.orig.src) for e in table.flows(4, [three], []))}))
"""


def test_the_kernel_filters_the_flow_dumps(host_ns: Netns) -> None:
    """The dumps behind the flow counts are filtered by the kernel (CTA_FILTER by original
    or reply source), not only here: the entries it sends back are the asked ones."""
    # loopback traffic is tracked once a rule needs conntrack in the namespace
    host_ns.run("iptables", "-A", "OUTPUT", "-m", "conntrack", "--ctstate", "NEW", "-j",
                "ACCEPT")
    out = host_ns.run(sys.executable, "-c", FILTERED_DUMP).stdout
    got = json.loads(out)
    assert got["all"] == ["127.0.0.2>127.0.0.1", "127.0.0.3>127.0.0.1", "127.0.0.3>127.0.0.1"]
    assert got["orig"] == ["127.0.0.3>127.0.0.1", "127.0.0.3>127.0.0.1"]
    assert got["reply"] == []  # nothing answers from 127.0.0.3
    assert len(got["reply_lo"]) == 3
    assert got["flows"] == ["127.0.0.3", "127.0.0.3"]


# ------------------------------------------------------------------ Docker




@pytest.mark.docker
def test_a_forced_replace_predicts_exactly_the_containers_it_disconnects(
        host_ns: Netns, docker_scratch_image: DockerScratch, tmp_path: object) -> None:
    """Predicted: the containers of the replaced network, with their addresses. Observed
    (``docker inspect``): exactly their endpoints were made again; a container on a network
    the plan leaves alone keeps its endpoint."""
    changed, kept = docker_scratch_image.name("chg"), docker_scratch_image.name("kept")
    nets = (f"{{name: {changed}, subnet: 172.29.7.0/24}}",
            f"{{name: {kept}, subnet: 172.29.8.0/24}}")
    f = networks_file(tmp_path, *nets)
    assert host_ns.reconcile("apply", f).rc == 0
    c1, c2, c3 = (docker_scratch_image.container(s) for s in ("c1", "c2", "c3"))
    docker_scratch_image.attach(c1, changed)
    docker_scratch_image.attach(c2, changed)
    docker_scratch_image.attach(c3, kept)
    before = {c.name: (n, endpoint(c, n)) for c, n in ((c1, changed), (c2, changed),
                                                        (c3, kept))}
    g = networks_file(tmp_path, f"{{name: {changed}, subnet: 172.29.7.0/24, mtu: 1400}}",
                      nets[1], name="g.yaml")
    r = host_ns.reconcile("plan", "--force-replace", "--output", "json", g)
    assert r.rc == 2, r.all
    want = predicted(r.out)
    assert set(want) == {("container", c1.name), ("container", c2.name)}, want
    for c in (c1, c2):
        assert want[("container", c.name)]["addresses"] == [before[c.name][1]["IPAddress"]]
        # a sandbox's containers are in the conntrack table of dockerd's namespace
        assert want[("container", c.name)]["flows"] is None
    r = host_ns.reconcile("apply", "--force-replace", "--max-disruption", "1", g)
    assert r.rc == 1 and "2 items (2 containers)" in r.err, r.all
    assert all(endpoint(c, n)["EndpointID"] == ep["EndpointID"]
               for c, (n, ep) in zip((c1, c2, c3), before.values(), strict=True))
    r = host_ns.reconcile("apply", "--force-replace", g)
    assert r.rc == 0, r.all
    remade = {c.name for c, (n, ep) in zip((c1, c2, c3), before.values(), strict=True)
              if endpoint(c, n)["EndpointID"] != ep["EndpointID"]}
    assert remade == {name for _kind, name in want}
    for c in (c1, c2):
        assert endpoint(c, changed)["IPAddress"] == before[c.name][1]["IPAddress"]
    assert host_ns.reconcile("destroy", "--yes").rc == 0
