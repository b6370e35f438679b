"""Elementwise C expressions of activations: LeakyRelu, PRelu, Elu, Selu, Celu, ThresholdedRelu,
Softplus, Mish, Softsign, Gelu (exact and tanh), and Floor and Sign.

They join elementwise.py's table (`expression`), so they fuse into elementwise chains and
contraction epilogues like any other elementwise op (fblc/passes/fuse.py lists them in
ELEMENTWISE); the kernel package imports this module when it loads its emitters.

An operand named twice in an expression is first bound to a temporary (`_once`), so its load or
sub-expression runs once. Softplus is written log1p(exp(-|x|)) + max(x, 0), which neither
overflows nor loses the small values for any x (log(1 + exp(x)) is inf from x = 89 in float32);
Mish uses the same form.
"""

from __future__ import annotations

import math
from typing import Callable

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder, ctype_of
from fblc.codegen.cl import float_literal
from fblc.codegen.kernels.elementwise import Operand, expression
from fblc.compiler.values import attr, choice_attr
from fblc.errors import UnsupportedOpError

SELU_ALPHA = 1.67326319217681884765625  # the ONNX defaults
SELU_GAMMA = 1.05070102214813232421875


def _once(b: KernelBuilder, node: ir.Node, x: Operand, hint: str) -> str:
    """The node's first input as a named float temporary."""
    return b.temp("float", x(node.inputs[0]), hint)


def _alpha(node: ir.Node, default: float) -> str:
    return float_literal(float(attr(node, "alpha", default)))


def softplus_c(value: str) -> str:
    """log(1 + exp(value)) without overflow: `value` must be a name (it is read twice)."""
    return f"(fmax({value}, 0.0f) + log1p(exp(-fabs({value}))))"


Activation = Callable[[ir.Node, str, Operand], str]
#: op -> the C of its activation of `v` (its input as a named temporary, so it can be read twice)
ACTIVATIONS: dict[str, Activation] = {
    "LeakyRelu": lambda node, v, x: f"({v} > 0.0f ? {v} : {_alpha(node, 0.01)} * {v})",
    # the slope is read with broadcasting (per channel for nn.PReLU's [C, 1, 1])
    "PRelu": lambda node, v, x: f"({v} > 0.0f ? {v} : {x(node.inputs[1])} * {v})",
    "Elu": lambda node, v, x: f"({v} > 0.0f ? {v} : {_alpha(node, 1.0)} * expm1({v}))",
    "ThresholdedRelu": lambda node, v, x: f"({v} > {_alpha(node, 1.0)} ? {v} : 0.0f)",
    "Softplus": lambda node, v, x: softplus_c(v),
    "Mish": lambda node, v, x: f"({v} * tanh({softplus_c(v)}))",
    "Softsign": lambda node, v, x: f"({v} / (1.0f + fabs({v})))",
}


def _activation(activation: Activation) -> Callable[[KernelBuilder, ir.Node, Operand], str]:
    return lambda b, node, x: activation(node, _once(b, node, x, node.op_type.lower()), x)


for _op, _activation_c in ACTIVATIONS.items():
    expression(_op)(_activation(_activation_c))


@expression("Selu")
def _selu(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    value = _once(b, node, x, "selu")
    gamma = float(attr(node, "gamma", SELU_GAMMA))
    alpha = float(attr(node, "alpha", SELU_ALPHA))
    return (f"({value} > 0.0f ? {float_literal(gamma)} * {value} : "
            f"{float_literal(gamma * alpha)} * expm1({value}))")


@expression("Celu")
def _celu(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    """max(0, x) + min(0, alpha (exp(x / alpha) - 1))."""
    alpha = float(attr(node, "alpha", 1.0))
    if alpha == 0.0:
        raise UnsupportedOpError(f"Celu with alpha 0 (node '{node.name}') is undefined (it divides by alpha)",
                                 "use an alpha other than 0", ops=["Celu"])
    value = _once(b, node, x, "celu")
    return (f"({value} > 0.0f ? {value} : "
            f"{float_literal(alpha)} * expm1({value} * {float_literal(1.0 / alpha)}))")


def _gelu_exact(value: str) -> str:
    return f"(0.5f * {value} * (1.0f + erf({value} * {float_literal(math.sqrt(0.5))})))"


def _gelu_tanh(value: str) -> str:
    inner = f"{float_literal(math.sqrt(2.0 / math.pi))} * fma({float_literal(0.044715)} * {value} * {value}, " \
            f"{value}, {value})"
    return f"(0.5f * {value} * (1.0f + tanh({inner})))"


GELU_FORMS = {"none": _gelu_exact, "tanh": _gelu_tanh}


@expression("Gelu")
def _gelu(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    """Opset 20's Gelu: 0.5 x (1 + erf(x / sqrt 2)), or with approximate='tanh'
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    form = GELU_FORMS[choice_attr(node, "approximate", "none", GELU_FORMS, "kernel")]
    return form(_once(b, node, x, "gelu"))


#: rounding: ONNX Round is half to even, as OpenCL's rint in the default rounding mode
ROUNDINGS = {"Floor": "floor", "Ceil": "ceil", "Round": "rint"}


@expression(*ROUNDINGS)
def _rounding(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    return f"{ROUNDINGS[node.op_type]}({x(node.inputs[0])})"


@expression("Sign")
def _sign(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    """OpenCL's sign for floats (0 at +-0, as ONNX); integers compare with 0."""
    ctype = ctype_of(node.outputs[0])
    if ctype == "float":
        return f"sign({x(node.inputs[0])})"
    value = b.temp(ctype, x(node.inputs[0]), "sg")
    return f"(({ctype})({value} > 0) - ({ctype})({value} < 0))"
