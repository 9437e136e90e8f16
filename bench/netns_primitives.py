"""Measure the namespace/netlink primitives allocations are built from.

Run as root: ``python bench/netns_primitives.py [N ...] [--settle S] [--no-link-local]``
(default sizes 100 500).

Everything happens inside a throwaway "host" namespace ``rtb-<hex>`` that the
main thread enters first, so the bridge and the veths never touch the real
host. For each N it times:

* build: ``ip netns add`` equivalent + veth into the bridge (hairpin on) +
  inside (lo up, eth0 up, IPv4 address, default route) per allocation;
* observe: links+addresses+routes of every allocation namespace through the
  cached per-namespace sockets, cold (sockets opened) and warm (cached);
* observe via target nsid: links+addresses of every namespace from the host
  socket (IFLA_TARGET_NETNSID / IFA_TARGET_NETNSID), for comparison;
* host dump: one link + one address dump of the host namespace;
* the same observation with system tools for reference (``ip -j link``,
  ``ip -j addr`` in the host namespace);
* delete: ``ip netns del`` equivalent for every namespace, then how long until
  the kernel has removed all host-side veths (namespace cleanup is async).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from reconciler.domain.ownership import alloc_veth_name
from reconciler.drivers import netns
from reconciler.drivers.netlink import client as links  # noqa: E402
from reconciler.drivers.netlink import parse as nlparse


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def run(n: int, settle: float, link_local: bool) -> None:
    tag = secrets.token_hex(3)
    host = f"rtb-{tag}"
    names = [f"rtb-{tag}-{i}" for i in range(n)]
    net = ipaddress.ip_network("10.200.0.0/16")
    gw = net[1]
    netns.create(host)
    try:
        with netns.enter(host), links.Netlink() as nl:
            nl.ensure_bridge("rbr0", mtu=1500)
            nl.add_address("rbr0", ipaddress.ip_interface(f"{gw}/16"))

            t0 = time.perf_counter()
            for i, name in enumerate(names):
                nl.create_netns(name)
                nl.create_veth_into_netns(alloc_veth_name(name), name, "rbr0",
                                          mtu=1500, hairpin=True)
                nl.configure_inside(name, [ipaddress.ip_interface(f"{net[10 + i]}/16")], [gw],
                                    mtu=1500, ipv6_link_local=link_local)
            t_build = time.perf_counter() - t0
            # IPv6 DAD/RS/MLD of fresh links keep the kernel busy for seconds.
            time.sleep(settle)

            nl2 = links.Netlink()  # a fresh instance: sockets not cached yet
            t0 = time.perf_counter()
            cold = nl2.observe_netns(names)
            t_cold = time.perf_counter() - t0
            nl2.close()
            t0 = time.perf_counter()
            nl.observe_netns(names)
            t0 = time.perf_counter()
            warm = nl.observe_netns(names)
            t_warm = time.perf_counter() - t0
            assert len(cold) == len(warm) == n and all(v.usable for v in warm.values())
            assert all(len(v.routes) >= 2 for v in warm.values())

            nsids = {name: nl.get_nsid(name) for name in names}  # the veths gave them one
            assert None not in nsids.values()
            t0 = time.perf_counter()
            for name in names:
                nlparse.assemble_links(nl.link_messages(nsid=nsids[name]),
                                     nl.addr_messages(nsid=nsids[name]))
            t_nsid = time.perf_counter() - t0

            t0 = time.perf_counter()
            hostlinks = nl.dump_links()
            t_host = time.perf_counter() - t0
            assert len(hostlinks) == n + 2

            t0 = time.perf_counter()
            for args in (["link"], ["addr"]):
                subprocess.run(["ip", "-n", host, "-j", *args, "show"], check=True,
                               stdout=subprocess.DEVNULL)
            t_ip = time.perf_counter() - t0
            t0 = time.perf_counter()
            for name in names:
                subprocess.run(["ip", "-n", name, "-j", "addr"], check=True,
                               stdout=subprocess.DEVNULL)
            t_ip_each = time.perf_counter() - t0

            t0 = time.perf_counter()
            for name in names:
                nl.delete_netns(name)
            t_del = time.perf_counter() - t0
            while len(nl.dump_links()) > 2:
                time.sleep(0.005)
            t_gone = time.perf_counter() - t0
    finally:
        for name in names:
            netns.delete(name)
        netns.delete(host)

    print(f"N={n} (settle {settle:g} s, IPv6 link-local inside: {link_local})")
    print(f"  build (netns+veth+inside) {_ms(t_build)}  {t_build / n * 1000:.2f} ms/alloc")
    print(f"  observe netns, cold       {_ms(t_cold)}  {t_cold / n * 1000:.3f} ms/ns")
    print(f"  observe netns, warm       {_ms(t_warm)}  {t_warm / n * 1000:.3f} ms/ns")
    print(f"  links+addrs by target nsid{_ms(t_nsid)}  {t_nsid / n * 1000:.3f} ms/ns")
    print(f"  host link+addr dump       {_ms(t_host)}")
    print(f"  ip -j link + ip -j addr   {_ms(t_ip)}  (reference, host ns)")
    print(f"  ip -n NS -j addr, each    {_ms(t_ip_each)}  (reference)")
    print(f"  delete netns (unmount)    {_ms(t_del)}")
    print(f"  ... until host veths gone {_ms(t_gone)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[100, 500])
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds to wait between build and observe")
    parser.add_argument("--no-link-local", action="store_true",
                        help="configure_inside(ipv6_link_local=False)")
    args = parser.parse_args()
    for n in args.sizes:
        run(n, args.settle, not args.no_link_local)


if __name__ == "__main__":
    main()
