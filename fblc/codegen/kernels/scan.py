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

from fblc.codegen.builder import OUT_INDEX, KernelBuilder, ctype_of
from fblc.codegen.cl import Kernel, flat_index, strides_of
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.textures import TextureTable
from fblc.compiler.values import attr, ints_input, static_shape
from fblc.errors import UnsupportedOpError

FAMILY = "scan"


def _single(table: TextureTable, group: KernelGroup) -> KernelBuilder:
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(group.anchor.name)
    return b


def _line(b: KernelBuilder, shape: tuple[int, ...], axis: int, out_axes: list[int | None]) -> str:
    """A temp: the flat index in `shape` of the current output element's line start along `axis`;
    out_axes[k] is the output coordinate that input axis k reads (None: the axis itself)."""
    strides = strides_of(shape)
    terms = [(f"{OUT_INDEX}{out_axes[k]}", strides[k]) for k in range(len(shape)) if k != axis]
    return b.temp("int", flat_index(terms), "line")


def _at(line: str, j: str, stride: int) -> str:
    return f"{line} + {j}" if stride == 1 else f"{line} + {j} * {stride}"


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
    b = _single(table, group)
    line = _line(b, shape, axis, list(range(len(shape))))
    o, acc, j = f"{OUT_INDEX}{axis}", b.fresh("acc"), b.fresh("j")
    loops = {(0, 0): f"for (int {j} = 0; {j} <= {o}; ++{j})",
             (1, 0): f"for (int {j} = 0; {j} < {o}; ++{j})",
             (0, 1): f"for (int {j} = {n - 1}; {j} >= {o}; --{j})",
             (1, 1): f"for (int {j} = {n - 1}; {j} > {o}; --{j})"}
    b.emit(f"{ctype_of(node.outputs[0])} {acc} = 0;",
           f"{loops[(exclusive, reverse)]} {acc} += {b.load(x, _at(line, j, stride))};")
    return [b.finish([acc])]


@register_kernel("Trilu")
def emit_trilu(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    x = node.inputs[0]
    rank = len(static_shape(x))
    k = (ints_input(node, 1, "k") or [0])[0] if len(node.inputs) > 1 else 0
    b = _single(table, group)
    column_minus_row = f"({OUT_INDEX}{rank - 1} - {OUT_INDEX}{rank - 2})"
    keep = f"{column_minus_row} >= {k}" if int(attr(node, "upper", 1)) else f"{column_minus_row} <= {k}"
    strides = strides_of(static_shape(x))
    value = b.load(x, flat_index([(f"{OUT_INDEX}{a}", strides[a]) for a in range(rank)]))
    return [b.finish([f"(({keep}) ? {value} : 0)"])]


@register_kernel("OneHot")
def emit_one_hot(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    indices, _, values = node.inputs[:3]
    out_shape = static_shape(node.outputs[0])
    axis = int(attr(node, "axis", -1)) % len(out_shape)
    depth = out_shape[axis]
    b = _single(table, group)
    index_shape = static_shape(indices)
    strides = strides_of(index_shape)
    terms = [(f"{OUT_INDEX}{a if a < axis else a + 1}", strides[a]) for a in range(len(index_shape))]
    raw = b.temp("int", f"(int)({b.load(indices, flat_index(terms))})", "idx")
    wrapped = b.temp("int", f"{raw} < 0 ? {raw} + {depth} : {raw}", "idx")
    return [b.finish([f"({wrapped} == {OUT_INDEX}{axis} ? {b.load(values, '1')} : {b.load(values, '0')})"])]


@register_kernel("ArgMax", "ArgMin")
def emit_arg_extremum(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    x = node.inputs[0]
    shape = static_shape(x)
    axis = int(attr(node, "axis", 0)) % len(shape)
    keepdims = int(attr(node, "keepdims", 1))
    n, stride = shape[axis], strides_of(shape)[axis]
    better = ">" if node.op_type == "ArgMax" else "<"
    if int(attr(node, "select_last_index", 0)):
        better += "="
    b = _single(table, group)
    out_axes = [k if keepdims else (k if k < axis else k - 1) for k in range(len(shape))]
    line = _line(b, shape, axis, out_axes)
    best, at, j, v = b.fresh("best"), b.fresh("at"), b.fresh("j"), b.fresh("v")
    b.emit(f"{ctype_of(x)} {best} = {b.load(x, line)};",
           f"int {at} = 0;",
           f"for (int {j} = 1; {j} < {n}; ++{j}) {{",
           f"  const {ctype_of(x)} {v} = {b.load(x, _at(line, j, stride))};",
           f"  if ({v} {better} {best}) {{ {best} = {v}; {at} = {j}; }}",
           "}")
    return [b.finish([at])]


@register_kernel("TopK")
def emit_topk(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Values and indices from one kernel: output r along the axis is the element of rank r."""
    node = group.anchor
    x = node.inputs[0]
    shape = static_shape(x)
    axis = int(attr(node, "axis", -1)) % len(shape)
    n, stride = shape[axis], strides_of(shape)[axis]
    b = _single(table, group)
    line = _line(b, shape, axis, list(range(len(shape))))
    value, at, step, i, w, taken, last, last_at = (b.fresh(h) for h in (
        "value", "at", "step", "i", "w", "taken", "last", "lastat"))
    ctype = ctype_of(x)
    ahead = ">" if int(attr(node, "largest", 1)) else "<"
    before_pick = f"({w} {ahead} {value} || ({w} == {value} && {i} < {at}))"  # w, i precede the pick so far
    behind = "<" if ahead == ">" else ">"
    after_last = f"({w} {behind} {last} || ({w} == {last} && {i} > {last_at}))"  # w, i follow the last pick
    b.emit(f"{ctype} {value} = 0;",
           f"int {at} = -1;",
           f"for (int {step} = 0; {step} <= {OUT_INDEX}{axis}; ++{step}) {{",
           f"  const {ctype} {last} = {value};",
           f"  const int {last_at} = {at};",
           f"  bool {taken} = false;",
           f"  for (int {i} = 0; {i} < {n}; ++{i}) {{",
           f"    const {ctype} {w} = {b.load(x, _at(line, i, stride))};",
           f"    if (({step} == 0 || {after_last}) && (!{taken} || {before_pick})) {{",
           f"      {value} = {w}; {at} = {i}; {taken} = true;",
           "    }",
           "  }",
           "}")
    results = {id(node.outputs[0]): value, id(node.outputs[1]): at}
    return [b.finish([results[id(out)] for out in b.outputs])]
