"""runtime/whole_steps.whole_step: SIGINT held to the end of the step, the previous handler back after it."""

from __future__ import annotations

import os
import signal

import pytest

from fblc.runtime import whole_steps
from fblc.runtime.whole_steps import whole_step


def test_sigint_waits_for_the_end_of_the_step_and_the_handler_comes_back():
    before = signal.getsignal(signal.SIGINT)
    finished = False
    with pytest.raises(KeyboardInterrupt):
        with whole_step():
            os.kill(os.getpid(), signal.SIGINT)
            finished = True
    assert finished and signal.getsignal(signal.SIGINT) is before


def test_a_handler_installed_outside_python_is_left_in_place(monkeypatch):
    # signal.getsignal gives None for a handler that C code installed; signal.signal refuses None, so it could not
    # be restored: whole_step must not replace it
    calls = []
    monkeypatch.setattr(whole_steps.signal, "getsignal", lambda number: None)
    monkeypatch.setattr(whole_steps.signal, "signal", lambda number, handler: calls.append(handler))
    with whole_step():
        pass
    assert calls == []
