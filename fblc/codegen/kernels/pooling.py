"""Windowed pooling kernels: AveragePool and MaxPool (with its optional Indices output).

Each lane owns one output element and walks its window with literal loops, skipping taps in the padding
(or past a ceil_mode end); MaxPool writes Y and Indices from one pass; docs/ARCHITECTURE.md §3.
"""

from __future__ import annotations

import functools
import operator

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import strides_of
from fblc.codegen.ir import FLOAT, Block, Expr, Var, call, const, div_index, flat_index, mod_index
from fblc.codegen.kernels import lane_kernel, out_axis
from fblc.errors import UnsupportedOpError
from fblc.compiler.values import attr, numel, static_shape
from fblc.compiler.window import Window, window_of

FAMILY = "pooling"


def _window(node: ir.Node) -> Window:
    if len(static_shape(node.inputs[0])) < 3:
        raise UnsupportedOpError(f"{node.op_type} (node '{node.name}') needs an input [N, C, spatial...], got "
                                 f"{list(static_shape(node.inputs[0]))}", "reshape the input to N x C x spatial")
    return window_of(node)


def _window_start(window: Window, axis: int) -> Expr:
    """The current output element's first tap on spatial `axis`, before padding."""
    return flat_index([(out_axis(2 + axis), window.strides[axis])])


def open_window(b: KernelBuilder, node: ir.Node, window: Window) -> tuple[Block, Var]:
    """Build the nested tap loops of the current output element into b.body (taps in the padding
    skipped); returns the innermost block, where the caller builds the per-tap work, and the tap's
    flat input index."""
    strides = strides_of(static_shape(node.inputs[0]))
    block = b.body
    flat: Expr = block.let(out_axis(0) * strides[0] + out_axis(1) * strides[1], "base")
    for a, (n, k, d, begin) in enumerate(zip(window.in_spatial, window.kernel, window.dilations, window.pads_begin)):
        start = _window_start(window, a) - begin if begin else _window_start(window, a)
        with block.loop("k", 0, k) as (tap, taps):
            pass  # the loop's body is built below, as deep as the window has axes
        coord = taps.let(start + flat_index([(tap, d)]), "p")
        # whether a tap can fall before the input's start / past its end
        low, high = begin > 0, (window.out_spatial[a] - 1) * window.strides[a] - begin + (k - 1) * d >= n
        inside = ([coord.ge(0)] if low else []) + ([coord.lt(n)] if high else [])
        block = taps
        if inside:
            with taps.when(functools.reduce(Expr.logical_and, inside)) as within:
                block = within
        flat = flat + flat_index([(coord, strides[2 + a])])
    return block, block.let(flat, "src")


def _padded_taps(window: Window, axis: int) -> Expr | None:
    """Taps of the current window on `axis` inside the padded input, or None when that is the kernel
    size for every window (always, without ceil_mode).

    With ceil_mode the last window may run past the end padding; count_include_pad=1 then divides
    by the taps inside [-pads_begin, n + pads_end) only, as onnxruntime and torch do (and as
    `fblc.compiler.gradients.pooling.tap_counts` does for the backward).
    """
    n, o = window.in_spatial[axis], window.out_spatial[axis]
    k, s, d = window.kernel[axis], window.strides[axis], window.dilations[axis]
    room = n + window.pads_begin[axis] + window.pads_end[axis]  # padded length; window o starts at o * s
    if (o - 1) * s + (k - 1) * d + 1 <= room:
        return None
    left = const(room) - _window_start(window, axis)
    return call("min", const(k), left if d == 1 else div_index(left + (d - 1), d))


@lane_kernel(FAMILY, "AveragePool")
def emit_average_pool(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """Mean over the window; the divisor is the taps inside the input (count_include_pad=0) or
    inside the padded input (1): the kernel size, except for a ceil_mode window past the end."""
    window = _window(node)
    acc = b.body.mutable(const(0.0, FLOAT), "acc")
    count = b.body.mutable(const(0), "count")
    tap, flat = open_window(b, node, window)
    tap.assign(acc, b.element(node.inputs[0], flat), "+=")
    tap.assign(count, const(1), "+=")
    if not int(attr(node, "count_include_pad", 0)):
        return [acc / call("max", count, const(1)).cast(FLOAT)]
    partial = [(a, _padded_taps(window, a)) for a in range(len(window.kernel))]
    full = numel([window.kernel[a] for a, taps_on_axis in partial if taps_on_axis is None])
    factors = [t for _, t in partial if t is not None]
    if not factors:
        return [acc / const(float(full), FLOAT)]
    product = functools.reduce(operator.mul, factors[1:], factors[0] if full == 1 else const(full) * factors[0])
    return [acc / b.body.let(product, "div").cast(FLOAT)]


@lane_kernel(FAMILY, "MaxPool")
def emit_max_pool(b: KernelBuilder, node: ir.Node) -> list[Expr]:
    """Maximum over the window and, when read, its flat position in the unpadded input (ONNX Indices).

    Ties keep the first tap in row-major window order, as onnxruntime does; padding never wins.
    """
    window = _window(node)
    x_shape = static_shape(node.inputs[0])
    best = b.body.mutable(const(float("-inf"), FLOAT), "best")
    where = b.body.mutable(const(-1), "arg")
    tap, flat = open_window(b, node, window)
    x = tap.let(b.element(node.inputs[0], flat), "x")
    with tap.when(x.gt(best).logical_or(where.lt(0))) as better:
        better.assign(best, x)
        better.assign(where, flat)
    index: Expr = where
    if int(attr(node, "storage_order", 0)) and len(x_shape) >= 4:
        # Column-major Indices: the last two spatial axes swap their strides (where >= 0: a window
        # always holds a tap of the input).
        h, w = x_shape[-2], x_shape[-1]
        within = mod_index(where, h * w)
        plane = b.body.let(where - within, "plane")
        index = plane + mod_index(within, w) * h + div_index(within, w)
    return [best if out is node.outputs[0] else index for out in b.outputs]
