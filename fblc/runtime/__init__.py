"""Runtimes that execute a bundle: the local pyopencl runner (local.py), the native C runner
(native/), locally or on a phone over adb (adb.py), and read tracing for the cache model (trace.py).

Runtimes import only the bundle format and fblc.errors, never the compiler (tests/test_layers.py).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # LocalRunner imports pyopencl: only load it when asked for
    if name == "LocalRunner":
        from fblc.runtime.local import LocalRunner

        return LocalRunner
    raise AttributeError(name)
