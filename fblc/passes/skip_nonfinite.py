"""skip_nonfinite: under dynamic loss scaling, a step whose gradients are not finite updates nothing.

Rewrite (when the step has the state input `loss_scale`, which build_gradients adds under
mixed precision; fblc.compiler.loss_scale): `skipped` = some element of some `P.grad` is inf or
NaN (loss_scale.not_finite: the gradients of parameters of one shape that one forward node reads,
a norm's scale and bias, are summed elementwise in the kernel that makes them and reduced once:
`read_together`); the optimizer reads `Where(skipped, 0, P.grad)` instead of `P.grad` (a skipped step's
gradient is no number to use; the graph is sorted again); every state output `X.new` becomes
`Where(skipped, X, X.new)` (parameters, optimizer
state, the step count, BatchNorm statistics); the scale halves on a skipped step and doubles
after GROWTH_INTERVAL finite ones (state `loss_scale.good_steps`); the metrics `skipped` and
`scale` (the loss scale this step's backward used) are reported beside the loss.
This is the step graph's meaning (train-graph, onnxruntime); lowering hands the gates to the runtimes
(commit_if_finite), so that each update still joins its gradient's kernel.
Preconditions: the optimizer's updates (`updates`). Without `loss_scale` nothing changes
(`modified` false). In place.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter
from fblc.compiler.keys import Role
from fblc.compiler.loss_scale import GOOD_STEPS, SCALE, SKIPPED, next_scale, not_finite
from fblc.passes.contracts import ContractPass
from fblc.passes.optimizer_step import name_output

SCALE_METRIC = "scale"


def read_together(graph: ir.Graph, grads: list[ir.Value]) -> list[list[ir.Value]]:
    """Gradients the finite check sums elementwise before it reduces them (loss_scale.not_finite): those of
    parameters of one shape that one forward node reads (BatchNorm's or LayerNorm's scale and bias), whose
    gradients sibling reductions make in one kernel. Each parameter in one list at most."""
    parameter_of = {g.name[: -len(".grad")]: g for g in grads if g.name.endswith(".grad")}
    inputs = {v.name: v for v in graph.inputs if v.name in parameter_of}
    together, taken = [], set()
    for node in graph:
        if node.metadata_props.get(keys.STAGE, "forward") != "forward":
            continue
        by_shape: dict[tuple, list[ir.Value]] = {}
        for value in node.inputs:
            if value is not None and value.name in inputs and value.name not in taken and value.shape is not None:
                by_shape.setdefault(tuple(value.shape), []).append(value)
        for group in by_shape.values():
            names = list(dict.fromkeys(v.name for v in group))
            if len(names) > 1:
                taken.update(names)
                together.append([parameter_of[name] for name in names])
    return together


class SkipNonfinite(ContractPass):
    """Gate every state update on finite gradients and update the loss scale (in place)."""

    name = "skip_nonfinite"
    requires_facts = ("updates",)
    ensures_facts = ("updates",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        inputs = {v.name: v for v in graph.inputs}
        scale = inputs.get(SCALE)
        if scale is None:
            return ir.passes.PassResult(model, False)
        e = Emitter(graph, stage="optimizer")
        grads = [v for v in graph.outputs if keys.get_role(v) == Role.GRAD.value]
        optimizer_uses = {id(g): [u for u in g.uses() if u.node.metadata_props.get(keys.STAGE) == "optimizer"]
                          for g in grads}
        skipped = not_finite(e, grads, read_together(graph, grads))
        for grad in grads:
            held = e.op("Where", skipped, e.scalar(0.0, grad), grad)
            for node, index in optimizer_uses[id(grad)]:
                node.replace_input_with(index, held)
        outputs = list(graph.outputs)
        for index, new in enumerate(outputs):
            state = inputs.get(new.name[: -len(".new")]) if new.name.endswith(".new") else None
            if state is None:
                continue
            role = keys.get_role(new) or Role.OPT_STATE.value
            new.name = f"{state.name}.proposed"  # the update a finite step makes
            outputs[index] = name_output(e, e.op("Where", skipped, state, new), f"{state.name}.new", Role(role))
        new_scale, good, new_good = next_scale(e, graph, scale, skipped)
        metrics = [name_output(e, e.op("Cast", skipped, to=ir.DataType.FLOAT), SKIPPED, Role.METRIC),
                   name_output(e, scale, SCALE_METRIC, Role.METRIC)]
        first_state = next(i for i, v in enumerate(outputs) if keys.get_role(v) != Role.METRIC.value and i > 0)
        outputs[first_state:first_state] = metrics
        outputs += [name_output(e, new_scale, f"{SCALE}.new", Role.OPT_STATE),
                    name_output(e, new_good, f"{GOOD_STEPS}.new", Role.OPT_STATE)]
        graph.outputs.clear()
        graph.outputs.extend(outputs)
        graph.sort()  # the optimizer now reads the check, emitted after it
        return ir.passes.PassResult(model, True)
