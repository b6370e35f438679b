"""Fused elementwise kernels: a chain of elementwise ops evaluated per output element.

Each op is a C expression from a table; inputs that come from outside the chain are read
with numpy broadcasting from their own shape to the kernel's. Contraction kernels reuse
`evaluate_chain` for their epilogue.
"""

from __future__ import annotations

from typing import Callable, Sequence

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, KernelBuilder, ctype_of
from fblc.codegen.cl import Kernel, float_literal
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.textures import TextureTable
from fblc.compiler.index_map import map_of, view_root
from fblc.errors import UnsupportedOpError
from fblc.compiler.values import attr, const_array, static_shape
from fblc.compiler.ops import ELEMENTWISE

Operand = Callable[[ir.Value], str]
Expression = Callable[[KernelBuilder, ir.Node, Operand], str]

EXPRESSIONS: dict[str, Expression] = {}


def expression(*op_types: str) -> Callable[[Expression], Expression]:
    def decorate(build: Expression) -> Expression:
        for op_type in op_types:
            assert op_type not in EXPRESSIONS, f"expression for {op_type} registered twice"
            EXPRESSIONS[op_type] = build
        return build

    return decorate


def _binary(op_type: str, template: str) -> None:
    EXPRESSIONS[op_type] = lambda b, n, x: template.format(a=x(n.inputs[0]), b=x(n.inputs[1]))


for _op, _template in {"Add": "({a} + {b})", "Sub": "({a} - {b})", "Mul": "({a} * {b})", "Div": "({a} / {b})",
                       "Equal": "({a} == {b})", "Greater": "({a} > {b})", "Less": "({a} < {b})",
                       "GreaterOrEqual": "({a} >= {b})", "LessOrEqual": "({a} <= {b})", "And": "({a} && {b})",
                       "Or": "({a} || {b})"}.items():
    _binary(_op, _template)


def _unary(op_type: str, template: str) -> None:
    EXPRESSIONS[op_type] = lambda b, n, x: template.format(a=x(n.inputs[0]))


for _op, _template in {"Sqrt": "sqrt({a})", "Reciprocal": "(1.0f / {a})", "Neg": "(-{a})", "Exp": "exp({a})",
                       "Log": "log({a})", "Relu": "fmax({a}, 0.0f)", "Sigmoid": "(1.0f / (1.0f + exp(-{a})))",
                       "Tanh": "tanh({a})", "Erf": "erf({a})", "Sin": "sin({a})", "Cos": "cos({a})",
                       "Atan": "atan({a})", "Not": "(!{a})", "Abs": "fabs({a})", "IsNaN": "isnan({a})"}.items():
    _unary(_op, _template)


@expression("Pow")
def _pow(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    exponent = const_array(node.inputs[1])
    base = x(node.inputs[0])
    if exponent is not None and exponent.size == 1:
        value = float(exponent.reshape(-1)[0])
        if value == 2.0:
            return f"({base} * {base})"
        if value == 1.0:
            return base
        if value == 0.5:
            return f"sqrt({base})"
        if value.is_integer():
            return f"pown({base}, {int(value)})"
    return f"pow({base}, (float){x(node.inputs[1])})"


@expression("HardSigmoid")
def _hard_sigmoid(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    alpha = float_literal(float(attr(node, "alpha", 0.2)))
    beta = float_literal(float(attr(node, "beta", 0.5)))
    return f"clamp(fma({alpha}, {x(node.inputs[0])}, {beta}), 0.0f, 1.0f)"


@expression("HardSwish")
def _hard_swish(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    """x * clip(x / 6 + 1/2, 0, 1); x is named once, since it appears twice."""
    value = b.temp("float", x(node.inputs[0]), "hs")
    return f"({value} * clamp(fma({value}, {float_literal(1.0 / 6.0)}, 0.5f), 0.0f, 1.0f))"


@expression("Max", "Min", "Sum")
def _variadic(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    operands = [x(v) for v in node.inputs]
    if node.op_type == "Sum":
        return "(" + " + ".join(operands) + ")"
    function = ("fmax" if node.op_type == "Max" else "fmin") if ctype_of(node.outputs[0]) == "float" else (
        "max" if node.op_type == "Max" else "min")
    result = operands[0]
    for operand in operands[1:]:
        result = f"{function}({result}, {operand})"
    return result


@expression("Clip")
def _clip(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    result = x(node.inputs[0])
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        result = f"fmax({result}, {x(node.inputs[1])})"
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        result = f"fmin({result}, {x(node.inputs[2])})"
    return result


@expression("Where")
def _where(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    return f"({x(node.inputs[0])} ? {x(node.inputs[1])} : {x(node.inputs[2])})"


@expression("Cast")
def _cast(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    source, target = ctype_of(node.inputs[0]), ctype_of(node.outputs[0])
    value = x(node.inputs[0])
    if node.outputs[0].dtype == ir.DataType.BOOL:
        return f"({value} != 0)"
    return value if source == target else f"(({target}){value})"


@expression("BatchNormalization")
def _batch_norm(b: KernelBuilder, node: ir.Node, x: Operand) -> str:
    """Eval mode: per-channel statistics (axis 1) read at the channel index."""
    if int(attr(node, "training_mode", 0)):
        raise UnsupportedOpError(f"BatchNormalization in training mode (node '{node.name}') has no kernel",
                                 "compile with --bn-train, which rewrites it into batch-statistics ops")
    scale, bias, mean = (b.load_channel(v) for v in node.inputs[1:4])
    epsilon = float_literal(float(attr(node, "epsilon", 1e-5)))
    inverse_std = b.load_channel(node.inputs[4], apply=f"rsqrt({{}} + {epsilon})")  # once per channel read
    return f"(({x(node.inputs[0])} - {mean}) * {scale} * {inverse_std} + {bias})"


def evaluate_chain(b: KernelBuilder, nodes: Sequence[ir.Node], env: dict[int, str]) -> dict[int, str]:
    """Append the chain's C to `b`; `env` maps value ids already computed to C names (updated)."""
    out_shape = b.out_shape

    def operand(value: ir.Value) -> str:
        if id(value) in env:
            return env[id(value)]
        root = view_root(value)
        if id(root) in env and static_shape(value) == out_shape and map_of(value).contiguous:
            return env[id(root)]  # a same-shape view of a value this kernel computes: never read it back
        return b.load_broadcast(value, out_shape)

    for node in nodes:
        build = EXPRESSIONS.get(node.op_type)
        if build is None:
            raise UnsupportedOpError(f"no elementwise expression for op {node.op_type} (node '{node.name}')",
                                     f"supported: {', '.join(sorted(EXPRESSIONS))}")
        b.nodes.append(node.name)
        env[id(node.outputs[0])] = b.temp(ctype_of(node.outputs[0]), build(b, node, operand))
    return env


@register_kernel(*sorted(ELEMENTWISE))
def emit_elementwise(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    b = KernelBuilder(table, group.name, "elementwise", group.outputs)
    env = evaluate_chain(b, group.nodes, {})
    return [b.finish([env[id(v)] for v in group.outputs])]
