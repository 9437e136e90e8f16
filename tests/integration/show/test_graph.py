"""``reconcile graph``, ``show`` and the progress line against the real kernel, iptables and
dockerd, in throwaway namespaces.

The DOT is rendered by Graphviz's own ``dot`` (Debian's graphviz, which scripts/install.sh
--test installs) into SVG, and what each node says is checked against ``ip -j``,
``iptables-save`` and ``docker network inspect``, never against our observer. The
progress line is read from a pseudo-terminal that the CLI has for stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.host import Netns, sh, unique, write

pytestmark = pytest.mark.root

BRIDGE = "rcg0"
SVG = "{http://www.w3.org/2000/svg}"
#: the fills ``ui.graph.STYLE`` gives each action (the plan's colours)
FILL = {"create": "#d8f5d0", "update": "#fff1c2", "replace": "#f4d9f7", "delete": "#fad4d4",
        "conflict": "#ff9e9e"}


def config(tmp_path: Any, allocs: list[dict[str, Any]], *, mtu: int = 1400,
           name: str = "g.yaml", cidr: str = "10.78.0.0/24") -> str:
    lines = ["version: 1", "bridges:", f"  - {{name: {BRIDGE}, mtu: {mtu}}}", "subnets:",
             "  - {name: gnet, bridge: " + BRIDGE + f", cidr: {cidr}, cidr6: fd00:78::/64}}",
             "allocs:" if allocs else "allocs: []"]
    lines += ["  - " + json.dumps({"subnet": "gnet", **a}) for a in allocs]
    return write(tmp_path, name, "\n".join(lines) + "\n")


def render(dot_text: str) -> dict[str, ET.Element]:
    """SVG node groups by title, rendered by the real dot (exit 0, nothing on stderr)."""
    exe = shutil.which("dot")
    assert exe, "Graphviz's dot is needed (apt-get install graphviz; scripts/install.sh --test)"
    p = subprocess.run([exe, "-Tsvg"], input=dot_text, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and not p.stderr, p.stderr
    root = ET.fromstring(p.stdout)
    nodes = {t.text or "": g for g in root.iter(f"{SVG}g")
             if g.get("class") == "node" and (t := g.find(f"{SVG}title")) is not None}
    # the graph's own label (title and legend): the top group's drawing, outside the nodes
    (top,) = [g for g in root.iter(f"{SVG}g") if g.get("class") == "graph"]
    nodes["legend"] = ET.Element("label")
    nodes["legend"].extend(el for el in top if el.tag != f"{SVG}g")
    return nodes


def texts(g: ET.Element) -> list[str]:
    return [t.text or "" for t in g.iter(f"{SVG}text")]


def fills(g: ET.Element) -> set[str]:
    return {el.get("fill", "") for el in g if el.tag in (f"{SVG}path", f"{SVG}polygon")}


def eth0(alloc: str) -> tuple[list[str], str]:
    """Global addresses and MAC of an allocation's eth0, read with ``ip -j``."""
    (link,) = json.loads(sh("ip", "-n", alloc, "-j", "addr", "show", "eth0").stdout)
    return (sorted(f"{a['local']}/{a['prefixlen']}" for a in link["addr_info"]
                   if a.get("scope") == "global"), link["address"])


def dnat_ports(host: Netns, alloc: str) -> set[str]:
    """``HOST/PROTO->TO`` of the allocation's DNAT rules: our table's port-map entries in
    their rule form (``Netns.our_rules``)."""
    out = set()
    for line in host.our_rules(4).splitlines():
        if re.search(f'--comment "?reconciler:alloc={re.escape(alloc)}"? ', line) \
                and "-j DNAT" in line:
            proto = re.search(r"-p (\w+)", line)
            dport = re.search(r"--dport (\d+)", line)
            to = re.search(r"--to-destination \S+:(\d+)", line)
            assert proto and dport and to, line
            out.add(f"{dport.group(1)}/{proto.group(1)}->{to.group(1)}")
    return out


def test_graph_and_show_of_the_host_say_what_the_kernel_has(host_ns: Netns, tmp_path: Any):
    a, b = unique("g"), unique("g")
    path = config(tmp_path, [{"id": a, "ports": [{"host": 8080, "to": 80},
                                                 {"host": 5353, "to": 53, "protocol": "udp"}]},
                             {"id": b, "ports": [{"host": "auto", "to": 9000}]}])
    r = host_ns.reconcile("apply", "--no-probe", path)
    assert r.rc == 0, r.all
    r = host_ns.reconcile("graph")
    assert r.rc == 0 and r.err == "", r.all
    nodes = render(r.out)
    assert {f"bridge/{BRIDGE}", "subnet/gnet", f"alloc/{a}", f"alloc/{b}"} <= set(nodes)
    bridge = host_ns.link(BRIDGE)
    assert bridge is not None
    assert f"mac {bridge['address']}" in texts(nodes[f"bridge/{BRIDGE}"])
    assert "gateway 10.78.0.1/24" in texts(nodes["subnet/gnet"])
    for alloc in (a, b):
        addrs, mac = eth0(alloc)
        said = texts(nodes[f"alloc/{alloc}"])
        assert said[0] == f"alloc {alloc}"
        assert set(addrs) | {f"mac {mac}"} <= set(said), said
        want = {p.replace("->", " → ") for p in dnat_ports(host_ns, alloc)}
        assert want and want <= set(said), (want, said)
    # the edges: bridge -> subnet -> each alloc
    edges = set(re.findall(r'^  "([^"]+)" -> "([^"]+)";$', r.out, re.M))
    assert {(f"bridge/{BRIDGE}", "subnet/gnet"), ("subnet/gnet", f"alloc/{a}"),
            ("subnet/gnet", f"alloc/{b}")} <= edges

    doc = json.loads(host_ns.reconcile("show", "--output", "json").out)
    assert {"links", "firewall", "netns", "probe_vantage", "docker_networks"} <= set(doc)
    (br,) = doc["bridges"]
    assert br["name"] == BRIDGE and br["mac"] == bridge["address"]
    (net,) = br["subnets"]
    assert net["name"] == "gnet" and net["cidrs"] == ["10.78.0.0/24", "fd00:78::/64"]
    for shown in net["allocs"]:
        addrs, mac = eth0(shown["id"])
        assert (sorted(shown["addresses"]), shown["mac"]) == (addrs, mac)
        assert {f"{p['host']}/{p['protocol']}->{p['to']}" for p in shown["ports"]} == \
            dnat_ports(host_ns, shown["id"])
    text = host_ns.reconcile("show").out.splitlines()
    at = text.index("  subnet gnet: 10.78.0.0/24 fd00:78::/64, gateway 10.78.0.1/24 "
                    "fd00:78::1/64")
    assert text[at - 1].startswith(f"bridge {BRIDGE}: mtu 1400 up mac {bridge['address']}")
    mine = next(i for i, line in enumerate(text) if line.startswith(f"    alloc {a}: "))
    assert mine > at and text[mine].startswith(f"    alloc {a}: 10.78.0.")
    assert f"mac {eth0(a)[1]} veth vr" in text[mine]
    assert text[mine + 1] == "      ports 5353/udp->53 8080/tcp->80"


def test_graph_plan_colours_what_apply_would_do(host_ns: Netns, tmp_path: Any):
    a, b, c = unique("g"), unique("g"), unique("g")
    first = config(tmp_path, [{"id": a}, {"id": b}])
    assert host_ns.reconcile("apply", "--no-probe", first).rc == 0
    # a foreign bridge where the files want one of ours: a conflict
    host_ns.run("ip", "link", "add", "rcgx", "type", "bridge")
    second = config(tmp_path, [{"id": a}, {"id": c, "ports": [{"host": 8090, "to": 90}]}],
                    mtu=1300, name="g2.yaml")
    with open(second, "a") as fh:
        fh.write("  - {id: " + unique("g") + ", subnet: xnet}\n")
    with open(second) as fh:
        text = fh.read().replace(
            "subnets:\n", "subnets:\n  - {name: xnet, bridge: rcgx, cidr: 10.79.0.0/24}\n")
    text = text.replace("bridges:\n", "bridges:\n  - {name: rcgx}\n")
    with open(second, "w") as fh:
        fh.write(text)
    plan = host_ns.reconcile("plan", "--output", "json", second)
    actions = {f"{ch['kind']}/{ch['name']}": ch["action"]
               for ch in json.loads(plan.out)["changes"]}
    assert actions[f"bridge/{BRIDGE}"] == "update" and actions[f"alloc/{b}"] == "delete"
    assert actions[f"alloc/{c}"] == "create" and actions["bridge/rcgx"] == "conflict", actions
    r = host_ns.reconcile("graph", "--plan", second)
    assert r.rc == 0, r.all
    nodes = render(r.out)
    for node, action in actions.items():
        if node.split("/")[0] not in ("bridge", "subnet", "alloc", "docker_network"):
            continue
        assert FILL[action] in fills(nodes[node]), (node, action)
        symbol = {"create": "+", "update": "~", "delete": "-", "replace": "-/+",
                  "conflict": "!"}[action]
        assert texts(nodes[node])[0].startswith(f"{symbol} "), node
    for node, g in nodes.items():  # nothing to do there: no colour
        if node.split("/")[0] in ("bridge", "subnet", "alloc") and node not in actions:
            assert not fills(g) & set(FILL.values()), node
    assert "mtu: 1400 → 1300" in texts(nodes[f"bridge/{BRIDGE}"])
    assert "8090/tcp → 90" in texts(nodes[f"alloc/{c}"])
    legend = texts(nodes["legend"])
    assert {"+ create", "~ update", "-/+ replace", "- delete"} <= set(legend)
    # graph changed nothing: the same plan after it
    again = host_ns.reconcile("plan", "--output", "json", second)
    assert json.loads(again.out)["changes"] == json.loads(plan.out)["changes"]
    host_ns.run("ip", "link", "del", "rcgx")


@pytest.mark.docker
def test_graph_draws_docker_networks_with_their_containers(host_ns: Netns, tmp_path: Any,
                                                           docker_scratch_image: Any):
    name = docker_scratch_image.name("g")
    path = write(tmp_path, "d.yaml", f"version: 1\ndocker_networks:\n  - {{name: {name}}}\n")
    assert host_ns.reconcile("apply", path).rc == 0
    changed = write(tmp_path, "d2.yaml",
                    f"version: 1\ndocker_networks:\n  - {{name: {name}, mtu: 1400}}\n")
    nodes = render(host_ns.reconcile("graph", "--plan", changed).out)
    assert FILL["replace"] in fills(nodes[f"docker_network/{name}"])
    assert texts(nodes[f"docker_network/{name}"])[0] == f"-/+ docker network {name}"
    box = docker_scratch_image.container("gc")
    net_id = json.loads(sh("docker", "network", "inspect", name).stdout)[0]["Id"]
    docker_scratch_image.attach(box, net_id)
    inspect = json.loads(sh("docker", "network", "inspect", name).stdout)[0]
    (endpoint,) = inspect["Containers"].values()
    r = host_ns.reconcile("graph")
    nodes = render(r.out)
    said = texts(nodes[f"container/{name}/{endpoint['Name']}"])
    assert said == [f"container {endpoint['Name']}", endpoint["IPv4Address"]]
    assert f"id {net_id[:12]}" in texts(nodes[f"docker_network/{name}"])
    assert f'  "docker_network/{name}" -> "container/{name}/{endpoint["Name"]}";' in r.out
    shown = json.loads(host_ns.reconcile("show", "--output", "json").out)
    (net,) = [d for d in shown["docker_networks"] if d["name"] == name]
    assert net["containers"] == [{"name": endpoint["Name"],
                                  "addresses": [endpoint["IPv4Address"]]}]


def on_a_terminal(host: Netns, *args: str, timeout: float = 300) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (stdout a file): (rc, stdout, what the
    terminal got). Not a pipe for stdout, which nobody would read while the terminal is:
    the plan of hundreds of allocations is more than a pipe holds."""
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm", COLUMNS="200")
    with tempfile.TemporaryFile() as out_file:
        p = subprocess.Popen([sys.executable, "-m", "reconciler", "--netns", host.name, *args],
                             stdout=out_file, stderr=slave, stdin=subprocess.DEVNULL, env=env)
        os.close(slave)
        seen = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed its end
                    break
                if not chunk:
                    break
                seen += chunk
            elif p.poll() is not None:
                break
        os.close(master)
        rc = p.wait(timeout=30)
        out_file.seek(0)
        return rc, out_file.read().decode(), seen.decode(errors="replace")


MANY = 200
LINE = re.compile(r"\r\x1b\[K\[ *(\d+)/(\d+)\]")
#: how long another writer holds the host lock before each run on the terminal: the line
#: appears once a command has run for a second, and how long 200 allocations take depends
#: on the machine; the wait makes that second certain (the delay itself: unit tests)
HOLD = 1.5


@contextlib.contextmanager
def lock_held(host: Netns, seconds: float = HOLD) -> Iterator[None]:
    """Another writer holds the host lock for ``seconds`` (from when this yields)."""
    holder = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{host.name}", sys.executable, "-c",
         "import sys, time\nfrom reconciler.engine.lock import host_lock\n"
         "with host_lock():\n    print('held', flush=True)\n"
         f"    time.sleep({seconds})\n"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_progress_line_on_a_terminal_never_on_a_pipe_or_with_json(host_ns: Netns,
                                                                   tmp_path: Any):
    ids = [f"{unique('p')}" for _ in range(MANY)]
    path = config(tmp_path, [{"id": i} for i in ids], cidr="10.78.0.0/22")
    empty = config(tmp_path, [], name="empty.yaml", cidr="10.78.0.0/22")
    with lock_held(host_ns):
        rc, out, tty = on_a_terminal(host_ns, "apply", "--no-probe", path)
    assert rc == 0, tty
    drawn = [(int(d), int(t)) for d, t in LINE.findall(tty)]
    assert len(drawn) >= 2, tty
    total = drawn[0][1]
    assert total >= MANY and all(t == total for _d, t in drawn)
    assert [d for d, _t in drawn] == sorted(d for d, _t in drawn)  # it only goes forward
    assert drawn[-1][0] == total and tty.endswith("\r\x1b[K")  # the last, then erased
    assert "\r" not in out and f"Apply: {total} applied, 0 failed, 0 skipped." in out
    # a pipe for stderr: no line, the same summary
    with lock_held(host_ns):
        r = host_ns.reconcile("apply", "--no-probe", empty)
    assert r.rc == 0 and "\r" not in r.all and "\x1b[" not in r.all, r.all
    assert "Apply: " in r.out
    # recreate, then prune on the terminal: the prune has its line too
    assert host_ns.reconcile("apply", "--no-probe", path).rc == 0
    with lock_held(host_ns):
        rc, out, tty = on_a_terminal(host_ns, "apply", "--no-probe", empty)
    assert rc == 0 and LINE.search(tty), tty
    assert re.search(r"\[ *\d+/\d+\] - alloc ", tty), tty
    # --output json on the terminal: no line, the JSON alone on stdout
    assert host_ns.reconcile("apply", "--no-probe", path).rc == 0
    with lock_held(host_ns):
        rc, out, tty = on_a_terminal(host_ns, "apply", "--no-probe", "--output", "json", empty)
    assert rc == 0 and "\r" not in tty and "\x1b[" not in tty, tty
    assert json.loads(out)["ok"] is True
