"""Index maps: a view of a stored tensor as a strided window, composed through data-movement ops.

A view value `v` of shape S reads its root's row-major flat element
`offset + sum_k i_k * strides[k]` for its multi-index i. Transpose permutes strides,
a broadcast gives stride 0, a Slice moves the offset and multiplies strides by its steps, and a reshape of a strided view keeps strides when the axes it
merges are contiguous with each other (numpy's no-copy reshape rule). `tile_remap` writes the
map of every view it creates as `fblc.index_map` on the node; the codegen reads the root's
texture through it, so a remapped view has no kernel and no texture of its own.

Which nodes are views: Identity and Dropout always (they are no-ops), and any node that
carries an index map.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.values import attr, const_array, numel, slice_bounds, static_shape

ALWAYS_VIEWS = frozenset({"Identity", "Dropout"})


def row_major_strides(shape: tuple[int, ...] | list[int]) -> list[int]:
    strides, running = [], 1
    for dim in reversed(shape):
        strides.append(running)
        running *= dim
    return list(reversed(strides))


@dataclass(frozen=True)
class IndexMap:
    """Element i (multi-index) of a view of `shape` is root element `offset + sum(i_k * strides[k])`."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @classmethod
    def identity(cls, shape: tuple[int, ...]) -> IndexMap:
        return cls(tuple(shape), tuple(row_major_strides(shape)))

    @property
    def contiguous(self) -> bool:
        """True when the view reads its root in row-major order from the root's first element."""
        significant = [(d, s) for d, s in zip(self.shape, self.strides) if d != 1]
        expected = row_major_strides([d for d, _ in significant])
        return self.offset == 0 and [s for _, s in significant] == expected

    def to_json(self) -> str:
        return json.dumps({"shape": list(self.shape), "strides": list(self.strides), "offset": self.offset})

    @classmethod
    def from_json(cls, text: str) -> IndexMap:
        data = json.loads(text)
        return cls(tuple(data["shape"]), tuple(data["strides"]), int(data.get("offset", 0)))

    # composition ---------------------------------------------------------------------------------
    def transposed(self, perm: list[int]) -> IndexMap:
        return IndexMap(tuple(self.shape[p] for p in perm), tuple(self.strides[p] for p in perm), self.offset)

    def sliced(self, starts: list[int], steps: list[int], shape: tuple[int, ...]) -> IndexMap:
        """Every `steps[k]`-th element of axis k from `starts[k]` on (numpy's basic slicing), as `shape`."""
        offset = self.offset + sum(start * stride for start, stride in zip(starts, self.strides))
        return IndexMap(tuple(shape), tuple(step * stride for step, stride in zip(steps, self.strides)), offset)

    def broadcast(self, shape: tuple[int, ...]) -> IndexMap:
        lead = len(shape) - len(self.shape)
        strides = [0] * lead + [0 if d == 1 and o != 1 else s
                                for d, o, s in zip(self.shape, shape[lead:], self.strides)]
        return IndexMap(tuple(shape), tuple(strides), self.offset)

    def reshaped(self, shape: tuple[int, ...]) -> IndexMap | None:
        """The same elements as `shape`, or None when an output axis would need a div/mod of the root index."""
        old = [(d, s) for d, s in zip(self.shape, self.strides) if d != 1]
        new_strides = [0] * len(shape)
        new_axes = [k for k, d in enumerate(shape) if d != 1]
        i = j = 0
        while i < len(old) and j < len(new_axes):
            # grow one chunk of old axes and new axes with equal products
            oi, oj = i + 1, j + 1
            old_size, new_size = old[i][0], shape[new_axes[j]]
            while old_size != new_size:
                if old_size < new_size:
                    old_size *= old[oi][0]
                    oi += 1
                else:
                    new_size *= shape[new_axes[oj]]
                    oj += 1
            for k in range(i, oi - 1):  # the old axes of a chunk must be contiguous with each other
                if old[k][1] != old[k + 1][1] * old[k + 1][0]:
                    return None
            stride = old[oi - 1][1]
            for k in reversed(range(j, oj)):
                new_strides[new_axes[k]] = stride
                stride *= shape[new_axes[k]]
            i, j = oi, oj
        return IndexMap(tuple(shape), tuple(new_strides), self.offset)

    def packs_whole_texels(self, root_shape: tuple[int, ...]) -> bool:
        """Tile boundary preservation: each texel of the root (4 consecutive elements of its last axis)
        stays a run of consecutive elements along one axis of the view."""
        last = root_shape[-1] if root_shape else 1
        if numel(root_shape) <= 4 or last == 1:
            return True
        if last % 4:  # texels straddle root rows: the view must keep the whole last axis as one axis
            return any(s == 1 and d == last for d, s in zip(self.shape, self.strides))
        return any(s == 1 and d % 4 == 0 for d, s in zip(self.shape, self.strides))


# which nodes are views ---------------------------------------------------------------------------

def index_map_of(node: ir.Node) -> IndexMap | None:
    text = node.metadata_props.get(keys.INDEX_MAP)
    return IndexMap.from_json(text) if text else None


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


REMAPPABLE = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Slice"})
