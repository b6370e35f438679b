"""What a texel-wide reduction reads and walks, as conv.py, conv_transpose.py and contraction.py describe it to
texel.py's Reduction: operands at a runtime base plus literal offsets (Term, Operand), the products of a static
block (Product), a padded axis's mask (Mask), the runtime loops around the blocks (Loop) and the reduction axis in
blocks (Blocked).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import onnx_ir as ir

from fblc.codegen.ir import Block, Expr, For, Operand as IROperand, Var, const, flat_index


@dataclass(frozen=True)
class Term:
    """`expr * coeff` in a runtime index, `expr` being an int expression that is a multiple of `multiple`."""

    expr: Expr
    coeff: int
    multiple: int = 1


def index_sum(terms: Sequence[Term], offset: int = 0) -> Expr:
    return flat_index([(t.expr, t.coeff) for t in terms], offset)


@dataclass
class Operand:
    """A tensor read by the reduction at `runtime base + literal offset`."""

    value: ir.Value
    terms: list[Term]
    offset: int = 0  # a literal part of the base, added to every offset
    clamp: bool = False  # masked offsets may leave the tensor: keep texel reads inside it
    #: a tile's rows each at its own base (rows of A that no one stride steps through: a heads-split view's
    #: rows across the batch): offset // row_span is the row, whose term is added to `terms`
    rows: tuple[Term, ...] = ()
    row_span: int = 0

    def by_row(self, offsets: Iterable[int]) -> dict[int, tuple[Operand, list[int]]]:
        """Offsets split by the row whose base they are counted from: (the row's operand, offsets within it)."""
        split: dict[int, tuple[Operand, list[int]]] = {}
        for offset in offsets:
            row = offset // self.row_span
            if row not in split:
                split[row] = replace(self, terms=[*self.terms, self.rows[row]], rows=(), row_span=0), []
            split[row][1].append(offset - row * self.row_span)
        return split


class Product(NamedTuple):
    """acc[lane] += X[x] * W[w], zero where `position` (along the masked axis) or `row_position` (along
    the row mask's axis) is outside the input (a tuple: a block lists hundreds of them)."""

    lane: int
    x: int
    w: int
    position: int = 0
    row_position: int = 0


@dataclass
class Mask:
    """Runtime position along a padded axis: `terms` lie in [low, high]; valid positions are [0, extent)."""

    terms: list[Term]
    low: int
    high: int
    extent: int


@dataclass
class Loop:
    """A runtime loop around the blocks, `for var in [start, stop) by step` (no var: none), adding its terms
    to the X and W indices; its iterations `enter` a guard first (it returns the block the blocks go into).
    `trips`: the most iterations it runs; `walks`: a counted loop, which a work-group can share."""

    x_terms: list[Term]
    w_terms: list[Term]
    trips: int = 1
    var: Var | None = None
    start: Expr = const(0)
    stop: Expr | None = None
    step: int = 1
    enter: Callable[[Block], Block] | None = None
    walks: bool = False

    @staticmethod
    def over(var: Var, start: IROperand, stop: IROperand, x_step: int, w_step: int, trips: int) -> Loop:
        """`for var in [start, stop)`, at most `trips` iterations (stop may be a runtime bound)."""
        start, stop = (const(bound) if isinstance(bound, int) else bound for bound in (start, stop))
        return Loop([Term(var, x_step)] if x_step else [], [Term(var, w_step)] if w_step else [], trips, var,
                    start, stop, walks=True)

    def open(self, block: Block, group: int | None = None, lid: Var | None = None) -> Block:
        """Build the loop into `block`; the block its body goes into. With `group`, its iterations are dealt
        round-robin to the `group` work-items of the group (`lid`)."""
        if self.var is not None:
            start, step = self.start, self.step
            if group is not None:
                assert self.walks and lid is not None, "only a counted loop is shared"
                start, step = (lid if start == const(0) else start + lid), group
            body = Block(block.numbering)
            block.add(For(self.var, start, self.stop, body.statements, step))
            block = body
        return self.enter(block) if self.enter is not None else block


@dataclass
class Blocked:
    """The reduction axis walked in static blocks of `block` (a loop over whole blocks, then the rest):
    `products(indices)` lists the products of those axis indices, offsets counted from the bases with
    the axis at 0; in the loop the block start moves X, W and the mask position by the steps."""

    extent: int
    block: int
    x_step: int
    w_step: int
    position_step: int
    products: Callable[[range], Sequence[Product]]
