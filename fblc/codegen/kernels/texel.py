"""Texel-wide reductions: a work-item's lanes reduce together and share their reads.

On PoCL (and on mobile GPUs) a `read_imagef` is the cost of a contraction: ~10-15 ns on the
CPU device, where the multiply-add is nearly free. Per-lane code reads two elements per
multiply-add. Here a work-item computes all its lanes (the 4 elements of its texel, or of
several consecutive texels, see KernelBuilder.texels_per_item) in one pass over the
reduction, in static blocks: for each block it lists the products it needs, as
(lane, offset into X, offset into W, position) with literal offsets from a runtime base
index, fetches every distinct element once (whole texels where the offsets are close: one
read gives four consecutive elements) and accumulates per lane in fp32.

Where the base index is known to be a multiple of 4 (the strides and the loop steps are)
the texels and lanes of every offset are literals; otherwise a cluster of offsets is read
as the texels that can cover it and the elements are picked by the runtime shift.

Products whose position (along a padded axis) falls outside the input read zero through a
mask, so border texels need no per-lane tap ranges; products always outside are dropped at
compile time, and reads the masked ones make out of the tensor are clamped into it: only
those, since a texel that an unmasked product reads lies in the tensor wherever the kernel runs
(unclamped neighbours are also what a CPU's compiler merges into wider loads).

A reduction too long for one work-item (Reduction.serial past SERIAL_REDUCTION) is dealt out to
a work-group: its longest counted loop (Reduction.shared_loop) takes every group-th iteration
from the work-item's `lid`, and the caller merges the partial tiles.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import flat_index
from fblc.codegen.ir import Statement
from fblc.codegen.kernels.accumulators import COMPONENTS, LANES, Accumulators, block_cost, choose_form, pair_stride
from fblc.codegen.schedule import resolve_form, resolve_pair
from fblc.profiles.profile import PRIVATE_FLOATS, SERIAL_REDUCTION

__all__ = ["COMPONENTS", "LANES"]  # the texel's shape, which the kernel modules take from here


@dataclass(frozen=True)
class Term:
    """`expr * coeff` in a runtime index, `expr` being a C int expression that is a multiple of `multiple`."""

    expr: str
    coeff: int
    multiple: int = 1


def c_sum(terms: Sequence[Term]) -> str:
    return flat_index([(t.expr, t.coeff) for t in terms])


def aligned(terms: Sequence[Term]) -> bool:
    """True when the index is a multiple of 4 whatever the runtime values."""
    return all((t.coeff * t.multiple) % 4 == 0 for t in terms)


@dataclass
class Operand:
    """A tensor read by the reduction at `runtime base + literal offset`."""

    value: ir.Value
    terms: list[Term]
    offset: int = 0  # a literal part of the base, added to every offset
    clamp: bool = False  # masked offsets may leave the tensor: keep texel reads inside it

    def moved(self, terms: list[Term]) -> Operand:
        return Operand(self.value, terms, self.offset, self.clamp)


class Product(NamedTuple):
    """acc[lane] += X[x] * W[w], zero where `position` (along the masked axis) or `row_position` (along
    the row mask's axis) is outside the input.
    (A tuple: a tile's block lists hundreds of them, for every contraction of the step.)"""

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
    """Lines around the blocks (a runtime loop, a guard: each line ending in '{' opens a C block)
    and the terms they add to the X and W indices. `trips`: the most iterations it runs; `walk`:
    (var, start, stop) of a plain counted loop, which a work-group can share (Reduction.emit)."""

    lines: list[str]
    x_terms: list[Term]
    w_terms: list[Term]
    trips: int = 1
    walk: tuple[str, str, str] | None = None

    @staticmethod
    def over(var: str, start: str, stop: str, x_step: int, w_step: int, trips: int) -> Loop:
        """`for var in [start, stop)`, at most `trips` iterations (stop may be a runtime bound)."""
        return Loop([f"for (int {var} = {start}; {var} < {stop}; ++{var}) {{"],
                    [Term(var, x_step)] if x_step else [], [Term(var, w_step)] if w_step else [],
                    trips, (var, start, stop))

    def shared(self, group: int) -> list[str]:
        """The loop's lines with its iterations dealt round-robin to the `group` work-items (`lid`)."""
        assert self.walk is not None, "only a counted loop is shared"
        var, start, stop = self.walk
        first = "lid" if start == "0" else f"{start} + lid"
        return [f"for (int {var} = {first}; {var} < {stop}; {var} += {group}) {{"]


@dataclass
class Blocked:
    """The reduction axis walked in static blocks of `block` (a loop over whole blocks, then the rest).

    `products(indices)` lists the products of those axis indices, offsets counted from the
    bases with the axis at 0; inside the loop the block start moves X, W and the mask position
    by the steps.
    """

    extent: int
    block: int
    x_step: int
    w_step: int
    position_step: int
    products: Callable[[range], Sequence[Product]]


class Code:
    """Lines appended to a kernel body (per-texel prologue or lane loop) with C block nesting."""

    def __init__(self, lines: list[str], depth: int = 0) -> None:
        self.lines = lines
        self.depth = depth

    def emit(self, *lines: str | Statement) -> None:
        self.lines.extend("  " * self.depth + line if isinstance(line, str) else line for line in lines)

    def open(self, header: str) -> None:
        self.emit(header + " {")
        self.depth += 1

    def close(self) -> None:
        self.depth -= 1
        self.emit("}")


def _window(arg: str, a: str, b: str, index: str, shift: str) -> str:
    """Elements shift..shift+3 of the 8 in texels a, b (texels `index` and `index` + 1 of `arg`; shift in
    0..3, known only at runtime): a shuffle of the two in images, one unaligned load in buffers."""
    return f"WINDOW({arg}, {a}, {b}, {index}, {shift})"


def _clusters(offsets: list[int]) -> list[list[int]]:
    """Sorted offsets split where a gap would leave a whole texel unread."""
    groups: list[list[int]] = []
    for offset in offsets:
        if groups and offset - groups[-1][-1] <= 4:
            groups[-1].append(offset)
        else:
            groups.append([offset])
    return groups


def fetch(b: KernelBuilder, code: Code, operand: Operand, offsets: Iterable[int],
          inside: Iterable[int] = ()) -> dict[int, str]:
    """Read each offset of `operand` once; C expressions of the values by offset. Offsets in `inside`
    (read by unmasked products) lie in the tensor wherever the kernel runs: a texel that holds one is
    read unclamped even where the operand's masked reads are clamped."""
    wanted = sorted({offset + operand.offset for offset in offsets})
    inside_offsets = {offset + operand.offset for offset in inside}
    inside_texels = {offset >> 2 for offset in inside_offsets}
    inlined = b.constant_scalar(operand.value)
    if inlined is not None:
        return {offset - operand.offset: inlined for offset in wanted}
    arg, texture = b.argument(operand.value)
    last = texture.texels - 1

    def texel(index: str, spare: bool = False, within: bool = False) -> str:
        """A texel read; `spare`: the read may pass the tensor's end (a cluster's last texel at shift 0);
        `within`: it never leaves the tensor."""
        if within:
            return b.read_texel(arg, texture, index)
        if operand.clamp:
            index = f"clamp({index}, 0, {last})"
        elif spare:
            index = f"min({index}, {last})"
        return b.read_texel(arg, texture, index)

    base = c_sum(operand.terms)
    values: dict[int, str] = {}
    if aligned(operand.terms):  # texel and lane of every offset are literals
        q = b.fresh("q")
        code.emit(f"const int {q} = ({base}) >> 2;")
        names: dict[int, str] = {}
        for offset in wanted:
            k = offset >> 2  # floor, also for negative offsets
            if k not in names:
                names[k] = b.fresh("T")
                code.emit(f"const float4 {names[k]} = {texel(_plus(q, k), within=k in inside_texels)};")
            values[offset] = f"{names[k]}.{COMPONENTS[offset & 3]}"
        return {offset - operand.offset: value for offset, value in values.items()}
    for cluster in _clusters(wanted):
        low, span = cluster[0], cluster[-1] - cluster[0] + 1
        count = ((span + 2) >> 2) + 1  # texels that cover `span` elements at any shift
        if count >= len(cluster):  # sparse: element reads are no more
            for offset in cluster:
                index = _plus(base, offset) if base != "0" else str(offset)
                if operand.clamp:
                    index = f"clamp({index}, 0, {texture.numel - 1})"
                values[offset] = b.fresh("E")  # named: several lanes share it
                code.emit(f"const float {values[offset]} = {b.load(operand.value, index)};")
            continue
        start, q, shift = b.fresh("e"), b.fresh("q"), b.fresh("s")
        code.emit(f"const int {start} = {_plus(base, low)};",
                  f"const int {q} = {start} >> 2, {shift} = {start} & 3;")
        texels = [b.fresh("T") for _ in range(count)]
        # at any shift, texel k holds element low + 4k: where that one lies inside, so does the texel
        within = [low + 4 * k in inside_offsets for k in range(count)]
        code.emit(*(f"const float4 {name} = {texel(_plus(q, k), k == count - 1, within[k])};"
                    for k, name in enumerate(texels)))
        windows: dict[int, str] = {}
        for offset in cluster:
            m, lane = (offset - low) >> 2, (offset - low) & 3
            if m + 1 < count:
                if m not in windows:
                    windows[m] = b.fresh("W")
                    # texels read clamped may not be neighbours in memory: shuffle those
                    window = (f"window4({texels[m]}, {texels[m + 1]}, {shift})"
                              if operand.clamp and not (within[m] and within[m + 1])
                              else _window(arg, texels[m], texels[m + 1], _plus(q, m), shift))
                    code.emit(f"const float4 {windows[m]} = {window};")
                values[offset] = f"{windows[m]}.{COMPONENTS[lane]}"
            else:  # the last texel alone holds it: shift + lane < 4
                values[offset] = f"lane_f({texels[m]}, {shift} + {lane})"
    return {offset - operand.offset: value for offset, value in values.items()}


def _plus(expression: str, offset: int) -> str:
    if offset == 0:
        return expression
    return f"{expression} {'+' if offset > 0 else '-'} {abs(offset)}"


def _shifted(terms: list[Term], var: str, step: int, multiple: int) -> list[Term]:
    return terms + [Term(var, step, multiple)] if step else terms


@dataclass
class Reduction:
    """`acc[lane] = sum of X * W` over outer loops and a blocked axis; see the module docstring."""

    x: Operand
    w: Operand
    blocked: Blocked
    loops: list[Loop] = field(default_factory=list)  # outermost first
    mask: Mask | None = None
    row_mask: Mask | None = None  # a second padded axis, enumerated in the products (a 2-D spatial tile)

    def serial(self, lanes: int) -> int:
        """Multiply-adds per accumulator, which one work-item runs in turn (runtime tap ranges counted whole)."""
        per_step = max(1, len(self.blocked.products(range(1))) // lanes)
        return math.prod(loop.trips for loop in self.loops) * self.blocked.extent * per_step

    @property
    def _looped(self) -> int:
        """The blocked axis's elements that its loop walks in whole blocks (0: one static block, no loop)."""
        axis = self.blocked
        main = axis.extent - axis.extent % axis.block
        return main if main > axis.block else 0

    def shared_loop(self) -> tuple[int | None, int]:
        """(index into loops, or None for the blocked axis's loop; its trips): the loop with the most
        iterations that a work-group can deal out (Reduction.emit's `group`)."""
        candidates = [(loop.trips, index) for index, loop in enumerate(self.loops) if loop.walk is not None]
        trips, index = max(candidates, default=(0, None))
        blocks = self._looped // self.blocked.block
        return (None, blocks) if blocks >= trips else (index, trips)

    def emit(self, b: KernelBuilder, code: Code, acc: str, lanes: int, guard: str | None = None,
             group: int | None = None) -> None:
        """Declare `float acc[lanes]` and accumulate into it (only where `guard` holds, if given).
        With `group`, the work-items of a work-group (`lid`) share `shared_loop()`, each its
        every group-th iteration, and hold partial sums."""
        if lanes > PRIVATE_FLOATS:
            raise AssertionError(f"{b.name}: {lanes} accumulators per work-item, more than the {PRIVATE_FLOATS} "
                                 "floats a work-item keeps in registers (fblc.profiles.profile.PRIVATE_FLOATS)")
        profile, schedule = b.table.profile, b.schedule
        if lanes % LANES == 0:  # the work-item's reduction (not a row path's per-lane fallback): the schedule's
            form = resolve_form(schedule, profile, self._sample, lanes, self.serial(lanes))
            pair = resolve_pair(schedule, profile, self._sample, form, lanes, b.name)
            schedule.accumulator_form, schedule.pair_stride = form, pair
        else:
            form = self.accumulator_form(b, lanes)
            pair = pair_stride(self._sample, form, lanes, profile.simd_floats)
        target = Accumulators(b.fresh("accv") if form != "lanes" else acc, form, pair)
        code.emit(target.declare(lanes))
        depth = code.depth
        code.open(f"if ({guard})" if guard else "")  # the loops' and blocks' names stay local
        shared = self.shared_loop()[0] if group else -1  # -1: no loop is dealt out
        blocks_dealt = group is not None and shared is None
        x_terms, w_terms = list(self.x.terms), list(self.w.terms)
        for index, loop in enumerate(self.loops):
            for line in loop.shared(group) + loop.lines[1:] if group and index == shared else loop.lines:
                if line.endswith("{"):
                    code.open(line[:-1].rstrip())
                else:
                    code.emit(line)
            x_terms += loop.x_terms
            w_terms += loop.w_terms
        axis, main = self.blocked, self._looped
        if main:
            var = b.fresh("blk")
            if blocks_dealt:
                code.open(f"for (int {var} = lid * {axis.block}; {var} < {main}; {var} += {group * axis.block})")
            else:
                code.open(f"for (int {var} = 0; {var} < {main}; {var} += {axis.block})")
            mask = None
            if self.mask is not None:
                mask = Mask(_shifted(self.mask.terms, var, axis.position_step, axis.block), self.mask.low,
                            self.mask.high + (main - axis.block) * axis.position_step, self.mask.extent)
            self._block(b, code, target, axis.products(range(axis.block)),
                        self.x.moved(_shifted(x_terms, var, axis.x_step, axis.block)),
                        self.w.moved(_shifted(w_terms, var, axis.w_step, axis.block)), mask, self.row_mask)
            code.close()
        if main < axis.extent:
            rest = axis.products(range(main, axis.extent))
            # a block scope of its own (names do not clash with the loop's); one work-item's share when dealt out
            code.open(f"if (lid == {group - 1})" if blocks_dealt else "")
            self._block(b, code, target, rest, self.x.moved(x_terms), self.w.moved(w_terms), self.mask, self.row_mask)
            code.close()
        while code.depth > depth:
            code.close()
        totals = target.totals(acc, lanes)
        if totals:
            code.emit(totals)

    def accumulator_form(self, b: KernelBuilder, lanes: int) -> str:
        """The form of the `lanes` accumulators (accumulators.choose_form), judged on one block's products."""
        profile = b.table.profile
        return choose_form(self._sample, lanes, self.serial(lanes) > SERIAL_REDUCTION, profile.cpu, profile.simd_floats)

    def cost(self, form: str) -> float:
        """Instructions per product of one block in accumulator `form` (accumulators.block_cost)."""
        return block_cost(self._sample, form)

    @functools.cached_property
    def _sample(self) -> list[tuple[int, int, int]]:
        """(lane, x, w) of one block's products (the form and the cost each judge them; listed once)."""
        return [(p.lane, p.x, p.w) for p in self.blocked.products(range(min(self.blocked.block, self.blocked.extent)))]

    @staticmethod
    def _block(b: KernelBuilder, code: Code, acc: Accumulators, products: Sequence[Product], x: Operand, w: Operand,
               mask: Mask | None, row_mask: Mask | None = None) -> None:
        """One static block: drop products that are always out of range, mask the ones that may be."""
        if mask is None and row_mask is None:  # every product counts (contractions): the common case, kept lean
            xs, ws = fetch(b, code, x, (p.x for p in products)), fetch(b, code, w, (p.w for p in products))
            code.emit(*acc.add([(p.lane, xs[p.x], ws[p.w]) for p in products], [(p.x, p.w) for p in products]))
            return
        axes = [(axis, m) for axis, m in enumerate((mask, row_mask)) if m is not None]
        positions = {axis: b.fresh("P") for axis, _ in axes[:1]}  # the row mask's is named where needed
        conditions: dict[tuple[int, int], str] = {}  # (axis, offset) -> C condition
        kept: list[tuple[Product, tuple[tuple[int, int], ...]]] = []
        for product in products:
            keys: list[tuple[int, int]] = []
            for axis, m in axes:
                offset = (product.position, product.row_position)[axis]
                low, high = m.low + offset, m.high + offset
                if high < 0 or low >= m.extent:
                    break
                if low < 0 or high >= m.extent:
                    if (axis, offset) not in conditions:
                        if axis not in positions:
                            positions[axis] = b.fresh("P")
                        conditions[axis, offset] = _condition(_plus(positions[axis], offset), low < 0,
                                                              high >= m.extent, m.extent)
                    keys.append((axis, offset))
            else:
                kept.append((product, tuple(keys)))
        if not kept:
            return
        for axis, position in positions.items():
            if any(key[0] == axis for key in conditions):
                code.emit(f"const int {position} = {c_sum((mask, row_mask)[axis].terms)};")  # type: ignore[union-attr]
        named: dict[tuple[tuple[int, int], ...], str] = {}
        for key, condition in conditions.items():
            named[(key,)] = b.fresh("m")
            code.emit(f"const bool {named[(key,)]} = {condition};")
        for _, keys in kept:
            if len(keys) > 1 and keys not in named:
                named[keys] = b.fresh("m")
                code.emit(f"const bool {named[keys]} = {' && '.join(named[(key,)] for key in keys)};")
        xs = fetch(b, code, x, (p.x for p, _ in kept), inside=(p.x for p, keys in kept if not keys))
        ws = fetch(b, code, w, (p.w for p, _ in kept))
        code.emit(*acc.add([(product.lane, f"({named[keys]} ? {xs[product.x]} : 0.0f)" if keys else xs[product.x],
                             ws[product.w]) for product, keys in kept], [(p.x, p.w) for p, _ in kept]))


def _condition(position: str, low: bool, high: bool, extent: int) -> str:
    if low and high:
        return f"(uint)({position}) < {extent}u"
    return f"{position} >= 0" if low else f"{position} < {extent}"
