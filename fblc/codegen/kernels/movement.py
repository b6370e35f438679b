"""Data-movement kernels: Transpose, Reshape and its kin, Expand, Slice, Pad, Concat, Split, ConstantOfShape.

Each output element reads one input element through an index map computed from the
output's multi-index. A Concat or constant Pad that fuse merged into the elementwise chain
reading it is computed there, element by element, by the same code (an expression of that
chain). Transposes, reshapes and broadcasts run here only where tile_remap could not turn them
into index maps, or under `--layout naive` (the conventional baseline).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, strides_of
from fblc.codegen.indexing import broadcast_view_index, index_var
from fblc.codegen.ir import INT, Const, Expr, flat_index, select
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.kernels.elementwise import Operand, emit_elementwise, expression
from fblc.codegen.textures import TextureTable
from fblc.codegen.reads import dtype_of
from fblc.errors import UnsupportedOpError
from fblc.compiler.index_map import IndexMap
from fblc.compiler.values import attr, ints_input, slice_bounds, static_shape


@register_kernel("Transpose")
def emit_transpose(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    in_shape = static_shape(node.inputs[0])
    perm = attr(node, "perm") or list(reversed(range(len(in_shape))))
    strides = strides_of(in_shape)
    b = KernelBuilder.for_group(table, group, "movement")
    index = flat_index([(index_var(OUT_INDEX, k), strides[axis]) for k, axis in enumerate(perm)])
    return [b.finish([b.element(node.inputs[0], index)])]


@register_kernel("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def emit_reshape_copy(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """A reshape that is not an index map: a copy (row-major order is unchanged)."""
    b = KernelBuilder.for_group(table, group, "movement")
    return [b.finish([b.element(group.anchor.inputs[0], b.flat)])]


@register_kernel("Expand")
def emit_expand(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    b = KernelBuilder.for_group(table, group, "movement")
    index = broadcast_view_index(IndexMap.identity(static_shape(node.inputs[0])), b.out_shape, OUT_INDEX)
    return [b.finish([b.element(node.inputs[0], index)])]


def _slice_kernel(table: TextureTable, name: str, source: ir.Value, output: ir.Value, starts: list[int],
                  steps: list[int], node_name: str) -> Kernel:
    b = KernelBuilder(table, name, "movement", [output])
    b.nodes.append(node_name)
    strides = strides_of(static_shape(source))
    offset = sum(start * stride for start, stride in zip(starts, strides))
    index = flat_index([(index_var(OUT_INDEX, k), step * stride)
                        for k, (step, stride) in enumerate(zip(steps, strides))], offset)
    return b.finish([b.element(source, index)])


@register_kernel("Slice")
def emit_slice(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    starts, _, steps = slice_bounds(node)
    return [_slice_kernel(table, group.name, node.inputs[0], node.outputs[0], starts, steps, node.name)]


@register_kernel("Split")
def emit_split(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    shape = static_shape(node.inputs[0])
    axis = int(attr(node, "axis", 0)) % len(shape)
    kernels, start = [], 0
    for k, output in enumerate(node.outputs):
        size = static_shape(output)[axis]
        if output in group.outputs:
            starts = [start if a == axis else 0 for a in range(len(shape))]
            kernels.append(_slice_kernel(table, f"{group.name}_{k}", node.inputs[0], output, starts,
                                         [1] * len(shape), node.name))
        start += size
    return kernels


@register_kernel("Pad")
def emit_pad(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    if len(group.nodes) > 1:  # fused into the elementwise chain that reads it (fuse.GATHERS)
        return emit_elementwise(table, group)
    b = KernelBuilder.for_group(table, group, "movement")
    return [b.finish([pad_value(b, group.anchor)])]


def pad_value(b: KernelBuilder, node: ir.Node) -> Expr:
    """In the lane loop of a kernel shaped like the Pad's output: its element (constant mode)."""
    mode = attr(node, "mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        raise UnsupportedOpError(f"Pad mode '{mode}' (node '{node.name}') has no kernel", "use constant padding")
    in_shape = static_shape(node.inputs[0])
    rank = len(in_shape)
    pads = ints_input(node, 1, "pads") or [0] * (2 * rank)
    axes = ints_input(node, 3, "axes") or list(range(rank))
    begins = [0] * rank
    for k, axis in enumerate(axes):
        begins[axis % rank] = pads[k]
    fill: Expr = Const(0, INT)
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        fill = b.element(node.inputs[2], Const(0, INT))
    strides = strides_of(in_shape)
    conditions, terms = [], []
    for k, (dim, begin) in enumerate(zip(in_shape, begins)):
        source: Expr = index_var(OUT_INDEX, k) - begin if begin else index_var(OUT_INDEX, k)
        conditions.append(source.ge(0).logical_and(source.lt(dim)))
        terms.append((source, strides[k]))
    flag = b.body.let(functools.reduce(Expr.logical_and, conditions), "inside", INT)
    index = b.body.let(select(flag, flat_index(terms), 0), "src", INT)
    return select(flag, b.element(node.inputs[0], index), fill.cast(dtype_of(node.outputs[0])))


@register_kernel("Concat")
def emit_concat(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    if len(group.nodes) > 1:  # fused into the elementwise chain that reads it (fuse.GATHERS)
        return emit_elementwise(table, group)
    b = KernelBuilder.for_group(table, group, "movement")
    return [b.finish([concat_value(b, group.anchor)])]


def concat_value(b: KernelBuilder, node: ir.Node) -> Expr:
    """In the lane loop of a kernel shaped like the Concat's output: its element, read from the input
    whose range along the axis holds it."""
    out_shape = static_shape(node.outputs[0])
    axis = int(attr(node, "axis")) % len(out_shape)
    dtype = dtype_of(node.outputs[0])
    result = b.body.mutable(Const(0, dtype), "v")
    along, start = index_var(OUT_INDEX, axis), 0
    for value in node.inputs:
        shape = static_shape(value)
        terms = [(along - start if k == axis and start else index_var(OUT_INDEX, k), stride)
                 for k, stride in enumerate(strides_of(shape))]
        with b.body.when(along.ge(start).logical_and(along.lt(start + shape[axis]))) as inside:
            inside.assign(result, b.element(value, flat_index(terms)))
        start += shape[axis]
    return result


@register_kernel("ConstantOfShape")
def emit_constant_of_shape(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    fill = attr(node, "value")
    number = np.asarray(fill.numpy()).reshape(-1)[0].item() if fill is not None else 0
    dtype = dtype_of(node.outputs[0])
    b = KernelBuilder.for_group(table, group, "movement")
    return [b.finish([Const(float(number) if dtype.is_float else int(number), dtype)])]


@expression("Concat", "Pad")
def _fused_gather(b: KernelBuilder, node: ir.Node, operand: Operand) -> Expr:
    """Fused into an elementwise chain (fuse.GATHERS), a Concat or Pad is one more expression of it: its
    inputs come from textures, never from the chain (fuse keeps their producers out)."""
    return concat_value(b, node) if node.op_type == "Concat" else pad_value(b, node)
