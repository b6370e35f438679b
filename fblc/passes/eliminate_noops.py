"""eliminate_noops: remove Identity nodes and inference-mode Dropout.

Rewrite: every consumer of `Identity(x)` or of the first output of an inference-mode
`Dropout(x)` reads `x` instead, and the node goes; the Dropout's mask, where read, becomes
Or(IsNaN(x), Not(IsNaN(x))) (ONNX: all true when not training). A graph output produced by such a node
keeps its name through an Identity, since graph outputs are named interfaces.
Preconditions: Dropout's training_mode input absent or constant false (a training-mode
Dropout is kept, and fails later with the unsupported-op error). In place.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, const_array, replace_output
from fblc.passes.contracts import ContractPass


def _is_noop(node: ir.Node) -> bool:
    if node.domain != "":
        return False
    if node.op_type == "Identity":
        return True
    if node.op_type == "Dropout":
        training = node.inputs[2] if len(node.inputs) > 2 else None
        array = None if training is None else const_array(training)
        return training is None or (array is not None and not bool(array))
    return False


def _mask_of_ones(graph: ir.Graph, node: ir.Node) -> None:
    """An inference-mode Dropout's mask, where something reads it, becomes IsNaN(x) or not: all true, as
    ONNX defines it when training_mode is false (it was a view of x: onnx's test_dropout_default_mask)."""
    mask = node.outputs[1] if len(node.outputs) > 1 else None
    if mask is None or not (mask.uses() or mask.is_graph_output()):
        return
    e = Emitter(graph, stage=node.metadata_props.get(keys.STAGE, "forward"))
    e.anchor, e.prefix = node, f"{node.name}/mask"
    nan = e.op("IsNaN", node.inputs[0])  # x's shape needs no shape inference (it runs later): an elementwise truth
    replace_output(mask, e.op("Or", nan, e.op("Not", nan)), "all_true")


class EliminateNoops(ContractPass):
    """Bypass Identity and inference Dropout (in place)."""

    name = "eliminate_noops"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        graph_outputs = set(id(v) for v in graph.outputs)
        modified = False
        for node in list(graph):
            if not _is_noop(node):
                continue
            if node.op_type == "Dropout":
                _mask_of_ones(graph, node)
            source, result = node.inputs[0], node.outputs[0]
            if id(result) in graph_outputs or source is None or source.is_graph_output():
                continue
            result.replace_all_uses_with(source)
            graph.remove(node, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified)
