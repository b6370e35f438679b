"""Reduction kernels: ReduceSum, ReduceMean, ReduceMax, ReduceL2, ReduceLogSumExp, GlobalAveragePool.

One work-item per output texel loops over the reduced elements of its four lanes (their count
and strides are literals). When the innermost reduced axes are a run of whole texels (the last
axes, a multiple of 4 long, of a plain tensor: rows, a BatchNorm gradient's maps) the loop reads
whole texels and folds their four lanes. When the kept axes after the last reduced one are a
multiple of 4 long (bias gradients, sums over the batch) the four lanes fold four consecutive
elements together: one texel read per step, in the per-texel prologue, where a per-lane fold
would read the same texel four times. Other trailing reduced runs (a BatchNorm gradient's maps of
49 x 30) loop over the runs, then along each, so index arithmetic comes once per run. A
reduction longer than the profile's serial limit (bias and norm-weight gradients over batch x
sequence, global pools of large maps) is shared by a work-group per output texel: each
work-item folds a strided share, and the partials merge in a tree in __local memory.
ReduceLogSumExp (also what split_softmax turns a softmax's row statistics into) folds twice:
the maximum, then the sum of exp(x - maximum).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, TEXEL_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, div_index, flat_index, mod_index, strides_of
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.kernels.texel import COMPONENTS
from fblc.codegen.textures import TextureTable
from fblc.compiler.index_map import map_of
from fblc.compiler.values import attr, ints_input, numel, static_shape


def reduced_axes(node: ir.Node) -> list[int]:
    rank = len(static_shape(node.inputs[0]))
    if node.op_type == "GlobalAveragePool":
        return list(range(2, rank))
    axes = ints_input(node, 1, "axes") if len(node.inputs) > 1 else None
    if axes is None:
        axes = attr(node, "axes")
    if not axes:
        return [] if attr(node, "noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a % rank for a in axes)


@dataclass(frozen=True)
class Folded:
    """A reduction's result: `name` as later fold templates refer to it (a float4 when the fold ran
    texel-wise in the per-texel prologue), `lane` as the lane loop reads it."""

    name: str
    lane: str


def texel_wise(b: KernelBuilder, shape: tuple[int, ...], axes: list[int]) -> bool:
    """True when each output texel's four lanes fold four consecutive source elements at every
    step: the kept axes after the last reduced one (a bias gradient's channels, a batch sum's
    features) are a multiple of 4 long, so the fold reads one whole texel per step instead of
    four texels per lane."""
    inner = numel(shape[axes[-1] + 1:]) if axes else 0
    return inner > 0 and inner % 4 == 0 and b.texels_per_item == 1


def _suffix_run(shape: list[int], axes: list[int]) -> tuple[int, int]:
    """(first axis, elements) of the longest run of trailing source axes that are all reduced
    (elements 0: the last axis is kept)."""
    run, axis = 1, len(shape) - 1
    while axis >= 0 and axis in axes:
        run, axis = run * shape[axis], axis - 1
    return axis + 1, run if axis < len(shape) - 1 else 0


def _loop_index(r: str, sizes: list[int], strides: list[int]) -> str:
    """C index of step `r` of a loop over `sizes` (row-major) whose axes move by `strides`."""
    loop_strides = strides_of(sizes)
    terms = []
    for k, (size, stride) in enumerate(zip(sizes, strides)):
        part = div_index(r, loop_strides[k])
        if k > 0:
            part = mod_index(part, size)
        terms.append((part, stride))
    return flat_index(terms)


def reduction_loop(b: KernelBuilder, source: ir.Value, axes: list[int], keepdims: bool, combine: str,
                   start: str, merge: str = "{a} + {b}", **earlier: Folded) -> Folded:
    """C that folds `source` over `axes` for the current output element.

    `combine` is a C template over `acc` and `x` (e.g. "acc + x") and the `earlier` folds by
    keyword; `merge` joins two partial accumulators `a` and `b`. With `b.group_size` the
    group's work-items fold every group_size-th step from their `lid`, then merge their
    partials in a tree in __local memory.
    """
    shape = static_shape(source)
    strides = strides_of(shape)
    kept = [a for a in range(len(shape)) if a not in axes]
    count = numel([shape[a] for a in axes])
    acc, r = b.fresh("acc"), b.fresh("r")
    group = b.group_size
    first, step = ("lid", str(group)) if group else ("0", "1")
    names = {key: fold.name for key, fold in earlier.items()}
    whole_texels = b.constant_scalar(source) is None and map_of(source).contiguous

    def base_of(prefix: str) -> str:
        return flat_index([(f"{prefix}{a if keepdims else kept.index(a)}", strides[a]) for a in kept])

    if whole_texels and texel_wise(b, shape, axes):  # in the prologue, from the texel's first element
        arg, texture = b.argument(source)
        offset = _loop_index(r, [shape[a] for a in axes], [strides[a] // 4 for a in axes])
        b.emit_texel(f"float4 {acc} = (float4)({start});",
                     f"for (int {r} = {first}; {r} < {count}; {r} += {step}) {{",
                     f"  const float4 x = {b.read_texel(arg, texture, f'(({base_of(TEXEL_INDEX)}) >> 2) + {offset}')};",
                     f"  {acc} = {combine.format(acc=acc, **names)};",
                     "}")
        if group:
            for lane in COMPONENTS:
                b.merge_across_group(f"{acc}.{lane}", merge, prologue=True)
        return Folded(acc, f"lane_f({acc}, lane)")
    base = b.temp("int", base_of(OUT_INDEX), "base")
    suffix, run = _suffix_run(shape, axes)
    if whole_texels and run and run % 4 == 0:  # the trailing reduced run as whole texels, their lanes folded in turn
        outer = [a for a in axes if a < suffix]
        sizes, texel_strides = [shape[a] for a in outer] + [run // 4], [strides[a] // 4 for a in outer] + [1]
        arg, texture = b.argument(source)
        texel = b.read_texel(arg, texture, f"({base} >> 2) + {_loop_index(r, sizes, texel_strides)}")
        b.emit(f"float {acc} = {start};",
               f"for (int {r} = {first}; {r} < {count // 4}; {r} += {step}) {{",
               f"  const float4 v = {texel};",
               *(f"  {{ const float x = v.{lane}; {acc} = {combine.format(acc=acc, **names)}; }}"
                 for lane in COMPONENTS),
               "}")
    elif whole_texels and run > 1:  # the trailing reduced run contiguous: index arithmetic once per run
        outer = [a for a in axes if a < suffix]
        inner = b.fresh("ri")
        deal_inner = group is None or run >= group or not outer  # deal out the longer loop to the group
        inner_first, inner_step = (first, step) if deal_inner else ("0", "1")
        row = base
        b.emit(f"float {acc} = {start};")
        if outer:  # a loop over the runs (one run alone needs none)
            row = b.fresh("row")
            outer_first, outer_step = ("0", "1") if deal_inner else (first, step)
            offset = _loop_index(r, [shape[a] for a in outer], [strides[a] for a in outer])
            b.emit(f"for (int {r} = {outer_first}; {r} < {count // run}; {r} += {outer_step}) {{",
                   f"const int {row} = {base} + {offset};")
        b.emit(f"for (int {inner} = {inner_first}; {inner} < {run}; {inner} += {inner_step}) {{",
               f"  const float x = {b.load(source, f'{row} + {inner}')};",
               f"  {acc} = {combine.format(acc=acc, **names)};",
               "}", *(["}"] if outer else []))
    else:
        index = _loop_index(r, [shape[a] for a in axes], [strides[a] for a in axes])
        b.emit(f"float {acc} = {start};",
               f"for (int {r} = {first}; {r} < {count}; {r} += {step}) {{",
               f"  const float x = {b.load(source, f'{base} + {index}' if axes else base)};",
               f"  {acc} = {combine.format(acc=acc, **names)};",
               "}")
    if group:
        b.merge_across_group(acc, merge)
    return Folded(acc, acc)


@register_kernel("ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "ReduceLogSumExp", "GlobalAveragePool")
def emit_reduce(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    axes = reduced_axes(node)
    keepdims = node.op_type == "GlobalAveragePool" or bool(attr(node, "keepdims", 1))
    b = KernelBuilder(table, group.name, "reduction", group.outputs)
    b.nodes.append(node.name)
    shape = static_shape(node.inputs[0])
    b.take_group()  # kernels/schedules.py: a work-group per output for a long reduction
    if node.op_type == "ReduceMax":
        acc = reduction_loop(b, node.inputs[0], axes, keepdims, "fmax({acc}, x)", "-INFINITY", "fmax({a}, {b})")
        return [b.finish([acc.lane])]
    if node.op_type == "ReduceLogSumExp":  # max first: exp(x - max) cannot overflow
        peak = reduction_loop(b, node.inputs[0], axes, keepdims, "fmax({acc}, x)", "-INFINITY", "fmax({a}, {b})")
        total = reduction_loop(b, node.inputs[0], axes, keepdims, "{acc} + exp(x - {peak})", "0.0f", peak=peak)
        # a row of -inf (every entry masked) has no finite maximum: its log-sum-exp is -inf
        return [b.finish([f"({peak.lane} == -INFINITY ? -INFINITY : {peak.lane} + log({total.lane}))"])]
    if node.op_type == "ReduceL2":  # with no axes (noop_with_empty_axes) this is |x|, as onnxruntime gives
        acc = reduction_loop(b, node.inputs[0], axes, keepdims, "fma(x, x, {acc})", "0.0f")
        return [b.finish([f"sqrt({acc.lane})"])]
    acc = reduction_loop(b, node.inputs[0], axes, keepdims, "{acc} + x", "0.0f").lane
    if node.op_type in ("ReduceMean", "GlobalAveragePool"):
        count = numel([shape[a] for a in axes]) or 1
        acc = f"({acc} / {float(count)}f)"
    return [b.finish([acc])]
