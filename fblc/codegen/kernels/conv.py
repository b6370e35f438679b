"""Conv kernels: a work-item's lanes reduce together (texel.py) where the output layout allows it.

A work-item holds 4 * texels_per_item consecutive flat outputs (the texture layout decides). Tiles, by
preference (conv_tile; kernels/schedules.py adds the register tiles):
- channel tile: 4 consecutive output channels x a whole short spatial row (at most 8; every other spatial extent
  1), where the autodiff's weight-gradient Conv lands (gradients/linalg.py: X viewed [Cg_in, N, ...], dY maps as
  its 'weights', kernel taps as its output rows): the 4 rows share the X window, each reads its own dY row (a
  2-D weight gradient's whole k x k map: docs/ARCHITECTURE.md §3).
- swapped tile (swapped_tile): the weight-gradient Conv written in W's own order [C_out, C_in, k..] on a CPU target
  (keys.WRITTEN_BY_PRODUCER): rows of output channels, each consecutive input channels' taps; W's update joins it.
- spatial tile: 4 to 20 consecutive positions along the innermost axis when its length is a multiple of 4
  (T-ResNet's [N, C, T, 1], image widths): the lanes share the weights and read their inputs as whole texels.
- row texels: an innermost axis of another length >= ROW_MIN: a texel within one row reduces like a spatial tile
  of 4 (at a runtime alignment), a texel across two rows per lane.
- per lane: each lane reduces alone in the builder's lane loop.
Under R-Tile codegen a work-item's register tile adds rows (docs/ARCHITECTURE.md §3, "Under `--layout rtile`").
Input channels go in blocks of 4 (2 or 1 where a 2-D tile's block would pass STATIC_PRODUCTS) with the taps of
the tiled (or last) spatial axis unrolled and masked at the input's borders, or, beyond TAP_BLOCK taps (dY rows),
the taps go in blocks of 16; the other spatial axes loop over their in-bounds tap range, which the lanes share,
except, on a GPU, the axis before the tiled one where the tile spans one position of it and the block stays within
STATIC_PRODUCTS (conv_schedules._enumerate_row_taps): its taps are enumerated and masked too, so a block's
weights are one run (channels x k x k) read once rather than two texels per channel at every tap-row trip.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, TEXEL_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel
from fblc.codegen.indexing import declare_index, index_var
from fblc.codegen.ir import INT, Block, Expr, Var, call, div_index, select
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.reads import ValueReads
from fblc.codegen.kernels.contraction_paths import finish_group, reduce_guarded, reduce_into, reduce_lane, start_builder
from fblc.codegen.kernels.conv_tiles import (STATIC_PRODUCTS, TAP_BLOCK, ConvShape, ConvTile, block_products,
                                             last_tap_axis)
from fblc.codegen.kernels.texel import Reduction, plus
from fblc.codegen.kernels.reduction_terms import Blocked, Loop, Mask, Operand, Product, Term
from fblc.codegen.textures import TextureTable
from fblc.compiler.window import Window

FLAT_TEXEL_INDEX, FLAT_INDEX = "f", "h"  # index prefixes of a flattened pointwise conv (texel, lane)


def conv_reduction(b: ValueReads, block: Block, cs: ConvShape, prefix: str, tile: ConvTile, masked: int | None
                    ) -> Reduction:
    """The conv's reduction over input channels and taps for the lanes of `tile` (`prefix` names the index
    variables of its first output): the taps of window axis `masked` (the tile's axis when it has one) in static
    blocks, masked at its borders; the other axes loop over their tap ranges (declared into `block`)."""
    window, xs, ws = cs.window, cs.xs, cs.ws
    n_axis, c_axis = (1, 0) if cs.swapped else (0, 1)  # the output axes of x's batch and of w's channels
    x_terms = [Term(index_var(prefix, n_axis), xs[0], tile.batches)] if cs.x_shape[0] > 1 else []
    group_rows = cs.groups > 1 and cs.cg_out == 1  # each of a channel tile's rows is a group of its own
    if cs.groups > 1:
        assert not cs.swapped, "a grouped conv is never written swapped (gradients/linalg.conv_weight_grad)"
        group = div_index(index_var(prefix, 1), cs.cg_out)
        x_terms.append(Term(group, cs.cg_in * xs[1], tile.rows if group_rows else 1))
    first_channel = tile.rows if tile.row_step == 1 else 1  # the first row's channel is a multiple of it
    w_terms = [Term(index_var(prefix, c_axis), ws[0], first_channel)] if cs.w_shape[0] > 1 else []
    x_offset, w_offset, loops = 0, 0, []
    for axis in (axis for axis in range(len(window.in_spatial)) if axis not in (masked, tile.row_axis)):
        k, s, d = window.kernel[axis], window.strides[axis], window.dilations[axis]
        n, o, pad = window.in_spatial[axis], window.out_spatial[axis], window.pads_begin[axis]
        x_step, w_step = xs[2 + axis], ws[2 + axis]
        if o == 1:  # a static origin and tap range
            low, high = max(0, -(-pad // d)), min(k, (n - 1 + pad) // d + 1)
            x_offset, w_offset = x_offset + (low * d - pad) * x_step, w_offset + low * w_step
            if high - low > 1:
                loops.append(Loop.over(block.var("k", INT), 0, high - low, d * x_step, w_step, high - low))
            continue
        origin = block.let(affine(index_var(prefix, 2 + axis), s, -pad), "y")
        x_terms.append(Term(origin, x_step))
        tap = block.var("k", INT)
        if pad > 0 or (o - 1) * s - pad + (k - 1) * d >= n:
            low, high = _tap_range(block, origin, k, d, n)
            loops.append(Loop.over(tap, low, high, d * x_step, w_step, k))
        elif k > 1:
            loops.append(Loop.over(tap, 0, k, d * x_step, w_step, k))
    if masked is None:  # no spatial taps to block: only channels
        (k, s, d, pad, x_step, w_step), mask, clamp = (1, 1, 1, 0, 0, 0), Mask([], 0, 0, 1), False
    else:
        walked = tile.length if masked == tile.axis else 1  # positions the tile covers along it
        mask, clamp = _tap_mask(window, masked, index_var(prefix, 2 + masked), walked,
                                tile.multiple if masked == tile.axis else 1, x_terms, xs[2 + masked])
        k, s, d = window.kernel[masked], window.strides[masked], window.dilations[masked]
        pad, x_step, w_step = window.pads_begin[masked], xs[2 + masked], ws[2 + masked]
    y, row_mask, row_taps, clamp_rows = tile.row_axis, None, range(1), False
    if y is not None:  # a 2-D tile's y_rows: their taps enumerated while a block stays within STATIC_PRODUCTS (the
        # rows then read each input row they share once), else (a weight gradient's dY rows) a loop, masked per tap
        k_y, d_y = window.kernel[y], window.dilations[y]
        row_mask, clamp_rows = _tap_mask(window, y, index_var(prefix, 2 + y), tile.y_rows, tile.y_rows, x_terms,
                                         xs[2 + y])
        if k_y * block_products(cs, k, tile.lanes, tile.channels) <= STATIC_PRODUCTS:
            row_taps = range(k_y)
        else:
            tap = block.var("k", INT)
            loops.append(Loop.over(tap, 0, k_y, d_y * xs[2 + y], ws[2 + y], k_y))
            row_mask = Mask(row_mask.terms + [Term(tap, d_y)], row_mask.low, row_mask.high + (k_y - 1) * d_y,
                            row_mask.extent)

    def product(lane: int, channel: int, tap: int, row_tap: int) -> Product:
        if cs.swapped:  # written [C, N, ..]: a row (output channel) holds its batch elements' taps
            row, rest = divmod(lane, tile.batches * tile.y_rows * tile.length)
            batch, rest = divmod(rest, tile.y_rows * tile.length)
        else:
            batch, rest = divmod(lane, tile.rows * tile.y_rows * tile.length)
            row, rest = divmod(rest, tile.y_rows * tile.length)
        y_row, step = divmod(rest, tile.length)
        position = (step * s if masked == tile.axis else 0) + tap * d - pad
        x_at = batch * xs[0] + (row * cs.cg_in if group_rows else 0) * xs[1] + channel * xs[1] + position * x_step
        w_at = row * tile.row_step * ws[0] + channel * ws[1] + tap * w_step
        if y is None:
            return Product(lane, x_at, w_at, position)
        row_position = y_row * window.strides[y] + row_tap * window.dilations[y] - window.pads_begin[y]
        return Product(lane, x_at + row_position * xs[2 + y], w_at + row_tap * ws[2 + y], position, row_position)

    lanes = range(tile.lanes)
    if k <= TAP_BLOCK:
        blocked = Blocked(cs.cg_in, min(tile.channels, cs.cg_in), xs[1], ws[1], 0, lambda channels: [
            product(lane, c, t, r) for c in channels for r in row_taps for t in range(k) for lane in lanes])
    else:
        if cs.cg_in > 1:
            loops.append(Loop.over(block.var("c", INT), 0, cs.cg_in, xs[1], ws[1], cs.cg_in))
        blocked = Blocked(k, TAP_BLOCK, d * x_step, w_step, d, lambda taps: [
            product(lane, 0, t, r) for t in taps for r in row_taps for lane in lanes])
    return Reduction(Operand(cs.x, x_terms, x_offset, clamp or clamp_rows), Operand(cs.w, w_terms, w_offset),
                     blocked, loops, mask, row_mask)


def _tap_mask(window: Window, axis: int, first: Var, walked: int, multiple: int, x_terms: list[Term],
              x_step: int) -> tuple[Mask, bool]:
    """(mask, clamp: the masked reads may leave the input) of window axis `axis` whose taps are enumerated: the
    tile's `walked` outputs along it start at `first` (a multiple of `multiple`; it joins `x_terms`)."""
    k, s, d = window.kernel[axis], window.strides[axis], window.dilations[axis]
    n, pad, length = window.in_spatial[axis], window.pads_begin[axis], window.out_spatial[axis]
    if length == walked:  # the tile starts at position 0
        mask = Mask([], 0, 0, n)
    else:
        mask = Mask([Term(first, s, multiple)], 0, (length - walked) * s, n)
        x_terms.append(Term(first, s * x_step, multiple))
    return mask, pad > 0 or mask.high + (walked - 1) * s - pad + (k - 1) * d >= n


def _tap_range(block: Block, origin: Var, k: int, d: int, n: int) -> tuple[Var, Var]:
    """(low, high) declared in `block`: the taps t in [low, high) with 0 <= origin + t * d < n."""
    if d == 1:
        return block.let(call("max", 0, -origin), "lo"), block.let(call("min", k, n - origin), "hi")
    # the numerators as non-negative indices (div_index); a non-positive one gives high 0, an empty range
    low = block.let(select(origin.lt(0), div_index(-origin + (d - 1), d), 0), "lo")
    return low, block.let(call("min", k, div_index(call("max", 0, n - origin + (d - 1)), d)), "hi")


def start_conv(table: TextureTable, group: KernelGroup) -> tuple[KernelBuilder, ConvPlan, str, str]:
    """A Conv's or ConvTranspose's builder, its plan, and its (texel, lane) index-variable prefixes. A flattened
    view declares its own lane variables, and its texel's where a texel-wide path reads them."""
    b = start_builder(table, group, "conv")
    plan: ConvPlan = b.schedule.detail
    b.numbering.count = max(b.numbering.count, plan.names_taken)
    if not plan.view.flat:
        return b, plan, TEXEL_INDEX, OUT_INDEX
    declare_index(b.body, plan.view.out_shape, b.flat, FLAT_INDEX)
    if plan.tile is not None or plan.row is not None:
        b.declare_item_index(b.prologue, plan.view.out_shape, FLAT_TEXEL_INDEX)
    return b, plan, FLAT_TEXEL_INDEX, FLAT_INDEX


@dataclass
class ConvPlan:
    """The geometry behind a Conv or ConvTranspose kernel's schedule (kernels/schedules.py decides it): the conv as
    its kernel sees it (`view`), the tile of its texel-wide path with the window axis whose taps are enumerated
    (`masked`), or of its row path (`row`), or neither (per lane). `names_taken`: the names a conv's trial
    reductions numbered, which the kernel skips (its text is then what was weighed)."""

    view: ConvShape
    tile: ConvTile | None = None
    masked: int | None = None
    row: ConvTile | None = None
    names_taken: int = 0


@register_kernel("Conv")
def emit_conv(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Direct convolution (and the autodiff's weight-gradient form, gradients/linalg.conv_weight_grad)."""
    b, plan, texel, lane = start_conv(table, group)
    view = plan.view

    def reduction(prefix: str, tile: ConvTile, masked: int | None) -> Callable[[Block], Reduction]:
        return lambda block: conv_reduction(b, block, view, prefix, tile, masked)

    # a row path's row taps enumerated (conv_schedules._enumerate_row_taps): its lanes' too, each lane's
    # weights of a block of channels one run read once, not two texels per channel and tap row
    row_axis = plan.row.row_axis if plan.row is not None and not b.table.profile.cpu else None
    per_lane = reduction(lane, ConvTile(1, 1, None, row_axis=row_axis), last_tap_axis(view))
    if plan.tile is not None:
        acc = reduce_into(b, reduction(texel, plan.tile, plan.masked), plan.tile.lanes)
    elif plan.row is not None:  # texels within one row reduce together, the ones across two per lane
        acc = reduce_guarded(b, within_row(view, texel, plan.row), reduction(texel, plan.row, plan.row.axis),
                             lambda block: reduce_lane(b, block, per_lane), plan.row.lanes)
    else:
        acc = reduce_into(b, per_lane, 1)
    return finish_group(b, group, add_bias(b, group.anchor, acc))


def within_row(cs: ConvShape, prefix: str, tile: ConvTile) -> Expr:
    """Whether a row path's tile (its first output's index variables named by `prefix`) ends within its row."""
    axis = 2 + tile.axis  # type: ignore[operator]
    return index_var(prefix, axis).le(cs.out_shape[axis] - tile.length)  # type: ignore[return-value]


def add_bias(b: KernelBuilder, node: ir.Node, acc: Expr) -> Expr:
    """`acc` plus the conv's bias at the output channel, if it has one."""
    return acc + b.channel(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else acc


def affine(index: Expr, scale: int, offset: int) -> Expr:
    """`index * scale + offset`, without the no-op parts."""
    return plus(index if scale == 1 else index * scale, offset)
