"""Reduction kernels: ReduceSum, ReduceMean, ReduceMax, ReduceL2, ReduceLogSumExp, GlobalAveragePool.

One work-item per output texel loops over the reduced elements of its four lanes (their count
and strides are literals). When they are a run of whole texels (the innermost axes, a multiple
of 4 long, of a plain tensor) the loop reads whole texels and folds their four lanes. A
reduction longer than the profile's serial limit (bias and norm-weight gradients over batch x
sequence, global pools of large maps) is shared by a work-group per output texel: each
work-item folds a strided share, and the partials merge in a tree in __local memory.
ReduceLogSumExp (also what split_softmax turns a softmax's row statistics into) folds twice:
the maximum, then the sum of exp(x - maximum).
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, div_index, flat_index, mod_index, strides_of
from fblc.codegen.kernels import KernelGroup, register_kernel
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


def reduction_loop(b: KernelBuilder, source: ir.Value, axes: list[int], keepdims: bool, combine: str,
                   start: str, merge: str = "{a} + {b}") -> str:
    """C that folds `source` over `axes` for the current output element; returns the accumulator name.

    `combine` is a C template over `acc` and `x` (e.g. "acc + x"); `merge` joins two partial
    accumulators `a` and `b`. With `b.group_size` the group's work-items fold every
    group_size-th element from their `lid`, then merge their partials in a tree in __local memory.
    """
    shape = static_shape(source)
    strides = strides_of(shape)
    kept = [a for a in range(len(shape)) if a not in axes]
    base_terms = [(f"{OUT_INDEX}{a if keepdims else kept.index(a)}", strides[a]) for a in kept]
    base = b.temp("int", flat_index(base_terms), "base")
    reduced_shape = [shape[a] for a in axes]
    count = numel(reduced_shape)
    loop_strides = strides_of(reduced_shape)
    acc = b.fresh("acc")
    r = b.fresh("r")
    terms = []
    for k, axis in enumerate(axes):
        part = div_index(r, loop_strides[k])
        if k > 0:
            part = mod_index(part, reduced_shape[k])
        terms.append((part, strides[axis]))
    index = f"{base} + {flat_index(terms)}" if terms else base
    group = b.group_size
    first, step = ("lid", str(group)) if group else ("0", "1")
    innermost = axes == list(range(len(shape) - len(axes), len(shape)))
    if innermost and count % 4 == 0 and b.constant_scalar(source) is None and map_of(source).contiguous:
        arg, texture = b.argument(source)
        texel = b.read_texel(arg, texture, f"({base} >> 2) + {r}")
        b.emit(f"float {acc} = {start};",
               f"for (int {r} = {first}; {r} < {count // 4}; {r} += {step}) {{",
               f"  const float4 v = {texel};",
               *(f"  {{ const float x = v.{lane}; {acc} = {combine.format(acc=acc)}; }}" for lane in "xyzw"),
               "}")
    else:
        b.emit(f"float {acc} = {start};",
               f"for (int {r} = {first}; {r} < {count}; {r} += {step}) {{",
               f"  const float x = {b.load(source, index)};",
               f"  {acc} = {combine.format(acc=acc)};",
               "}")
    if group:
        b.merge_across_group(acc, merge)
    return acc


@register_kernel("ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "ReduceLogSumExp", "GlobalAveragePool")
def emit_reduce(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    node = group.anchor
    axes = reduced_axes(node)
    keepdims = node.op_type == "GlobalAveragePool" or bool(attr(node, "keepdims", 1))
    b = KernelBuilder(table, group.name, "reduction", group.outputs)
    b.nodes.append(node.name)
    shape = static_shape(node.inputs[0])
    b.group_size = table.profile.reduction_group(numel([shape[a] for a in axes]))
    if node.op_type == "ReduceMax":
        acc = reduction_loop(b, node.inputs[0], axes, keepdims, "fmax({acc}, x)", "-INFINITY", "fmax({a}, {b})")
        return [b.finish([acc])]
    if node.op_type == "ReduceLogSumExp":  # max first: exp(x - max) cannot overflow
        peak = reduction_loop(b, node.inputs[0], axes, keepdims, "fmax({acc}, x)", "-INFINITY", "fmax({a}, {b})")
        total = reduction_loop(b, node.inputs[0], axes, keepdims, f"{{acc}} + exp(x - {peak})", "0.0f")
        # a row of -inf (every entry masked) has no finite maximum: its log-sum-exp is -inf
        return [b.finish([f"({peak} == -INFINITY ? -INFINITY : {peak} + log({total}))"])]
    if node.op_type == "ReduceL2":  # with no axes (noop_with_empty_axes) this is |x|, as onnxruntime gives
        acc = reduction_loop(b, node.inputs[0], axes, keepdims, "fma(x, x, {acc})", "0.0f")
        return [b.finish([f"sqrt({acc})"])]
    acc = reduction_loop(b, node.inputs[0], axes, keepdims, "{acc} + x", "0.0f")
    if node.op_type in ("ReduceMean", "GlobalAveragePool"):
        count = numel([shape[a] for a in axes]) or 1
        acc = f"({acc} / {float(count)}f)"
    return [b.finish([acc])]
