"""pick_log_probs: a LogSoftmax that only GatherElements read becomes the picked logits minus the log-sum-exp.

In a step without a backward through it (ES members: no gradient reads the log-probabilities), the loss needs
only each row's label entry of log softmax(x), yet LogSoftmax writes all of it: one more tensor of the logits'
size ([T, V]: 131 MB at Llama 3's 128256 classes and T = 256, live beside the logits at the step's peak).

Rewrite, for x [..., C], LogSoftmax(x, axis = last) read only by GatherElements(., idx, axis = last):

    lse = ReduceLogSumExp(x, last, keepdims)              [..., 1]
    GatherElements(LogSoftmax(x), idx)  ->  GatherElements(x, idx) - lse

LogSoftmax's own definition, and what split_softmax makes of a LogSoftmax (Sub(x, lse)) read at the picked
entries only: the same arithmetic per picked entry, so the same numbers. Other LogSoftmaxes, and every one
under backprop (its gradient reads the softmax), are left alone.

Preconditions: static shapes; the trainer builds no backward through the LogSoftmax (the pass is in the ES
pipeline only). In place; `modified` false where no LogSoftmax qualifies.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, attr, static_shape
from fblc.passes.contracts import ContractPass


def _last_axis(axis: int, rank: int) -> bool:
    return axis % rank == rank - 1


def _qualifies(node: ir.Node) -> bool:
    """A LogSoftmax over the last axis whose output only GatherElements along that axis read (as their data)."""
    if node.op_type != "LogSoftmax" or node.domain != "" or node.inputs[0] is None:
        return False
    rank = len(static_shape(node.inputs[0]))
    out = node.outputs[0]
    if not _last_axis(int(attr(node, "axis", -1)), rank) or out.is_graph_output() or not out.uses():
        return False
    return all(use.node.op_type == "GatherElements" and use.node.domain == "" and use.idx == 0 and
               _last_axis(int(attr(use.node, "axis", 0)), rank) for use in out.uses())


class PickLogProbs(ContractPass):
    """Rewrite label-picked LogSoftmaxes as picked logits minus the log-sum-exp (in place)."""

    name = "pick_log_probs"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        found = [node for node in graph if _qualifies(node)]
        for node in found:
            x = node.inputs[0]
            assert x is not None
            e = Emitter(graph, stage=node.metadata_props.get(keys.STAGE, "loss"))
            e.anchor, e.prefix = node, node.name
            lse = e.op("ReduceLogSumExp", x, e.ints([-1]), keepdims=1)  # one reduction kernel, as split_softmax's
            for use in list(node.outputs[0].uses()):
                gather = use.node
                e.anchor = gather
                picked = e.op("GatherElements", x, gather.inputs[1], axis=-1)
                ir.convenience.replace_all_uses_with(gather.outputs[0], e.op("Sub", picked, lse))
                graph.remove(gather, safe=True)
            graph.remove(node, safe=True)
        return ir.passes.PassResult(model, bool(found))
