"""Texel-wide reductions: a work-item's lanes reduce together and share their reads.

On PoCL (and on mobile GPUs) a `read_imagef` is the cost of a contraction: ~10-15 ns on the
CPU device, where the multiply-add is nearly free; per-lane code reads two elements per
multiply-add. Here a work-item computes all its lanes (KernelBuilder.texels_per_item texels)
in one pass over the reduction, in static blocks: each block lists its products with literal
offsets from a runtime base index, fetches every distinct element once (whole texels where the
offsets are close) and accumulates per lane in fp32.

Where the base index is a known multiple of 4 the texel and lane of every offset are literals;
otherwise a cluster of offsets is read as the texels that can cover it, picked by the runtime shift.

Products whose position along a padded axis falls outside the input read zero through a mask, so
border texels need no per-lane tap ranges; products always outside are dropped at compile time.
Only the reads of masked products that may leave the tensor are clamped (a texel an unmasked
product reads lies inside; unclamped neighbours are what a CPU's compiler merges into wider loads).
A reduction too long for one work-item (past SERIAL_REDUCTION) is dealt out to a work-group (Reduction.emit).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.ir import (
    FLOAT, FLOAT4, UINT, ArgumentRef, Block, Expr, If, StagedChoice, Var, call, const, select)
from fblc.codegen.kernels.accumulators import LANES, Accumulators, block_cost, float4_count
from fblc.codegen.kernels.reduction_terms import Blocked, Loop, Mask, Operand, Product, Term, index_sum
from fblc.codegen.kernels.staging import Staging, plan_staging
from fblc.codegen.schedule import Schedule, offered_pairings, resolve_form, resolve_pair
from fblc.profiles.profile import private_limit

__all__ = ["LANES"]  # the texel's width, which the kernel modules take from here


def fetch(b: KernelBuilder, block: Block, operand: Operand, offsets: Iterable[int],
          inside: Iterable[int] = (), staged: Callable[[Expr, int | None], Expr] | None = None) -> dict[int, Expr]:
    """Read each offset of `operand` once; its values by offset. Offsets in `inside` (read by unmasked
    products) lie in the tensor wherever the kernel runs: a texel that holds one is read unclamped even
    where the operand's masked reads are clamped. `staged`: where a work-group's __local copy holds each texel
    (staging.py; of the texel's index and, where the base is aligned, its offset k from the base texel)."""
    if operand.rows:  # each row from its own base (Operand.rows)
        inside = set(inside)
        span, values = operand.row_span, {}
        for row, (one, row_offsets) in operand.by_row(offsets).items():
            got = fetch(b, block, one, row_offsets, [o - row * span for o in inside if o // span == row])
            values.update({offset + row * span: value for offset, value in got.items()})
        return values
    wanted = sorted({offset + operand.offset for offset in offsets})
    inside_offsets = {offset + operand.offset for offset in inside}
    inside_texels = {offset >> 2 for offset in inside_offsets}
    inlined = b.constant_value(operand.value)
    if inlined is not None:
        return {offset - operand.offset: inlined for offset in wanted}
    argument, texture = b.input_argument(operand.value)
    last = texture.texels - 1

    def texel(index: Expr, spare: bool = False, within: bool = False, k: int | None = None) -> Var:
        # spare: the read may pass the tensor's end (a cluster's last texel at shift 0); within: it never leaves it
        unclamped = index
        if not within and (operand.clamp or spare):
            index = call("clamp", index, 0, last) if operand.clamp else call("min", index, last)
        load = b.texel(argument, texture, index)
        if staged is not None:  # the copy holds texel clamp(t) for the texel t read here
            load = replace(load, staged=staged(unclamped, k))  # type: ignore[type-var]
        return block.let(load, "T")

    base = index_sum(operand.terms)
    # the base is a multiple of `aligned` (1, 2 or 4) whatever the runtime values
    aligned = functools.reduce(math.gcd, [t.coeff * t.multiple for t in operand.terms], LANES)
    # a base that is a multiple of 4: the texel and lane of every offset are literals
    if aligned == LANES:  # (>> 2 floors negative offsets too)
        q = block.let(base >> 2, "q")
        texels = {k: texel(plus(q, k), within=k in inside_texels, k=k) for k in sorted({offset >> 2 for offset in wanted})}
        return {offset - operand.offset: texels[offset >> 2].lane(offset & 3) for offset in wanted}
    values: dict[int, Expr] = {}
    for cluster in _clusters(wanted):
        low, count = cluster[0], _covering(cluster, aligned)
        if count >= len(cluster):  # sparse: element reads are no more
            for offset in cluster:
                index = plus(base, offset)
                index = call("clamp", index, 0, texture.numel - 1) if operand.clamp else index
                values[offset] = block.let(b.element(operand.value, index), "E")  # named: several lanes share it
            continue
        start = block.let(plus(base, low), "e")
        q, shift = block.let(start >> 2, "q"), block.let(start & 3, "s")
        # at any shift, texel k holds element low + 4k: where that one lies inside, so does the texel
        within = [low + 4 * k in inside_offsets for k in range(count)]
        texels_read = [texel(plus(q, k), k == count - 1, within[k]) for k in range(count)]
        windows: dict[int, Var] = {}
        for offset in cluster:
            m, lane = (offset - low) >> 2, (offset - low) & 3
            if m + 1 < count:
                if m not in windows:
                    # texels read clamped may not be neighbours in memory: shuffle those; else WINDOW: a
                    # shuffle of the two in images, one unaligned load in buffers
                    pair = texels_read[m], texels_read[m + 1]
                    window = (call("window4", *pair, shift, dtype=FLOAT4)
                              if (operand.clamp and not (within[m] and within[m + 1])) or texture.dequantized
                              is not None  # dequantized in registers: no texture to load a window from
                              else call("WINDOW", ArgumentRef(argument), *pair, plus(q, m), plus(start, 4 * m), shift,
                                         dtype=FLOAT4))
                    windows[m] = block.let(window, "W")
                values[offset] = windows[m].lane(lane)
            else:  # the last texel alone holds it: shift + lane < 4
                values[offset] = texels_read[m].lane(plus(shift, lane))
    return {offset - operand.offset: value for offset, value in values.items()}


def _clusters(wanted: Sequence[int]) -> list[list[int]]:
    """Sorted offsets split where a gap would leave a whole texel unread."""
    clusters: list[list[int]] = []
    for offset in wanted:
        if clusters and offset - clusters[-1][-1] <= 4:
            clusters[-1].append(offset)
        else:
            clusters.append([offset])
    return clusters


def _covering(cluster: Sequence[int], aligned: int) -> int:
    """Texels that cover a cluster's span at any shift of its first offset from a base that is a multiple of
    `aligned`: the base's multiples leave it shifts low, low + aligned, .. (mod 4) only (2-row tiles of
    consecutive channels: a pair of lanes of one texel, one read, not two)."""
    low, span = cluster[0], cluster[-1] - cluster[0] + 1
    most = max(shift for shift in range(LANES) if (shift - low) % aligned == 0)
    return ((most + span - 1) >> 2) + 1


def texel_reads(offsets: Iterable[int], terms: Sequence[Term]) -> int:
    """The reads `fetch` makes of `offsets` (the operand's own offset added) from a base of `terms`: one per
    distinct texel where the base is a multiple of 4, else per cluster its covering texels or, where those
    are no fewer, one per element."""
    wanted = sorted(set(offsets))
    aligned = functools.reduce(math.gcd, [t.coeff * t.multiple for t in terms], LANES)
    if aligned == LANES:
        return len({offset >> 2 for offset in wanted})
    return sum(min(_covering(cluster, aligned), len(cluster)) for cluster in _clusters(wanted))


def plus(expression: Expr, offset: int) -> Expr:
    """`expression + offset`, without the no-op parts."""
    if offset == 0:
        return expression
    if expression == const(0):
        return const(offset)
    return expression + offset if offset > 0 else expression - (-offset)


def _shifted(terms: list[Term], var: Var, step: int, multiple: int) -> list[Term]:
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
    #: float4 accumulators one vector may group (accumulators.VECTOR_TEXELS): 4 (a float16) for a contraction's
    #: tile, whose rows share each operand vector; 2 elsewhere (convs keep float8s, measured there)
    widest: int = 2

    def serial(self, lanes: int) -> int:
        """Multiply-adds per accumulator, which one work-item runs in turn (runtime tap ranges counted whole)."""
        per_step = max(1, len(self.blocked.products(range(1))) // lanes)
        return math.prod(loop.trips for loop in self.loops) * self.blocked.extent * per_step

    @property
    def _looped(self) -> int:
        """The blocked axis's elements that its loop walks in whole blocks (0: one static block, no loop)."""
        main = self.blocked.extent - self.blocked.extent % self.blocked.block
        return main if main > self.blocked.block else 0

    def shared_loop(self) -> tuple[int | None, int]:
        """(index into loops, or None for the blocked axis's loop; its trips): the loop with the most
        iterations that a work-group can deal out (Reduction.emit's `group`)."""
        candidates = [(loop.trips, index) for index, loop in enumerate(self.loops) if loop.walks]
        trips, index = max(candidates, default=(0, None))
        blocks = self._looped // self.blocked.block
        return (None, blocks) if blocks >= trips else (index, trips)

    def emit(self, b: KernelBuilder, block: Block, lanes: int, guard: Expr | None = None,
             group: int | None = None, stage: bool = False) -> Var:
        """Accumulate into `lanes` accumulators (only where `guard` holds, if given); the array `float
        acc[lanes]` of their totals. With `group`, the work-items of a work-group (`lid`) share
        `shared_loop()`, each its every group-th iteration, and hold partial sums. `stage`: every work-item
        runs this reduction (no guard, no group), so a work-group may stage the texels they share (staging.py)."""
        profile, schedule = b.table.profile, b.schedule
        if lanes > private_limit(profile.cpu):
            raise AssertionError(f"{b.name}: {lanes} accumulators per work-item, more than the "
                                 f"{private_limit(profile.cpu)} floats a work-item keeps in registers "
                                 "(fblc.profiles.profile.private_limit)")
        if lanes % LANES == 0:  # the work-item's reduction (not a row path's per-lane fallback): the schedule's
            form = self.accumulator_form(b, lanes, schedule)
            pair, width = resolve_pair(schedule, profile, self._sample, form, lanes, b.name, self.widest)
            schedule.accumulator_form, schedule.pair_stride, schedule.pair_width = form, pair, width
            if "pair_stride" in schedule.choices:  # plan.json offers the pairings of the form taken
                schedule.choices["pair_stride"] = offered_pairings(form, lanes)
        else:  # what choose_form and pair_stride give lanes that are no whole texels
            form, pair, width = "lanes", 0, 2
        target = Accumulators.declared(block, "accv" if form != "lanes" else "acc", form, pair, lanes, width)
        live = (float4_count(form, lanes) * LANES if form != "lanes" else lanes) * 4  # the accumulators' bytes
        staging = plan_staging(b, block, self, live) if stage and guard is None and group is None else None
        inner = block if guard is None else Block(block.numbering)
        if guard is not None:
            block.add(If(guard, inner.statements))
        shared = self.shared_loop()[0] if group else -1  # -1: no loop is dealt out
        blocks_dealt = group is not None and shared is None
        x_terms, w_terms = list(self.x.terms), list(self.w.terms)
        for index, loop in enumerate(self.loops):
            inner = loop.open(inner, group if index == shared else None, b.lid)
            x_terms, w_terms = x_terms + loop.x_terms, w_terms + loop.w_terms
        axis, main = self.blocked, self._looped
        if main:
            start, step = (b.lid * axis.block, group * axis.block) if blocks_dealt else (const(0), axis.block)
            with inner.loop("blk", start, main, step=step) as (var, body_block):
                mask = None if self.mask is None else replace(
                    self.mask, terms=_shifted(self.mask.terms, var, axis.position_step, axis.block),
                    high=self.mask.high + (main - axis.block) * axis.position_step)
                self._block(b, body_block, target, axis.products(range(axis.block)),
                            _shifted(x_terms, var, axis.x_step, axis.block),
                            _shifted(w_terms, var, axis.w_step, axis.block), mask, staging)
        if main < axis.extent:  # the rest, one work-item's share when the blocks are dealt out
            rest = inner
            if blocks_dealt:
                rest = Block(inner.numbering)
                inner.add(If(b.lid.eq(group - 1), rest.statements))  # type: ignore[operator]
            self._block(b, rest, target, axis.products(range(main, axis.extent)), x_terms, w_terms, self.mask,
                        staging)
        return target.totals(block, lanes)

    def fetches(self) -> float:
        """Texel reads of X and W one work-item makes over the whole reduction as `emit` builds it alone (no
        work-group): each block's distinct texels (texel_reads; the products a mask drops at a border and
        constant operands counted too) times the blocks and the outer loops' most trips. The cost of a tile
        on a GPU whose texture units bound it (TileBudget.fetch_time)."""
        axis, main = self.blocked, self._looped
        x_terms = self.x.terms + [t for loop in self.loops for t in loop.x_terms]
        w_terms = self.w.terms + [t for loop in self.loops for t in loop.w_terms]

        def reads(indices: range, x: list[Term], w: list[Term]) -> int:
            products = axis.products(indices)
            x_reads = (sum(texel_reads((o + self.x.offset for o in offsets), [*x, one.terms[-1]])
                           for one, offsets in self.x.by_row(p.x for p in products).values()) if self.x.rows
                       else texel_reads((p.x + self.x.offset for p in products), x))
            return x_reads + texel_reads((p.w + self.w.offset for p in products), w)

        total = 0
        if main:
            # the block loop's variable: only its multiples matter (the alignment of the bases)
            x_walk, w_walk = ([Term(const(0), step, axis.block)] if step else [] for step in (axis.x_step, axis.w_step))
            total += main // axis.block * reads(range(axis.block), x_terms + x_walk, w_terms + w_walk)
        if main < axis.extent:
            total += reads(range(main, axis.extent), x_terms, w_terms)
        return float(total * math.prod(loop.trips for loop in self.loops))

    def accumulator_form(self, b: KernelBuilder, lanes: int, schedule: Schedule | None = None) -> str:
        """The form of the `lanes` accumulators, judged on one block's products (schedule.resolve_form)."""
        return resolve_form(schedule or Schedule(), b.table.profile, self._sample, lanes, self.serial(lanes),
                            self.widest)

    def cost(self, form: str) -> float:
        """Instructions per product of one block in accumulator `form` (accumulators.block_cost)."""
        return block_cost(self._sample, form)

    @functools.cached_property
    def _sample(self) -> list[tuple[int, int, int]]:
        """(lane, x, w) of one block's products (the form and the cost each judge them; listed once)."""
        return [(p.lane, p.x, p.w) for p in self.blocked.products(range(min(self.blocked.block, self.blocked.extent)))]

    def _block(self, b: KernelBuilder, block: Block, acc: Accumulators, products: Sequence[Product],
               x_terms: list[Term], w_terms: list[Term], mask: Mask | None, staging: Staging | None = None) -> None:
        """One static block (the operands' bases at the terms): drop products that are always out of range, mask
        the ones that may be; with `staging`, its staged operands read from the group's copy."""
        x, w, row_mask = replace(self.x, terms=x_terms), replace(self.w, terms=w_terms), self.row_mask
        axes = [(axis, m) for axis, m in enumerate((mask, row_mask)) if m is not None]
        conditions: dict[tuple[int, int], tuple[int, bool, bool, int]] = {}  # (axis, offset) -> what to test
        kept: list[tuple[Product, tuple[tuple[int, int], ...]]] = []
        for product in products:
            keys: list[tuple[int, int]] = []
            for axis, m in axes:
                offset = (product.position, product.row_position)[axis]
                low, high = m.low + offset, m.high + offset
                if high < 0 or low >= m.extent:
                    break
                if low < 0 or high >= m.extent:
                    conditions.setdefault((axis, offset), (offset, low < 0, high >= m.extent, m.extent))
                    keys.append((axis, offset))
            else:
                kept.append((product, tuple(keys)))
        if not kept:
            return
        positions = {axis: block.let(index_sum((mask, row_mask)[axis].terms), "P")  # type: ignore[union-attr]
                     for axis, _ in axes if any(key[0] == axis for key in conditions)}
        named: dict[tuple[tuple[int, int], ...], Expr] = {
            (key,): block.let(_condition(plus(positions[key[0]], offset), low, high, extent), "m")
            for key, (offset, low, high, extent) in conditions.items()}
        for _, keys in kept:
            if len(keys) > 1 and keys not in named:
                named[keys] = block.let(functools.reduce(Expr.logical_and, (named[(key,)] for key in keys)), "m")
        # without masks (MatMul, Gemm) no read is marked inside: a cluster's spare texel keeps its end clamp
        copies: dict[str, Callable[[Expr, int | None], Expr]] = {}
        if staging is not None:  # every block copies, so every work-item meets the same barriers
            for operand in (x, w):  # the kernel's arguments in the order fetch would number them (x, then w)
                if b.constant_value(operand.value) is None:
                    b.input_argument(operand.value)
            starts = {name: staging.origin(block, name, operand.terms, [getattr(p, name) + operand.offset
                                                                         for p, _ in kept])
                      for name, operand in (("x", x), ("w", w))}
            staging.copy(b, block, [(operand, name, starts[name]) for name, operand in (("x", x), ("w", w))
                                    if starts[name] is not None])  # type: ignore[misc]
            copies = {name: staging.operands[name].read(q0) for name, q0 in starts.items() if q0 is not None}
        xs = fetch(b, block, x, (p.x for p, _ in kept), inside=(p.x for p, keys in kept if not keys) if axes else (),
                   staged=copies.get("x"))
        ws = fetch(b, block, w, (p.w for p, _ in kept), staged=copies.get("w"))
        masked: dict[tuple[int, tuple[tuple[int, int], ...]], Expr] = {}
        for product, keys in kept:
            if keys and (product.x, keys) not in masked:
                element = select(named[keys], xs[product.x], const(0.0, FLOAT))
                # a staged block's straight-line body masks each element once: selected per product, PoCL's
                # register allocation spilled 3.4x the stack accesses (T-ResNet B=64's input gradient k35); a
                # storage that stages nothing keeps the select per product (T-ResNet's k5 in buffers 1.4x slower)
                masked[product.x, keys] = (StagedChoice(element, block.let(element, "X"), FLOAT)
                                           if staging is not None else element)
        updates = acc.add([(product.lane, masked[product.x, keys] if keys else xs[product.x], ws[product.w])
                           for product, keys in kept], [(p.x, p.w) for p, _ in kept])
        block.add(*(updates if staging is None else staging.accumulate(block, updates, acc.array)))


def _condition(position: Expr, low: bool, high: bool, extent: int) -> Expr:
    if low and high:
        return position.cast(UINT).lt(const(extent, UINT))
    return position.ge(0) if low else position.lt(extent)
