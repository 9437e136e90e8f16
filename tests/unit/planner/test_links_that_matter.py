"""What the plan agent relies on: links, addresses and routes outside ``links_that_matter``
and the address space never change a plan."""

from __future__ import annotations

import dataclasses

import pytest

from reconciler.domain.live import LiveLink
from reconciler.planner import PlanOptions
from tests.support.planning import alloc, converge, port, state


@pytest.mark.parametrize("seed", range(40))
def test_other_tools_links_never_change_a_plan(seed: int) -> None:
    """What the plan agent relies on: links outside links_that_matter do not change a plan.

    A converged host with allocations, pruned leftovers and an interrupted bridge, then
    random foreign links (names, kinds, states, masters among themselves); the plan made
    with them must equal the plan made without, whatever the options.
    """
    import random

    from reconciler.planner import links_that_matter, make_plan
    from tests.support.fakehost import FakeHost

    rng = random.Random(seed)
    host = FakeHost()
    full = state(*(alloc(f"a{i}", port(8000 + i, 80), port(None, 443)) for i in range(6)))
    converge(host, full)
    desired = state(*(alloc(f"a{i}", port(8000 + i, 80)) for i in range(0, 6, 2)))
    live = host.observe(desired)
    foreign: dict[str, LiveLink] = {}
    for i in range(rng.randint(1, 30)):
        name = rng.choice(["eth", "veth", "docker", "cni", "br-", "vx", "vr"]) + f"{i}x{seed}"
        master = rng.choice([None, None, *foreign])
        foreign[name] = LiveLink(name, 1000 + i, rng.choice(["veth", "bridge", "dummy", ""]),
                                 rng.choice([1280, 1500, 9000]), rng.random() < 0.5, False,
                                 alias=rng.choice([None, "docker", "managed-by=someone"]),
                                 master=master, peer_netnsid=rng.choice([None, 0, 7]))
    noisy = dataclasses.replace(live, links={**live.links, **foreign})
    assert links_that_matter(desired, noisy) == links_that_matter(desired, live)
    for opts in (PlanOptions(), PlanOptions(prune=False)):
        quiet_plan = make_plan(desired, live, opts).to_json()
        assert make_plan(desired, noisy, opts).to_json() == quiet_plan


def test_foreign_addresses_and_routes_change_a_plan_only_through_addrspace_relevant() -> None:
    """What the plan agent relies on for the address space: random foreign addresses and
    routes, some over the declared subnet (10.0.0.0/24) or near it; whenever
    ``addrspace.relevant`` is the same with them as without, so is the plan."""
    import ipaddress
    import random

    from reconciler.domain.live import LiveAddress, LiveRoute
    from reconciler.planner import addrspace, make_plan
    from tests.support.fakehost import FakeHost

    host = FakeHost()
    desired = state(*(alloc(f"a{i}", port(8000 + i, 80, host_ip="127.0.0.1"))
                      for i in range(3)))
    converge(host, desired)
    live = host.observe(desired)
    quiet_plan = make_plan(desired, live).to_json()
    same = differ = 0
    for seed in range(200):
        rng = random.Random(seed)

        def prefix(rng: random.Random = rng) -> str:
            base = rng.choice(["10.0.0.", "10.0.1.", "10.9.0.", "192.0.2.", "127.0.0."])
            return f"{base}{rng.randrange(0, 256, 16)}/{rng.choice([28, 30, 32])}"

        links = {}
        for i in range(rng.randint(1, 4)):
            addrs = tuple(LiveAddress(ipaddress.ip_interface(prefix()), False)
                          for _ in range(rng.randint(0, 2)))
            links[f"fx{i}"] = LiveLink(f"fx{i}", 900 + i, "veth", 1500, True, False,
                                       addresses=addrs)
        routes = tuple(LiveRoute(str(ipaddress.ip_interface(prefix()).network), None, False,
                                 oif=rng.choice([0, 900, 5])) for _ in range(rng.randint(0, 3)))
        noisy = dataclasses.replace(live, links={**live.links, **links},
                                    routes=live.routes + routes)
        if addrspace.relevant(desired, noisy) == addrspace.relevant(desired, live):
            same += 1
            assert make_plan(desired, noisy).to_json() == quiet_plan, seed
        else:
            differ += 1
    assert same > 20 and differ > 20, (same, differ)
