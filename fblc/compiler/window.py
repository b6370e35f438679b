"""Sliding-window geometry of Conv, ConvTranspose and pooling nodes, with auto_pad resolved."""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_ir as ir

from fblc.compiler.graph import attr, static_shape


@dataclass(frozen=True)
class Window:
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    in_spatial: tuple[int, ...]
    out_spatial: tuple[int, ...]

    @property
    def pads(self) -> list[int]:
        return list(self.pads_begin) + list(self.pads_end)


def window_of(node: ir.Node, kernel: tuple[int, ...] | None = None) -> Window:
    """The window of a Conv/pool node; `kernel` defaults to kernel_shape or the weight's spatial dims."""
    x_shape = static_shape(node.inputs[0])
    in_spatial = tuple(x_shape[2:])
    rank = len(in_spatial)
    if kernel is None:
        kernel = tuple(attr(node, "kernel_shape") or static_shape(node.inputs[1])[2:])
    strides = tuple(attr(node, "strides") or [1] * rank)
    dilations = tuple(attr(node, "dilations") or [1] * rank)
    out_spatial = tuple(static_shape(node.outputs[0])[2:])
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for n, k, s, d in zip(in_spatial, kernel, strides, dilations):
            total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
            small, large = total // 2, total - total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else large)
            end.append(large if auto_pad == "SAME_UPPER" else small)
        pads_begin, pads_end = tuple(begin), tuple(end)
    elif auto_pad == "VALID":
        pads_begin = pads_end = (0,) * rank
    else:
        pads = attr(node, "pads") or [0] * (2 * rank)
        pads_begin, pads_end = tuple(pads[:rank]), tuple(pads[rank:])
    return Window(tuple(kernel), strides, dilations, pads_begin, pads_end, in_spatial, out_spatial)


def conv_transpose_pads(node: ir.Node) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A ConvTranspose's pads, begin and end: its `pads`, or where auto_pad SAME_* or `output_shape` decide the
    output size, the ONNX spec's: total = s (n - 1) + output_padding + (k - 1) d + 1 - out, the smaller half
    first under SAME_UPPER, last otherwise (SAME_LOWER, or an output_shape alone). An end below 0 is output
    the input does not reach (as output_padding is)."""
    x_spatial, y_spatial = static_shape(node.inputs[0])[2:], static_shape(node.outputs[0])[2:]
    rank = len(x_spatial)
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "VALID":
        return (0,) * rank, (0,) * rank
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER") and attr(node, "output_shape") is None:
        pads = list(attr(node, "pads") or [0] * (2 * rank))
        return tuple(pads[:rank]), tuple(pads[rank:])
    kernel = tuple(attr(node, "kernel_shape") or static_shape(node.inputs[1])[2:])
    strides = attr(node, "strides") or [1] * rank
    dilations = attr(node, "dilations") or [1] * rank
    output_padding = attr(node, "output_padding") or [0] * rank
    totals = [s * (n - 1) + extra + (k - 1) * d + 1 - o for n, o, k, s, d, extra in zip(
        x_spatial, y_spatial, kernel, strides, dilations, output_padding)]
    begins = tuple(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2 for total in totals)
    return begins, tuple(t - b for t, b in zip(totals, begins))


def transpose_output_padding(window: Window) -> list[int]:
    """output_padding that makes ConvTranspose over this window give back the input's spatial size."""
    return [n - ((o - 1) * s + (k - 1) * d + 1 - pb - pe)
            for n, o, s, k, d, pb, pe in zip(window.in_spatial, window.out_spatial, window.strides, window.kernel,
                                             window.dilations, window.pads_begin, window.pads_end)]
