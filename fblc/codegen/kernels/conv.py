"""Conv and ConvTranspose kernels: texel-wide where the output layout allows it, per lane otherwise.

Texel-wide (see texel.py): the output's innermost non-unit axis has a length divisible by 4,
so a texel's lanes are 4 consecutive positions along it and share everything else.
- a spatial lane axis (T-ResNet [N, C, T, 1], images of width % 4 == 0): the lanes share the
  weights; their inputs are consecutive (stride 1) or interleaved (stride 2) elements of one
  input row, read as whole texels. The taps along that axis are unrolled, input channels
  go in blocks of 4, other spatial axes loop over their in-bounds tap range.
- the channel axis with 1x1 spatial output (the weight gradient of a 1x1 conv, which the
  autodiff writes as a Conv of X with dY rows grouped over the batch): the lanes share the
  input and read 4 weight rows.
Per lane (each lane reduces alone, inside the builder's lane loop): the same blocked
reduction along the last spatial axis with a kernel, reading its contiguous taps as texels
(e.g. the weight-gradient Conv with a kernel length that is not a multiple of 4, whose
'taps' are a 60-long dY row). A 1x1 conv with no texel-wide layout keeps the plain channel
loop of contraction.py, and so does a ConvTranspose without one.

Taps along the lane axis read zero outside the input through masks, in place of per-lane tap
ranges; the other spatial axes keep the ranges, shared by the lanes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, TEXEL_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, strides_of
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.kernels.contraction import (Stream, dot_loop, finish_group, index_terms, lane_axis, reduce_into,
                                              start_builder, zero_acc)
from fblc.codegen.kernels.texel import LANES, Blocked, Code, Loop, Mask, Operand, Product, Reduction, Term
from fblc.codegen.textures import TextureTable
from fblc.compiler.values import attr, static_shape
from fblc.compiler.window import Window, window_of

TAP_BLOCK = 16  # taps per static block when the masked axis has more than that (dY rows of a weight gradient)
CHANNEL_BLOCK = 4  # input channels per static block when the taps are unrolled
CHANNEL_TILE_LENGTH = 8  # the longest spatial row of a channel tile (4 rows of it per work-item)


@dataclass
class _ConvShape:
    x: ir.Value
    w: ir.Value
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    groups: int
    cg_in: int
    cg_out: int
    window: Window

    @property
    def xs(self) -> list[int]:
        return strides_of(self.x_shape)

    @property
    def ws(self) -> list[int]:
        return strides_of(self.w_shape)


def _conv_shape(node: ir.Node) -> _ConvShape:
    x, w = node.inputs[0], node.inputs[1]
    x_shape, w_shape = static_shape(x), static_shape(w)
    groups = int(attr(node, "group", 1))
    return _ConvShape(x, w, x_shape, w_shape, static_shape(node.outputs[0]), groups, w_shape[1],
                      w_shape[0] // groups, window_of(node, tuple(w_shape[2:])))


@dataclass
class _Tile:
    """The outputs of one work-item: `rows` consecutive output channels x `length` consecutive
    positions along window axis `axis` (None: no spatial axis varies), lane = row * length + position."""

    rows: int
    length: int
    axis: int | None

    @property
    def lanes(self) -> int:
        return self.rows * self.length


def _conv_reduction(b: KernelBuilder, code: Code, cs: _ConvShape, prefix: str, tile: _Tile, masked: int | None
                    ) -> Reduction:
    """The conv's reduction over input channels and taps for the lanes of `tile`.

    `masked` is the window axis whose taps are enumerated in static blocks, with masks at its
    borders (the tile's axis when it has one); the other axes loop over their tap ranges, which
    the lanes share. `prefix` names the index variables of the tile's first output.
    """
    window, xs, ws = cs.window, cs.xs, cs.ws

    def var(axis: int) -> str:
        return f"{prefix}{axis}"

    x_terms = [Term(var(0), xs[0])] if cs.x_shape[0] > 1 else []
    if cs.groups > 1:
        x_terms.append(Term(f"({var(1)} / {cs.cg_out})", cs.cg_in * xs[1]))
    w_terms = [Term(var(1), ws[0], tile.rows)] if cs.w_shape[0] > 1 else []
    x_offset, w_offset, loops = 0, 0, []
    for axis in range(len(window.in_spatial)):
        if axis == masked:
            continue
        k, s, d = window.kernel[axis], window.strides[axis], window.dilations[axis]
        n, o, pad = window.in_spatial[axis], window.out_spatial[axis], window.pads_begin[axis]
        x_step, w_step = xs[2 + axis], ws[2 + axis]
        if o == 1:  # a static origin and tap range
            low = max(0, -(-pad // d))
            high = min(k, (n - 1 + pad) // d + 1)
            x_offset += -pad * x_step + low * d * x_step
            w_offset += low * w_step
            if high - low > 1:
                tap = b.fresh("k")
                loops.append(Loop.over(tap, "0", str(high - low), d * x_step, w_step))
            continue
        origin = b.fresh("y")
        code.emit(f"const int {origin} = {_affine(var(2 + axis), s, -pad)};")
        x_terms.append(Term(origin, x_step))
        tap = b.fresh("k")
        if pad > 0 or (o - 1) * s - pad + (k - 1) * d >= n:
            low, high = b.fresh("lo"), b.fresh("hi")
            code.emit(*_tap_range(origin, low, high, k, d, n))
            loops.append(Loop.over(tap, low, high, d * x_step, w_step))
        elif k > 1:
            loops.append(Loop.over(tap, "0", str(k), d * x_step, w_step))
    if masked is None:  # no spatial taps to block: only channels
        k, s, d, pad, x_step, w_step, n = 1, 1, 1, 0, 0, 0, 1
        mask = Mask([], 0, 0, 1)
    else:
        k, s, d = window.kernel[masked], window.strides[masked], window.dilations[masked]
        n, pad, length = window.in_spatial[masked], window.pads_begin[masked], window.out_spatial[masked]
        x_step, w_step = xs[2 + masked], ws[2 + masked]
        walked = tile.length if masked == tile.axis else 1  # positions the tile covers along it
        if length == walked:  # the tile starts at position 0
            mask = Mask([], 0, 0, n)
        else:
            mask = Mask([Term(var(2 + masked), s, walked)], 0, (length - walked) * s, n)
            x_terms.append(Term(var(2 + masked), s * x_step, walked))
    spread = (tile.length - 1) * s if masked == tile.axis else 0
    clamp = pad > 0 or mask.high + spread - pad + (k - 1) * d >= n

    def product(lane: int, channel: int, tap: int) -> Product:
        row, step = divmod(lane, tile.length)
        position = (step * s if masked == tile.axis else 0) + tap * d - pad
        return Product(lane, channel * xs[1] + position * x_step, row * ws[0] + channel * ws[1] + tap * w_step,
                       position)

    x = Operand(cs.x, x_terms, x_offset, clamp)
    w = Operand(cs.w, w_terms, w_offset)
    lanes = range(tile.lanes)
    if k <= TAP_BLOCK:
        blocked = Blocked(cs.cg_in, min(CHANNEL_BLOCK, cs.cg_in), xs[1], ws[1], 0, lambda channels: [
            product(lane, c, t) for c in channels for t in range(k) for lane in lanes])
    else:
        if cs.cg_in > 1:
            loops.append(Loop.over(b.fresh("c"), "0", str(cs.cg_in), xs[1], ws[1]))
        blocked = Blocked(k, TAP_BLOCK, d * x_step, w_step, d, lambda taps: [
            product(lane, 0, t) for t in taps for lane in lanes])
    return Reduction(x, w, blocked, loops, mask)


def _conv_tile(cs: _ConvShape) -> _Tile | None:
    """The work-item tile for a conv output, or None when only per-lane code fits.

    Channel tiles (4 output channels x a short spatial row, at most CHANNEL_TILE_LENGTH) share
    the input: the weight gradients, whose rows are kernel taps. Spatial tiles (4 to 16
    positions along an innermost axis of length % 4 == 0) share the weights.
    """
    spatial = [axis for axis, size in enumerate(cs.out_shape[2:]) if size > 1]
    if cs.cg_out % LANES == 0 and len(spatial) <= 1:
        length = cs.out_shape[2 + spatial[0]] if spatial else 1
        if length <= CHANNEL_TILE_LENGTH:
            return _Tile(LANES, length, spatial[0] if spatial else None)
    axis = lane_axis(cs.out_shape)
    if axis is not None and axis >= 2:
        return _Tile(1, LANES * texels_per_item(cs.out_shape[axis] // LANES), axis - 2)
    return None


def texels_per_item(texels: int) -> int:
    """Texels a work-item of a spatial tile covers: the most (up to 5) that divide a row of `texels`."""
    return next(n for n in (5, 4, 3, 2, 1) if texels % n == 0)


def _tap_range(origin: str, low: str, high: str, k: int, d: int, n: int) -> list[str]:
    """Taps t in [low, high) with 0 <= origin + t * d < n."""
    if d == 1:
        return [f"const int {low} = max(0, -{origin});", f"const int {high} = min({k}, {n} - {origin});"]
    # C division truncates toward zero: a non-positive numerator gives high <= 0, an empty range
    return [f"const int {low} = {origin} < 0 ? (-{origin} + {d - 1}) / {d} : 0;",
            f"const int {high} = min({k}, ({n} - {origin} + {d - 1}) / {d});"]


@register_kernel("Conv")
def emit_conv(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Direct convolution (and the autodiff's weight-gradient form, group = N*G over [Cg_in, N*G, H, W])."""
    node = group.anchor
    cs = _conv_shape(node)
    b = start_builder(table, group, "conv")
    tile = _conv_tile(cs)
    if tile is not None:
        b.texels_per_item = tile.lanes // LANES
        masked = tile.axis if tile.axis is not None else _last_tap_axis(cs)
        acc = reduce_into(b, lambda code: _conv_reduction(b, code, cs, TEXEL_INDEX, tile, masked), tile.lanes)
    else:
        acc = reduce_into(b, lambda code: _conv_reduction(b, code, cs, OUT_INDEX, _Tile(1, 1, None),
                                                          _last_tap_axis(cs)), 1)
    _add_bias(b, node, acc)
    return finish_group(b, group, acc)


def _last_tap_axis(cs: _ConvShape) -> int | None:
    taps = [axis for axis, k in enumerate(cs.window.kernel) if k > 1]
    return taps[-1] if taps else None


def _add_bias(b: KernelBuilder, node: ir.Node, acc: str) -> None:
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        b.emit(f"{acc} += {b.load(node.inputs[2], f'{OUT_INDEX}1')};")


def _affine(var: str, scale: int, offset: int) -> str:
    """`var * scale + offset` as C, without the no-op parts."""
    text = var if scale == 1 else f"{var} * {scale}"
    return text if offset == 0 else f"{text} {'+' if offset > 0 else '-'} {abs(offset)}"


# ConvTranspose ------------------------------------------------------------------------------------

def _transpose_pads_begin(node: ir.Node, in_spatial: Sequence[int], out_spatial: Sequence[int],
                          kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]) -> list[int]:
    """Leading pads of a ConvTranspose: explicit `pads`, or derived from the output size as the ONNX spec says."""
    rank = len(in_spatial)
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad == "VALID":
        return [0] * rank
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") or attr(node, "output_shape") is not None:
        output_padding = attr(node, "output_padding") or [0] * rank
        begins = []
        for n, o, k, s, d, extra in zip(in_spatial, out_spatial, kernel, strides, dilations, output_padding):
            total = s * (n - 1) + extra + (k - 1) * d + 1 - o
            begins.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
        return begins
    return list((attr(node, "pads") or [0] * (2 * rank))[:rank])


@dataclass
class _TransposeShape:
    x: ir.Value
    w: ir.Value
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    groups: int
    cg_in: int
    cg_out: int
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: list[int]


def _transpose_shape(node: ir.Node) -> _TransposeShape:
    x, w = node.inputs[0], node.inputs[1]
    x_shape, w_shape, y_shape = static_shape(x), static_shape(w), static_shape(node.outputs[0])
    groups = int(attr(node, "group", 1))
    rank = len(x_shape) - 2
    kernel = tuple(attr(node, "kernel_shape") or w_shape[2:])
    strides = tuple(attr(node, "strides") or [1] * rank)
    dilations = tuple(attr(node, "dilations") or [1] * rank)
    pads = _transpose_pads_begin(node, x_shape[2:], y_shape[2:], kernel, strides, dilations)
    return _TransposeShape(x, w, x_shape, w_shape, y_shape, groups, w_shape[0] // groups, w_shape[1], kernel,
                           strides, dilations, pads)


def _transpose_taps(b: KernelBuilder, ts: _TransposeShape, prefix: str, axis: int) -> tuple[list[str], str, str]:
    """Lines entering the taps of spatial `axis` that hit an input pixel; the tap and input index variables.

    The output pixel o gets x[i] * w[t] for i * s = o + pad - t * d, 0 <= i < n. The lines
    open a tap loop (when k > 1) and an `if` on the conditions that can fail; every line
    ending in '{' opens a C block.
    """
    k, s, d = ts.kernel[axis], ts.strides[axis], ts.dilations[axis]
    n, pad, length = ts.x_shape[2 + axis], ts.pads[axis], ts.out_shape[2 + axis]
    shifted = f"({_affine(f'{prefix}{2 + axis}', 1, pad)})" if pad else f"{prefix}{2 + axis}"
    lines: list[str] = []
    tap, numerator = "0", shifted
    if k > 1:
        tap, numerator = b.fresh("k"), b.fresh("q")
        lines += [f"for (int {tap} = 0; {tap} < {k}; ++{tap}) {{",
                  f"const int {numerator} = {shifted} - {_affine(tap, d, 0)};"]
    conditions = []
    if pad - (k - 1) * d < 0:
        conditions.append(f"{numerator} >= 0")
    if s > 1:
        conditions.append(f"{numerator} % {s} == 0")
    if (length - 1 + pad) // s >= n:
        conditions.append(f"{numerator} < {n * s}")
    if conditions:
        lines.append(f"if ({' && '.join(conditions)}) {{")
    source = numerator
    if s > 1:
        source = b.fresh("y")
        lines.append(f"const int {source} = {numerator} / {s};")
    return lines, tap, source


def _transpose_reduction(b: KernelBuilder, ts: _TransposeShape, lane: int, lanes: int) -> Reduction:
    """Texel-wide ConvTranspose, `lanes` consecutive outputs along spatial `lane` (the stride divides
    4, so which taps a lane takes is a literal): input channels in blocks of 4, taps unrolled."""
    xs, ws = strides_of(ts.x_shape), strides_of(ts.w_shape)
    u = TEXEL_INDEX
    g = f"({u}1 / {ts.cg_out})"
    x_terms = ([Term(f"{u}0", xs[0])] if ts.x_shape[0] > 1 else []) + (
        [Term(g, ts.cg_in * xs[1])] if ts.groups > 1 else [])
    w_terms = ([Term(g, ts.cg_in * ws[0])] if ts.groups > 1 else []) + (
        [Term(f"({u}1 % {ts.cg_out})" if ts.groups > 1 else f"{u}1", ws[1])] if ts.cg_out > 1 else [])
    loops = []
    for axis in range(len(ts.kernel)):
        if axis != lane:
            lines, tap, source = _transpose_taps(b, ts, u, axis)
            loops.append(Loop(lines, [Term(source, xs[2 + axis])] if ts.x_shape[2 + axis] > 1 else [],
                              [Term(tap, ws[2 + axis])] if tap != "0" else []))
    k, s, d = ts.kernel[lane], ts.strides[lane], ts.dilations[lane]
    n, pad, length = ts.x_shape[2 + lane], ts.pads[lane], ts.out_shape[2 + lane]
    x_step, w_step = xs[2 + lane], ws[2 + lane]
    origin = f"({u}{2 + lane} / {s})" if s > 1 else f"{u}{2 + lane}"  # o / s: a multiple of 4 / s
    x_terms.append(Term(origin, x_step, lanes // s))
    mask = Mask([Term(origin, 1, lanes // s)], 0, (length - lanes) // s, n)

    def products(channels: range) -> list[Product]:
        found = []
        for c in channels:
            for t in range(k):
                for lane_index in range(lanes):
                    v = lane_index + pad - t * d  # o + v must be a multiple of s
                    if v % s == 0:
                        found.append(Product(lane_index, c * xs[1] + (v // s) * x_step, c * ws[0] + t * w_step, v // s))
        return found

    positions = [p.position for p in products(range(1))]
    clamp = min(positions) < 0 or mask.high + max(positions) >= n
    blocked = Blocked(ts.cg_in, min(CHANNEL_BLOCK, ts.cg_in), xs[1], ws[0], 0, products)
    return Reduction(Operand(ts.x, x_terms, 0, clamp), Operand(ts.w, w_terms), blocked, loops, mask)


@register_kernel("ConvTranspose")
def emit_conv_transpose(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Gather form: y[o] sums x[i] * w[t] over taps t with i * s = o + pad - t * d, i in range.

    The autodiff uses it for Conv's input gradient and AveragePool's gradient; output_padding
    only lengthens the (already static) output, so the loops ignore it.
    """
    node = group.anchor
    ts = _transpose_shape(node)
    b = start_builder(table, group, "conv")
    axis = lane_axis(ts.out_shape)
    if (axis is not None and axis >= 2 and LANES % ts.strides[axis - 2] == 0
            and ts.kernel[axis - 2] <= TAP_BLOCK):
        b.texels_per_item = texels_per_item(ts.out_shape[axis] // LANES)
        lanes = LANES * b.texels_per_item
        acc = reduce_into(b, lambda code: _transpose_reduction(b, ts, axis - 2, lanes), lanes)
    else:
        acc = _transpose_per_lane(b, ts)
    _add_bias(b, node, acc)
    return finish_group(b, group, acc)


def _transpose_per_lane(b: KernelBuilder, ts: _TransposeShape) -> str:
    """One lane, one output element: guarded tap loops around a dot product over input channels."""
    acc = zero_acc(b)
    xs, ws = strides_of(ts.x_shape), strides_of(ts.w_shape)
    g = f"({OUT_INDEX}1 / {ts.cg_out})" if ts.groups > 1 else "0"
    local = f"({OUT_INDEX}1 % {ts.cg_out})" if ts.groups > 1 else f"{OUT_INDEX}1"
    x_terms = index_terms([f"{OUT_INDEX}0", g], [ts.x_shape[0], ts.groups], [xs[0], ts.cg_in * xs[1]])
    w_terms = index_terms([g, local], [ts.groups, ts.cg_out], [ts.cg_in * ws[0], ws[1]])
    code = Code(b.lines)
    for axis in range(len(ts.kernel)):
        lines, tap, source = _transpose_taps(b, ts, OUT_INDEX, axis)
        for line in lines:
            if line.endswith("{"):
                code.open(line[:-1].rstrip())
            else:
                code.emit(line)
        if tap != "0":
            w_terms.append((tap, ws[2 + axis]))
        x_terms += index_terms([source], [ts.x_shape[2 + axis]], [xs[2 + axis]])
    depth = code.depth
    dot_loop(b, acc, ts.cg_in, (Stream(ts.x, x_terms, xs[1]), Stream(ts.w, w_terms, ws[0])), "  " * depth)
    while code.depth:
        code.close()
    return acc
