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


def transpose_output_padding(window: Window) -> list[int]:
    """output_padding that makes ConvTranspose over this window give back the input's spatial size."""
    return [n - ((o - 1) * s + (k - 1) * d + 1 - pb - pe)
            for n, o, s, k, d, pb, pe in zip(window.in_spatial, window.out_spatial, window.strides, window.kernel,
                                             window.dilations, window.pads_begin, window.pads_end)]
