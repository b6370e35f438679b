"""split_resize: a Resize whose tap tables would pass the kernel's limit, as a gather an axis.

Rewrite, for a Resize (any mode fblc runs) with an axis of more than resize_taps.TABLE_LIMIT
outputs that is no integer nearest upsampling (that axis reads o / s, no table): every resized axis
in turn, x viewed [P, in, Q] around it, becomes

    y = ReduceSum(Reshape(GatherElements(x, Expand(index [1, out * K, 1]), axis 1), [P, out, K, Q])
                  * weight [1, out, K, 1], axis 2)                             (nearest: the gather alone)

with the axis's taps (fblc/compiler/resize_taps.py) as constants, and the result reshaped to Y's
shape. Y keeps its value (name, readers), and the last node takes the Resize's name and stage.

Why: the Resize kernel keeps one tap table entry per output coordinate in private constant arrays
(fblc/codegen/kernels/resample.py), which is a huge kernel, or none at all, past a few thousand
entries; the gather, multiply and ReduceSum kernels read their indices and weights from buffers
of any length. The cost is the [P, out * K, Q] gathered tensor (K times Y) per axis, written once.

Preconditions: the step graph (after the gradient rules: Resize's own rule, an O(out * K) gather,
has differentiated it), static shapes, constant scales or sizes. In place.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, replace_output, static_shape
from fblc.compiler.resize_taps import TABLE_LIMIT, AxisTaps, resize_taps
from fblc.compiler.values import numel
from fblc.passes.contracts import ContractPass


def _needs_split(node: ir.Node) -> bool:
    return any(t.size_out > TABLE_LIMIT and t.repeat_factor() is None for t in resize_taps(node))


def _axis(e: Emitter, x: ir.Value, taps: AxisTaps, shape: list[int]) -> ir.Value:
    """x [.., in, ..] resized along taps.axis: [P, out, Q]."""
    p, q = numel(shape[:taps.axis]), numel(shape[taps.axis + 1:])
    n_out, width = taps.size_out, taps.width
    flat = e.reshape(x, [p, taps.size_in, q])
    index = e.op("Expand", e.const(taps.index.reshape(1, n_out * width, 1)), e.ints([p, n_out * width, q]))
    gathered = e.op("GatherElements", flat, index, axis=1)
    if width == 1 and np.all(taps.weight == 1):
        return gathered
    weighted = e.op("Mul", e.reshape(gathered, [p, n_out, width, q]), e.const(taps.weight.reshape(1, n_out, width, 1)))
    return e.reduce_sum(weighted, [2], keepdims=False)


def _split(graph: ir.Graph, node: ir.Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    e = Emitter(graph, stage=node.metadata_props.get(keys.STAGE, "forward"))
    e.anchor, e.prefix = node, f"{node.name}/split"
    e.origin = node.metadata_props.get(keys.GRAD_OF)
    shape = list(static_shape(x))
    value = x
    for taps in resize_taps(node):
        value = _axis(e, value, taps, shape)
        shape[taps.axis] = taps.size_out
    result = e.reshape(value, shape)
    replace_output(y, result, "split")
    graph.remove(node, safe=True)
    result.producer().name = node.name


class SplitResize(ContractPass):
    """Rewrite a Resize with tap tables past TABLE_LIMIT into a gather, a multiply and a ReduceSum an axis."""

    name = "split_resize"
    requires_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        found = [n for n in graph if n.op_type == "Resize" and n.domain in ("", "ai.onnx") and _needs_split(n)]
        for node in found:
            _split(graph, node)
        return ir.passes.PassResult(model, bool(found))
