"""Which flows count in impact: a client's from any port, never a probe's.
"""

from __future__ import annotations

import ipaddress

from reconciler.domain.live import (
    LiveAddress,
    LiveFlow,
    LiveLink,
    LiveState,
)
from reconciler.domain.probes import VANTAGE_PEER
from reconciler.planner.impact import ProbeSources, counts_as_flow

# ------------------------------------------------------------------ impact's flows


def _flow(src: str, sport: int, reply_src: str = "10.0.0.2") -> LiveFlow:
    return LiveFlow(4, "tcp", src, sport, "192.0.2.1", 8080, reply_src, 80, True)


def test_a_clients_flow_from_the_probes_port_range_counts_a_probes_does_not() -> None:
    host = LiveState(links={
        "eth0": LiveLink("eth0", 2, "", 1500, True, False, addresses=(
            LiveAddress(ipaddress.ip_interface("192.0.2.1/24"), False),)),
        "lo": LiveLink("lo", 1, "", 65536, True, False, addresses=(
            LiveAddress(ipaddress.ip_interface("127.0.0.1/8"), False),))})
    probes = ProbeSources.of(host)
    assert counts_as_flow(_flow("198.51.100.7", 61234), probes)  # a client's ephemeral port
    assert counts_as_flow(_flow("192.0.2.1", 40000), probes)  # the host's own, not a probe's
    for probe in (_flow("192.0.2.1", 61000), _flow("127.0.0.5", 61999),  # host, loopback
                  _flow(VANTAGE_PEER, 61500),  # the external vantage
                  _flow("10.0.0.2", 61500)):  # hairpin: answered by where it started
        assert not counts_as_flow(probe, probes), probe


