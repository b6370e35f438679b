"""The cyclic garbage collector paused while the compiler builds its kernels.

Lowering a step allocates a kernel IR of some hundred thousand small objects (expressions, statements) that
live until the bundle is written; each allocation burst starts a collection, and the oldest generation's
traverse every object the process holds (in a test worker: torch, transformers, earlier steps), all of them
alive. Measured on `fblc compile` of tests/support's MobileNetV2: a fifth to a quarter of its CPU time.
Reference counting still frees what is dropped meanwhile (the IR is trees); the few cycles made meanwhile
are collected once the collector runs again, after the compile.
"""

from __future__ import annotations

import functools
import gc
from typing import Callable, TypeVar

__all__ = ["collector_paused"]

F = TypeVar("F", bound=Callable[..., object])


def collector_paused(function: F) -> F:
    """`function` run with the cyclic collector off, restored as found (a call inside another stays off)."""
    @functools.wraps(function)
    def paused(*args: object, **kwargs: object) -> object:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return paused  # type: ignore[return-value]
