"""Every mistake a user can make in the files: one clear line naming file:line, exit 1."""

from __future__ import annotations

import os

import pytest

from reconciler.cli import commands as cli
from reconciler.config.load import load
from reconciler.domain.errors import ConfigError
from tests.support.host import EXAMPLES

GOOD = """\
version: 1
bridges:
  - name: nomad
    mtu: 1500
subnets:
  - name: nomad-net
    bridge: nomad
    cidr: 172.26.64.0/20
    cidr6: fd00:a:b::/64
    range: {start: 172.26.64.10, end: 172.26.79.250}
allocs:
  - id: web-1
    subnet: nomad-net
    address: 172.26.64.10
    ports:
      - {host: 8080, to: 80}
      - {host: 5353, to: 53, protocol: udp}
      - {host: 8443, to: 443, host_ip: 127.0.0.1}
      - {host: auto, to: 9000}
docker_networks:
  - name: kind
    ipv6: true
    labels: {team: infra}
"""


def write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_good_file_loads_with_defaults(tmp_path):
    d = load([write(tmp_path, "a.yaml", GOOD)])
    s = d.subnets["nomad-net"]
    assert str(s.gateway) == "172.26.64.1" and str(s.gateway6) == "fd00:a:b::1"
    assert d.bridges["nomad"].hairpin is True
    assert d.allocs["web-1"].ports[3].host is None
    assert d.docker_networks["kind"].labels == (("team", "infra"),)
    assert d.subnets["nomad-net"].source.line == 6


# (yaml text, expected line, expected substring)
BAD = [
    ("version: 1\nbridges:\n  - name: nomad\n    mut: 3\n", 4, "unknown key 'mut' (did you mean 'mtu'?)"),
    ("version: 2\n", 1, "version"),
    ("bridges: []\n", 1, "'version' is a required property"),
    ("version: 1\nbridges:\n  - name: waytoolongbridgename\n", 3, "is not allowed here"),
    ("version: 1\nbridges:\n  - name: 'br;rm -rf'\n", 3, "is not allowed here"),
    ("version: 1\nbridges:\n  - name: \"br\\nx\"\n", 3, "control character U+000A is not allowed"),
    ("version: 1\nbridges:\n  - name: \"br0\\n\"\n", 3, "control character U+000A is not allowed"),
    ("version: 1\nbridges:\n  - name: all\n", 3, "reserved"),
    ("version: 1\nbridges:\n  - name: -j\n", 3, "would read as an option"),
    ("version: 1\nbridges:\n  - name: b\n    mtu: 99999999999999999999\n", 4, "maximum"),
    ("version: 1\nbridges:\n  - name: b\n    mtu: '1500'\n", 4, "not of type 'integer'"),
    ("version: 1\nbridges:\n  - name: b\n    hairpin: maybe\n", 4, "not of type 'boolean'"),
    ("version: 1\nbridges: {name: b}\n", 2, "not of type 'array'"),
    ("version: 1\nbridges:\n  - name: b\n  - name: b\n", 4, "defined twice"),
    ("version: 1\nbridges:\n  - name: b\n    name: c\n", 4, "duplicate key"),
    ("version: 1\nbridges:\n  - name: [unclosed\n", 4, "invalid YAML"),
    ("version: 1\n\tbridges: []\n", 2, "invalid YAML"),
    ("- just\n- a list\n", 1, "expected a mapping"),
    ("", 1, "empty file"),
    ("version: 1\n---\nversion: 1\n", 3, "more than one YAML document"),
    ("version: 1\n1: x\n", 2, "keys must be strings"),
    ("version: 1\nbridges:\n  - name: b\nsubnets:\n  - {name: s, bridge: b, cidr: 10.0.0.1/24}\n",
     5, "host bits set; did you mean 10.0.0.0/24?"),
    ("version: 1\nbridges:\n  - name: b\nsubnets:\n  - {name: s, bridge: b, cidr: nonsense}\n",
     5, "is not an IPv4 prefix"),
    ("version: 1\nbridges:\n  - name: b\nsubnets:\n  - {name: s, bridge: b, cidr: 'fd00::/64'}\n",
     5, "is IPv6"),
    ("version: 1\nsubnets:\n  - {name: s, bridge: nope, cidr: 10.0.0.0/24}\n", 3,
     "bridge 'nope' is not declared"),
    ("version: 1\nbridges:\n  - name: b\nsubnets:\n  - {name: s, bridge: b, cidr: 10.0.0.0/24}\n"
     "  - {name: t, bridge: b, cidr: 10.0.0.128/25}\n", 6, "overlaps subnet 's'"),
    ("version: 1\nbridges:\n  - name: b\nsubnets:\n"
     "  - {name: s, bridge: b, cidr: 10.0.0.0/24, gateway: 10.1.0.1}\n", 5,
     "is not a host address of 10.0.0.0/24"),
    ("version: 1\nbridges:\n  - name: b\nsubnets:\n"
     "  - {name: s, bridge: b, cidr: 10.0.0.0/24, range: {start: 10.0.0.50, end: 10.0.0.10}}\n",
     5, "start 10.0.0.50 is after end 10.0.0.10"),
    ("version: 1\nbridges:\n  - name: b\nsubnets:\n  - {name: s, bridge: b, cidr: 10.0.0.0/31}\n",
     5, "leaves no room"),
    ("version: 1\nallocs:\n  - {id: a, subnet: nope}\n", 3, "subnet 'nope' is not declared"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - {id: a, subnet: s, address: 10.0.1.5}\n", 5, "is not a host address"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - {id: a, subnet: s, address: 10.0.0.1}\n", 5, "is the gateway"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - {id: a, subnet: s, address: 10.0.0.5}\n  - {id: c, subnet: s, "
     "address: 10.0.0.5}\n", 6, "already given to alloc 'a'"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - id: a\n    subnet: s\n    ports:\n      - {host: 8080, to: 80}\n"
     "      - {host: 8080, to: 81, protocol: both}\n", 9, "host port 8080/tcp is already mapped"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - id: a\n    subnet: s\n    ports:\n      - {host: 70000, to: 80}\n", 8,
     "must be a port 1-65535 or 'auto'"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - id: a\n    subnet: s\n    ports:\n      - {host: 80, to: 80, protocol: sctp}\n",
     8, "protocol"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - id: a\n    subnet: s\n    ports:\n      - {host: 80, to: 80, host_ip: x}\n",
     8, "is not an IP address"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - {id: a, subnet: s, address6: 'fd00::5'}\n", 5, "has no cidr6"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - id: a\n    subnet: s\n    ports:\n      - {host: 80, to: 80, host_ip: 'fd00::1%eth0'}\n",
     8, "zone ids are not supported"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - id: a\n    subnet: s\n    ports:\n      - {host: 80, to: 80, host_ip: '::1'}\n",
     8, "IPv6 loopback cannot be forwarded"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 10.0.0.0/24}]\n"
     "allocs:\n  - id: a\n    subnet: s\n    ports:\n      - {host: 80, to: 80, host_ip: 'fd00::1'}\n",
     8, "is IPv6 but subnet 's' has no cidr6"),
    ("version: 1\ndocker_networks:\n  - {name: bridge}\n", 3, "Docker's own networks"),
    ("version: 1\ndocker_networks:\n  - {name: k, subnet6: 'fd00::/64', ipv6: false}\n", 3,
     "is false but subnet6"),
    ("version: 1\ndocker_networks:\n  - {name: k, labels: {io.reconciler.managed: 'x'}}\n", 3,
     "are the reconciler's own"),
    ("version: 1\ndocker_networks:\n  - name: k\n    labels:\n      io.reconciler.scope: x\n", 5,
     "are the reconciler's own"),
    ("version: 1\nbridges: [{name: b}]\nsubnets: [{name: s, bridge: b, cidr: 172.30.0.0/16}]\n"
     "docker_networks:\n  - {name: k, subnet: 172.30.5.0/24}\n", 5, "overlaps subnet 's'"),
    ("version: 1\nsettings: {auto_port_range: {start: 30000, end: 20000}}\n", 2, "start is after"),
    ("a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
     "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n", None,
     "document too large"),
    ("version: 1\nx: " + "[" * 5000 + "]" * 5000 + "\n", None, "nesting too deep"),
]


@pytest.mark.parametrize("text,line,needle", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_one_clear_error(tmp_path, capsys, text, line, needle):
    path = write(tmp_path, "bad.yaml", text)
    rc = cli.main(["validate", path])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "Traceback" not in out + err
    assert needle in err, err
    first = err.splitlines()[0]
    assert first.startswith(f"error: {path}")
    if line is not None:
        assert first.startswith(f"error: {path}:{line}:"), first


def test_duplicate_across_files_names_both_places(tmp_path):
    a = write(tmp_path, "a.yaml", "version: 1\nbridges:\n  - name: nomad\n")
    b = write(tmp_path, "b.yaml", "version: 1\n\nbridges:\n  - name: nomad\n")
    with pytest.raises(ConfigError) as exc:
        load([str(tmp_path)])
    assert f"{a}:3" in str(exc.value) and f"{b}:4" in str(exc.value)


def test_directory_reads_yaml_and_yml_only(tmp_path):
    write(tmp_path, "a.yaml", "version: 1\nbridges: [{name: a}]\n")
    write(tmp_path, "b.yml", "version: 1\nbridges: [{name: b}]\n")
    write(tmp_path, "notes.txt", "not yaml at all: [")
    assert sorted(load([str(tmp_path)]).bridges) == ["a", "b"]


def test_missing_path_and_empty_dir(tmp_path, capsys):
    assert cli.main(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["validate", str(empty)]) == 1
    assert "holds no *.yaml" in capsys.readouterr().err


def test_not_utf8(tmp_path, capsys):
    p = tmp_path / "x.yaml"
    p.write_bytes(b"version: 1\nbridges: [{name: \xff}]\n")
    assert cli.main(["validate", str(p)]) == 1
    assert "not UTF-8" in capsys.readouterr().err


def test_several_errors_reported_together(tmp_path, capsys):
    path = write(tmp_path, "a.yaml", "version: 1\nbridges:\n  - name: b\n    mut: 1\n"
                                     "  - name: c\n    hairpn: true\n")
    assert cli.main(["validate", path]) == 1
    err = capsys.readouterr().err
    assert f"{path}:4:" in err and f"{path}:6:" in err


def test_hosts_filter(tmp_path):
    write(tmp_path, "web.yaml", "version: 1\nhosts: ['web-*']\nbridges: [{name: w}]\n")
    write(tmp_path, "all.yaml", "version: 1\nbridges: [{name: a}]\n")
    assert sorted(load([str(tmp_path)], hostname="web-3").bridges) == ["a", "w"]
    assert sorted(load([str(tmp_path)], hostname="db-1").bridges) == ["a"]


def test_huge_file_refused(tmp_path, capsys):
    p = tmp_path / "big.yaml"
    with open(p, "w") as fh:
        fh.write("version: 1\n# " + "x" * (9 * 1024 * 1024) + "\n")
    assert cli.main(["validate", str(p)]) == 1
    assert "file too large" in capsys.readouterr().err


def test_usage_error_exits_1(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan"])
    assert exc.value.code == 1


#: example directories holding manifests for other tools (a DaemonSet, a Nomad job, a unit)
NOT_RECONCILER = {"kubernetes", "nomad", "prometheus", "systemd"}


def test_examples_validate():
    """Each top-level file alone, and each directory (at any depth) as one desired state."""
    here = EXAMPLES
    seen = 0
    for root, dirs, files in os.walk(here):
        dirs[:] = sorted(d for d in dirs if d not in NOT_RECONCILER)
        yamls = sorted(f for f in files if f.endswith((".yaml", ".yml")))
        if os.path.samefile(root, here):
            for f in yamls:
                load([os.path.join(root, f)])
        elif yamls:
            load([root])
        seen += len(yamls)
    assert seen >= 5


# The compiled fast path must never accept what jsonschema rejects.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70000), st.floats(allow_nan=False),
                     st.sampled_from(["nomad", "10.0.0.0/24", "10.0.0.1", "fd00::1", "auto",
                                      "tcp", "both", "x" * 20, "", "-j", "a b"]))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(["name", "mtu", "hairpin", "bridge", "cidr", "id", "subnet",
                                     "ports", "host", "to", "protocol", "host_ip", "labels",
                                     "ipv6", "start", "end", "range", "extra"]), inner,
                    max_size=4)), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({"version": st.sampled_from([1, 1, 2, "1"])}, optional={
    "bridges": _values, "subnets": _values, "allocs": _values, "docker_networks": _values,
    "settings": _values}))
def test_fast_schema_check_agrees_with_jsonschema(doc):
    from reconciler.config.schema import _fast_check, _validator
    if _fast_check()(doc):
        assert not list(_validator().iter_errors(doc)), doc


def test_more_allocations_than_bridge_ports(tmp_path, capsys):
    allocs = "".join(f"  - {{id: a{i}, subnet: s}}\n" for i in range(1024))
    path = write(tmp_path, "big.yaml", "version: 1\nbridges: [{name: b}]\n"
                 "subnets: [{name: s, bridge: b, cidr: 10.0.0.0/16}]\nallocs:\n" + allocs)
    assert cli.main(["validate", path]) == 1
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and "at most 1023 ports" in err
