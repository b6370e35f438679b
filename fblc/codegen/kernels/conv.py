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

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, TEXEL_INDEX, KernelBuilder, lane_axis
from fblc.codegen.cl import Kernel
from fblc.codegen.indexing import declare_index, index_var
from fblc.codegen.ir import INT, Block, Expr, Var, call, div_index, select
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.reads import ValueReads
from fblc.codegen.kernels.contraction_paths import (finish_group, reduce_guarded, reduce_into, reduce_lane, row_axis,
                                                    start_builder)
from fblc.codegen.kernels.texel import LANES, Blocked, Loop, Mask, Operand, Product, Reduction, Term, plus
from fblc.codegen.textures import TextureTable
from fblc.compiler import keys
from fblc.compiler.index_map import IndexMap, map_of, view_root
from fblc.compiler.values import attr, static_shape
from fblc.compiler.window import Window, window_of
from fblc.profiles.profile import PRIVATE_FLOATS

FLAT_TEXEL_INDEX, FLAT_INDEX = "f", "h"  # index prefixes of a flattened pointwise conv (texel, lane)
TAP_BLOCK = 16  # taps per static block when the masked axis has more than that (dY rows of a weight gradient)
CHANNEL_BLOCK = 4  # input channels per static block when the taps are unrolled
CHANNEL_TILE_LENGTH = 8  # the longest spatial row of a channel tile (4 rows of it per work-item)
STATIC_PRODUCTS = 1024  # a 2-D tile enumerates its row taps while a block keeps at most this many products


@dataclass
class ConvShape:
    """A Conv (or ConvTranspose) as its kernel reads it: x and w at strides xs and ws in the tensors that store
    them (a remapped view reads its root in place); the window runs from x's spatial axes to the output's."""

    x: ir.Value
    w: ir.Value
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    groups: int
    cg_in: int
    cg_out: int
    window: Window
    xs: tuple[int, ...]
    ws: tuple[int, ...]
    flat: bool = False  # the conv over its flattened spatial axes (flattened_pointwise)
    swapped: bool = False  # written [C, N, ..] (out_shape in that order): a weight gradient in W's own order


def conv_shape(node: ir.Node, swapped: bool = False) -> ConvShape:
    """`node` as its kernel reads it; `swapped`: its kernel writes the output with axes 0 and 1 exchanged
    (written_swapped)."""
    x, w = node.inputs[0], node.inputs[1]
    x_shape, w_shape, groups = static_shape(x), static_shape(w), int(attr(node, "group", 1))
    out_shape = static_shape(node.outputs[0])
    if swapped:
        out_shape = (out_shape[1], out_shape[0], *out_shape[2:])
    return ConvShape(view_root(x), view_root(w), x_shape, w_shape, out_shape, groups,
                     w_shape[1], w_shape[0] // groups, window_of(node, tuple(w_shape[2:])), map_of(x).strides,
                     map_of(w).strides, swapped=swapped)


def written_swapped(group: KernelGroup) -> bool:
    """Whether the conv of `group` writes its output as the Transpose of its axes 0 and 1 that the group holds
    (keys.WRITTEN_BY_PRODUCER, fuse.written_by: a weight gradient in W's own order), its work-items then
    running over that Transpose's elements."""
    output = group.anchor.outputs[0]
    return any(node.metadata_props.get(keys.REMAP) == keys.WRITTEN_BY_PRODUCER and node.inputs[0] is output
               for node in group.nodes[1:])


def _merged_stride(shape: Sequence[int], strides: Sequence[int]) -> int | None:
    """The stride of `shape`'s axes read as one axis, or None when they are not contiguous with each other or
    are a broadcast (stride 0: a mean's gradient, one element for the whole map, read by the general path)."""
    size = int(np.prod(shape))
    merged = IndexMap(tuple(shape), tuple(strides)).reshaped((size,))
    if merged is None or merged.folded or (merged.strides[0] == 0 and size > 1):
        return None
    return merged.strides[0] or 1  # one element: any stride reads it


@dataclass
class ConvTile:
    """The outputs of one work-item: `rows` output channels x `y_rows` consecutive positions along window axis
    `row_axis` (a 2-D tile) x `length` consecutive positions along window axis `axis` (None: no spatial axis
    varies) from a multiple of `multiple` (default `length`), lane = (row * y_rows + y_row) * length + position."""

    rows: int
    length: int
    axis: int | None
    multiple: int = 0
    row_step: int = 1  # output channels between consecutive rows
    batches: int = 1  # consecutive batch elements (the R-Tile register tile of a channel tile)
    y_rows: int = 1  # consecutive positions along row_axis
    row_axis: int | None = None
    channels: int = CHANNEL_BLOCK  # input channels per static block (fewer where a block's products would pass
    # STATIC_PRODUCTS: a weight gradient's long dY rows times its whole k x k map)

    def __post_init__(self) -> None:
        self.multiple = self.multiple or self.length

    @property
    def lanes(self) -> int:
        return self.batches * self.rows * self.y_rows * self.length


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
        if k_y * _block_products(cs, k, tile.lanes, tile.channels) <= STATIC_PRODUCTS:
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


def _block_products(cs: ConvShape, k: int, lanes: int, channels: int = CHANNEL_BLOCK) -> int:
    """Products of one static block of `channels` input channels over `k` taps along the masked axis, without
    a 2-D tile's row taps."""
    return (min(channels, cs.cg_in) * k if k <= TAP_BLOCK else TAP_BLOCK) * lanes


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


def conv_tile(cs: ConvShape, private: int = PRIVATE_FLOATS, device_items: int = 0) -> ConvTile | None:
    """The channel or spatial tile for a conv output (see the module docstring), or None; a 2-D weight
    gradient's tile within `private` accumulators (the target's Profile.private_floats). Where its taps
    outnumber dY's row (or dY's map is smaller than its taps) in whole blocks of 4 input channels, always: per
    lane a GPU would read 1.5 texels per multiply-add, the tile whole texels of 4 channels' maps, its padding
    taps dropped (MobileNetV2 [1,3,32,32]'s depthwise weight gradients on 2 x 2 and 1 x 1 maps: 0.2M image reads
    fewer a step). Where its channels go in blocks of fewer than 4, only if its tiles fill the device (`device_items`: Profile.device_items, 0 on a CPU): a GPU keeps those
    per lane, where they fill it."""
    spatial = [axis for axis, size in enumerate(cs.out_shape[2:]) if size > 1]
    if cs.cg_out % LANES == 0 and len(spatial) <= 1:
        length = cs.out_shape[2 + spatial[0]] if spatial else 1
        if length <= CHANNEL_TILE_LENGTH:
            return ConvTile(LANES, length, spatial[0] if spatial else None)
    stacks = cs.cg_out % LANES == 0 or (cs.cg_out == 1 and cs.out_shape[1] % LANES == 0)  # a depthwise one
    if stacks and len(spatial) == 2:  # a weight gradient's k x k taps: 4 channels' maps are consecutive texels
        y, x = spatial
        out_y, out_x, k = cs.out_shape[2 + y], cs.out_shape[2 + x], cs.window.kernel[x]
        lanes = LANES * out_y * out_x
        # rows wider than the kernel take the spatial or row path below, unless too short for both (a weight
        # gradient whose dY map is smaller than its taps: a last stage's 2 x 2 under 3 x 3 taps)
        short = lane_axis(cs.out_shape) is None and row_axis(cs.out_shape, first=2) is None
        channels = next((c for c in (CHANNEL_BLOCK, 2, 1) if _block_products(cs, k, lanes, c) <= STATIC_PRODUCTS), 0)
        fills = int(np.prod(cs.out_shape)) // lanes >= device_items
        whole_blocks = (k > out_x or short) and channels == CHANNEL_BLOCK
        if (whole_blocks or (k > out_x or short) and channels and fills) and out_x <= CHANNEL_TILE_LENGTH \
                and lanes <= private:
            return ConvTile(LANES, out_x, x, y_rows=out_y, row_axis=y, channels=channels)
    axis = lane_axis(cs.out_shape)
    if axis is not None and axis >= 2:
        return ConvTile(1, LANES * texels_per_item(cs.out_shape[axis] // LANES), axis - 2)
    return None


SWAPPED_ROWS = (4, 2, 1)  # output channels of a swapped conv's tile, the first that fits (they share x's reads)
SWAPPED_BATCHES = (8, 4, 2, 1)  # its input channels (x's batch elements), the most that fit with those rows


def swapped_tile(cs: ConvShape, private: int = PRIVATE_FLOATS, device_items: int = 0) -> ConvTile | None:
    """The tile of a conv written swapped (a weight gradient in W's own order [C_out, C_in, taps]): `rows`
    output channels (one row of the schedule's 2-D tile each), each `batches` consecutive input channels (x's
    batch axis, from a multiple of it) x every tap, consecutive outputs in that order filling whole texels. The
    rows share each x window, the batches and taps each dY row (the conv's weights). The most rows, then batches,
    within `private` accumulators whose tiles fill the device (`device_items`, 0 on a CPU), a 2-D one's only
    with a block of input channels within STATIC_PRODUCTS; None (per lane) where none fits or the taps' last
    axis is longer than a channel tile's row."""
    spatial = [axis for axis, size in enumerate(cs.out_shape[2:]) if size > 1]
    taps = int(np.prod(cs.out_shape[2:]))
    if len(spatial) > 2 or (spatial and cs.out_shape[2 + spatial[-1]] > CHANNEL_TILE_LENGTH):
        return None

    def blocks(lanes: int) -> int:  # input channels of a 2-D tile's static block within STATIC_PRODUCTS, or 0
        return next((c for c in (CHANNEL_BLOCK, 2, 1) if _block_products(cs, cs.window.kernel[spatial[-1]], lanes, c)
                     <= STATIC_PRODUCTS), 0) if len(spatial) == 2 else 1

    fits = [(rows, batches) for rows in SWAPPED_ROWS for batches in SWAPPED_BATCHES
            if cs.out_shape[0] % rows == 0 and cs.out_shape[1] % batches == 0 and (batches * taps) % LANES == 0
            and rows * batches * taps <= private and blocks(rows * batches * taps)]
    if not fits:
        return None
    rows, batches = next((fit for fit in fits if int(np.prod(cs.out_shape)) // (fit[0] * fit[1] * taps)
                          >= device_items), fits[-1])
    if not spatial:
        return ConvTile(rows, 1, None, batches=batches)
    x = spatial[-1]
    if len(spatial) == 1:
        return ConvTile(rows, cs.out_shape[2 + x], x, batches=batches)
    y = spatial[0]
    return ConvTile(rows, cs.out_shape[2 + x], x, batches=batches, y_rows=cs.out_shape[2 + y], row_axis=y,
                    channels=blocks(rows * batches * taps))


def texels_per_item(texels: int) -> int:
    """Texels a work-item of a spatial tile covers: the most (up to 5) that divide a row of `texels`."""
    return next(n for n in (5, 4, 3, 2, 1) if texels % n == 0)


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


def flattened_pointwise(cs: ConvShape) -> ConvShape:
    """The conv over its flattened spatial axes when they walk together, or `cs` itself: a 1x1 conv with stride
    1 and no padding (output pixel = input pixel: a longer row for the lanes) and a conv whose one output pixel
    sees the whole input (a 1x1 conv's weight gradient, whose kernel is the dY map: one run of taps)."""
    window = cs.window
    if len(window.kernel) < 2 or any(window.pads):
        return cs
    x_spatial = _merged_stride(cs.x_shape[2:], cs.xs[2:])
    w_spatial = _merged_stride(cs.w_shape[2:], cs.ws[2:])
    if x_spatial is None or w_spatial is None:
        return cs
    size = int(np.prod(window.in_spatial))
    if all(k == 1 for k in window.kernel) and all(s == 1 for s in window.strides):
        flat, kernel, out = Window((1,), (1,), (1,), (0,), (0,), (size,), (size,)), 1, size
    elif window.kernel == window.in_spatial and all(d == 1 for d in window.dilations):
        flat, kernel, out = Window((size,), (1,), (1,), (0,), (0,), (size,), (1,)), size, 1
    else:
        return cs
    return dataclasses.replace(cs, x_shape=(*cs.x_shape[:2], size), w_shape=(*cs.w_shape[:2], kernel),
                               out_shape=(*cs.out_shape[:2], out), window=flat, xs=(*cs.xs[:2], x_spatial),
                               ws=(*cs.ws[:2], w_spatial), flat=True)


def last_tap_axis(cs: ConvShape) -> int | None:
    return max((axis for axis, k in enumerate(cs.window.kernel) if k > 1), default=None)


def add_bias(b: KernelBuilder, node: ir.Node, acc: Expr) -> Expr:
    """`acc` plus the conv's bias at the output channel, if it has one."""
    return acc + b.channel(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else acc


def affine(index: Expr, scale: int, offset: int) -> Expr:
    """`index * scale + offset`, without the no-op parts."""
    return plus(index if scale == 1 else index * scale, offset)
