"""DequantizeLinear: y = (q - zero_point) * scale, per tensor, per axis or blocked (opset 21's `block_size`).

A lane owns one output element: it reads its integer from the packed texture (fblc.codegen.reads.packed_element),
and the scale (and zero point) of its block. This kernel materialises the dequantized tensor (its readers, the
contractions, read it as any float tensor): the integers stay packed in memory between steps, but the float
weight exists while its readers run.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import strides_of
from fblc.codegen.ir import FLOAT, Expr, const, div_index, flat_index
from fblc.codegen.kernels import lane_kernel, out_axis, own_index
from fblc.compiler.values import attr, static_shape

FAMILY = "dequantize"


def _parameter_index(node: ir.Node, shape: tuple[int, ...], parameter_shape: tuple[int, ...]) -> Expr | None:
    """Flat index into the scale (and zero point) of the current output element; None for one scale."""
    rank = len(shape)
    if not parameter_shape or all(d == 1 for d in parameter_shape):
        return None
    axis = int(attr(node, "axis", 1)) % rank
    if len(parameter_shape) == 1:  # per axis
        return out_axis(axis)
    block = int(attr(node, "block_size", 0)) or 1
    coordinates = [div_index(out_axis(k), block) if k == axis else out_axis(k) for k in range(rank)]
    return flat_index(list(zip(coordinates, strides_of(parameter_shape))))


@lane_kernel(FAMILY, "DequantizeLinear")
def emit_dequantize(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """(q - zero_point) * scale at the output element, in float."""
    data, scale = node.inputs[0], node.inputs[1]
    zero_point = node.inputs[2] if len(node.inputs) > 2 else None
    shape = static_shape(data)
    at = _parameter_index(node, shape, static_shape(scale))
    at = const(0) if at is None else at  # one scale: element 0 (inlined where it is a one-element constant)
    q = b.element(data, own_index(shape)).cast(FLOAT)
    if zero_point is not None:
        q = q - b.element(zero_point, at).cast(FLOAT)
    return [q * b.element(scale, at).cast(FLOAT)]
