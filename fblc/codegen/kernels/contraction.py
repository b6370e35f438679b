"""Contraction kernels: MatMul and Gemm with their fused epilogue (the reduction paths they share with the convs:
contraction_paths.py).

Each lane's reduction ends in a float accumulator `acc` (fp32 even over half textures, since
`read_imagef` returns float); the elementwise nodes the fuse pass attached (group.nodes[1:])
are evaluated on it and every value in `group.outputs` is written.

Texel-wide (texel.py) when N, the output's innermost axis, is a multiple of 4: a texel's
lanes are 4 consecutive columns, so they share A's row (read once, as texels along K) and
read B' four columns at a time. When N is not a multiple of 4 but at least ROW_MIN (attention's
scores over 65 tokens: contraction_paths.ROW_MIN), the texels within one output row take that path too, B' read
at an unaligned column, and the few that cross a row compute per lane (reduce_guarded); a work-item may take a tile of
texels N apart (the same columns of rows 4 apart, which share each B' window: reduce_rows_apart).
Otherwise one lane computes one element with `dot_loop`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
import dataclasses

import numpy as np
import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, TEXEL_INDEX, KernelBuilder, lane_axis
from fblc.codegen.cl import Kernel, strides_of
from fblc.codegen.indexing import digit_terms, index_var
from fblc.codegen.ir import FLOAT, INT, Block, Expr, const, flat_index
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.kernels.accumulators import VECTOR_TEXELS
from fblc.codegen.kernels.contraction_paths import (Build, Stream, Terms, dot_loop, finish_group, reduce_guarded,
                                                    reduce_into, reduce_rows_apart, row_axis, rows_apart,
                                                    start_builder)
from fblc.codegen.reads import TEXEL_ALONE, ValueReads
from fblc.codegen.kernels.texel import LANES, Reduction, plus
from fblc.codegen.kernels.reduction_terms import Blocked, Loop, Operand, Product, Term
from fblc.codegen.textures import TextureTable
from fblc.compiler.index_map import SubAxis, common_digits
from fblc.compiler.values import attr, static_shape

Digits = list[SubAxis]  # an axis's (extent, stride) digits, outermost first (IndexMap.sub_axes)

MATMUL_BLOCK = 16  # K steps per static block of the texel-wide path (divided by the tile's rows)


@functools.lru_cache(maxsize=256)
def _tile_products(steps: range, rows: int, width: int, a_step: int, a_row: int, w_step: int,
                   w_lane: int) -> tuple[Product, ...]:
    """The products of a tile's block (cached, so immutable: a model's layers repeat the same contractions)."""
    return tuple(Product(row * width + column, r * a_step + row * a_row, r * w_step + column * w_lane)
                 for r in steps for row in range(rows) for column in range(width))


# MatMul / Gemm ----------------------------------------------------------------------------------

def root_digits(b: ValueReads, value: ir.Value, shape: Sequence[int]) -> tuple[ir.Value, list[Digits]]:
    """The tensor holding `value` and each axis's digits (extent, stride) in it, outermost first: one
    digit per axis unless the view folds it (`shape`: value's shape, or its 2-D promotion)."""
    root, index_map = b.strided(value)
    if len(index_map.shape) == len(shape):
        return root, [index_map.sub_axes(k) for k in range(len(shape))]
    assert index_map.contiguous, f"1-D strided view '{value.name}'"
    return root, [[(dim, stride)] for dim, stride in zip(shape, strides_of(shape))]


def matmul_operands(b: ValueReads, node: ir.Node) -> tuple[tuple[ir.Value, list[Digits]], ...]:
    """A MatMul's A' and B' as root_digits gives them: a 1-D A is a row [1, K], a 1-D B a column [K, 1]."""
    a_shape, b_shape = (static_shape(value) for value in node.inputs)
    return (root_digits(b, node.inputs[0], a_shape if len(a_shape) >= 2 else (1, a_shape[0])),
            root_digits(b, node.inputs[1], b_shape if len(b_shape) >= 2 else (b_shape[0], 1)))


def block_steps(rows: int, columns: int) -> int:
    """K steps per static block of the texel-wide path for a tile of `rows` x `columns` texels."""
    return max(LANES, MATMUL_BLOCK // (rows * columns)) if rows * columns > 1 else MATMUL_BLOCK


def tile_reduction(k_digits: Digits, rows: int, columns: int) -> tuple[int, int]:
    """(multiply-adds per accumulator, iterations of the loop a work-group may deal out) of the texel-wide
    path's reduction over K cut into `k_digits` (outermost first) for a tile of `rows` x `columns` texels,
    as Reduction.serial and Reduction.shared_loop count them: the outer digits' loops and the blocks of
    block_steps along the innermost one."""
    *outer, (k_inner, _) = k_digits
    steps = block_steps(rows, columns)
    looped = k_inner - k_inner % steps
    return k_inner * math.prod(extent for extent, _ in outer), max([extent for extent, _ in outer]
                                                                    + [looped // steps if looped > steps else 0])


def tile_fetches(a_step: int, a_row: int, w_step: int, w_lane: int) -> Callable[[tuple[int, int]], float]:
    """Texel fetches per K step of a (rows, texel columns) tile on the texel-wide path, given the strides of
    K and M in A's root (`a_step`, `a_row`) and of K and N in B's (`w_step`, `w_lane`); a stride of 1 is
    the axis a texel's 4 lanes run along. A's texel holds 4 steps of a row (K along lanes), or 4 of the
    tile's rows (M along lanes: a one-row tile uses one lane of each), else one element; B's holds a
    texel column (N along lanes) or 4 steps of a column (K along lanes), else one element."""
    def fetches(tile: tuple[int, int]) -> float:
        rows, columns = tile
        a = rows / LANES if a_step == 1 else max(1.0, rows / LANES) if a_row == 1 else float(rows)
        return a + columns * (1 if 1 in (w_lane, w_step) else LANES)

    return fetches


def merged_rows(a_axes: list[Digits], w_axes: list[Digits]) -> int | None:
    """The rows of A' over its batch axes and M as one run, where a tile of whole rows cannot take M alone
    (M % 4 != 0: a ViT's 65 tokens) and B' has no batch of its own (a weight: [4, 65, 128] @ [128, 512] is
    [260, 128] @ [128, 512]): the run's length, else None. Where its digits are not one stride apart each
    (heads split: [4, 65, 4, 32] rows 64 apart within a batch, 8320 across), a tile's rows each get their
    own base (row_digits, reduction_terms.Operand.rows)."""
    rows = a_axes[-2][-1][0]
    if len(a_axes) < 3 or rows % LANES == 0 or any(extent != 1 for axis in w_axes[:-2] for extent, _ in axis):
        return None
    return math.prod(extent for extent, _ in row_digits(a_axes))


def row_digits(a_axes: list[Digits]) -> Digits:
    """The digits (extent, stride) of A's rows over its batch axes and M, outermost first (extents of 1 left out)."""
    return [digit for axis in a_axes[:-1] for digit in axis if digit[0] != 1]


def one_stride(digits: Digits) -> bool:
    """Whether mixed-radix `digits` (outermost first) step through their run by one stride."""
    return all(outer_stride == inner * inner_stride
               for (_, outer_stride), (inner, inner_stride) in zip(digits, digits[1:]))


def texel_columns(out_shape: Sequence[int], w_axes: list[Digits], has_n: bool = True) -> bool:
    """Whether a texel's lanes are 4 consecutive output columns n, one stride apart in B' (the texel-wide path)."""
    return has_n and lane_axis(out_shape) == len(out_shape) - 1 and w_axes[-1][-1][0] % LANES == 0


def _contract(b: KernelBuilder, a: tuple[ir.Value, list[Digits]], w: tuple[ir.Value, list[Digits]], batch: int,
              has_m: bool = True, has_n: bool = True) -> Expr:
    """The lane's sum over K of A'[..., m, k] * B'[k, n] for output [batch axes..., m, n] (a missing m or n,
    a 1-D operand's, is index 0). A' and B' are their roots and axis digits (root_digits): a remapped view
    (W^T, X^T of the backward) is walked in its root, a folded K (heads merged after a transpose) as a loop
    per outer digit around its innermost `k_inner` steps."""
    (a_root, a_axes), (w_root, w_axes) = a, w
    k_digits = common_digits([a_axes[-1], w_axes[-2]])
    assert k_digits is not None, f"{b.name}: K folds differently in its operands (tile_remap keeps such views)"
    (*a_outer, (k_inner, a_step)), (*w_outer, (_, w_step)) = k_digits
    (_, a_row), (_, w_lane) = a_axes[-2][-1], w_axes[-1][-1]  # innermost digits: one stride apart
    if merged_rows(a_axes, w_axes) and row_digits(a_axes):  # a tile's rows run over batch x M: consecutive rows are
        a_row = row_digits(a_axes)[-1][1]  # its innermost digit of more than one row apart (M = 1: a batch axis's)
    texel = texel_columns(b.out_shape, w_axes, has_n)
    # N % 4 != 0 (a ViT's 65 tokens): texels within one output row reduce their 4 columns together, the
    # few that cross a row per lane (reduce_guarded); the schedule keeps such a kernel at one texel per item
    single = b.schedule.texels_per_item == 1 or rows_apart(b.schedule, b.out_shape)
    row = None if texel or not (has_m and has_n) or not single else row_axis(b.out_shape)
    if row is not None and row[0] != len(b.out_shape) - 1:
        row = None
    rows, columns = b.schedule.tile_rows, b.schedule.tile_columns  # kernels/schedules.py: 1 off the texel path

    def operand_terms(prefix: str, tiled: bool) -> tuple[Terms, Terms, dict[Expr, int], Expr, Expr, list[Expr]]:
        """A' and B' base terms for the output index named by `prefix`, what the index variables are multiples
        of (`tiled`: n the texel's first column, m the tile's first row), the m and n variables, and where a
        tile's rows of A are no one stride apart, each row's own base (else none)."""
        m_var = index_var(prefix, batch) if has_m else const(0)
        n_var = index_var(prefix, batch + has_m) if has_n else const(0)
        var_multiples: dict[Expr, int] = {n_var: LANES, m_var: rows} if tiled else {}
        multiples: dict[Expr, int] = {}

        def base(axes: list[Digits], kept: Expr, kept_axis: int) -> Terms:
            """Index terms over the batch axes and the kept matrix axis, dropping axes of extent 1. A folded
            axis gives a term per digit; its innermost digit `v % e` is a multiple of gcd(multiple of v, e)."""
            terms: Terms = []
            indexed = [(index_var(prefix, batch - len(axes) + 2 + k), axes[k]) for k in range(len(axes) - 2)]
            for var, digits in indexed + [(kept, axes[kept_axis])]:
                if np.prod([extent for extent, _ in digits]) != 1:
                    terms += digit_terms(var, digits)
                    if len(digits) > 1:
                        multiples[terms[-1][0]] = int(np.gcd(var_multiples.get(var, 1), digits[-1][0]))
            return terms

        a_terms, w_terms = base(a_axes, m_var, -2), base(w_axes, n_var, -1)
        a_rows: list[Expr] = []
        if tiled and has_m and rows > 1 and merged_rows(a_axes, w_axes):  # a tile's rows may cross A's batch axes:
            # A's row is the output's flat row over them (the builder declares the multi-index from it)
            batch_vars = [index_var(prefix, batch - len(a_axes) + 2 + k) for k in range(len(a_axes) - 2)]
            extents = [math.prod(extent for extent, _ in axis) for axis in a_axes[:-1]]
            flat_row = flat_index([(var, math.prod(extents[k + 1:])) for k, var in enumerate([*batch_vars, m_var])])
            digits = row_digits(a_axes)
            if one_stride(digits):
                a_terms = [(flat_row, a_row)]
                multiples[flat_row] = LANES  # the tile's first row: a multiple of its rows (4, 8 or 16)
            else:  # each row of the tile its own base: its digits of the flat row, no stride stepping through them
                a_terms, a_rows = [], [flat_index(digit_terms(plus(flat_row, row), digits)) for row in range(rows)]
        return a_terms, w_terms, multiples, m_var, n_var, a_rows

    def k_loops() -> list[Loop]:
        return [Loop.over(b.body.var("kd", INT), 0, extent, a_stride, w_stride, extent)
                for (extent, a_stride), (_, w_stride) in zip(a_outer, w_outer)]

    def per_lane(block: Block) -> Expr:
        """The lane's own dot product (prefix OUT_INDEX) built into `block`: its accumulator."""
        a_terms, w_terms, _, _, _, _ = operand_terms(OUT_INDEX, False)
        acc = block.mutable(const(0.0, FLOAT), "acc")
        dot_loop(b, acc, k_inner, (Stream(a_root, a_terms, a_step), Stream(w_root, w_terms, w_step)), block,
                 k_loops())
        return acc

    if not texel and row is None:
        return per_lane(b.body)
    a_terms, w_terms, multiples, m_var, n_var, a_rows = operand_terms(TEXEL_INDEX, texel)
    # what the index variables are multiples of: the texel's lanes, the tile's rows, folded axes' digits
    known = ({n_var: LANES} | ({m_var: LANES} if rows > 1 else {}) if texel else {}) | multiples
    def builder(a_terms: Terms, w_terms: Terms, rows: int, row_step: int, a_rows: Sequence[Expr] = ()) -> Build:
        """The Reduction of a tile of `rows` rows `row_step` of A's rows apart from the operands' base terms, or
        where `a_rows` gives them, each row of A from its own base (reduction_terms.Operand.rows: offsets a span
        apart)."""
        width, steps = LANES * columns, block_steps(rows, columns)
        span = 1 << (k_inner * a_step + LANES).bit_length() if a_rows else 0  # past any offset within a row
        blocked = Blocked(k_inner, steps, a_step, w_step, 0,
                          lambda indices: _tile_products(indices, rows, width, a_step, span or row_step * a_row,
                                                         w_step, w_lane))
        a_operand, w_operand = (Operand(root, [Term(var, stride, known.get(var, 1)) for var, stride in terms])
                                for root, terms in ((a_root, a_terms), (w_root, w_terms)))
        # a row's base: a multiple of its digits' strides (of 4 where all are: whole texels along K)
        multiple = functools.reduce(math.gcd, [stride for _, stride in row_digits(a_axes)], LANES) if a_rows else 1

        def build(block: Block) -> Reduction:
            bases = tuple(Term(block.let(base, "ar"), 1, multiple) for base in a_rows)
            a_tile = dataclasses.replace(a_operand, rows=bases, row_span=span)
            return Reduction(a_tile, w_operand, blocked, k_loops(), widest=VECTOR_TEXELS[-1])

        return build

    if row is not None and rows > 1:  # a tile of rows LANES apart within one row and batch, else texel by texel
        alone_a, alone_w, _, _, alone_n, _ = operand_terms(TEXEL_ALONE, False)
        last_row = b.out_shape[-2] - 1 - LANES * (rows - 1)
        return reduce_rows_apart(b, n_var.le(row[1] - LANES).logical_and(m_var.le(last_row)),
                                 builder(a_terms, w_terms, rows, LANES), alone_n.le(row[1] - LANES),
                                 builder(alone_a, alone_w, 1, 1), per_lane)
    build = builder(a_terms, w_terms, rows, 1, a_rows)
    if row is not None:  # texels within one row reduce together, the ones across two per lane
        return reduce_guarded(b, n_var.le(row[1] - LANES), build, per_lane)
    return reduce_into(b, build, rows * LANES * columns)


@register_kernel("MatMul")
def emit_matmul(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """numpy matmul: batch dims broadcast, a 1-D A is a row [1, K], a 1-D B a column [K, 1]."""
    b = start_builder(table, group, "matmul")
    a, w = matmul_operands(b, group.anchor)
    ranks = [len(static_shape(value)) for value in group.anchor.inputs]
    acc = _contract(b, a, w, max(len(a[1]), len(w[1])) - 2, ranks[0] >= 2, ranks[1] >= 2)
    return finish_group(b, group, acc)


@register_kernel("Gemm")
def emit_gemm(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Y = alpha * A' B' + beta * C, A' = A^T when transA (B' likewise); C broadcasts to [M, N]."""
    node = group.anchor
    c = node.inputs[2] if len(node.inputs) > 2 else None
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    b = start_builder(table, group, "matmul")
    (a_root, a_axes), (w_root, w_axes) = (root_digits(b, value, static_shape(value)) for value in node.inputs[:2])
    result = _contract(b, (a_root, a_axes[::-1] if attr(node, "transA", 0) else a_axes),
                       (w_root, w_axes[::-1] if attr(node, "transB", 0) else w_axes), 0)
    if alpha != 1.0:
        result = const(alpha, FLOAT) * result
    if c is not None and beta != 0.0:
        c_value = b.broadcast(c, b.out_shape)
        result = result + c_value if beta == 1.0 else result + const(beta, FLOAT) * c_value
    return finish_group(b, group, result)
