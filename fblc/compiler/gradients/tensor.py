"""Gradient rules of data-movement ops: views, permutations, joins, slices, gathers, pads."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.autodiff import register_gradient
from fblc.errors import UnsupportedOpError
from fblc.compiler.gradients.segment_sum import constant_rows, segment_sum, tuple_rows, wrap_rows
from fblc.compiler.graph import Emitter, attr, const_array, ints_input, numel, static_shape
from fblc.compiler.values import slice_bounds

Grads = Sequence["ir.Value | None"]


@register_gradient("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def view_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    dx = e.reshape(dys[0], static_shape(node.inputs[0]))
    return [dx] + [None] * (len(node.inputs) - 1)


@register_gradient("Transpose")
def transpose_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    rank = len(static_shape(node.inputs[0]))
    perm = attr(node, "perm") or list(reversed(range(rank)))
    inverse = [int(i) for i in np.argsort(perm)]
    swapped = _transposed_product(e, dys[0], inverse) if dys[0] is not None else None
    return [swapped if swapped is not None else e.op("Transpose", dys[0], perm=inverse)]


def _transposed_product(e: Emitter, dy: ir.Value, perm: list[int]) -> ir.Value | None:
    """(A B)^T as B^T A^T when `dy` is a 2-D MatMul that only this transpose reads (the weight gradient of
    `x @ W.T`, nn.Linear as MatMul): the product comes out in the weight's own order, so the optimizer's
    update joins the MatMul's epilogue instead of reading it through a transpose; the first MatMul goes."""
    product = dy.producer()
    if (perm != [1, 0] or product is None or product.op_type != "MatMul" or dy.uses() or dy.is_graph_output()
            or product.metadata_props.get(keys.STAGE) != e.stage
            or any(len(static_shape(v)) != 2 for v in product.inputs)):
        return None
    a, b = product.inputs
    swapped = e.op("MatMul", _transposed(e, b), _transposed(e, a))
    _remove_unused(e.graph, product)
    return swapped


def _transposed(e: Emitter, matrix: ir.Value) -> ir.Value:
    """matrix^T: the input of a transpose that made it, else a new Transpose (a view of it)."""
    maker = matrix.producer()
    if maker is not None and maker.op_type == "Transpose" and list(attr(maker, "perm") or [1, 0]) == [1, 0]:
        return maker.inputs[0]  # type: ignore[return-value]
    return e.op("Transpose", matrix, perm=[1, 0])


def _remove_unused(graph: ir.Graph, node: ir.Node) -> None:
    """Remove `node` and then every node of its stage that only it read."""
    stage = node.metadata_props.get(keys.STAGE)
    inputs = [v for v in node.inputs if v is not None]
    graph.remove(node, safe=True)
    for value in inputs:
        maker = value.producer()
        if (maker is not None and maker.metadata_props.get(keys.STAGE) == stage and not value.uses()
                and not value.is_graph_output() and all(not o.uses() for o in maker.outputs)):
            _remove_unused(graph, maker)


@register_gradient("Expand")
def expand_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    dx = e.unbroadcast(dys[0], static_shape(node.outputs[0]), static_shape(node.inputs[0]))
    return [dx, None]


def _axis(node: ir.Node, rank: int, default: int = 0) -> int:
    axis = int(attr(node, "axis", default))
    return axis + rank if axis < 0 else axis


@register_gradient("Concat")
def concat_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    shapes = [static_shape(v) for v in node.inputs]
    axis = _axis(node, len(shapes[0]))
    sizes = [s[axis] for s in shapes]
    pieces = e.op_multi("Split", dys[0], e.ints(sizes), axis=axis, num_outputs=len(sizes))
    return [piece if want else None for piece, want in zip(pieces, need)]


@register_gradient("Split")
def split_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    axis = _axis(node, len(static_shape(node.inputs[0])))
    parts = [dy if dy is not None else e.zeros(static_shape(out), like=out) for dy, out in zip(dys, node.outputs)]
    return [e.op("Concat", *parts, axis=axis)] + [None] * (len(node.inputs) - 1)


@register_gradient("Slice")
def slice_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    in_shape = static_shape(node.inputs[0])
    out_shape = static_shape(node.outputs[0])
    starts, stops, steps = slice_bounds(node)
    dy = dys[0]
    if all(step == 1 for step in steps):
        pads = starts + [n - start - size for n, start, size in zip(in_shape, starts, out_shape)]
        dx = e.op("Pad", dy, e.ints(pads))
    else:
        flat_positions = np.arange(numel(in_shape), dtype=np.int64).reshape(in_shape)
        # np.arange, not slice(): a normalised stop of -1 (a negative step run through index 0)
        # would read as "the last element" in a slice and pick nothing.
        picked = flat_positions[np.ix_(*(np.arange(a, b, c) for a, b, c in zip(starts, stops, steps)))]
        # a slice picks each input element at most once: every input element gathers its own dy
        # element (or a trailing zero), linear and race-free, rather than scanning every pick
        source = np.full(numel(in_shape), numel(out_shape), dtype=np.int64)
        source[picked.reshape(-1)] = np.arange(numel(out_shape))
        padded = e.op("Concat", e.reshape(dy, [numel(out_shape)]), e.zeros([1], like=dy), axis=0)
        dx = e.reshape(e.op("GatherElements", padded, e.const(source), axis=0), in_shape)
    return [dx] + [None] * (len(node.inputs) - 1)


@register_gradient("Gather")
def gather_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """Gather on any axis a: data [P, D, Q] (P, Q the extents before and after a) gives dy [P, N, Q],
    N = numel(indices) (a scalar index drops the axis: N = 1); dx is the segment sum of dy's rows
    into D rows (segment_sum: repeated and negative indices add up, at any thread count)."""
    data, indices = node.inputs
    data_shape = static_shape(data)
    axis = _axis(node, len(data_shape))
    depth = data_shape[axis]
    count = numel(static_shape(indices))
    dy = e.reshape(dys[0], [numel(data_shape[:axis]), count, numel(data_shape[axis + 1:])])
    array = _constant(indices)
    if array is not None:
        rows: np.ndarray | ir.Value = constant_rows(array, depth).reshape(1, count)
    else:
        rows = e.reshape(wrap_rows(e, indices, depth), [1, count])
    return [e.reshape(segment_sum(e, dy, rows, depth, like=data), data_shape), None]


@register_gradient("GatherND")
def gather_nd_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """GatherND with b batch dims and index tuples of length k: data [B.., K.., R..] is [P, D, Q]
    (P = numel(B), D = numel(K), Q = numel(R)), a tuple picks one of the D rows by its row-major
    offset in K, and dy [B.., M.., R..] is [P, N, Q] (N = numel(M)); dx is the segment sum."""
    data, indices = node.inputs
    data_shape, index_shape = static_shape(data), static_shape(indices)
    batch, k = int(attr(node, "batch_dims", 0)), index_shape[-1]
    tuple_dims = data_shape[batch:batch + k]
    p, depth, q = numel(data_shape[:batch]), numel(tuple_dims), numel(data_shape[batch + k:])
    count = numel(index_shape[batch:-1])
    dy = e.reshape(dys[0], [p, count, q])
    array = _constant(indices)
    if array is None and k > 0:
        rows: np.ndarray | ir.Value = e.reshape(tuple_rows(e, indices, tuple_dims), [p, count])
    else:  # constant tuples (or k = 0: every tuple picks the one row): offsets computed here
        strides = [numel(tuple_dims[j + 1:]) for j in range(k)]
        offsets = np.zeros(index_shape[:-1], np.int64)
        for j, (size, stride) in enumerate(zip(tuple_dims, strides)):
            offsets += constant_rows(np.asarray(array)[..., j], size) * stride
        rows = offsets.reshape(p, count)
    return [e.reshape(segment_sum(e, dy, rows, depth, like=data), data_shape), None]


def _constant(indices: ir.Value) -> np.ndarray | None:
    """The value of constant indices (folded at import), so their row numbers are computed here once."""
    return None if indices.is_graph_input() else const_array(indices)


@register_gradient("GatherElements")
def gather_elements_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    data, indices = node.inputs
    data_shape = static_shape(data)
    axis = _axis(node, len(data_shape))
    dx = e.op("ScatterElements", e.zeros(data_shape, like=data), indices, dys[0], axis=axis, reduction="add")
    return [dx, None]


def _edge_part(e: Emitter, dy: ir.Value, axis: int, start: int, stop: int, mode: str, left: bool, length: int,
               rank: int) -> ir.Value:
    """The gradient that the padded positions [start, stop) on `axis` (one edge, width w) send to the input's
    `length` positions, in the input's extent on that axis: reflect mirrors them onto 1..w (the start) or
    length-1-w..length-2 (the end), edge sums them onto the first or last position, wrap moves them to the
    other end."""
    width = stop - start
    part = e.op("Slice", dy, e.ints([start]), e.ints([stop]), e.ints([axis]))
    if mode == "reflect":
        part = e.op("Slice", part, e.ints([width - 1]), e.ints([-width - 1]), e.ints([axis]), e.ints([-1]))
        before = 1 if left else length - 1 - width
    elif mode == "edge":
        part = e.reduce_sum(part, [axis], keepdims=True)
        before, width = (0 if left else length - 1), 1
    else:  # wrap: the start's pad holds the input's last positions, the end's its first
        before = length - width if left else 0
    pads = [0] * (2 * rank)
    pads[axis], pads[rank + axis] = before, length - before - width
    return e.op("Pad", part, e.ints(pads)) if before or length - before - width else part


def _mirrored_pad_grad(e: Emitter, node: ir.Node, dy: ir.Value, mode: str, begins: list[int],
                       ends: list[int]) -> ir.Value:
    """Pad reflect / edge / wrap: per padded axis (the padding is one axis after another, so is its gradient),
    the input's own span of dy plus each edge's part (_edge_part)."""
    in_shape = static_shape(node.inputs[0])
    rank = len(in_shape)
    if any(p < 0 for p in begins + ends):
        raise UnsupportedOpError(f"Pad mode '{mode}' with negative pads has no gradient (node '{node.name}')",
                                 "crop with a Slice, or freeze what feeds it", ops=["Pad"])
    shape = list(static_shape(node.outputs[0]))
    for axis in range(rank):
        a, b, length = begins[axis], ends[axis], in_shape[axis]
        if not a and not b:
            continue
        total = e.op("Slice", dy, e.ints([a]), e.ints([a + length]), e.ints([axis]))
        if a:
            total = e.op("Add", total, _edge_part(e, dy, axis, 0, a, mode, True, length, rank))
        if b:
            total = e.op("Add", total, _edge_part(e, dy, axis, a + length, shape[axis], mode, False, length, rank))
        dy, shape[axis] = total, length
    return dy


#: Pad modes whose padded positions copy input positions (their gradients flow back there)
MIRRORED_PADS = ("reflect", "edge", "wrap")


@register_gradient("Pad")
def pad_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    mode = attr(node, "mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("constant", *MIRRORED_PADS):
        raise UnsupportedOpError(f"Pad mode '{mode}' has no gradient (node '{node.name}')",
                                 "use constant padding, or freeze what feeds it")
    in_shape = static_shape(node.inputs[0])
    rank = len(in_shape)
    pads = ints_input(node, 1, "pads") or [0] * (2 * rank)
    axes = ints_input(node, 3, "axes") or list(range(rank))
    begins, ends = [0] * rank, [0] * rank
    for k, axis in enumerate(axes):
        begins[axis % rank] = pads[k]
        ends[axis % rank] = pads[k + len(axes)]
    if mode != "constant":
        return [_mirrored_pad_grad(e, node, dys[0], mode, begins, ends), None, None, None][: len(node.inputs)]
    out_shape = static_shape(node.outputs[0])
    # A negative pad cropped the input: the gradient pads it back with zeros.
    crop = [max(b, 0) for b in begins] + [max(x, 0) for x in ends]
    regrow = [max(-b, 0) for b in begins] + [max(-x, 0) for x in ends]
    dx = dys[0]
    if any(crop):
        starts = crop[:rank]
        stops = [n - c for n, c in zip(out_shape, crop[rank:])]
        dx = e.op("Slice", dx, e.ints(starts), e.ints(stops), e.ints(list(range(rank))))
    from_input = dx
    if any(regrow):
        dx = e.op("Pad", dx, e.ints(regrow))
    dvalue = None
    if len(node.inputs) > 2 and node.inputs[2] is not None and need[2]:
        # A trained constant_value fills every output position the input does not: it gets the rest of dy.
        every = list(range(rank))
        rest = e.op("Sub", e.reduce_sum(dys[0], every, keepdims=False),
                    e.reduce_sum(from_input, every, keepdims=False))
        dvalue = e.reshape(rest, static_shape(node.inputs[2]))
    return [dx, None, dvalue, None][: len(node.inputs)]
