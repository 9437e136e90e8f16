"""Running the CLI at a terminal: a pty for its stdin, stdout and stderr, as a person has."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

from tests.support.host import REPO


def on_a_terminal(ns: str, *args: str, answer: str | None,
                  timeout: float = 60) -> tuple[int, str]:
    """Run the CLI with its stdin, stdout and stderr on a pty (a person at a terminal);
    type ``answer`` once it asks (None: the test expects no question). Returns (rc, screen)."""
    main, tty = pty.openpty()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "reconciler", "--netns", ns, *args],
                            stdin=tty, stdout=tty, stderr=tty, env=env, cwd=REPO,
                            start_new_session=True)
    os.close(tty)
    screen = b""
    typed = False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(main, 4096)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                if not chunk and proc.poll() is not None:
                    break
                screen += chunk
            elif proc.poll() is not None:
                break
            if answer is not None and not typed and b"Enter a value:" in screen:
                os.write(main, answer.encode() + b"\n")
                typed = True
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(main)
    return rc, screen.decode(errors="replace").replace("\r\n", "\n")
