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
from fblc.codegen.cl import Kernel
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.kernels.gather import (SLICE_TEXELS, combine_template, own_index, start_accumulator, texel_of,
                                         whole_texels)
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
    b.emit(f"const int {start} = ({OUT_INDEX}1 / {2 * run}) * {2 * run};",
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
    data_shape = static_shape(node.outputs[0])
    zeros = data is None or is_zeros(data)
    axis = int(attr(node, "axis", 0)) % len(data_shape)
    depth, inner = data_shape[axis], numel(data_shape[axis + 1:])
    groups, count = static_shape(keys)
    combine = combine_template(node, ctype_of(node.outputs[0]))
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    texels = (ctype_of(node.outputs[0]) == "float" and inner % 4 == 0 and (zeros or whole_texels(b, data))
              and whole_texels(b, updates))
    per = max(d for d in range(1, SLICE_TEXELS + 1) if (inner // 4) % d == 0) if texels else 1
    b.texels_per_item = per  # before item_first: a work-item's texels lie in one row
    first, row, outer, within, target, line = (b.fresh(h) for h in ("first", "row", "outer", "within", "target",
                                                                     "line"))
    code = [f"const int {first} = {b.item_first if texels else own_index(data_shape)};",
            f"const int {row} = {first} / {inner};",
            f"const int {outer} = {row} / {depth};",
            f"const int {within} = {first} - {row} * {inner};",
            f"const int {target} = {row} - {outer} * {depth};",
            f"const int {line} = {outer if groups > 1 else 0} * {count};"]
    search, u = _first_update(b, keys, line, target)
    base = b.fresh("base")
    scan = [f"for (; {u} < {count}; ++{u}) {{",
            f"  if ({b.load(keys, f'{line} + {u}')} != {target}) break;",
            f"  const int {base} = ({outer} * {count} + {b.load(positions, f'{line} + {u}')}) * {inner} + {within};"]
    if not texels:
        acc = b.fresh("acc")
        b.emit(*code)
        if zeros:
            b.emit(f"{ctype_of(node.outputs[0])} {acc} = 0;")
        else:
            start_accumulator(b, node, acc)
        b.emit(*search, *scan, f"  {acc} = {combine.format(acc=acc, u=b.load(updates, base))};", "}")
        return [b.finish([acc])]
    accs = b.fresh("acc")
    initial = "(float4)(0.0f)" if zeros else texel_of(b, data, f"{first} + 4 * tt")
    folded = combine.format(acc=f"vload4(tt, {accs})", u=texel_of(b, updates, f"{base} + 4 * tt"))
    b.emit_texel(*code, f"float {accs}[{4 * per}];",
                 f"for (int tt = 0; tt < {per}; ++tt) vstore4({initial}, tt, {accs});",
                 *search, *scan, f"  for (int tt = 0; tt < {per}; ++tt) vstore4({folded}, tt, {accs});", "}")
    return [b.finish([f"{accs}[{b.item_lane}]"])]
