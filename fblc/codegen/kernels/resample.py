"""Resize (nearest and linear): a gather kernel over constant per-axis taps.

Each output element reads, along every resized axis, one (nearest) or two (linear) input
coordinates with constant weights (fblc/compiler/resize_taps.py computes them once, in the float32
arithmetic onnxruntime uses), and sums the 2^k products of its k linear axes' taps; unresized
axes read their own coordinate. A direct gather, not the separable matmul the gradient uses
(fblc/compiler/gradients/resample.py): one pass, O(2^k) reads an element instead of O(in) per axis.

The taps are literals: an integer upsampling by s reads coordinate o / s; any other axis reads
its coordinate and weights from private `const` tables (one entry per output coordinate, declared
once per work-item in the prologue; read-only arrays with constant initializers, which OpenCL
compilers may place in constant memory). Tables past MAX_TABLE entries an axis are refused
(UnsupportedOpError) rather than compiled into a huge kernel.
"""

from __future__ import annotations

from itertools import product

import numpy as np

from fblc.codegen.builder import OUT_INDEX, KernelBuilder, ctype_of
from fblc.codegen.cl import Kernel, div_index, flat_index, float_literal, strides_of
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.textures import TextureTable
from fblc.compiler.resize_taps import AxisTaps, resize_taps
from fblc.compiler.values import static_shape
from fblc.errors import UnsupportedOpError

FAMILY = "resample"
MAX_TABLE = 8192  # output coordinates of one axis the tables may hold


def _table(b: KernelBuilder, ctype: str, values: np.ndarray, hint: str) -> str:
    """A private constant array in the per-work-item prologue; returns its name."""
    name = b.fresh(hint)
    if ctype == "float":
        body = ", ".join(float_literal(float(v)) for v in values)
    else:
        body = ", ".join(str(int(v)) for v in values)
    b.emit_texel(f"const {ctype} {name}[{len(values)}] = {{{body}}};")
    return name


def _axis_reads(b: KernelBuilder, taps: AxisTaps, node_name: str) -> list[tuple[str, str | None]]:
    """(coordinate, weight) C expressions of the taps of the current output element along the axis
    (weight None: 1)."""
    o = f"{OUT_INDEX}{taps.axis}"
    factor = taps.repeat_factor()
    if factor is not None:
        return [(div_index(o, factor), None)]
    if taps.size_out > MAX_TABLE:
        raise UnsupportedOpError(f"Resize node '{node_name}': axis {taps.axis} has {taps.size_out} outputs, past the "
                                 f"{MAX_TABLE} of the kernel's tap tables",
                                 "resize by an integer factor with nearest, or in smaller steps")
    first = f"{_table(b, 'int', taps.first, 'rf')}[{o}]"
    if taps.nearest:
        return [(first, None)]
    reads = [(first, f"{_table(b, 'float', taps.w_first, 'wf')}[{o}]")]
    if np.any(taps.w_second):
        reads.append((f"{_table(b, 'int', taps.second, 'rs')}[{o}]",
                      f"{_table(b, 'float', taps.w_second, 'ws')}[{o}]"))
    return reads


@register_kernel("Resize")
def emit_resize(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """out[o] = sum over tap choices c of prod_a w_a(c) * x[coordinates c] (see the module docstring)."""
    node = group.anchor
    x = node.inputs[0]
    shape = static_shape(x)
    taps = {t.axis: t for t in resize_taps(node)}
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    per_axis = [_axis_reads(b, taps[a], node.name) if a in taps else [(f"{OUT_INDEX}{a}", None)]
                for a in range(len(shape))]
    strides = strides_of(shape)
    acc = b.fresh("acc")
    b.emit(f"{ctype_of(node.outputs[0])} {acc} = 0;")
    for choice in product(*per_axis):
        value = b.load(x, flat_index([(coordinate, stride) for (coordinate, _), stride in zip(choice, strides)]))
        weights = [w for _, w in choice if w is not None]
        b.emit(f"{acc} += {' * '.join(weights + [value])};")
    return [b.finish([acc])]
