"""The topology read back from a live state, its DOT (checked by Graphviz's own ``dot``),
``show``'s grouping and JSON, and the progress line (a fake clock, no terminal)."""

from __future__ import annotations

import io
import ipaddress
import logging
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

from reconciler.cli.commands import main
from reconciler.config.load import load
from reconciler.domain.live import (
    LiveAddress,
    LiveChainSet,
    LiveDocker,
    LiveDockerNetwork,
    LiveEndpoint,
    LiveLink,
    LiveNetns,
    LiveState,
)
from reconciler.domain.ownership import (
    DOCKER_LABEL,
    DOCKER_LABEL_VALUE,
    LINK_ALIAS,
    alloc_ns_alias,
    alloc_veth_name,
)
from reconciler.domain.plan import Action, AttrChange, Change, Plan
from reconciler.engine.executor import Outcome
from reconciler.planner import make_plan
from reconciler.ui import graph, show
from reconciler.ui.progress import Progress, wanted
from reconciler.ui.topology import PortView, live_topology
from tests.support.fakehost import table_from
from tests.support.host import EXAMPLES, REPO

HOST = "4026532999"
SVG = "{http://www.w3.org/2000/svg}"


def addr(text: str, owned: bool = True) -> LiveAddress:
    return LiveAddress(ipaddress.ip_interface(text), owned)


def subnet_rules(name: str, bridge: str, cidr: str) -> tuple[str, ...]:
    c = f"-m comment --comment reconciler:subnet={name}"
    return (f"-d {cidr} -o {bridge} -m conntrack --ctstate RELATED,ESTABLISHED,DNAT {c} "
            "-j ACCEPT",
            f"-s {cidr} -d {cidr} -i {bridge} -o {bridge} {c} -j ACCEPT",
            f"-d {cidr} -o {bridge} {c} -j DROP", f"-s {cidr} -i {bridge} {c} -j ACCEPT")


def alloc_ns(aid: str, mac: str, *addrs: str, host: str = HOST) -> LiveNetns:
    return LiveNetns(aid, True, links=(
        LiveLink("lo", 1, "", 65536, True, False, alias=alloc_ns_alias(host)),
        LiveLink("eth0", 2, "veth", 1500, True, False, mac=mac,
                 addresses=tuple(addr(a) for a in addrs) + (addr("fe80::1/64", False),))))


def veth(aid: str, master: str) -> LiveLink:
    return LiveLink(alloc_veth_name(aid), 10, "veth", 1500, True, True, alias=LINK_ALIAS,
                    master=master)


def a_host() -> LiveState:
    """One bridge with a dual-stack subnet and two allocs, a foreign namespace, an owned
    Docker network of this scope with two containers and one of another scope."""
    dnat = ("-p tcp -m tcp --dport 8080 -m comment --comment reconciler:alloc=web-1 "
            "-j DNAT --to-destination 10.9.0.10:80",
            "-d 127.0.0.1/32 -p udp -m udp --dport 5353 -m comment --comment "
            "reconciler:alloc=web-1 -j DNAT --to-destination 10.9.0.10:53")
    dnat6 = ("-p tcp -m tcp --dport 8080 -m comment --comment reconciler:alloc=web-1 "
             "-j DNAT --to-destination [fd00:9::2]:80",)
    fw4 = LiveChainSet(True, {("filter", "RECONCILER-FORWARD"):
                              subnet_rules("net", "br9", "10.9.0.0/24"),
                              ("nat", "RECONCILER-DNAT"): dnat})
    fw6 = LiveChainSet(True, {("filter", "RECONCILER-FORWARD"):
                              subnet_rules("net", "br9", "fd00:9::/64"),
                              ("nat", "RECONCILER-DNAT"): dnat6})
    net = LiveDockerNetwork("a" * 64, 'ki"nd', "bridge",
                            {DOCKER_LABEL: DOCKER_LABEL_VALUE, "io.reconciler.scope": "host"},
                            {}, False, False, ("172.30.0.0/16",), 2,
                            endpoints=(LiveEndpoint("c-1", "172.30.0.2", None, ("172.30.0.2/16",)),
                                       LiveEndpoint('we\\ird"name')))
    other = LiveDockerNetwork("b" * 64, "theirs", "bridge",
                              {DOCKER_LABEL: DOCKER_LABEL_VALUE,
                               "io.reconciler.scope": "netns/x"}, {}, False, False, (), 0)
    return LiveState(
        host_id=HOST,
        links={"br9": LiveLink("br9", 5, "bridge", 1400, True, True, alias=LINK_ALIAS,
                               mac="02:00:00:00:00:09",
                               addresses=(addr("10.9.0.1/24"), addr("fd00:9::1/64"),
                                          addr("192.0.2.1/24", False))),
               "eth9": LiveLink("eth9", 2, "", 1500, True, False),
               alloc_veth_name("web-1"): veth("web-1", "br9"),
               alloc_veth_name("db-1"): veth("db-1", "br9")},
        firewall4=fw4, firewall6=fw6, table=table_from(fw4, fw6),
        netns={"web-1": alloc_ns("web-1", "02:aa:00:00:00:01", "10.9.0.10/24", "fd00:9::2/64"),
               "db-1": alloc_ns("db-1", "02:aa:00:00:00:02", "10.9.0.11/24"),
               "foreign": alloc_ns("foreign", "02:bb:00:00:00:01", "10.9.0.99/24",
                                   host="1234")},
        docker=LiveDocker(True, networks=(net, other), scope="host"))


def test_live_topology_is_read_from_the_markers():
    topo = live_topology(a_host())
    assert list(topo.bridges) == ["br9"]
    assert topo.bridges["br9"].addresses == ("10.9.0.1/24", "fd00:9::1/64")  # not the foreign
    net = topo.subnets["net"]
    assert (net.bridge, net.cidrs, net.gateways) == (
        "br9", ("10.9.0.0/24", "fd00:9::/64"), ("10.9.0.1/24", "fd00:9::1/64"))
    assert sorted(topo.allocs) == ["db-1", "web-1"]  # another host's namespace is not ours
    web = topo.allocs["web-1"]
    assert (web.bridge, web.subnet, web.addresses, web.mac, web.veth) == (
        "br9", "net", ("10.9.0.10/24", "fd00:9::2/64"), "02:aa:00:00:00:01",
        alloc_veth_name("web-1"))
    # one map per protocol and host address, both families' rules read as one
    assert web.ports == (PortView("tcp", 8080, 80), PortView("udp", 5353, 53, "127.0.0.1"))[::-1]
    assert [p.text for p in web.ports] == ["5353/udp->53@127.0.0.1", "8080/tcp->80"]
    assert topo.allocs["db-1"].ports == ()
    assert list(topo.docker_networks) == ['ki"nd']  # the other scope's is another reconciler's
    assert [c.name for c in topo.docker_networks['ki"nd'].containers] == ["c-1", 'we\\ird"name']
    assert list(live_topology(a_host(), all_scopes=True).docker_networks) == ['ki"nd', "theirs"]


def svg_nodes(dot_text: str) -> dict[str, ET.Element]:
    """Render with the real Graphviz and return the SVG's node groups by their title."""
    exe = shutil.which("dot")
    assert exe, "Graphviz's dot is needed (apt-get install graphviz; scripts/install.sh --test)"
    p = subprocess.run([exe, "-Tsvg"], input=dot_text, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and not p.stderr, p.stderr
    root = ET.fromstring(p.stdout)
    out = {}
    for g in root.iter(f"{SVG}g"):
        if g.get("class") == "node":
            title = g.find(f"{SVG}title")
            assert title is not None and title.text is not None
            out[title.text] = g
    out["legend"] = graph_label(root)
    return out


def graph_label(root: ET.Element) -> ET.Element:
    """What the graph's own label drew (title and legend): the drawing elements of the
    top-level group, outside every node, cluster and edge."""
    (top,) = [g for g in root.iter(f"{SVG}g") if g.get("class") == "graph"]
    label = ET.Element("label")
    label.extend(el for el in top if el.tag != f"{SVG}g")
    return label


def texts(g: ET.Element) -> list[str]:
    return [t.text or "" for t in g.iter(f"{SVG}text")]


def fills(g: ET.Element) -> set[str]:
    return {el.get("fill", "") for el in g if el.tag in (f"{SVG}path", f"{SVG}polygon")}


def test_dot_of_the_live_host_is_valid_graphviz_whatever_the_names():
    nodes = svg_nodes(graph.dot(live_topology(a_host()), title='host "x"'))
    assert {"bridge/br9", "subnet/net", "alloc/web-1", "alloc/db-1", 'docker_network/ki"nd',
            'container/ki"nd/c-1', 'container/ki"nd/we/ird"name'} <= set(nodes)
    assert texts(nodes["alloc/web-1"]) == ["alloc web-1", "10.9.0.10/24", "fd00:9::2/64",
                                           "mac 02:aa:00:00:00:01", "5353/udp → 53@127.0.0.1",
                                           "8080/tcp → 80"]
    # IDs spell a backslash "/" (a trailing one would end the string), labels keep it
    assert texts(nodes['container/ki"nd/we/ird"name']) == ['container we\\ird"name']
    assert texts(nodes["legend"]) == ['host "x"']  # no plan, no files: the title alone


def declared(tmp_path, text: str):
    path = tmp_path / "d.yaml"
    path.write_text(text)
    return load([str(path)])


FILES = """version: 1
bridges: [{name: br9, mtu: 1500}]
subnets: [{name: net, bridge: br9, cidr: 10.9.0.0/24, cidr6: fd00:9::/64}]
allocs:
  - {id: web-1, subnet: net, ports: [{host: 8080, to: 80}, {host: 5353, to: 53, protocol: udp, host_ip: 127.0.0.1}]}
  - {id: new-1, subnet: net, ports: [{host: auto, to: 9000}]}
"""


def test_plan_colours_each_action_and_the_legend_spells_the_symbols(tmp_path):
    live = a_host()
    desired = declared(tmp_path, FILES)
    plan = make_plan(desired, live)
    actions = {c.address: c.action for c in plan.changes}
    assert actions["bridge/br9"] is Action.UPDATE and actions["alloc/db-1"] is Action.DELETE
    assert actions["alloc/new-1"] is Action.CREATE
    # a replace and a conflict, as the planner makes them for Docker networks
    plan = Plan((*plan.changes,
                 Change("docker_network", 'ki"nd', Action.REPLACE, "mtu differ",
                        (AttrChange("mtu", 1500, 1400),)),
                 Change("docker_network", "taken", Action.CONFLICT, "exists, not ours")))
    nodes = svg_nodes(graph.dot(live_topology(live), desired, plan, actions=True))
    for node, action in (("bridge/br9", Action.UPDATE), ("alloc/db-1", Action.DELETE),
                         ("alloc/new-1", Action.CREATE), ('docker_network/ki"nd',
                                                          Action.REPLACE),
                         ("docker_network/taken", Action.CONFLICT)):
        assert graph.STYLE[action][0] in fills(nodes[node]), node
        assert texts(nodes[node])[0].startswith(f"{action.symbol} "), node
    colours = {f for f, _b in graph.STYLE.values()}
    for c in plan.changes:  # every node in its own action's colour, and only that one
        if c.kind in graph.KINDS:
            want = {graph.STYLE[c.action][0]} if c.action in graph.STYLE else set()
            assert fills(nodes[c.address]) & colours == want, c.address
    # what apply will give the new alloc: the address and host port the planner picked
    new = texts(nodes["alloc/new-1"])
    assert "10.9.0.2/24" in new and any(t.endswith("/tcp → 9000") for t in new), new
    assert "mtu: 1400 → 1500" in texts(nodes["bridge/br9"])
    legend = set(texts(nodes["legend"]))
    assert {"+ create", "~ update", "-/+ replace", "- delete"} <= legend
    assert any(t.startswith("~ firewall nftables") for t in legend)  # the changes that are no node
    # without --plan: the same nodes, no colours, the files' view still drawn
    plain = svg_nodes(graph.dot(live_topology(live), desired, plan))
    assert not fills(plain["alloc/new-1"]) & {f for f, _b in graph.STYLE.values()}
    assert texts(plain["alloc/new-1"])[0] == "alloc new-1"
    assert "+ create" not in texts(plain["legend"])
    assert "declared, not on the host yet" in texts(plain["legend"])


def test_declared_example_on_an_empty_host_is_all_creates():
    desired = load([f"{EXAMPLES}/quickstart.yaml"])
    plan = make_plan(desired, LiveState())
    nodes = svg_nodes(graph.dot(live_topology(LiveState()), desired, plan, actions=True))
    kinds = [k for k in nodes if k != "legend"]
    assert sorted(kinds) == ["alloc/demo-dns-1", "alloc/demo-web-1", "bridge/demo0",
                             "subnet/demo-net"]
    assert all(graph.STYLE[Action.CREATE][0] in fills(nodes[k]) for k in kinds)


def test_graph_plan_without_files_is_one_usage_line(capsys):
    assert main(["graph", "--plan"]) == 1
    err = capsys.readouterr().err
    assert err == "error: graph --plan needs the desired-state files: reconcile graph --plan " \
                  "PATH…\n"


def test_show_groups_by_bridge_and_subnet_and_keeps_its_json_keys():
    doc = show.view(a_host(), None)
    assert {"links", "firewall", "netns", "probe_vantage", "docker_networks"} <= set(doc)
    assert [lk["name"] for lk in doc["links"]] == sorted(
        ["br9", alloc_veth_name("web-1"), alloc_veth_name("db-1")])
    (br,) = doc["bridges"]
    (net,) = br["subnets"]
    assert [a["id"] for a in net["allocs"]] == ["db-1", "web-1"]
    web = net["allocs"][1]
    assert web["mac"] == "02:aa:00:00:00:01" and web["addresses"] == ["10.9.0.10/24",
                                                                      "fd00:9::2/64"]
    assert web["ports"][0] == {"host": 5353, "protocol": "udp", "to": 53,
                               "host_ip": "127.0.0.1"}
    assert doc["docker_networks"][0]["containers"][0] == {"name": "c-1",
                                                          "addresses": ["172.30.0.2/16"]}
    lines = show.text(doc).splitlines()
    assert lines[0] == "bridge br9: mtu 1400 up mac 02:00:00:00:00:09 10.9.0.1/24 fd00:9::1/64"
    assert lines[1] == "  subnet net: 10.9.0.0/24 fd00:9::/64, gateway 10.9.0.1/24 fd00:9::1/64"
    assert lines[2].startswith("    alloc db-1: 10.9.0.11/24 mac 02:aa:00:00:00:02")
    assert lines[3] == (f"    alloc web-1: 10.9.0.10/24 fd00:9::2/64 mac 02:aa:00:00:00:01 "
                        f"veth {alloc_veth_name('web-1')}")
    assert lines[4] == "      ports 5353/udp->53@127.0.0.1 8080/tcp->80"
    assert doc["table"]["sets"]["pm4"] == 1 and doc["table"]["intact"]
    assert lines[5] == ("table inet reconciler: 9 entries (egress4 1, egress6 1, intra4 1, "
                        "intra6 1, pm4 1, pm6 1, pmip4 1, ports4 1, ports6 1)")
    assert not any("RECONCILER-" in line for line in lines)  # no chain of ours is left
    assert "netns foreign" in lines and "netns web-1" not in lines
    assert "  container c-1 172.30.0.2/16" in lines


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def changes(n: int) -> Plan:
    return Plan(tuple(Change("alloc", f"a-{i}", Action.CREATE) for i in range(n)))


def test_progress_draws_one_line_only_after_a_second_and_erases_it():
    out, clock = io.StringIO(), Clock()
    p = Progress(out, clock=clock)
    plan = changes(3)
    p.plan(plan)
    p.outcome(Outcome(plan.changes[0], "applied"))
    assert out.getvalue() == ""  # a short apply prints what it always printed
    clock.now += 1.5
    p.outcome(Outcome(plan.changes[1], "failed", "boom"))
    assert out.getvalue() == "\r\033[K[2/3] (1 failed) + alloc a-2"
    clock.now += 0.01  # redraws at most every 0.1 s, but the last one always
    p.outcome(Outcome(plan.changes[2], "skipped"))
    assert out.getvalue().endswith("\r\033[K[3/3] (1 failed) verifying")
    assert "\n" not in out.getvalue()
    p.finish()
    assert out.getvalue().endswith("\r\033[K")


def test_progress_throttles_redraws():
    out, clock = io.StringIO(), Clock()
    p = Progress(out, clock=clock, delay=0.0)
    plan = changes(100)
    p.plan(plan)
    for c in plan.changes[:50]:
        clock.now += 0.001
        p.outcome(Outcome(c, "applied"))
    assert out.getvalue().count("\r") == 1  # 50 ms: the first draw only


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal_with_text_output(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert wanted(Tty(), "text", 0)
    assert not wanted(io.StringIO(), "text", 0)  # a pipe or a file
    assert not wanted(Tty(), "json", 0)
    assert not wanted(Tty(), "text", 1)  # -v logs each change on stderr already
    monkeypatch.setenv("TERM", "dumb")
    assert not wanted(Tty(), "text", 0)


@pytest.mark.parametrize("name", ['a"b', "back\\slash", "new\nline", "end\\", '"'])
def test_quote_keeps_anything_inside_the_string(name):
    text = f"digraph g {{ {graph.quote(name)} [label={graph.text_label(name)}]; }}"
    nodes = svg_nodes(text)
    (title,) = set(nodes) - {"legend"}
    assert title == name.replace("\n", " ").replace("\\", "/")
    assert texts(nodes[title]) == [name.replace("\n", " ")]


def test_docs_hold_the_rendered_example_graphs_and_the_command_that_made_them():
    docs = os.path.join(REPO, "docs")
    with open(os.path.join(docs, "graph.md")) as fh:
        text = fh.read()
    for name in ("graph-quickstart-plan.png", "graph-quickstart-host.png"):
        assert f"]({name})" in text
        with open(os.path.join(docs, name), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(REPO, "scripts", "docs-graph.sh")) as fh:
        script = fh.read()
    assert "graph --plan examples/quickstart.yaml" in script and "dot -Tpng" in script


def test_a_log_record_erases_the_line_first_and_the_next_change_draws_it_again():
    out, clock = io.StringIO(), Clock()
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        plan = changes(3)
        with Progress(out, clock=clock, delay=0.0) as p:
            p.plan(plan)
            logging.getLogger("reconciler.executor").warning("link.add: busy; retrying")
            clock.now += 0.001  # within the interval: drawn again all the same
            p.outcome(Outcome(plan.changes[0], "applied"))
        assert out.getvalue() == ("\r\033[K[0/3] + alloc a-0\r\033[K"
                                  "link.add: busy; retrying\n"
                                  "\r\033[K[1/3] + alloc a-1\r\033[K")
        assert not handler.filters  # let go on exit
    finally:
        root.removeHandler(handler)


def test_apply_hands_the_plan_then_each_outcome_to_the_progress_hooks():
    from reconciler.engine.reconcile import Reconciler
    from reconciler.planner.context import PlanOptions
    from tests.support.fakehost import FakeHost

    host = FakeHost()
    desired = load([f"{EXAMPLES}/quickstart.yaml"])
    heard: list[object] = []
    rec = Reconciler(host, runner=host, sleep=lambda _s: None)  # type: ignore[arg-type]
    result = rec.apply(desired, PlanOptions(), on_plan=heard.append,
                       on_outcome=heard.append)
    assert result.ok
    assert heard[0] is result.plan  # the plan first, before any change ran
    assert heard[1:] == result.outcomes and len(result.outcomes) == len(
        result.plan.actionable)
    heard.clear()
    rec.apply(desired, PlanOptions(), on_plan=heard.append, on_outcome=heard.append)
    assert heard == []  # nothing to do: no line at all


def test_docker_inspect_containers_become_endpoints_by_name():
    from reconciler.drivers.docker.payloads import parse_network

    net = parse_network({"Id": "f" * 64, "Name": "n", "Containers": {
        "b" * 64: {"Name": "web", "IPv4Address": "172.30.0.2/16",
                   "IPv6Address": "fc00::2/64"},
        "a" * 64: {"Name": "", "IPv4Address": "172.30.0.3/16", "IPv6Address": ""}}})
    assert net.containers == 2
    assert net.endpoints == (LiveEndpoint("aaaaaaaaaaaa", "172.30.0.3", None, ("172.30.0.3/16",)),
                             LiveEndpoint("web", "172.30.0.2", "fc00::2",
                                          ("172.30.0.2/16", "fc00::2/64")))


def test_a_port_map_edit_colours_the_allocation_and_labels_old_and_new(tmp_path):
    """SPEC §13: the node of the allocation whose map moves is filled and says old ⇒ new; the
    map it loses is no longer drawn as if it stayed."""
    live = a_host()
    desired = declared(tmp_path, FILES.replace("host: 8080", "host: 8082"))
    plan = make_plan(desired, live)
    nodes = svg_nodes(graph.dot(live_topology(live), desired, plan, actions=True))
    web = texts(nodes["alloc/web-1"])
    assert web[0] == "~ alloc web-1"
    assert graph.STYLE[Action.UPDATE][0] in fills(nodes["alloc/web-1"])
    assert "ports: 8080/tcp → 80 ⇒ 8082/tcp → 80" in web, web
    assert "8080/tcp → 80" not in web and "5353/udp → 53@127.0.0.1" in web
