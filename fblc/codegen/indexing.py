"""Index arithmetic in the kernel IR: multi-indices from flat ones, flat indices into (strided) views.

Every division and remainder is by a compile-time constant (ir.div_index / ir.mod_index: shifts and
reciprocal multiplies). Multi-index variables have fixed names, `prefix` and axis (`o0, o1..`: the output's).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fblc.codegen import ir as kir
from fblc.codegen.ir import INT, Block, Expr, Var, const, div_index, flat_index, mod_index
from fblc.compiler.index_map import IndexMap


def index_var(prefix: str, axis: int) -> Var:
    """Axis `axis` of the multi-index named `prefix` (declared by declare_index)."""
    return Var(prefix, 0, INT, f"{prefix}{axis}")


def lane_axis(shape: Sequence[int]) -> int | None:
    """The axis a texel's 4 lanes walk: the innermost non-unit one, when its length is a multiple of 4."""
    for axis in reversed(range(len(shape))):
        if shape[axis] != 1:
            return axis if shape[axis] % 4 == 0 else None
    return None


def unflatten(shape: Sequence[int], flat: Expr) -> list[Expr]:
    """The multi-index of flat index `flat` (non-negative) in `shape`: its mixed-radix digits."""
    return [index for index, _ in digit_terms(flat, [(dim, 1) for dim in shape])]


def declare_index(block: Block, shape: Sequence[int], flat: Expr, prefix: str) -> list[Var]:
    """Declare `prefix0..` as the multi-index of flat index `flat` (non-negative) in `shape`."""
    names = [index_var(prefix, axis) for axis in range(len(shape))]
    block.add(*(kir.Declare(name, index) for name, index in zip(names, unflatten(shape, flat))))
    return names


def declare_row_index(block: Block, shape: Sequence[int], row: Expr, column: Expr, prefix: str) -> list[Var]:
    """`prefix0..` for the element at element column `column` of flat row `row` of `shape` seen as
    rows of its lane axis (the axes after it have length 1)."""
    axis = lane_axis(shape)
    assert axis is not None
    names = declare_index(block, shape[:axis], row, prefix) + [index_var(prefix, k) for k in range(axis, len(shape))]
    block.add(*(kir.Declare(name, column if k == axis else const(0)) for k, name in enumerate(names) if k >= axis))
    return names


def digit_terms(index: Expr, digits: Sequence[tuple[int, int]]) -> list[tuple[Expr, int]]:
    """(index, stride) per digit of the axis index `index` (non-negative) whose mixed-radix digits
    are `digits` (extent, stride), outermost first (IndexMap.sub_axes)."""
    terms, inner = [], int(np.prod([extent for extent, _ in digits], dtype=np.int64))
    for j, (extent, stride) in enumerate(digits):
        inner //= extent
        digit = div_index(index, inner)
        terms.append((mod_index(digit, extent) if j else digit, stride))
    return terms


def view_index(index_map: IndexMap, indices: Sequence[Expr]) -> Expr:
    """Flat index into the root of `index_map` of the view element whose axis indices are `indices`."""
    terms = [term for axis, (dim, index) in enumerate(zip(index_map.shape, indices)) if dim != 1
             for term in digit_terms(index, index_map.sub_axes(axis))]
    return flat_index(terms, index_map.offset)


def broadcast_view_index(index_map: IndexMap, out_shape: Sequence[int], prefix: str) -> Expr:
    """Flat index into the root of `index_map`, the view numpy-broadcast to `out_shape`, from the
    multi-index `prefix0..` of the output."""
    lead = len(out_shape) - len(index_map.shape)
    return view_index(index_map, [index_var(prefix, lead + k) for k in range(len(index_map.shape))])


def flat_view_index(index_map: IndexMap, flat: Expr) -> Expr:
    """Flat index into the root of a strided view of the view's element `flat` (in its own shape)."""
    return view_index(index_map, unflatten(index_map.shape, flat))
