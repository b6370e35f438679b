"""bn_batch_stats: BatchNormalization with batch statistics, for full fine-tuning (`--bn-train`).

Rewrite: each eval-mode BatchNormalization becomes primitive ops that normalise with the
batch's mean and biased variance over (N, spatial), as torch's BatchNorm in train mode, so
autodiff differentiates through the statistics. Its running statistics become step state:
graph inputs with role `opt_state` and outputs `<stat>.new` updated as torch does
(new = momentum * running + (1 - momentum) * batch, ONNX's momentum, unbiased variance).

A training-mode BatchNormalization whose running statistics are computed, not stored, is
rewritten whether or not the pass is enabled: batch statistics are what the model means there
(a weight-standardised convolution normalises its weight by the weight's own statistics, and
the legacy exporter writes that as training_mode=1 fed by ReduceMeans), and there is no state
to update. Its running-statistic outputs must be unused.
Preconditions: static shapes; runs before mark_trainable. In place; `modified` is false
when no BatchNormalization was rewritten.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, attr, numel, static_shape
from fblc.compiler.keys import Role
from fblc.errors import UnsupportedOpError
from fblc.passes.contracts import ContractPass


class BatchNormBatchStats(ContractPass):
    """Decompose BatchNormalization into batch-statistics ops (in place; no-op unless enabled)."""

    name = "bn_batch_stats"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def __init__(self, enabled: bool) -> None:
        super().__init__()
        self.enabled = enabled

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        nodes = [n for n in graph if n.op_type == "BatchNormalization" and n.domain == ""
                 and (self.enabled or _normalises_by_computed_statistics(n))]
        if not nodes:
            return ir.passes.PassResult(model, False)
        emitter = Emitter(graph, stage="forward")
        for node in nodes:
            emitter.anchor = node
            emitter.prefix = f"{node.name}/batch_stats"
            self._rewrite(emitter, graph, node)
            graph.remove(node, safe=True)
        return ir.passes.PassResult(model, True)

    @staticmethod
    def _rewrite(e: Emitter, graph: ir.Graph, node: ir.Node) -> None:
        x, scale, bias, running_mean, running_var = node.inputs[:5]
        shape = static_shape(x)
        channels, rank = shape[1], len(shape)
        axes = [0] + list(range(2, rank))
        count = numel(shape) // channels
        epsilon = float(attr(node, "epsilon", 1e-5))
        momentum = float(attr(node, "momentum", 0.9))
        per_channel = [1, channels] + [1] * (rank - 2)
        mean = e.op("ReduceMean", x, e.ints(axes), keepdims=1)
        centered = e.op("Sub", x, mean)
        var = e.op("ReduceMean", e.op("Mul", centered, centered), e.ints(axes), keepdims=1)
        inv_std = e.op("Reciprocal", e.op("Sqrt", e.op("Add", var, e.scalar(epsilon, var))))
        normalized = e.op("Mul", centered, inv_std)
        y = e.op("Add", e.op("Mul", normalized, e.reshape(scale, per_channel)), e.reshape(bias, per_channel))
        original = node.outputs[0]
        name = original.name
        original.replace_all_uses_with(y, replace_graph_outputs=True)
        original.name, y.name = f"{name}/eval_mode", name  # consumers and dumps keep seeing the same name
        if _normalises_by_computed_statistics(node):
            used = [out.name for out in node.outputs[1:] if out.uses() or out in graph.outputs]
            if used:
                raise UnsupportedOpError(
                    f"BatchNormalization '{node.name}' normalises by batch statistics and its running statistics "
                    f"are computed, yet its outputs {', '.join(map(repr, used))} are read",
                    "export the model so that only the normalised output of this node is used")
            return
        unbiased = count / max(count - 1, 1)
        for stat, batch, correction in ((running_mean, mean, 1.0), (running_var, var, unbiased)):
            batch_vector = e.reshape(batch, [channels])
            blended = e.op("Add", e.op("Mul", stat, e.scalar(momentum, stat)),
                           e.op("Mul", batch_vector, e.scalar((1.0 - momentum) * correction, stat)))
            keys.set_role(stat, Role.OPT_STATE)
            if stat not in graph.inputs:
                graph.inputs.append(stat)
            new = e.op("Identity", blended, name=f"{stat.name}.new")
            keys.set_role(new, Role.OPT_STATE)
            graph.outputs.append(new)


def _normalises_by_computed_statistics(node: ir.Node) -> bool:
    """training_mode=1 with running statistics that a node computes: nothing is stored to update."""
    stats = node.inputs[3:5]
    return bool(int(attr(node, "training_mode", 0))) and any(s is not None and s.producer() is not None
                                                             for s in stats)
