"""A step that has begun changing the device's state finishes before Ctrl-C stops the program.

Parameters and optimizer state are updated in place (codegen/inplace.py): a step cut short after some of its
launches were enqueued would leave some parameters updated and others not, and "the parameters after step N"
would exist nowhere. `whole_step()` holds a SIGINT that arrives while a step runs and raises it as
KeyboardInterrupt once the step has finished (its updates committed, the step counted).
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def whole_step() -> Iterator[None]:
    """Defer SIGINT (Ctrl-C) to the end of the block; elsewhere than the main thread, where Python delivers
    signals, or where SIGINT's handler was installed outside Python (getsignal says None, and signal.signal could
    not put it back), it changes nothing."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    received: list[Any] = []

    def hold(number: int, frame: Any) -> None:
        if not received:
            sys.stderr.write("fblc: Ctrl-C: stopping after this step, whose updates are in place on the device\n")
        received.append(number)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
