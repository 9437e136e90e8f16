"""Read our table back and change it in one transaction per call.

In this process through libnftables when its context could be made safely at start-up
(``lib.LibNft.open``), else through an ``nft -j -f -`` process: the same JSON either way.
Both act on the calling thread's network namespace, as the ``iptables`` driver does: a
thread in another namespace than the context's (an in-process caller inside
``netns.enter``) runs ``nft`` there, never the context, whose socket would read and change
the table of the namespace it was made in.

See docs/decisions/045-nftables-table-of-our-own.md.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from typing import Any

from reconciler.domain import nftable
from reconciler.domain.errors import DriverError, PreconditionError, TemporaryError
from reconciler.drivers.nft.lib import LibNft

log = logging.getLogger(__name__)

_LIST = f"list table {nftable.FAMILY} {nftable.TABLE}"


_shared: tuple[LibNft | None, LibNft | None, str] | None = None


def shared_lib() -> tuple[LibNft | None, LibNft | None, str]:
    """Return the process's two libnftables contexts, one that reads our table back and one
    that changes it (made on the first call: at start-up), or Nones and why not.

    Two, because a context keeps what it last listed in its cache: after a ``list table``
    of N elements the next transaction on the same context releases and fetches that cache
    again, and one allocation's change cost 54 ms at 5,000 allocations instead of 0.4 ms.
    The writer never lists, so a change costs the same at any size.
    """
    global _shared  # noqa: PLW0603 - contexts per process, made while fds are few
    if _shared is None:
        reader, why = LibNft.open()
        writer, why2 = LibNft.open() if reader is not None else (None, "")
        if reader is not None and writer is None:
            reader.close()
            reader, why = None, why2
        _shared = (reader, writer, why)
    return _shared


class NftDriver:
    """Our table, through libnftables or ``nft``."""

    def __init__(self, lib: LibNft | None = None, *, use_lib: bool = True,
                 writer: LibNft | None = None) -> None:
        self.why_process = ""
        if lib is None and use_lib:
            lib, writer, self.why_process = shared_lib()
            if lib is None:
                log.info("nftables through the nft command: %s", self.why_process)
        self._lib = lib
        self._writer = writer if writer is not None else lib

    @property
    def in_process(self) -> bool:
        """Tell whether the calling thread's commands run through libnftables here."""
        return self._lib is not None and self._lib.here()

    def _run(self, command: str, *, json_input: bool) -> tuple[int, str, str]:
        lib = self._writer if json_input else self._lib
        if lib is not None and lib.here():
            return lib.run(command)
        if shutil.which("nft") is None:
            why = self.why_process or "its context is in another network namespace"
            raise PreconditionError("nft is not installed and libnftables.so.1 is not usable "
                                    f"({why}): install nftables")
        args = ["nft", "-j", "-f", "-"] if json_input else ["nft", "-j", *command.split()]
        try:
            out = subprocess.run(args, input=command if json_input else None,
                                 capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise TemporaryError("nft timed out", delay=1.0) from None
        return out.returncode, out.stdout, out.stderr

    def observe(self, mark: int | None = None) -> nftable.TableState:
        """Read our table back (its sets' elements included)."""
        try:
            rc, out, err = self._run(_LIST, json_input=False)
        except PreconditionError as exc:
            return nftable.TableState(available=False, error=str(exc))
        if rc != 0:
            if "No such file or directory" in err:
                return nftable.TableState(exists=False)
            return nftable.TableState(available=False, error=f"nft {_LIST}: {_last(err)}")
        try:
            listing = json.loads(out)
        except ValueError as exc:
            return nftable.TableState(available=False, error=f"nft {_LIST}: {exc}")
        return nftable.parse_table(listing, mark)

    def apply(self, commands: list[dict[str, Any]]) -> None:
        """Run ``commands`` as one transaction (all or nothing)."""
        if not commands:
            return
        rc, _out, err = self._run(json.dumps({"nftables": commands}), json_input=True)
        if rc != 0:
            raise DriverError(f"nftables transaction failed: {_last(err)}")



def _last(err: str) -> str:
    return " ".join(err.split())[:300] or "failed"
