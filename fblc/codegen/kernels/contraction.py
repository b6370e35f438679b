"""Contraction kernels: MatMul and Gemm with their fused epilogue, and what conv.py and conv_transpose.py share.

Each lane's reduction ends in a float accumulator `acc` (fp32 even over half textures, since
`read_imagef` returns float); the elementwise nodes the fuse pass attached (group.nodes[1:])
are evaluated on it and every value in `group.outputs` is written.

Texel-wide (texel.py) when N, the output's innermost axis, is a multiple of 4: a texel's
lanes are 4 consecutive columns, so they share A's row (read once, as texels along K) and
read B' four columns at a time (one texel per k for an untransposed B, a texel per lane along
K for B^T). Otherwise one lane computes one element with `dot_loop`: shapes and strides are
literals, base indices are hoisted out of the loop, the loop steps pointers, and an operand
walked contiguously from a texel boundary is read four values per texel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fblc.bundle_format import MASK_FORMATS
from fblc.codegen.builder import OUT_INDEX, TEXEL_INDEX, KernelBuilder, lane_axis
from fblc.codegen.cl import Kernel, strides_of
from fblc.codegen.indexing import declare_index, digit_terms, index_var
from fblc.codegen.ir import (FLOAT, FLOAT4, INT, Assign, Block, Break, Declare, Element, Expr, For, If, Var, Vector,
                             call, const, flat_index, select)
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.kernels.elementwise import evaluate_chain
from fblc.codegen.reads import ValueReads
from fblc.codegen.schedule import resolve_group
from fblc.codegen.kernels.texel import LANES, Blocked, Loop, Operand, Product, Reduction, Term
from fblc.codegen.textures import TextureTable
from fblc.errors import UnsupportedOpError
from fblc.compiler.index_map import SubAxis, common_digits
from fblc.compiler.values import attr, is_float, static_shape

Terms = list[tuple[Expr, int]]
Digits = list[SubAxis]  # an axis's (extent, stride) digits, outermost first (IndexMap.sub_axes)
Build = Callable[[Block], Reduction]  # builds a Reduction, its index values declared into the block


@dataclass
class Stream:
    """An operand walked by a reduction: element `base + r * step` for r = 0, 1, ..."""

    value: ir.Value
    terms: Terms  # base index as (int expression, literal stride)
    step: int

    def aligned(self) -> bool:
        """True when every base is a multiple of 4 and the walk is contiguous: one texel holds 4 steps."""
        return self.step == 1 and all(stride % 4 == 0 for _, stride in self.terms)


def index_terms(variables: Sequence[Expr], dims: Sequence[int], strides: Sequence[int]) -> Terms:
    """Index terms, dropping axes of extent 1 (their index is always 0)."""
    return [(var, stride) for var, dim, stride in zip(variables, dims, strides) if dim != 1]


ROW_MIN = 6  # the shortest row whose texels may take the texel-wide path when they do not cross it


def row_axis(shape: Sequence[int], first: int = 0) -> tuple[int, int] | None:
    """(axis, length) of the innermost non-unit axis when a texel's 4 lanes usually lie within one
    of its rows but not always (length >= ROW_MIN, not a multiple of 4); None if not, or if the
    axis is before `first`."""
    for axis in reversed(range(len(shape))):
        if shape[axis] != 1:
            ok = axis >= first and shape[axis] >= ROW_MIN and shape[axis] % LANES != 0
            return (axis, shape[axis]) if ok else None
    return None


def _check_float(node: ir.Node) -> None:
    """The loops accumulate in float and read float elements; integer contractions are not training ops."""
    for value in node.inputs:
        if value is not None and not is_float(value):
            raise UnsupportedOpError(f"{node.op_type} '{node.name}' has a non-float input '{value.name}'",
                                     "only float contractions have kernels; cast the operands to float")


def dot_loop(b: KernelBuilder, acc: Var, count: int | Expr, streams: tuple[Stream, Stream],
             block: Block | None = None) -> None:
    """Build `acc += sum_r a[r] * w[r]` over `count` steps of the two streams into `block` (the lane loop's).

    A literal count is unrolled by 4 into float4 dot products; an aligned stream fills its
    float4 with one texel read, the other with four element reads; a scalar tail covers count % 4.
    A runtime count (e.g. the in-bounds taps of a border pixel) is a plain loop.
    """
    block = block if block is not None else b.body
    if isinstance(count, int) and count <= 0:
        return
    pointers = [block.mutable(flat_index(s.terms), "p") for s in streams]
    product = b.element(streams[0].value, pointers[0]) * b.element(streams[1].value, pointers[1])
    if count == 1:
        block.assign(acc, product, "+=")
        return
    main = count - count % 4 if isinstance(count, int) else 0
    if main:
        vectors: list[Expr] = []
        for p, s in zip(pointers, streams):
            if s.aligned() and b.constant_value(s.value) is None:
                argument, texture = b.input_argument(s.value)
                vectors.append(b.texel(argument, texture, p >> 2))
            else:
                vectors.append(Vector(FLOAT4, tuple(b.element(s.value, p if k == 0 else p + k * s.step)
                                                    for k in range(4))))
        with block.loop("r", 0, main, step=4) as (_, body):
            body.assign(acc, call("dot", *vectors, dtype=FLOAT), "+=")
            body.add(*(Assign(p, const(4 * s.step), "+=") for p, s in zip(pointers, streams)))
    if not isinstance(count, int) or count % 4:  # a runtime count, or the scalar tail
        with block.loop("r", main, count) as (_, body):
            body.assign(acc, product, "+=")
            body.add(*(Assign(p, const(s.step), "+=") for p, s in zip(pointers, streams)))


def finish_group(b: KernelBuilder, group: KernelGroup, acc: Expr) -> list[Kernel]:
    """Apply the fused epilogue to `acc` and write every value the rest of the step reads."""
    env = evaluate_chain(b, group.nodes[1:], {id(group.anchor.outputs[0]): acc})
    return [b.finish([env[id(v)] for v in group.outputs])]


def start_builder(table: TextureTable, group: KernelGroup, family: str) -> KernelBuilder:
    _check_float(group.anchor)
    b = KernelBuilder(table, group.name, family, group.outputs)
    b.nodes.append(group.anchor.name)
    return b


def zero_acc(b: KernelBuilder) -> Var:
    """A per-lane accumulator starting at 0 (the per-lane code paths)."""
    return b.body.mutable(const(0.0, FLOAT), "acc")


def reduce_into(b: KernelBuilder, build: Build, lanes: int = LANES) -> Expr:
    """Build the Reduction `build` makes: in the per-texel prologue for the lanes of a work-item
    (4 * b.texels_per_item), in the lane loop for 1.

    Returns the lane's accumulator in the lane loop, where the epilogue runs.
    """
    if lanes == 1:
        return b.body.let(reduce_lane(b, b.body, build), "acc")
    prologue = b.prologue
    reduction = build(prologue)
    group = _tile_group(b, reduction, lanes)
    accs = reduction.emit(b, prologue, lanes, group=group)
    if group:
        prologue.add(*b.merge_tiles_across_group(accs, lanes))
    return b.body.let(Element(accs, b.lane_of_item), "acc")


def _tile_group(b: KernelBuilder, reduction: Reduction, lanes: int) -> int | None:
    """Work-items that share each tile's `reduction` (a work-group per tile, schedule.resolve_group),
    made the builder's; a group smaller than a wave holds several tiles (Profile.tiles_per_group).
    Where one work-item alone would run more than SERIAL_REDUCTION multiply-adds per accumulator: the
    weight gradients, whose reduction is a whole dY map or batch x sequence. None for a kernel with
    mask outputs (their bytes pair texels of two work-items), which keeps one work-item per tile."""
    if b.group_size is not None:
        return None
    masks = any(texture.format in MASK_FORMATS.values() for texture in b.out_textures)
    tiles = b.out_textures[0].texels * LANES // lanes
    b.group_size = resolve_group(b.schedule, b.table.profile, reduction.serial(lanes), reduction.shared_loop()[1],
                                 lanes, tiles, masks)
    if b.group_size is not None:
        b.tiles_per_group = b.table.profile.tiles_per_group(b.group_size, lanes, b.items)
    return b.group_size


def reduce_lane(b: KernelBuilder, block: Block, build: Build) -> Expr:
    """Build, into `block` of the lane loop, the one-lane Reduction `build` makes; its sum."""
    reduction = build(block)
    return Element(reduction.emit(b, block, 1), const(0))


def reduce_guarded(b: KernelBuilder, guard: Expr, build: Build, fallback: Callable[[Block], Expr],
                   lanes: int = LANES) -> Expr:
    """Work-items whose texels meet `guard` (e.g. they do not cross the end of a row) reduce their
    `lanes` (4 * b.texels_per_item) together in the per-texel prologue; the others per lane, with
    what `fallback` builds into the block it gets, in a loop of their own before the lane loop
    (b.lane_fallback): kept out of the unrolled lane loop, the rare lanes' loops and index arithmetic
    stay one copy, away from the registers of the texel-wide path (MobileNetV2's row kernels ran 5-25 %
    faster).

    Returns the lane's accumulator in the lane loop, where the epilogue runs.
    """
    prologue = b.prologue
    whole = prologue.let(guard, "whole")
    accs = build(prologue).emit(b, prologue, lanes, whole)
    prelude = list(b.lines)  # the lane loop's own index variables so far (a flattened view's)
    outside = Block(b.numbering, b.lane_fallback)  # type: ignore[arg-type]
    leftover = outside.array("fb", FLOAT, LANES, [const(0.0, FLOAT)] * LANES)
    lane_body: list = []
    outside.add(If(~whole, [For(b.lane, const(0), const(LANES), lane_body)]))
    lane = Block(b.numbering, lane_body)
    numel = b.out_textures[0].numel
    lane.add(Declare(b.flat, b.t * 4 + b.lane))
    if numel % LANES:
        lane.add(If(b.flat.ge(numel), [Break()]))
    declare_index(lane, b.out_shape, b.flat, OUT_INDEX)
    lane.add(*prelude)
    lane_loop, b.lines = b.lines, lane_body  # what the fallback builds through b goes here too
    try:
        value = fallback(lane)
    finally:
        b.lines = lane_loop
    lane.assign(Element(leftover, b.lane), value)
    return b.body.let(select(whole, Element(accs, b.lane_of_item), Element(leftover, b.lane)), "acc")


def _texel_dot(b: KernelBuilder, a: Operand, a_step: int, w: Operand, w_step: int, w_lane: int, k: int,
               tile: tuple[int, int] = (1, 1), a_row: int = 0, loops: Sequence[Loop] = ()) -> Expr:
    """acc[row, column] = sum_r A'[row, r] * B'[r, column] in blocks of steps along K, over the
    work-item's tile of `tile` = (rows, texel columns) outputs (`a_row`: A's stride between rows;
    `loops`: the outer digits of a folded K, around the blocks, which walk its innermost `k` steps)."""
    rows, columns = tile

    def products(steps: range) -> Sequence[Product]:
        return _tile_products(steps, rows, LANES * columns, a_step, a_row, w_step, w_lane)

    block = max(LANES, MATMUL_BLOCK // (rows * columns)) if rows * columns > 1 else MATMUL_BLOCK
    blocked = Blocked(k, block, a_step, w_step, 0, products)
    return reduce_into(b, lambda _: Reduction(a, w, blocked, list(loops)), rows * LANES * columns)


@functools.lru_cache(maxsize=256)
def _tile_products(steps: range, rows: int, width: int, a_step: int, a_row: int, w_step: int,
                   w_lane: int) -> tuple[Product, ...]:
    """The products of a tile's block (cached, so immutable: a model's layers repeat the same contractions)."""
    return tuple(Product(row * width + column, r * a_step + row * a_row, r * w_step + column * w_lane)
                 for r in steps for row in range(rows) for column in range(width))


def _texel_terms(terms: Terms, *aligned_vars: Expr, multiples: dict[Expr, int] | None = None) -> list[Term]:
    """Terms whose variables in `aligned_vars` are known multiples of 4 (a texel's lanes, a tile's rows),
    and the digit expressions in `multiples` multiples of their value there."""
    known = {var: LANES for var in aligned_vars} | (multiples or {})
    return [Term(var, stride, known.get(var, 1)) for var, stride in terms]


def _axis_terms(axes: Sequence[tuple[Expr, Digits]], var_multiples: dict[Expr, int], multiples: dict[Expr, int]
                ) -> Terms:
    """Index terms of the axes (index variable, digits), dropping axes of extent 1. A folded axis
    gives a term per digit; its innermost digit `v % e` is a multiple of gcd(multiple of v, e),
    recorded in `multiples` for the texel path's alignment (`var_multiples`: what each v is a multiple of)."""
    terms: Terms = []
    for var, digits in axes:
        if np.prod([extent for extent, _ in digits]) == 1:
            continue
        parts = digit_terms(var, digits)
        if len(parts) > 1:
            multiples[parts[-1][0]] = int(np.gcd(var_multiples.get(var, 1), digits[-1][0]))
        terms += parts
    return terms


# MatMul / Gemm ----------------------------------------------------------------------------------

def _root_strides(b: ValueReads, value: ir.Value, shape: Sequence[int]) -> tuple[ir.Value, list[int]]:
    """The tensor holding `value` and `value`'s strides in it (`shape`: value's shape, or its 2-D promotion)."""
    root, axes = root_digits(b, value, shape)
    assert all(len(digits) == 1 for digits in axes), f"folded view '{value.name}' read by a Gemm"
    return root, [digits[0][1] for digits in axes]


def root_digits(b: ValueReads, value: ir.Value, shape: Sequence[int]) -> tuple[ir.Value, list[Digits]]:
    """The tensor holding `value` and each axis's digits (extent, stride) in it, outermost first: one
    digit per axis unless the view folds it (`shape`: value's shape, or its 2-D promotion)."""
    root, index_map = b.strided(value)
    if len(index_map.shape) == len(shape):
        return root, [index_map.sub_axes(k) for k in range(len(shape))]
    assert index_map.contiguous, f"1-D strided view '{value.name}'"
    return root, [[(dim, stride)] for dim, stride in zip(shape, strides_of(shape))]


MATMUL_BLOCK = 16  # K steps per static block of the texel-wide path (divided by the tile's rows)


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
    b = start_builder(table, group, "matmul")
    # a remapped view (W^T, X^T of the backward) is walked in its root with the view's strides; a
    # folded K axis (heads merged after a transpose) is walked as a loop per outer digit
    (a_root, a_axes), (w_root, w_axes) = root_digits(b, a, a2), root_digits(b, w, b2)
    k_digits = common_digits([a_axes[-1], w_axes[-2]])
    assert k_digits is not None, f"{node.name}: K folds differently in its operands (tile_remap keeps such views)"
    (*a_outer, (k_inner, a_step)), (*w_outer, (_, w_step)) = k_digits
    (_, a_row), (n_run, w_lane) = a_axes[-2][-1], w_axes[-1][-1]  # innermost digits: one stride apart
    # lanes: 4 consecutive columns n, one stride apart in B
    texel = len(b_shape) >= 2 and lane_axis(b.out_shape) == len(b.out_shape) - 1 and n_run % LANES == 0
    prefix = TEXEL_INDEX if texel else OUT_INDEX
    # output axes of the batch dims, m and n; a missing m or n (1-D operand) is index 0
    m_var = index_var(prefix, nb) if len(a_shape) >= 2 else const(0)
    n_var = index_var(prefix, nb + (1 if len(a_shape) >= 2 else 0)) if len(b_shape) >= 2 else const(0)
    tile = b.schedule.tile_rows, b.schedule.tile_columns  # kernels/schedules.py: (1, 1) off the texel path
    var_multiples: dict[Expr, int] = {n_var: LANES, m_var: tile[0]} if texel else {}
    multiples: dict[Expr, int] = {}

    def base(axes: list[Digits], shape2: tuple[int, ...], kept: Expr, kept_axis: int) -> Terms:
        """Index terms over the batch dims and the kept matrix axis."""
        lead = nb - (len(shape2) - 2)
        indexed = [(index_var(prefix, lead + k), axes[k]) for k in range(len(shape2) - 2)] + [(kept, axes[kept_axis])]
        return _axis_terms(indexed, var_multiples, multiples)

    a_terms, w_terms = base(a_axes, a2, m_var, -2), base(w_axes, b2, n_var, -1)
    loop_vars = [b.body.var("kd", INT) for _ in a_outer]
    if texel:
        aligned = (n_var, m_var) if tile[0] > 1 else (n_var,)
        loops = [Loop.over(var, 0, extent, a_stride, w_stride, extent)
                 for var, (extent, a_stride), (_, w_stride) in zip(loop_vars, a_outer, w_outer)]
        acc: Expr = _texel_dot(b, Operand(a_root, _texel_terms(a_terms, *aligned, multiples=multiples)), a_step,
                               Operand(w_root, _texel_terms(w_terms, *aligned, multiples=multiples)), w_step, w_lane,
                               k_inner, tile, a_row, loops)
    else:
        acc = zero_acc(b)
        block = b.body
        for var, (extent, a_stride), (_, w_stride) in zip(loop_vars, a_outer, w_outer):
            body: list = []
            block.add(For(var, const(0), const(extent), body))
            block = Block(b.numbering, body)
            a_terms, w_terms = a_terms + [(var, a_stride)], w_terms + [(var, w_stride)]
        dot_loop(b, acc, k_inner, (Stream(a_root, a_terms, a_step), Stream(w_root, w_terms, w_step)), block)
    return finish_group(b, group, acc)


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
    b = start_builder(table, group, "matmul")
    texel = lane_axis(b.out_shape) == 1
    prefix = TEXEL_INDEX if texel else OUT_INDEX
    m_var, n_var = index_var(prefix, 0), index_var(prefix, 1)
    # A' [M, K]: element (m, k) is A[k, m] when transposed; B' [K, N]: (k, n) is B[n, k] when transposed
    a_root, (a_s0, a_s1) = _root_strides(b, a, a_shape)
    b_root, (b_s0, b_s1) = _root_strides(b, w, b_shape)
    (m_stride, ak_stride), (bk_stride, n_stride) = ((a_s1, a_s0) if trans_a else (a_s0, a_s1),
                                                    (b_s1, b_s0) if trans_b else (b_s0, b_s1))
    m_dim, n_dim = b.out_shape
    a_stream = Stream(a_root, index_terms([m_var], [m_dim], [m_stride]), ak_stride)
    b_stream = Stream(b_root, index_terms([n_var], [n_dim], [n_stride]), bk_stride)
    if texel:  # lanes: 4 consecutive columns n, one B' column each
        tile = b.schedule.tile_rows, b.schedule.tile_columns
        aligned = (n_var, m_var) if tile[0] > 1 else (n_var,)
        acc: Expr = _texel_dot(b, Operand(a_root, _texel_terms(a_stream.terms, *aligned)), a_stream.step,
                               Operand(b_root, _texel_terms(b_stream.terms, *aligned)), b_stream.step, n_stride,
                               k_dim, tile, m_stride)
    else:
        acc = zero_acc(b)
        dot_loop(b, acc, k_dim, (a_stream, b_stream))
    result = acc if alpha == 1.0 else const(alpha, FLOAT) * acc
    if c is not None and beta != 0.0:
        c_value = b.broadcast(c, b.out_shape)
        result = result + c_value if beta == 1.0 else result + const(beta, FLOAT) * c_value
    return finish_group(b, group, result)
