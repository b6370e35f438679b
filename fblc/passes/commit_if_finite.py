"""commit_if_finite: the runtime, not a Where per state, drops a skipped step's updates.

Rewrite (when skip_nonfinite gated the step: a metric output `skipped`, the Cast of the step's
non-finite flag F): every state output `X.new` = Where(F, X, X.proposed) becomes X.proposed itself,
named `X.new` and marked `fblc.commit` = "finite"; every gradient the optimizer read as
Where(F, 0, P.grad) is read directly. The runtimes swap a marked state with its `.new` texture only
after a step whose `skipped` reads 0 (plan.json `swaps_if_finite`); the other states (the loss scale
and its good-step count, which are no such Where) swap after every step, as before.

Why: the gates made every parameter's update wait for the finite check over all gradients, so no
update could join the kernel that sums its gradient (fuse): under --dtype fp16 a launch per
parameter more (MobileNetV2 B=8 adreno830: 159 Where launches). Without them the updates fuse as in
fp32, and the proposed updates of a skipped step (computed from non-finite gradients) lie in `.new`
textures that are never swapped in, so the step leaves every marked state as it was.

Same results: on a finite step Where(F, X, X.proposed) is X.proposed and Where(F, 0, g) is g; on a
skipped one the runtime keeps X, which is what the Where gave. The step graph (`fblc train-graph`,
onnxruntime) keeps its Wheres: this runs only in lowering.
Preconditions: the step graph after skip_nonfinite. Without a `skipped` metric nothing changes
(`modified` false). In place.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.compiler.loss_scale import SKIPPED
from fblc.passes.contracts import ContractPass

#: value metadata on a `.new` output: the runtimes swap it in only after a finite step
FINITE = "finite"


def _is_gate(node: ir.Node | None, flag: ir.Value) -> bool:
    return node is not None and node.op_type == "Where" and node.inputs[0] is flag


def _drop_if_dead(graph: ir.Graph, gate: ir.Node) -> None:
    """Remove `gate` once nothing reads it, and the constant 0 it read once nothing else does."""
    if gate.outputs[0].uses() or gate.outputs[0].is_graph_output():
        return
    inputs = list(gate.inputs)
    graph.remove(gate, safe=True)
    for value in inputs:
        if (value is not None and value.name in graph.initializers and not value.uses()
                and not value.is_graph_input()):
            del graph.initializers[value.name]


class CommitIfFinite(ContractPass):
    """Replace skip_nonfinite's Wheres by states committed only after a finite step (in place)."""

    name = "commit_if_finite"
    requires_facts = ("updates",)
    ensures_facts = ("updates",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        metric = next((v for v in graph.outputs if v.name == SKIPPED), None)
        producer = metric.producer() if metric is not None else None
        if producer is None or producer.op_type != "Cast":
            return ir.passes.PassResult(model, False)
        flag = producer.inputs[0]
        inputs = {v.name: v for v in graph.inputs}
        gates = []
        outputs = list(graph.outputs)
        for index, new in enumerate(outputs):
            state = inputs.get(new.name[: -len(".new")]) if new.name.endswith(".new") else None
            gate = new.producer()
            if state is None or not _is_gate(gate, flag) or gate.inputs[1] is not state:
                continue
            proposed = gate.inputs[2]
            if proposed.is_graph_input() or proposed.is_graph_output():
                continue  # a state the step passes through: the gate's output is the only name it can take
            name, role = new.name, keys.get_role(new) or Role.OPT_STATE.value
            new.name = f"{name}/gated"
            proposed.name = name
            keys.set_role(proposed, Role(role))
            proposed.metadata_props[keys.COMMIT] = FINITE
            outputs[index] = proposed
            gates.append(gate)
        for node in list(graph):
            if (_is_gate(node, flag) and _zero(node.inputs[1]) and node.inputs[2] is not None
                    and keys.get_role(node.inputs[2]) == Role.GRAD.value and not node.outputs[0].is_graph_output()):
                node.outputs[0].replace_all_uses_with(node.inputs[2])
                gates.append(node)
        if not gates:
            return ir.passes.PassResult(model, False)
        graph.outputs.clear()
        graph.outputs.extend(outputs)
        for gate in gates:
            _drop_if_dead(graph, gate)
        return ir.passes.PassResult(model, True)


def _zero(value: ir.Value | None) -> bool:
    """Whether `value` is the scalar constant 0 (the gradient gate's first branch)."""
    if value is None or value.const_value is None or value.is_graph_input():
        return False
    array = value.const_value.numpy()
    return array.size == 1 and float(array.reshape(-1)[0]) == 0.0
