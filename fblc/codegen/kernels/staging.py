"""Work-group staging: the texels a work-group's work-items share, read once into __local memory per trip.

Where a device's texel reads cost more than __local traffic and barriers (Profile.local_staging: PoCL's software
images, a function call per read_imagef), neighbouring work-items of a contraction read the same texels many
times: a conv's output positions share their input row and its halo, its output channels' tiles of one batch
element share the weights. benchmarks/staging_trial.py measured it on two T-ResNet launches (the forward conv
0.50x its time, texel reads 11.8M -> 2.2M; a weight gradient 0.59x). Here a work-item's own reduction (Reduction
.emit, no group kernel) gets a work-group of G consecutive items that, at the top of each block of the reduction,
copy the union of their reads of an operand (its `span` texels) into a __local array between two barriers, and
each work-item then reads its texels from there (ir.Stage; Load.staged). Images stage; buffers render the same
kernel with plain loads (render.opencl.Storage.stages).

The plan is decided at compile time from the operand's index arithmetic, per kernel: each index term is uniform
over a group (loop variables, constants) or a function of the work-item's item alone (its output index); the
latter's sum is evaluated for every item (item_index.py: the IR's arithmetic), and for each candidate G (a divisor
of the launch within max_work_group_size) and order of its items the spread of a group's sums from its first
item's gives the texels a group copies. A group holds G consecutive items, or, where one operand's reads repeat
in runs of items (a weight gradient's output channels of one input channel: x alike along a run, w alike at
the same place of each run), blocks of runs (grouped_items: G/a runs of a consecutive items), so that both
operands are shared, as a register tile's rows and columns are. Where an operand's reads repeat every P items (a
conv's weights, batch element after batch element), the group size chosen may take runs P apart instead (more
batch elements, fewer output-channel tiles a group: the weights shared by more items), the other operand's runs
each copying its own span (StagedOperand.run_gap: T-ResNet B=64's k8, texel reads 1088 -> 512 a group and block,
its time 0.81x; buffers, which stage nothing, keep the launch's order: ir.StagedChoice). An operand is staged
where its copy is at most STAGE_GAIN of the group's reads of it, the G and order taken being the ones of the
least cost per work-item and block: its copies' texels, twice (UNSTAGED_READ_WEIGHT) its own reads of operands
left unstaged, and STAGED_BLOCK_READS shared by the group; the arrays within LOCAL_TEXELS, and on a CPU with
barriers in nested loops (and for blocks of runs, always) the group's accumulators within half the L1
(_largest_group), unless the reduction carries them (carried.py). A gathered-rows copy takes each kind of
block's own texels (whole blocks, the remainder) (T-ResNet B=64's weight gradients: 17 texel reads a work-item
and block -> 7, their time in image storage 0.3-0.75x). Nothing is staged (None)
where a loop's bounds differ between work-items (every work-item must reach the barriers), a term mixes the two
kinds, or the operand is inlined, dequantized or read by rows (Operand.rows). On a CPU, a reduction of many blocks
carries its slots and accumulators across the barriers as carried.py writes them (PoCL's per-work-item context).

Why the values are the image's: the copy holds texel clamp(q0 + j) at j, and a read of texel t (clamped or not:
an unclamped read lies inside) takes element t - q0, which the span bounds, so it reads texel clamp(t).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fblc.bundle_format import MASK_FORMATS
from fblc.codegen.builder import TEXEL_INDEX, KernelBuilder
from fblc.codegen.ir import (FLOAT4, INT, Assign, Barrier, Block, Const, DeclareArray, Declare, Element, Expr,
                             Numbering, Stage, Statement, Var, call, div_index, mod_index, walk)
from fblc.codegen.kernels.accumulators import LANES
from fblc.codegen.kernels.carried import Carried, carries, in_registers
from fblc.codegen.kernels.item_index import Unplannable, evaluate, inline, leaves
from fblc.codegen.kernels.reduction_terms import Operand, Term, index_sum
from fblc.profiles.profile import LOCAL_TEXELS, STAGE_GAIN, STAGED_BLOCK_READS, UNSTAGED_READ_WEIGHT, Profile

if TYPE_CHECKING:  # texel.py imports this module
    from fblc.codegen.kernels.texel import Reduction


@dataclass
class StagedOperand:
    """One operand's __local copy: `array` of `texels`, the item-dependent `varying` terms of its index and
    `first`, their sum at the group's first item. A span (`rows` empty): the texels from the least to the most a
    group reads, `spread` (least, most) of an item's sum less the first's. Gathered rows: where the group's items
    sit `row_step` texels apart (sum - first = r * 4 * row_step, r < n) and each block reads texels `rows[kind]`
    from its base (a kind per distinct set: the reduction's whole blocks, its remainder), n rows of those texels
    (a conv's weights: each output channel's few taps of a block's channels, far apart); `slot`, this item's row
    r, and `tables`, each kind's offsets of a row; `kind`, the one of the block being emitted (set by
    Staging.origin, read by its copy and the block's reads that follow)."""

    array: Var
    texels: int
    varying: tuple[Term, ...]
    first: Var
    spread: tuple[int, int] = (0, 0)
    rows: tuple[tuple[int, ...], ...] = ()
    row_step: int = 0
    slot: Var | None = None
    tables: tuple[Var, ...] = ()
    kind: int = 0
    run_gap: int = 0
    run_texels: int = 0
    slot_read: Var | None = None  # the slot as the block being emitted read it again (carried.py), if carried

    def read(self, q0: Var) -> Callable[[Expr, int | None], Element]:
        """The copy's element of texel `index` (k: its offset from the item's base texel, where aligned)."""
        slot = self.slot_read if self.slot_read is not None else self.slot
        if self.run_gap:  # run `slot`'s span sits run_gap texels past the last one's in the image, run_texels here
            assert slot is not None
            return lambda index, k: Element(self.array, index - q0 - slot * (self.run_gap - self.run_texels))
        if not self.rows:
            return lambda index, k: Element(self.array, index - q0)
        row = self.rows[self.kind]
        where = {k: i for i, k in enumerate(row)}
        assert slot is not None
        return lambda index, k: Element(self.array, slot * len(row) + where[k])  # type: ignore[index, operator]


@dataclass
class Staging:
    """The plan of one reduction: the work-group size and the staged operands by name ("x", "w"); `carried`, what
    its work-items carry across the barriers (carried.py), and `zero`, the carried zero as the block being emitted
    read it again."""

    group: int
    operands: dict[str, StagedOperand]
    carried: Carried | None = None
    zero: Var | None = None

    def accumulate(self, block: Block, assigns: Sequence[Assign], array: Var) -> list[Statement]:
        """A block's updates of the accumulators `array` (carried: through private copies, carried.py)."""
        return list(assigns) if self.zero is None else in_registers(block, assigns, array, self.zero)

    def origin(self, block: Block, name: str, terms: Sequence[Term], offsets: Sequence[int]) -> Var | None:
        """The texel q0 at which operand `name`'s copy starts (gathered rows: the group's first item's base
        texel) for a block whose reads lie at `offsets` (the operand's own offset included) from the base `terms`;
        None where the operand is not staged."""
        staged = self.operands.get(name)
        if staged is None:
            return None
        uniform = list(terms)
        for term in staged.varying:  # each once: a term twice in the index counts twice
            uniform.remove(term)
        if staged.rows:
            texels = {offset >> 2 for offset in offsets}
            staged.kind = next((k for k, row in enumerate(staged.rows) if texels <= set(row)), -1)
            assert staged.kind >= 0, f"a block's texels off its rows ({name})"
            return block.let((index_sum(uniform) + staged.first) >> 2, "q")
        low, high = staged.spread[0] + min(offsets), staged.spread[1] + max(offsets) + LANES
        span = staged.run_texels or staged.texels
        assert (high - low) // LANES + 2 <= span, f"a block's span past the group's copy ({name})"
        return block.let((index_sum(uniform) + staged.first + low) >> 2, "q")

    def copy(self, b: KernelBuilder, block: Block, reads: Sequence[tuple[Operand, str, Var]]) -> None:
        """The group's copy of each staged operand from texel q0 (`reads`: operand, name, q0), between the
        barriers that keep the last block's reads before it and this block's after it."""
        stage = Block(block.numbering, [Barrier()])
        for operand, name, q0 in reads:
            argument, texture = b.input_argument(operand.value)
            staged = self.operands[name]
            with stage.loop("j", b.lid, staged.texels, step=self.group) as (j, body):
                at: Expr = q0 + j
                if staged.run_gap:  # element j: run r's texel i of its span
                    r = body.let(div_index(j, staged.run_texels), "r")
                    at = q0 + r * staged.run_gap + (j - r * staged.run_texels)  # type: ignore[operator]
                elif staged.rows:  # element j: row r's texel i
                    row = len(staged.rows[staged.kind])
                    r = body.let(div_index(j, row), "r")
                    at = q0 + r * staged.row_step + Element(staged.tables[staged.kind], j - r * row)  # type: ignore[arg-type]
                body.assign(Element(staged.array, j), b.texel(argument, texture, call("clamp", at, 0, texture.texels - 1)))
        stage.add(Barrier())
        if self.carried is not None:
            self.zero, slots = self.carried.read(stage)
            for name, slot in slots.items():
                self.operands[name].slot_read = slot
        block.add(Stage(stage.statements))


def plan_staging(b: KernelBuilder, block: Block, reduction: Reduction, live_bytes: int) -> Staging | None:
    """The staging of `reduction` (emitted into `block` of the per-texel prologue by every work-item, no guard),
    or None (the module docstring's conditions); declares the arrays (b.staged_arrays) and the first items'
    sums (into `block`) of a plan it returns."""
    profile = b.table.profile
    # a work-item that runs two items in turn (builder.PAIR: an odd tile's mask8 bytes) is no item of its own
    masks_paired = b.texels_per_item % 2 and any(t.format == MASK_FORMATS["mask8"] and t.layout.mask_pair_stride == 1
                                                 for t in b.out_textures)
    if not profile.local_staging or b.group_size is not None or b.staging_group is not None or masks_paired:
        return None
    item = b.t if b.texels_per_item == 1 else b.g
    scratch = Block(Numbering(10 ** 9))  # the item's index as finish declares it, numbered apart from the kernel's
    b.declare_item_index(scratch, b.out_shape, TEXEL_INDEX)
    decls = {s.var: s.init for s in walk([*scratch.statements, *b.texel_lines])
             if getattr(s, "const", False) and getattr(s, "init", None) is not None and hasattr(s, "var")}
    items = np.arange(b.items, dtype=np.int64)
    try:
        for loop in reduction.loops:
            entered = Block(Numbering(10 ** 9))
            if loop.enter is not None and loop.enter(entered) is not entered:  # an `if` around the blocks
                return None
            decls.update({s.var: s.init for s in entered.statements if isinstance(s, Declare) and s.init is not None})
            if any(leaves(e, decls) & {item} for e in (loop.start, loop.stop) if e is not None):
                return None
        candidates = {}
        for name, operand in (("x", reduction.x), ("w", reduction.w)):
            found = _operand_reads(b, reduction, name, operand, item, decls, items,
                                   {loop.var for loop in reduction.loops if loop.var is not None})
            if found is not None:
                candidates[name] = found
    except Unplannable:
        return None
    # the barriers in a block loop of several trips inside an outer loop (a remainder block adds no loop)
    nested = any(loop.trips > 1 for loop in reduction.loops) and reduction._looped > reduction.blocked.block
    # blocks of runs (_orders) only in groups whose accumulators fit as a nested loop's must, unless carried: the
    # larger ones that read fewest texels ran slower on PoCL (T-ResNet's forward convs in blocks of 256: 1.8x)
    carried = carries(profile, reduction)
    periods = {_run(sums) for sums, *_ in candidates.values()} - {0}
    within = _largest_group(profile, live_bytes, not carried)
    largest = _largest_group(profile, live_bytes, nested and not carried)
    plans = (_plan_cost(candidates, b.items, g, o) for g in range(LANES, largest + 1) if b.items % g == 0
             for o in _orders(b.items, g, periods if g <= within else set()))
    best = min((p for p in plans if p is not None), key=lambda p: p[0], default=None)
    if best is None:
        return None
    # an operand whose reads repeat every `period` items (a conv's weights, batch element after batch element):
    # groups of runs `period` apart share it, the other operand's runs copied as spans (_run_spans); only at the
    # group size chosen above, so that the barriers and the group's context stay as they were: T-ResNet B=64's
    # k8 (groups of 96) took 0.80x its time, where the same order in groups of 256 took 1.32x and MobileNetV2's
    # weight gradients in groups twice theirs 1.2-1.4x (PoCL, one thread, process CPU time)
    repeats = {_period(sums) for sums, *_ in candidates.values()} - {0}
    plans = (_plan_cost(candidates, b.items, best[1], o) for o in _orders(b.items, best[1], repeats)[1:])
    unrepeated, best = best, min([best, *(p for p in plans if p is not None)], key=lambda p: p[0])
    # such an order only where it stages: buffers keep the launch's, whose neighbouring items share a batch
    # element's x in the cache (T-ResNet B=64's k0 in buffers: 6.3 -> 9.4 ms in the staged order)
    b.staging_launch_order = best is not unrepeated
    _, group, order, chosen = best
    staged = {}
    for name, (texels, spread, step, run) in chosen.items():
        _, varying, _, _, rows = candidates[name]
        var = Var("st", b.numbering.next(), FLOAT4)
        b.staged_arrays.append(DeclareArray(var, texels, local=True))
        own = sum((t.expr * t.coeff for t in varying), start=Const(0, item.dtype))
        across, period = order  # the group's first item: this one less its place in the group's runs
        at_first = item - b.lid if across == group else item - div_index(b.lid, across) * period - mod_index(b.lid, across)
        first = block.let(inline(own, decls, {item: at_first}), "first")
        if run is not None:  # this item's run of the group's
            slot = block.let(div_index(b.lid, across), "slot")
            staged[name] = StagedOperand(var, texels, varying, first, spread, slot=slot, run_gap=run[0],
                                         run_texels=run[1])
            continue
        if not step:
            staged[name] = StagedOperand(var, texels, varying, first, spread)
            continue
        tables = tuple(Var("rows", b.numbering.next(), INT) for _ in rows)
        b.staged_arrays.extend(DeclareArray(table, len(row), tuple(Const(k, INT) for k in row), constant=True)
                               for table, row in zip(tables, rows))
        slot = block.let(div_index(own - first, step * LANES), "slot")
        staged[name] = StagedOperand(var, texels, varying, first, spread, rows, step, slot, tables)
    b.staging_group, b.staging_order = group, order
    slots = {name: s.slot for name, s in staged.items() if s.slot is not None}
    return Staging(group, staged, Carried.declared(block, slots) if carried else None)


def _run(sums: np.ndarray) -> int:
    """The items in each run of equal sums where the runs are alike and tile the launch (an operand read alike by
    consecutive items: a weight gradient's output channels of one input channel), else 0."""
    changes = np.flatnonzero(np.diff(sums)) + 1
    run = int(changes[0]) if len(changes) else 0
    return run if run and len(sums) % run == 0 and not np.any(changes % run) else 0


_Copy = tuple[int, tuple[int, int], int, "tuple[int, int] | None"]  # texels, spread, rows' step, run spans


def _plan_cost(candidates: dict[str, tuple[np.ndarray, tuple[Term, ...], int, int, tuple[tuple[int, ...], ...]]],
               items: int, group: int, order: tuple[int, int]
               ) -> tuple[float, int, tuple[int, int], dict[str, _Copy]] | None:
    """(the cost per work-item and block, group, order, each staged operand's copy: texels, spread, gathered rows'
    step, run spans (gap, texels)) of staging `candidates` in groups of `group` items in `order`, or None where
    nothing is staged or the copies pass LOCAL_TEXELS (the module docstring's cost)."""
    chosen, per_item = {}, 0.0
    in_groups = grouped_items(np.arange(items), group, *order)  # the items in their groups' order, every operand's
    for name, (sums, _, extent, reads, rows) in candidates.items():
        grouped = sums[in_groups].reshape(-1, group)
        spread = grouped - grouped[:, :1]
        low, high = int(spread.min()), int(spread.max())
        texels, step, run = (high - low + extent + LANES) // LANES + 2, 0, None
        if rows and low == 0:  # gathered rows where the items' bases step evenly from the first's
            distinct = np.unique(spread)
            gap = int(distinct[1]) if len(distinct) > 1 else LANES
            longest = max(len(row) for row in rows)
            if gap % LANES == 0 and np.array_equal(distinct, np.arange(len(distinct)) * gap) \
                    and len(distinct) * longest < texels:
                texels, step = len(distinct) * longest, gap // LANES
        spans = _run_spans(grouped, order[0], extent) if order[0] < group else None
        if spans is not None and spans[0] < texels:  # each run's own span: the least copy of the three forms
            texels, (low, high), step, run = spans[0], spans[1], 0, spans[2]
        if texels <= STAGE_GAIN * group * reads:
            chosen[name] = texels, (low, high), step, run
            per_item += texels / group
        else:
            per_item += reads * UNSTAGED_READ_WEIGHT
    per_item += STAGED_BLOCK_READS / group  # the group's barriers and copy loops, shared by its work-items
    if not chosen or sum(c[0] for c in chosen.values()) > LOCAL_TEXELS:
        return None
    return per_item, group, order, chosen


def _period(sums: np.ndarray) -> int:
    """The fewest items after which the sums repeat (an operand read alike by each batch element's items: a
    conv's weights), where fewer than all; else 0."""
    items = len(sums)
    return next((p for p in range(1, items // 2 + 1) if items % p == 0 and np.array_equal(sums[p:], sums[:-p])), 0)


def _run_spans(grouped: np.ndarray, across: int, extent: int) -> tuple[int, tuple[int, int], tuple[int, int]] | None:
    """A copy of each run's own span where a group's runs of `across` items (grouped: each group's sums, in its
    items' order) lie far apart: (its texels, an item's least and most sum less its run's first's, (the texels
    from a run's span to the next's in the image, a span's texels)), where every group's runs start evenly
    whole texels apart; else None."""
    runs = grouped.reshape(grouped.shape[0], -1, across)
    bases = runs[:, :, 0]
    steps = bases - bases[:, :1]
    gap = int(steps[0, 1]) if steps.shape[1] > 1 else 0
    if gap <= 0 or gap % LANES or not (steps == np.arange(steps.shape[1]) * gap).all():
        return None
    within = runs - bases[:, :, None]
    low, high = int(within.min()), int(within.max())
    span = (high - low + extent + LANES) // LANES + 2
    return span * steps.shape[1], (low, high), (gap // LANES, span)


def _orders(items: int, group: int, periods: set[int]) -> list[tuple[int, int]]:
    """The item orders a work-group of `group` may take (grouped_items' (across, period)): consecutive items, and
    blocks of group/across runs of `across` consecutive items, `period` apart, where one operand's reads repeat
    every `period` items (its runs): those items share both operands, as a register tile's rows and columns do."""
    orders = [(group, group)]
    for period in sorted(periods):
        orders += [(across, period) for across in range(1, group) if group % across == 0 and period % across == 0
                   and period > across and items % (group // across * period) == 0]
    return orders


def grouped_items(position: np.ndarray, group: int, across: int, period: int) -> np.ndarray:
    """The item each work-item runs at `position` of the launch: work-group k holds group/across runs of `across`
    consecutive items, the runs `period` items apart (across == group: the items in launch order). numpy's twin of
    grouped_item, which the staging plan evaluates."""
    if across == group:
        return position
    lid = position % group
    runs = period // across
    first = position // group
    return (first // runs * (group // across) + lid // across) * period + first % runs * across + lid % across


def grouped_item(position: Expr, lid: Expr, group: int, across: int, period: int) -> Expr:
    """grouped_items in the kernel: the item of the work-item at global id `position`, local id `lid`."""
    if across == group:
        return position
    runs = period // across
    first = div_index(position - lid, group)
    return ((div_index(first, runs) * (group // across) + div_index(lid, across)) * period
            + mod_index(first, runs) * across + mod_index(lid, across))


def _largest_group(profile: Profile, live_bytes: int, bounded: bool) -> int:
    """The largest work-group for a staged reduction whose work-item keeps `live_bytes` of accumulators, held to
    half the L1 where `bounded`: on a CPU, a reduction that does not carry its accumulators as carried.py writes
    them (fewer than CARRIED_BLOCKS blocks) and whose barriers sit inside an outer loop around several blocks, or
    that takes blocks of runs. A CPU device runs a group's work-items in turn between barriers and keeps what each
    carries across one in a context array of the group; measured on PoCL before carried.py (T-ResNet B=64's weight
    gradients, a batch loop of 64 around 3 blocks), a group's accumulators past the core's L1 made staging cost
    more than it saved: 640 B a work-item in groups of 256 (160 KB) 1.9x the unstaged time, in groups of 16 (half
    of a 32 KB L1) 0.7-0.9x. Carried, the same kernels in the larger groups took 0.49-0.54x the time of the
    bounded ones (k33, k34, k43, k44; k36 0.74x; T-ResNet's step 520 -> 418 ms, MobileNetV2's 317 -> 310). A GPU
    keeps the accumulators in registers."""
    if not (profile.cpu and bounded):
        return profile.max_work_group_size
    return min(profile.max_work_group_size, max(LANES, profile.l1_bytes // 2 // max(live_bytes, 1)))


def _operand_reads(b: KernelBuilder, reduction: Reduction, name: str, operand: Operand, item: Var,
                   decls: dict[Var, Expr], items: np.ndarray, uniform: set[Var]
                   ) -> tuple[np.ndarray, tuple[Term, ...], int, int, tuple[tuple[int, ...], ...]] | None:
    """(each item's sum of the operand's item terms, those terms, the extent of a block's offsets, texel reads
    of a work-item per block, the texels each kind of block (whole, remainder) reads from its base texel where
    that base is a multiple of 4 whatever the run-time values, else ()) of a stageable operand, else None."""
    from fblc.codegen.kernels.texel import texel_reads

    if operand.rows or b.constant_value(operand.value) is not None or b.table.of(operand.value).dequantized \
            is not None:
        return None
    varying = []
    for term in [*operand.terms, *(t for loop in reduction.loops for t in getattr(loop, f"{name}_terms"))]:
        read = leaves(term.expr, decls)
        if read == {item}:
            varying.append(term)
        elif not read <= uniform:  # the item's and a loop's at once, or a value declared out of sight
            raise Unplannable(term)
    if not varying:
        return None
    sums = sum((evaluate(t.expr, decls, item, items) * t.coeff for t in varying), start=np.zeros_like(items))
    axis = reduction.blocked
    blocks = [range(axis.block)] if reduction._looped else []
    if reduction._looped < axis.extent:
        blocks.append(range(reduction._looped, axis.extent))
    extent, reads, texels = 0, 0, []
    for indices in blocks:
        offsets = [getattr(p, name) + operand.offset for p in axis.products(indices)]
        extent = max(extent, max(offsets) - min(offsets))
        reads = max(reads, texel_reads(offsets, operand.terms))
        texels.append(tuple(sorted({offset >> 2 for offset in offsets})))
    steps = [t.coeff * t.multiple for t in operand.terms] + [t.coeff * t.multiple for loop in reduction.loops
                                                             for t in getattr(loop, f"{name}_terms")]
    steps.append(getattr(axis, f"{name}_step") * axis.block if reduction._looped else 0)
    aligned = all(step % LANES == 0 for step in steps) and operand.offset % LANES == 0
    return sums, tuple(varying), extent, reads, tuple(texels) if aligned else ()
