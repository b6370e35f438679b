"""Child processes that Ctrl-C reaches, whatever signal state the test process inherited."""

from __future__ import annotations

import signal


def interruptible() -> None:
    """`preexec_fn` for a child the test interrupts: a shell that starts a job in the background
    without job control ignores SIGINT in it, and pytest-xdist's workers, their children and a
    Python started from them inherit that, so SIGINT would never reach the child's handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
