"""Which files a list of desired-state paths names, and reading them: stdlib only.

Shared by the loader and by the thin `plan` client (``planclient``), which must
start fast and so cannot import YAML or the model.
"""

from __future__ import annotations

import os
import stat

from reconciler.domain.errors import ConfigError

TYPE_CHECKING = False  # not `typing`: this module is on the thin client's start-up path
if TYPE_CHECKING:
    from collections.abc import Sequence

MAX_FILE_BYTES = 8 * 1024 * 1024
YAML_SUFFIXES = (".yaml", ".yml")


def _error(message: str, path: str | None = None) -> ConfigError:
    """Return the error ``message`` of ``path``: it names the path only, never the file's
    values, so readers who may not read the file see it whole too."""
    return ConfigError(message, file=path, public=message)


def expand_paths(paths: Sequence[str]) -> list[str]:
    """Return the files named directly, plus every *.yaml/*.yml directly inside named
    directories.

    Each path is looked at once, by the call that uses it (no ``isdir`` before the
    ``listdir``): a directory someone removes meanwhile is a ``ConfigError`` like any
    missing path, never an exception of the look's own (it killed the agent, SPEC §5).
    """
    if not paths:
        raise _error("no desired-state path given")
    files: list[str] = []
    for p in paths:
        try:
            names = os.listdir(p)
        except NotADirectoryError:
            files.append(p)  # a file: read_bytes says what is wrong with it, when anything is
            continue
        except FileNotFoundError:
            raise _error("no such file or directory", p) from None
        except OSError as exc:
            raise _error(f"cannot read: {exc.strerror or exc}", p) from None
        found = sorted(os.path.join(p, n) for n in names
                       if n.endswith(YAML_SUFFIXES) and not n.startswith("."))
        found = [f for f in found if os.path.isfile(f)]  # isfile: False, never an error
        if not found:
            raise _error("directory holds no *.yaml or *.yml file", p)
        files.extend(found)
    seen: set[str] = set()
    unique = []
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            unique.append(f)
    return unique


def read_bytes(path: str) -> bytes:
    """Return the bytes of one desired-state file: a regular file within the size limit."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise _error("not a regular file", path)
        if st.st_size > MAX_FILE_BYTES:
            raise _error(f"file too large ({st.st_size} bytes; limit {MAX_FILE_BYTES})", path)
        with open(path, "rb") as fh:
            return fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise _error(f"cannot read: {exc.strerror}", path) from None
