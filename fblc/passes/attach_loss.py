"""attach_loss: end the graph in a scalar `loss` computed from the model's first output.

Rewrite: adds the `labels` input (after the model's inputs, unless the loss takes none),
appends the loss ops from `fblc.compiler.losses`, and makes `loss` the first graph output;
the model's outputs go, state outputs of earlier passes (`opt_state`) stay after it.
Preconditions: static shapes; mark_trainable ran (inputs carry roles). In place.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, static_shape
from fblc.compiler.keys import Role
from fblc.compiler.losses import loss_spec
from fblc.passes.contracts import ContractPass

LABELS = "labels"
LOSS = "loss"


class AttachLoss(ContractPass):
    """Append the loss and make it the graph's output (in place)."""

    name = "attach_loss"
    requires_facts = ("static shapes",)
    ensures_facts = ("loss", "static shapes")

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.spec = loss_spec(loss)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        prediction = graph.outputs[0]
        prediction.metadata_props[keys.PREDICTION] = "1"
        if prediction.name == LOSS:
            prediction.name = f"{LOSS}/model_output"  # the step's `loss` is the Identity below
        labels = None
        if self.spec.takes_labels:
            shape = self.spec.label_shape(static_shape(prediction))
            dtype = self.spec.label_dtype or prediction.dtype
            labels = ir.Value(name=LABELS, shape=ir.Shape(list(shape)), type=ir.TensorType(dtype))
            keys.set_role(labels, Role.LABEL)
            classes = self.spec.classes(static_shape(prediction))
            if classes is not None:
                labels.metadata_props[keys.CLASSES] = str(classes)
            model_inputs = sum(1 for v in graph.inputs if keys.get_role(v) == Role.INPUT.value)
            graph.inputs.insert(model_inputs, labels)
        emitter = Emitter(graph, stage="loss")
        loss = emitter.op("Identity", self.spec.builder(emitter, prediction, labels), name=LOSS)
        loss.shape = ir.Shape([])
        loss.dtype = prediction.dtype
        carried = [v for v in graph.outputs if keys.get_role(v) == Role.OPT_STATE.value]
        graph.outputs.clear()
        graph.outputs.extend([loss, *carried])
        return ir.passes.PassResult(model, True)
