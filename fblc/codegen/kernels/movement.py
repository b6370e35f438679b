"""Data-movement kernels: Transpose, Reshape and its kin, Expand, Slice, Pad, Concat, Split, ConstantOfShape.

Each output element reads one input element through an index map of the output's multi-index; a Concat
or constant Pad fused into an elementwise chain is an expression of that chain, by the same code. Movement
runs here only where tile_remap left a copy (docs/ARCHITECTURE.md §2), or under `--layout naive`.

A Transpose that moves the axis a texel's lanes walk (TransposeBlock: a weight's per-step W^T copy of
pass pointwise_transposes, a [M, K] -> [K, M]) reads each output texel's 4 lanes from 4 input texels, one
lane of each. Under R-Tile codegen its work-item takes a 4 x 4 block instead (kernels/schedules.py): 4
output texels along the axis fed by the input's lanes, read as 4 whole input texels, each lane used once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, TEXEL_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, strides_of
from fblc.codegen.indexing import broadcast_view_index, index_var, lane_axis
from fblc.codegen.ir import INT, Const, Expr, flat_index, select
from fblc.codegen.kernels import KernelGroup, lane_kernel, out_axis, register_kernel
from fblc.codegen.kernels.elementwise import Operand, emit_elementwise, expression
from fblc.codegen.textures import TextureTable
from fblc.codegen.reads import dtype_of
from fblc.compiler.index_map import IndexMap, map_of
from fblc.compiler.values import attr, choice_attr, ints_input, numel, slice_bounds, static_shape

FAMILY = "movement"
LANES = 4  # elements of a texel
#: (builder, node) -> the flat index in the node's input of the output element the lane computes
IndexMapOf = Callable[[KernelBuilder, ir.Node], Expr]


def _slice_index(shape: tuple[int, ...], starts: Sequence[int], steps: Sequence[int]) -> Expr:
    """The element of an input of `shape` that the output element of a slice (starts, steps per axis) reads."""
    strides = strides_of(shape)
    offset = sum(start * stride for start, stride in zip(starts, strides))
    return flat_index([(out_axis(k), step * stride) for k, (step, stride) in enumerate(zip(steps, strides))], offset)


def _transpose(b: KernelBuilder, node: ir.Node) -> Expr:
    in_shape = static_shape(node.inputs[0])
    perm = attr(node, "perm") or list(reversed(range(len(in_shape))))
    strides = strides_of(in_shape)
    return flat_index([(out_axis(k), strides[axis]) for k, axis in enumerate(perm)])


@dataclass(frozen=True)
class TransposeBlock:
    """A Transpose whose output lanes (axis `out_lanes`, the innermost non-unit one) come from input axis
    `perm[out_lanes]`, not from the input's lanes (axis `in_lanes`), which land on output axis `rows_axis`:
    4 consecutive positions along `rows_axis` (output texels `stride` apart) are the 4 lanes of one input
    texel for every output lane."""

    perm: tuple[int, ...]
    in_lanes: int
    out_lanes: int
    rows_axis: int
    stride: int


def transpose_block(node: ir.Node) -> TransposeBlock | None:
    """The 4 x 4 block geometry of a Transpose node (see TransposeBlock), or None where its lanes stay on one
    axis, an axis's length is no multiple of 4 or it reads a strided view of its input."""
    if node.op_type != "Transpose":
        return None
    x = node.inputs[0]
    in_shape, out_shape = static_shape(x), static_shape(node.outputs[0])
    perm = tuple(attr(node, "perm") or reversed(range(len(in_shape))))
    in_lanes, out_lanes = lane_axis(in_shape), lane_axis(out_shape)
    if in_lanes is None or out_lanes is None or perm[out_lanes] == in_lanes or not map_of(x).contiguous:
        return None
    rows_axis = perm.index(in_lanes)  # before out_lanes: out_lanes is the innermost non-unit axis
    return TransposeBlock(perm, in_lanes, out_lanes, rows_axis, numel(out_shape[rows_axis + 1:]) // LANES)


def _block_transposed(b: KernelBuilder, node: ir.Node, block: TransposeBlock) -> Expr:
    """The lane's element of a work-item's 4 x 4 block (its tile: 4 texels `stride` apart): output texel tt,
    lane l is lane tt of input texel l, the 4 of them read once in the per-texel prologue."""
    x = node.inputs[0]
    argument, texture = b.input_argument(x)
    strides = strides_of(static_shape(x))
    first = [index_var(TEXEL_INDEX, k) for k in range(len(block.perm))]  # the block's first output element
    source: list[Expr] = [Const(0, INT)] * len(strides)
    for k, axis in enumerate(block.perm):
        source[axis] = first[k]  # the input's lanes at the block's first row along rows_axis (a multiple of 4)
    texels = []
    for lane in range(LANES):
        at = list(source)
        at[block.perm[block.out_lanes]] = first[block.out_lanes] + lane
        texels.append(b.prologue.let(b.texel(argument, texture, flat_index(list(zip(at, strides))) >> 2), "T"))
    picked = functools.reduce(lambda rest, k: select(b.lane.eq(k), texels[k], rest), range(LANES - 2, -1, -1),
                              texels[-1])
    return picked.lane(b.tt)


INDEX_MAPS: dict[str, IndexMapOf] = {
    "Transpose": _transpose,
    "Slice": lambda b, node: _slice_index(static_shape(node.inputs[0]), *slice_bounds(node)[::2]),  # starts, steps
    "Expand": lambda b, node: broadcast_view_index(IndexMap.identity(static_shape(node.inputs[0])), b.out_shape,
                                                   OUT_INDEX),
    # a reshape that is not an index map: a copy (row-major order is unchanged)
    **dict.fromkeys(("Reshape", "Flatten", "Squeeze", "Unsqueeze"), lambda b, node: b.flat)}


@lane_kernel(FAMILY, *INDEX_MAPS)
def emit_index_map(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """Each output element reads one input element, through the op's INDEX_MAPS; a Transpose's work-item
    of a 4 x 4 block (kernels/schedules.py) reads whole texels (_block_transposed)."""
    block = transpose_block(node)
    if block is not None and (b.texels_per_item, b.item_columns, b.item_stride) == (LANES, 1, block.stride):
        return [_block_transposed(b, node, block)]
    return [b.element(node.inputs[0], INDEX_MAPS[node.op_type](b, node))]


@register_kernel("Split")
def emit_split(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """One slice kernel per output read outside the group."""
    node = group.anchor
    shape = static_shape(node.inputs[0])
    axis = int(attr(node, "axis", 0)) % len(shape)
    kernels, start = [], 0
    for k, output in enumerate(node.outputs):
        if output in group.outputs:
            b = KernelBuilder(table, f"{group.name}_{k}", FAMILY, [output])
            b.nodes.append(node.name)
            index = _slice_index(shape, [start if a == axis else 0 for a in range(len(shape))], [1] * len(shape))
            kernels.append(b.finish([b.element(node.inputs[0], index)]))
        start += static_shape(output)[axis]
    return kernels


#: Pad mode -> (the input position read below the input's start, above its end) for a position `s` counted
#: from the input's start on an axis of `dim` (ONNX keeps reflect pads under dim, wrap pads at most dim)
MIRRORED_SOURCES: dict[str, Callable[[Expr, int], tuple[Expr | int, Expr | int]]] = {
    "reflect": lambda s, dim: (-s, 2 * (dim - 1) - s),
    "edge": lambda s, dim: (0, dim - 1),
    "wrap": lambda s, dim: (s + dim, s - dim),
}


def _mirrored_pad_value(b: KernelBuilder, node: ir.Node, mode: str, sources: list[Expr], padded: list[int]) -> Expr:
    """A reflect / edge / wrap Pad's element: every output position reads an input position (MIRRORED_SOURCES)."""
    in_shape = static_shape(node.inputs[0])
    for k in padded:
        below, above = MIRRORED_SOURCES[mode](sources[k], in_shape[k])
        sources[k] = b.body.let(select(sources[k].lt(0), below, select(sources[k].ge(in_shape[k]), above,
                                                                          sources[k])), "src", INT)
    return b.element(node.inputs[0], flat_index(list(zip(sources, strides_of(in_shape)))))


def pad_value(b: KernelBuilder, node: ir.Node) -> Expr:
    """In the lane loop of a kernel shaped like the Pad's output: its element (constant mode: the fill outside
    the input; reflect, edge and wrap: the input position the mode names)."""
    mode = choice_attr(node, "mode", "constant", ("constant", *MIRRORED_SOURCES), "kernel")
    in_shape = static_shape(node.inputs[0])
    rank = len(in_shape)
    pads = ints_input(node, 1, "pads") or [0] * (2 * rank)
    axes = ints_input(node, 3, "axes") or list(range(rank))
    begins = {axis % rank: pads[k] for k, axis in enumerate(axes)}
    # an axis without pads maps onto itself: no bounds to check there (a size-1 axis' check was a constant)
    padded = sorted({axis % rank for k, axis in enumerate(axes) if pads[k] or pads[k + len(axes)]})
    sources = [out_axis(k) - begins[k] if begins.get(k) else out_axis(k) for k in range(rank)]
    if mode != "constant":
        return _mirrored_pad_value(b, node, mode, sources, padded)
    has_fill = len(node.inputs) > 2 and node.inputs[2] is not None
    fill = b.element(node.inputs[2], Const(0, INT)) if has_fill else Const(0, INT)
    inside = [sources[k].ge(0).logical_and(sources[k].lt(in_shape[k])) for k in padded] or [Const(1, INT)]
    flag = b.body.let(functools.reduce(Expr.logical_and, inside), "inside", INT)
    index = b.body.let(select(flag, flat_index(list(zip(sources, strides_of(in_shape)))), 0), "src", INT)
    return select(flag, b.element(node.inputs[0], index), fill.cast(dtype_of(node.outputs[0])))


def concat_value(b: KernelBuilder, node: ir.Node) -> Expr:
    """In the lane loop of a kernel shaped like the Concat's output: its element, read from the input
    whose range along the axis holds it."""
    out_shape = static_shape(node.outputs[0])
    axis = int(attr(node, "axis")) % len(out_shape)
    result = b.body.mutable(Const(0, dtype_of(node.outputs[0])), "v")
    along, start = out_axis(axis), 0
    for value in node.inputs:
        shape = static_shape(value)
        terms = [(along - start if k == axis and start else out_axis(k), stride)
                 for k, stride in enumerate(strides_of(shape))]
        with b.body.when(along.ge(start).logical_and(along.lt(start + shape[axis]))) as inside:
            inside.assign(result, b.element(value, flat_index(terms)))
        start += shape[axis]
    return result


#: op type -> its element, in the lane loop of a kernel (its own, or a fused chain's) shaped like its output
GATHERED: dict[str, IndexMapOf] = {"Concat": concat_value, "Pad": pad_value}


@register_kernel(*GATHERED)
def emit_gathered(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    if len(group.nodes) > 1:  # fused into the elementwise chain that reads it (fuse.GATHERS)
        return emit_elementwise(table, group)
    b = KernelBuilder.for_group(table, group, FAMILY)
    return [b.finish([GATHERED[group.anchor.op_type](b, group.anchor)])]


@expression(*GATHERED)
def _fused_gather(b: KernelBuilder, node: ir.Node, operand: Operand) -> Expr:
    """Fused into an elementwise chain (fuse.GATHERS), a Concat or Pad is one more expression of it: its
    inputs come from textures, never from the chain (fuse keeps their producers out)."""
    return GATHERED[node.op_type](b, node)


@lane_kernel(FAMILY, "ConstantOfShape")
def emit_constant_of_shape(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    fill = attr(node, "value")
    number = np.asarray(fill.numpy()).reshape(-1)[0].item() if fill is not None else 0
    dtype = dtype_of(node.outputs[0])
    return [Const(float(number) if dtype.is_float else int(number), dtype)]
