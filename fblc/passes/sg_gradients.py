"""sg_gradients: build_gradients for memflora-sg, which also keeps dL/dq of every adapter site.

Rewrite: as build_gradients (reverse-mode autodiff of `loss`, `P.grad` outputs for the
trainable parameters, forward values the backward reads get role `saved`), with the
bottleneck q of every MemFLoRA site (values marked `fblc.adapter.q` by memory_floor) among
the values differentiated: their gradients dL/dq are marked `fblc.adapter.dq` (the name of
their q) for sg_replay, which contracts them with the replayed site inputs. q itself is read by
no new backward op, so the saved set is that of memflora.
Preconditions: those of build_gradients; memory_floor ran with `--adapter memflora-sg`. In
place; `modified` as build_gradients.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.adapters import SITE_DQ, SITE_Q
from fblc.compiler.autodiff import build_backward, params_reaching
from fblc.compiler.errors import FblcError, TrainableSetError
from fblc.compiler.graph import Emitter
from fblc.compiler.keys import Role
from fblc.passes.build_gradients import UNUSED_PARAMS, BuildGradients, trainable_params


class SgGradients(BuildGradients):
    """Autodiff of the loss with respect to the parameters and every site's q (in place)."""

    name = "sg_gradients"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        loss = graph.outputs[0]
        bottlenecks = [v for n in graph for v in n.outputs if v is not None and SITE_Q in v.metadata_props]
        if not bottlenecks:
            raise FblcError("memflora-sg found no adapter bottleneck in the graph", "run memory_floor with --adapter memflora-sg first")
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
            model.metadata_props[UNUSED_PARAMS] = ",".join(p.name for p in unused)
        result = build_backward(graph, loss, list(reaching) + bottlenecks)
        naming = Emitter(graph, stage="backward")
        for param in reaching:
            grad = result.grads[param.name]
            if grad.producer() is None or grad.is_graph_output() or grad.name.endswith(".grad"):
                grad = naming.op("Identity", grad)
            grad.name = f"{param.name}.grad"
            grad.shape, grad.dtype = param.shape, param.dtype
            keys.set_role(grad, Role.GRAD)
            graph.outputs.append(grad)
        for q in bottlenecks:
            dq = result.grads[q.name]
            if dq.producer() is None or SITE_DQ in dq.metadata_props:  # a zero, or shared: own it
                dq = naming.op("Identity", dq)
            dq.shape, dq.dtype = q.shape, q.dtype
            dq.metadata_props[SITE_DQ] = q.name
        return ir.passes.PassResult(model, True)
