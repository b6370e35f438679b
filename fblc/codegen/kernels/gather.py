"""Indexed reads and writes: Gather, GatherElements, GatherND, ScatterND, ScatterElements.

Gathers are per-element index maps: each lane reads its index (GatherND: its k-tuple), wraps a
negative one, clamps it into range (an out-of-range read of an image is undefined on a GPU; ONNX calls such an
index an error anyway) and reads the data element.

Scatters are written the other way round, as gathers over the updates: each lane owns one
output element, starts from the data element and folds in every update that targets it, in
update order. No two work-items write the same texel, so there are no atomics and the result
is deterministic (float addition in a fixed order, unlike an atomic scatter-add); with
reduction "none" the last update wins, as in onnxruntime. ScatterND scans all updates per
element; ScatterElements only scans the updates on its own line along `axis`, the only ones
that can reach it. Both have a whole-texel path for the row scatters of gather gradients (one
target row per update): a work-item folds a few texels of one row and reads each update's row
number once for all of them. A scatter of more than SORTED_SCATTER_UPDATES updates a line never
reaches these scans when it is a row scatter, a ScatterElements along the data's last axis
(GatherElements' gradient) or a ScatterND of k-tuples: pass sort_scatter_rows sorts its rows first
(kernels in sort.py).
"""

from __future__ import annotations

import functools
from typing import Callable

import onnx_ir as ir

from fblc.codegen import ir as kir
from fblc.codegen.builder import OUT_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, strides_of
from fblc.codegen.indexing import index_var
from fblc.codegen.ir import FLOAT4, INT, Block, Element, Expr, call, const, div_index, flat_index, mod_index, select
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.reads import dtype_of
from fblc.codegen.textures import TextureTable
from fblc.errors import UnsupportedOpError
from fblc.compiler.index_map import is_zeros, row_major_strides
from fblc.compiler.values import attr, numel, static_shape
from fblc.passes.sort_scatter_rows import expanded_rows

FAMILY = "gather"

#: a reduction's fold of update `u` into accumulator `acc`
Combine = Callable[[Expr, Expr], Expr]


def _axis(node: ir.Node, rank: int) -> int:
    return int(attr(node, "axis", 0)) % max(rank, 1)


def _out(axis: int) -> kir.Var:
    return index_var(OUT_INDEX, axis)


def wrap(raw: Expr, size: int) -> Expr:
    """ONNX's index `raw` into an axis of `size`: a negative one counts from the end."""
    return select(raw.lt(0), raw + size, raw)


def _wrapped(b: KernelBuilder, raw: Expr, size: int, hint: str = "idx") -> kir.Var:
    """A value holding index `raw` wrapped (negative counts from the end) and clamped to [0, size)."""
    value = b.body.let(raw, hint, INT)
    return b.body.let(call("clamp", wrap(value, size), 0, size - 1, dtype=INT), hint)


def own_index(shape: tuple[int, ...]) -> Expr:
    """Flat index of the current output element in a tensor of the output's shape."""
    return flat_index([(_out(k), stride) for k, stride in enumerate(strides_of(shape))])


@register_kernel("Gather")
def emit_gather(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """out[i_0..i_{a-1}, j.., k..] = data[i.., indices[j..], k..] (j: the indices' coordinates)."""
    node = group.anchor
    data, indices = node.inputs
    data_shape = static_shape(data)
    index_shape = static_shape(indices)
    axis = _axis(node, len(data_shape))
    q = len(index_shape)
    b = KernelBuilder.for_group(table, group, FAMILY)
    index_terms = [(_out(axis + k), stride) for k, stride in enumerate(strides_of(index_shape))]
    row = _wrapped(b, b.element(indices, flat_index(index_terms)), data_shape[axis])
    strides = strides_of(data_shape)
    terms: list[tuple[Expr, int]] = [(_out(k), strides[k]) for k in range(axis)]
    terms.append((row, strides[axis]))
    terms += [(_out(k + q - 1), strides[k]) for k in range(axis + 1, len(data_shape))]
    return [b.finish([b.element(data, flat_index(terms))])]


@register_kernel("GatherElements")
def emit_gather_elements(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """out[i] = data[i with coordinate `axis` replaced by indices[i]]."""
    node = group.anchor
    data, indices = node.inputs
    data_shape = static_shape(data)
    index_shape = static_shape(indices)
    axis = _axis(node, len(data_shape))
    b = KernelBuilder.for_group(table, group, FAMILY)
    along = _wrapped(b, b.element(indices, own_index(index_shape)), data_shape[axis])
    strides = strides_of(data_shape)
    terms = [(along if k == axis else _out(k), strides[k]) for k in range(len(data_shape))]
    return [b.finish([b.element(data, flat_index(terms))])]


@register_kernel("GatherND")
def emit_gather_nd(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """out[b.., m.., r..] = data[b.., indices[b.., m.., 0..k-1], r..] (b: the batch_dims leading axes).

    The output's first q - 1 axes are the indices' own (batch and tuple positions), the rest the
    data axes after the k indexed ones; each lane reads its k-tuple and wraps every entry."""
    node = group.anchor
    data, indices = node.inputs
    data_shape, index_shape = static_shape(data), static_shape(indices)
    batch, k = int(attr(node, "batch_dims", 0)), index_shape[-1]
    lead = len(index_shape) - 1  # output axes that index the tuples
    b = KernelBuilder.for_group(table, group, FAMILY)
    index_strides, strides = strides_of(index_shape), strides_of(data_shape)
    tuple_start = flat_index([(_out(j), index_strides[j]) for j in range(lead)])
    terms: list[tuple[Expr, int]] = [(_out(j), strides[j]) for j in range(batch)]
    for j in range(k):
        entry = b.element(indices, tuple_start + j if j else tuple_start)
        terms.append((_wrapped(b, entry, data_shape[batch + j]), strides[batch + j]))
    terms += [(_out(lead + t), strides[batch + k + t]) for t in range(len(data_shape) - batch - k)]
    return [b.finish([b.element(data, flat_index(terms))])]


# scatters ------------------------------------------------------------------------------------------

def _extreme(name: str) -> Combine:
    """fmax / fmin of floats, max / min of ints."""
    return lambda acc, u: call(f"f{name}" if acc.dtype.is_float else name, acc, u)


#: reduction attribute -> its fold of an update into the accumulator
COMBINES: dict[str, Combine] = {"none": lambda acc, u: u, "add": lambda acc, u: acc + u,
                                "mul": lambda acc, u: acc * u, "max": _extreme("max"), "min": _extreme("min")}


def combiner(node: ir.Node) -> Combine:
    """The fold of the node's reduction."""
    reduction = attr(node, "reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction not in COMBINES:
        raise UnsupportedOpError(f"{node.op_type} reduction '{reduction}' (node '{node.name}') has no kernel",
                                 f"supported reductions: {', '.join(COMBINES)}")
    return COMBINES[reduction]


def start_accumulator(b: KernelBuilder, node: ir.Node) -> kir.Var:
    """The accumulator holding the data element (a literal 0 for a zero table)."""
    data = node.inputs[0]
    dtype = dtype_of(node.outputs[0])
    initial = const(0, dtype) if is_zeros(data) else b.element(data, own_index(static_shape(data)))
    return b.body.mutable(initial, "acc", dtype)


@register_kernel("ScatterND")
def emit_scatter_nd(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """out = data; for each update u (in order): out[indices[u]] (+)= updates[u] — folded per element."""
    node = group.anchor
    data, indices, updates = node.inputs[:3]
    data_shape = static_shape(data)
    index_shape = static_shape(indices)
    depth = index_shape[-1]
    count = numel(index_shape[:-1])
    slice_size = numel(data_shape[depth:])
    strides = strides_of(data_shape)
    combine = combiner(node)
    b = KernelBuilder.for_group(table, group, FAMILY)
    if (count and dtype_of(node.outputs[0]).is_float and slice_size % 4 == 0 and whole_texels(b, data)
            and whole_texels(b, updates)):
        return [_scatter_nd_slices(b, node, combine)]
    acc = start_accumulator(b, node)
    if count == 0:
        return [b.finish([acc])]
    body = b.body
    prefix = body.let(flat_index([(_out(k), strides[k]) for k in range(depth)]), "prefix", INT)
    within = body.let(flat_index([(_out(k), strides[k]) for k in range(depth, len(data_shape))]), "within", INT)
    with body.loop("u", 0, count) as (u, scan):
        target = _update_target(b, scan, node, u)
        with scan.when(target.eq(prefix)) as hit:
            hit.assign(acc, combine(acc, b.element(updates, u * slice_size + within if slice_size > 1 else u)))
    return [b.finish([acc])]


def _update_target(b: KernelBuilder, block: Block, node: ir.Node, u: Expr) -> kir.Var:
    """Declare in `block` the flat offset of update `u`'s slice: the sum over its index tuple of
    wrap(index) * stride (compared with the element's or the texel's slice start)."""
    data, indices = node.inputs[:2]
    data_shape, depth = static_shape(data), static_shape(indices)[-1]
    strides = strides_of(data_shape)
    target = block.mutable(const(0), "target")
    for k in range(depth):
        raw = block.let(b.element(indices, u * depth + k if depth > 1 else u), "t", INT)
        wrapped = wrap(raw, data_shape[k])
        block.assign(target, wrapped if strides[k] == 1 else wrapped * strides[k], "+=")
    return target


SLICE_TEXELS = 16  # the most texels of one target slice a work-item folds together


def whole_texels(b: KernelBuilder, value: ir.Value) -> bool:
    """Whether `value` is stored (or viewed) contiguously from a texel boundary, so that its
    elements 4k..4k+3 are one texel of the tensor that holds it."""
    if b.constant_value(value) is not None:
        return False
    _, index_map = b.strided(value)
    return index_map.contiguous or (index_map.offset % 4 == 0 and
                                    list(index_map.strides) == row_major_strides(index_map.shape))


def texel_of(b: KernelBuilder, value: ir.Value, element: Expr) -> kir.Load:
    """The texel of `value` (see whole_texels) that starts at element `element`."""
    root, index_map = b.strided(value)
    argument, texture = b.input_argument(root)
    start = element + index_map.offset if index_map.offset else element
    return b.texel(argument, texture, start >> 2)


def _texel_accumulators(b: KernelBuilder, block: Block, per: int, data: ir.Value | None, first: Expr) -> kir.Var:
    """`per` float4 accumulators, the data's texels from element `first` on (None: a zero table)."""
    accs = block.array("acc", FLOAT4, per)
    with block.loop("tt", 0, per) as (tt, init):
        init.assign(Element(accs, tt), kir.vector(FLOAT4, 0.0) if data is None else texel_of(b, data, first + 4 * tt))
    return accs


def _fold_texels(block: Block, accs: kir.Var, per: int, combine: Combine, update: Callable[[Expr], Expr]) -> None:
    """Fold texel tt of an update (`update(tt)`) into accumulator tt, for each of the `per`."""
    with block.loop("tt", 0, per) as (tt, fold):
        fold.assign(Element(accs, tt), combine(Element(accs, tt), update(tt)))


def _lane_of(b: KernelBuilder, accs: kir.Var) -> Expr:
    """In the lane loop: the lane's element of the work-item's float4 accumulators."""
    return Element(accs, b.tt if b.texels_per_item > 1 else const(0)).lane(b.lane)


def _scatter_nd_slices(b: KernelBuilder, node: ir.Node, combine: Combine) -> Kernel:
    """ScatterND whose slices are whole texels: a work-item owns `per` texels of one target slice
    and scans the indices once for all of them (the lane path scans them once per element: the
    embedding gradient of a decoder read its 512 token ids 8192 times). Matching updates fold
    into float4 accumulators in update order, so every reduction keeps its per-element meaning."""
    data, indices, updates = node.inputs[:3]
    data_shape, index_shape = static_shape(data), static_shape(indices)
    depth, count = index_shape[-1], numel(index_shape[:-1])
    slice_size = numel(data_shape[depth:])
    per = slice_texels(slice_size)
    b.texels_per_item = per
    code = b.prologue
    first = code.let(b.first_element, "first", INT)
    prefix = code.let(first - mod_index(first, slice_size), "prefix")
    within = code.let(first - prefix, "within")
    accs = _texel_accumulators(b, code, per, None if is_zeros(data) else data, first)
    with code.loop("update", 0, count) as (u, scan):
        target = _update_target(b, scan, node, u)
        with scan.when(target.eq(prefix)) as hit:
            _fold_texels(hit, accs, per, combine, lambda tt: texel_of(b, updates, u * slice_size + within + 4 * tt))
    return b.finish([_lane_of(b, accs)])


@register_kernel("ScatterElements")
def emit_scatter_elements(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """out = data; out[u with coordinate `axis` replaced by indices[u]] (+)= updates[u], for each u.

    Only updates sharing the element's coordinates off `axis` can reach it, so a lane scans the
    indices' extent along `axis` (in increasing order, the order onnxruntime applies them).
    """
    node = group.anchor
    data, indices, updates = node.inputs[:3]
    data_shape = static_shape(data)
    index_shape = static_shape(indices)
    rank = len(data_shape)
    axis = _axis(node, rank)
    combine = combiner(node)
    b = KernelBuilder.for_group(table, group, FAMILY)
    if _row_scatter(b, node):
        return [_scatter_elements_rows(b, node, combine)]
    acc = start_accumulator(b, node)
    if numel(index_shape) == 0:
        return [b.finish([acc])]
    index_strides = strides_of(index_shape)
    # Indices may be smaller than data off `axis`: elements outside their extent get no update.
    reachable = [_out(k).lt(index_shape[k]) for k in range(rank) if k != axis and index_shape[k] < data_shape[k]]
    block = b.body
    line = block.let(flat_index([(_out(k), index_strides[k]) for k in range(rank) if k != axis]), "line", INT)
    if reachable:
        block = block.either(functools.reduce(Expr.logical_and, reachable))[0]
    with block.loop("j", 0, index_shape[axis]) as (j, scan):
        position = line + (j * index_strides[axis] if index_strides[axis] != 1 else j)
        raw = scan.let(b.element(indices, position), "t", INT)
        with scan.when(wrap(raw, data_shape[axis]).eq(_out(axis))) as hit:
            hit.assign(acc, combine(acc, b.element(updates, position)))
    return [b.finish([acc])]


def _row_scatter(b: KernelBuilder, node: ir.Node) -> bool:
    """Whether a ScatterElements scatters whole rows (sort_scatter_rows.expanded_rows) that are whole
    float texels of data and updates."""
    data, updates = node.inputs[0], node.inputs[2]
    found = expanded_rows(node)
    if found is None or not dtype_of(node.outputs[0]).is_float:
        return False
    return (numel(static_shape(data)[found[2] + 1:]) % 4 == 0 and (is_zeros(data) or whole_texels(b, data))
            and whole_texels(b, updates))


def _scatter_elements_rows(b: KernelBuilder, node: ir.Node, combine: Combine) -> Kernel:
    """ScatterElements of whole rows (see _row_scatter), as `_scatter_nd_slices` does ScatterND: a
    work-item owns texels of one target row and scans the updates' row numbers once for all of them
    (the lane path reads them once per element, the gradient of a 32k-row embedding N * 32k * width
    times); matching rows fold in update order (fold_rows)."""
    data, indices, updates = node.inputs[:3]
    data_shape, index_shape = static_shape(data), static_shape(indices)
    axis = _axis(node, len(data_shape))
    depth, count, inner = data_shape[axis], index_shape[axis], numel(data_shape[axis + 1:])

    def scan_all(block: Block, outer: Expr, target: Expr, fold: FoldRow) -> None:
        with block.loop("update", 0, count) as (u, scan):
            base = scan.let((outer * count + u) * inner, "base")
            raw = scan.let(b.element(indices, base), "t", INT)
            with scan.when(call("wrap_row", raw, depth, dtype=INT).eq(target)) as hit:
                fold(hit, base)

    return fold_rows(b, None if is_zeros(data) else data, updates, combine, depth, inner, scan_all)


def slice_texels(elements: int) -> int:
    """The texels of a slice of `elements` (a multiple of 4) that one work-item folds: the most, up to
    SLICE_TEXELS, that divide the slice (so a work-item's texels never leave it)."""
    return max(d for d in range(1, SLICE_TEXELS + 1) if (elements // 4) % d == 0)


#: (block, update row's first element) -> folds that update row into the accumulators
FoldRow = Callable[[Block, Expr], None]
#: (block, outer, target, fold) -> builds into `block` a loop over the updates of target row `target` (of
#: leading index `outer`), in update order, calling `fold` for each matching update row
UpdateRows = Callable[[Block, Expr, Expr, FoldRow], None]


def fold_rows(b: KernelBuilder, data: ir.Value | None, updates: ir.Value, combine: Combine, depth: int, inner: int,
              updates_of: UpdateRows) -> Kernel:
    """A row scatter by whole texels into data [.., depth, inner] (None: a zero table): a work-item owns
    slice_texels(inner) texels of one target row, starts from the data's texels and folds the texels of
    each update row that `updates_of` finds, into float4 accumulators in the order it gives."""
    per = slice_texels(inner)
    b.texels_per_item = per
    code = b.prologue
    first = code.let(b.first_element, "first", INT)
    row = code.let(div_index(first, inner), "row")
    outer = code.let(div_index(row, depth), "outer")
    within = code.let(first - row * inner, "within")
    target = code.let(row - outer * depth, "target")
    accs = _texel_accumulators(b, code, per, data, first)

    def fold(block: Block, update_row: Expr) -> None:
        _fold_texels(block, accs, per, combine, lambda tt: texel_of(b, updates, update_row + within + 4 * tt))

    updates_of(code, outer, target, fold)
    return b.finish([_lane_of(b, accs)])
