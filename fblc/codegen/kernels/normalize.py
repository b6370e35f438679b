"""Softmax-family and normalisation kernels: Softmax, LogSoftmax, LayerNormalization.

Every kernel keeps the builder's shape of one work-item per output texel, each lane computing
one element. A lane needs statistics of its whole row (max and sum of exp, or mean and
variance), so:

- Softmax/LogSoftmax fold the row in a single pass with an online max (running maximum, sum
  rescaled when it grows), i.e. one read of the row per element instead of two.
- LayerNormalization, when its Mean and InvStdDev outputs exist (always in a training step:
  the backward reads them), computes them once per row in a statistics kernel launched first,
  and the Y kernel reads them back; only without those outputs does each lane recompute them.
  The statistics have one element per row while Y has one per element, so they cannot share
  a kernel (the builder writes outputs of one shape).

All statistics accumulate in float whatever the storage type (fp16 textures are read as float).
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, broadcast_index, flat_index, float_literal, strides_of
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.textures import TextureTable
from fblc.compiler.values import attr, numel, static_shape

FAMILY = "normalization"


def _row_base(b: KernelBuilder, shape: tuple[int, ...], axes: list[int]) -> str:
    """Flat index of the current output element with the coordinates on `axes` set to 0."""
    strides = strides_of(shape)
    terms = [(f"{OUT_INDEX}{k}", strides[k]) for k in range(len(shape)) if k not in axes]
    return b.temp("int", flat_index(terms), "base")


# Softmax / LogSoftmax ------------------------------------------------------------------------------

@register_kernel("Softmax", "LogSoftmax")
def emit_softmax(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """softmax(x)_i = exp(x_i - m) / s, log_softmax(x)_i = x_i - m - log(s), m = max, s = sum exp(x - m)."""
    node = group.anchor
    x = node.inputs[0]
    shape = static_shape(x)
    rank = len(shape)
    if rank == 0:
        value = "1.0f" if node.op_type == "Softmax" else "0.0f"
        b = KernelBuilder(table, group.name, FAMILY, group.outputs)
        b.nodes.append(node.name)
        return [b.finish([value])]
    axis = int(attr(node, "axis", -1)) % rank
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    base = _row_base(b, shape, [axis])
    stride = strides_of(shape)[axis]
    m, s, r = b.fresh("m"), b.fresh("s"), b.fresh("r")
    step = r if stride == 1 else f"{r} * {stride}"
    # Online max: when a larger element arrives, the sum so far is rescaled to the new maximum.
    b.emit(f"float {m} = -INFINITY;",
           f"float {s} = 0.0f;",
           f"for (int {r} = 0; {r} < {shape[axis]}; ++{r}) {{",
           f"  const float x = {b.load(x, f'{base} + {step}')};",
           f"  if (x > {m}) {{ {s} = {s} * exp({m} - x) + 1.0f; {m} = x; }}",
           f"  else {{ {s} += exp(x - {m}); }}",
           "}")
    own = b.temp("float", b.load(x, flat_index([(f"{OUT_INDEX}{k}", st) for k, st in enumerate(strides_of(shape))])),
                 "x")
    if node.op_type == "Softmax":
        result = f"(exp({own} - {m}) / {s})"
    else:
        result = f"({own} - {m} - log({s}))"
    return [b.finish([result])]


# LayerNormalization --------------------------------------------------------------------------------

def _layer_norm_geometry(node: ir.Node) -> tuple[tuple[int, ...], int, int]:
    """(input shape, first normalised axis, elements per normalised row)."""
    shape = static_shape(node.inputs[0])
    axis = int(attr(node, "axis", -1)) % len(shape)
    return shape, axis, numel(shape[axis:])


def _row_statistics(b: KernelBuilder, node: ir.Node, row_start: str) -> tuple[str, str]:
    """Mean and 1/sqrt(var + eps) of the contiguous row starting at flat index `row_start`.

    Two passes (mean, then centred squares) rather than E[x^2] - E[x]^2, which cancels badly
    when the mean is large next to the spread.
    """
    x = node.inputs[0]
    _, _, count = _layer_norm_geometry(node)
    epsilon = float_literal(float(attr(node, "epsilon", 1e-5)))
    total, centred, r = b.fresh("sum"), b.fresh("sq"), b.fresh("r")
    b.emit(f"float {total} = 0.0f;",
           f"for (int {r} = 0; {r} < {count}; ++{r}) {total} += {b.load(x, f'{row_start} + {r}')};")
    mean = b.temp("float", f"{total} / {float_literal(float(count))}", "mean")
    b.emit(f"float {centred} = 0.0f;",
           f"for (int {r} = 0; {r} < {count}; ++{r}) {{",
           f"  const float d = {b.load(x, f'{row_start} + {r}')} - {mean};",
           f"  {centred} += d * d;",
           "}")
    inv_std = b.temp("float", f"rsqrt({centred} / {float_literal(float(count))} + {epsilon})", "inv")
    return mean, inv_std


def _has_statistics(node: ir.Node) -> bool:
    return len(node.outputs) >= 3 and all(o is not None and o.name for o in node.outputs[1:3])


def _statistics_kernel(table: TextureTable, name: str, node: ir.Node, outputs: list[ir.Value]) -> Kernel:
    """Mean and/or InvStdDev (shape: the input's with the normalised axes as 1), one lane per row."""
    shape, axis, _ = _layer_norm_geometry(node)
    b = KernelBuilder(table, name, FAMILY, outputs)
    b.nodes.append(node.name)
    strides = strides_of(shape)
    row_start = b.temp("int", flat_index([(f"{OUT_INDEX}{k}", strides[k]) for k in range(axis)]), "row")
    mean, inv_std = _row_statistics(b, node, row_start)
    return b.finish([mean if out is node.outputs[1] else inv_std for out in outputs])


@register_kernel("LayerNormalization")
def emit_layer_norm(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Y = (X - mean) * inv_std * Scale + B over the trailing axes from `axis`."""
    node = group.anchor
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    shape, axis, _ = _layer_norm_geometry(node)
    kernels: list[Kernel] = []
    statistics = _has_statistics(node)
    if statistics:
        # Both are written (even one nothing reads) so that the Y kernel can read them back.
        kernels.append(_statistics_kernel(table, f"{group.name}_stats", node, list(node.outputs[1:3])))
    y = node.outputs[0]
    if y not in group.outputs:
        return kernels
    b = KernelBuilder(table, group.name, FAMILY, [y])
    b.nodes.append(node.name)
    strides = strides_of(shape)
    if statistics:
        stat_shape = static_shape(node.outputs[1])
        stat_index = broadcast_index(stat_shape, shape, OUT_INDEX)
        mean = b.temp("float", b.load(node.outputs[1], stat_index), "mean")
        inv_std = b.temp("float", b.load(node.outputs[2], stat_index), "inv")
    else:
        row_start = b.temp("int", flat_index([(f"{OUT_INDEX}{k}", strides[k]) for k in range(axis)]), "row")
        mean, inv_std = _row_statistics(b, node, row_start)
    own = b.load(x, flat_index([(f"{OUT_INDEX}{k}", st) for k, st in enumerate(strides)]))
    result = f"(({own} - {mean}) * {inv_std} * {b.load(scale, broadcast_index(static_shape(scale), shape, OUT_INDEX))}"
    if bias is not None:
        result += f" + {b.load(bias, broadcast_index(static_shape(bias), shape, OUT_INDEX))}"
    return kernels + [b.finish([result + ")"])]
