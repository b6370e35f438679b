"""Gradient rules of activations (LeakyRelu, PRelu, the ELU family, Softplus, Mish, Softsign, Gelu,
ThresholdedRelu) and of Abs and the variadic Max, Min and Sum.

Every rule follows torch 2.13's backward at the kinks and ties, so a model trained in torch and
here takes the same steps (tests/test_gradient_activations.py checks each against float64
autograd, on and off the kinks):

- slopes of piecewise activations at their kink are torch's: LeakyRelu and PRelu take the
  negative slope at 0, Elu, Selu and Celu the left piece's (alpha, gamma alpha, 1), ThresholdedRelu 0
  at x = alpha, Abs 0 at 0 (torch's sgn);
- Max and Min split the gradient evenly between the inputs equal to the result: half each for two,
  as torch.maximum / torch.minimum; 1/k each for k tied inputs of more, as torch.amax / torch.amin
  over the inputs stacked (broadcast) along a new axis.

The unary rules read the forward output where it spares a transcendental: the ELU family's left
slope is y plus a constant (so no Exp that could overflow on the right piece).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import onnx_ir as ir

from fblc.compiler.autodiff import register_gradient
from fblc.compiler.gradients.unary import unary
from fblc.compiler.graph import Emitter, attr, static_shape
from fblc.compiler.values import choice_attr
from fblc.errors import UnsupportedOpError

Grads = Sequence["ir.Value | None"]

SELU_ALPHA = 1.67326319217681884765625  # the ONNX defaults: torch's constants rounded to float32
SELU_GAMMA = 1.05070102214813232421875
GELU_KAPPA = 0.044715
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _to_input(e: Emitter, node: ir.Node, index: int, grad: ir.Value) -> ir.Value:
    """Reduce a gradient of the output's shape to input `index`'s (broadcast) shape."""
    return e.unbroadcast(grad, static_shape(node.outputs[0]), static_shape(node.inputs[index]))


def _float(node: ir.Node, name: str, default: float) -> float:
    return float(attr(node, name, default))


def _left_piece(e: Emitter, x: ir.Value, left: ir.Value, right: float) -> ir.Value:
    """`left` where x <= 0 (the kink takes the left piece, as torch's elu_backward), else `right`."""
    return e.op("Where", e.op("LessOrEqual", x, e.scalar(0.0, x)), left, e.scalar(right, x))


@unary("LeakyRelu")
def _leaky_relu(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    """1 for x > 0, alpha from 0 down (torch's leaky_relu_backward: `x > 0 ? dy : dy * alpha`)."""
    alpha = _float(node, "alpha", 0.01)
    return e.op("Where", e.op("Greater", x, e.scalar(0.0, x)), e.scalar(1.0, x), e.scalar(alpha, x))


@unary("Elu")
def _elu(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    """alpha exp(x) = y + alpha for x <= 0, 1 above."""
    return _left_piece(e, x, e.op("Add", y, e.scalar(_float(node, "alpha", 1.0), y)), 1.0)


@unary("Selu")
def _selu(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    """gamma alpha exp(x) = y + gamma alpha for x <= 0, gamma above."""
    alpha, gamma = _float(node, "alpha", SELU_ALPHA), _float(node, "gamma", SELU_GAMMA)
    return _left_piece(e, x, e.op("Add", y, e.scalar(gamma * alpha, y)), gamma)


@unary("Celu")
def _celu(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    """exp(x / alpha) = y / alpha + 1 for x <= 0, 1 above (continuous: 1 at the kink)."""
    alpha = _float(node, "alpha", 1.0)
    if alpha == 0.0:
        raise UnsupportedOpError(f"Celu with alpha 0 (node '{node.name}') is undefined (it divides by alpha)",
                                 "use an alpha other than 0", ops=["Celu"])
    scaled = e.op("Add", e.op("Mul", y, e.scalar(1.0 / alpha, y)), e.scalar(1.0, y))
    return _left_piece(e, x, scaled, 1.0)


@unary("ThresholdedRelu")
def _thresholded_relu(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    """1 strictly above alpha, 0 from alpha down (torch's threshold_backward: `x <= t ? 0 : dy`)."""
    alpha = _float(node, "alpha", 1.0)
    return e.op("Where", e.op("Greater", x, e.scalar(alpha, x)), e.scalar(1.0, x), e.scalar(0.0, x))


@unary("Softplus")
def _softplus(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    """sigmoid(x), finite for any x. torch's F.softplus (beta 1, threshold 20) takes slope 1 above 20,
    where sigmoid is within 2.1e-9 of 1 and rounds to it in float32: the same values."""
    return e.op("Sigmoid", x)


@unary("Mish")
def _mish(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    """t + x sigmoid(x) (1 - t^2), t = tanh(softplus(x)): torch's mish_backward; finite at x = +-100
    (t is 1 or 0 there, and the second term 0)."""
    t = e.op("Tanh", e.op("Softplus", x))
    sech2 = e.op("Sub", e.scalar(1.0, x), e.op("Mul", t, t))
    return e.op("Add", t, e.op("Mul", e.op("Mul", x, e.op("Sigmoid", x)), sech2))


@unary("Softsign")
def _softsign(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    """1 / (1 + |x|)^2 (1 at 0, as torch's autograd through x / (1 + |x|))."""
    denominator = e.op("Add", e.scalar(1.0, x), e.op("Abs", x))
    return e.op("Reciprocal", e.op("Mul", denominator, denominator))


def _gelu_exact(e: Emitter, x: ir.Value) -> ir.Value:
    """Phi(x) + x phi(x): 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)."""
    cdf = e.op("Mul", e.scalar(0.5, x),
               e.op("Add", e.scalar(1.0, x), e.op("Erf", e.op("Mul", x, e.scalar(math.sqrt(0.5), x)))))
    pdf = e.op("Mul", e.op("Exp", e.op("Mul", e.op("Mul", x, x), e.scalar(-0.5, x))),
               e.scalar(1.0 / math.sqrt(2.0 * math.pi), x))
    return e.op("Add", cdf, e.op("Mul", x, pdf))


def _gelu_tanh(e: Emitter, x: ir.Value) -> ir.Value:
    """torch's gelu_backward for approximate='tanh': with u = sqrt(2/pi) (x + k x^3) and t = tanh(u),
    0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 k x^2)."""
    square = e.op("Mul", x, x)
    inner = e.op("Mul", e.scalar(SQRT_2_OVER_PI, x),
                 e.op("Add", x, e.op("Mul", e.scalar(GELU_KAPPA, x), e.op("Mul", square, x))))
    t = e.op("Tanh", inner)
    left = e.op("Mul", e.scalar(0.5, x), e.op("Add", e.scalar(1.0, x), t))
    inner_slope = e.op("Mul", e.scalar(SQRT_2_OVER_PI, x),
                       e.op("Add", e.scalar(1.0, x), e.op("Mul", e.scalar(3.0 * GELU_KAPPA, x), square)))
    sech2 = e.op("Sub", e.scalar(1.0, x), e.op("Mul", t, t))
    right = e.op("Mul", e.op("Mul", e.op("Mul", e.scalar(0.5, x), x), sech2), inner_slope)
    return e.op("Add", left, right)


GELU_FORMS: dict[str, Callable[[Emitter, ir.Value], ir.Value]] = {"none": _gelu_exact, "tanh": _gelu_tanh}


@unary("Gelu")
def _gelu(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    return GELU_FORMS[choice_attr(node, "approximate", "none", GELU_FORMS, "gradient rule")](e, x)


@unary("Abs")
def _abs(e: Emitter, node: ir.Node, x: ir.Value, y: ir.Value) -> ir.Value:
    """sign(x): 0 at 0, as torch's abs backward (sgn)."""
    return e.op("Sign", x)


@register_gradient("PRelu")
def prelu_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """y = x for x > 0, slope * x from 0 down (slope broadcast to x, e.g. [C, 1, 1] per channel).

    As torch's prelu backward: dx = dy where x > 0, else dy * slope (so the slope at 0); dslope
    = dy * x where x <= 0, summed over the axes the slope was broadcast along (unbroadcast).
    """
    x, slope = node.inputs
    dy = dys[0]
    positive = e.op("Greater", x, e.scalar(0.0, x))
    dx = e.op("Where", positive, dy, e.op("Mul", dy, slope)) if need[0] else None
    dslope = None
    if need[1]:
        dslope = _to_input(e, node, 1, e.op("Where", positive, e.scalar(0.0, dy), e.op("Mul", dy, x)))
    return [dx, dslope]


def _extremum_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """Each input equal to the result gets dy / (how many are), unbroadcast to its shape.

    Two inputs: torch.maximum / torch.minimum's rule (a tie gives each half). More: the gradient of
    torch.amax / torch.amin over the broadcast inputs stacked on a new axis (ties share evenly).
    """
    y, dy = node.outputs[0], dys[0]
    if len(node.inputs) == 1:
        return [dy if need[0] else None]
    hits = [e.op("Equal", v, y) for v in node.inputs]
    count = e.op("Sum", *(e.op("Cast", hit, to=dy.dtype) for hit in hits))
    share = e.op("Div", dy, count)
    zero = e.scalar(0.0, dy)
    return [_to_input(e, node, i, e.op("Where", hit, share, zero)) if need[i] else None for i, hit in enumerate(hits)]


register_gradient("Max", "Min")(_extremum_grad)


@register_gradient("Floor", "Ceil", "Round", "Sign")
def piecewise_constant_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """Zero: the output is flat between its jumps, and torch's floor, ceil, round and sign backward
    give zeros everywhere (the jumps included), so a parameter read through them trains by its
    other paths only."""
    x = node.inputs[0]
    return [e.zeros(list(static_shape(x)), like=x) if need[0] else None]


@register_gradient("Sum")
def sum_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """dy to every input, summed over the axes numpy broadcasting added to it."""
    return [_to_input(e, node, i, dys[0]) if need[i] else None for i in range(len(node.inputs))]
