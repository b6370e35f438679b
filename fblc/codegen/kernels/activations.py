"""Elementwise expressions of activations: LeakyRelu, PRelu, Elu, Selu, Celu, ThresholdedRelu, Softplus,
Mish, Softsign, Gelu (exact and tanh) and Sign; they join elementwise.py's table (`expression`), so they
fuse into elementwise chains and contraction epilogues like any elementwise op.

Softplus is log1p(exp(-|x|)) + max(x, 0), which neither overflows (log(1 + exp(x)) is inf from x = 89
in float32) nor loses small values; Mish uses the same form.
"""

from __future__ import annotations

import math
from typing import Callable

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.ir import FLOAT, Expr, call, select
from fblc.codegen.kernels.elementwise import Operand, expression, f
from fblc.codegen.reads import dtype_of
from fblc.compiler.values import attr, choice_attr
from fblc.errors import UnsupportedOpError

SELU_ALPHA = 1.67326319217681884765625  # the ONNX defaults
SELU_GAMMA = 1.05070102214813232421875


def _alpha(node: ir.Node, default: float) -> Expr:
    return f(float(attr(node, "alpha", default)))


def softplus(value: Expr) -> Expr:
    """log(1 + exp(value)) without overflow (`value` named: it is read twice)."""
    return call("fmax", value, f(0.0)) + call("log1p", call("exp", -call("fabs", value)))


#: opset 20's Gelu: 0.5 x (1 + erf(x / sqrt 2)), or approximate='tanh': 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
GELU_FORMS: dict[str, Callable[[Expr], Expr]] = {
    "none": lambda v: f(0.5) * v * (f(1.0) + call("erf_rational", v * f(math.sqrt(0.5)), dtype=FLOAT)),
    "tanh": lambda v: f(0.5) * v * (f(1.0) + call(
        "tanh", f(math.sqrt(2.0 / math.pi)) * call("fma", f(0.044715) * v * v, v, v))),
}

#: op -> its activation of `v` (its input as a named value, so it can be read twice)
ACTIVATIONS: dict[str, Callable[[ir.Node, Expr, Operand], Expr]] = {
    "LeakyRelu": lambda node, v, x: select(v.gt(f(0.0)), v, _alpha(node, 0.01) * v),
    # the slope is read with broadcasting (per channel for nn.PReLU's [C, 1, 1])
    "PRelu": lambda node, v, x: select(v.gt(f(0.0)), v, x(node.inputs[1]) * v),
    "Elu": lambda node, v, x: select(v.gt(f(0.0)), v, _alpha(node, 1.0) * call("expm1", v)),
    "ThresholdedRelu": lambda node, v, x: select(v.gt(_alpha(node, 1.0)), v, f(0.0)),
    "Softplus": lambda node, v, x: softplus(v),
    "Mish": lambda node, v, x: v * call("tanh", softplus(v)),
    "Softsign": lambda node, v, x: v / (f(1.0) + call("fabs", v)),
    "Selu": lambda node, v, x: select(v.gt(f(0.0)), f(float(attr(node, "gamma", SELU_GAMMA))) * v, f(
        float(attr(node, "gamma", SELU_GAMMA)) * float(attr(node, "alpha", SELU_ALPHA))) * call("expm1", v)),
    "Celu": lambda node, v, x: select(v.gt(f(0.0)), v, _alpha(node, 1.0) * call(
        "expm1", v * f(1.0 / float(attr(node, "alpha", 1.0))))),
    "Gelu": lambda node, v, x: GELU_FORMS[choice_attr(node, "approximate", "none", GELU_FORMS, "kernel")](v),
}


@expression(*ACTIVATIONS)
def _activation(b: KernelBuilder, node: ir.Node, x: Operand) -> Expr:
    if node.op_type == "Celu" and float(attr(node, "alpha", 1.0)) == 0.0:
        raise UnsupportedOpError(f"Celu with alpha 0 (node '{node.name}') is undefined (it divides by alpha)",
                                 "use an alpha other than 0", ops=["Celu"])
    return ACTIVATIONS[node.op_type](node, b.body.let(x(node.inputs[0]), node.op_type.lower(), FLOAT), x)


@expression("Sign")
def _sign(b: KernelBuilder, node: ir.Node, x: Operand) -> Expr:
    """OpenCL's sign for floats (0 at +-0, as ONNX); integers compare with 0."""
    dtype = dtype_of(node.outputs[0])
    if dtype == FLOAT:
        return call("sign", x(node.inputs[0]))
    value = b.body.let(x(node.inputs[0]), "sg", dtype)
    return value.gt(0).cast(dtype) - value.lt(0).cast(dtype)
