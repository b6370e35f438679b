"""ConvTranspose kernels (Conv's input gradient, AveragePool's gradient), in gather form.

Output pixel o sums x[i] * w[t] over the taps t with i * s = o + pad - t * d, 0 <= i < n.
Texel-wide (see texel.py and conv.py) when the output's innermost non-unit axis is spatial with a length % 4 == 0
and its stride divides 4: a work-item's lanes (4 to 20) are consecutive positions along it, whose taps (which lane
takes which tap is then a literal) share the weights and read their inputs as whole texels. Rows of another
length >= ROW_MIN (texels_fit): the texels within one row do the same, the ones across two rows run per
lane. Output planes too small for either (a last stage's 2 x 2 maps) or whose axes do not fit: a plane tile, whole
planes of consecutive output channels (conv_schedules.plane_tile), every lane's taps literals. Under R-Tile codegen the register tiles of docs/ARCHITECTURE.md §3 ("Under `--layout rtile`"): output
channels' weights lie side by side in W [C_in, C_out / group, k...].
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.cl import Kernel
from fblc.codegen.indexing import index_var
from fblc.codegen.ir import FLOAT, INT, Block, Declare, Expr, If, Var, const, div_index, mod_index
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.kernels.contraction_paths import (Stream, dot_loop, finish_group, index_terms, reduce_guarded,
                                                    reduce_into, reduce_lane)
from fblc.codegen.kernels.conv import add_bias, affine, start_conv, within_row
from fblc.codegen.kernels.conv_tiles import CHANNEL_BLOCK, TAP_BLOCK, ConvShape, ConvTile
from fblc.codegen.kernels.conv_tiles import flattened_pointwise as flattened_conv
from fblc.codegen.kernels.texel import LANES, Reduction
from fblc.codegen.kernels.reduction_terms import Blocked, Loop, Mask, Operand, Product, Term
from fblc.codegen.reads import ValueReads
from fblc.codegen.textures import TextureTable
from fblc.compiler.index_map import row_major_strides as strides_of
from fblc.compiler.values import attr, static_shape
from fblc.compiler.window import Window, conv_transpose_pads, window_of


def _transpose_window(node: ir.Node) -> Window:
    """window_of's window with the ConvTranspose's own pads (conv_transpose_pads: auto_pad and output_shape
    resolved as the ONNX spec says)."""
    begins, ends = conv_transpose_pads(node)
    return dataclasses.replace(window_of(node), pads_begin=begins, pads_end=ends)


def transpose_shape(node: ir.Node) -> ConvShape:
    """A ConvTranspose as its kernel reads it: x [N, C_in, ...], w [C_in, C_out / group, k...]."""
    x, w = node.inputs[0], node.inputs[1]
    x_shape, w_shape, groups = static_shape(x), static_shape(w), int(attr(node, "group", 1))
    return ConvShape(x, w, x_shape, w_shape, static_shape(node.outputs[0]), groups, w_shape[0] // groups,
                          w_shape[1], _transpose_window(node), tuple(strides_of(x_shape)), tuple(strides_of(w_shape)))


def _transpose_taps(block: Block, ts: ConvShape, prefix: str, axis: int) -> Loop:
    """The taps of spatial `axis` that hit an input pixel, as a loop (when k > 1; its variables numbered by `block`)
    whose iterations enter an `if` on the conditions that can fail, X term the input index, W term the tap.
    Without dilation it walks only the taps t = o + pad (mod s), whose numerator s divides: a stride-2
    transpose's 3 taps are 1 or 2."""
    window = ts.window
    k, s, d = window.kernel[axis], window.strides[axis], window.dilations[axis]
    n, pad, length = window.in_spatial[axis], window.pads_begin[axis], window.out_spatial[axis]
    shifted = affine(index_var(prefix, 2 + axis), 1, pad)
    stepped = s > 1 and d == 1 and k > 1  # o + pad >= 0: its remainder is the first tap
    tap = block.var("k", INT) if k > 1 else None
    numerator: Expr = block.var("q", INT) if tap is not None else shifted
    source: Expr = block.var("y", INT) if s > 1 else numerator

    def enter(inner: Block) -> Block:
        if tap is not None:
            inner.add(Declare(numerator, shifted - affine(tap, d, 0)))  # type: ignore[arg-type]
        conditions = []
        if pad - (k - 1) * d < 0:
            conditions.append(numerator.ge(0))
        if s > 1 and not stepped:
            conditions.append(mod_index(numerator, s).eq(0))  # after '>= 0': a non-negative index
        if (length - 1 + pad) // s >= n:
            conditions.append(numerator.lt(n * s))
        if conditions:
            body: list = []
            inner.add(If(functools.reduce(lambda a, b: a.logical_and(b), conditions), body))
            inner = Block(inner.numbering, body)
        if s > 1:
            inner.add(Declare(source, div_index(numerator, s)))  # type: ignore[arg-type]
        return inner

    first, step = (mod_index(shifted, s), s) if stepped else (const(0), 1)
    return Loop([Term(source, ts.xs[2 + axis])] if n > 1 else [],
                [Term(tap, ts.ws[2 + axis])] if tap is not None else [], k, tap, first, const(k), step, enter)


def transpose_reduction(b: KernelBuilder | ValueReads, ts: ConvShape, u: str, tile: ConvTile) -> Reduction:
    """Texel-wide ConvTranspose, the `length` consecutive outputs of `tile` along its spatial `axis` from a multiple of
    its `multiple` (the stride divides it: which taps a lane takes is a literal; `u` names the first output's index
    variables): input channels in blocks of 4, taps unrolled. Its rows: the same positions of output channels
    `row_step` apart, and/or with `row_axis` (a stride-1 spatial axis, or any axis the tile walks whole: a plane
    tile) consecutive positions along it, whose taps are unrolled too; lane = (row * y_rows + y_row) * length +
    position."""
    lane, lanes, multiple, row_axis = tile.axis, tile.length, tile.multiple, tile.row_axis
    assert lane is not None, "a transpose's tile runs along a spatial axis"
    rows, y_rows, row_step = tile.rows, tile.y_rows, tile.row_step
    window, xs, ws = ts.window, ts.xs, ts.ws
    channel = index_var(u, 1)
    g = div_index(channel, ts.cg_out)
    # a depthwise tile's rows are consecutive groups from a multiple of the rows (channel_rows' across_groups)
    across = ts.groups > 1 and ts.cg_out == 1 and rows > 1
    first_group = tile.rows if across else 1
    x_terms = ([Term(index_var(u, 0), xs[0])] if ts.x_shape[0] > 1 else []) + (
        [Term(g, ts.cg_in * xs[1], first_group)] if ts.groups > 1 else [])
    # consecutive output channels (row_step 1) start at a multiple of the rows (channel_rows: cg_out is one of
    # rows * row_step; a plane tile's whole planes), so their weights, side by side in W, are whole texels (or
    # pairs of lanes of one: texel.fetch) at literal lanes, not windows
    first_channel = rows if row_step == 1 else 1
    w_terms = ([Term(g, ts.cg_in * ws[0], first_group)] if ts.groups > 1 else []) + (
        [Term(mod_index(channel, ts.cg_out) if ts.groups > 1 else channel, ws[1], first_channel)]
        if ts.cg_out > 1 else [])
    scratch = Block(b.numbering)  # numbers the tap loops' variables
    loops = [_transpose_taps(scratch, ts, u, axis) for axis in range(len(window.kernel))
             if axis not in (lane, row_axis)]
    k, s, d = window.kernel[lane], window.strides[lane], window.dilations[lane]
    n, pad, length = window.in_spatial[lane], window.pads_begin[lane], window.out_spatial[lane]
    x_step, w_step = xs[2 + lane], ws[2 + lane]
    origin = div_index(index_var(u, 2 + lane), s)  # o / s: a multiple of multiple / s
    if lanes == length:  # a plane tile walks the whole axis from 0: no runtime term (its reads' texels literals)
        mask = Mask([], 0, 0, n)
    else:
        x_terms.append(Term(origin, x_step, multiple // s))
        mask = Mask([Term(origin, 1, multiple // s)], 0, (length - lanes) // s, n)
    row_mask, row_taps, row_x, s_y = None, [(0, 0)], 0, 1  # (input row's numerator from the output row, W offset)
    if row_axis is not None:  # consecutive output rows from a multiple of y_rows: the tap's input row is
        # (row + pad - t * d) / s, a literal where the stride is 1 or the tile covers the whole axis (first is 0)
        first, k_y, d_y = index_var(u, 2 + row_axis), window.kernel[row_axis], window.dilations[row_axis]
        s_y = window.strides[row_axis]
        assert s_y == 1 or y_rows == window.out_spatial[row_axis], "a strided row axis is walked whole"
        if y_rows == window.out_spatial[row_axis]:  # walked whole from 0, as the lane axis above
            row_mask = Mask([], 0, 0, window.in_spatial[row_axis])
        else:
            row_mask = Mask([Term(first, 1, y_rows)], 0, window.out_spatial[row_axis] - y_rows,
                            window.in_spatial[row_axis])
            x_terms.append(Term(first, xs[2 + row_axis], y_rows))
        row_taps = [(window.pads_begin[row_axis] - t * d_y, t * ws[2 + row_axis]) for t in range(k_y)]
        row_x = xs[2 + row_axis]
    # the next tile row: row_step output channels on, or with `across` the next group
    channel_x, channel_w = (ts.cg_in * xs[1], ts.cg_in * ws[0]) if across else (0, row_step * ws[1])

    def products(channels: range) -> list[Product]:  # o + v must be a multiple of s (and of s_y along rows)
        return [Product((row * y_rows + y_row) * lanes + i,
                        c * xs[1] + row * channel_x + (v // s) * x_step + (y_row + row_tap) // s_y * row_x,
                        c * ws[0] + row * channel_w + t * w_step + w_row, v // s, (y_row + row_tap) // s_y)
                for c in channels for row_tap, w_row in row_taps for t in range(k) for i in range(lanes)
                for v in (i + pad - t * d,) if v % s == 0 for row in range(rows) for y_row in range(y_rows)
                if (y_row + row_tap) % s_y == 0]

    first_channel = products(range(1))
    positions, rows_at = [p.position for p in first_channel], [p.row_position for p in first_channel]
    clamp = min(positions) < 0 or mask.high + max(positions) >= n or (
        row_mask is not None and (min(rows_at) < 0 or row_mask.high + max(rows_at) >= row_mask.extent))
    blocked = Blocked(ts.cg_in, min(CHANNEL_BLOCK, ts.cg_in), xs[1], ws[0], 0, products)
    return Reduction(Operand(ts.x, x_terms, 0, clamp), Operand(ts.w, w_terms), blocked, loops, mask, row_mask)


@register_kernel("ConvTranspose")
def emit_conv_transpose(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Gather form; output_padding only lengthens the (already static) output, so the loops ignore it."""
    b, plan, texel, lane = start_conv(table, group)
    view = plan.view
    if plan.tile is not None:
        acc = reduce_into(b, lambda _: transpose_reduction(b, view, texel, plan.tile), plan.tile.lanes)
    elif plan.row is not None:  # texels within one row reduce together, the ones across two per lane
        row = plan.row
        acc = reduce_guarded(b, within_row(view, texel, row), lambda _: transpose_reduction(b, view, texel, row),
                             _lane_fallback(b, view, row, lane), row.lanes)
    else:
        acc = _transpose_per_lane(b, view, b.body, lane)
    return finish_group(b, group, add_bias(b, group.anchor, acc))


def weights_side_by_side(view: ConvShape) -> bool:
    """Whether a transpose's consecutive output channels have their weights side by side in W [C_in, C_out / group]
    (a pointwise one: ws[1] = 1), so a tile of rows by 4 of them reads whole weight texels (conv_schedules.channel_rows
    puts those first)."""
    return view.ws[1] == 1 and view.cg_out % LANES == 0


def texels_fit(ts: ConvShape, axis: int) -> bool:
    """Whether lanes along output `axis` (whose length 4 divides, or a row path's) may reduce texel-wide: the
    stride divides 4 and the length, so every texel starts at a multiple of it (4t - r * length is one) and
    which taps a lane takes is a literal; the taps, at most TAP_BLOCK, unroll."""
    stride = ts.window.strides[axis - 2]
    return LANES % stride == 0 and ts.out_shape[axis] % stride == 0 and ts.window.kernel[axis - 2] <= TAP_BLOCK


def flattened_pointwise(ts: ConvShape) -> ConvShape:
    """A 1x1 ConvTranspose with stride 1 and no padding over its flattened spatial axes (as conv_tiles.py flattens
    one), or `ts`: a transpose's whole-window taps are no contiguous run of taps."""
    pointwise = all(k == 1 for k in ts.window.kernel) and all(s == 1 for s in ts.window.strides)
    return flattened_conv(ts) if pointwise else ts


def _lane_fallback(b: KernelBuilder, ts: ConvShape, row: ConvTile, o: str) -> Callable[[Block], Expr]:
    """What a row path's lanes across two rows reduce with (`o` names their index variables): where the row
    path enumerates a depthwise transpose's row taps (stride 1 along both axes: conv_schedules._enumerate_row_taps)
    a one-lane tile of the same taps, whose k x k weights are one run read once as its covering texels; else
    the guarded tap loops, one weight element per tap."""
    stride = ts.window.strides[row.axis]  # type: ignore[index]
    if row.row_axis is None or row.rows != 1 or stride != 1 or b.table.profile.cpu:  # a CPU keeps its loops
        return lambda block: _transpose_per_lane(b, ts, block, o)
    lane = ConvTile(1, 1, row.axis, row_axis=row.row_axis)
    return lambda block: reduce_lane(b, block, lambda _: transpose_reduction(b, ts, o, lane))


def _transpose_per_lane(b: KernelBuilder, ts: ConvShape, block: Block, o: str) -> Var:
    """One lane, one output element (`o` names its index variables; in the lane loop's `block`): guarded
    tap loops around a dot product over input channels; returns the sum."""
    acc = block.mutable(const(0.0, FLOAT), "acc")
    channel = index_var(o, 1)
    g = div_index(channel, ts.cg_out) if ts.groups > 1 else const(0)
    local = mod_index(channel, ts.cg_out) if ts.groups > 1 else channel
    x_terms = index_terms([index_var(o, 0), g], [ts.x_shape[0], ts.groups], [ts.xs[0], ts.cg_in * ts.xs[1]])
    w_terms = index_terms([g, local], [ts.groups, ts.cg_out], [ts.cg_in * ts.ws[0], ts.ws[1]])
    loops = [_transpose_taps(block, ts, o, axis) for axis in range(len(ts.window.kernel))]
    dot_loop(b, acc, ts.cg_in, (Stream(ts.x, x_terms, ts.xs[1]), Stream(ts.w, w_terms, ts.ws[0])), block, loops)
    return acc
