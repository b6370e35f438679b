"""Contraction kernels: MatMul, Gemm, Conv, ConvTranspose, each with its fused epilogue.

One lane computes one output element: it folds its reduction (K, or input channels x kernel
taps) into a float accumulator `acc` (fp32 even over half textures, since `ldf` and
`read_imagef` return float), then the elementwise nodes the fuse pass attached
(group.nodes[1:]) are evaluated on `acc` and every value in `group.outputs` is written.
Shapes and strides are literals, so the OpenCL compiler folds the index arithmetic; base
indices are hoisted out of the reduction loops and the loops step pointers instead of
recomputing flat indices. Where a reduction walks an operand contiguously from a texel
boundary (e.g. Gemm's A and B^T rows with K % 4 == 0, a 1x1 conv's weights) four values are
fetched with one texel read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, flat_index, float_literal, strides_of
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.kernels.elementwise import evaluate_chain
from fblc.codegen.textures import TextureTable
from fblc.compiler.errors import UnsupportedOpError
from fblc.compiler.values import attr, is_float, static_shape
from fblc.compiler.window import window_of

Terms = list[tuple[str, int]]


def _o(axis: int) -> str:
    return f"{OUT_INDEX}{axis}"


@dataclass
class Stream:
    """An operand walked by a reduction: element `base + r * step` for r = 0, 1, ..."""

    value: ir.Value
    terms: Terms  # base index as (C expression, literal stride); expressions must be ints
    step: int

    def aligned(self) -> bool:
        """True when every base is a multiple of 4 and the walk is contiguous: one texel holds 4 steps."""
        return self.step == 1 and all(stride % 4 == 0 for _, stride in self.terms)


def _terms(variables: Sequence[str], dims: Sequence[int], strides: Sequence[int]) -> Terms:
    """Index terms, dropping axes of extent 1 (their index is always 0)."""
    return [(var, stride) for var, dim, stride in zip(variables, dims, strides) if dim != 1]


def _check_float(node: ir.Node) -> None:
    """The loops accumulate in float and read through `ldf`; integer contractions are not training ops."""
    for value in node.inputs:
        if value is not None and not is_float(value):
            raise UnsupportedOpError(f"{node.op_type} '{node.name}' has a non-float input '{value.name}'",
                                     "only float contractions have kernels; cast the operands to float")


def dot_loop(b: KernelBuilder, acc: str, count: int, streams: tuple[Stream, Stream], indent: str = "") -> None:
    """Emit `acc += sum_r a[r] * w[r]` over `count` steps of the two streams.

    Unrolled by 4 into float4 dot products; an aligned stream fills its float4 with one texel
    read, the other with four `ldf`. A scalar tail covers count % 4.
    """
    if count <= 0:
        return
    pointers = [b.fresh("p") for _ in streams]
    lines = [f"int {p} = {flat_index(s.terms)};" for p, s in zip(pointers, streams)]
    if count == 1:
        lines.append(f"{acc} += {b.load(streams[0].value, pointers[0])} * {b.load(streams[1].value, pointers[1])};")
        b.emit(*(indent + line for line in lines))
        return
    main = count - count % 4
    r = b.fresh("r")
    if main:
        vectors = []
        for p, s in zip(pointers, streams):
            if s.aligned() and b.constant_scalar(s.value) is None:
                arg, texture = b.argument(s.value)
                vectors.append(f"read_imagef({arg}, SMP, TEXEL({p} >> 2, {texture.width}))")
            else:
                parts = [b.load(s.value, p if k == 0 else f"{p} + {k * s.step}") for k in range(4)]
                vectors.append(f"(float4)({', '.join(parts)})")
        steps = " ".join(f"{p} += {4 * s.step};" for p, s in zip(pointers, streams))
        lines += [f"for (int {r} = 0; {r} < {main}; {r} += 4) {{",
                  f"  {acc} += dot({vectors[0]}, {vectors[1]});",
                  f"  {steps}",
                  "}"]
    if count % 4:
        tail = b.fresh("r")
        steps = " ".join(f"{p} += {s.step};" for p, s in zip(pointers, streams))
        lines += [f"for (int {tail} = {main}; {tail} < {count}; ++{tail}) {{",
                  f"  {acc} += {b.load(streams[0].value, pointers[0])} * {b.load(streams[1].value, pointers[1])};",
                  f"  {steps}",
                  "}"]
    b.emit(*(indent + line for line in ["{"] + ["  " + line for line in lines] + ["}"]))


def _finish(b: KernelBuilder, group: KernelGroup, acc: str) -> list[Kernel]:
    """Apply the fused epilogue to `acc` and write every value the rest of the step reads."""
    env = evaluate_chain(b, group.nodes[1:], {id(group.anchor.outputs[0]): acc})
    return [b.finish([env[id(v)] for v in group.outputs])]


def _builder(table: TextureTable, group: KernelGroup, family: str) -> tuple[KernelBuilder, str]:
    _check_float(group.anchor)
    b = KernelBuilder(table, group.name, family, group.outputs)
    b.nodes.append(group.anchor.name)
    acc = b.fresh("acc")
    b.emit(f"float {acc} = 0.0f;")
    return b, acc


# MatMul / Gemm ----------------------------------------------------------------------------------

@register_kernel("MatMul")
def emit_matmul(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """numpy matmul: batch dims broadcast, a 1-D A is a row [1, K], a 1-D B a column [K, 1]."""
    node = group.anchor
    a, w = node.inputs
    a_shape, b_shape = static_shape(a), static_shape(w)
    a2 = a_shape if len(a_shape) >= 2 else (1, a_shape[0])
    b2 = b_shape if len(b_shape) >= 2 else (b_shape[0], 1)
    batch = tuple(np.broadcast_shapes(a2[:-2], b2[:-2]))
    nb = len(batch)
    # output axes of the batch dims, m and n; a missing m or n (1-D operand) is index 0
    m_var = _o(nb) if len(a_shape) >= 2 else "0"
    n_var = _o(nb + (1 if len(a_shape) >= 2 else 0)) if len(b_shape) >= 2 else "0"

    def stream(shape2: tuple[int, ...], row: str, col: str, reduce_rows: bool) -> Stream:
        strides = strides_of(shape2)
        lead = nb - (len(shape2) - 2)
        variables = [_o(lead + k) for k in range(len(shape2) - 2)]
        variables += ["0", col] if reduce_rows else [row, "0"]
        return Stream(w if reduce_rows else a, _terms(variables, shape2, strides),
                      strides[-2] if reduce_rows else strides[-1])

    b, acc = _builder(table, group, "matmul")
    dot_loop(b, acc, a2[-1], (stream(a2, m_var, "", False), stream(b2, "", n_var, True)))
    return _finish(b, group, acc)


@register_kernel("Gemm")
def emit_gemm(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Y = alpha * A' B' + beta * C, A' = A^T when transA (B' likewise); C broadcasts to [M, N]."""
    node = group.anchor
    a, w = node.inputs[0], node.inputs[1]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    trans_a, trans_b = int(attr(node, "transA", 0)), int(attr(node, "transB", 0))
    a_shape, b_shape = static_shape(a), static_shape(w)
    k_dim = a_shape[0] if trans_a else a_shape[1]
    # A' [M, K]: element (m, k) is A[k, m] when transposed; B' [K, N]: (k, n) is B[n, k] when transposed
    a_stream = (Stream(a, _terms([_o(0)], [a_shape[1]], [1]), a_shape[1]) if trans_a
                else Stream(a, _terms([_o(0)], [a_shape[0]], [a_shape[1]]), 1))
    b_stream = (Stream(w, _terms([_o(1)], [b_shape[0]], [b_shape[1]]), 1) if trans_b
                else Stream(w, _terms([_o(1)], [b_shape[1]], [1]), b_shape[1]))
    b, acc = _builder(table, group, "matmul")
    dot_loop(b, acc, k_dim, (a_stream, b_stream))
    result = acc if alpha == 1.0 else f"{float_literal(alpha)} * {acc}"
    if c is not None and beta != 0.0:
        c_shape = static_shape(c)
        out_shape = b.out_shape
        lead = len(out_shape) - len(c_shape)
        c_index = flat_index(_terms([_o(lead + k) for k in range(len(c_shape))], c_shape, strides_of(c_shape)))
        c_value = b.load(c, c_index)
        result = f"{result} + {c_value}" if beta == 1.0 else f"{result} + {float_literal(beta)} * {c_value}"
    if result != acc:
        b.emit(f"{acc} = {result};")
    return _finish(b, group, acc)


