"""Windowed pooling kernels: AveragePool and MaxPool (with its optional Indices output).

Each lane owns one output element [n, c, *spatial] and walks its window with nested loops
whose bounds, strides, dilations and pads are literals (from `window_of`, so auto_pad is
already resolved). Taps that fall in the padding are skipped; the bounds test is left out on
axes where no window can leave the input. MaxPool's Indices has Y's shape, so the same kernel
writes both (one pass over the window gives the maximum and where it is). With ceil_mode the
last window may run past the padded input (the output shape says so); its taps there are
skipped like padding, and count_include_pad=1 does not count them (`_padded_taps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, div_index, float_literal, strides_of
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.textures import TextureTable
from fblc.errors import UnsupportedOpError
from fblc.compiler.values import attr, numel, static_shape
from fblc.compiler.window import Window, window_of

FAMILY = "pooling"


@dataclass
class Taps:
    """C names produced by `open_window`: per spatial axis the input coordinate, and the flat input index."""

    coords: list[str]
    flat: str
    closing: list[str]  # lines that close the loops, in order


def _needs_bounds(window: Window, axis: int) -> tuple[bool, bool]:
    """Whether a tap on `axis` can fall before the input start / past its end."""
    n, o = window.in_spatial[axis], window.out_spatial[axis]
    k, s, d = window.kernel[axis], window.strides[axis], window.dilations[axis]
    begin = window.pads_begin[axis]
    return begin > 0, (o - 1) * s - begin + (k - 1) * d >= n


def open_window(b: KernelBuilder, node: ir.Node, window: Window) -> Taps:
    """Emit the nested tap loops of the current output element; the caller emits the body then `closing`."""
    x_shape = static_shape(node.inputs[0])
    strides = strides_of(x_shape)
    spatial = len(window.kernel)
    base = b.temp("int", f"{OUT_INDEX}0 * {strides[0]} + {OUT_INDEX}1 * {strides[1]}", "base")
    coords: list[str] = []
    flat = base
    closing: list[str] = []
    for a in range(spatial):
        tap, coord = b.fresh("k"), b.fresh("p")
        start = f"{OUT_INDEX}{2 + a}" if window.strides[a] == 1 else f"{OUT_INDEX}{2 + a} * {window.strides[a]}"
        if window.pads_begin[a]:
            start = f"{start} - {window.pads_begin[a]}"
        step = tap if window.dilations[a] == 1 else f"{tap} * {window.dilations[a]}"
        indent = "  " * a
        b.emit(f"{indent}for (int {tap} = 0; {tap} < {window.kernel[a]}; ++{tap}) {{",
               f"{indent}  const int {coord} = {start} + {step};")
        low, high = _needs_bounds(window, a)
        tests = ([f"{coord} < 0"] if low else []) + ([f"{coord} >= {window.in_spatial[a]}"] if high else [])
        if tests:
            b.emit(f"{indent}  if ({' || '.join(tests)}) continue;")
        term = coord if strides[2 + a] == 1 else f"{coord} * {strides[2 + a]}"
        flat = f"{flat} + {term}"
        coords.append(coord)
        closing.insert(0, f"{indent}}}")
    name = b.fresh("src")
    b.emit(f"{'  ' * spatial}const int {name} = {flat};")
    return Taps(coords, name, closing)


def _inner(window: Window) -> str:
    return "  " * len(window.kernel)


def _check_rank(node: ir.Node) -> None:
    if len(static_shape(node.inputs[0])) < 3:
        raise UnsupportedOpError(f"{node.op_type} (node '{node.name}') needs an input [N, C, spatial...], got "
                                 f"{list(static_shape(node.inputs[0]))}", "reshape the input to N x C x spatial")


def _padded_taps(window: Window, axis: int) -> str | None:
    """C int: taps of the current window on `axis` inside the padded input, or None when that is
    the kernel size for every window (always, without ceil_mode).

    With ceil_mode the last window may run past the end padding; count_include_pad=1 then divides
    by the taps inside [-pads_begin, n + pads_end) only, as onnxruntime and torch do (and as
    `fblc.compiler.gradients.pooling.tap_counts` does for the backward).
    """
    n, o = window.in_spatial[axis], window.out_spatial[axis]
    k, s, d = window.kernel[axis], window.strides[axis], window.dilations[axis]
    room = n + window.pads_begin[axis] + window.pads_end[axis]  # padded length; window o starts at o * s
    if (o - 1) * s + (k - 1) * d + 1 <= room:
        return None
    start = f"{OUT_INDEX}{2 + axis}" if s == 1 else f"{OUT_INDEX}{2 + axis} * {s}"
    left = f"({room} - {start})"
    return f"min({k}, {left})" if d == 1 else f"min({k}, {div_index(f'({left} + {d - 1})', d)})"


@register_kernel("AveragePool")
def emit_average_pool(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Mean over the window; the divisor is the taps inside the input (count_include_pad=0) or
    inside the padded input (1): the kernel size, except for a ceil_mode window past the end."""
    node = group.anchor
    _check_rank(node)
    window = window_of(node)
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    acc, count = b.fresh("acc"), b.fresh("count")
    b.emit(f"float {acc} = 0.0f;", f"int {count} = 0;")
    taps = open_window(b, node, window)
    b.emit(f"{_inner(window)}{acc} += {b.load(node.inputs[0], taps.flat)};",
           f"{_inner(window)}++{count};", *taps.closing)
    if not int(attr(node, "count_include_pad", 0)):
        return [b.finish([f"({acc} / (float)max({count}, 1))"])]
    partial = [(a, _padded_taps(window, a)) for a in range(len(window.kernel))]
    full = numel([window.kernel[a] for a, taps_on_axis in partial if taps_on_axis is None])
    factors = [t for _, t in partial if t is not None]
    if not factors:
        return [b.finish([f"({acc} / {float_literal(float(full))})"])]
    divisor = b.temp("int", " * ".join(([str(full)] if full != 1 else []) + factors), "div")
    return [b.finish([f"({acc} / (float){divisor})"])]


@register_kernel("MaxPool")
def emit_max_pool(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Maximum over the window and, when read, its flat position in the unpadded input (ONNX Indices).

    Ties keep the first tap in row-major window order, as onnxruntime does; padding never wins.
    """
    node = group.anchor
    _check_rank(node)
    window = window_of(node)
    x_shape = static_shape(node.inputs[0])
    b = KernelBuilder(table, group.name, FAMILY, group.outputs)
    b.nodes.append(node.name)
    best, where = b.fresh("best"), b.fresh("arg")
    b.emit(f"float {best} = -INFINITY;", f"int {where} = -1;")
    taps = open_window(b, node, window)
    inner = _inner(window)
    b.emit(f"{inner}const float x = {b.load(node.inputs[0], taps.flat)};",
           f"{inner}if (x > {best} || {where} < 0) {{ {best} = x; {where} = {taps.flat}; }}", *taps.closing)
    index = where
    if int(attr(node, "storage_order", 0)) and len(x_shape) >= 4:
        # Column-major Indices: the last two spatial axes swap their strides.
        h, w = x_shape[-2], x_shape[-1]
        plane = b.temp("int", f"{where} - {where} % {h * w}", "plane")
        within = f"({where} % {h * w})"
        index = f"({plane} + ({within} % {w}) * {h} + {within} / {w})"
    results = []
    for out in group.outputs:
        results.append(best if out is node.outputs[0] else index)
    return [b.finish(results)]
