"""Sorted row scatters (pass sort_scatter_rows): MergeRuns and ScatterSortedRows, fblc's device-only ops.

- MergeRuns(keys [G, N], positions [G, N] or none; run, depth) -> (keys', positions'): each line of
  N row numbers is made of sorted runs of `run`; output r of a line is element r of the stable merge
  of its pair of runs (the left run wins ties, so equal rows keep their update order). Its work-item
  finds how many of its first r come from the left run by a binary search along the merge path
  (log2(run) reads of each run), then reads its element. Without positions it is the first pass:
  keys are wrapped (a negative row counts from the end of `depth`) and a position is its own index.
- ScatterSortedRows(data or none, keys, positions, updates; axis, reduction[, shape]): ScatterElements
  of whole rows whose row numbers are sorted (without data, into zeros of `shape`). A work-item of
  target row d binary-searches the first update of d (log2(N) reads) and folds d's updates in
  sorted order, which is update order: the sums of the unsorted kernel (gather.py) and
  onnxruntime, bit for bit, without scanning the other rows' updates.
  Like gather.py's row scatter, a work-item owns a few whole texels of a row when the rows are whole
  float texels, else one element per lane.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, KernelBuilder, ctype_of
from fblc.codegen.cl import Kernel, div_index
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.kernels.gather import combine_template, fold_rows, own_index, start_accumulator, whole_texels
from fblc.compiler.index_map import is_zeros
from fblc.codegen.textures import TextureTable
from fblc.compiler.values import attr, numel, static_shape

FAMILY = "sort"


@register_kernel("MergeRuns")
def emit_merge_runs(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    keys = node.inputs[0]
    positions = node.inputs[1] if len(node.inputs) > 1 else None
    count = static_shape(keys)[1]
    run, depth = int(attr(node, "run")), int(attr(node, "depth"))
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    line = b.temp("int", f"{OUT_INDEX}0 * {count}", "line")

    def key(at: str) -> str:
        raw = b.load(keys, f"{line} + {at}")
        return raw if positions is not None else f"wrap_row({raw}, {depth})"

    start, na, nb, k, lo, hi, mid, j, src = (b.fresh(h) for h in ("start", "na", "nb", "k", "lo", "hi", "mid", "j",
                                                                    "src"))
    b.emit(f"const int {start} = {div_index(f'{OUT_INDEX}1', 2 * run)} * {2 * run};",
           f"const int {na} = min({run}, {count} - {start});",
           f"const int {nb} = clamp({count} - {start} - {run}, 0, {run});",
           f"const int {k} = {OUT_INDEX}1 - {start};",
           f"int {lo} = max(0, {k} - {nb}), {hi} = min({k}, {na});",
           f"while ({lo} < {hi}) {{  // is the left run's element {mid} among the first {k}?",
           f"  const int {mid} = ({lo} + {hi}) >> 1;",
           f"  if ({key(f'{start} + {mid}')} <= {key(f'{start} + {na} + {k} - 1 - {mid}')}) {lo} = {mid} + 1;",
           f"  else {hi} = {mid};",
           "}",
           f"const int {j} = {k} - {lo};",
           f"const int {src} = ({lo} < {na} && ({j} >= {nb} || {key(f'{start} + {lo}')} <= "
           f"{key(f'{start} + {na} + {j}')})) ? {start} + {lo} : {start} + {na} + {j};")
    position = src if positions is None else b.load(positions, f"{line} + {src}")
    results = {id(node.outputs[0]): key(src), id(node.outputs[1]): position}
    return [b.finish([results[id(out)] for out in b.outputs])]


def _first_update(b: KernelBuilder, keys: ir.Value, line: str, target: str) -> tuple[list[str], str]:
    """(C, its variable): C declaring the first index of `line` (a C expression) whose sorted row number is
    not below `target`: a binary search, log2(N) reads."""
    count = static_shape(keys)[1]
    lo, hi, mid = b.fresh("lo"), b.fresh("hi"), b.fresh("mid")
    return [f"int {lo} = 0, {hi} = {count};",
            f"while ({lo} < {hi}) {{",
            f"  const int {mid} = ({lo} + {hi}) >> 1;",
            f"  if ({b.load(keys, f'{line} + {mid}')} < {target}) {lo} = {mid} + 1; else {hi} = {mid};",
            "}"], lo


@register_kernel("ScatterSortedRows")
def emit_scatter_sorted_rows(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    data, keys, positions, updates = node.inputs[:4]  # no data: a zero table (sort_scatter_rows)
    data = None if data is None or is_zeros(data) else data
    data_shape = static_shape(node.outputs[0])
    axis = int(attr(node, "axis", 0)) % len(data_shape)
    depth, inner = data_shape[axis], numel(data_shape[axis + 1:])
    groups, count = static_shape(keys)
    ctype = ctype_of(node.outputs[0])
    combine = combine_template(node, ctype)
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    base = b.fresh("base")

    def sorted_updates(outer: str, target: str) -> tuple[list[str], str]:
        """The binary search for target's first update, then a loop over its run of equal row numbers."""
        line = f"{outer} * {count}" if groups > 1 else "0"
        search, u = _first_update(b, keys, line, target)
        return [*search,
                f"for (; {u} < {count}; ++{u}) {{",
                f"  if ({b.load(keys, f'{line} + {u}')} != {target}) break;",
                f"  const int {base} = ({outer} * {count} + {b.load(positions, f'{line} + {u}')}) * {inner};"], base

    if (ctype == "float" and inner % 4 == 0 and (data is None or whole_texels(b, data))
            and whole_texels(b, updates)):
        return [fold_rows(b, data, updates, combine, depth, inner, sorted_updates)]
    element, row, outer, target, acc = (b.fresh(h) for h in ("element", "row", "outer", "target", "acc"))
    b.emit(f"const int {element} = {own_index(data_shape)};",
           f"const int {row} = {div_index(element, inner)};",
           f"const int {outer} = {div_index(row, depth)};",
           f"const int {target} = {row} - {outer} * {depth};")
    if data is None:
        b.emit(f"{ctype} {acc} = 0;")
    else:
        start_accumulator(b, node, acc)
    loop, update_row = sorted_updates(outer, target)
    within = f"{element} - {row} * {inner}"
    b.emit(*loop, f"  {acc} = {combine.format(acc=acc, u=b.load(updates, f'{update_row} + {within}'))};", "}")
    return [b.finish([acc])]
