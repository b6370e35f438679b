"""A conv as its kernel reads it (ConvShape: a remapped view's root and strides, a pointwise conv's flattened
spatial axes) and the tile of outputs a work-item takes (ConvTile: conv_tile, swapped_tile), which conv.py's
reductions and conv_schedules.py's choices share; conv.py's docstring describes the tiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fblc.codegen.builder import lane_axis
from fblc.codegen.kernels import KernelGroup
from fblc.codegen.kernels.contraction_paths import row_axis
from fblc.codegen.kernels.texel import LANES
from fblc.compiler import keys
from fblc.compiler.index_map import IndexMap, map_of, view_root
from fblc.compiler.values import attr, static_shape
from fblc.compiler.window import Window, window_of
from fblc.profiles.profile import PRIVATE_FLOATS

TAP_BLOCK = 16  # taps per static block when the masked axis has more than that (dY rows of a weight gradient)
CHANNEL_BLOCK = 4  # input channels per static block when the taps are unrolled
CHANNEL_TILE_LENGTH = 8  # the longest spatial row of a channel tile (4 rows of it per work-item)
STATIC_PRODUCTS = 1024  # a 2-D tile enumerates its row taps while a block keeps at most this many products
SWAPPED_ROWS = (4, 2, 1)  # output channels of a swapped conv's tile, the first that fits (they share x's reads)
SWAPPED_BATCHES = (8, 4, 2, 1)  # its input channels (x's batch elements), the most that fit with those rows


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


def block_products(cs: ConvShape, k: int, lanes: int, channels: int = CHANNEL_BLOCK) -> int:
    """Products of one static block of `channels` input channels over `k` taps along the masked axis, without
    a 2-D tile's row taps."""
    return (min(channels, cs.cg_in) * k if k <= TAP_BLOCK else TAP_BLOCK) * lanes


def conv_tile(cs: ConvShape, private: int = PRIVATE_FLOATS, device_items: int = 0) -> ConvTile | None:
    """The channel or spatial tile for a conv output (see the module docstring), or None; a 2-D weight
    gradient's tile within `private` accumulators (the target's Profile.private_floats). Where its taps
    outnumber dY's row (or dY's map is smaller than its taps) in whole blocks of 4 input channels, always: per
    lane a GPU would read 1.5 texels per multiply-add, the tile whole texels of 4 channels' maps, its padding
    taps dropped (MobileNetV2 [1,3,32,32]'s depthwise weight gradients on 2 x 2 and 1 x 1 maps: 0.2M image reads
    fewer a step). Where its channels go in blocks of fewer than 4, only if its tiles fill the device
    (`device_items`: Profile.device_items, 0 on a CPU): a GPU keeps those
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
        channels = next((c for c in (CHANNEL_BLOCK, 2, 1) if block_products(cs, k, lanes, c) <= STATIC_PRODUCTS), 0)
        fills = int(np.prod(cs.out_shape)) // lanes >= device_items
        whole_blocks = (k > out_x or short) and channels == CHANNEL_BLOCK
        if (whole_blocks or (k > out_x or short) and channels and fills) and out_x <= CHANNEL_TILE_LENGTH \
                and lanes <= private:
            return ConvTile(LANES, out_x, x, y_rows=out_y, row_axis=y, channels=channels)
    axis = lane_axis(cs.out_shape)
    if axis is not None and axis >= 2:
        return ConvTile(1, LANES * texels_per_item(cs.out_shape[axis] // LANES), axis - 2)
    return None


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
        return next((c for c in (CHANNEL_BLOCK, 2, 1) if block_products(cs, cs.window.kernel[spatial[-1]], lanes, c)
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
