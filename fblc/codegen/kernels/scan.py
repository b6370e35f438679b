"""Scans, masks and selections along one axis: CumSum, Trilu, OneHot, ArgMax, ArgMin, TopK.

Each lane owns one output element and loops over its line along the axis (extents and strides are
literals); no two work-items write the same element, so nothing races.

- CumSum: the prefix (suffix when reverse; without the element itself when exclusive) summed in
  onnxruntime's order, from the start of the scan.
- Trilu: the element, or 0 off the kept side of diagonal k (upper: col - row >= k, lower: <= k).
- OneHot: `on` where the coordinate along `axis` is the (wrapped) index, else `off`.
- ArgMax / ArgMin: the first extremum of the line (the last with select_last_index).
- TopK: output r along the axis is the line's element of rank r in the order (value, greater
  first for largest; ties: the lower index first, as in onnxruntime). The lane walks the order
  from its head: each pass over the line picks the first element after the previous pick, so
  rank r costs (r + 1) n reads, a line's k outputs O(k^2 n): linear in n for the small k of
  routing and beams (counting each candidate's rank was O(n^2) per output). sorted=0 leaves the
  order to the runtime: it runs sorted too.
"""

from __future__ import annotations

from typing import Callable

from fblc.codegen.builder import OUT_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, strides_of
from fblc.codegen.indexing import index_var
from fblc.codegen.ir import INT, Block, Expr, Var, const, flat_index, select
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.reads import dtype_of
from fblc.codegen.textures import TextureTable
from fblc.compiler.values import attr, ints_input, static_shape
from fblc.errors import UnsupportedOpError

FAMILY = "scan"
#: ArgMax / ArgMin: when an element replaces the extremum so far (select_last_index: on ties too)
BETTER: dict[tuple[str, int], Callable[[Expr, Expr], Expr]] = {
    ("ArgMax", 0): Expr.gt, ("ArgMax", 1): Expr.ge, ("ArgMin", 0): Expr.lt, ("ArgMin", 1): Expr.le}


def _o(axis: int) -> Var:
    return index_var(OUT_INDEX, axis)


def _line(block: Block, shape: tuple[int, ...], axis: int, out_axes: list[int]) -> Var:
    """The flat index in `shape` of the current output element's line start along `axis`;
    out_axes[k] is the output coordinate that input axis k (other than `axis`) reads."""
    strides = strides_of(shape)
    terms = [(_o(out_axes[k]), strides[k]) for k in range(len(shape)) if k != axis]
    return block.let(flat_index(terms), "line")


def _at(line: Expr, j: Expr, stride: int) -> Expr:
    return line + j if stride == 1 else line + j * stride


@register_kernel("CumSum")
def emit_cumsum(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    x = node.inputs[0]
    shape = static_shape(x)
    axis_input = ints_input(node, 1, "axis")
    if not axis_input:
        raise UnsupportedOpError(f"CumSum node '{node.name}' has no constant axis", "export with a fixed dim")
    axis = axis_input[0] % len(shape)
    n, stride = shape[axis], strides_of(shape)[axis]
    exclusive, reverse = int(attr(node, "exclusive", 0)), int(attr(node, "reverse", 0))
    b = KernelBuilder.for_group(table, group, FAMILY)
    body, o = b.body, _o(axis)
    line = _line(body, shape, axis, list(range(len(shape))))
    acc = body.mutable(const(0, dtype_of(node.outputs[0])), "acc")
    # (exclusive, reverse) -> the scan's first index, whether it stays in, and its step
    start, within, step = {(0, 0): (0, lambda j: j.le(o), "+="), (1, 0): (0, lambda j: j.lt(o), "+="),
                           (0, 1): (n - 1, lambda j: j.ge(o), "-="),
                           (1, 1): (n - 1, lambda j: j.gt(o), "-=")}[(exclusive, reverse)]
    with body.loop("j", start, None, condition=within, step_op=step) as (j, scan):
        scan.assign(acc, b.element(x, _at(line, j, stride)), "+=")
    return [b.finish([acc])]


@register_kernel("Trilu")
def emit_trilu(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    x = node.inputs[0]
    rank = len(static_shape(x))
    k = (ints_input(node, 1, "k") or [0])[0] if len(node.inputs) > 1 else 0
    b = KernelBuilder.for_group(table, group, FAMILY)
    column_minus_row = _o(rank - 1) - _o(rank - 2)
    keep = column_minus_row.ge(k) if int(attr(node, "upper", 1)) else column_minus_row.le(k)
    strides = strides_of(static_shape(x))
    value = b.element(x, flat_index([(_o(a), strides[a]) for a in range(rank)]))
    return [b.finish([select(keep, value, const(0, value.dtype))])]


@register_kernel("OneHot")
def emit_one_hot(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    indices, _, values = node.inputs[:3]
    out_shape = static_shape(node.outputs[0])
    axis = int(attr(node, "axis", -1)) % len(out_shape)
    depth = out_shape[axis]
    b = KernelBuilder.for_group(table, group, FAMILY)
    index_shape = static_shape(indices)
    strides = strides_of(index_shape)
    terms = [(_o(a if a < axis else a + 1), strides[a]) for a in range(len(index_shape))]
    raw = b.body.let(b.element(indices, flat_index(terms)).cast(INT), "idx")
    wrapped = b.body.let(select(raw.lt(0), raw + depth, raw), "idx")
    on, off = b.element(values, const(1)), b.element(values, const(0))
    return [b.finish([select(wrapped.eq(_o(axis)), on, off)])]


@register_kernel("ArgMax", "ArgMin")
def emit_arg_extremum(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    x = node.inputs[0]
    shape = static_shape(x)
    axis = int(attr(node, "axis", 0)) % len(shape)
    keepdims = int(attr(node, "keepdims", 1))
    n, stride = shape[axis], strides_of(shape)[axis]
    better = BETTER[(node.op_type, 1 if int(attr(node, "select_last_index", 0)) else 0)]
    b = KernelBuilder.for_group(table, group, FAMILY)
    body = b.body
    out_axes = [k if keepdims else (k if k < axis else k - 1) for k in range(len(shape))]
    line = _line(body, shape, axis, out_axes)
    best = body.mutable(b.element(x, line), "best")
    at = body.mutable(const(0), "at")
    with body.loop("j", 1, n) as (j, walk):
        v = walk.let(b.element(x, _at(line, j, stride)), "v")
        with walk.when(better(v, best)) as found:
            found.assign(best, v)
            found.assign(at, j)
    return [b.finish([at])]


@register_kernel("TopK")
def emit_topk(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Values and indices from one kernel: output r along the axis is the element of rank r."""
    node = group.anchor
    x = node.inputs[0]
    shape = static_shape(x)
    axis = int(attr(node, "axis", -1)) % len(shape)
    n, stride = shape[axis], strides_of(shape)[axis]
    b = KernelBuilder.for_group(table, group, FAMILY)
    body = b.body
    line = _line(body, shape, axis, list(range(len(shape))))
    largest = int(attr(node, "largest", 1))
    ahead, behind = (Expr.gt, Expr.lt) if largest else (Expr.lt, Expr.gt)
    value = body.mutable(const(0, dtype_of(x)), "value")
    at = body.mutable(const(-1), "at")
    with body.loop("step", 0, None, condition=lambda step: step.le(_o(axis))) as (step, ranks):
        last = ranks.let(value, "last")
        last_at = ranks.let(at, "lastat")
        taken = ranks.mutable(const(0), "taken")
        with ranks.loop("i", 0, n) as (i, walk):
            w = walk.let(b.element(x, _at(line, i, stride)), "w")
            before_pick = ahead(w, value).logical_or(w.eq(value).logical_and(i.lt(at)))  # w, i precede the pick
            after_last = behind(w, last).logical_or(w.eq(last).logical_and(i.gt(last_at)))  # w, i follow the last
            with walk.when(step.eq(0).logical_or(after_last).logical_and((~taken).logical_or(before_pick))) as pick:
                pick.assign(value, w)
                pick.assign(at, i)
                pick.assign(taken, const(1))
    results = {id(node.outputs[0]): value, id(node.outputs[1]): at}
    return [b.finish([results[id(out)] for out in b.outputs])]
