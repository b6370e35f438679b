"""User-facing errors: one line with the cause and what to do; the CLI exits 2 on them."""

from __future__ import annotations


class FblcError(Exception):
    """An error caused by the user's input (model, flags, data), not by a bug in fblc."""

    exit_code = 2

    def __init__(self, cause: str, remedy: str = "") -> None:
        self.cause = cause
        self.remedy = remedy
        super().__init__(self.one_line())

    def one_line(self) -> str:
        return f"{self.cause}; {self.remedy}" if self.remedy else self.cause


class ModelLoadError(FblcError):
    """The model file cannot be read as ONNX."""


class ShapeError(FblcError):
    """A dimension is unknown or shapes do not agree."""


class UnsupportedOpError(FblcError):
    """An op has no entry in a registry (gradient rules, kernels, FTD classes)."""


class TrainableSetError(FblcError):
    """The trainable/frozen split selected nothing, or a pattern matched nothing."""
