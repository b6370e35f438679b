"""User-facing errors: one line with the cause and what to do; the CLI exits 2 on them."""

from __future__ import annotations

from typing import Sequence


class FblcError(Exception):
    """An error caused by the user's input (model, flags, data), not by a bug in fblc."""

    exit_code = 2

    def __init__(self, cause: str, remedy: str = "") -> None:
        self.cause = cause
        self.remedy = remedy
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return f"{self.cause}; {self.remedy}" if self.remedy else self.cause


class BundleError(Exception):
    """A bundle that is missing, corrupt, or of another format version (fblc.bundle_format; the runtimes'
    errors derive from it). Defined here, with no import, so that the CLI catches it without loading numpy."""


class ModelLoadError(FblcError):
    """The model file cannot be read as ONNX."""


class ShapeError(FblcError):
    """A dimension is unknown or shapes do not agree."""


class UnsupportedOpError(FblcError):
    """An op has no entry in a registry (gradient rules, kernels, FTD classes), or its entry refuses a node.

    `ops` are the op types it names, so that `fblc check` can mark them without parsing the text.
    """

    def __init__(self, cause: str, remedy: str = "", ops: Sequence[str] = ()) -> None:
        super().__init__(cause, remedy)
        self.ops = tuple(ops)


class TrainableSetError(FblcError):
    """The trainable/frozen split selected nothing, or a pattern matched nothing."""
