"""Scans, masks and selections along one axis: CumSum, Trilu, OneHot, ArgMax, ArgMin, TopK.

Each lane owns one output element and loops over its line along the axis (literal extents and strides), in
onnxruntime's order and tie rules; docs/ARCHITECTURE.md §3.
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import strides_of
from fblc.codegen.ir import INT, Expr, const, flat_index, select
from fblc.codegen.kernels import lane_kernel, out_axis, own_index
from fblc.codegen.kernels.gather import wrap
from fblc.codegen.reads import dtype_of
from fblc.compiler.values import attr, ints_input, static_shape
from fblc.errors import UnsupportedOpError

FAMILY = "scan"
#: ArgMax / ArgMin: when an element replaces the extremum so far (select_last_index: on ties too)
BETTER: dict[tuple[str, int], Callable[[Expr, Expr], Expr]] = {
    ("ArgMax", 0): Expr.gt, ("ArgMax", 1): Expr.ge, ("ArgMin", 0): Expr.lt, ("ArgMin", 1): Expr.le}
#: element j of a line (no j: its first)
Reader = Callable[..., Expr]


def _line(b: KernelBuilder, x: ir.Value, axis: int, out_axes: list[int] | None = None) -> tuple[int, Reader]:
    """(length, Reader) of x's line along `axis` through the current output element, whose start
    it declares in b.body; out_axes[k] is the output coordinate that input axis k (other than `axis`) reads."""
    shape = static_shape(x)
    strides = strides_of(shape)
    axes = out_axes or list(range(len(shape)))
    line = b.body.let(flat_index([(out_axis(axes[k]), strides[k]) for k in range(len(shape)) if k != axis]), "line")
    return shape[axis], lambda j=None: b.element(x, line if j is None else line + flat_index([(j, strides[axis])]))


@lane_kernel(FAMILY, "CumSum")
def emit_cumsum(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    axis_input = ints_input(node, 1, "axis")
    if not axis_input:
        raise UnsupportedOpError(f"CumSum node '{node.name}' has no constant axis", "export with a fixed dim")
    axis = axis_input[0] % len(static_shape(node.inputs[0]))
    exclusive, reverse = int(attr(node, "exclusive", 0)), int(attr(node, "reverse", 0))
    o = out_axis(axis)
    n, element = _line(b, node.inputs[0], axis)
    acc = b.body.mutable(const(0, dtype_of(node.outputs[0])), "acc")
    # (exclusive, reverse) -> the scan's first index, whether it stays in, and its step
    start, within, step = {(0, 0): (0, lambda j: j.le(o), "+="), (1, 0): (0, lambda j: j.lt(o), "+="),
                           (0, 1): (n - 1, lambda j: j.ge(o), "-="),
                           (1, 1): (n - 1, lambda j: j.gt(o), "-=")}[(exclusive, reverse)]
    with b.body.loop("j", start, None, condition=within, step_op=step) as (j, scan):
        scan.assign(acc, element(j), "+=")
    return [acc]


@lane_kernel(FAMILY, "Trilu")
def emit_trilu(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    x = node.inputs[0]
    rank = len(static_shape(x))
    k = (ints_input(node, 1, "k") or [0])[0]
    column_minus_row = out_axis(rank - 1) - out_axis(rank - 2)
    keep = column_minus_row.ge(k) if int(attr(node, "upper", 1)) else column_minus_row.le(k)
    value = b.element(x, own_index(static_shape(x)))
    return [select(keep, value, const(0, value.dtype))]


@lane_kernel(FAMILY, "OneHot")
def emit_one_hot(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    indices, _, values = node.inputs[:3]
    out_shape = static_shape(node.outputs[0])
    axis = int(attr(node, "axis", -1)) % len(out_shape)
    terms = [(out_axis(a if a < axis else a + 1), stride) for a, stride in enumerate(strides_of(static_shape(indices)))]
    raw = b.body.let(b.element(indices, flat_index(terms)).cast(INT), "idx")
    wrapped = b.body.let(wrap(raw, out_shape[axis]), "idx")
    on, off = b.element(values, const(1)), b.element(values, const(0))
    return [select(wrapped.eq(out_axis(axis)), on, off)]


@lane_kernel(FAMILY, "ArgMax", "ArgMin")
def emit_arg_extremum(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    rank = len(static_shape(node.inputs[0]))
    axis = int(attr(node, "axis", 0)) % rank
    keepdims = int(attr(node, "keepdims", 1))
    better = BETTER[(node.op_type, 1 if int(attr(node, "select_last_index", 0)) else 0)]
    n, element = _line(b, node.inputs[0], axis, [k if keepdims or k < axis else k - 1 for k in range(rank)])
    best = b.body.mutable(element(), "best")
    at = b.body.mutable(const(0), "at")
    with b.body.loop("j", 1, n) as (j, walk):
        v = walk.let(element(j), "v")
        with walk.when(better(v, best)) as found:
            found.assign(best, v)
            found.assign(at, j)
    return [at]


@lane_kernel(FAMILY, "TopK")
def emit_topk(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """Values and indices from one kernel: output r along the axis is the element of rank r."""
    x = node.inputs[0]
    axis = int(attr(node, "axis", -1)) % len(static_shape(x))
    n, element = _line(b, x, axis)
    ahead, behind = (Expr.gt, Expr.lt) if int(attr(node, "largest", 1)) else (Expr.lt, Expr.gt)
    body = b.body
    value = body.mutable(const(0, dtype_of(x)), "value")
    at = body.mutable(const(-1), "at")
    with body.loop("step", 0, None, condition=lambda step: step.le(out_axis(axis))) as (step, ranks):
        last = ranks.let(value, "last")
        last_at = ranks.let(at, "lastat")
        taken = ranks.mutable(const(0), "taken")
        with ranks.loop("i", 0, n) as (i, walk):
            w = walk.let(element(i), "w")
            before_pick = ahead(w, value).logical_or(w.eq(value).logical_and(i.lt(at)))  # w, i precede the pick
            after_last = behind(w, last).logical_or(w.eq(last).logical_and(i.gt(last_at)))  # w, i follow the last
            with walk.when(step.eq(0).logical_or(after_last).logical_and((~taken).logical_or(before_pick))) as pick:
                pick.assign(value, w)
                pick.assign(at, i)
                pick.assign(taken, const(1))
    return [value if out is node.outputs[0] else at for out in b.outputs]
