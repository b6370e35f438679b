"""Index maps: a view of a stored tensor as a strided window, composed through data-movement ops.

A view value `v` of shape S reads its root's row-major flat element
`offset + sum_k i_k * strides[k]` for its multi-index i. Transpose permutes strides,
a broadcast gives stride 0, a Slice moves the offset and multiplies strides by its steps, and a reshape of a strided view keeps strides when the axes it
merges are contiguous with each other (numpy's no-copy reshape rule). A reshape that merges axes
that are not (heads merged after a transpose, `[B, H, T, D] -> [B, T, H * D]`; a grouped-query
repeat) gives a *folded* axis: its index i is a mixed-radix number over sub-axes, each with its
own stride (`folds`), which a reader turns into root offsets with a division and a modulo per
sub-axis. `tile_remap` lets only readers that do so read a folded view. `tile_remap` writes the
map of every view it creates as `fblc.index_map` on the node; the codegen reads the root's
texture through it, so a remapped view has no kernel and no texture of its own.

Which nodes are views: Identity and Dropout always (they are no-ops), and any node that
carries an index map.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys, ops
from fblc.compiler.values import attr, const_array, numel, slice_bounds, static_shape

ALWAYS_VIEWS = ops.ALWAYS_VIEWS  # the op table's views (fblc/compiler/ops.py)


def row_major_strides(shape: tuple[int, ...] | list[int]) -> list[int]:
    strides, running = [], 1
    for dim in reversed(shape):
        strides.append(running)
        running *= dim
    return list(reversed(strides))


SubAxis = tuple[int, int]  # (extent, stride) of one mixed-radix digit of a folded axis


@dataclass(frozen=True)
class IndexMap:
    """Element i (multi-index) of a view of `shape` is root element `offset + sum(i_k * strides[k])`.

    `folds`, when not empty, has one entry per axis: the sub-axes (extent, stride) outside the axis's
    innermost one, outermost first. Axis k then reads `sum_j digit_j(i_k) * stride_j` over
    `sub_axes(k)`, whose innermost sub-axis is (shape[k] / product of the fold extents, strides[k])."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0
    folds: tuple[tuple[SubAxis, ...], ...] = ()

    @classmethod
    def identity(cls, shape: tuple[int, ...]) -> IndexMap:
        return cls(tuple(shape), tuple(row_major_strides(shape)))

    @property
    def folded(self) -> bool:
        return any(self.folds)

    def sub_axes(self, axis: int) -> list[SubAxis]:
        """Axis `axis` as (extent, stride) digits, outermost first (one digit unless it is folded)."""
        outer = list(self.folds[axis]) if self.folds else []
        inner = self.shape[axis] // int(np.prod([extent for extent, _ in outer], dtype=np.int64))
        return outer + [(inner, self.strides[axis])]

    def inner_extent(self, axis: int) -> int:
        """How many consecutive indices of `axis` step by its stride (the whole axis unless folded)."""
        return self.sub_axes(axis)[-1][0]

    @property
    def contiguous(self) -> bool:
        """True when the view reads its root in row-major order from the root's first element."""
        if self.folded:
            return False
        significant = [(d, s) for d, s in zip(self.shape, self.strides) if d != 1]
        expected = row_major_strides([d for d, _ in significant])
        return self.offset == 0 and [s for _, s in significant] == expected

    def to_json(self) -> str:
        data: dict = {"shape": list(self.shape), "strides": list(self.strides), "offset": self.offset}
        if self.folded:
            data["folds"] = [[list(sub) for sub in fold] for fold in self.folds]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> IndexMap:
        data = json.loads(text)
        folds = tuple(tuple((int(e), int(s)) for e, s in fold) for fold in data.get("folds", ()))
        return cls(tuple(data["shape"]), tuple(data["strides"]), int(data.get("offset", 0)), folds)

    @classmethod
    def from_sub_axes(cls, shape: tuple[int, ...], axes: list[list[SubAxis]], offset: int) -> IndexMap:
        """The map whose axis k has the digits `axes[k]` (outermost first; merged where contiguous)."""
        merged: list[list[SubAxis]] = []
        for digits in axes:
            kept: list[SubAxis] = []
            for extent, stride in (d for d in digits if d[0] != 1):
                if kept and kept[-1][1] == stride * extent:  # contiguous with the digit inside it
                    kept[-1] = (kept[-1][0] * extent, stride)
                else:
                    kept.append((extent, stride))
            merged.append(kept or [(1, 0)])
        strides = tuple(digits[-1][1] for digits in merged)
        folds = tuple(tuple(digits[:-1]) for digits in merged)
        return cls(tuple(shape), strides, offset, folds if any(folds) else ())

    # composition ---------------------------------------------------------------------------------
    def transposed(self, perm: list[int]) -> IndexMap:
        folds = tuple(self.folds[p] for p in perm) if self.folded else ()
        return IndexMap(tuple(self.shape[p] for p in perm), tuple(self.strides[p] for p in perm), self.offset, folds)

    def sliced(self, starts: list[int], steps: list[int], shape: tuple[int, ...]) -> IndexMap | None:
        """Every `steps[k]`-th element of axis k from `starts[k]` on (numpy's basic slicing), as `shape`;
        None when a folded axis would be cut (its digits would no longer be whole)."""
        if self.folded and any(self.folds[k] and (start, step, dim) != (0, 1, self.shape[k])
                               for k, (start, step, dim) in enumerate(zip(starts, steps, shape))):
            return None
        offset = self.offset + sum(start * stride for start, stride in zip(starts, self.strides))
        return IndexMap(tuple(shape), tuple(step * stride for step, stride in zip(steps, self.strides)), offset,
                        self.folds)

    def broadcast(self, shape: tuple[int, ...]) -> IndexMap:
        lead = len(shape) - len(self.shape)
        strides = [0] * lead + [0 if d == 1 and o != 1 else s
                                for d, o, s in zip(self.shape, shape[lead:], self.strides)]
        folds = ((),) * lead + self.folds if self.folded else ()
        return IndexMap(tuple(shape), tuple(strides), self.offset, folds)

    def reshaped(self, shape: tuple[int, ...]) -> IndexMap | None:
        """The same elements as `shape`: the digits of all axes, outermost first, regrouped into the new
        axes (a digit split where a new axis ends inside it). None when a new axis would end inside a
        digit at a point that does not divide it."""
        digits = [digit for k in range(len(self.shape)) for digit in self.sub_axes(k) if digit[0] != 1]
        axes: list[list[SubAxis]] = []
        for dim in shape:
            taken: list[SubAxis] = []
            size = 1
            while size < dim:
                if not digits:
                    return None
                extent, stride = digits.pop(0)
                if size * extent <= dim:
                    taken.append((extent, stride))
                    size *= extent
                    continue
                outer = dim // size  # the new axis ends inside this digit: split it
                if dim % size or extent % outer:
                    return None
                taken.append((outer, stride * (extent // outer)))
                digits.insert(0, (extent // outer, stride))
                size = dim
            if size != dim:
                return None
            axes.append(taken)
        return IndexMap.from_sub_axes(tuple(shape), axes, self.offset)

    def lanes_read_texels(self) -> bool:
        """Whether every 4 consecutive view elements from a multiple of 4 along the last axis are one
        texel of the root: the last axis steps by 1 in runs of a multiple of 4 from an aligned start,
        and every other digit moves by whole texels."""
        last = len(self.shape) - 1
        others = [digit for axis in range(last + 1) for digit in self.sub_axes(axis)[:-1 if axis == last else None]]
        return (self.offset % 4 == 0 and self.strides[-1] == 1 and self.inner_extent(last) % 4 == 0
                and all(stride % 4 == 0 for extent, stride in others if extent != 1))

    def packs_whole_texels(self, root_shape: tuple[int, ...]) -> bool:
        """Tile boundary preservation: each texel of the root (4 consecutive elements of its last axis)
        stays a run of consecutive elements along one axis of the view."""
        last = root_shape[-1] if root_shape else 1
        if numel(root_shape) <= 4 or last == 1:
            return True
        if last % 4:  # texels straddle root rows: the view must keep the whole last axis as one axis
            return any(s == 1 and d == last and not (self.folds and self.folds[k])
                       for k, (d, s) in enumerate(zip(self.shape, self.strides)))
        if any(s == 1 and self.inner_extent(k) % 4 == 0 for k, s in enumerate(self.strides)):
            return True
        # rows cut short at their end (a Slice [.., :W] of rows of whole texels: passes/align_widths): every row
        # of the view starts on a texel, so a texel's elements in the view are a run along its innermost axis
        return (not self.folded and self.strides[-1] == 1 and self.offset % 4 == 0
                and all(s % 4 == 0 and (s == 0 or s >= self.shape[-1])
                        for d, s in zip(self.shape[:-1], self.strides[:-1]) if d != 1))


def common_digits(axes: list[list[SubAxis]]) -> list[list[SubAxis]] | None:
    """The same axis of several operands (a contraction's K) cut into one set of digits: each operand's
    digits split where another's end, so one nest of loops walks them all (outermost first). None
    when the cuts do not nest (digit sizes 4 and 6 of 12: no mixed radix serves both)."""
    cuts = sorted({size for digits in axes for size in _inner_sizes(digits)})
    if any(high % low for low, high in zip(cuts, cuts[1:])):
        return None
    refined = []
    for digits in axes:
        ends = _inner_sizes(digits)  # digit j covers inner sizes (ends[j - 1], ends[j]]
        own, below, start = [], 1, 1
        for cut in cuts:
            j = next(j for j, end in enumerate(ends) if cut <= end)
            start = ends[j - 1] if j else 1
            own.append((cut // below, digits[len(digits) - 1 - j][1] * (below // start)))
            below = cut
        refined.append(list(reversed(own)))
    return refined


def _inner_sizes(digits: list[SubAxis]) -> list[int]:
    """Products of the innermost 1, 2, ... digits."""
    sizes, size = [], 1
    for extent, _ in reversed(digits):
        size *= extent
        sizes.append(size)
    return sizes


# which nodes are views ---------------------------------------------------------------------------

@lru_cache(maxsize=8192)
def _parsed_map(text: str) -> IndexMap:
    return IndexMap.from_json(text)


def index_map_of(node: ir.Node) -> IndexMap | None:
    """The map tile_remap wrote on `node` (INDEX_MAP), parsed once per distinct text (IndexMap is frozen)."""
    text = node.metadata_props.get(keys.INDEX_MAP)
    return _parsed_map(text) if text else None


def is_view(node: ir.Node | None) -> bool:
    if node is None or node.domain != "":
        return False
    return node.op_type in ALWAYS_VIEWS or keys.INDEX_MAP in node.metadata_props


def view_root(value: ir.Value) -> ir.Value:
    """The value whose storage `value` reads: itself, or the input of the views it comes from."""
    producer = value.producer()
    while is_view(producer) and producer.inputs[0] is not None:  # type: ignore[union-attr]
        value = producer.inputs[0]  # type: ignore[union-attr]
        producer = value.producer()
    return value


def real_producer(value: ir.Value | None) -> ir.Node | None:
    """The node that computes `value`'s data, looking through views (which share its storage)."""
    producer = value.producer() if value is not None else None
    while producer is not None and is_view(producer):
        producer = producer.inputs[0].producer() if producer.inputs[0] is not None else None
    return producer


def is_zeros(value: ir.Value) -> bool:
    """Whether `value` is a known all-zero tensor (the zero tables gradient rules scatter into), seen
    through views."""
    if value.is_graph_input():
        return False
    array = const_array(value)
    if array is None:
        producer = real_producer(value)
        if producer is None or producer.op_type != "ConstantOfShape":
            return False
        fill = attr(producer, "value")
        array = fill.numpy() if fill is not None else np.zeros(1)
    return bool(np.all(np.asarray(array) == 0))


def read_uses(value: ir.Value, through: Callable[[ir.Node], bool] = is_view) -> Iterator[tuple[ir.Value, ir.Usage]]:
    """Every use of `value`'s data by a node that is not passed `through`, with the value that node
    reads (`value` itself or one of its views), depth first in use order."""
    for use in value.uses():
        if through(use.node):
            for out in use.node.outputs:
                yield from read_uses(out, through)
        else:
            yield value, use


def real_readers(value: ir.Value, through: Callable[[ir.Node], bool] = is_view) -> list[ir.Node]:
    """The nodes that read `value`'s data, looking through views (or through what `through` accepts)."""
    return [use.node for _, use in read_uses(value, through)]


def views_of(value: ir.Value) -> list[ir.Value]:
    """Every view of `value`, transitively, depth first in use order."""
    found = []
    for use in value.uses():
        if is_view(use.node):
            for out in use.node.outputs:
                found.append(out)
                found.extend(views_of(out))
    return found


def map_of(value: ir.Value) -> IndexMap:
    """How `value` reads its root's storage (identity for a value that is its own root)."""
    producer = value.producer()
    if is_view(producer):
        stored = index_map_of(producer)  # type: ignore[arg-type]
        if stored is not None:
            return stored
        return map_of(producer.inputs[0])  # type: ignore[union-attr]
    return IndexMap.identity(static_shape(value))


# composing a data-movement node ------------------------------------------------------------------

def compose(node: ir.Node, source: IndexMap) -> IndexMap | None:
    """The map of `node`'s output given its input's map, or None when it is not a strided view."""
    out_shape = static_shape(node.outputs[0])
    op = node.op_type
    if op == "Transpose":
        perm = attr(node, "perm") or list(reversed(range(len(source.shape))))
        return source.transposed(list(perm))
    if op == "Expand":
        if tuple(np.broadcast_shapes(source.shape, out_shape)) != out_shape:
            return None
        return source.broadcast(out_shape)
    if op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
        return source.reshaped(out_shape)
    if op == "Slice":
        starts, _, steps = slice_bounds(node)
        if any(step < 1 for step in steps) or 0 in out_shape:  # reversed or empty: a copy
            return None
        return source.sliced(starts, steps, out_shape)
    return None


#: the movement ops `compose` maps (the op table's `remappable`)
REMAPPABLE = ops.ops_where(lambda entry: entry.remappable)
