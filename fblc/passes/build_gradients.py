"""build_gradients: append the backward of `loss` and output `P.grad` for every parameter P.

Rewrite: reverse-mode autodiff with the gradient-rule registry (fblc.compiler.autodiff);
forward values the backward reads get role `saved`. Parameters the loss does not depend on
are demoted to `frozen` and listed in the model's metadata (`fblc.unused_params`).
With `loss_scale` (mixed precision, fblc.compiler.loss_scale) the backward starts from the new
state input `loss_scale` instead of 1 and each `P.grad` is divided by it again.
Preconditions: attach_loss ran (output 0 is the scalar loss); parameters are graph inputs
with role `param`; static shapes. In place. Errors: an op on the path without a gradient
rule (naming op, node and the supported list); no parameter reaching the loss.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.autodiff import BackwardResult, build_backward, params_reaching
from fblc.errors import TrainableSetError
from fblc.compiler.graph import Emitter
from fblc.compiler.keys import Role
from fblc.compiler.loss_scale import scale_input, unscale
from fblc.passes.contracts import ContractPass



def trainable_params(graph: ir.Graph) -> list[ir.Value]:
    return [v for v in graph.inputs if keys.get_role(v) == Role.PARAM.value]


class BuildGradients(ContractPass):
    """Reverse-mode autodiff of the loss (in place)."""

    name = "build_gradients"
    requires_facts = ("static shapes", "trainable inputs", "loss")
    ensures_facts = ("gradients", "static shapes")

    def __init__(self, loss_scale: bool = False) -> None:
        super().__init__()
        self.loss_scale = loss_scale

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        loss = graph.outputs[0]
        extra = self.extra_targets(graph)
        params = trainable_params(graph)
        reaching = params_reaching(graph, loss, params)
        if not reaching:
            raise TrainableSetError("nothing to train: the loss depends on none of the trainable parameters",
                                    "check --train/--freeze and that the model's first output is what the loss reads")
        reaching_ids = {id(p) for p in reaching}
        unused = [p for p in params if id(p) not in reaching_ids]
        for param in unused:
            keys.set_role(param, Role.FROZEN)
            graph.inputs.remove(param)
        if unused:
            model.metadata_props[keys.UNUSED_PARAMS] = ",".join(p.name for p in unused)
        seed = scale_input(graph) if self.loss_scale else None
        result = build_backward(graph, loss, list(reaching) + extra, seed)
        naming = Emitter(graph, stage="backward")
        grads = [result.grads[param.name] for param in reaching]
        if seed is not None:
            grads = unscale(graph, grads, seed)
        for param, grad in zip(reaching, grads):
            if grad.producer() is None or grad.is_graph_output() or grad.name.endswith(".grad"):
                grad = naming.op("Identity", grad)
            grad.name = f"{param.name}.grad"
            grad.shape, grad.dtype = param.shape, param.dtype
            keys.set_role(grad, Role.GRAD)
            graph.outputs.append(grad)
        self.after_backward(extra, result, naming)
        return ir.passes.PassResult(model, True)

    def extra_targets(self, graph: ir.Graph) -> list[ir.Value]:
        """Values besides the parameters whose gradient a subclass needs (none here)."""
        return []

    def after_backward(self, extra: list[ir.Value], result: BackwardResult, naming: Emitter) -> None:
        """What a subclass does with the gradients of its extra targets (nothing here)."""
