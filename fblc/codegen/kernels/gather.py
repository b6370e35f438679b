"""Indexed reads and writes: Gather, GatherElements, GatherND, ScatterND, ScatterElements.

A lane owns one output element: a gather reads through its (wrapped, clamped) index; a scatter is a gather
over the updates, with no atomics and in update order (deterministic sums); docs/ARCHITECTURE.md §3.
"""

from __future__ import annotations

import functools
from typing import Callable

import onnx_ir as ir

from fblc.codegen import ir as kir
from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import strides_of
from fblc.codegen.ir import FLOAT4, INT, Block, Element, Expr, call, const, div_index, flat_index, mod_index, select
from fblc.codegen.kernels import lane_kernel, out_axis, own_index
from fblc.codegen.kernels.elementwise import extreme
from fblc.codegen.reads import dtype_of
from fblc.compiler.index_map import is_zeros, row_major_strides
from fblc.compiler.values import attr, choice_attr, numel, static_shape
from fblc.passes.sort_scatter_rows import expanded_rows

FAMILY = "gather"
SLICE_TEXELS = 16  # the most texels of one target slice a work-item folds together

#: a reduction's fold of update `u` into accumulator `acc`
Combine = Callable[[Expr, Expr], Expr]
Shape = tuple[int, ...]
#: the data coordinates (one per data axis) an output element of a gather reads, given (builder, node, data
#: shape, index shape); it declares the index reads into the builder's body
Coordinates = Callable[[KernelBuilder, ir.Node, Shape, Shape], list[Expr]]
#: (block, update row's first element) -> folds that update row into the accumulators
FoldRow = Callable[[Block, Expr], None]
#: (block, outer, target, fold) -> builds into `block` a loop over the updates of target row `target` (of
#: leading index `outer`), in update order, calling `fold` for each matching update row
UpdateRows = Callable[[Block, Expr, Expr, FoldRow], None]


def _axis(node: ir.Node, rank: int) -> int:
    return int(attr(node, "axis", 0)) % max(rank, 1)


def wrap(raw: Expr, size: int) -> Expr:
    """ONNX's index `raw` into an axis of `size`: a negative one counts from the end."""
    return select(raw.lt(0), raw + size, raw)


def _wrapped(b: KernelBuilder, raw: Expr, size: int) -> kir.Var:
    """A value holding index `raw` wrapped (negative counts from the end) and clamped to [0, size)."""
    value = b.body.let(raw, "idx", INT)
    return b.body.let(call("clamp", wrap(value, size), 0, size - 1, dtype=INT), "idx")


def _gather(b: KernelBuilder, node: ir.Node, data_shape: Shape, index_shape: Shape) -> list[Expr]:
    """out[i_0..i_{a-1}, j.., k..] = data[i.., indices[j..], k..] (j: the indices' coordinates)."""
    axis, q = _axis(node, len(data_shape)), len(index_shape)
    index_terms = [(out_axis(axis + k), stride) for k, stride in enumerate(strides_of(index_shape))]
    row = _wrapped(b, b.element(node.inputs[1], flat_index(index_terms)), data_shape[axis])
    return [out_axis(k) for k in range(axis)] + [row] + [out_axis(k + q - 1) for k in range(axis + 1, len(data_shape))]


def _gather_elements(b: KernelBuilder, node: ir.Node, data_shape: Shape, index_shape: Shape) -> list[Expr]:
    """out[i] = data[i with coordinate `axis` replaced by indices[i]]."""
    axis = _axis(node, len(data_shape))
    along = _wrapped(b, b.element(node.inputs[1], own_index(index_shape)), data_shape[axis])
    return [along if k == axis else out_axis(k) for k in range(len(data_shape))]


def _gather_nd(b: KernelBuilder, node: ir.Node, data_shape: Shape, index_shape: Shape) -> list[Expr]:
    """out[b.., m.., r..] = data[b.., indices[b.., m.., 0..k-1], r..] (b: the batch_dims leading axes).

    The output's first q - 1 axes are the indices' own (batch and tuple positions), the rest the
    data axes after the k indexed ones; each lane reads its k-tuple and wraps every entry."""
    batch, k = int(attr(node, "batch_dims", 0)), index_shape[-1]
    lead = len(index_shape) - 1  # output axes that index the tuples
    indices, index_strides = node.inputs[1], strides_of(index_shape)
    start = flat_index([(out_axis(j), index_strides[j]) for j in range(lead)])
    entries = [_wrapped(b, b.element(indices, start + j if j else start), data_shape[batch + j]) for j in range(k)]
    return [out_axis(j) for j in range(batch)] + entries + [out_axis(t) for t in range(lead, len(b.out_shape))]


GATHERS: dict[str, Coordinates] = {"Gather": _gather, "GatherElements": _gather_elements, "GatherND": _gather_nd}


@lane_kernel(FAMILY, *GATHERS)
def emit_gather(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """The data element at the coordinates the op's index map (GATHERS) gives the output element."""
    data, indices = node.inputs
    data_shape = static_shape(data)
    coordinates = GATHERS[node.op_type](b, node, data_shape, static_shape(indices))
    return [b.element(data, flat_index(list(zip(coordinates, strides_of(data_shape)))))]


# scatters ------------------------------------------------------------------------------------------

#: reduction attribute -> its fold of an update into the accumulator
COMBINES: dict[str, Combine] = {"none": lambda acc, u: u, "add": lambda acc, u: acc + u,
                                "mul": lambda acc, u: acc * u, "max": extreme("max"), "min": extreme("min")}


def combiner(node: ir.Node) -> Combine:
    """The fold of the node's reduction."""
    return COMBINES[choice_attr(node, "reduction", "none", COMBINES, "kernel")]


def start_accumulator(b: KernelBuilder, node: ir.Node) -> kir.Var:
    """The accumulator holding the data element (a literal 0 for a zero table, or no data)."""
    data, dtype = node.inputs[0], dtype_of(node.outputs[0])
    zeros = data is None or is_zeros(data)
    return b.body.mutable(const(0, dtype) if zeros else b.element(data, own_index(static_shape(data))), "acc", dtype)


def texel_rows(b: KernelBuilder, node: ir.Node, data: ir.Value | None, updates: ir.Value, inner: int) -> bool:
    """Whether a scatter of rows of `inner` elements can fold whole float texels: `inner` a multiple of 4,
    and data (None: a zero table) and updates stored (or viewed) contiguously from a texel boundary, so
    that their elements 4k..4k+3 are one texel of the tensor that holds them."""
    def whole_texels(value: ir.Value) -> bool:
        if b.constant_value(value) is not None:
            return False
        index_map = b.strided(value)[1]
        return index_map.contiguous or (index_map.offset % 4 == 0 and
                                        list(index_map.strides) == row_major_strides(index_map.shape))

    float_rows = dtype_of(node.outputs[0]).is_float and inner % 4 == 0
    return float_rows and (data is None or whole_texels(data)) and whole_texels(updates)


def texel_of(b: KernelBuilder, value: ir.Value, element: Expr) -> kir.Load:
    """The texel of `value` (see texel_rows) that starts at element `element`."""
    root, index_map = b.strided(value)
    argument, texture = b.input_argument(root)
    start = element + index_map.offset if index_map.offset else element
    return b.texel(argument, texture, start >> 2)


def _own_texels(b: KernelBuilder, elements: int) -> kir.Var:
    """Make a work-item fold the most texels, up to SLICE_TEXELS, that divide a slice of `elements` (a
    multiple of 4; so its texels never leave the slice); returns its first element, declared in the prologue."""
    b.texels_per_item = max(d for d in range(1, SLICE_TEXELS + 1) if (elements // 4) % d == 0)
    return b.prologue.let(b.first_element, "first", INT)


def _texel_folds(b: KernelBuilder, data: ir.Value | None, updates: ir.Value, combine: Combine, first: Expr,
                 within: Expr) -> tuple[FoldRow, Expr]:
    """Declare in the prologue the work-item's texels_per_item float4 accumulators, the data's texels from
    element `first` on (None: a zero table); returns the fold of an update row (its texels from `within`)
    into them and, for the lane loop, the lane's result."""
    per = b.texels_per_item
    accs = b.prologue.array("acc", FLOAT4, per)
    with b.prologue.loop("tt", 0, per) as (tt, init):
        init.assign(Element(accs, tt), kir.vector(FLOAT4, 0.0) if data is None else texel_of(b, data, first + 4 * tt))

    def fold(block: Block, update_row: Expr) -> None:
        with block.loop("tt", 0, per) as (tt, texels):
            update = texel_of(b, updates, update_row + within + 4 * tt)
            texels.assign(Element(accs, tt), combine(Element(accs, tt), update))

    return fold, Element(accs, b.tt if per > 1 else const(0)).lane(b.lane)


@lane_kernel(FAMILY, "ScatterND")
def emit_scatter_nd(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """out = data; for each update u (in order): out[indices[u]] (+)= updates[u] — folded per element, or
    per texel of whole-texel slices (the lane path scans the indices once per element: the embedding
    gradient of a decoder read its 512 token ids 8192 times)."""
    data, indices, updates = node.inputs[:3]
    data_shape, index_shape = static_shape(data), static_shape(indices)
    depth, count = index_shape[-1], numel(index_shape[:-1])
    slice_size, strides = numel(data_shape[depth:]), strides_of(data_shape)
    combine = combiner(node)

    def target_of(block: Block, u: Expr) -> kir.Var:
        """Declared in `block`: the flat offset of update u's slice, the sum over its index tuple of
        wrap(index) * stride (compared with the element's or the texel's slice start)."""
        target = block.mutable(const(0), "target")
        for k in range(depth):
            raw = block.let(b.element(indices, u * depth + k if depth > 1 else u), "t", INT)
            block.assign(target, flat_index([(wrap(raw, data_shape[k]), strides[k])]), "+=")
        return target

    if count and texel_rows(b, node, data, updates, slice_size):
        code = b.prologue
        first = _own_texels(b, slice_size)
        prefix = code.let(first - mod_index(first, slice_size), "prefix")
        fold, result = _texel_folds(b, None if is_zeros(data) else data, updates, combine, first,
                                    code.let(first - prefix, "within"))
        with code.loop("update", 0, count) as (u, scan):
            with scan.when(target_of(scan, u).eq(prefix)) as hit:
                fold(hit, u * slice_size)
        return [result]
    acc = start_accumulator(b, node)
    if count == 0:
        return [acc]
    body = b.body
    prefix = body.let(flat_index([(out_axis(k), strides[k]) for k in range(depth)]), "prefix", INT)
    within = body.let(flat_index([(out_axis(k), strides[k]) for k in range(depth, len(data_shape))]), "within", INT)
    with body.loop("u", 0, count) as (u, scan):
        with scan.when(target_of(scan, u).eq(prefix)) as hit:
            hit.assign(acc, combine(acc, b.element(updates, u * slice_size + within if slice_size > 1 else u)))
    return [acc]


@lane_kernel(FAMILY, "ScatterElements")
def emit_scatter_elements(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """out = data; out[u with coordinate `axis` replaced by indices[u]] (+)= updates[u], for each u.

    Only updates sharing the element's coordinates off `axis` can reach it, so a lane scans the
    indices' extent along `axis` (in increasing order, the order onnxruntime applies them). Whole rows
    (sort_scatter_rows.expanded_rows) of whole float texels go as `fold_rows` (the lane path reads the
    row numbers once per element: the gradient of a 32k-row embedding N * 32k * width times)."""
    data, indices, updates = node.inputs[:3]
    data_shape, index_shape = static_shape(data), static_shape(indices)
    rank = len(data_shape)
    axis = _axis(node, rank)
    combine = combiner(node)
    depth, count, inner = data_shape[axis], index_shape[axis], numel(data_shape[axis + 1:])
    initial = None if is_zeros(data) else data
    if expanded_rows(node) is not None and texel_rows(b, node, initial, updates, inner):
        def scan_all(block: Block, outer: Expr, target: Expr, fold: FoldRow) -> None:
            with block.loop("update", 0, count) as (u, scan):
                base = scan.let((outer * count + u) * inner, "base")
                raw = scan.let(b.element(indices, base), "t", INT)
                with scan.when(call("wrap_row", raw, depth, dtype=INT).eq(target)) as hit:
                    fold(hit, base)

        return [fold_rows(b, initial, updates, combine, depth, inner, scan_all)]
    acc = start_accumulator(b, node)
    if numel(index_shape) == 0:
        return [acc]
    index_strides = strides_of(index_shape)
    # Indices may be smaller than data off `axis`: elements outside their extent get no update.
    reachable = [out_axis(k).lt(index_shape[k]) for k in range(rank) if k != axis and index_shape[k] < data_shape[k]]
    block = b.body
    line = block.let(flat_index([(out_axis(k), index_strides[k]) for k in range(rank) if k != axis]), "line", INT)
    if reachable:
        block = block.either(functools.reduce(Expr.logical_and, reachable))[0]
    with block.loop("j", 0, count) as (j, scan):
        position = line + (j * index_strides[axis] if index_strides[axis] != 1 else j)
        raw = scan.let(b.element(indices, position), "t", INT)
        with scan.when(wrap(raw, depth).eq(out_axis(axis))) as hit:
            hit.assign(acc, combine(acc, b.element(updates, position)))
    return [acc]


def fold_rows(b: KernelBuilder, data: ir.Value | None, updates: ir.Value, combine: Combine, depth: int, inner: int,
              updates_of: UpdateRows) -> Expr:
    """A row scatter by whole texels into data [.., depth, inner] (None: a zero table): a work-item owns
    texels of one target row (_own_texels), starts from the data's texels and folds the texels of
    each update row that `updates_of` finds, into float4 accumulators in the order it gives. Returns the
    lane's result."""
    code = b.prologue
    first = _own_texels(b, inner)
    row = code.let(div_index(first, inner), "row")
    outer = code.let(div_index(row, depth), "outer")
    within = code.let(first - row * inner, "within")
    target = code.let(row - outer * depth, "target")
    fold, result = _texel_folds(b, data, updates, combine, first, within)
    updates_of(code, outer, target, fold)
    return result
