"""Resize (nearest, linear, cubic, antialiased): a gather kernel over constant per-axis taps.

The taps come from fblc/compiler/resize_taps.py. They are literals (an integer upsampling) or private
`const` tables of at most TABLE_LIMIT entries an axis (fblc/passes/split_resize.py writes a longer one as
gathers); docs/ARCHITECTURE.md §3.
"""

from __future__ import annotations

import functools
import operator
from itertools import product

import numpy as np
import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import strides_of
from fblc.codegen.ir import FLOAT, INT, DType, Element, Expr, const, div_index, flat_index
from fblc.codegen.kernels import lane_kernel, out_axis
from fblc.codegen.reads import dtype_of
from fblc.compiler.resize_taps import TABLE_LIMIT, AxisTaps, resize_taps
from fblc.compiler.values import static_shape
from fblc.errors import UnsupportedOpError

FAMILY = "resample"


def _table(b: KernelBuilder, dtype: DType, values: np.ndarray, kind: str, o: Expr) -> Expr:
    """Entry `o` of a private constant array declared in the per-work-item prologue."""
    entries = [float(v) if dtype == FLOAT else int(v) for v in values]
    return Element(b.prologue.array(kind, dtype, len(entries), entries, constant=True), o)


def _axis_reads(b: KernelBuilder, taps: AxisTaps, node_name: str) -> list[tuple[Expr, Expr | None]]:
    """(coordinate, weight) of the taps of the current output element along the axis (weight None: 1)."""
    o = out_axis(taps.axis)
    factor = taps.repeat_factor()
    if factor is not None:
        return [(div_index(o, factor), None)]
    if taps.size_out > TABLE_LIMIT:  # split_resize rewrote every such Resize before codegen
        raise UnsupportedOpError(f"Resize node '{node_name}': axis {taps.axis} has {taps.size_out} outputs, past the "
                                 f"{TABLE_LIMIT} of the kernel's tap tables",
                                 "run the lowering passes (split_resize) before the kernels")
    reads: list[tuple[Expr, Expr | None]] = []
    for k in range(taps.width):  # K taps: 1 nearest, 2 linear, 4 cubic, the filter's window antialiased
        weight = None if np.all(taps.weight[:, k] == 1) else _table(b, FLOAT, taps.weight[:, k], "wt", o)
        reads.append((_table(b, INT, taps.index[:, k], "rt", o), weight))
    return reads


@lane_kernel(FAMILY, "Resize")
def emit_resize(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """out[o] = sum over tap choices c of prod_a w_a(c) * x[coordinates c]."""
    x = node.inputs[0]
    shape = static_shape(x)
    taps = {t.axis: t for t in resize_taps(node)}
    per_axis = [_axis_reads(b, taps[a], node.name) if a in taps else [(out_axis(a), None)]
                for a in range(len(shape))]
    strides = strides_of(shape)
    acc = b.body.mutable(const(0, dtype_of(node.outputs[0])), "acc")
    for choice in product(*per_axis):
        value = b.element(x, flat_index([(coordinate, stride) for (coordinate, _), stride in zip(choice, strides)]))
        b.body.assign(acc, functools.reduce(operator.mul, [w for _, w in choice if w is not None] + [value]), "+=")
    return [acc]
