"""sg_replay: MemFLoRA-SG's projection-gradient recovery and the update of P.

Rewrite, after optimizer_step: the forward is replayed without saving: the forward nodes
that the site inputs x depend on are cloned (stage `replay`, reading the same parameters as
the first forward, so before their update) and, as soon as a site's x is recomputed, its
projection gradient is formed and x can go:

    dP[r, c] = sum over batch and positions of dL/dq[b, r, t] * x[b, c, t]

(MatMul of x [b, C, T] with dq^T [b, T, r], summed over b, transposed: [r, C, 1, ...]). The
dL/dq come from sg_gradients. Every P becomes a trainable graph input updated by its own Adam
(lr 1e-3, betas 0.9/0.999, eps 1e-8, no weight decay, its own step count `sg.step`), as
MemFLoRA's public code does; outputs `P.grad`, `P.new`, then the new Adam state and
`sg.step.new`, after the outputs of optimizer_step.
Preconditions: sg_gradients and optimizer_step ran. In place; `modified` is false when the
graph has no dL/dq (not memflora-sg).
"""

from __future__ import annotations


import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, clone_node, static_shape
from fblc.compiler.keys import Role
from fblc.compiler.optimizers import OPTIMIZERS, OptimizerConfig, StateTensor
from fblc.passes.optimizer_step import name_output, state_input
from fblc.passes.contracts import ContractPass

SG_STEP = "sg.step"


def projection_optimizer(lr: float = 1e-3) -> OptimizerConfig:
    return OptimizerConfig(name="adam", lr=lr, weight_decay=0.0)


def _is_forward(node: ir.Node) -> bool:
    return node.metadata_props.get(keys.STAGE, "forward") == "forward"


class SgReplay(ContractPass):
    """Replay the forward, form dP per site, update P with its own Adam (in place)."""

    name = "sg_replay"
    requires_facts = ("updates",)
    ensures_facts = ("updates", "static shapes")

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.config = projection_optimizer(lr)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        values = {v.name: v for n in graph for v in n.outputs if v is not None and v.name}
        dqs = [v for v in values.values() if keys.ADAPTER_SITE_DQ in v.metadata_props]
        if not dqs:
            return ir.passes.PassResult(model, False)
        sites = {s["conv"]: s for s in keys.json_of(model.metadata_props, keys.ADAPTER)["sites"]}
        # per site input x (a forward value): the (dq, q) pairs that contract with it
        wanted: dict[int, list[tuple[ir.Value, ir.Value]]] = {}
        x_values: dict[int, ir.Value] = {}
        for dq in dqs:
            q = values[dq.metadata_props[keys.ADAPTER_SITE_DQ]]
            producer = q.producer()
            assert producer is not None and producer.op_type == "Conv"
            x = producer.inputs[0]
            wanted.setdefault(id(x), []).append((dq, q))
            x_values[id(x)] = x
        needed = self._ancestors(graph, list(x_values.values()))
        e = Emitter(graph, stage="replay")
        mapping: dict[int, ir.Value] = {}
        partial: dict[str, list[ir.Value]] = {}  # P name -> dP of each chunk

        def contract(x_id: int, replayed: ir.Value) -> None:
            convs = {q.metadata_props[keys.ADAPTER_SITE_Q] for _, q in wanted[x_id]}
            replayed.metadata_props[keys.ADAPTER_REPLAY] = ",".join(sorted(convs))
            for dq, q in wanted[x_id]:
                site = sites[q.metadata_props[keys.ADAPTER_SITE_Q]]
                partial.setdefault(site["P"], []).append(self._projection_grad(e, replayed, dq))

        for x_id, x in x_values.items():
            if x.producer() is None:  # a graph input: nothing to recompute
                contract(x_id, x)
        for node in graph:
            if id(node) not in needed:
                continue
            clone = clone_node(e, node, mapping, stage="replay")
            for old, new in zip(node.outputs, clone.outputs):
                if id(old) in wanted:
                    contract(id(old), new)
        self._update_projections(e, graph, partial)
        return ir.passes.PassResult(model, True)

    @staticmethod
    def _ancestors(graph: ir.Graph, targets: list[ir.Value]) -> set[int]:
        """Forward nodes that the targets depend on."""
        needed: set[int] = set()
        stack = [v.producer() for v in targets]
        while stack:
            node = stack.pop()
            if node is None or id(node) in needed or not _is_forward(node):
                continue
            needed.add(id(node))
            stack.extend(v.producer() for v in node.inputs if v is not None)
        return needed

    @staticmethod
    def _projection_grad(e: Emitter, x: ir.Value, dq: ir.Value) -> ir.Value:
        """dP [r, C, 1...] = sum over batch and positions of dq x^T."""
        x_shape, dq_shape = static_shape(x), static_shape(dq)
        batch, channels, rank = x_shape[0], x_shape[1], dq_shape[1]
        positions = int(np.prod(x_shape[2:], dtype=np.int64))
        flat_x = e.reshape(x, [batch, channels, positions])
        dq_t = e.op("Transpose", e.reshape(dq, [batch, rank, positions]), perm=[0, 2, 1])
        per_sample = e.op("MatMul", flat_x, dq_t)  # [b, C, r]
        summed = e.reduce_sum(per_sample, [0], keepdims=False)  # [C, r]
        return e.reshape(e.op("Transpose", summed, perm=[1, 0]), [rank, channels] + [1] * (len(x_shape) - 2))

    def _update_projections(self, e: Emitter, graph: ir.Graph, partial: dict[str, list[ir.Value]]) -> None:
        spec = OPTIMIZERS["adam"]
        e.prefix = "sg_optimizer"  # unique names; the stage tag is set on the new nodes at the end
        first_new = len(graph)
        step = StateTensor(SG_STEP, lambda: np.zeros((), np.float32), (), np.dtype(np.float32))
        outputs: list[ir.Value] = []
        states: list[StateTensor] = []
        projections = []
        for name, parts in partial.items():
            p = graph.initializers[name]
            keys.set_role(p, Role.PARAM)
            graph.inputs.append(p)
            grad = parts[0] if len(parts) == 1 else e.op("Sum", *parts)
            projections.append((p, grad))
        for p, _ in projections:
            p_states = spec.per_param_state(self.config, p.name, static_shape(p), np.dtype(np.float32))
            for state in p_states:
                state_input(graph, state)
            states.append(p_states)  # type: ignore[arg-type]
        state_input(graph, step)
        shared = spec.shared_update(e, self.config, [step])
        for (p, grad), p_states in zip(projections, states):
            new = spec.update(e, self.config, p, grad, p_states, shared)  # type: ignore[arg-type]
            outputs += [name_output(e, grad, f"{p.name}.grad", Role.GRAD), name_output(e, new, f"{p.name}.new", Role.PARAM)]
        for p_states in states:
            for state in p_states:  # type: ignore[attr-defined]
                assert state.new is not None
                outputs.append(name_output(e, state.new, f"{state.name}.new", Role.OPT_STATE))
        assert step.new is not None
        outputs.append(name_output(e, step.new, f"{SG_STEP}.new", Role.OPT_STATE))
        graph.outputs.extend(outputs)
        for node in list(graph)[first_new:]:
            node.metadata_props[keys.STAGE] = "optimizer"
