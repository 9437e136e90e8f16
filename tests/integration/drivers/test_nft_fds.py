"""libnftables' context is never used with a socket fd >= 1024 (its select() would abort)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_a_process_holding_1100_fds_falls_back_to_nft_and_still_reads() -> None:
    out = _run("""
        import os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
        from reconciler.drivers.nft.driver import NftDriver
        d = NftDriver()
        state = d.observe()
        print(d.in_process, state.available, d.why_process)
    """)
    assert out.returncode == 0, out.stderr
    in_process, available, why = out.stdout.split(" ", 2)
    assert (in_process, available) == ("False", "True")
    assert ">= 1024" in why


def test_a_context_made_at_start_up_stays_in_process() -> None:
    out = _run("""
        import os, resource
        from reconciler.drivers.nft.driver import NftDriver
        d = NftDriver()
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
        print(d.in_process, d.observe().available)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_changes_go_through_a_context_that_never_lists() -> None:
    """A context keeps what it last listed: a transaction right after a ``list table`` of N
    elements on the same context costs O(N) (54 ms at 5,000 allocations, 0.4 ms without;
    bench/fw_change.py). Reads and changes use two contexts, both made at start-up."""
    out = _run("""
        from reconciler.drivers.nft.driver import NftDriver
        d = NftDriver()
        print(d.in_process, d._lib is not None and d._writer is not None
              and d._lib is not d._writer)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_a_process_that_cannot_open_the_netfilter_socket_falls_back_instead_of_exiting() -> None:
    """``nft_ctx_new`` calls exit() when its socket cannot be opened (no nfnetlink, AF_NETLINK
    filtered, no fd left): the process ended with rc 3 and a line of libmnl's. Here every fd
    is used when the driver is made."""
    out = _run("""
        import ctypes, os, resource
        from reconciler.drivers.nft.driver import NftDriver
        ctypes.CDLL("libnftables.so.1")  # loaded: opening it again needs no fd
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        d = NftDriver()
        for fd in held[-8:]:
            os.close(fd)
        print(d.in_process, d.observe().available, "|", d.why_process)
    """)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    in_process, available = out.stdout.split("|")[0].split()
    assert (in_process, available) == ("False", "True"), out.stdout
    assert "netfilter netlink socket" in out.stdout, out.stdout
