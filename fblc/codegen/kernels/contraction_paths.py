"""The reduction paths every contraction kernel takes (MatMul and Gemm in contraction.py, Conv and ConvTranspose).

A work-item's lanes reduce together in the per-texel prologue (reduce_into: texel.py's Reduction, a work-group per
tile where the reduction is long), one lane alone (reduce_lane), guarded where a texel may cross a row
(reduce_guarded: the rare lanes per lane in a loop of their own), or as a tile of texels N apart
(reduce_rows_apart); dot_loop is the one-lane loop over two element streams; finish_group applies the fused
epilogue and writes the group's outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx_ir as ir

from fblc.bundle_format import MASK_FORMATS
from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import Kernel
from fblc.codegen.indexing import declare_index
from fblc.codegen.ir import (FLOAT, FLOAT4, Assign, Block, Element, Expr, For, If, Var, Vector, call, const,
                             flat_index, select)
from fblc.codegen.kernels import KernelGroup
from fblc.codegen.kernels.elementwise import evaluate_chain
from fblc.codegen.reads import TEXEL_ALONE
from fblc.codegen.schedule import Schedule, resolve_group
from fblc.codegen.kernels.texel import LANES, Reduction
from fblc.codegen.kernels.reduction_terms import Loop, Term
from fblc.codegen.textures import TextureTable
from fblc.errors import UnsupportedOpError
from fblc.compiler.values import is_float

Terms = list[tuple[Expr, int]]
Build = Callable[[Block], Reduction]  # builds a Reduction, its index values declared into the block

ROW_MIN = 6  # the shortest row whose texels may take the texel-wide path when they do not cross it


@dataclass
class Stream:
    """An operand walked by a reduction: element `base + r * step` for r = 0, 1, ..."""

    value: ir.Value
    terms: Terms  # base index as (int expression, literal stride)
    step: int

    def extended(self, terms: Sequence[Term]) -> Stream:
        """The stream with a loop's terms added to its base."""
        return Stream(self.value, self.terms + [(term.expr, term.coeff) for term in terms], self.step)


def index_terms(variables: Sequence[Expr], dims: Sequence[int], strides: Sequence[int]) -> Terms:
    """Index terms, dropping axes of extent 1 (their index is always 0)."""
    return [(var, stride) for var, dim, stride in zip(variables, dims, strides) if dim != 1]


def row_axis(shape: Sequence[int], first: int = 0) -> tuple[int, int] | None:
    """(axis, length) of the innermost non-unit axis when a texel's 4 lanes usually lie within one
    of its rows but not always (length >= ROW_MIN, not a multiple of 4); None if not, or if the
    axis is before `first`."""
    axis = max((axis for axis, extent in enumerate(shape) if extent != 1), default=-1)
    ok = axis >= max(first, 0) and shape[axis] >= ROW_MIN and shape[axis] % LANES != 0
    return (axis, shape[axis]) if ok else None


def dot_loop(b: KernelBuilder, acc: Var, count: int, streams: tuple[Stream, Stream], block: Block,
             loops: Sequence[Loop] = ()) -> None:
    """Build `acc += sum_r a[r] * w[r]` over `count` steps of the two streams into `block` (the lane loop's),
    inside `loops`, each adding its terms to the streams' bases: unrolled by 4 into float4 dot products, a
    scalar loop for the rest."""
    for loop in loops:
        block = loop.open(block)
        streams = (streams[0].extended(loop.x_terms), streams[1].extended(loop.w_terms))
    pointers = [block.mutable(flat_index(s.terms), "p") for s in streams]
    product = b.element(streams[0].value, pointers[0]) * b.element(streams[1].value, pointers[1])
    if count == 1:
        block.assign(acc, product, "+=")
        return
    main = count - count % 4
    if main:
        vectors: list[Expr] = []
        for p, s in zip(pointers, streams):
            # contiguous from multiples of 4: its float4 is one texel read, else four element reads
            if s.step == 1 and all(stride % 4 == 0 for _, stride in s.terms) and b.constant_value(s.value) is None:
                vectors.append(b.texel(*b.input_argument(s.value), p >> 2))
            else:
                vectors.append(Vector(FLOAT4, tuple(b.element(s.value, p if k == 0 else p + k * s.step)
                                                    for k in range(4))))
        with block.loop("r", 0, main, step=4) as (_, body):
            body.assign(acc, call("dot", *vectors, dtype=FLOAT), "+=")
            body.add(*(Assign(p, const(4 * s.step), "+=") for p, s in zip(pointers, streams)))
    if count % 4:
        with block.loop("r", main, count) as (_, body):
            body.assign(acc, product, "+=")
            body.add(*(Assign(p, const(s.step), "+=") for p, s in zip(pointers, streams)))


def finish_group(b: KernelBuilder, group: KernelGroup, acc: Expr) -> list[Kernel]:
    """Apply the fused epilogue to `acc` and write every value the rest of the step reads."""
    env = evaluate_chain(b, group.nodes[1:], {id(group.anchor.outputs[0]): acc})
    return [b.finish([env[id(v)] for v in group.outputs])]


def start_builder(table: TextureTable, group: KernelGroup, family: str) -> KernelBuilder:
    """The group's builder; the loops accumulate in float and read float elements (integer contractions
    are not training ops)."""
    node = group.anchor
    for value in node.inputs:
        if value is not None and not is_float(value):
            raise UnsupportedOpError(f"{node.op_type} '{node.name}' has a non-float input '{value.name}'",
                                     "only float contractions have kernels; cast the operands to float")
    return KernelBuilder.for_group(table, group, family)


def reduce_into(b: KernelBuilder, build: Build, lanes: int = LANES) -> Expr:
    """Build the Reduction `build` makes: in the per-texel prologue for the lanes of a work-item
    (4 * b.texels_per_item), in the lane loop for 1; the lane's accumulator in the lane loop. A reduction
    longer than SERIAL_REDUCTION per accumulator (a weight gradient's) takes a work-group per tile
    (schedule.resolve_group), unless the kernel has mask outputs: their bytes pair texels of two work-items."""
    if lanes == 1:
        return b.body.let(reduce_lane(b, b.body, build), "acc")
    prologue, profile = b.prologue, b.table.profile
    reduction = build(prologue)
    masks = any(texture.format in MASK_FORMATS.values() for texture in b.out_textures)
    b.group_size = resolve_group(b.schedule, profile, reduction.serial(lanes), reduction.shared_loop()[1], lanes,
                                 b.out_textures[0].texels * LANES // lanes, masks)
    if b.group_size is not None:
        b.tiles_per_group = profile.tiles_per_group(b.group_size, lanes, b.items)
    accs = reduction.emit(b, prologue, lanes, group=b.group_size, stage=b.group_size is None)
    if b.group_size:
        prologue.add(*b.merge_tiles_across_group(accs, lanes))
    return b.body.let(Element(accs, b.lane_of_item), "acc")


def reduce_lane(b: KernelBuilder, block: Block, build: Build) -> Expr:
    """Build, into `block` of the lane loop, the one-lane Reduction `build` makes; its sum."""
    return Element(build(block).emit(b, block, 1), const(0))


def rows_apart(schedule: Schedule, out_shape: Sequence[int]) -> bool:
    """Whether a row path's work-item takes a tile of texels N apart (N = the row's length, out_shape[-1], not a
    multiple of 4): the same columns of rows LANES apart, whose texels start at the same place in their rows."""
    return schedule.tile_rows > 1 and schedule.tile_columns == 1 and schedule.tile_stride == out_shape[-1]


def reduce_rows_apart(b: KernelBuilder, guard: Expr, build: Build, texel_guard: Expr, build_texel: Build,
                      fallback: Callable[[Block], Expr]) -> Expr:
    """A row path's tile of texels N apart (rows_apart): where `guard` holds (its texels lie within their rows and
    one batch matrix) they reduce together in the prologue, each B' window read once for the tile's rows;
    else each texel on its own before the lane loop: the one-texel row path where `texel_guard` holds (its
    index as TEXEL_ALONE), per lane (`fallback`) where the texel crosses a row. The lane's accumulator."""
    prologue, schedule = b.prologue, b.schedule
    whole = prologue.let(guard, "whole")
    accs = build(prologue).emit(b, prologue, LANES * b.texels_per_item, whole)
    decided = schedule.accumulator_form, schedule.pair_stride  # the tile's, which plan.json records
    outside = Block(b.numbering, b.lane_fallback)  # type: ignore[arg-type]
    leftover = outside.array("fb", FLOAT, LANES, [const(0.0, FLOAT)] * LANES)
    alone = Block(b.numbering)
    declare_index(alone, b.out_shape, b.t * 4, TEXEL_ALONE)
    within = alone.let(texel_guard, "within")
    own = build_texel(alone).emit(b, alone, LANES, within)
    schedule.accumulator_form, schedule.pair_stride = decided
    copy = Block(b.numbering)
    copy.assign(Element(leftover, b.lane), Element(own, b.lane))
    lane = Block(b.numbering)
    b.lane_header(lane, b.lane)
    lane.add(*b.lines)  # the lane loop's own index variables so far (a flattened view's)
    lane.assign(Element(leftover, b.lane), fallback(lane))
    alone.add(If(within, [For(b.lane, const(0), const(LANES), copy.statements)]),
              If(~within, [For(b.lane, const(0), const(LANES), lane.statements)]))
    outside.add(If(~whole, alone.statements))
    return b.body.let(select(whole, Element(accs, b.lane_of_item), Element(leftover, b.lane)), "acc")


def reduce_guarded(b: KernelBuilder, guard: Expr, build: Build, fallback: Callable[[Block], Expr],
                   lanes: int = LANES) -> Expr:
    """Work-items whose texels meet `guard` (e.g. they do not cross the end of a row) reduce their
    `lanes` together in the per-texel prologue; the others per lane, with what `fallback` builds into the
    block it gets, in a loop before the lane loop (b.lane_fallback): out of the unrolled lane loop, the rare
    lanes' code stays one copy, away from the texel-wide path's registers (MobileNetV2's row kernels ran
    5-25 % faster). The lane's accumulator in the lane loop."""
    prologue = b.prologue
    whole = prologue.let(guard, "whole")
    accs = build(prologue).emit(b, prologue, lanes, whole)
    outside = Block(b.numbering, b.lane_fallback)  # type: ignore[arg-type]
    leftover = outside.array("fb", FLOAT, LANES, [const(0.0, FLOAT)] * LANES)
    lane = Block(b.numbering)
    b.lane_header(lane, b.lane)
    lane.add(*b.lines)  # the lane loop's own index variables so far (a flattened view's)
    lane.assign(Element(leftover, b.lane), fallback(lane))
    outside.add(If(~whole, [For(b.lane, const(0), const(LANES), lane.statements)]))
    return b.body.let(select(whole, Element(accs, b.lane_of_item), Element(leftover, b.lane)), "acc")
