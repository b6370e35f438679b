"""Gradient rules of windowed pooling: AveragePool and MaxPool."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler.autodiff import register_gradient
from fblc.errors import UnsupportedOpError
from fblc.compiler.graph import Emitter, attr, static_shape
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


def tap_positions(window: Window) -> np.ndarray:
    """[taps, *out_spatial]: the plane-local flat input position that tap t of each window reads
    (row-major over the input's spatial dims), -1 where the tap falls in the padding."""
    grids = np.meshgrid(*[np.arange(o) for o in window.out_spatial], indexing="ij")
    positions = []
    for offsets in np.ndindex(*window.kernel):
        flat = np.zeros(window.out_spatial, dtype=np.int64)
        inside = np.ones(window.out_spatial, dtype=bool)
        for axis, (grid, k) in enumerate(zip(grids, offsets)):
            coordinate = grid * window.strides[axis] - window.pads_begin[axis] + k * window.dilations[axis]
            inside &= (coordinate >= 0) & (coordinate < window.in_spatial[axis])
            flat = flat * window.in_spatial[axis] + coordinate
        positions.append(np.where(inside, flat, -1))
    return np.stack(positions)


@register_gradient("MaxPool")
def max_pool_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """dY goes to each window's argmax (the forward's Indices output, exposed here), gathered per
    input element from the windows that cover it, never scattered: race-free and linear in size.

    For each tap t of the window, Where(Indices == the position tap t reads, dY, 0) is the share
    of dY that tap routes; the taps become channels ([N, C * taps, *out]) and one depthwise
    ConvTranspose with a one-hot kernel per tap puts each share back at its input position (the
    AveragePool gradient's ConvTranspose with a selecting kernel). Each input element then sums
    at most `taps` windows; a repeated argmax (overlapping windows) sums in ConvTranspose's fixed
    order. Indices count over the whole tensor (N and C included), so each plane's base offset
    is taken off first.
    """
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
    window = window_of(node)
    batch, channels = static_shape(x)[:2]
    out, taps = list(window.out_spatial), int(np.prod(window.kernel))
    plane = int(np.prod(window.in_spatial))
    base = (np.arange(batch * channels, dtype=np.int64) * plane).reshape(batch, channels, *[1] * len(out))
    local = e.op("Sub", indices, e.const(base))
    if _whole_plane(window):
        return [_whole_plane_grad(e, local, dys[0], static_shape(x))]
    local = e.reshape(local, [batch, channels, 1, *out])
    routes = e.op("Equal", local, e.const(tap_positions(window).reshape(1, 1, taps, *out)))
    shares = e.op("Where", routes, e.reshape(dys[0], [batch, channels, 1, *out]), e.scalar(0.0, x))
    stacked = e.reshape(shares, [batch, channels * taps, *out])
    selecting = np.zeros((channels * taps, 1, *window.kernel))
    for t, offsets in enumerate(np.ndindex(*window.kernel)):
        selecting[(slice(t, None, taps), 0, *offsets)] = 1.0
    grown = covering(window)
    dx = e.op("ConvTranspose", stacked, e.const(selecting, dtype=x.dtype), group=channels,
              strides=list(grown.strides), dilations=list(grown.dilations), pads=grown.pads,
              output_padding=transpose_output_padding(grown), kernel_shape=list(grown.kernel))
    return [dx]


def _whole_plane(window: Window) -> bool:
    """One window over the whole unpadded plane: GlobalMaxPool as lower_composites writes it."""
    return (all(o == 1 for o in window.out_spatial) and tuple(window.kernel) == tuple(window.in_spatial)
            and not any(window.pads_begin) and not any(window.pads_end))


def _whole_plane_grad(e: Emitter, local: ir.Value, dy: ir.Value, x_shape: Sequence[int]) -> ir.Value:
    """dX = dY where the plane position is the window's argmax, else 0: linear in the plane, with a
    constant of its positions only (the one-hot tap kernels of the general rule would be C x P^2)."""
    spatial = list(x_shape[2:])
    positions = np.arange(int(np.prod(spatial)), dtype=np.int64).reshape(1, 1, *spatial)
    return e.op("Where", e.op("Equal", local, e.const(positions)), dy, e.scalar(0.0, dy))
