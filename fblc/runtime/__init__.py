"""Runtimes that execute a bundle: the local pyopencl runner (and, later, the native runner over adb).

Runtimes import only the bundle format, never the compiler.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # LocalRunner imports pyopencl: only load it when asked for
    if name == "LocalRunner":
        from fblc.runtime.local import LocalRunner

        return LocalRunner
    raise AttributeError(name)
