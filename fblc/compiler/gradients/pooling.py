"""Gradient rules of windowed pooling: AveragePool and MaxPool."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler.autodiff import register_gradient
from fblc.compiler.errors import UnsupportedOpError
from fblc.compiler.graph import Emitter, attr, numel, static_shape
from fblc.compiler.window import Window, transpose_output_padding, window_of

Grads = Sequence["ir.Value | None"]


def tap_counts(window: Window, include_pad: bool) -> np.ndarray:
    """Per output position: the AveragePool divisor, the count of window taps inside the input or,
    with `include_pad`, inside the padded input [-pads_begin, n + pads_end).

    With ceil_mode the last window can run past the padded input too; those taps count for
    neither, as onnxruntime and torch divide (the codegen kernel divides the same way).
    """
    per_axis = []
    for n, o, k, s, d, pb, pe in zip(window.in_spatial, window.out_spatial, window.kernel, window.strides,
                                     window.dilations, window.pads_begin, window.pads_end):
        low, high = (-pb, n + pe) if include_pad else (0, n)
        starts = np.arange(o) * s - pb
        taps = starts[:, None] + np.arange(k)[None, :] * d
        per_axis.append(((taps >= low) & (taps < high)).sum(axis=1))
    counts = per_axis[0]
    for axis_counts in per_axis[1:]:
        counts = np.multiply.outer(counts, axis_counts)
    return counts.astype(np.float64)


def covering(window: Window) -> Window:
    """The window with its end pads grown to cover every tap of the last window.

    Without ceil_mode that is the window itself. With it, the last window may reach past the
    padded input; ConvTranspose over the grown pads then crops those taps (they read no input)
    instead of needing a negative output_padding.
    """
    ends = tuple(max(pe, (o - 1) * s + (k - 1) * d + 1 - pb - n)
                 for n, o, k, s, d, pb, pe in zip(window.in_spatial, window.out_spatial, window.kernel,
                                                  window.strides, window.dilations, window.pads_begin,
                                                  window.pads_end))
    return dataclasses.replace(window, pads_end=ends)


@register_gradient("AveragePool")
def average_pool_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """dX = ConvTranspose(dY / divisor, ones) per channel; the divisor map is computed at compile time.

    ceil_mode needs nothing else: the output shape (the last window starts inside the input or
    its begin padding) is already the node's, and `tap_counts` / `covering` handle a last window
    that runs past the padded input.
    """
    x = node.inputs[0]
    window = window_of(node)
    channels = static_shape(x)[1]
    divisor = tap_counts(window, include_pad=bool(int(attr(node, "count_include_pad", 0))))
    scaled = e.op("Mul", dys[0], e.const(1.0 / divisor, dtype=x.dtype))
    ones = e.const(np.ones((channels, 1, *window.kernel)), dtype=x.dtype)
    grown = covering(window)
    dx = e.op("ConvTranspose", scaled, ones, group=channels, strides=list(grown.strides),
              dilations=list(grown.dilations), pads=grown.pads,
              output_padding=transpose_output_padding(grown), kernel_shape=list(grown.kernel))
    return [dx]


@register_gradient("MaxPool")
def max_pool_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """Scatter-add dY to the argmax positions, read from the forward's Indices output (exposed here).
    ScatterElements, not ScatterND: overlapping windows repeat an argmax, and onnxruntime's ScatterND add
    races on repeated indices when it uses several threads, while its ScatterElements adds in order."""
    if int(attr(node, "storage_order", 0)):
        raise UnsupportedOpError(f"MaxPool with storage_order=1 (node '{node.name}') has no gradient rule",
                                 "export with the default row-major storage order")
    x, y = node.inputs[0], node.outputs[0]
    if len(node.outputs) < 2 or not node.outputs[1].name:
        node.resize_outputs(2)
        indices = node.outputs[1]
        indices.name = f"{node.name}/argmax"
        indices.shape = ir.Shape(list(static_shape(y)))
        indices.dtype = ir.DataType.INT64
    indices = node.outputs[1]
    total = numel(static_shape(x))
    flat = e.op("ScatterElements", e.zeros([total], like=x), e.reshape(indices, [-1]),
                e.reshape(dys[0], [-1]), axis=0, reduction="add")
    return [e.reshape(flat, static_shape(x))]
