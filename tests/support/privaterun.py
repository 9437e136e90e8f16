"""A mount namespace with a private ``/run``, as the coexistence cells make one.

A tmpfs over ``/run`` and ``/run/netns`` bound back into it without its submounts
(``mount --bind``, not ``--rbind``): the namespaces mounted before it are empty files
there. The shell that made it keeps it until it is killed; enter it with
``nsenter --mount=/proc/PID/ns/mnt``.
"""

from __future__ import annotations

import select
import subprocess

#: argv: a directory to stage the bind in, then directories to make under the new /run
PRIVATE_RUN = r"""
set -eu
D=$1; shift
mkdir -p "$D/keep"
mount --make-private / 2>/dev/null || true
mount --bind /run/netns "$D/keep"
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/netns "$@"
mount --move "$D/keep" /run/netns
echo ready
exec sleep 1000000
"""


def private_run(staging: str, *dirs: str, timeout: float = 20.0) -> subprocess.Popen[str]:
    """The keeper of a new private-``/run`` mount namespace (``dirs`` made under its
    /run), once it is ready; kill it to end the namespace and its mounts."""
    keeper = subprocess.Popen(["unshare", "-m", "--propagation", "unchanged", "sh", "-c",
                               PRIVATE_RUN, "sh", staging, *dirs],
                              stdout=subprocess.PIPE, text=True)
    assert keeper.stdout is not None
    ready, _, _ = select.select([keeper.stdout], [], [], timeout)
    if not ready or keeper.stdout.readline().strip() != "ready":
        keeper.kill()
        keeper.wait()
        raise RuntimeError("the private mount namespace did not come up")
    return keeper
