"""The arithmetic of one node, for the target's time estimates (report.json `estimate`, the layout search).

The op table (fblc/compiler/ops.py) names each op's rule, one of FLOP_RULES: a contraction's
multiply-adds count two, a reduction or normalisation one per input element, any other op one per
output element.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from fblc.compiler.ops import row
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


#: rule name (the op table's `flops` column, fblc/compiler/ops.py) -> the rule
FLOP_RULES: dict[str, FlopRule] = {"output": _out, "input": _reduction, "matmul": _matmul, "gemm": _gemm,
                                   "conv": _conv, "conv_transpose": _conv_transpose, "philox": _philox,
                                   "philox_sum": _philox_sum}


def node_flops(node: ir.Node) -> int:
    if not node.outputs or node.outputs[0] is None or node.outputs[0].shape is None:
        return 0
    entry = row(node.op_type)
    return FLOP_RULES[entry.flops if entry is not None else "output"](node)
