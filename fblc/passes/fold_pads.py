"""fold_pads: merge a zero Pad in front of convolutions into their `pads` attribute.

Exporters of TF-style models (transformers' MobileNetV2 with `tf_padding`) write an explicit
`Pad` before every Conv. Each one is a full copy of the activation, kept alive next to it, and
in a training step the backward would slice the gradient back out of the padded copy.

Rewrite: a `Pad` in constant mode with fill 0 (or no fill), constant non-negative pads on the
spatial axes only, whose every consumer is a Conv reading it as input 0 (with `auto_pad`
NOTSET), is removed; each Conv reads the Pad's input and adds the spatial pads to its own
`pads`. A Pad whose pads are all zero is removed whatever reads it. Preconditions: constants
folded (the pads are initializers or Constant outputs). In place; `modified` is false when no
Pad qualifies (a reflect/edge Pad, a non-zero fill, a pad on the batch or channel axis, or a
Pad that also feeds another op is left alone).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fblc.compiler.values import attr, const_array
from fblc.passes.contracts import ContractPass


def _zero_fill(node: ir.Node) -> bool:
    if len(node.inputs) < 3 or node.inputs[2] is None:
        return True
    fill = const_array(node.inputs[2])
    return fill is not None and fill.size == 1 and float(np.asarray(fill).reshape(-1)[0]) == 0.0


def _pads_per_axis(node: ir.Node, rank: int) -> list[tuple[int, int]] | None:
    """(begin, end) per axis of the Pad's input, or None when not constant."""
    pads = const_array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if pads is None:
        return None
    pads = [int(p) for p in np.asarray(pads).reshape(-1)]
    axes = list(range(rank))
    if len(node.inputs) > 3 and node.inputs[3] is not None:
        given = const_array(node.inputs[3])
        if given is None:
            return None
        axes = [int(a) % rank for a in np.asarray(given).reshape(-1)]
    if len(pads) != 2 * len(axes):
        return None
    result = [(0, 0)] * rank
    for k, axis in enumerate(axes):
        result[axis] = (pads[k], pads[k + len(axes)])
    return result


def _conv_reads_only_input(node: ir.Node, value: ir.Value) -> bool:
    return (node.op_type == "Conv" and node.domain == "" and str(attr(node, "auto_pad", "NOTSET")) == "NOTSET"
            and all(index == 0 for index, v in enumerate(node.inputs) if v is value))


def _drop_if_unused(graph: ir.Graph, value: ir.Value | None) -> None:
    """Remove a pads/fill constant that nothing reads any more."""
    if value is None or value.uses() or value.is_graph_input() or value.is_graph_output():
        return
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant":
        graph.remove(producer, safe=True)
    elif producer is None and value.name in graph.initializers:
        graph.initializers.pop(value.name)


class FoldPads(ContractPass):
    """Fold zero Pads into the pads of the Convs that read them (in place)."""

    name = "fold_pads"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "Pad" or node.domain != "" or str(attr(node, "mode", "constant")) != "constant":
                continue
            source, padded = node.inputs[0], node.outputs[0]
            if source is None or source.shape is None or padded.is_graph_output() or not _zero_fill(node):
                continue
            per_axis = _pads_per_axis(node, len(source.shape))
            if per_axis is None or any(b < 0 or e < 0 for b, e in per_axis):
                continue
            consumers = [use.node for use in padded.uses()]
            if all(b == 0 and e == 0 for b, e in per_axis):
                self._remove(graph, node)
                modified = True
                continue
            if per_axis[0] != (0, 0) or per_axis[1] != (0, 0) or not consumers:
                continue
            if not all(_conv_reads_only_input(c, padded) for c in consumers):
                continue
            spatial = per_axis[2:]
            for conv in consumers:
                own = list(attr(conv, "pads", [0] * (2 * len(spatial))))
                half = len(own) // 2
                merged = ([own[i] + spatial[i][0] for i in range(half)]
                          + [own[half + i] + spatial[i][1] for i in range(half)])
                conv.attributes["pads"] = ir.AttrInt64s("pads", merged)
            self._remove(graph, node)
            modified = True
        return ir.passes.PassResult(model, modified)

    @staticmethod
    def _remove(graph: ir.Graph, node: ir.Node) -> None:
        constants = list(node.inputs[1:])
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        graph.remove(node, safe=True)
        for value in constants:
            _drop_if_unused(graph, value)
