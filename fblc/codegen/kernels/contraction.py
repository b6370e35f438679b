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

from collections.abc import Sequence
from dataclasses import dataclass

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


def dot_loop(b: KernelBuilder, acc: str, count: int | str, streams: tuple[Stream, Stream], indent: str = "") -> None:
    """Emit `acc += sum_r a[r] * w[r]` over `count` steps of the two streams.

    A literal count is unrolled by 4 into float4 dot products; an aligned stream fills its
    float4 with one texel read, the other with four `ldf`; a scalar tail covers count % 4.
    A runtime count (a C expression, e.g. the in-bounds taps of a border pixel) is a plain loop.
    """
    if isinstance(count, int) and count <= 0:
        return
    pointers = [b.fresh("p") for _ in streams]
    lines = [f"int {p} = {flat_index(s.terms)};" for p, s in zip(pointers, streams)]
    product = f"{acc} += {b.load(streams[0].value, pointers[0])} * {b.load(streams[1].value, pointers[1])};"
    if count == 1:
        b.emit(*(indent + line for line in lines + [product]))
        return
    steps = " ".join(f"{p} += {s.step};" for p, s in zip(pointers, streams))
    r = b.fresh("r")
    if isinstance(count, str):
        lines += [f"for (int {r} = 0; {r} < {count}; ++{r}) {{", f"  {product}", f"  {steps}", "}"]
        b.emit(*(indent + line for line in ["{"] + ["  " + line for line in lines] + ["}"]))
        return
    main = count - count % 4
    if main:
        vectors = []
        for p, s in zip(pointers, streams):
            if s.aligned() and b.constant_scalar(s.value) is None:
                arg, texture = b.argument(s.value)
                vectors.append(f"read_imagef({arg}, SMP, TEXEL({p} >> 2, {texture.width}))")
            else:
                parts = [b.load(s.value, p if k == 0 else f"{p} + {k * s.step}") for k in range(4)]
                vectors.append(f"(float4)({', '.join(parts)})")
        steps4 = " ".join(f"{p} += {4 * s.step};" for p, s in zip(pointers, streams))
        lines += [f"for (int {r} = 0; {r} < {main}; {r} += 4) {{",
                  f"  {acc} += dot({vectors[0]}, {vectors[1]});",
                  f"  {steps4}",
                  "}"]
    if count % 4:
        tail = b.fresh("r")
        lines += [f"for (int {tail} = {main}; {tail} < {count}; ++{tail}) {{", f"  {product}", f"  {steps}", "}"]
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

    def stream(value: ir.Value, shape2: tuple[int, ...], kept: str, reduced_axis: int) -> Stream:
        """Base over the batch dims and the kept matrix axis; the walk goes along `reduced_axis`."""
        strides = strides_of(shape2)
        lead = nb - (len(shape2) - 2)
        variables = [_o(lead + k) for k in range(len(shape2) - 2)] + [kept]
        axes = list(range(len(shape2) - 2)) + [len(shape2) - 1 if reduced_axis == -2 else len(shape2) - 2]
        return Stream(value, _terms(variables, [shape2[k] for k in axes], [strides[k] for k in axes]),
                      strides[reduced_axis])

    b, acc = _builder(table, group, "matmul")
    dot_loop(b, acc, a2[-1], (stream(a, a2, m_var, -1), stream(w, b2, n_var, -2)))
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


# Conv / ConvTranspose ---------------------------------------------------------------------------

def _affine(var: str, scale: int, offset: int) -> str:
    """`var * scale + offset` as C, without the no-op parts."""
    text = var if scale == 1 else f"{var} * {scale}"
    return text if offset == 0 else f"{text} {'+' if offset > 0 else '-'} {abs(offset)}"


class _Nest:
    """Nested C blocks (tap loops, bounds guards) in the lane body, closed together.

    Guards are `if` blocks rather than `continue`, which outside a tap loop would skip the
    builder's lane loop and leave the lane unwritten.
    """

    def __init__(self, b: KernelBuilder) -> None:
        self.b = b
        self.depth = 0

    @property
    def indent(self) -> str:
        return "  " * self.depth

    def emit(self, line: str) -> None:
        self.b.emit(self.indent + line)

    def open(self, header: str) -> None:
        self.emit(header + " {")
        self.depth += 1

    def loop(self, count: int, hint: str) -> str:
        return self.loop_over("0", str(count), hint)

    def loop_over(self, start: str, stop: str, hint: str) -> str:
        var = self.b.fresh(hint)
        self.open(f"for (int {var} = {start}; {var} < {stop}; ++{var})")
        return var

    def close(self) -> None:
        while self.depth:
            self.depth -= 1
            self.emit("}")


def _add_bias(b: KernelBuilder, node: ir.Node, acc: str) -> None:
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        b.emit(f"{acc} += {b.load(node.inputs[2], _o(1))};")


@dataclass
class _Loop:
    """One reduction loop of a conv: `var` runs over [start, stop), moving the X and W indices."""

    start: str  # C expression
    stop: str  # C expression
    extent: int  # the static bound on its trip count (picks the innermost loop)
    x_step: int
    w_step: int


def _tap_range(b: KernelBuilder, origin: str, k: int, d: int, n: int) -> tuple[str, str]:
    """Taps t in [lo, hi) with 0 <= origin + t * d < n, computed once per output element."""
    if d == 1:
        return b.temp("int", f"max(0, -{origin})", "lo"), b.temp("int", f"min({k}, {n} - {origin})", "hi")
    low = b.temp("int", f"{origin} < 0 ? (-{origin} + {d - 1}) / {d} : 0", "lo")
    # C division truncates toward zero: a non-positive numerator gives hi <= 0, an empty range
    return low, b.temp("int", f"min({k}, ({n} - {origin} + {d - 1}) / {d})", "hi")


@register_kernel("Conv")
def emit_conv(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Direct convolution: nested loops over input channels and kernel taps.

    Border pixels get tap ranges (computed once, no per-tap branch) instead of skipped taps.
    The loop with the most trips is innermost and walks pointers: channels for an ordinary
    3x3 conv (unrolled by 4), a spatial tap axis for the autodiff's weight-gradient conv
    (group = N*G over a [Cg_in, N*G, H, W] view, Cg_in = 1, taps over the whole dY map).
    """
    node = group.anchor
    x, w = node.inputs[0], node.inputs[1]
    x_shape, w_shape = static_shape(x), static_shape(w)
    groups = int(attr(node, "group", 1))
    window = window_of(node, tuple(w_shape[2:]))
    cg_in, cg_out = w_shape[1], w_shape[0] // groups
    x_strides, w_strides = strides_of(x_shape), strides_of(w_shape)
    b, acc = _builder(table, group, "conv")
    g = f"({_o(1)} / {cg_out})" if groups > 1 else "0"
    x_terms = _terms([_o(0), g], [x_shape[0], groups], [x_strides[0], cg_in * x_strides[1]])
    w_terms = _terms([_o(1)], [w_shape[0]], [w_strides[0]])
    loops = [_Loop("0", str(cg_in), cg_in, x_strides[1], w_strides[1])]
    for axis in range(len(window.in_spatial)):
        k, s, d = window.kernel[axis], window.strides[axis], window.dilations[axis]
        n, o, pad = window.in_spatial[axis], window.out_spatial[axis], window.pads_begin[axis]
        x_stride = x_strides[2 + axis]
        origin = b.temp("int", _affine(_o(2 + axis), s, -pad), "y")
        x_terms.append((origin, x_stride))  # the input coordinate is origin + tap * d
        if pad > 0 or (o - 1) * s - pad + (k - 1) * d >= n:
            low, high = _tap_range(b, origin, k, d, n)
            loops.append(_Loop(low, high, k, d * x_stride, w_strides[2 + axis]))
        elif k > 1:
            loops.append(_Loop("0", str(k), k, d * x_stride, w_strides[2 + axis]))
    inner = max(loops, key=lambda loop: (loop.extent, loop.start == "0"))  # ties: a literal range, channels
    nest = _Nest(b)
    for loop in loops:
        if loop is not inner and not (loop.extent == 1 and loop.start == "0"):
            var = nest.loop_over(loop.start, loop.stop, "k")
            x_terms.append((var, loop.x_step))
            w_terms.append((var, loop.w_step))
    if inner.start != "0":
        x_terms.append((inner.start, inner.x_step))
        w_terms.append((inner.start, inner.w_step))
    count: int | str = inner.extent if inner.stop == str(inner.extent) and inner.start == "0" else (
        f"{inner.stop} - {inner.start}")
    dot_loop(b, acc, count, (Stream(x, x_terms, inner.x_step), Stream(w, w_terms, inner.w_step)), nest.indent)
    nest.close()
    _add_bias(b, node, acc)
    return _finish(b, group, acc)


def _transpose_pads_begin(node: ir.Node, in_spatial: Sequence[int], out_spatial: Sequence[int],
                          kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]) -> list[int]:
    """Leading pads of a ConvTranspose: explicit `pads`, or derived from the output size as the ONNX spec says."""
    rank = len(in_spatial)
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "VALID":
        return [0] * rank
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") or attr(node, "output_shape") is not None:
        output_padding = attr(node, "output_padding") or [0] * rank
        begins = []
        for n, o, k, s, d, extra in zip(in_spatial, out_spatial, kernel, strides, dilations, output_padding):
            total = s * (n - 1) + extra + (k - 1) * d + 1 - o
            begins.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
        return begins
    return list((attr(node, "pads") or [0] * (2 * rank))[:rank])


@register_kernel("ConvTranspose")
def emit_conv_transpose(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Gather form: y[o] sums x[i] * w[t] over taps t with i * s = o + pad - t * d, i in range.

    The autodiff uses it for Conv's input gradient and AveragePool's gradient; output_padding
    only lengthens the (already static) output, so the loop ignores it.
    """
    node = group.anchor
    x, w = node.inputs[0], node.inputs[1]
    x_shape, w_shape, y_shape = static_shape(x), static_shape(w), static_shape(node.outputs[0])
    groups = int(attr(node, "group", 1))
    in_spatial, out_spatial = x_shape[2:], y_shape[2:]
    rank = len(in_spatial)
    kernel = tuple(attr(node, "kernel_shape") or w_shape[2:])
    strides = tuple(attr(node, "strides") or [1] * rank)
    dilations = tuple(attr(node, "dilations") or [1] * rank)
    pads = _transpose_pads_begin(node, in_spatial, out_spatial, kernel, strides, dilations)
    cg_in, cg_out = w_shape[0] // groups, w_shape[1]
    x_strides, w_strides = strides_of(x_shape), strides_of(w_shape)
    b, acc = _builder(table, group, "conv")
    g = f"({_o(1)} / {cg_out})" if groups > 1 else "0"
    local = f"({_o(1)} % {cg_out})" if groups > 1 else _o(1)
    x_terms = _terms([_o(0), g], [x_shape[0], groups], [x_strides[0], cg_in * x_strides[1]])
    w_terms = _terms([g, local], [groups, cg_out], [cg_in * w_strides[0], w_strides[1]])
    shifted = [b.temp("int", _affine(_o(2 + axis), 1, pads[axis]), "q") for axis in range(rank)]
    nest = _Nest(b)
    for axis in range(rank):
        k, s, d, n, pad = kernel[axis], strides[axis], dilations[axis], in_spatial[axis], pads[axis]
        numerator = shifted[axis]
        if k > 1:
            tap = nest.loop(k, "k")
            numerator = b.fresh("q")
            nest.emit(f"const int {numerator} = {shifted[axis]} - {_affine(tap, d, 0)};")
            w_terms.append((tap, w_strides[2 + axis]))
        conditions = []
        if pad - (k - 1) * d < 0:
            conditions.append(f"{numerator} >= 0")
        if s > 1:
            conditions.append(f"{numerator} % {s} == 0")
        if (out_spatial[axis] - 1 + pad) // s >= n:
            conditions.append(f"{numerator} < {n * s}")
        if conditions:
            nest.open(f"if ({' && '.join(conditions)})")
        source = numerator
        if s > 1:
            source = b.fresh("y")
            nest.emit(f"const int {source} = {numerator} / {s};")
        x_terms += _terms([source], [n], [x_strides[2 + axis]])
    dot_loop(b, acc, cg_in, (Stream(x, x_terms, x_strides[1]), Stream(w, w_terms, w_strides[0])), nest.indent)
    nest.close()
    _add_bias(b, node, acc)
    return _finish(b, group, acc)
