"""Normalisation kernels: LayerNormalization, InstanceNormalization (LayerNormalization over the spatial
axes, from 2, with a per-channel scale and bias, and never statistic outputs).

Row statistics come from a statistics kernel when they are outputs (a training step), else once per
work-item in the Y kernel's prologue (rows of whole texels) or per lane; docs/ARCHITECTURE.md §3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, TEXEL_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel
from fblc.codegen.indexing import broadcast_view_index
from fblc.codegen.ir import FLOAT, FLOAT4, Block, Element, Expr, Var, call, const, vector
from fblc.codegen.kernels import KernelGroup, out_axis, own_index, register_kernel
from fblc.codegen.textures import TextureTable
from fblc.errors import UnsupportedOpError
from fblc.compiler.index_map import IndexMap, map_of
from fblc.compiler.values import attr, numel, static_shape
from fblc.profiles.profile import PRIVATE_FLOATS

FAMILY = "normalization"
ROW_CACHE = PRIVATE_FLOATS // 4  # texels of a row a work-item keeps in private memory
ITEM_TEXELS = 64  # most texels of one row a work-item computes


def item_texels(texels: int) -> int:
    """Texels of one row a work-item computes: all of them, or the largest divisor up to ITEM_TEXELS."""
    return max(d for d in range(1, min(texels, ITEM_TEXELS) + 1) if texels % d == 0)


@dataclass
class _Row:
    """Texels k = 0..count-1 of `x` from flat element `first`, read whole: one row of 4 * count elements, or
    in a group kernel the work-item's share of it, texels `start`, `start + step`... (`slots` of them, the
    last one past the row's end for some work-items when `step` does not divide `count`). The first pass
    over a share of at most ROW_CACHE texels copies it into a private array the later passes read."""

    b: KernelBuilder
    x: ir.Value
    first: Expr  # a multiple of 4
    count: int
    start: Expr = field(default_factory=lambda: const(0))
    step: int = 1
    cache_limit: int = ROW_CACHE  # the most texels its private copy may take
    _cache: Var | None = field(default=None, init=False)  # the private copy, once made

    @property
    def slots(self) -> int:
        return -(-self.count // self.step)

    def read(self, k: Expr) -> Expr:
        """Texel `k` read from the tensor (a strided view, with no texture of its own: element by element)."""
        if map_of(self.x).contiguous:
            argument, texture = self.b.input_argument(self.x)
            return self.b.texel(argument, texture, (self.first >> 2) + k)
        return vector(FLOAT4, *(self.b.element(self.x, self.first + 4 * k + j) for j in range(4)))

    def loop(self, block: Block, body: Callable[[Block, Expr], None]) -> None:
        """for each texel of the share: `body(loop body, texel)`; the first pass over a short share makes the
        private copy."""
        copy = self._cache is None and self.slots <= self.cache_limit
        cache = block.array("row", FLOAT4, self.slots) if copy else self._cache
        with block.loop("m", 0, self.slots) as (m, each):
            k = m if self.step == 1 else self.start + m * self.step
            if self.count % self.step:  # the work-items whose share is one texel shorter skip its last slot
                each = each.either(k.lt(self.count))[0]
            texel = each.let(self.read(k) if cache is None or copy else Element(cache, m), "x")
            if copy:
                each.assign(Element(cache, m), texel)
            body(each, texel)
        self._cache = cache


# LayerNormalization --------------------------------------------------------------------------------

def layer_norm_geometry(node: ir.Node) -> tuple[tuple[int, ...], int, int]:
    """(input shape, first normalised axis, elements per normalised row); InstanceNormalization
    normalises every [n, c] plane, the axes from 2 on."""
    shape = static_shape(node.inputs[0])
    if node.op_type == "InstanceNormalization":
        if len(shape) < 3:
            raise UnsupportedOpError(f"InstanceNormalization of a rank-{len(shape)} input (node '{node.name}') has "
                                     "no kernel", "give it an input [N, C, spatial...]")
        axis = 2
    else:
        axis = int(attr(node, "axis", -1)) % len(shape)
    return shape, axis, numel(shape[axis:])


def _lanes_sum(v: Expr) -> Expr:
    return v.lane(0) + v.lane(1) + v.lane(2) + v.lane(3)


def _row_statistics(b: KernelBuilder, node: ir.Node, prologue: bool = False) -> tuple[Var, Var]:
    """Mean and 1/sqrt(var + eps) of the row of the lane's element (or with `prologue`, in the per-texel
    prologue, of the work-item's first element): two passes (mean, then centred squares) rather than
    E[x^2] - E[x]^2, which cancels badly when the mean is large next to the spread. A row of whole
    texels is read four elements per read, once: the second pass reads a private copy where it fits
    (ROW_CACHE). In a group kernel (`b.group_size`) each work-item folds every group_size-th texel (or
    element, of a row of partial texels) and the group merges the sums (KernelBuilder.merge_across_group)."""
    x = node.inputs[0]
    shape, axis, count = layer_norm_geometry(node)
    trailing = range(axis, len(shape))
    block = b.prologue if prologue else b.body
    row_start = own_index(shape, trailing, TEXEL_INDEX) if prologue else block.let(own_index(shape, trailing), "row")
    epsilon, n = const(float(attr(node, "epsilon", 1e-5)), FLOAT), const(float(count), FLOAT)
    group = b.group_size
    if count % 4 == 0:  # whole texels: each read once (a group's work-items each keep their share)
        row = _Row(b, x, row_start, count // 4, *((b.lid, group) if group else ()))
        total = block.mutable(vector(FLOAT4, 0.0), "sum")
        row.loop(block, lambda each, v: each.assign(total, v, "+="))
        total_sum = block.mutable(_lanes_sum(total), "total") if group else _lanes_sum(total)
        if group:
            b.merge_across_group([total_sum])
        mean = block.let(total_sum / n, "mean")
        centred = block.mutable(vector(FLOAT4, 0.0), "sq")
        row.loop(block, lambda each, v: each.assign(centred, (v - mean) * (v - mean), "+="))
        centred_sum = block.mutable(_lanes_sum(centred), "total") if group else _lanes_sum(centred)
        if group:
            b.merge_across_group([centred_sum])
        return mean, block.let(call("rsqrt", centred_sum / n + epsilon), "inv")
    first, step = (b.lid, group) if group else (0, 1)
    total = block.mutable(const(0.0, FLOAT), "sum")
    with block.loop("r", first, count, step=step) as (r, each):
        each.assign(total, b.element(x, row_start + r), "+=")
    if group:
        b.merge_across_group([total])
    mean = block.let(total / n, "mean")
    centred = block.mutable(const(0.0, FLOAT), "sq")
    with block.loop("r", first, count, step=step) as (r, each):
        d = each.let(b.element(x, row_start + r) - mean, "d")
        each.assign(centred, d * d, "+=")
    if group:
        b.merge_across_group([centred])
    return mean, block.let(call("rsqrt", centred / n + epsilon), "inv")


def _texel_statistics(b: KernelBuilder, node: ir.Node) -> tuple[Expr, Expr]:
    """_row_statistics of a group kernel's rows of whole texels, for the 4 rows of a statistics texel at once
    in the per-texel prologue: each work-item folds its share of each row, and each merge joins the 4 rows'
    partials together (one tree for 4 rows, not 4; the texel is then work-item 0's to write). A lane past
    the last row repeats it, so that every work-item reaches every barrier."""
    x, (_, _, count), group = node.inputs[0], layer_norm_geometry(node), b.group_size
    assert group is not None and count % 4 == 0
    rows, block = numel(static_shape(node.outputs[1])), b.prologue
    epsilon, n = const(float(attr(node, "epsilon", 1e-5)), FLOAT), const(float(count), FLOAT)
    shares = []
    for lane in range(4):
        row = b.first_element + lane if rows % 4 == 0 else call("min", b.first_element + lane, rows - 1)
        shares.append(_Row(b, x, block.let(row * count, "row"), count // 4, b.lid, group, ROW_CACHE // 4))

    def merged(fold: Callable[[int, Expr], Expr]) -> list[Var]:
        """Each row k's sum of fold(k, texel) over its share, its lanes added, joined across the group."""
        totals = []
        for k, share in enumerate(shares):
            acc = block.mutable(vector(FLOAT4, 0.0), "sum")
            share.loop(block, lambda each, v: each.assign(acc, fold(k, v), "+="))  # noqa: B023 (called at once)
            totals.append(block.mutable(_lanes_sum(acc), "total"))
        b.merge_across_group(totals, prologue=True)
        return totals

    means = [block.let(total / n, "mean") for total in merged(lambda k, v: v)]
    squares = merged(lambda k, v: (v - means[k]) * (v - means[k]))
    inverses = [block.let(call("rsqrt", square / n + epsilon), "inv") for square in squares]
    return vector(FLOAT4, *means).lane(b.lane), vector(FLOAT4, *inverses).lane(b.lane)


def has_statistics(node: ir.Node) -> bool:
    return len(node.outputs) >= 3 and all(o is not None and o.name for o in node.outputs[1:3])


@register_kernel("LayerNormalization", "InstanceNormalization")
def emit_layer_norm(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Y = (X - mean) * inv_std * Scale + B over the trailing axes from `axis` (from 2, Scale and B
    per channel, for InstanceNormalization)."""
    node = group.anchor
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    shape, _, count = layer_norm_geometry(node)
    kernels: list[Kernel] = []
    statistics = has_statistics(node)
    if statistics:  # both written (even one nothing reads) so that the Y kernel can read them back
        stats = KernelBuilder(table, f"{group.name}_stats", FAMILY, list(node.outputs[1:3]))
        stats.nodes.append(node.name)
        stats.take_group()  # kernels/schedules.py: a work-group per row for a long row
        whole = stats.group_size is not None and count % 4 == 0
        kernels.append(stats.finish(list(_texel_statistics(stats, node) if whole else _row_statistics(stats, node))))
    y = node.outputs[0]
    if y not in group.outputs:
        return kernels
    b = KernelBuilder(table, group.name, FAMILY, [y])
    b.nodes.append(node.name)

    def broadcast(v: ir.Value) -> Expr:
        """`v` at the current element, numpy-broadcast to the input's shape."""
        return b.element(v, broadcast_view_index(IndexMap.identity(static_shape(v)), shape, OUT_INDEX))

    if statistics:
        mean, inv_std = b.body.let(broadcast(node.outputs[1]), "mean"), b.body.let(broadcast(node.outputs[2]), "inv")
    else:  # a row of whole texels: once per work-item, over the texels of one row it computes (item_texels)
        mean, inv_std = _row_statistics(b, node, prologue=count % 4 == 0)

    def affine(v: ir.Value) -> Expr:
        """Scale or B at the current element: per channel, or broadcast over the normalised axes."""
        return b.element(v, out_axis(1)) if node.op_type == "InstanceNormalization" else broadcast(v)

    result = (b.element(x, own_index(shape)) - mean) * inv_std * affine(scale)
    return kernels + [b.finish([result + affine(bias) if bias is not None else result])]
