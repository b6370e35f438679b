"""Fused elementwise kernels: a chain of elementwise ops evaluated per output element.

Each op is an IR expression from one table (`expression`; ops that read each input once by `of_operands`);
inputs that come from outside the chain are read with numpy broadcasting from their own shape to the
kernel's. Contraction kernels reuse `evaluate_chain` for their epilogue.
"""

from __future__ import annotations

import operator
from functools import partial, reduce
from typing import Callable, Sequence

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import Kernel
from fblc.codegen.ir import FLOAT, INT, Expr, call, const, select
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.reads import dtype_of
from fblc.codegen.textures import TextureTable
from fblc.compiler import keys
from fblc.compiler.index_map import map_of, view_root
from fblc.compiler.values import attr, const_array, static_shape
from fblc.compiler.ops import ELEMENTWISE
from fblc.errors import UnsupportedOpError

Operand = Callable[[ir.Value], Expr]
Expression = Callable[[KernelBuilder, ir.Node, Operand], Expr]

EXPRESSIONS: dict[str, Expression] = {}


def expression(*op_types: str) -> Callable[[Expression], Expression]:
    def decorate(build: Expression) -> Expression:
        for op_type in op_types:
            assert op_type not in EXPRESSIONS, f"expression for {op_type} registered twice"
            EXPRESSIONS[op_type] = build
        return build

    return decorate


def of_operands(op_type: str, build: Callable[..., Expr]) -> None:
    """An op whose expression is `build` of its inputs, each read once."""
    expression(op_type)(lambda b, node, x: build(*(x(v) for v in node.inputs)))


def f(value: float) -> Expr:
    """A float literal."""
    return const(float(value), FLOAT)


#: ops that are one OpenCL function of their input (ONNX Round is half to even, as rint in the default rounding mode;
#: Erf the preamble's erf_rational, within 5e-7 of erf and ~30x faster than PoCL's)
FUNCTIONS = {"Sqrt": "sqrt", "Exp": "exp", "Log": "log", "Tanh": "tanh", "Erf": "erf_rational", "Sin": "sin",
             "Cos": "cos", "Atan": "atan", "Abs": "fabs", "Floor": "floor", "Ceil": "ceil", "Round": "rint"}
for _op, _build in {"Add": Expr.__add__, "Sub": Expr.__sub__, "Mul": Expr.__mul__, "Div": Expr.__truediv__,
                    "Equal": Expr.eq, "Greater": Expr.gt, "Less": Expr.lt, "GreaterOrEqual": Expr.ge,
                    "LessOrEqual": Expr.le, "And": Expr.logical_and, "Or": Expr.logical_or, "Where": select,
                    "Reciprocal": lambda a: f(1.0) / a, "Neg": Expr.__neg__, "Not": Expr.__invert__,
                    "Relu": lambda a: call("fmax", a, f(0.0)), "Sigmoid": lambda a: f(1.0) / (f(1.0) + call("exp", -a)),
                    "IsNaN": lambda a: call("isnan", a, dtype=INT),
                    **{op: partial(call, function) for op, function in FUNCTIONS.items()}}.items():
    of_operands(_op, _build)


#: the largest |integer exponent| computed by multiplications (log2 of it, plus a division when negative): PoCL's
#: pown is a library call of about 200 ns per element on an x86 core (GELU's x^3 in a GPT-2 MLP: 27 ms of a
#: 60 ms step), against one multiply
PRODUCT_EXPONENT = 4


def _power(b: KernelBuilder, base: Expr, exponent: int) -> Expr:
    """`base` to the integer `exponent` (1 <= |exponent| <= PRODUCT_EXPONENT) by repeated squaring; `base` named
    once where it is used more than once."""
    value = base if exponent in (1, -1, 2, -2) else b.body.let(base, "pw", FLOAT)
    square = value * value
    power = {1: value, 2: square, 3: square * value, 4: square * square}[abs(exponent)]
    return power if exponent > 0 else f(1.0) / power


@expression("Pow")
def _pow(b: KernelBuilder, node: ir.Node, x: Operand) -> Expr:
    exponent = const_array(node.inputs[1])
    base = x(node.inputs[0])
    if exponent is not None and exponent.size == 1:
        value = float(exponent.reshape(-1)[0])
        if value in (1.0, 0.5):
            return {1.0: base, 0.5: call("sqrt", base)}[value]
        if value.is_integer() and 1 <= abs(value) <= PRODUCT_EXPONENT:
            return _power(b, base, int(value))
        if value.is_integer():
            return call("pown", base, const(int(value)))
    return call("pow", base, x(node.inputs[1]).cast(FLOAT))


@expression("HardSigmoid")
def _hard_sigmoid(b: KernelBuilder, node: ir.Node, x: Operand) -> Expr:
    alpha, beta = f(float(attr(node, "alpha", 0.2))), f(float(attr(node, "beta", 0.5)))
    return call("clamp", call("fma", alpha, x(node.inputs[0]), beta), f(0.0), f(1.0))


@expression("HardSwish")
def _hard_swish(b: KernelBuilder, node: ir.Node, x: Operand) -> Expr:
    """x * clip(x / 6 + 1/2, 0, 1); x is named once, since it appears twice."""
    value = b.body.let(x(node.inputs[0]), "hs", FLOAT)
    return value * call("clamp", call("fma", value, f(1.0 / 6.0), f(0.5)), f(0.0), f(1.0))


def extreme(name: str) -> Callable[[Expr, Expr], Expr]:
    """max or min (`name`) of two values: fmax / fmin of floats."""
    return lambda a, c: call(f"f{name}" if a.dtype.is_float else name, a, c)


@expression("Max", "Min", "Sum")
def _variadic(b: KernelBuilder, node: ir.Node, x: Operand) -> Expr:
    return reduce(operator.add if node.op_type == "Sum" else extreme(node.op_type.lower()), [x(v) for v in node.inputs])


@expression("Clip")
def _clip(b: KernelBuilder, node: ir.Node, x: Operand) -> Expr:
    result = x(node.inputs[0])
    for k, function in ((1, "fmax"), (2, "fmin")):  # the bounds min and max, either absent
        if len(node.inputs) > k and node.inputs[k] is not None:
            result = call(function, result, x(node.inputs[k]))
    return result


@expression("Cast")
def _cast(b: KernelBuilder, node: ir.Node, x: Operand) -> Expr:
    value, out = x(node.inputs[0]), node.outputs[0]
    return value.ne(0) if out.dtype == ir.DataType.BOOL else value.cast(dtype_of(out))


@expression("BatchNormalization")
def _batch_norm(b: KernelBuilder, node: ir.Node, x: Operand) -> Expr:
    """Eval mode: per-channel statistics (axis 1) read at the channel index."""
    if int(attr(node, "training_mode", 0)):
        raise UnsupportedOpError(f"BatchNormalization in training mode (node '{node.name}') has no kernel",
                                 "compile with --bn-train, which rewrites it into batch-statistics ops")
    scale, bias, mean = (b.channel(v) for v in node.inputs[1:4])
    epsilon = f(float(attr(node, "epsilon", 1e-5)))
    inverse_std = b.channel(node.inputs[4], apply=lambda var: call("rsqrt", var + epsilon))  # once per channel read
    return (x(node.inputs[0]) - mean) * scale * inverse_std + bias


def evaluate_chain(b: KernelBuilder, nodes: Sequence[ir.Node], env: dict[int, Expr]) -> dict[int, Expr]:
    """Build the chain into `b`'s lane loop; `env` maps value ids already computed to their values (updated)."""
    def operand(value: ir.Value) -> Expr:
        if id(value) in env:
            return env[id(value)]
        root = view_root(value)
        if id(root) in env and static_shape(value) == b.out_shape and map_of(value).contiguous:
            return env[id(root)]  # a same-shape view of a value this kernel computes: never read it back
        return b.broadcast(value, b.out_shape)

    for node in nodes:
        if node.metadata_props.get(keys.REMAP) == keys.WRITTEN_BY_PRODUCER \
                and id(node.inputs[0]) in env:  # the kernel computes its elements in this Transpose's order
            env[id(node.outputs[0])] = env[id(node.inputs[0])]
            continue
        build = EXPRESSIONS.get(node.op_type)
        if build is None:
            raise UnsupportedOpError(f"no elementwise expression for op {node.op_type} (node '{node.name}')",
                                     f"supported: {', '.join(sorted(EXPRESSIONS))}")
        b.nodes.append(node.name)
        env[id(node.outputs[0])] = b.body.let(build(b, node, operand), "v", dtype_of(node.outputs[0]))
    return env


@register_kernel(*sorted(ELEMENTWISE))
def emit_elementwise(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    b = KernelBuilder(table, group.name, "elementwise", group.outputs)
    env = evaluate_chain(b, group.nodes, {})
    return [b.finish([env[id(v)] for v in group.outputs])]
