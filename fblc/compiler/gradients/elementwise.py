"""Gradient rules of elementwise ops (broadcasting binaries, unary math, activations, selection)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler.autodiff import register_gradient
from fblc.compiler.gradients.unary import unary
from fblc.errors import UnsupportedOpError
from fblc.compiler.graph import Emitter, attr, const_array, static_shape

Grads = Sequence["ir.Value | None"]


def _to_input(e: Emitter, node: ir.Node, index: int, grad: ir.Value) -> ir.Value:
    """Reduce a gradient of the output's shape to input `index`'s (broadcast) shape."""
    return e.unbroadcast(grad, static_shape(node.outputs[0]), static_shape(node.inputs[index]))


@register_gradient("Add")
def add_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    dy = dys[0]
    return [_to_input(e, node, i, dy) if need[i] else None for i in range(2)]


@register_gradient("Sub")
def sub_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    dy = dys[0]
    da = _to_input(e, node, 0, dy) if need[0] else None
    db = _to_input(e, node, 1, e.op("Neg", dy)) if need[1] else None
    return [da, db]


@register_gradient("Mul")
def mul_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    a, b = node.inputs
    dy = dys[0]
    da = _to_input(e, node, 0, e.op("Mul", dy, b)) if need[0] else None
    db = _to_input(e, node, 1, e.op("Mul", dy, a)) if need[1] else None
    return [da, db]


@register_gradient("Div")
def div_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    a, b = node.inputs
    y, dy = node.outputs[0], dys[0]
    da = _to_input(e, node, 0, e.op("Div", dy, b)) if need[0] else None
    db = _to_input(e, node, 1, e.op("Neg", e.op("Div", e.op("Mul", dy, y), b))) if need[1] else None
    return [da, db]


@register_gradient("Pow")
def pow_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    x, p = node.inputs
    y, dy = node.outputs[0], dys[0]
    da = db = None
    if need[0]:
        known = None if p.is_graph_input() else const_array(p)
        if known is not None:  # p - 1 now: a Sub of constants would be a launch of one work-item
            dtype = ir.DataType(x.dtype).numpy()
            exponent, lowered = e.const(known.astype(dtype)), e.const((known - 1).astype(dtype))
        else:
            exponent = p if p.dtype == x.dtype else e.op("Cast", p, to=x.dtype)
            lowered = e.op("Sub", exponent, e.scalar(1.0, x))
        x_pow = e.op("Pow", x, lowered)
        da = _to_input(e, node, 0, e.op("Mul", dy, e.op("Mul", exponent, x_pow)))
    if need[1]:
        db = _to_input(e, node, 1, e.op("Mul", dy, e.op("Mul", y, e.op("Log", x))))
    return [da, db]


@unary("Sqrt")
def _sqrt(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return e.op("Div", e.scalar(0.5, y), y)


@unary("Reciprocal")
def _reciprocal(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return e.op("Neg", e.op("Mul", y, y))


@unary("Exp")
def _exp(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return y


@unary("Log")
def _log(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return e.op("Reciprocal", x)


@unary("Sigmoid")
def _sigmoid(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return e.op("Mul", y, e.op("Sub", e.scalar(1.0, y), y))


@unary("Tanh")
def _tanh(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return e.op("Sub", e.scalar(1.0, y), e.op("Mul", y, y))


@unary("Erf")
def _erf(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return e.op("Mul", e.scalar(2.0 / math.sqrt(math.pi), x), e.op("Exp", e.op("Neg", e.op("Mul", x, x))))


@unary("Sin")
def _sin(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return e.op("Cos", x)


@unary("Cos")
def _cos(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return e.op("Neg", e.op("Sin", x))


@unary("Atan")
def _atan(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return e.op("Reciprocal", e.op("Add", e.scalar(1.0, x), e.op("Mul", x, x)))


@unary("HardSwish")
def _hard_swish(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    """y = x * clip(x / 6 + 1/2, 0, 1): slope 0 up to -3, x / 3 + 1/2 strictly between, 1 from 3 on.

    The kinks take the outer pieces, as torch.nn.functional.hardswish's backward does (torch
    2.13), so a model trained in torch and here takes the same steps.
    """
    middle = e.op("Add", e.op("Mul", x, e.scalar(1.0 / 3.0, x)), e.scalar(0.5, x))
    upper = e.op("Where", e.op("Less", x, e.scalar(3.0, x)), middle, e.scalar(1.0, x))
    return e.op("Where", e.op("LessOrEqual", x, e.scalar(-3.0, x)), e.scalar(0.0, x), upper)


@register_gradient("HardSigmoid")
def hard_sigmoid_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """y = clip(alpha x + beta, 0, 1): slope alpha strictly between the bounds, as torch's hardsigmoid.

    The test is on x against the bounds' preimages, computed here in float64, rather than on
    alpha x + beta, whose float32 rounding can reach 0 or 1 a little inside them.
    """
    x = node.inputs[0]
    alpha, beta = float(attr(node, "alpha", 0.2)), float(attr(node, "beta", 0.5))
    if alpha == 0.0:
        return [e.op("Mul", dys[0], e.scalar(0.0, x))]
    low, high = sorted(((0.0 - beta) / alpha, (1.0 - beta) / alpha))
    inside = e.op("And", e.op("Greater", x, e.scalar(low, x)), e.op("Less", x, e.scalar(high, x)))
    return [e.op("Where", inside, e.op("Mul", dys[0], e.scalar(alpha, x)), e.scalar(0.0, x))]


@register_gradient("Neg")
def neg_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    return [e.op("Neg", dys[0])]


@register_gradient("Identity")
def identity_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    return [dys[0]] + [None] * (len(node.inputs) - 1)


@register_gradient("Dropout")
def dropout_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """Inference Dropout is the identity. In training mode (or a mode known only at run time) the
    forward drops and rescales, so the identity would be a wrong gradient: refuse, as
    eliminate_noops documents."""
    training = node.inputs[2] if len(node.inputs) > 2 else None
    flag = const_array(training) if training is not None else np.array(False)
    if flag is None or bool(flag):
        raise UnsupportedOpError(f"Dropout in training mode (node '{node.name}') has no gradient rule",
                                 "export the model in eval mode, so that Dropout is the identity")
    return identity_grad(e, node, dys, need)


def _masked(e: Emitter, mask: ir.Value, dy: ir.Value) -> ir.Value:
    return e.op("Where", mask, dy, e.scalar(0.0, dy))


@register_gradient("Relu")
def relu_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    y = node.outputs[0]
    return [_masked(e, e.op("Greater", y, e.scalar(0.0, y)), dys[0])]


@register_gradient("Clip")
def clip_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """Gradient passes strictly inside (min, max), as torch's hardtanh/ReLU6 and MemFLoRA's mask.

    A bound that trains (a float initializer) gets the gradient of the elements it clips, as
    torch.clamp with tensor bounds; left at None it would silently read as a zero gradient.
    """
    x = node.inputs[0]
    bounds = [node.inputs[i] if i < len(node.inputs) else None for i in (1, 2)]
    mask = None
    bound_grads: list[ir.Value | None] = [None, None]
    for k, (bound, compare, clipped) in enumerate(zip(bounds, ("Greater", "Less"), ("LessOrEqual", "GreaterOrEqual"))):
        if bound is None:
            continue
        inside = e.op(compare, x, bound)
        mask = inside if mask is None else e.op("And", mask, inside)
        if need[k + 1]:
            bound_grads[k] = _to_input(e, node, k + 1, _masked(e, e.op(clipped, x, bound), dys[0]))
    dx = dys[0] if mask is None else _masked(e, mask, dys[0])
    return [dx, *bound_grads][: len(node.inputs)]


@register_gradient("Where")
def where_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    condition = node.inputs[0]
    dy = dys[0]
    zero = e.scalar(0.0, dy)
    dx = _to_input(e, node, 1, e.op("Where", condition, dy, zero)) if need[1] else None
    dz = _to_input(e, node, 2, e.op("Where", condition, zero, dy)) if need[2] else None
    return [None, dx, dz]


@register_gradient("Cast")
def cast_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    if not need[0]:
        return [None]
    return [e.op("Cast", dys[0], to=node.inputs[0].dtype)]
