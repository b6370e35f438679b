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

from typing import Callable

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, KernelBuilder, ctype_of
from fblc.codegen.cl import Kernel, div_index, flat_index, mod_index, strides_of
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.textures import TextureTable
from fblc.errors import UnsupportedOpError
from fblc.compiler.index_map import is_zeros, row_major_strides
from fblc.compiler.values import attr, numel, static_shape
from fblc.passes.sort_scatter_rows import expanded_rows

FAMILY = "gather"


def _axis(node: ir.Node, rank: int) -> int:
    return int(attr(node, "axis", 0)) % max(rank, 1)


def _wrapped(b: KernelBuilder, raw: str, size: int, hint: str = "idx") -> str:
    """A temp holding index `raw` wrapped (negative counts from the end) and clamped to [0, size)."""
    value = b.temp("int", raw, hint)
    return b.temp("int", f"clamp({value} < 0 ? {value} + {size} : {value}, 0, {size - 1})", hint)


def own_index(shape: tuple[int, ...]) -> str:
    """Flat index of the current output element in a tensor of the output's shape."""
    return flat_index([(f"{OUT_INDEX}{k}", stride) for k, stride in enumerate(strides_of(shape))])


@register_kernel("Gather")
def emit_gather(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """out[i_0..i_{a-1}, j.., k..] = data[i.., indices[j..], k..] (j: the indices' coordinates)."""
    node = group.anchor
    data, indices = node.inputs
    data_shape = static_shape(data)
    index_shape = static_shape(indices)
    axis = _axis(node, len(data_shape))
    q = len(index_shape)
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    index_terms = [(f"{OUT_INDEX}{axis + k}", stride) for k, stride in enumerate(strides_of(index_shape))]
    row = _wrapped(b, b.load(indices, flat_index(index_terms)), data_shape[axis])
    strides = strides_of(data_shape)
    terms = [(f"{OUT_INDEX}{k}", strides[k]) for k in range(axis)]
    terms.append((row, strides[axis]))
    terms += [(f"{OUT_INDEX}{k + q - 1}", strides[k]) for k in range(axis + 1, len(data_shape))]
    return [b.finish([b.load(data, flat_index(terms))])]


@register_kernel("GatherElements")
def emit_gather_elements(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """out[i] = data[i with coordinate `axis` replaced by indices[i]]."""
    node = group.anchor
    data, indices = node.inputs
    data_shape = static_shape(data)
    index_shape = static_shape(indices)
    axis = _axis(node, len(data_shape))
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    along = _wrapped(b, b.load(indices, own_index(index_shape)), data_shape[axis])
    strides = strides_of(data_shape)
    terms = [(along if k == axis else f"{OUT_INDEX}{k}", strides[k]) for k in range(len(data_shape))]
    return [b.finish([b.load(data, flat_index(terms))])]


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
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    index_strides, strides = strides_of(index_shape), strides_of(data_shape)
    tuple_start = flat_index([(f"{OUT_INDEX}{j}", index_strides[j]) for j in range(lead)])
    terms = [(f"{OUT_INDEX}{j}", strides[j]) for j in range(batch)]
    for j in range(k):
        entry = b.load(indices, f"{tuple_start} + {j}" if j else tuple_start)
        terms.append((_wrapped(b, entry, data_shape[batch + j]), strides[batch + j]))
    terms += [(f"{OUT_INDEX}{lead + t}", strides[batch + k + t]) for t in range(len(data_shape) - batch - k)]
    return [b.finish([b.load(data, flat_index(terms))])]


# scatters ------------------------------------------------------------------------------------------

def combine_template(node: ir.Node, ctype: str) -> str:
    """C template over `acc` and `u` for the node's reduction."""
    reduction = attr(node, "reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    templates = {"none": "{u}", "add": "{acc} + {u}", "mul": "{acc} * {u}",
                 "max": ("fmax({acc}, {u})" if ctype == "float" else "max({acc}, {u})"),
                 "min": ("fmin({acc}, {u})" if ctype == "float" else "min({acc}, {u})")}
    if reduction not in templates:
        raise UnsupportedOpError(f"{node.op_type} reduction '{reduction}' (node '{node.name}') has no kernel",
                                 f"supported reductions: {', '.join(templates)}")
    return templates[reduction]


def start_accumulator(b: KernelBuilder, node: ir.Node, acc: str) -> None:
    """Declare the accumulator `acc` holding the data element (a literal 0 for a zero table)."""
    data = node.inputs[0]
    ctype = ctype_of(node.outputs[0])
    initial = "0" if is_zeros(data) else b.load(data, own_index(static_shape(data)))
    b.emit(f"{ctype} {acc} = {initial};")


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
    ctype = ctype_of(node.outputs[0])
    combine = combine_template(node, ctype)
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    if count and ctype == "float" and slice_size % 4 == 0 and whole_texels(b, data) and whole_texels(b, updates):
        return [_scatter_nd_slices(b, node, combine)]
    acc, u = b.fresh("acc"), b.fresh("u")
    start_accumulator(b, node, acc)
    if count == 0:
        return [b.finish([acc])]
    prefix = b.temp("int", flat_index([(f"{OUT_INDEX}{k}", strides[k]) for k in range(depth)]), "prefix")
    within = b.temp("int", flat_index([(f"{OUT_INDEX}{k}", strides[k]) for k in range(depth, len(data_shape))]),
                    "within")
    target = b.fresh("target")
    body = _target_lines(b, node, u, target)
    update_index = f"{u} * {slice_size} + {within}" if slice_size > 1 else u
    b.emit(f"for (int {u} = 0; {u} < {count}; ++{u}) {{", *body,
           f"  if ({target} == {prefix}) {acc} = {combine.format(acc=acc, u=b.load(updates, update_index))};",
           "}")
    return [b.finish([acc])]


def _target_lines(b: KernelBuilder, node: ir.Node, u: str, target: str) -> list[str]:
    """Loop-body C declaring `target`: the flat offset of update `u`'s slice, the sum over its index
    tuple of wrap(index) * stride (compared with the element's or the texel's slice start)."""
    data, indices = node.inputs[:2]
    data_shape, depth = static_shape(data), static_shape(indices)[-1]
    strides, raw = strides_of(data_shape), b.fresh("t")
    lines = [f"  int {target} = 0;"]
    for k in range(depth):
        position = f"{u} * {depth} + {k}" if depth > 1 else u
        wrapped = f"({raw} < 0 ? {raw} + {data_shape[k]} : {raw})"
        scaled = wrapped if strides[k] == 1 else f"{wrapped} * {strides[k]}"
        lines.append(f"  {{ const int {raw} = {b.load(indices, position)}; {target} += {scaled}; }}")
    return lines


SLICE_TEXELS = 16  # the most texels of one target slice a work-item folds together


def whole_texels(b: KernelBuilder, value: ir.Value) -> bool:
    """Whether `value` is stored (or viewed) contiguously from a texel boundary, so that its
    elements 4k..4k+3 are one texel of the tensor that holds it."""
    if b.constant_scalar(value) is not None:
        return False
    _, index_map = b.strided(value)
    return index_map.contiguous or (index_map.offset % 4 == 0 and
                                    list(index_map.strides) == row_major_strides(index_map.shape))


def texel_of(b: KernelBuilder, value: ir.Value, element: str) -> str:
    """C expression: the texel of `value` (see whole_texels) that starts at element `element`."""
    root, index_map = b.strided(value)
    arg, texture = b.argument(root)
    start = f"{element} + {index_map.offset}" if index_map.offset else element
    return b.read_texel(arg, texture, f"({start}) >> 2")


def _scatter_nd_slices(b: KernelBuilder, node: ir.Node, combine: str) -> Kernel:
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
    first, prefix, within = b.fresh("first"), b.fresh("prefix"), b.fresh("within")
    accs, u, target = b.fresh("acc"), b.fresh("update"), b.fresh("target")
    code = [f"const int {first} = {b.item_first};",
            f"const int {prefix} = {first} - {mod_index(first, slice_size)};",
            f"const int {within} = {first} - {prefix};",
            f"float {accs}[{4 * per}];"]
    initial = "(float4)(0.0f)" if is_zeros(data) else texel_of(b, data, f"{first} + 4 * tt")
    code += [f"for (int tt = 0; tt < {per}; ++tt) vstore4({initial}, tt, {accs});",
             f"for (int {u} = 0; {u} < {count}; ++{u}) {{", *_target_lines(b, node, u, target)]
    update = texel_of(b, updates, f"{u} * {slice_size} + {within} + 4 * tt")
    folded = combine.format(acc=f"vload4(tt, {accs})", u=update)
    code += [f"  if ({target} != {prefix}) continue;",
             f"  for (int tt = 0; tt < {per}; ++tt) vstore4({folded}, tt, {accs});",
             "}"]
    b.emit_texel(*code)
    return b.finish([f"{accs}[{b.item_lane}]"])


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
    ctype = ctype_of(node.outputs[0])
    combine = combine_template(node, ctype)
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    if _row_scatter(b, node):
        return [_scatter_elements_rows(b, node, combine)]
    acc, j = b.fresh("acc"), b.fresh("j")
    start_accumulator(b, node, acc)
    if numel(index_shape) == 0:
        return [b.finish([acc])]
    index_strides = strides_of(index_shape)
    # Indices may be smaller than data off `axis`: elements outside their extent get no update.
    reachable = [f"{OUT_INDEX}{k} < {index_shape[k]}" for k in range(rank)
                 if k != axis and index_shape[k] < data_shape[k]]
    line = b.temp("int", flat_index([(f"{OUT_INDEX}{k}", index_strides[k]) for k in range(rank) if k != axis]), "line")
    position = f"{line} + {j} * {index_strides[axis]}" if index_strides[axis] != 1 else f"{line} + {j}"
    raw = b.fresh("t")
    loop = [f"for (int {j} = 0; {j} < {index_shape[axis]}; ++{j}) {{",
            f"  const int {raw} = {b.load(indices, position)};",
            f"  if (({raw} < 0 ? {raw} + {data_shape[axis]} : {raw}) == {OUT_INDEX}{axis})",
            f"    {acc} = {combine.format(acc=acc, u=b.load(updates, position))};",
            "}"]
    if reachable:
        b.emit(f"if ({' && '.join(reachable)}) {{", *[f"  {text}" for text in loop], "}")
    else:
        b.emit(*loop)
    return [b.finish([acc])]


def _row_scatter(b: KernelBuilder, node: ir.Node) -> bool:
    """Whether a ScatterElements scatters whole rows (sort_scatter_rows.expanded_rows) that are whole
    float texels of data and updates."""
    data, updates = node.inputs[0], node.inputs[2]
    found = expanded_rows(node)
    if found is None or ctype_of(node.outputs[0]) != "float":
        return False
    return (numel(static_shape(data)[found[2] + 1:]) % 4 == 0 and (is_zeros(data) or whole_texels(b, data))
            and whole_texels(b, updates))


def _scatter_elements_rows(b: KernelBuilder, node: ir.Node, combine: str) -> Kernel:
    """ScatterElements of whole rows (see _row_scatter), as `_scatter_nd_slices` does ScatterND: a
    work-item owns texels of one target row and scans the updates' row numbers once for all of them
    (the lane path reads them once per element, the gradient of a 32k-row embedding N * 32k * width
    times); matching rows fold in update order (fold_rows)."""
    data, indices, updates = node.inputs[:3]
    data_shape, index_shape = static_shape(data), static_shape(indices)
    axis = _axis(node, len(data_shape))
    depth, count, inner = data_shape[axis], index_shape[axis], numel(data_shape[axis + 1:])
    u, base, raw = b.fresh("update"), b.fresh("base"), b.fresh("t")

    def scan_all(outer: str, target: str) -> tuple[list[str], str]:
        return [f"for (int {u} = 0; {u} < {count}; ++{u}) {{",
                f"  const int {base} = ({outer} * {count} + {u}) * {inner};",
                f"  const int {raw} = {b.load(indices, base)};",
                f"  if (wrap_row({raw}, {depth}) != {target}) continue;"], base

    return fold_rows(b, None if is_zeros(data) else data, updates, combine, depth, inner, scan_all)


def slice_texels(elements: int) -> int:
    """The texels of a slice of `elements` (a multiple of 4) that one work-item folds: the most, up to
    SLICE_TEXELS, that divide the slice (so a work-item's texels never leave it)."""
    return max(d for d in range(1, SLICE_TEXELS + 1) if (elements // 4) % d == 0)


#: (outer, target) -> the C lines of a loop over the updates of target row `target` (of leading index
#: `outer`), in update order, the last line inside its open body, and the C expression of the
#: matching update row's first element
UpdateRows = Callable[[str, str], tuple[list[str], str]]


def fold_rows(b: KernelBuilder, data: ir.Value | None, updates: ir.Value, combine: str, depth: int, inner: int,
              updates_of: UpdateRows) -> Kernel:
    """A row scatter by whole texels into data [.., depth, inner] (None: a zero table): a work-item owns
    slice_texels(inner) texels of one target row, starts from the data's texels and folds the texels of
    each update row that `updates_of` finds, into float4 accumulators in the order it gives."""
    per = slice_texels(inner)
    b.texels_per_item = per
    first, row, outer, within, target, accs = (b.fresh(h) for h in ("first", "row", "outer", "within", "target",
                                                                     "acc"))
    initial = "(float4)(0.0f)" if data is None else texel_of(b, data, f"{first} + 4 * tt")
    loop, update_row = updates_of(outer, target)
    folded = combine.format(acc=f"vload4(tt, {accs})", u=texel_of(b, updates, f"{update_row} + {within} + 4 * tt"))
    b.emit_texel(f"const int {first} = {b.item_first};",
                 f"const int {row} = {div_index(first, inner)};",
                 f"const int {outer} = {div_index(row, depth)};",
                 f"const int {within} = {first} - {row} * {inner};",
                 f"const int {target} = {row} - {outer} * {depth};",
                 f"float {accs}[{4 * per}];",
                 f"for (int tt = 0; tt < {per}; ++tt) vstore4({initial}, tt, {accs});",
                 *loop,
                 f"  for (int tt = 0; tt < {per}; ++tt) vstore4({folded}, tt, {accs});",
                 "}")
    return b.finish([f"{accs}[{b.item_lane}]"])
