"""Sorted row scatters and long TopK lines (passes sort_scatter_rows, sort_topk): MergeRuns and ScatterSortedRows,
fblc's device-only ops.

MergeRuns merges pairs of sorted runs of row numbers (a merge-path binary search per work-item, then each of its
consecutive outputs in O(1)); ScatterSortedRows
folds each target row's updates in update order, bit for bit the sums of gather.py's unsorted kernel;
docs/ARCHITECTURE.md §2 (`sort_scatter_rows`) and §3.
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.ir import INT, Block, Break, Expr, Var, call, const, div_index, select
from fblc.codegen.kernels import lane_kernel, out_axis, own_index
from fblc.codegen.kernels.gather import FoldRow, combiner, fold_rows, start_accumulator, texel_rows
from fblc.compiler.index_map import is_zeros
from fblc.compiler.values import attr, numel, static_shape

FAMILY = "sort"


def _bisect(block: Block, lo: Expr, hi: Expr, below: Callable[[Expr], Expr]) -> Var:
    """Declare `lo` and `hi` in `block` and narrow them, by binary search, to the first index in [lo, hi)
    where `below(index)` fails (all before it pass); returns the variable lo."""
    first, last = block.mutable(lo, "lo"), block.mutable(hi, "hi")
    with block.repeat_while(first.lt(last)) as search:
        mid = search.let((first + last) >> 1, "mid")
        left, right = search.either(below(mid))
        left.assign(first, mid + 1)
        right.assign(last, mid)
    return first


@lane_kernel(FAMILY, "MergeRuns")
def emit_merge_runs(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    keys = node.inputs[0]
    positions = node.inputs[1] if len(node.inputs) > 1 else None
    count = static_shape(keys)[1]
    run, depth = int(attr(node, "run")), int(attr(node, "depth"))
    body = b.body
    line = body.let(out_axis(0) * count, "line", INT)

    def key(at: Expr) -> Expr:
        raw = b.element(keys, line + at)
        return raw if positions is not None else call("wrap_row", raw, depth, dtype=INT)

    column = out_axis(1)
    start = body.let(div_index(column, 2 * run) * (2 * run), "start")
    na = body.let(call("min", run, const(count) - start), "na")
    nb = body.let(call("clamp", const(count) - start - run, 0, run), "nb")
    k = body.let(column - start, "k")
    # a work-item's outputs are consecutive (passes/sort_topk.merge_texels): where this one follows its previous
    # one in the same pair of runs, the left run's count among the first k is the previous count plus its pick,
    # and the search's range is that one index (no step); else the merge-path binary search over
    # [max(0, k - nb), min(k, na)]
    last, taken = b.prologue.mutable(const(-1), "last"), b.prologue.mutable(const(0), "taken")
    flat = body.let(line + column, "flat")
    resume = body.let(flat.eq(last + 1).logical_and(k.gt(0)), "resume")
    lo = _bisect(body, select(resume, taken, call("max", 0, k - nb)), select(resume, taken, call("min", k, na)),
                 lambda mid: key(start + mid).le(key(start + na + k - 1 - mid)))  # the left run's among the first k
    j = body.let(k - lo, "j")
    from_left = body.let(lo.lt(na).logical_and(j.ge(nb).logical_or(key(start + lo).le(key(start + na + j)))),
                         "left", INT)
    src = body.let(select(from_left, start + lo, start + na + j), "src")
    body.assign(taken, lo + select(from_left, const(1), const(0)))
    body.assign(last, flat)
    position = src if positions is None else b.element(positions, line + src)
    return [key(src) if out is node.outputs[0] else position for out in b.outputs]


@lane_kernel(FAMILY, "ScatterSortedRows")
def emit_scatter_sorted_rows(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    data, keys, positions, updates = node.inputs[:4]  # no data: a zero table (sort_scatter_rows)
    data = None if data is None or is_zeros(data) else data
    data_shape = static_shape(node.outputs[0])
    axis = int(attr(node, "axis", 0)) % len(data_shape)
    depth, inner = data_shape[axis], numel(data_shape[axis + 1:])
    groups, count = static_shape(keys)
    combine = combiner(node)

    def sorted_updates(block: Block, outer: Expr, target: Expr, fold: FoldRow) -> None:
        """The binary search for target's first update, then a loop over its run of equal row numbers."""
        line = outer * count if groups > 1 else const(0)
        first = _bisect(block, const(0), const(count), lambda mid: b.element(keys, line + mid).lt(target))
        with block.loop("u", first, count) as (u, run):
            with run.when(b.element(keys, line + u).ne(target)) as past:
                past.add(Break())
            fold(run, run.let((outer * count + b.element(positions, line + u)) * inner, "base"))

    if texel_rows(b, node, data, updates, inner):
        return [fold_rows(b, data, updates, combine, depth, inner, sorted_updates)]
    body = b.body
    element = body.let(own_index(data_shape), "element", INT)
    row = body.let(div_index(element, inner), "row")
    outer = body.let(div_index(row, depth), "outer")
    target = body.let(row - outer * depth, "target")
    acc = start_accumulator(b, node)

    def fold(block: Block, update_row: Expr) -> None:
        block.assign(acc, combine(acc, b.element(updates, update_row + (element - row * inner))))

    sorted_updates(body, outer, target, fold)
    return [acc]
