"""Data-movement kernels: Transpose, Reshape and its kin, Expand, Slice, Pad, Concat, Split, ConstantOfShape.

Each output element reads one input element through an index map of the output's multi-index; a Concat
or constant Pad fused into an elementwise chain is an expression of that chain, by the same code. Movement
runs here only where tile_remap left a copy (docs/ARCHITECTURE.md §2), or under `--layout naive`.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import numpy as np
import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, strides_of
from fblc.codegen.indexing import broadcast_view_index
from fblc.codegen.ir import INT, Const, Expr, flat_index, select
from fblc.codegen.kernels import KernelGroup, lane_kernel, out_axis, register_kernel
from fblc.codegen.kernels.elementwise import Operand, emit_elementwise, expression
from fblc.codegen.textures import TextureTable
from fblc.codegen.reads import dtype_of
from fblc.compiler.index_map import IndexMap
from fblc.compiler.values import attr, choice_attr, ints_input, slice_bounds, static_shape

FAMILY = "movement"
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


INDEX_MAPS: dict[str, IndexMapOf] = {
    "Transpose": _transpose,
    "Slice": lambda b, node: _slice_index(static_shape(node.inputs[0]), *slice_bounds(node)[::2]),  # starts, steps
    "Expand": lambda b, node: broadcast_view_index(IndexMap.identity(static_shape(node.inputs[0])), b.out_shape,
                                                   OUT_INDEX),
    # a reshape that is not an index map: a copy (row-major order is unchanged)
    **dict.fromkeys(("Reshape", "Flatten", "Squeeze", "Unsqueeze"), lambda b, node: b.flat)}


@lane_kernel(FAMILY, *INDEX_MAPS)
def emit_index_map(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """Each output element reads one input element, through the op's INDEX_MAPS."""
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


def pad_value(b: KernelBuilder, node: ir.Node) -> Expr:
    """In the lane loop of a kernel shaped like the Pad's output: its element (constant mode)."""
    choice_attr(node, "mode", "constant", ("constant",), "kernel")
    in_shape = static_shape(node.inputs[0])
    rank = len(in_shape)
    pads = ints_input(node, 1, "pads") or [0] * (2 * rank)
    axes = ints_input(node, 3, "axes") or list(range(rank))
    begins = {axis % rank: pads[k] for k, axis in enumerate(axes)}
    has_fill = len(node.inputs) > 2 and node.inputs[2] is not None
    fill = b.element(node.inputs[2], Const(0, INT)) if has_fill else Const(0, INT)
    sources = [out_axis(k) - begins[k] if begins.get(k) else out_axis(k) for k in range(rank)]
    inside = [source.ge(0).logical_and(source.lt(dim)) for source, dim in zip(sources, in_shape)]
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
