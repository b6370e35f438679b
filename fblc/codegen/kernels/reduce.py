"""Reduction kernels: ReduceSum, ReduceMean, ReduceMax, ReduceL2, ReduceLogSumExp, GlobalAveragePool.

One work-item per output texel (a work-group past the serial limit) folds the reduced elements, whole
texels where the axes allow; docs/ARCHITECTURE.md §3. A kernel folds every sibling reduction of its group
(passes/fuse.py: one input shape, axes and output shape) in turn, then evaluates the group's elementwise
epilogue on their results, as a contraction does (an optimizer update of a gradient summed over the batch). A
reduction whose input the group's prologue node makes (fuse.reduction_prologue: BatchNorm's dy * x_hat) folds that
node's op of its operands' texels as it reads them (FoldInput): the product is never stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Union

import onnx_ir as ir

from fblc.bundle_format import MASK_FORMATS
from fblc.codegen.builder import OUT_INDEX, TEXEL_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, strides_of
from fblc.codegen.indexing import digit_terms, flat_view_index, index_var
from fblc.codegen.ir import FLOAT, FLOAT4, Block, Expr, Lane, Var, call, const, flat_index, select, vector
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.kernels.elementwise import evaluate_chain
from fblc.codegen.kernels.fold_reads import FoldInput, FoldReads, Folds, Read, lane_each, let_each
from fblc.codegen.reads import dtype_of
from fblc.codegen.textures import TextureTable
from fblc.compiler.index_map import map_of, view_root
from fblc.compiler.values import attr, numel, static_shape
from fblc.passes.fuse import REDUCTIONS, reduced_axes
from fblc.profiles.profile import SHARED_TILE_FLOATS

Combine = Callable[[Expr, Expr], Expr]  # (accumulator, element) -> the new accumulator
_fmax: Combine = partial(call, "fmax")


@dataclass(frozen=True)
class TexelFold:
    """How a fold runs a row's texels whole: float4 accumulators (component c folds the row's elements at c
    mod 4) that `join` turns into the scalar accumulators; a lane outside the row enters as `neutral`, the
    element that folds nothing. Worth it where the combine is dear per element (an exp: PoCL vectorizes a
    float4 exp, not a chain of scalar ones)."""

    neutral: float
    join: Callable[[Block, tuple[Var, ...]], tuple[Expr, ...]]


@dataclass(frozen=True)
class Folded:
    """A reduction's result, per accumulator: `values` as a later fold reads them (float4s when the fold ran
    texel-wise in the per-texel prologue), `lanes` as the lane loop reads them; `value`, `lane`: the first's."""

    values: tuple[Var, ...]
    lanes: tuple[Expr, ...]

    @property
    def value(self) -> Var:
        return self.values[0]

    @property
    def lane(self) -> Expr:
        return self.lanes[0]


#: how a group joins partials of several accumulators ([the work-item's partials of each], prologue)
GroupMerge = Callable[[KernelBuilder, list[list[Union[Var, Lane]]], bool], None]


def reduction_loop(b: KernelBuilder, source: ir.Value | tuple[ir.Value, ...], axes: list[int], keepdims: bool,
                   combine: Callable,
                   start: float | tuple[float, ...], merge: str | GroupMerge = "add",
                   texel_fold: TexelFold | None = None, computed: dict[int, ir.Node] | None = None) -> Folded:
    """Fold `source` over `axes` for the current output element: `acc = combine(acc, x)` from `start`, or with a
    tuple of starts, several accumulators at once (`combine(block, accs, x)` gives their new values). With
    `b.group_size` the work-items fold every group_size-th step, then `merge` joins their partials: a
    group_merges.MERGES name (one accumulator), or a GroupMerge. With `texel_fold`, a row whose trailing reduced
    run is contiguous folds whole texels into float4 accumulators (combine takes float4s too). `computed`: the
    kernel's prologue nodes by output id (FoldInput), `source` computed as it is read where one makes it. A tuple
    of sources (contiguous, one shape: fuse_sums) folds them in one loop, `combine` taking a tuple of elements."""
    sources = source if isinstance(source, tuple) else None
    source = sources[0] if sources else source
    assert isinstance(source, ir.Value)
    shape = static_shape(source)
    strides = strides_of(shape)
    kept = [a for a in range(len(shape)) if a not in axes]
    count = numel([shape[a] for a in axes])

    def base_of(prefix: str, view_kept: tuple[int, ...] = tuple(kept), view_strides: tuple[int, ...] = tuple(strides)
                ) -> Expr:
        """The flat index of the output's first reduced element (in the view's own order)."""
        return flat_index([(index_var(prefix, a if keepdims else view_kept.index(a)), view_strides[a])
                           for a in view_kept])

    index_map, stepped = map_of(source), False  # stepped: `read` reads the root, a row's start mapped to it
    if (columns := root_columns(source, axes)) is not None:  # its rows in the root's order: the same fold
        source, shape, strides, axes, kept = view_root(source), (count, columns), [columns, 1], [0], [1]
    elif root_steps(source, axes):  # the row's start through the view once, then its steps in root strides
        strides = [index_map.strides[a] if a in axes else stride for a, stride in enumerate(strides)]
        source, stepped = view_root(source), True
    group = b.group_size
    first, step = (b.lid, group) if group else (const(0), 1)
    whole_texels = b.constant_value(source) is None and map_of(source).contiguous and not stepped
    starts = start if isinstance(start, tuple) else (start,)
    read: Read = FoldReads(b, sources, computed or {}) if sources else FoldInput(b, source, computed or {})

    def fold_in(block: Block, accs: list[Var], x: Folds) -> None:
        """accs = combine(accs, x), every new value computed from the old ones."""
        new = combine(accs[0], x) if len(accs) == 1 else combine(block, tuple(accs), x)
        news = [block.let(v, "n") for v in new] if isinstance(new, tuple) else [new]
        for acc, value in zip(accs, news):
            block.assign(acc, value)

    def join(partials: list[list[Var | Lane]], prologue: bool) -> None:
        if isinstance(merge, str):  # fused sums (FoldReads): in merges of at most SHARED_TILE_FLOATS of __local
            flat, most = [p for each in partials for p in each], max(4, SHARED_TILE_FLOATS // (group or 1))
            for at in range(0, len(flat), most):
                b.merge_across_group(flat[at:at + most], merge, prologue)
        else:
            merge(b, partials, prologue)

    def step_index(r: Expr, loop_axes: list[int], unit: int = 1) -> Expr:
        """Index (in `unit`s) of step `r` of a row-major loop over `loop_axes`."""
        return flat_index(digit_terms(r, [(shape[a], strides[a] // unit) for a in loop_axes]))

    inner = numel(shape[axes[-1] + 1:]) if axes else 0
    # kept axes after the reduced ones a multiple of 4 long: the 4 lanes fold 4 consecutive elements, one
    # texel read per step, in the per-texel prologue
    if whole_texels and inner > 0 and inner % 4 == 0 and b.texels_per_item == 1:
        accs = [b.prologue.mutable(vector(FLOAT4, const(st, FLOAT)), "acc") for st in starts]
        with b.prologue.loop("r", first, count, step=step) as (r, fold):
            x = let_each(fold, read.texel((base_of(TEXEL_INDEX) >> 2) + step_index(r, axes, 4), fold), "x")
            fold_in(fold, accs, x)
        if group:  # the four outputs' partials in one merge
            join([[acc.lane(lane) for lane in range(4)] for acc in accs], True)
        return Folded(tuple(accs), tuple(acc.lane(b.lane) for acc in accs))
    suffix = len(shape)  # the first of the trailing axes that are all reduced
    while suffix > 0 and suffix - 1 in axes:
        suffix -= 1
    run = numel(shape[suffix:]) if suffix < len(shape) else 0  # the run of their elements (0: the last axis is kept)
    outer = [a for a in axes if a < suffix]

    def fold_row(body: Block, base: Expr, accs: list[Var]) -> None:
        """Fold the reduced elements of the output whose first reduced element is `base` into `accs` (at
        their starts)."""
        if whole_texels and run and run % 4 == 0:  # the trailing reduced run as whole texels, their lanes in turn
            texel_accs = [body.mutable(vector(FLOAT4, const(st, FLOAT)), "acc") for st in starts] if texel_fold else []
            with body.loop("r", first, count // 4, step=step) as (r, fold):
                texel = flat_index(digit_terms(r, [(shape[a], strides[a] // 4) for a in outer] + [(run // 4, 1)]))
                v = let_each(fold, read.texel((base >> 2) + texel, fold), "v")
                if texel_fold:
                    fold_in(fold, texel_accs, v)
                else:
                    for lane in range(4):
                        fold_in(fold, accs, let_each(fold, lane_each(v, lane), "x"))
            if texel_fold:
                for acc, value in zip(accs, texel_fold.join(body, tuple(texel_accs))):
                    body.assign(acc, value)
        elif whole_texels and run > 1:  # the trailing reduced run contiguous: index arithmetic once per run
            deal_inner = group is None or run >= group or not outer  # deal out the longer loop to the group
            inner_first, inner_step = (first, step) if deal_inner else (const(0), 1)
            wide = texel_fold if texel_fold and not read.mask else None
            targets = [body.mutable(vector(FLOAT4, const(st, FLOAT)), "acc") for st in starts] if wide else accs
            if not outer:  # one run alone needs no loop over the runs
                _fold_run(body, read, base, run, targets, fold_in, inner_first, inner_step, wide)
            else:
                outer_first, outer_step = (const(0), 1) if deal_inner else (first, step)
                with body.loop("r", outer_first, count // run, step=outer_step) as (r, runs):
                    row = runs.let(base + step_index(r, outer), "row")
                    _fold_run(runs, read, row, run, targets, fold_in, inner_first, inner_step, wide)
            if wide:
                for acc, value in zip(accs, wide.join(body, tuple(targets))):
                    body.assign(acc, value)
        else:
            start = body.let(flat_view_index(index_map, base), "row") if stepped else base
            with body.loop("r", first, count, step=step) as (r, fold):
                index = start + step_index(r, axes) if axes else start
                fold_in(fold, accs, let_each(fold, read.element(index, fold), "x"))

    if group and b.texels_per_item == 1:  # the texel's 4 outputs in the prologue, their partials in one merge
        prologue, outputs = b.prologue, numel([shape[a] for a in kept])
        lanes = []
        for lane in range(4):  # a lane past the last output keeps its starts (every lane reaches the merge)
            lanes.append([prologue.mutable(const(st, FLOAT), "acc") for st in starts])
            if lane >= outputs:  # past the end in every texel
                continue
            out = prologue.let(b.first_element + lane, "out")
            fold_row(prologue if outputs % 4 == 0 else prologue.either(out.lt(outputs))[0],
                     step_index(out, kept), lanes[-1])
        live = lanes[:min(4, outputs)]
        join([[each[k] for each in live] for k in range(len(starts))], True)
        texels = [prologue.let(vector(FLOAT4, *(each[k] for each in lanes)), "acc") for k in range(len(starts))]
        return Folded(tuple(texels), tuple(texel.lane(b.lane) for texel in texels))
    body = b.body
    base = body.let(base_of(OUT_INDEX), "base")
    accs = [body.mutable(const(st, FLOAT), "acc") for st in starts]
    fold_row(body, base, accs)
    if group:
        join([[acc] for acc in accs], False)
    return Folded(tuple(accs), tuple(accs))


def root_steps(source: ir.Value, axes: list[int]) -> bool:
    """Whether the strided view `source`'s reduced `axes` are each one digit (not folded): a fold then maps its
    row's first element through the view once (the divisions of a folded kept axis: heads merged after a
    transpose) and steps by the root strides, not every element through the view."""
    index_map = map_of(source)
    return (not index_map.contiguous and bool(axes)
            and all(len([d for d in index_map.sub_axes(a) if d[0] != 1]) <= 1 for a in axes))


def root_columns(source: ir.Value, axes: list[int]) -> int | None:
    """C where folding the strided view `source` over `axes` is folding its root as [N / C, C] over its rows: the
    kept axes are the trailing ones and read the root's first C elements in order, and the reduced axes, a
    permutation (no broadcast, no slice: the view has the root's size), visit every C-th one (a window reverse's
    or a head merge's transposed rows, whose bias gradient sums all of them). A fold is the same in any order
    (sum, max, log-sum-exp), and the root's rows are read as whole texels with no division per element; None
    where the view is contiguous already or another form."""
    index_map, shape = map_of(source), static_shape(source)
    if index_map.contiguous or index_map.offset or not axes or sorted(axes) != list(range(len(axes))):
        return None
    if numel(static_shape(view_root(source))) != numel(shape):
        return None
    digits = {a: [d for d in index_map.sub_axes(a) if d[0] != 1] for a in range(len(shape))}
    if any(stride == 0 for each in digits.values() for _, stride in each):
        return None
    columns, expected = numel(shape[len(axes):]), 1
    for extent, stride in reversed([d for a in range(len(axes), len(shape)) for d in digits[a]]):
        if stride != expected:
            return None
        expected *= extent
    return columns if all(stride % columns == 0 for a in axes for _, stride in digits[a]) else None


def _fold_run(block: Block, read: Read, row: Expr, run: int, accs: list[Var],
              fold_in: Callable[[Block, list[Var], Folds], None], first: Expr, step: int,
              texel_fold: TexelFold | None = None) -> None:
    """Fold the `run` consecutive elements of `read` from flat index `row` into `accs` (the `first`, `first +
    step`.. of their texels): the texels that cover them, each read once and its lanes folded in turn, but for
    the lanes of the two end texels that lie outside the run (a run of no multiple of 4, such as a channel's
    map in BatchNorm's gradient sums, starts anywhere in a texel). One element a read was 4 reads a texel.
    With `texel_fold` the texel folds whole into float4 `accs`, its lanes outside the run as the neutral element."""
    if read.mask:  # a mask's bits have no texels to read whole
        with block.loop("ri", first, run, step=step) as (inner, fold):
            fold_in(fold, accs, let_each(fold, read.element(row + inner, fold), "x"))
        return
    # a static count (the most texels a run covers, at its worst alignment: a compiler and kernel_stats know its
    # trips); a texel past the tensor's end, which only the last run can meet, is read clamped and folds nothing
    span, last = (run + 6) // 4, read.texels - 1
    start, end = block.let(row >> 2, "q"), block.let(row + run, "end")
    with block.loop("ri", first, span, step=step) as (inner, fold):
        at = fold.let(start + inner, "q")
        texel = let_each(fold, read.texel(call("min", at, last), fold), "v")
        if texel_fold:
            assert not isinstance(texel, tuple), "a texel fold of one source"
            inside = [(at * 4 + lane).ge(row).logical_and((at * 4 + lane).lt(end)) for lane in range(4)]
            neutral = const(texel_fold.neutral, FLOAT)
            fold_in(fold, accs, fold.let(vector(FLOAT4, *(select(inside[lane], texel.lane(lane), neutral)
                                                           for lane in range(4))), "x"))
            return
        for lane in range(4):
            element = at * 4 + lane
            with fold.when(element.ge(row).logical_and(element.lt(end))) as inside:
                fold_in(inside, accs, let_each(inside, lane_each(texel, lane), "x"))


def _log_sum_exp_step(block: Block, accs: tuple[Expr, ...], x: Expr) -> tuple[Expr, Expr]:
    """One element into a running (max m, sum s of exp(x - m)): one pass over the row, one exp an element.
    The smaller of m and x enters as exp(smaller - larger); `fmin(.., 0)` makes that exp(0) = 1 where both
    are -inf (NaN otherwise), and a later finite x scales that sum by exp(-inf) = 0."""
    peak, total = accs
    larger = block.let(call("fmax", peak, x), "hi")
    scale = block.let(call("exp", call("fmin", call("fmin", peak, x) - larger, const(0.0, FLOAT))), "e")
    return larger, select(x.gt(peak), total * scale + const(1.0, FLOAT), total + scale)


def _join_log_sum_exp(block: Block, accs: tuple[Var, ...]) -> tuple[Expr, Expr]:
    """The (max, sum) of a row from its float4 (max, sum) pairs, one per component: the components' max, each
    sum rescaled to it (one float4 exp) and added. A component at the max keeps its sum, -inf's included."""
    peaks, totals = accs
    peak = block.let(call("fmax", call("fmax", peaks.lane(0), peaks.lane(1)),
                          call("fmax", peaks.lane(2), peaks.lane(3))), "hi")
    scaled = block.let(select(peaks.eq(peak), totals, totals * call("exp", peaks - peak)), "s")
    return peak, (scaled.lane(0) + scaled.lane(1)) + (scaled.lane(2) + scaled.lane(3))


#: -inf folds nothing into a (max, sum) pair: fmax keeps the max, and its exp(-inf - max) adds 0 (while the max is
#: -inf too it adds 1, which a later finite element or the join scales by exp(-inf) = 0)
LOG_SUM_EXP_TEXELS = TexelFold(-math.inf, _join_log_sum_exp)


def _merge_log_sum_exp(b: KernelBuilder, partials: list[list[Var | Lane]], prologue: bool) -> None:
    """Join the work-items' (max, sum) pairs: the group's max, then each sum rescaled to it and added."""
    peaks, totals = partials
    block = b.prologue if prologue else b.body
    own = [block.let(peak, "own") for peak in peaks]  # a peak's partial, before the merge replaces it
    b.merge_across_group(peaks, "max", prologue)
    for mine, peak, total in zip(own, peaks, totals):  # a partial already at the max keeps its sum (-inf's too)
        block.assign(total, select(mine.eq(peak), total, total * call("exp", mine - peak)))
    b.merge_across_group(totals, "add", prologue)


def reduction_lane(b: KernelBuilder, node: ir.Node, computed: dict[int, ir.Node]) -> Expr:
    """The lane's result of reduction `node` (its fold loops built into `b`; `computed`: reduction_loop's)."""
    axes = reduced_axes(node)
    keepdims = node.op_type == "GlobalAveragePool" or bool(attr(node, "keepdims", 1))
    source = node.inputs[0]
    if node.op_type == "ReduceMax":
        return reduction_loop(b, source, axes, keepdims, _fmax, -math.inf, "max", computed=computed).lane
    if node.op_type == "ReduceLogSumExp":  # exp(x - running max): cannot overflow, the row read once
        peak, total = reduction_loop(b, source, axes, keepdims, _log_sum_exp_step, (-math.inf, 0.0),
                                     _merge_log_sum_exp, LOG_SUM_EXP_TEXELS, computed).lanes
        # a row of -inf (every entry masked) has no finite maximum: its log-sum-exp is -inf
        none = const(-math.inf, FLOAT)
        return select(peak.eq(none), none, peak + call("log", total))
    if node.op_type == "ReduceL2":  # with no axes (noop_with_empty_axes) this is |x|, as onnxruntime gives
        squares = reduction_loop(b, source, axes, keepdims, lambda a, x: call("fma", x, x, a), 0.0, computed=computed)
        return call("sqrt", squares.lane)
    total_lane = reduction_loop(b, source, axes, keepdims, lambda a, x: a + x, 0.0, computed=computed).lane
    if node.op_type in ("ReduceMean", "GlobalAveragePool"):
        total_lane = total_lane / const(float(numel([static_shape(source)[a] for a in axes]) or 1), FLOAT)
    return total_lane


#: the reductions that are a plain sum of their input (a mean: the sum scaled)
SUMS = ("ReduceSum", "ReduceMean", "GlobalAveragePool")


def _fold_key(b: KernelBuilder, node: ir.Node) -> tuple | None:
    """What sums may share a loop: the same reduced axes and keepdims over a contiguous input of one shape (one
    order of texels); None: a fold of its own (another op, a strided view, a constant, a mask's bits)."""
    source = node.inputs[0]
    if node.op_type not in SUMS or not map_of(source).contiguous or b.constant_value(source) is not None:
        return None
    keepdims = node.op_type == "GlobalAveragePool" or bool(attr(node, "keepdims", 1))
    return tuple(reduced_axes(node)), keepdims, tuple(static_shape(source))


def fuse_sums(b: KernelBuilder, reductions: list[ir.Node]) -> list[list[ir.Node]]:
    """The group's reductions in order, sums of one _fold_key together (at the first's place): one loop reads
    the texels they share once (FoldReads), where a loop each read BatchNorm's dy twice."""
    runs: list[list[ir.Node]] = []
    at: dict[tuple, list[ir.Node]] = {}
    for node in reductions:
        key = _fold_key(b, node)
        if key is not None and key in at:
            at[key].append(node)
            continue
        runs.append([node])
        if key is not None:
            at[key] = runs[-1]
    return runs


def sum_lanes(b: KernelBuilder, nodes: list[ir.Node], computed: dict[int, ir.Node]) -> list[Expr]:
    """The lane's results of sums `nodes` (one _fold_key) folded in one loop."""
    source = nodes[0].inputs[0]
    axes, keepdims, _ = _fold_key(b, nodes[0]) or ((), True, ())
    sums = reduction_loop(b, tuple(n.inputs[0] for n in nodes), list(axes), keepdims,
                          lambda block, accs, xs: tuple(a + x for a, x in zip(accs, xs)), (0.0,) * len(nodes),
                          computed=computed).lanes
    count = const(float(numel([static_shape(source)[a] for a in axes]) or 1), FLOAT)
    return [total / count if node.op_type != "ReduceSum" else total for node, total in zip(nodes, sums)]


@register_kernel(*sorted(REDUCTIONS))
def emit_reductions(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """One kernel for a group's sibling reductions (one signature: passes/fuse.py), each folded in turn
    for the output element, then the elementwise epilogue that reads them (an optimizer update)."""
    b = KernelBuilder.for_group(table, group, "reduction")
    b.take_group()  # kernels/schedules.py: a work-group per output for a long reduction
    if any(texture.format in MASK_FORMATS.values() for texture in b.out_textures):
        b.group_size = None  # an epilogue's saved mask: its bytes pair texels of two items (builder.py), no group
    reductions = [n for n in group.nodes if n.op_type in REDUCTIONS]
    members = {id(n) for n in group.nodes}
    computed = {id(view_root(r.inputs[0])): producer for r in reductions  # prologues: fuse.reduction_prologue
                if (producer := view_root(r.inputs[0]).producer()) is not None and id(producer) in members}
    env: dict[int, Expr] = {}
    for node in reductions + list(computed.values()):
        if node is not group.anchor:
            b.nodes.append(node.name)
    for nodes in fuse_sums(b, reductions):
        lanes = [reduction_lane(b, nodes[0], computed)] if len(nodes) == 1 else sum_lanes(b, nodes, computed)
        for node, lane in zip(nodes, lanes):
            env[id(node.outputs[0])] = b.body.let(lane, "red", dtype_of(node.outputs[0]))
    prologue = {id(n) for n in computed.values()}
    env = evaluate_chain(b, [n for n in group.nodes if n.op_type not in REDUCTIONS and id(n) not in prologue], env)
    return [b.finish([env[id(v)] for v in group.outputs])]
