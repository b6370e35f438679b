"""forward_step: the step is the model's forward alone (`--trainer none`: a forward bundle, for inference).

Rewrite: takes mark_trainable's place in the pipeline, which then has no loss, backward or optimizer
passes (pipeline.training_passes): every parameter initializer gets role `frozen` (the weights stay
constants, so quantize_weights may store them as --weights says), the model's inputs role `input`, and
the graph is marked FORWARD_STEP, which the bundle's manifest records (`"step": "forward"`, no `loss`).
The model's outputs stay the step's outputs, by their names. With no trainable parameter the facts
"trainable inputs" and "updates" hold (there is no parameter without its P.new), so the lowering
passes run unchanged. Preconditions: static shapes; the model has at least one output. In place.

With an adapter (--adapter lora|memflora|fura-s: its pass ran before this one and froze everything but its own
trained tensors), the tensors that are still `param` are the adapter sites: frozen like the rest, initialised
to the adapter's identity (B, U, delta zero), and listed on the graph (SPECIALIST), so that the bundle's
manifest names them as the `specialist` a runtime replaces without recompiling (fblc.runtime.specialist).
"""

from __future__ import annotations

import json

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.errors import FblcError
from fblc.passes.contracts import ContractPass


class ForwardStep(ContractPass):
    """Freeze every parameter and keep the model's outputs: the step is the forward (in place)."""

    name = "forward_step"
    requires_facts = ("static shapes",)
    ensures_facts = ("trainable inputs", "updates", "static shapes")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if not graph.outputs:
            raise FblcError("the model has no outputs, so its forward computes nothing to read back",
                            "export the model with its outputs")
        adapted = keys.ADAPTER in model.metadata_props or keys.FURA_S in model.metadata_props
        sites = []
        for value in graph.initializers.values():
            if keys.get_role(value) == Role.PARAM.value:
                keys.set_role(value, Role.FROZEN)
                sites.append(value.name)
        if adapted:
            graph.metadata_props[keys.SPECIALIST] = json.dumps(sites)
        for value in graph.inputs:
            if keys.get_role(value) is None:
                keys.set_role(value, Role.INPUT)
        graph.metadata_props[keys.FORWARD_STEP] = "1"
        return ir.passes.PassResult(model, True)
