"""Gradient rules of reductions and of the softmax family."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler.autodiff import register_gradient
from fblc.compiler.graph import Emitter, attr, ints_input, static_shape

Grads = Sequence["ir.Value | None"]


def reduced_axes(node: ir.Node) -> list[int]:
    """The axes a Reduce* node reduces, normalised to non-negative (axes input or attribute)."""
    rank = len(static_shape(node.inputs[0]))
    axes = ints_input(node, 1, "axes")
    if axes is None:
        axes = attr(node, "axes")
    if not axes:
        return [] if attr(node, "noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a % rank for a in axes)


def _kept_shape(shape: Sequence[int], axes: Sequence[int]) -> list[int]:
    return [1 if i in axes else n for i, n in enumerate(shape)]


def _spread(e: Emitter, node: ir.Node, dy: ir.Value) -> tuple[ir.Value, list[int]]:
    """dy reshaped with the reduced axes kept as size 1, and the reduced axes."""
    axes = reduced_axes(node)
    return e.reshape(dy, _kept_shape(static_shape(node.inputs[0]), axes)), axes


@register_gradient("ReduceSum")
def reduce_sum_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    kept, _ = _spread(e, node, dys[0])
    return [e.op("Expand", kept, e.ints(static_shape(node.inputs[0]))), None]


@register_gradient("ReduceMean")
def reduce_mean_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    kept, axes = _spread(e, node, dys[0])
    shape = static_shape(node.inputs[0])
    count = int(np.prod([shape[a] for a in axes])) if axes else 1
    scaled = e.op("Mul", kept, e.scalar(1.0 / count, kept))
    return [e.op("Expand", scaled, e.ints(shape)), None]


@register_gradient("ReduceMax")
def reduce_max_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """Ties share the gradient equally, as torch.amax does."""
    x = node.inputs[0]
    kept_dy, axes = _spread(e, node, dys[0])
    kept_max = e.reshape(node.outputs[0], _kept_shape(static_shape(x), axes))
    is_max = e.op("Equal", x, kept_max)
    ties = e.reduce_sum(e.op("Cast", is_max, to=x.dtype), axes, keepdims=True)
    share = e.op("Div", kept_dy, ties)
    return [e.op("Where", is_max, share, e.scalar(0.0, x)), None]


@register_gradient("ReduceLogSumExp")
def reduce_log_sum_exp_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """y = log(sum exp x): dx = dy * exp(x - y), the softmax of x over the reduced axes."""
    x = node.inputs[0]
    kept_dy, axes = _spread(e, node, dys[0])
    kept_y = e.reshape(node.outputs[0], _kept_shape(static_shape(x), axes))
    return [e.op("Mul", kept_dy, e.op("Exp", e.op("Sub", x, kept_y))), None]


@register_gradient("ReduceL2")
def reduce_l2_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """y = sqrt(sum x^2): dx = x * dy / y, and 0 where y is 0, as torch's norm backward (its subgradient).

    The divisor is 1 where y is 0, so dy / 0 is never formed, not even in a lane the Where then
    discards (a NaN there would trip NaN checks and any driver that compiles with finite-math).
    With noop_with_empty_axes and no axes, y = |x| and the same formula gives sign(x) dy.
    """
    x = node.inputs[0]
    kept_dy, axes = _spread(e, node, dys[0])
    kept_y = e.reshape(node.outputs[0], _kept_shape(static_shape(x), axes))
    is_zero = e.op("Equal", kept_y, e.scalar(0.0, kept_y))
    safe = e.op("Where", is_zero, e.scalar(1.0, kept_y), kept_y)
    scale = e.op("Where", is_zero, e.scalar(0.0, kept_y), e.op("Div", kept_dy, safe))
    return [e.op("Mul", x, scale), None]


@register_gradient("GlobalAveragePool")
def global_average_pool_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    shape = static_shape(node.inputs[0])
    count = int(np.prod(shape[2:]))
    scaled = e.op("Mul", dys[0], e.scalar(1.0 / count, dys[0]))
    return [e.op("Expand", scaled, e.ints(shape))]


def _softmax_axis(node: ir.Node) -> int:
    return int(attr(node, "axis", -1))


@register_gradient("Softmax")
def softmax_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    y, dy = node.outputs[0], dys[0]
    axis = _softmax_axis(node)
    dot = e.reduce_sum(e.op("Mul", dy, y), [axis], keepdims=True)
    return [e.op("Mul", y, e.op("Sub", dy, dot))]


@register_gradient("LogSoftmax")
def log_softmax_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    y, dy = node.outputs[0], dys[0]
    axis = _softmax_axis(node)
    total = e.reduce_sum(dy, [axis], keepdims=True)
    return [e.op("Sub", dy, e.op("Mul", e.op("Exp", y), total))]
