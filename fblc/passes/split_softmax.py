"""split_softmax: Softmax and LogSoftmax as a row statistic and an elementwise map.

Rewrite (SPLITS, a table keyed by op type), for Y = op(X, axis):
- L = ReduceLogSumExp(X, [axis], keepdims=1), the row statistic, once per row;
- Softmax: Y = Exp(Sub(X, L)); LogSoftmax: Y = Sub(X, L).
Y keeps its value (name, shape, every reader: the gradient rules, which read Y, are unchanged),
and the node that computes Y takes the replaced node's name: the gradient rules' nodes name it as
their origin (`fblc.grad_of`), which storage_precision follows from the loss's nodes to their gradients.

Why: a row statistic computed inside a per-element kernel is computed again by every
work-item of the row (a vocabulary of V read V / 4 times per row when V % 4 == 0, V times per
element otherwise), or kept in private memory that spills on a phone. As a reduction it is one
kernel over the rows (a work-group per row when a row is longer than the profile's serial
limit, fblc.codegen.kernels.reduce), and the map fuses into the elementwise kernels around it
(the loss's gather, the softmax backward's product).

Preconditions: the step graph (after the gradient rules and the optimizer), static shapes; the
lowered graph computes what the step did (exp(x - logsumexp x) is softmax). In place; nodes
keep the stage of the node they replace (a forward one's is "forward", as lower_composites writes).
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, attr, replace_output, static_shape
from fblc.passes.contracts import ContractPass

#: (emitter before the node, X, L) -> the value that becomes Y
Split = Callable[[Emitter, ir.Value, ir.Value], ir.Value]

SPLITS: dict[str, Split] = {
    "Softmax": lambda e, x, lse: e.op("Exp", e.op("Sub", x, lse)),
    "LogSoftmax": lambda e, x, lse: e.op("Sub", x, lse),
}


def _split(graph: ir.Graph, node: ir.Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    # the nodes it writes carry the replaced node's stage and gradient origin
    emitter = Emitter(graph, stage=node.metadata_props.get(keys.STAGE, "forward"))
    emitter.anchor, emitter.prefix = node, f"{node.name}/split"
    emitter.origin = node.metadata_props.get(keys.GRAD_OF)
    rank = len(static_shape(x))
    lse = emitter.op("ReduceLogSumExp", x, emitter.ints([int(attr(node, "axis", -1)) % rank]), keepdims=1)
    result = SPLITS[node.op_type](emitter, x, lse)
    replace_output(y, result, "split")
    graph.remove(node, safe=True)
    result.producer().name = node.name


class SplitSoftmax(ContractPass):
    """Rewrite Softmax and LogSoftmax into ReduceLogSumExp and an elementwise map (in place)."""

    name = "split_softmax"
    requires_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        found = [n for n in graph if n.op_type in SPLITS and n.domain in ("", "ai.onnx")
                 and static_shape(n.inputs[0])]
        for node in found:
            _split(graph, node)
        return ir.passes.PassResult(model, bool(found))
