"""OpenCL C building blocks: per-element kernels, index arithmetic, literals (the preamble: render/preamble.py).

Every kernel has one work-item per output texel; it computes the four elements of that
texel in a loop over lanes and writes each output texture once. Shapes, strides and texture
widths are compile-time literals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from fblc.compiler.index_map import IndexMap
from fblc.compiler.index_map import row_major_strides as strides_of
from fblc.texel_layout import div_index, mod_index  # noqa: F401 (the codegen's index arithmetic)


def float_literal(value: float) -> str:
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = repr(float(np.float32(value)))
    return f"{text}f" if ("." in text or "e" in text) else f"{text}.0f"


def index_vars(shape: Sequence[int], flat: str, prefix: str) -> list[str]:
    """Statements declaring `prefix0..` as the multi-index of flat index `flat` (non-negative) in `shape`."""
    lines = []
    for axis, (dim, stride) in enumerate(zip(shape, strides_of(shape))):
        expression = div_index(flat, stride)
        if axis > 0:
            expression = mod_index(expression, dim)
        lines.append(f"const int {prefix}{axis} = {expression};")
    return lines


def flat_index(terms: Sequence[tuple[str, int]], offset: int = 0) -> str:
    """sum(var * stride) + offset as C, dropping zero strides."""
    parts = [var if stride == 1 else f"{var} * {stride}" for var, stride in terms if stride != 0]
    if offset:
        parts.append(str(offset))
    return " + ".join(parts) if parts else "0"


def digit_terms(index: str, digits: Sequence[tuple[int, int]]) -> list[tuple[str, int]]:
    """(C expression, stride) per digit of the axis index `index` (a non-negative C int expression)
    whose mixed-radix digits are `digits` (extent, stride), outermost first (IndexMap.sub_axes)."""
    terms, inner = [], int(np.prod([extent for extent, _ in digits], dtype=np.int64))
    for j, (extent, stride) in enumerate(digits):
        inner //= extent
        digit = div_index(index, inner)
        terms.append((mod_index(digit, extent) if j else digit, stride))
    return terms


def view_index(index_map: IndexMap, indices: Sequence[str]) -> str:
    """Flat index into the root of `index_map` of the view element whose axis indices are `indices`."""
    terms = [term for axis, (dim, index) in enumerate(zip(index_map.shape, indices)) if dim != 1
             for term in digit_terms(index, index_map.sub_axes(axis))]
    return flat_index(terms, index_map.offset)


def broadcast_view_index(index_map: IndexMap, out_shape: Sequence[int], prefix: str) -> str:
    """Flat index into the root of `index_map`, the view numpy-broadcast to `out_shape`, from out index vars."""
    lead = len(out_shape) - len(index_map.shape)
    return view_index(index_map, [f"{prefix}{lead + k}" for k in range(len(index_map.shape))])


def broadcast_index(leaf_shape: Sequence[int], out_shape: Sequence[int], prefix: str) -> str:
    """Flat row-major index into a leaf of `leaf_shape` numpy-broadcast to `out_shape`, from out index vars."""
    return broadcast_view_index(IndexMap.identity(tuple(leaf_shape)), out_shape, prefix)


@dataclass
class Kernel:
    """One __kernel: its source, launch size and texture arguments (outputs first)."""

    name: str
    family: str
    source: str
    global_size: int
    outputs: list[int] = field(default_factory=list)  # texture ids
    inputs: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)  # ONNX node names it computes
    function: str = ""  # the __kernel it launches: its own, or an identical one emitted earlier
    #: the work-group size the kernel is written for (its work-items share __local memory), or None:
    #: any size, the target profile's schedule chooses
    group_size: int | None = None
    ir: object = field(default=None, repr=False, compare=False)  # its KernelIR (fblc.codegen.ir)
