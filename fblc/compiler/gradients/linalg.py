"""Gradient rules of the contraction and normalisation ops: MatMul, Gemm, Conv, ConvTranspose, BatchNorm,
LayerNorm, InstanceNorm."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.autodiff import register_gradient
from fblc.errors import UnsupportedOpError
from fblc.compiler.graph import Emitter, attr, static_shape
from fblc.compiler.values import const_array
from fblc.compiler.window import Window, conv_transpose_pads, transpose_output_padding, window_of

Grads = Sequence["ir.Value | None"]


#: elements of an image texel (RGBA), along a conv output's channels where its kernel shares reads across them
RGBA = 4


def _swap_last_two(e: Emitter, x: ir.Value, rank: int) -> ir.Value:
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return e.op("Transpose", x, perm=perm)


@register_gradient("MatMul")
def matmul_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """dA = dY B^T, dB = A^T dY, summed over broadcast batch dims; 1-D operands are promoted like numpy."""
    a, b = node.inputs
    a_shape, b_shape = static_shape(a), static_shape(b)
    a2 = a_shape if len(a_shape) >= 2 else (1, a_shape[0])
    b2 = b_shape if len(b_shape) >= 2 else (b_shape[0], 1)
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    out2 = tuple(batch) + (a2[-2], b2[-1])
    dy = dys[0]
    if static_shape(node.outputs[0]) != out2:
        dy = e.reshape(dy, out2)
    a_view = a if a2 == a_shape else e.reshape(a, a2)
    b_view = b if b2 == b_shape else e.reshape(b, b2)
    da = db = None
    if need[0]:
        full = e.op("MatMul", dy, _swap_last_two(e, b_view, len(b2)))
        da = e.unbroadcast(full, tuple(batch) + a2[-2:], a2)
        da = da if a2 == a_shape else e.reshape(da, a_shape)
    if need[1]:
        if len(b2) == 2 and batch and tuple(a2[:-2]) == tuple(batch):
            db = _weight_grad_over_rows(e, a_view, dy, a2, out2)
        else:
            db = e.unbroadcast(e.op("MatMul", _swap_last_two(e, a_view, len(a2)), dy), tuple(batch) + b2[-2:], b2)
        db = db if b2 == b_shape else e.reshape(db, b_shape)
    return [da, db]


def _weight_grad_over_rows(e: Emitter, a: ir.Value, dy: ir.Value, a_shape: Sequence[int],
                           out_shape: Sequence[int]) -> ir.Value:
    """dB of Y = A B for a 2-D B under batched A: A's batch axes are more rows, so dB = A'^T dY' with
    A' = A as [rows, K] and dY' = dY as [rows, N]. One contraction that sums over the batch as it goes:
    no [batch, K, N] temporary reduced afterwards (at batch 1 that reduction was a copy)."""
    rows = int(np.prod(a_shape[:-1]))
    flat_a = e.reshape(a, [rows, a_shape[-1]])
    flat_dy = e.reshape(dy, [rows, out_shape[-1]])
    return e.op("MatMul", _swap_last_two(e, flat_a, 2), flat_dy)


@register_gradient("Gemm")
def gemm_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """Y = alpha A' B' + beta C with A' = A^T when transA (B' likewise)."""
    a, b = node.inputs[0], node.inputs[1]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    trans_a, trans_b = int(attr(node, "transA", 0)), int(attr(node, "transB", 0))
    dy = dys[0]
    da = db = dc = None
    if need[0]:
        da = (e.op("Gemm", dy, b, alpha=alpha, transB=1 - trans_b) if not trans_a
              else e.op("Gemm", b, dy, alpha=alpha, transA=trans_b, transB=1))
    if need[1]:
        db = (e.op("Gemm", a, dy, alpha=alpha, transA=1 - trans_a) if not trans_b
              else e.op("Gemm", dy, a, alpha=alpha, transA=1, transB=trans_a))
    if c is not None and need[2]:
        dc = e.unbroadcast(dy, static_shape(node.outputs[0]), static_shape(c))
        if beta != 1.0:
            dc = e.op("Mul", dc, e.scalar(beta, dc))
    return [da, db, dc][: len(node.inputs)]


@register_gradient("Conv")
def conv_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """dX by ConvTranspose; dW by a conv of X with dY as kernels (conv_weight_grad); dB by a sum."""
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    window = window_of(node)
    groups = int(attr(node, "group", 1))
    rank = len(static_shape(x)) - 2
    dy = dys[0]
    dx = dw = db = None
    if need[0]:
        dx = e.op("ConvTranspose", dy, w, group=groups, strides=list(window.strides),
                  dilations=list(window.dilations), pads=window.pads,
                  output_padding=transpose_output_padding(window), kernel_shape=list(window.kernel))
    if need[1]:
        dw = conv_weight_grad(e, x, dy, static_shape(w)[0], groups, window)
    if bias is not None and need[2]:
        db = e.reduce_sum(dy, [0] + list(range(2, 2 + rank)), keepdims=False)
    return [dx, dw, db][: len(node.inputs)]


@register_gradient("ConvTranspose")
def conv_transpose_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """ConvTranspose is the adjoint of the Conv from Y's shape to X's with the same weight, strides, dilations
    and pads: dX is that Conv of dY; dW is that Conv's weight gradient with X and dY in each other's roles."""
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    groups = int(attr(node, "group", 1))
    spatial_x, spatial_y = static_shape(x)[2:], static_shape(node.outputs[0])[2:]
    rank = len(spatial_x)
    kernel = tuple(attr(node, "kernel_shape") or static_shape(w)[2:])
    strides = tuple(attr(node, "strides") or [1] * rank)
    dilations = tuple(attr(node, "dilations") or [1] * rank)
    begins, ends = conv_transpose_pads(node)
    # output the input never reaches (an end below 0) is read by no tap: the Conv from Y stops before it
    ends = tuple(max(end, 0) for end in ends)
    window = Window(kernel, strides, dilations, begins, ends, tuple(spatial_y), tuple(spatial_x))
    reached = [(o + b + end - ((k - 1) * d + 1)) // s + 1
               for o, b, end, k, s, d in zip(spatial_y, begins, ends, kernel, strides, dilations)]
    if min(begins) < 0 or reached != list(spatial_x):
        raise UnsupportedOpError(f"ConvTranspose '{node.name}': output {list(spatial_y)} from input "
                                 f"{list(spatial_x)} needs pads {list(begins)} at the start, or leaves more than a "
                                 "stride of output no input reaches; its gradient rule does not cover that",
                                 "export it with pads >= 0 and output_padding < stride")
    pads = window.pads
    dy = dys[0]
    dx = dw = db = None
    if need[0]:
        dx = e.op("Conv", dy, w, group=groups, strides=list(window.strides), dilations=list(window.dilations),
                  pads=pads, kernel_shape=list(kernel))
    if need[1]:
        dw = conv_weight_grad(e, dy, x, static_shape(w)[0], groups, window)
    if bias is not None and need[2]:
        db = e.reduce_sum(dy, [0] + list(range(2, 2 + rank)), keepdims=False)
    return [dx, dw, db][: len(node.inputs)]


def conv_weight_grad(e: Emitter, x: ir.Value, dy: ir.Value, c_out: int, groups: int, window: Window) -> ir.Value:
    """dW[g, co, ci, tap] = sum over n and output pixels p of dY[n, g, co, p] * X[n, g, ci, p * s + tap * d - pad]:
    a conv over X's channels, its kernels dY's maps (stride and dilation swapped), read in place.

    With one group the batch is reduced inside that conv (X viewed [cg_in, n, ...] as its input
    channels, dY viewed [c_out, n, ...] as its kernels: no intermediate, no sum); where a run of
    n x output pixels is long, the codegen shares it across a work-group per register tile. With
    groups, each batch element's kernels stay apart (groups over batch x groups, [cg_in, n, c_out, k]
    summed over n afterwards): the group axis cannot also carry n.
    """
    n, c_in, *spatial = static_shape(x)
    rank = len(spatial)
    cg_in, cg_out = c_in // groups, c_out // groups
    inside = n if groups == 1 else 1
    apart = n // inside  # batch elements in groups of their own
    trailing = list(range(4, 4 + rank))  # the spatial axes after [apart, inside, groups, channels]
    x_view = e.reshape(e.op("Transpose", e.reshape(x, [apart, inside, groups, cg_in, *spatial]),
                            perm=[3, 0, 2, 1] + trailing), [cg_in, apart * groups * inside, *spatial])
    kernels = e.reshape(e.op("Transpose", e.reshape(dy, [apart, inside, groups, cg_out, *window.out_spatial]),
                             perm=[0, 2, 3, 1] + trailing), [apart * groups * cg_out, inside, *window.out_spatial])
    pointwise = all(k == 1 for k in window.kernel) and all(s == 1 for s in window.strides) and not any(window.pads)
    if groups == 1 and pointwise and (cg_in % RGBA == 0 or c_out % RGBA):
        # dW[co, ci] = sum over n, p of dY[n, co, p] * X[n, ci, p] is symmetric in X and dY, so dY is the conv's
        # input and X its kernels, and dW comes out in the weight's own order (the optimizer's update joins the
        # conv's epilogue: no transpose between them). Only where its output channels (ci) fill whole texels
        # as often as the other order's (co) do: a texel's 4 outputs then share their reads of dY and X.
        return e.op("Conv", kernels, x_view, strides=[1] * rank, dilations=[1] * rank, pads=[0] * (2 * rank))
    correlated = e.op("Conv", x_view, kernels, group=apart * groups, strides=list(window.dilations),
                      dilations=list(window.strides), pads=window.pads)
    k_full = [(size + pb + pe - s * (o - 1) - 1) // d + 1 for size, pb, pe, s, o, d in
              zip(spatial, window.pads_begin, window.pads_end, window.strides, window.out_spatial, window.dilations)]
    if groups == 1 and cg_in % RGBA == 0:
        # [cg_in, c_out, k..] to W's own order [c_out, cg_in, k..]: the conv's kernel writes it in that order
        # (keys.WRITTEN_BY_PRODUCER; its tile then takes 4 consecutive input channels), so the optimizer's update
        # reads it in its own order and joins that kernel's epilogue, where a view would be read one lane per fetch
        dw = e.op("Transpose", correlated, perm=[1, 0] + list(range(2, 2 + rank)))
        dw.producer().metadata_props[keys.REMAP] = keys.WRITTEN_BY_PRODUCER  # type: ignore[union-attr]
    elif apart > 1:  # summed over n in the weight's own order: the optimizer's update joins the sum's kernel
        per_group, taps = e.reshape(correlated, [cg_in, apart, groups, cg_out, *k_full]), list(range(4, 4 + rank))
        dw = e.reduce_sum(e.reshape(e.op("Transpose", per_group, perm=[2, 3, 0, 1] + taps),
                                    [c_out, cg_in, apart, *k_full]), [2], keepdims=False)
    else:
        per_group, taps = e.reshape(correlated, [cg_in, apart, groups, cg_out, *k_full]), list(range(4, 4 + rank))
        dw = e.reshape(e.op("Transpose", per_group, perm=[2, 3, 0, 1] + taps), [c_out, cg_in, *k_full])
    if list(k_full) != list(window.kernel):
        dw = e.op("Slice", dw, e.ints([0] * rank), e.ints(list(window.kernel)), e.ints(list(range(2, 2 + rank))))
    return dw


def _inverse_std(e: Emitter, var: ir.Value, epsilon: float) -> ir.Value:
    """1 / sqrt(var + epsilon); computed here when `var` is a constant (eval mode's running variance, not a
    step input), so that the step has no kernel for it."""
    known = None if var.is_graph_input() else const_array(var)
    if known is not None and np.issubdtype(known.dtype, np.floating):
        return e.const((1.0 / np.sqrt(known.astype(np.float64) + epsilon)).astype(known.dtype))
    return e.op("Reciprocal", e.op("Sqrt", e.op("Add", var, e.scalar(epsilon, var))))


def _channel_view(e: Emitter, vector: ir.Value, channels: int, rank: int) -> ir.Value:
    return e.reshape(vector, [1, channels] + [1] * (rank - 2))


@register_gradient("BatchNormalization")
def batch_norm_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """Eval mode (given statistics): y = (x - mean) * scale / sqrt(var + eps) + bias.

    mean and var have gradients too where something trainable computes them (a weight-standardised
    convolution exports its weight's statistics as ReduceMeans feeding them):
    dmean = -scale * inv_std * sum(dy), dvar = -scale * inv_std^2 / 2 * sum(dy * x_hat).
    """
    if int(attr(node, "training_mode", 0)):
        raise UnsupportedOpError(f"BatchNormalization in training mode (node '{node.name}') has no gradient rule",
                                 "fblc decomposes batch statistics itself with --bn-train; export in eval mode")
    x, scale, _, mean, var = node.inputs[:5]
    rank = len(static_shape(x))
    channels = static_shape(x)[1]
    epsilon = float(attr(node, "epsilon", 1e-5))
    inv_std = _inverse_std(e, var, epsilon)
    dy = dys[0]
    reduce_axes = [0] + list(range(2, rank))
    dx = dscale = dbias = dmean = dvar = None
    if need[0]:  # two per-element products: a [C] product of its own would be a launch of C work-items
        dx = e.op("Mul", e.op("Mul", dy, _channel_view(e, scale, channels, rank)),
                  _channel_view(e, inv_std, channels, rank))
    if need[1] or need[4]:
        x_hat = e.op("Mul", e.op("Sub", x, _channel_view(e, mean, channels, rank)),
                     _channel_view(e, inv_std, channels, rank))
        dscale = e.reduce_sum(e.op("Mul", dy, x_hat), reduce_axes, keepdims=False)
        if need[4]:
            dvar = e.op("Mul", dscale, e.op("Mul", e.op("Mul", scale, e.op("Mul", inv_std, inv_std)),
                                            e.scalar(-0.5, dy)))
    if need[2] or need[3]:
        dbias = e.reduce_sum(dy, reduce_axes, keepdims=False)
        if need[3]:
            dmean = e.op("Neg", e.op("Mul", dbias, e.op("Mul", scale, inv_std)))
    return [dx, dscale if need[1] else None, dbias if need[2] else None, dmean, dvar]


def _expose_outputs(node: ir.Node, count: int, shape: Sequence[int], dtype: ir.DataType, names: Sequence[str]) -> None:
    """Give a node its optional statistic outputs, so the backward reads them instead of recomputing."""
    if len(node.outputs) >= count and all(o.name for o in node.outputs[1:count]):
        return
    node.resize_outputs(count)
    for out, label in zip(node.outputs[1:count], names):
        if not out.name:
            out.name = f"{node.name}/{label}"
        out.shape = ir.Shape(list(shape))
        out.dtype = dtype


@register_gradient("LayerNormalization")
def layer_norm_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    x_shape = static_shape(x)
    rank = len(x_shape)
    axis = int(attr(node, "axis", -1)) % rank
    axes = list(range(axis, rank))
    stat_shape = [d if i < axis else 1 for i, d in enumerate(x_shape)]
    _expose_outputs(node, 3, stat_shape, ir.DataType.FLOAT, ["mean", "inv_std_dev"])
    mean, inv_std = node.outputs[1], node.outputs[2]
    if x.dtype != ir.DataType.FLOAT:
        mean, inv_std = e.op("Cast", mean, to=x.dtype), e.op("Cast", inv_std, to=x.dtype)
    dy = dys[0]
    x_hat = e.op("Mul", e.op("Sub", x, mean), inv_std)
    dx = dscale = dbias = None
    if need[0]:
        g = e.op("Mul", dy, scale)
        g_mean = e.op("ReduceMean", g, e.ints(axes), keepdims=1)
        gx_mean = e.op("ReduceMean", e.op("Mul", g, x_hat), e.ints(axes), keepdims=1)
        dx = e.op("Mul", inv_std, e.op("Sub", e.op("Sub", g, g_mean), e.op("Mul", x_hat, gx_mean)))
    if need[1]:
        dscale = e.unbroadcast(e.op("Mul", dy, x_hat), x_shape, static_shape(scale))
    if bias is not None and need[2]:
        dbias = e.unbroadcast(dy, x_shape, static_shape(bias))
    return [dx, dscale, dbias][: len(node.inputs)]


@register_gradient("InstanceNormalization")
def instance_norm_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """y = scale[c] * (x - mean) * inv_std + bias[c], statistics per (sample, channel) over the spatial axes.

    The op has no statistic outputs to expose (LayerNormalization's Mean and InvStdDev), so the
    backward recomputes them from x, which it saves anyway for x_hat: two reductions instead of
    two more saved tensors. dx is LayerNorm's formula with the per-channel scale.
    """
    x, scale = node.inputs[0], node.inputs[1]
    shape = static_shape(x)
    rank = len(shape)
    if rank < 3:
        raise UnsupportedOpError(f"InstanceNormalization of a rank-{rank} input (node '{node.name}') has no "
                                 "gradient rule", "give it an input [N, C, spatial...]")
    channels = shape[1]
    axes = e.ints(list(range(2, rank)))
    epsilon = float(attr(node, "epsilon", 1e-5))
    centred = e.op("Sub", x, e.op("ReduceMean", x, axes, keepdims=1))
    variance = e.op("ReduceMean", e.op("Mul", centred, centred), axes, keepdims=1)
    inv_std = e.op("Reciprocal", e.op("Sqrt", e.op("Add", variance, e.scalar(epsilon, x))))
    x_hat = e.op("Mul", centred, inv_std)
    dy = dys[0]
    summed_axes = [0] + list(range(2, rank))
    dx = dscale = dbias = None
    if need[0]:
        g = e.op("Mul", dy, _channel_view(e, scale, channels, rank))
        g_mean = e.op("ReduceMean", g, axes, keepdims=1)
        gx_mean = e.op("ReduceMean", e.op("Mul", g, x_hat), axes, keepdims=1)
        dx = e.op("Mul", inv_std, e.op("Sub", e.op("Sub", g, g_mean), e.op("Mul", x_hat, gx_mean)))
    if need[1]:
        dscale = e.reduce_sum(e.op("Mul", dy, x_hat), summed_axes, keepdims=False)
    if need[2]:
        dbias = e.reduce_sum(dy, summed_axes, keepdims=False)
    return [dx, dscale, dbias]
