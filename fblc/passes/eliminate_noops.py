"""eliminate_noops: remove Identity nodes and inference-mode Dropout.

Rewrite: every consumer of `Identity(x)` or of the first output of an inference-mode
`Dropout(x)` reads `x` instead, and the node goes. A graph output produced by such a node
keeps its name through an Identity, since graph outputs are named interfaces.
Preconditions: Dropout's training_mode input absent or constant false (a training-mode
Dropout is kept, and fails later with the unsupported-op error). In place.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler.graph import const_array
from fblc.passes.contracts import ContractPass


def _is_noop(node: ir.Node) -> bool:
    if node.domain != "":
        return False
    if node.op_type == "Identity":
        return True
    if node.op_type == "Dropout":
        training = node.inputs[2] if len(node.inputs) > 2 else None
        if training is None:
            return not (len(node.outputs) > 1 and node.outputs[1].uses())
        array = const_array(training)
        return array is not None and not bool(array) and not (len(node.outputs) > 1 and node.outputs[1].uses())
    return False


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
            source, result = node.inputs[0], node.outputs[0]
            if id(result) in graph_outputs or source is None or source.is_graph_output():
                continue
            result.replace_all_uses_with(source)
            graph.remove(node, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified)
