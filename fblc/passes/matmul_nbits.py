"""onnxruntime's com.microsoft MatMulNBits as ONNX ops: DequantizeLinear (blocked, opset 21) then MatMul.

MatMulNBits(A, B, scales[, zero_points, g_idx, bias]; K, N, bits, block_size) is A @ W^T (+ bias) with W [N, K]
dequantized from B [N, k_blocks, block_size * bits / 8] bytes: element (n, k) is the unsigned `bits`-bit value
at position k of row n, low nibble first (onnxruntime's MatMul4Bits layout), minus its block's zero point
(default 2^(bits-1)), times its block's scale. The lowering keeps those bytes as they are: a uint4/uint8 [N, K]
tensor whose packed words (fblc.compiler.quantize.pack_words) are B's bytes in order, and the scales and zero
points as [N, k_blocks]. Refused: g_idx (act-order), float zero points, bits other than 4 and 8.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, attr, const_array
from fblc.compiler.keys import Role
from fblc.errors import UnsupportedOpError

DOMAIN = "com.microsoft"
UNSIGNED = {4: (ir.DataType.UINT4, ml_dtypes.uint4), 8: (ir.DataType.UINT8, np.uint8)}


def _refuse(node: ir.Node, what: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"MatMulNBits node '{node.name}': {what}",
                              "re-quantize the model with onnxruntime's MatMulNBitsQuantizer (4 or 8 bits, symmetric "
                              "or uint8 zero points, no act-order), or import the float model and use --weights")


def _unpack(raw: np.ndarray, rows: int, count: int, bits: int) -> np.ndarray:
    """The first `count` `bits`-bit values of each of `rows` rows of bytes (low bits first), as uint8."""
    data = np.asarray(raw, np.uint8).reshape(rows, -1)
    if bits == 8:
        return data[:, :count]
    values = np.stack([data & 0xF, data >> 4], axis=-1).reshape(rows, -1)
    return values[:, :count]


def _frozen(e: Emitter, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
    tensor = ir.tensor(array, dtype=dtype, name=name)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(dtype), const_value=tensor)
    keys.set_role(value, Role.FROZEN)  # a quantized weight never trains (its scales neither)
    e.graph.register_initializer(value)
    return value


def lower_matmul_nbits(e: Emitter, node: ir.Node) -> ir.Value:
    """DequantizeLinear + Transpose + MatMul (+ Add of the bias) in place of `node`'s output."""
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    a, packed, scales, zero_points, g_idx, bias = inputs
    k, n = int(attr(node, "K")), int(attr(node, "N"))
    bits, block = int(attr(node, "bits", 4)), int(attr(node, "block_size"))
    if bits not in UNSIGNED:
        raise _refuse(node, f"bits {bits} (fblc reads 4 and 8)")
    if g_idx is not None:
        raise _refuse(node, "g_idx (act-order) is not supported")
    raw, scale = const_array(packed), const_array(scales)
    if raw is None or scale is None:
        raise _refuse(node, "B and scales must be initializers")
    blocks = -(-k // block)
    dtype, numpy_type = UNSIGNED[bits]
    prefix = packed.name or node.name
    q = _frozen(e, f"{prefix}.q", _unpack(raw, n, k, bits).astype(numpy_type), dtype)
    scale_value = _frozen(e, f"{prefix}.scale", np.asarray(scale).reshape(n, blocks), ir.DataType(scales.dtype))
    if zero_points is None:
        zero = np.full((n, blocks), 1 << (bits - 1), np.uint8)
    else:
        if zero_points.dtype != ir.DataType.UINT8 or (raw_zero := const_array(zero_points)) is None:
            raise _refuse(node, "zero points must be a uint8 initializer (float zero points are not supported)")
        zero = _unpack(raw_zero, n, blocks, bits)
    zero_value = _frozen(e, f"{prefix}.zero_point", zero.astype(numpy_type), dtype)
    weight = e.op("DequantizeLinear", q, scale_value, zero_value, axis=1, block_size=block)
    y = e.op("MatMul", a, e.op("Transpose", weight, perm=[1, 0]))
    return e.op("Add", y, bias) if bias is not None else y


def drop_unread(graph: ir.Graph, names: set[str]) -> None:
    """Remove the initializers `names` that nothing reads now (the lowered nodes' packed B, scales, zero points)."""
    for name in names:
        value = graph.initializers.get(name)
        if value is not None and not value.uses() and not value.is_graph_input() and not value.is_graph_output():
            graph.initializers.pop(name)
