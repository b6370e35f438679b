"""Reverse-mode autodiff over ONNX graphs: one registry of gradient rules, keyed by op type.

A rule receives the emitter, the forward node, the gradient of each output (None where no
gradient flows) and which inputs need a gradient; it appends ONNX ops and returns one
gradient (or None) per input. Rules read only the forward tensors they need; that set is
what later stages see as saved state.

The nodes that need a rule are those on a float path from a trainable parameter to the loss
(`gradient_gaps` finds them before any rule runs); the backward reports every op without a
rule, and every node a rule refuses, in one error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import onnx_ir as ir

from fblc.compiler import keys
from fblc.errors import FblcError, UnsupportedOpError
from fblc.compiler.gaps import OpGap, mark_refusal, op_label
from fblc.compiler.graph import Emitter, is_float
from fblc.compiler.registry import OpRegistry

GradRule = Callable[[Emitter, ir.Node, Sequence["ir.Value | None"], Sequence[bool]], Sequence["ir.Value | None"]]

def _load_rules() -> None:
    from fblc.compiler import gradients  # noqa: F401  (registers the rules on import)


GRADIENTS: OpRegistry[GradRule] = OpRegistry(
    "gradient rule", "freeze the parameters that reach it with --freeze, or use a model built from supported ops",
    loader=_load_rules)
register_gradient = GRADIENTS.register
supported_ops = GRADIENTS.supported
gradient_rule = GRADIENTS.lookup


@dataclass
class BackwardResult:
    grads: dict[str, ir.Value]  # parameter name -> gradient value
    saved: list[ir.Value]  # forward values the backward reads


def differentiable_nodes(graph: ir.Graph, loss: ir.Value, params: Sequence[ir.Value]) -> list[ir.Node]:
    """Nodes on a float path from some parameter to the loss, in topological order."""
    from_params: set[int] = {id(p) for p in params}
    reaches_params: set[int] = set()
    for node in graph:
        if any(v is not None and id(v) in from_params for v in node.inputs):
            reaches_params.add(id(node))
            from_params.update(id(o) for o in node.outputs if is_float(o))
    to_loss: set[int] = {id(loss)}
    on_path: list[ir.Node] = []
    for node in reversed(list(graph)):
        if id(node) in reaches_params and any(id(o) in to_loss for o in node.outputs):
            on_path.append(node)
            to_loss.update(id(v) for v in node.inputs if v is not None and is_float(v))
    on_path.reverse()
    return on_path


def params_reaching(graph: ir.Graph, loss: ir.Value, params: Sequence[ir.Value]) -> list[ir.Value]:
    """The parameters through which the loss depends on them."""
    nodes = differentiable_nodes(graph, loss, params)
    read = {id(v) for node in nodes for v in node.inputs if v is not None}
    return [p for p in params if id(p) in read or p is loss]


def gradient_gaps(graph: ir.Graph, loss: ir.Value, params: Sequence[ir.Value]) -> list[OpGap]:
    """The ops without a gradient rule among the nodes the backward of `loss` runs through.

    Only nodes between a parameter and the loss need a rule: a frozen front, or a branch the loss
    does not read, has none in the backward and must not be reported.
    """
    return GRADIENTS.missing(differentiable_nodes(graph, loss, params))


def build_backward(graph: ir.Graph, loss: ir.Value, params: Sequence[ir.Value],
                   seed: ir.Value | None = None) -> BackwardResult:
    """Append the backward of `loss` with respect to `params`; return each parameter's gradient
    (of `seed` * loss with a `seed`, the loss scale of mixed precision).

    Raises one UnsupportedOpError naming every op on the path without a rule and every node a
    rule refuses; the rules run on past a refusal only to find the others (the graph is then
    left half-built, and the caller discards it with the error).
    """
    nodes = differentiable_nodes(graph, loss, params)
    gaps = GRADIENTS.missing(nodes)
    refusals: list[FblcError] = []
    forward_ids = {id(n) for n in graph}
    emitter = Emitter(graph, stage="backward")
    contributions: dict[int, list[ir.Value]] = {id(loss): [seed if seed is not None else emitter.const(1.0, dtype=loss.dtype)]}
    needs_grad: set[int] = {id(p) for p in params}
    for node in nodes:
        needs_grad.update(id(o) for o in node.outputs)

    def total(value: ir.Value) -> ir.Value | None:
        parts = contributions.get(id(value))
        if not parts:
            return None
        if len(parts) > 1:
            emitter.prefix = f"grad/{value.name}"
            parts[:] = [emitter.op("Sum", *parts)]
        return parts[0]

    for node in reversed(nodes):
        output_grads = [total(o) for o in node.outputs]
        if all(g is None for g in output_grads):
            continue
        wanted = [v is not None and is_float(v) and id(v) in needs_grad for v in node.inputs]
        emitter.prefix = f"grad/{node.name}"
        input_grads: Sequence[ir.Value | None] = [None] * len(node.inputs)
        failed = not GRADIENTS.has(node)  # then it is in `gaps`
        if not failed:
            emitter.origin = node.name
            try:
                input_grads = gradient_rule(node)(emitter, node, output_grads, wanted)
            except UnsupportedOpError as refusal:  # e.g. an attribute the rule does not handle
                refusals.append(mark_refusal(refusal, node))
                failed = True
            finally:
                emitter.origin = None
        for index, (value, grad, want) in enumerate(zip(node.inputs, input_grads, wanted)):
            if not want:
                continue
            if grad is None:
                if not failed:  # a silent zero would train a parameter wrongly: say so instead
                    refusals.append(UnsupportedOpError(
                        f"op {node.op_type} (node '{node.name}') has no gradient for its input {index} "
                        f"('{value.name}'), which a trainable parameter feeds",
                        f"freeze what reaches '{value.name}' with --freeze", ops=[op_label(node)]))
                # the step fails, but a stand-in lets the rules before this node run and report too
                grad = emitter.zeros(list(value.shape), like=value)
            contributions.setdefault(id(value), []).append(grad)
    if gaps or refusals:
        raise GRADIENTS.error(gaps, refusals)

    grads: dict[str, ir.Value] = {}
    for param in params:
        grad = total(param)
        if grad is None:
            grad = emitter.zeros(list(param.shape), like=param)
        grads[param.name] = grad
    backward_nodes = [n for n in graph if id(n) not in forward_ids]
    saved_ids: dict[int, ir.Value] = {}
    for node in backward_nodes:
        for value in node.inputs:
            if value is None or id(value) in saved_ids:
                continue
            producer = value.producer()
            if (producer is not None and id(producer) in forward_ids) or value.is_graph_input():
                saved_ids[id(value)] = value
    for value in saved_ids.values():
        if keys.get_role(value) is None:
            keys.set_role(value, keys.Role.SAVED)
    return BackwardResult(grads=grads, saved=list(saved_ids.values()))
