"""The reference: Nomad's CNI plugin chain, exec'd per allocation the way libcni does it.

Nomad (``seeds/nomad_networking_bridge_linux.go.txt``) loads one conflist,
``bridge`` (+ ``host-local`` IPAM) → ``firewall`` → ``portmap`` (snat), with
its own bridge name, subnet and admin chain, cniVersion 0.4.0. For each
allocation libcni (``AddNetworkList``) runs every plugin binary in turn with
``CNI_COMMAND=ADD``, ``CNI_CONTAINERID``, ``CNI_NETNS``, ``CNI_IFNAME=eth0``,
``CNI_ARGS``, ``CNI_PATH`` in the environment and the plugin's config on stdin,
with ``name``, ``cniVersion``, ``prevResult`` (the previous plugin's result)
and, for plugins declaring the capability, ``runtimeConfig.portMappings``
injected; the final result is cached on disk. ``DelNetworkList`` runs the
plugins in reverse with ``CNI_COMMAND=DEL`` and the cached result as
``prevResult`` of every plugin (cniVersion ≥ 0.4.0), then drops the cache.

Here one allocation set-up = ``ip netns add`` + ADD of the three plugins;
teardown = DEL in reverse + ``ip netns del``. Plugins come from Debian's
``containernetworking-plugins`` (``/usr/lib/cni``).

Everything runs inside a throwaway "host" network namespace that the calling
thread enters first (the plugins and their iptables processes inherit it), so
the real host's network is never touched; host-local's data dir and the result
cache live in a temp dir. Namespaces and temp dirs are removed even on failure.

    python3 bench/cni_chain.py [--n 20] [--udp]     # as root
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reconciler.drivers import netns, nsfs  # noqa: E402

CNI_PATH = "/usr/lib/cni"
PLUGINS = ("bridge", "host-local", "firewall", "portmap")

#: ``nomadCNIConfigTemplate`` from the seed, verbatim; %s = bridge, subnet, admin chain.
NOMAD_CONFLIST_TEMPLATE = """{
	"cniVersion": "0.4.0",
	"name": "nomad",
	"plugins": [
		{
			"type": "bridge",
			"bridge": "%s",
			"ipMasq": true,
			"isGateway": true,
			"forceAddress": true,
			"ipam": {
				"type": "host-local",
				"ranges": [
					[
						{
							"subnet": "%s"
						}
					]
				],
				"routes": [
					{ "dst": "0.0.0.0/0" }
				]
			}
		},
		{
			"type": "firewall",
			"backend": "iptables",
			"iptablesAdminChainName": "%s"
		},
		{
			"type": "portmap",
			"capabilities": {"portMappings": true},
			"snat": true
		}
	]
}
"""

#: Nomad's defaults (``defaultNomadBridgeName``, ``defaultNomadAllocSubnet``, ``cniAdminChainName``)
NOMAD_BRIDGE, NOMAD_SUBNET, NOMAD_ADMIN_CHAIN = "nomad", "172.26.64.0/20", "NOMAD-ADMIN"


def check_installed() -> str | None:
    """None, or why the chain cannot run here."""
    if os.geteuid() != 0:
        return "run as root (the chain creates namespaces, links and iptables rules)"
    missing = [p for p in PLUGINS if not os.access(os.path.join(CNI_PATH, p), os.X_OK)]
    if missing:
        return (f"CNI plugins {', '.join(missing)} not in {CNI_PATH}: "
                "apt-get install -y containernetworking-plugins")
    return None


def conflist(bridge: str, subnet: str, admin_chain: str, data_dir: str) -> dict[str, Any]:
    """Nomad's conflist with host-local's state under ``data_dir`` instead of /var/lib/cni."""
    conf: dict[str, Any] = json.loads(NOMAD_CONFLIST_TEMPLATE % (bridge, subnet, admin_chain))
    conf["plugins"][0]["ipam"]["dataDir"] = data_dir
    return conf


@dataclass(frozen=True)
class PortMapping:
    host: int
    container: int
    protocol: str = "tcp"

    def to_json(self) -> dict[str, Any]:
        return {"hostPort": self.host, "containerPort": self.container,
                "protocol": self.protocol}


def port_mappings(i: int, *, udp: bool = False, base: int = 20000) -> list[PortMapping]:
    """Alloc ``i``'s 2 ports (host base+2i → 80, base+2i+1 → 443), tcp (and udp, as Nomad does)."""
    protos = ("tcp", "udp") if udp else ("tcp",)
    return [PortMapping(base + 2 * i + k, to, proto)
            for k, to in enumerate((80, 443)) for proto in protos]


class PluginError(RuntimeError):
    pass


@dataclass
class Chain:
    """libcni's AddNetworkList/DelNetworkList for one conflist (not thread-safe)."""

    conf: dict[str, Any]
    cache_dir: str
    execs: int = 0
    plugin_seconds: dict[str, float] = field(default_factory=dict)

    def _plugin_conf(self, plugin: dict[str, Any], prev: Any,
                     capability_args: dict[str, Any]) -> bytes:
        """libcni buildOneConfig + injectRuntimeConfig."""
        conf = dict(plugin)
        conf["name"] = self.conf["name"]
        conf["cniVersion"] = self.conf["cniVersion"]
        if prev is not None:
            conf["prevResult"] = prev
        runtime = {cap: capability_args[cap]
                   for cap, on in plugin.get("capabilities", {}).items()
                   if on and cap in capability_args}
        if runtime:
            conf["runtimeConfig"] = runtime
        return json.dumps(conf).encode()

    def _exec(self, command: str, plugin: dict[str, Any], container_id: str, netns_path: str,
              stdin: bytes) -> bytes:
        env = dict(os.environ, CNI_COMMAND=command, CNI_CONTAINERID=container_id,
                   CNI_NETNS=netns_path, CNI_IFNAME="eth0", CNI_ARGS="IgnoreUnknown=1",
                   CNI_PATH=CNI_PATH)
        kind = plugin["type"]
        t0 = time.perf_counter()
        proc = subprocess.run([os.path.join(CNI_PATH, kind)], input=stdin, env=env,
                              capture_output=True, check=False)
        key = f"{command} {kind}"
        self.plugin_seconds[key] = self.plugin_seconds.get(key, 0.0) + time.perf_counter() - t0
        self.execs += 1
        if proc.returncode != 0:
            raise PluginError(f"{kind} {command} {container_id}: exit {proc.returncode}: "
                              f"{(proc.stdout or proc.stderr).decode(errors='replace')[:500]}")
        return proc.stdout

    def _cache_path(self, container_id: str) -> str:
        return os.path.join(self.cache_dir, f"{self.conf['name']}-{container_id}-eth0")

    def add(self, container_id: str, netns_path: str, ports: list[PortMapping]) -> Any:
        caps = {"portMappings": [p.to_json() for p in ports]}
        prev: Any = None
        for plugin in self.conf["plugins"]:
            out = self._exec("ADD", plugin, container_id, netns_path,
                             self._plugin_conf(plugin, prev, caps))
            prev = json.loads(out)
        with open(self._cache_path(container_id), "w") as fh:  # libcni's cacheAdd
            json.dump({"kind": "cniCacheV1", "containerId": container_id, "ifName": "eth0",
                       "networkName": self.conf["name"], "result": prev}, fh)
        return prev

    def delete(self, container_id: str, netns_path: str, ports: list[PortMapping]) -> None:
        caps = {"portMappings": [p.to_json() for p in ports]}
        path = self._cache_path(container_id)
        try:
            with open(path) as fh:
                cached = json.load(fh)["result"]
        except FileNotFoundError:
            cached = None
        for plugin in reversed(self.conf["plugins"]):
            self._exec("DEL", plugin, container_id, netns_path,
                       self._plugin_conf(plugin, cached, caps))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def ip_netns(*args: str) -> None:
    subprocess.run(["ip", "netns", *args], check=True, capture_output=True)


@contextlib.contextmanager
def throwaway_host(name: str) -> Iterator[None]:
    """Create netns ``name`` with lo up; the calling thread runs inside it; removed on exit."""
    netns.create(name)
    try:
        with netns.enter(name):
            if nsfs.current_inode() != netns.namespace_inode(name):
                raise RuntimeError(f"not inside {name}: refusing to touch the host")
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
            yield
    finally:
        netns.delete(name)


@dataclass
class Timings:
    n: int
    setup: float = 0.0
    teardown: float = 0.0
    add_each: list[float] = field(default_factory=list)
    del_each: list[float] = field(default_factory=list)
    execs_add: int = 0
    execs_del: int = 0
    iptables_lines: int = 0
    plugin_seconds: dict[str, float] = field(default_factory=dict)


def run(n: int, *, udp: bool = False, prefix: str | None = None,
        bridge: str = NOMAD_BRIDGE, admin_chain: str = NOMAD_ADMIN_CHAIN,
        subnet: str | None = None, progress: bool = False) -> Timings:
    """Set up then tear down ``n`` allocations through the chain, in a throwaway host namespace."""
    why = check_installed()
    if why:
        raise SystemExit(f"cni_chain: {why}")
    prefix = prefix or f"rcc{secrets.token_hex(3)}"
    if subnet is None:
        subnet = NOMAD_SUBNET if n < 4000 else "172.26.0.0/16"
    if ipaddress.ip_network(subnet).num_addresses - 3 < n:
        raise SystemExit(f"cni_chain: {subnet} too small for {n} allocations")
    host = f"{prefix}-host"
    names = [f"{prefix}-{i}" for i in range(n)]
    tmp = tempfile.mkdtemp(prefix=f"{prefix}-")
    created: list[str] = []
    t = Timings(n)
    try:
        with throwaway_host(host):
            data_dir = os.path.join(tmp, "ipam")
            cache_dir = os.path.join(tmp, "results")
            os.makedirs(cache_dir)
            chain = Chain(conflist(bridge, subnet, admin_chain, data_dir), cache_dir)
            t0 = time.perf_counter()
            for i, name in enumerate(names):
                a0 = time.perf_counter()
                ip_netns("add", name)
                created.append(name)
                chain.add(name, f"/run/netns/{name}", port_mappings(i, udp=udp))
                t.add_each.append(time.perf_counter() - a0)
                if progress and (i + 1) % 50 == 0:
                    print(f"  cni ADD {i + 1}/{n}", file=sys.stderr)
            t.setup = time.perf_counter() - t0
            t.execs_add = chain.execs
            t.iptables_lines = len(subprocess.run(
                ["iptables-save"], check=True, capture_output=True, text=True).stdout.splitlines())
            chain.execs = 0
            t0 = time.perf_counter()
            for i, name in enumerate(names):
                d0 = time.perf_counter()
                chain.delete(name, f"/run/netns/{name}", port_mappings(i, udp=udp))
                ip_netns("del", name)
                created.remove(name)
                t.del_each.append(time.perf_counter() - d0)
            t.teardown = time.perf_counter() - t0
            t.execs_del = chain.execs
            t.plugin_seconds = dict(chain.plugin_seconds)
    finally:
        for name in created:  # a failure half-way: the namespaces go, the host ns takes the rest
            with contextlib.suppress(Exception):
                netns.delete(name)
        shutil.rmtree(tmp, ignore_errors=True)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="allocations (default 20)")
    ap.add_argument("--udp", action="store_true",
                    help="map each port for tcp and udp as Nomad does (4 mappings, not 2)")
    opts = ap.parse_args(argv)
    t = run(opts.n, udp=opts.udp, progress=True)
    print(f"CNI chain, N={t.n}: set-up {t.setup:.2f} s "
          f"({statistics.median(t.add_each) * 1000:.0f} ms/alloc median), "
          f"teardown {t.teardown:.2f} s "
          f"({statistics.median(t.del_each) * 1000:.0f} ms/alloc median)")
    k = min(50, t.n)
    print(f"  ADD median of first {k}: {statistics.median(t.add_each[:k]) * 1000:.0f} ms, "
          f"last {k}: {statistics.median(t.add_each[-k:]) * 1000:.0f} ms")
    print(f"  plugin execs: {t.execs_add} ADD, {t.execs_del} DEL; "
          f"iptables-save lines at N: {t.iptables_lines}")
    for key, sec in sorted(t.plugin_seconds.items()):
        print(f"  {key:<14} {sec / t.n * 1000:7.1f} ms/alloc")
    return 0


if __name__ == "__main__":
    sys.exit(main())
