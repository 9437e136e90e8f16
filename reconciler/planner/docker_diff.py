"""A declared Docker network against a live one: which declared fields differ."""

from __future__ import annotations

from collections.abc import Sequence

from reconciler.domain.docker import (
    IPV6_FALLBACK_LABEL,
    OPT_MASQUERADE,
    OPT_MTU,
    flag,
    parse_bool,
    parse_mtu,
    split_subnets,
    ula_subnet,
)
from reconciler.domain.live import LiveDockerNetwork
from reconciler.domain.model import DockerNetwork


def _show(values: Sequence[object]) -> str:
    return ",".join(str(v) for v in values) if values else "(none)"


def diff_network(spec: DockerNetwork, live: LiveDockerNetwork,
                 default_mtu: int | None) -> list[tuple[str, str, str, bool]]:
    """Compare a declared network with the live one: what differs.

    Returns ``(field, live_value, desired_value, replace_needed)`` tuples, only
    for what the file declares (or what has a default in the file format):
    a subnet Docker picked is no difference when ``subnet`` is not declared; a
    derived ULA matches any live /64 with IPv6 on (kind probes other
    attempts); the MTU is compared only when declared or when Docker's default
    MTU is known; labels are a subset match. A network we created IPv4-only
    because the daemon lacked IPv6 (``IPV6_FALLBACK_LABEL``) satisfies
    ``ipv6: true`` without ``subnet6``, as in kind. Docker cannot change a
    network in place, so every difference needs a replace.
    """
    diffs: list[tuple[str, str, str, bool]] = []
    live4, live6 = split_subnets(live.subnets)

    if live.driver != "bridge":
        diffs.append(("driver", live.driver or "(none)", "bridge", True))

    if spec.subnet is not None and spec.subnet not in live4:
        diffs.append(("subnet", _show(live4), str(spec.subnet), True))

    want_v6 = spec.ipv6 or spec.subnet6 is not None
    if want_v6 and ipv6_fell_back(spec, live):
        pass  # kind's IPv4-only fallback: the daemon could not do IPv6 when we created it
    elif want_v6 != live.enable_ipv6:
        diffs.append(("ipv6", flag(live.enable_ipv6), flag(want_v6), True))
    elif want_v6:
        if spec.subnet6 is not None:
            if spec.subnet6 not in live6:
                diffs.append(("subnet6", _show(live6), str(spec.subnet6), True))
        elif not any(net.prefixlen == 64 for net in live6):
            diffs.append(("subnet6", _show(live6), f"{ula_subnet(spec.name, 0)} (derived)", True))

    want_mtu = spec.mtu if spec.mtu is not None else default_mtu
    if want_mtu is not None:
        # Without the option Docker uses its daemon-wide default, which is what
        # the bridge network reports.
        raw_mtu = live.options.get(OPT_MTU)
        live_mtu = parse_mtu(raw_mtu) if raw_mtu is not None else default_mtu
        if live_mtu != want_mtu:
            diffs.append(("mtu", str(live_mtu) if live_mtu else "(unset)", str(want_mtu), True))

    raw_masq = live.options.get(OPT_MASQUERADE)
    live_masq = True if raw_masq is None else parse_bool(raw_masq)  # Docker's default: on
    if live_masq != spec.masquerade:
        shown = raw_masq if live_masq is None and raw_masq is not None else flag(bool(live_masq))
        diffs.append(("masquerade", shown, flag(spec.masquerade), True))

    if live.internal != spec.internal:
        diffs.append(("internal", flag(live.internal), flag(spec.internal), True))

    for key, value in spec.labels:
        have = live.labels.get(key)
        if have != value:
            diffs.append((f"labels.{key}", "(absent)" if have is None else have, value, True))
    return diffs


def ipv6_fell_back(spec: DockerNetwork, live: LiveDockerNetwork) -> bool:
    """Tell whether ``live`` was created IPv4-only for ``spec`` because the daemon could not do
    IPv6."""
    return (spec.subnet6 is None and not live.enable_ipv6
            and live.labels.get(IPV6_FALLBACK_LABEL) == "true")

