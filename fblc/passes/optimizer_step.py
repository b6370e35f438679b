"""optimizer_step: append the optimizer update of every parameter, in the graph.

Rewrite: for each parameter P with output `P.grad`, adds its state tensors (graph inputs
with role `opt_state`, zero-initialised initializers of the same name) and the update from
`fblc.compiler.optimizers`; outputs become `loss`, the `metric` outputs of earlier passes (ES's rewards), then `P.grad`, `P.new` per parameter,
then `S.new` per state tensor (optimizer state, then state outputs of earlier passes such
as BatchNorm running statistics under --bn-train), so feeding the `.new` values back runs the next step.
Preconditions: build_gradients ran. In place.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, static_shape
from fblc.compiler.keys import Role
from fblc.compiler.optimizers import OptimizerConfig, StateTensor, optimizer_spec
from fblc.passes.build_gradients import trainable_params
from fblc.passes.contracts import ContractPass


def state_input(graph: ir.Graph, state: StateTensor) -> ir.Value:
    """`state` as a graph input with role `opt_state` and a lazy zero initializer of the same name."""
    dtype = ir.DataType.from_numpy(state.dtype)
    shape = ir.Shape(list(state.shape))
    # Lazy: a 1B-parameter model's Adam state is 8 GB of zeros, made only if the step is saved.
    initial = ir.LazyTensor(lambda: ir.tensor(state.initial(), name=state.name), dtype=dtype, shape=shape,
                            name=state.name)
    value = ir.Value(name=state.name, shape=shape, type=ir.TensorType(dtype), const_value=initial)
    keys.set_role(value, Role.OPT_STATE)
    graph.inputs.append(value)
    graph.register_initializer(value)
    state.value = value
    return value


def name_output(e: Emitter, value: ir.Value, name: str, role: Role) -> ir.Value:
    """`value` under the interface name `name`; through an Identity when renaming it would break another name."""
    if (value.producer() is None or value.name.endswith((".new", ".grad")) or value.is_graph_input()
            or value.is_graph_output()):
        value = e.op("Identity", value)
    value.name = name
    keys.set_role(value, role)
    return value


class OptimizerStep(ContractPass):
    """Append SGD/Adam/AdamW updates and the step graph's outputs (in place)."""

    name = "optimizer_step"
    requires_facts = ("loss", "gradients")
    ensures_facts = ("updates", "static shapes")

    def __init__(self, config: OptimizerConfig) -> None:
        super().__init__()
        self.config = config
        self.spec = optimizer_spec(config.name)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        loss = graph.outputs[0]
        grads = {v.name[: -len(".grad")]: v for v in graph.outputs if v.name.endswith(".grad")}
        e = Emitter(graph, stage="optimizer")
        shared_states = self.spec.shared_state()
        for state in shared_states:
            state_input(graph, state)
        shared = self.spec.shared_update(e, self.config, shared_states)
        carried = [v for v in graph.outputs if keys.get_role(v) == Role.OPT_STATE.value]
        outputs: list[ir.Value] = [loss, *(v for v in graph.outputs if keys.get_role(v) == Role.METRIC.value)]
        states: list[StateTensor] = []
        for param in trainable_params(graph):
            grad = grads[param.name]
            param_states = self.spec.per_param_state(self.config, param.name, static_shape(param),
                                                     ir.DataType(param.dtype).numpy())
            for state in param_states:
                state_input(graph, state)
            new_param = self.spec.update(e, self.config, param, grad, param_states, shared)
            outputs += [grad, name_output(e, new_param, f"{param.name}.new", Role.PARAM)]
            states += param_states
        for state in states + shared_states:
            assert state.new is not None, f"optimizer left state {state.name} without an update"
            outputs.append(name_output(e, state.new, f"{state.name}.new", Role.OPT_STATE))
        outputs += carried
        outputs += [v for v in graph.outputs if keys.get_role(v) == Role.CARRIED.value]  # a loop's (es_loop)
        for state in shared_states:  # inputs in the order of the outputs: shared state after per-parameter state
            assert state.value is not None
            graph.inputs.remove(state.value)
            graph.inputs.append(state.value)
        carried_inputs = [v for v in graph.inputs if keys.get_role(v) == Role.OPT_STATE.value
                          and v.name + ".new" in {o.name for o in carried}]
        for value in carried_inputs:  # state of earlier passes (BatchNorm running statistics) goes last
            graph.inputs.remove(value)
            graph.inputs.append(value)
        graph.outputs.clear()
        graph.outputs.extend(outputs)
        return ir.passes.PassResult(model, True)
