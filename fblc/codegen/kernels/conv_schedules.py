"""The schedules of Conv and ConvTranspose (kernels/schedules.py registers them): which register tile a conv's
work-item computes (spatial texels, channel rows, 2-D rows, batch elements, the row path), within the target's
accumulators and by the device's size, told by a trial reduction of each candidate the work-group it would
really get; the emitters follow the ConvPlan they return."""

from __future__ import annotations


import dataclasses
import math
from typing import Any, Callable, Sequence

from fblc.codegen.builder import TEXEL_INDEX, lane_axis
from fblc.codegen.ir import Block
from fblc.codegen.kernels import KernelGroup
from fblc.codegen.kernels.contraction_paths import row_axis
from fblc.codegen.kernels.conv import FLAT_TEXEL_INDEX, ConvPlan, conv_reduction
from fblc.codegen.kernels.conv_tiles import (CHANNEL_BLOCK, STATIC_PRODUCTS, TAP_BLOCK, ConvShape, ConvTile, conv_shape,
                                             conv_tile, last_tap_axis, swapped_tile, texels_per_item, written_swapped)
from fblc.codegen.kernels.conv_tiles import flattened_pointwise as flattened_conv
from fblc.codegen.kernels.conv_transpose import texels_fit, transpose_reduction, transpose_shape, weights_side_by_side
from fblc.codegen.kernels.conv_transpose import flattened_pointwise as flattened_transpose
from fblc.codegen.kernels.texel import LANES, Reduction
from fblc.codegen.kernels.tile_budget import T, TileBudget, saved_masks
from fblc.codegen.reads import ValueReads
from fblc.codegen.schedule import Schedule, consecutive, reduction_choices
from fblc.codegen.schedule import tile as tile_of
from fblc.codegen.textures import TextureTable
from fblc.compiler.values import numel, static_shape
from fblc.compiler.window import Window

# A conv's register tile (R-Tile codegen; docs/ARCHITECTURE.md §3, "Under `--layout rtile`") within PRIVATE_FLOATS
# accumulators. A saved mask whose bytes it splits falls back to r_mask4 (schedule.pairs_mask_bytes): twice the
# mask's bits, 1/16 of the float tensor's, for 1/rows of the input reads.
CHANNEL_ROWS = (8, 4, 2)  # output channels of a conv's register tile, the first that fits
BATCH_ROWS = (8, 4, 2)  # batch elements of a channel tile's register tile, the first that fits
SPATIAL_ROWS = (4, 3, 2)  # output rows of a 2-D spatial tile where channels cannot stack
#: rows at least this long (no multiple of 4) take tiles of two texel columns on the row path: whole bytes of a
#: saved mask, more lanes sharing the weights, where most pairs lie within one row
PAIR_ROW = 16


def conv_schedule(table: TextureTable, group: KernelGroup) -> tuple[Schedule, ConvPlan, int]:
    """The conv's tile (see the module docstring) as the ConvPlan its emitter follows."""
    scratch = ValueReads(table, static_shape(group.outputs[0]))  # numbers the names of the trial reductions
    budget, view = TileBudget.of(table, group), flattened_conv(conv_shape(group.anchor, written_swapped(group)))
    if view.swapped:  # a weight gradient written in W's own order: its own tile, or per lane
        tile, row = swapped_tile(view, budget.private, budget.device_items), None
    else:
        tile, row = conv_tile(view, budget.private, budget.device_items), row_axis(view.out_shape, first=2)
    prefix = FLAT_TEXEL_INDEX if view.flat else TEXEL_INDEX

    def masked_of(candidate: ConvTile) -> int | None:
        return candidate.axis if candidate.axis is not None else last_tap_axis(view)

    def trial(candidate: ConvTile) -> Reduction:
        return conv_reduction(scratch, Block(scratch.numbering), view, prefix, candidate, masked_of(candidate))

    weighing = _tile_group(table, group, trial)
    if tile is not None and view.swapped:
        per_row = tile.lanes // tile.rows // LANES  # a row (output channel) of C_in x taps: stride apart
        schedule = tile_of(tile.rows, per_row, numel(view.out_shape[1:]) // LANES)
        schedule.choices["group_size"] = _group_sizes(table, group, tile, trial(tile))
        return schedule, ConvPlan(view, tile, masked_of(tile), names_taken=scratch.numbering.count), tile.lanes
    if tile is not None:
        if tile.rows == 1:  # a spatial tile: its texels along the row by the device's size
            tile = dataclasses.replace(tile, length=LANES * _spatial_texels(budget, view, tile, weighing),
                                       multiple=0)
        per = tile.lanes // LANES
        schedule = consecutive(per)
        masked = masked_of(tile)
        if tile.rows == 1:  # a spatial tile
            # where channels cannot stack (a depthwise conv): rows along the axis before, where its taps overlap
            k, s = view.window.kernel, view.window.strides
            schedule = _spatial_rows(budget, view, tile, lambda x: k[x] <= TAP_BLOCK and k[x - 1] > s[x - 1],
                                     weighing, across_groups=depthwise(view))
        else:  # a channel tile: batch elements in texels (batch_count) or as many as the sums form holds
            sums = _sums_batches(scratch, view, prefix, tile, masked, budget, weighing)
            if sums is None:
                tile = channel_rows_and_batches(budget, view, tile, weighing)
                per = tile.lanes // tile.batches // LANES
            else:
                tile.batches = sums
            if sums is None or sums > 1:
                schedule = tile_of(tile.batches, per, numel(view.out_shape[1:]) // LANES)  # one batch element apart
        schedule.choices["group_size"] = _group_sizes(table, group, tile, trial(tile))
        return schedule, ConvPlan(view, tile, masked, names_taken=scratch.numbering.count), tile.lanes
    if row is not None:
        tile, schedule = _row_texels(dataclasses.replace(budget, splits=False), view, row, 1, depthwise(view))
        schedule.choices["group_size"] = (1,)  # its reduction is its texels' own (reduce_guarded)
        return schedule, ConvPlan(view, row=tile), tile.lanes
    return consecutive(1), ConvPlan(view), 0


#: the work-items that would share a conv tile's reduction, given the tile and its count of tiles
TileSplit = Callable[[ConvTile, int], int | None]
#: a conv tile's texel fetches over its reduction in one work-item alone (Reduction.fetches)
TileFetches = Callable[[ConvTile], float]
#: a conv tile's multiply-adds in one work-item alone (its accumulators times their serial products)
TileWork = Callable[[ConvTile], float]
#: what TileBudget.pick weighs a conv tile by: (TileSplit, TileFetches, TileWork), the split None where its tiles
#: may not be split; all None on a CPU
Weighing = tuple[TileSplit | None, TileFetches | None, TileWork | None]
NO_WEIGHING: Weighing = (None, None, None)


def _tile_group(table: TextureTable, group: KernelGroup, reduction: Callable[[ConvTile], Reduction]
                ) -> Weighing:
    """What Profile.tile_group deals a conv tile's reduction (`reduction`: a trial one for a candidate tile, its
    multiply-adds per accumulator and the loop a group shares) out to, as reduce_into will, the texel fetches
    of that reduction in one work-item (by which TileBudget.pick weighs tiles where none fills the device: a
    larger tile with its reduction split reads each texel for more outputs) and its multiply-adds (with the
    fetches, the roofline that weighs tiles that fill it); the split None where its tiles may not be split
    (saved masks: one work-item a tile, weighed by its fetches alone); all None on a CPU (whose tiles keep
    their own rules: TileBudget)."""
    profile = table.profile
    if profile.cpu:
        return NO_WEIGHING
    known: dict[tuple[Any, ...], tuple[int, int, float]] = {}

    def trial(tile: ConvTile) -> tuple[int, int, float]:
        key = dataclasses.astuple(tile)
        if key not in known:
            reduced = reduction(tile)
            known[key] = (reduced.serial(tile.lanes), reduced.shared_loop()[1], reduced.fetches())
        return known[key]

    def split(tile: ConvTile, tiles: int) -> int | None:
        serial, trips, _ = trial(tile)
        return profile.tile_group(serial, trips, tile.lanes, tiles)

    return (None if saved_masks(group) else split, lambda tile: trial(tile)[2],
            lambda tile: float(trial(tile)[0] * tile.lanes))


def _group_sizes(table: TextureTable, group: KernelGroup, tile: ConvTile, reduction: Reduction) -> tuple[int, ...]:
    """The group sizes a conv `tile` whose `reduction` the emitter builds may take: up to the least power of two
    that leaves each work-item one iteration of the loop a group deals out (schedule.reduction_choices; 1 where
    it has none: more work-items would change nothing but their idle merge)."""
    trips = reduction.shared_loop()[1]
    return reduction_choices(table.profile, tile.lanes, bool(saved_masks(group)), trips)["group_size"]


def _tiles_of(split: TileSplit | None, tile_of_candidate: Callable[[T], ConvTile]
              ) -> Callable[[T, int], int | None] | None:
    """TileBudget.pick's `group` for candidates that `tile_of_candidate` makes conv tiles of."""
    return None if split is None else lambda candidate, tiles: split(tile_of_candidate(candidate), tiles)


def _picking(budget: TileBudget, candidates: Sequence[T], texels_per_item: Callable[[T], int],
             weighing: Weighing, tile_of_candidate: Callable[[T], ConvTile], fallback: Sequence[T] = ()) -> T:
    """TileBudget.pick of conv tile candidates (`tile_of_candidate` makes their conv tiles), weighed by the
    work-group each would get and its fetches (`weighing`: _tile_group's)."""
    split, fetches, work = weighing
    return budget.pick(candidates, texels_per_item, _tiles_of(split, tile_of_candidate), fallback,
                       None if fetches is None else lambda candidate: fetches(tile_of_candidate(candidate)),
                       None if work is None else lambda candidate: work(tile_of_candidate(candidate)))


def _sums_batches(b: ValueReads, cs: ConvShape, prefix: str, tile: ConvTile, masked: int | None,
                  budget: TileBudget, weighing: Weighing = NO_WEIGHING) -> int | None:
    """The batch elements of a channel tile whose outputs sum float4s along the reduction (the "sums" form),
    or None where it takes batch elements in texels instead (batch_count). The sums must be chosen for the tile
    alone; then the most batch elements (BATCH_ROWS, they share every weight read: a weight gradient's dY rows)
    whose outputs the sums form still holds (accumulators.sum_float4s), if they cost fewer instructions per
    product (loads included) than the batched tile's texels. A weight gradient of 3 or 5 taps on a CPU of
    float8 registers: 2 batch elements of 4 channels x the taps, each dY texel read once for twice the outputs
    (T-ResNet B=64 on PoCL: fewer texel reads per step and a faster step in images and in buffers)."""
    def trial(candidate: ConvTile) -> Reduction:
        return conv_reduction(b, Block(b.numbering), cs, prefix, candidate, masked)

    if trial(tile).accumulator_form(b, tile.lanes) != "sums":
        return None
    sums = [dataclasses.replace(tile, batches=n) for n in BATCH_ROWS  # R-Tile codegen only (naive: one element)
            if budget.tiled and cs.out_shape[0] % n == 0 and n * tile.lanes <= budget.private]
    single = next((c for c in sums if trial(c).accumulator_form(b, c.lanes) == "sums"), tile)
    batched = dataclasses.replace(tile, batches=batch_count(budget, cs.out_shape, tile, weighing))
    if batched.batches == 1 or trial(single).cost("sums") < trial(batched).cost("texels"):
        return single.batches
    return None


def conv_transpose_schedule(table: TextureTable, group: KernelGroup) -> tuple[Schedule, ConvPlan, int]:
    """The ConvTranspose's tile (see conv_transpose.py's docstring) as the ConvPlan its emitter follows."""
    budget, view = TileBudget.of(table, group), flattened_transpose(transpose_shape(group.anchor))
    axis, row, window = lane_axis(view.out_shape), row_axis(view.out_shape, first=2), view.window
    if axis is not None and axis >= 2 and texels_fit(view, axis):
        scratch = ValueReads(table, static_shape(group.outputs[0]))
        prefix = FLAT_TEXEL_INDEX if view.flat else TEXEL_INDEX
        weighing = _tile_group(table, group, lambda candidate: transpose_reduction(scratch, view, prefix, candidate))
        tile = ConvTile(1, LANES * _spatial_texels(budget, view, ConvTile(1, LANES, axis - 2), weighing), axis - 2)
        # where channels cannot stack (a depthwise conv's input gradient) rows along a stride-1 axis before
        schedule = _spatial_rows(budget, view, tile,
                                 lambda x: window.strides[x - 1] == 1 and window.kernel[x - 1] != 1, weighing,
                                 weights_side_by_side(view), depthwise(view), transposed=True)
        schedule.choices["group_size"] = _group_sizes(table, group, tile,
                                                      transpose_reduction(scratch, view, prefix, tile))
        return schedule, ConvPlan(view, tile), tile.lanes
    if row is not None and texels_fit(view, row[0]):
        tile, schedule = _row_texels(dataclasses.replace(budget, splits=False), view, row,
                                     window.strides[row[0] - 2], depthwise(view), transposed=True)
        schedule.choices["group_size"] = (1,)  # its reduction is its texels' own (reduce_guarded)
        return schedule, ConvPlan(view, row=tile), tile.lanes
    scratch = ValueReads(table, static_shape(group.outputs[0]))
    prefix = FLAT_TEXEL_INDEX if view.flat else TEXEL_INDEX
    tile = plane_tile(budget, view, _tile_group(table, group,
                                                lambda candidate: transpose_reduction(scratch, view, prefix, candidate)))
    if tile is not None:
        schedule = consecutive(tile.lanes // LANES)
        schedule.choices["group_size"] = _group_sizes(table, group, tile,
                                                      transpose_reduction(scratch, view, prefix, tile))
        return schedule, ConvPlan(view, tile, names_taken=scratch.numbering.count), tile.lanes
    return consecutive(1), ConvPlan(view), 0


def _taps_hit(window: Window, axis: int) -> int:
    """(output position, tap) pairs of a transpose's window axis `axis` that read an input pixel."""
    k, s, d = window.kernel[axis], window.strides[axis], window.dilations[axis]
    n, pad = window.in_spatial[axis], window.pads_begin[axis]
    return sum(1 for o in range(window.out_spatial[axis]) for t in range(k)
               for v in (o + pad - t * d,) if v % s == 0 and 0 <= v // s < n)


def plane_tile(budget: TileBudget, view: ConvShape, weighing: Weighing = NO_WEIGHING) -> ConvTile | None:
    """A transpose's plane tile, where its output rows take neither a spatial tile nor the row path (planes
    smaller than a texel row: a last stage's 2 x 2 maps; strides that do not divide 4): a work-item computes the
    whole output planes of `rows` consecutive channels of one batch element (consecutive texels: rows x plane
    elements, a multiple of 4), every lane's taps literals, the input planes read as whole texels. Of CHANNEL_ROWS
    (and 1) whose elements are whole texels, within the target's accumulators and STATIC_PRODUCTS products (of
    taps that hit, x input channels) per block, TileBudget.pick's (told by `split` the work-group each would
    really get); the fewest under naive. None where no plane fits (or more than two axes vary)."""
    window, spatial = view.window, len(view.window.kernel)
    if not 1 <= spatial <= 2 or any(k > TAP_BLOCK for k in window.kernel):
        return None
    plane, hits = numel(view.out_shape[2:]), math.prod(_taps_hit(window, axis) for axis in range(spatial))
    x, y = spatial - 1, (spatial - 2 if spatial == 2 else None)
    channels = min(CHANNEL_BLOCK, view.cg_in)
    fits = [rows for rows in (*CHANNEL_ROWS, 1) if view.cg_out % rows == 0 and rows * plane % LANES == 0
            and rows * plane <= budget.private and rows * hits * channels <= STATIC_PRODUCTS]
    if not fits:
        return None

    def tile(rows: int) -> ConvTile:
        return ConvTile(rows, view.out_shape[2 + x], x, y_rows=view.out_shape[2 + y] if y is not None else 1,
                        row_axis=y)

    rows = _picking(budget, fits, lambda rows: rows * plane // LANES, weighing, tile) if budget.tiled else fits[-1]
    return tile(rows)


def _spatial_texels(budget: TileBudget, view: ConvShape, tile: ConvTile, weighing: Weighing = NO_WEIGHING) -> int:
    """Texels along window axis `tile.axis` a spatial tile's work-item covers: of the counts up to
    conv_tiles.texels_per_item's (the most, up to 5, that divide a row) that divide the row, TileBudget.pick's,
    told by `split` the work-group each would really get."""
    axis = tile.axis
    row = view.out_shape[2 + axis] // LANES if axis is not None else 1
    most = texels_per_item(row)
    return _picking(budget, [n for n in range(most, 0, -1) if row % n == 0], lambda n: n, weighing,
                    lambda n: dataclasses.replace(tile, length=LANES * n, multiple=0))


def _spatial_rows(budget: TileBudget, view: ConvShape, tile: ConvTile, stacks: Callable[[int], bool],
                  weighing: Weighing = NO_WEIGHING, whole_rows: bool = False, across_groups: bool = False,
                  transposed: bool = False) -> Schedule:
    """The schedule of a spatial tile, whose rows it sets: under R-Tile codegen, the same positions of several
    output channels (channel_rows), or where none stack and `stacks(window axis x)`, the next output positions
    along the axis before, `stride` texels apart: of SPATIAL_ROWS that divide it within the target's accumulators
    and STATIC_PRODUCTS products (taps x input channels) per block, the one TileBudget.pick takes (told by
    `split` the work-group each would really get). They share input rows, (rows - 1) * stride + (taps - 1) *
    dilation + 1 of them read instead of rows * taps. With `across_groups` (a depthwise conv) where no output
    rows stack, rows by 4 of consecutive channels instead (channel_rows), whose weights are whole texels."""
    x, per, kernel = tile.axis, tile.length // LANES, view.window.kernel

    def rows_of(across: bool) -> tuple[int, int, int, int]:
        return channel_rows(budget, view.out_shape, view.cg_out, (per,), weighing,
                            lambda rows: dataclasses.replace(tile, rows=rows[0], row_step=rows[1]), whole_rows, across)

    tile.rows, tile.row_step, _, stride = rows_of(False)
    if tile.rows == 1 and budget.tiled and x and stacks(x):
        products = tile.lanes * kernel[x - 1] * kernel[x] * min(CHANNEL_BLOCK, view.cg_in)
        fits = [rows for rows in SPATIAL_ROWS if view.out_shape[1 + x] % rows == 0
                and rows * tile.lanes <= budget.private and rows * products <= STATIC_PRODUCTS]
        tile.y_rows = _picking(budget, [*fits, 1], lambda rows: rows * per, weighing,
                               lambda rows: dataclasses.replace(tile, y_rows=rows, row_axis=x - 1 if rows > 1 else None))
        tile.row_axis, stride = (x - 1 if tile.y_rows > 1 else None), numel(view.out_shape[2 + x:]) // LANES
    if across_groups and tile.y_rows == 1:
        tile.rows, tile.row_step, _, stride = rows_of(True)
    if budget.tiled and tile.y_rows == 1:
        _enumerate_row_taps(view, tile, transposed, budget.device_items > 0)
    return tile_of(tile.rows * tile.y_rows, per, stride)


def _enumerate_row_taps(view: ConvShape, tile: ConvTile, transposed: bool, gpu: bool) -> None:
    """Give a tile of one position along the window axis before its own that axis as `row_axis`: its taps are
    then enumerated in the block, not looped, so a row's weights for a block of input channels are one run
    (channels x k x k consecutive floats) read once, not two texels per channel at every trip of a loop over
    the tap rows. Rows by 4 consecutive channels of a depthwise conv from a multiple of 4 read them as whole
    texels at literal lanes; one channel (a plane no tile of consecutive channels lines up with: 25 x 15) or
    rows `row_step` apart as each run's covering texels, the middle ones whole (texel.fetch). Input channels
    go in blocks of 4, 2 or 1, the first within STATIC_PRODUCTS (none fits: the loop stays). A ConvTranspose
    only where depthwise and at stride 1 along the row axis (conv_transpose.transpose_reduction's row taps,
    blocks of 4). On a CPU (`gpu` False) only the depthwise rows by 4: its loops skip the taps outside the input
    at the borders, where masks read and zero them, and its reads are cached loads, not texel fetches (ResNet-4
    [4,3,64,64] in buffers on PoCL took 8 % longer with the other tiles' taps enumerated)."""
    x, kernel = tile.axis, view.window.kernel
    if not x or kernel[x - 1] == 1 or kernel[x] > TAP_BLOCK:
        return
    if not gpu and not (depthwise(view) and tile.rows % LANES == 0):
        return
    if transposed and (view.window.strides[x - 1] != 1 or not depthwise(view)):
        return
    products = kernel[x - 1] * kernel[x] * tile.lanes
    blocks = (CHANNEL_BLOCK,) if transposed else (CHANNEL_BLOCK, 2, 1)
    channels = next((c for c in blocks if products * min(c, view.cg_in) <= STATIC_PRODUCTS), 0)
    if channels:
        tile.row_axis, tile.channels = x - 1, channels


def channel_rows(budget: TileBudget, out_shape: Sequence[int], cg_out: int, choices: Sequence[int],
                 weighing: Weighing = NO_WEIGHING,
                 tile_of_rows: Callable[[tuple[int, int, int, int]], ConvTile] | None = None,
                 whole_rows: bool = False, across_groups: bool = False) -> tuple[int, int, int, int]:
    """(rows, row_step, columns, stride): a work-item of `columns` consecutive texels of one output channel
    (of `choices`, largest first) also computes the same positions of rows - 1 more channels of its
    group (cg_out), row_step apart: positions line up with texel columns only every 4 * columns /
    gcd(plane, 4 * columns) channels. Its rows are `stride` texels apart. Of the ones within the target's
    accumulators, TileBudget.pick's (`group`: the work-group a candidate's reduction would get); (1, 1, the
    last choice, 1) where none fits, or under naive: one channel. With `whole_rows` (a pointwise transpose:
    consecutive channels' weights side by side in W) rows by 4 of consecutive channels, whose weights are whole
    texels, come first, sharing their reduction in a work-group where their tiles alone leave the device idle;
    the other tiles are the fallback. With `across_groups` (a depthwise conv: one output channel a group) rows
    by 4 of consecutive channels from a multiple of 4, one group each: they share no input reads, but their
    weights and per-channel values are whole texels; only where positions line up with texel columns
    (row_step 1)."""
    plane = numel(out_shape[2:])
    fits = []
    if budget.tiled and across_groups:
        for columns in choices:
            if plane % (LANES * columns) == 0:
                fits += [(rows, 1, columns, plane // LANES) for rows in CHANNEL_ROWS if rows % LANES == 0
                         and out_shape[1] % rows == 0 and rows * columns * LANES <= budget.private]
    elif budget.tiled:
        for columns in choices:
            step = LANES * columns // math.gcd(plane, LANES * columns)
            stride = step * plane // LANES
            fits += [(rows, step, columns, stride) for rows in CHANNEL_ROWS
                     if cg_out % (rows * step) == 0 and rows * columns * LANES <= budget.private]
    rest = [*fits, (1, 1, choices[-1], 1)]
    whole = [fit for fit in fits if fit[1] == 1 and fit[0] % LANES == 0] if whole_rows else []
    if tile_of_rows is None:  # nothing to weigh them by
        weighing, tile_of_rows = NO_WEIGHING, lambda rows: ConvTile(rows[0], LANES * rows[2], None)
    if whole and weighing[0] is not None and budget.splits:
        return _picking(budget, whole, lambda tile: tile[0] * tile[2], weighing, tile_of_rows,
                        [fit for fit in rest if fit not in whole])
    return _picking(budget, rest, lambda tile: tile[0] * tile[2], weighing, tile_of_rows)


#: output channels of a channel tile without a spatial extent (a 1 x 1 map: a pointwise weight gradient whose dY and
#: x maps are the last stage's), largest first: 8 is two texels of channels sharing each x texel of the reduction
WIDE_CHANNEL_ROWS = (2 * LANES, LANES)


def channel_rows_and_batches(budget: TileBudget, view: ConvShape, tile: ConvTile,
                             weighing: Weighing = NO_WEIGHING) -> ConvTile:
    """A channel tile's output channels and batch elements (batch_count's), where its outputs have no spatial
    extent and a GPU weighs tiles (`weighing`): of WIDE_CHANNEL_ROWS that divide the conv's channel groups, each
    with its own batch count, TileBudget.pick's. Its rows share each x texel and its batch elements each weight
    texel: 8 rows x 8 batches read 16 texels per 4 reduction steps for 64 outputs where 4 x 8 read 12 for 32
    (MobileNetV2's last-stage 1 x 1 weight gradients: a third fewer texels fetched per step). Only where 4 rows
    fill the device: else 8 would share their reduction in a work-group, reading more in all. A row of outputs
    (tile.length > 1) keeps 4 rows; so does a CPU, and R-Tile codegen off."""
    wide = [rows for rows in WIDE_CHANNEL_ROWS if view.cg_out % rows == 0]
    if tile.length > 1 or not budget.tiled or weighing[1] is None or len(wide) < 2:
        return dataclasses.replace(tile, batches=batch_count(budget, view.out_shape, tile, weighing))
    candidates = [dataclasses.replace(tile, rows=rows) for rows in wide]
    candidates = [c for c in (dataclasses.replace(c, batches=batch_count(budget, view.out_shape, c, weighing))
                              for c in candidates) if c.lanes <= budget.private]
    if budget.texels // (candidates[-1].lanes // LANES) < budget.device_items:  # 4 rows leave the device idle:
        return candidates[-1]  # 8 would take a work-group's split, whose partial reads the roofline does not weigh
    return _picking(budget, candidates, lambda c: c.lanes // LANES, weighing, lambda c: c)


def batch_count(budget: TileBudget, out_shape: Sequence[int], tile: ConvTile,
                weighing: Weighing = NO_WEIGHING) -> int:
    """Batch elements a channel `tile`'s work-item computes under R-Tile codegen (they share every weight read;
    the weight gradient's batch axis is the input channels, sharing the dY reads): of BATCH_ROWS within the
    target's accumulators, TileBudget.pick's (told by `split` the work-group each would really get); 1 under
    naive."""
    lanes = tile.lanes // tile.batches
    fits = [batches for batches in BATCH_ROWS if out_shape[0] % batches == 0 and batches * lanes <= budget.private]
    return _picking(budget, [*fits, 1], lambda batches: batches * lanes // LANES, weighing,
                    lambda batches: dataclasses.replace(tile, batches=batches)) if budget.tiled else 1


def depthwise(view: ConvShape) -> bool:
    """Whether each output channel of the conv is a group of its own (a depthwise conv)."""
    return view.groups > 1 and view.cg_out == 1


def _row_texels(budget: TileBudget, view: ConvShape, row: tuple[int, int], multiple: int,
                across_groups: bool = False, transposed: bool = False) -> tuple[ConvTile, Schedule]:
    """A row path's tile (its texels start at a multiple of `multiple`) and schedule."""
    axis, length = row
    choices = (2, 1) if length >= PAIR_ROW else (1,)
    rows, step, columns, stride = channel_rows(budget, view.out_shape, view.cg_out, choices,
                                               across_groups=across_groups)
    tile = ConvTile(rows, LANES * columns, axis - 2, multiple, row_step=step)
    if budget.tiled:
        _enumerate_row_taps(view, tile, transposed, budget.device_items > 0)
    return tile, tile_of(rows, columns, stride)
