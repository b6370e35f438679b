"""DequantizeLinear: y = (q - zero_point) * scale, per tensor, per axis or blocked (opset 21's `block_size`).

Where only contractions read y, each as its B operand, they dequantize the elements they load (fuse.IN_READERS,
reads.ValueReads.dequantized) and this kernel never runs. Elsewhere (another reader, a step output) a lane owns
one output element: it reads its integer from the packed texture (reads.packed_element) and the scale (and zero
point) of its block, and y is stored as any float tensor while its readers run.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.ir import FLOAT, Expr, const
from fblc.codegen.kernels import lane_kernel, out_axis, own_index
from fblc.codegen.packed import dequantize_parameter_index
from fblc.compiler.values import static_shape

FAMILY = "dequantize"


@lane_kernel(FAMILY, "DequantizeLinear")
def emit_dequantize(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """(q - zero_point) * scale at the output element, in float."""
    data, scale = node.inputs[0], node.inputs[1]
    zero_point = node.inputs[2] if len(node.inputs) > 2 else None
    shape = static_shape(data)
    at = dequantize_parameter_index(node, [out_axis(k) for k in range(len(shape))])
    at = const(0) if at is None else at  # one scale: element 0 (inlined where it is a one-element constant)
    q = b.element(data, own_index(shape)).cast(FLOAT)
    if zero_point is not None:
        q = q - b.element(zero_point, at).cast(FLOAT)
    return [q * b.element(scale, at).cast(FLOAT)]
