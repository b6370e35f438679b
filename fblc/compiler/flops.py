"""The arithmetic of one node, for the target's time estimates (report.json `estimate`, the layout search).

FLOPS is keyed by op type: a contraction's multiply-adds count two, a reduction or normalisation one
per input element, any other op one per output element.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from fblc.compiler.values import attr, numel, static_shape

FlopRule = Callable[[ir.Node], int]


def _out(node: ir.Node) -> int:
    return numel(static_shape(node.outputs[0]))


def _matmul(node: ir.Node) -> int:
    return 2 * _out(node) * static_shape(node.inputs[0])[-1]


def _gemm(node: ir.Node) -> int:
    a = static_shape(node.inputs[0])
    return 2 * _out(node) * (a[0] if int(attr(node, "transA", 0)) else a[1])


def _conv(node: ir.Node) -> int:  # every output element: Cin / group x kernel taps multiply-adds
    weight = static_shape(node.inputs[1])
    return 2 * _out(node) * numel(weight[1:])


def _conv_transpose(node: ir.Node) -> int:  # every input element scatters into Cout / group x taps outputs
    weight = static_shape(node.inputs[1])
    return 2 * numel(static_shape(node.inputs[0])) * numel(weight[1:])


def _reduction(node: ir.Node) -> int:
    return numel(static_shape(node.inputs[0]))


def _philox(node: ir.Node) -> int:  # per texel: ten rounds of two multiplies and xors, two Box-Muller pairs
    return 20 * _out(node)


def _philox_sum(node: ir.Node) -> int:  # the same per texel and member row, plus a multiply-add
    return 22 * _out(node) * static_shape(node.inputs[0])[-1]


FLOPS: dict[str, FlopRule] = {"MatMul": _matmul, "Gemm": _gemm, "Conv": _conv, "ConvTranspose": _conv_transpose,
                              "PhiloxNormal": _philox, "PhiloxWeightedSum": _philox_sum,
                              **{op: _reduction for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2",
                                                            "ReduceLogSumExp", "LayerNormalization",
                                                            "BatchNormalization", "GlobalAveragePool")}}


def node_flops(node: ir.Node) -> int:
    if not node.outputs or node.outputs[0] is None or node.outputs[0].shape is None:
        return 0
    return FLOPS.get(node.op_type, _out)(node)
