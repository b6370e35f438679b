"""Gradient rules of windowed pooling: AveragePool and MaxPool."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler.autodiff import register_gradient
from fblc.compiler.errors import UnsupportedOpError
from fblc.compiler.graph import Emitter, attr, numel, static_shape
from fblc.compiler.window import Window, transpose_output_padding, window_of

Grads = Sequence["ir.Value | None"]


def _valid_counts(window: Window) -> np.ndarray:
    """Per output position: how many window taps fall inside the unpadded input."""
    per_axis = []
    for n, o, k, s, d, pb in zip(window.in_spatial, window.out_spatial, window.kernel, window.strides,
                                 window.dilations, window.pads_begin):
        starts = np.arange(o) * s - pb
        taps = starts[:, None] + np.arange(k)[None, :] * d
        per_axis.append(((taps >= 0) & (taps < n)).sum(axis=1))
    counts = per_axis[0]
    for axis_counts in per_axis[1:]:
        counts = np.multiply.outer(counts, axis_counts)
    return counts.astype(np.float64)


@register_gradient("AveragePool")
def average_pool_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """dX = ConvTranspose(dY / divisor, ones) per channel; the divisor map is computed at compile time."""
    if int(attr(node, "ceil_mode", 0)):
        raise UnsupportedOpError(f"AveragePool with ceil_mode (node '{node.name}') has no gradient rule",
                                 "export with ceil_mode=False")
    x = node.inputs[0]
    window = window_of(node)
    channels = static_shape(x)[1]
    if int(attr(node, "count_include_pad", 0)):
        divisor = np.full(window.out_spatial, float(numel(window.kernel)))
    else:
        divisor = _valid_counts(window)
    scaled = e.op("Mul", dys[0], e.const(1.0 / divisor, dtype=x.dtype))
    ones = e.const(np.ones((channels, 1, *window.kernel)), dtype=x.dtype)
    dx = e.op("ConvTranspose", scaled, ones, group=channels, strides=list(window.strides),
              dilations=list(window.dilations), pads=window.pads,
              output_padding=transpose_output_padding(window), kernel_shape=list(window.kernel))
    return [dx]


@register_gradient("MaxPool")
def max_pool_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """Scatter-add dY to the argmax positions, read from the forward's Indices output (exposed here)."""
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
    flat = e.op("ScatterND", e.zeros([total], like=x), e.reshape(indices, [-1, 1]),
                e.reshape(dys[0], [-1]), reduction="add")
    return [e.reshape(flat, static_shape(x))]
