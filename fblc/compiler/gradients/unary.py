"""The one way to write the gradient of a one-input, one-output op: its local derivative.

    @unary("Atan")
    def _atan(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
        return e.op("Reciprocal", e.op("Add", e.scalar(1.0, x), e.op("Mul", x, x)))

registers the rule dx = dy * local(x, y) (elementwise of x's shape; `node` gives the attributes,
y the forward output where it spares recomputing). Rules that need more (several inputs, a
masked or zero gradient) register with autodiff.register_gradient directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx_ir as ir

from fblc.compiler.autodiff import GradRule, register_gradient
from fblc.compiler.graph import Emitter

Grads = Sequence["ir.Value | None"]
#: (emitter, node, x, y) -> dy/dx, elementwise of x's shape
LocalDerivative = Callable[[Emitter, ir.Node, ir.Value, ir.Value], ir.Value]

#: op -> its local derivative (every rule registered through `unary`)
UNARY: dict[str, LocalDerivative] = {}


def _rule(op_type: str, local: LocalDerivative) -> GradRule:
    def rule(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
        return [e.op("Mul", dys[0], local(e, node, node.inputs[0], node.outputs[0]))]

    rule.__name__ = f"{op_type.lower()}_grad"
    rule.__doc__ = f"dx = dy * d{op_type}/dx. " + (local.__doc__ or "")
    return rule


def unary(*op_types: str) -> Callable[[LocalDerivative], LocalDerivative]:
    """Decorator: `local` is the derivative of `op_types`; registers their gradient rules."""

    def decorate(local: LocalDerivative) -> LocalDerivative:
        for op_type in op_types:
            register_gradient(op_type)(_rule(op_type, local))
            UNARY[op_type] = local
        return local

    return decorate
