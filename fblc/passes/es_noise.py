"""es_noise: the ES step's `noise` is made on the device, from the seed and an iteration counter.

Rewrite: the graph input `noise` (role `noise`, made by es_gradients) becomes the output of
PhiloxNormal(es.iteration) (fblc's device-only op, seed from `--seed`, kernel in
fblc/codegen/kernels/noise.py); `es.iteration` is a new float32 scalar state (role
`opt_state`, 0 at the start) with the output `es.iteration.new` = es.iteration + 1, so
iteration i of a run perturbs with `fblc.compiler.philox.es_noise(seed, i, [P, D])`, the
noise `fblc.compiler.reference.ReferenceStep` feeds the ONNX step at its step i.

Preconditions: the training passes ran (es_gradients's `noise` input, the step's outputs).
In place; `modified` is false for a step without `noise` (backprop).
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.es import ES_META, ITERATION
from fblc.compiler.graph import Emitter, static_shape
from fblc.compiler.keys import Role
from fblc.passes.contracts import ContractPass


class EsNoise(ContractPass):
    """Replace the `noise` input by on-device Philox noise and count the iterations (in place)."""

    name = "es_noise"
    requires_facts = ("updates",)
    ensures_facts = ("updates", "static shapes")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        noise = next((v for v in graph.inputs if keys.get_role(v) == Role.NOISE.value), None)
        if noise is None:
            return ir.passes.PassResult(model, False)
        seed = int(json.loads(model.metadata_props[ES_META])["seed"])
        counter = ir.Value(name=ITERATION, shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT),
                           const_value=ir.tensor(np.array(0.0, np.float32), name=ITERATION))
        keys.set_role(counter, Role.OPT_STATE)
        graph.inputs.remove(noise)
        graph.inputs.append(counter)
        graph.register_initializer(counter)
        e = Emitter(graph, stage="es")
        first = next(iter(graph))
        e.anchor = first
        made = e.op("PhiloxNormal", counter, seed=seed, shape=list(static_shape(noise)), name="es/noise")
        noise.replace_all_uses_with(made)
        e.anchor = None
        after = e.op("Add", counter, e.scalar(1.0, counter), name=f"{ITERATION}.new")
        keys.set_role(after, Role.OPT_STATE)
        graph.outputs.append(after)
        return ir.passes.PassResult(model, True)
