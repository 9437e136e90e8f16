"""The packet-mark bit our chains OR into declared forwarded traffic, and the shim that reads it.

Other managers' iptables chains on the forward path may drop (dockerd ≤ 28 sets
``FORWARD``'s policy to DROP, ufw's routed default is deny). In netfilter an accept in
one chain does not stop a drop in another, so the reconciler marks the traffic it
declares — ORs one bit into the packet mark, leaving the other bits to whoever uses
them — and keeps one rule in each such chain that accepts what carries the bit
(``planner.shim``). The bit is ``settings.firewall_mark`` (one bit, default 0x2000:
Kubernetes uses 0x4000 and 0x8000, Calico the top bits, Docker and Podman none).

See docs/decisions/048-mark-shim.md.
"""

from __future__ import annotations

from reconciler.domain.model import Settings
from reconciler.domain.ownership import RULE_COMMENT

#: the bit used when ``settings.firewall_mark`` is not set
DEFAULT_MARK = 0x2000
#: the comment that marks the shim rule as ours (the only ownership mark it can carry)
SHIM_COMMENT = f"{RULE_COMMENT}:shim"


def mark_bit(settings: Settings | None = None) -> int:
    """Return the mark bit of a desired state's settings (``DEFAULT_MARK`` without any)."""
    return DEFAULT_MARK if settings is None else settings.firewall_mark


def is_one_bit(value: int) -> bool:
    """Tell whether ``value`` is a single bit of the 32-bit packet mark."""
    return 0 < value < 1 << 32 and value & (value - 1) == 0


def hex_mark(bit: int) -> str:
    """Write a mark as iptables-save prints it: ``0x2000``."""
    return f"{bit:#x}"


def set_mark_target(bit: int) -> tuple[str, ...]:
    """Return the target that ORs ``bit`` in, as iptables-save prints ``-j MARK --or-mark``."""
    return ("-j", "MARK", "--set-xmark", f"{hex_mark(bit)}/{hex_mark(bit)}")


def shim_rule(bit: int) -> str:
    """Return the shim (after ``-A CHAIN``) exactly as ``iptables -m mark --mark X/X -m comment
    --comment reconciler:shim -j ACCEPT`` writes it and iptables-save prints it back."""
    return (f"-m mark --mark {hex_mark(bit)}/{hex_mark(bit)} -m comment --comment "
            f"{SHIM_COMMENT} -j ACCEPT")


def is_shim(rule: str) -> bool:
    """Tell whether a rule (after ``-A CHAIN``) is a shim of ours, whatever its bit."""
    return f"--comment {SHIM_COMMENT} -j ACCEPT" in rule or \
        f'--comment "{SHIM_COMMENT}" -j ACCEPT' in rule
