"""Every kernel group's schedule (fblc/codegen/schedule.py), decided before any kernel is built (docs/ARCHITECTURE.md
§3, "Schedules are data"): SCHEDULE_RULES by anchor op type, else one texel per work-item. A family whose work-item
reduces outputs together (`_reducing`: MatMul, Gemm, Conv, ConvTranspose) offers its reduction's fields as choices
and hands its emitter its geometry (`detail`: ConvPlan).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

import onnx_ir as ir

from fblc.codegen.builder import TEXEL_INDEX, lane_axis
from fblc.codegen.ir import Block
from fblc.codegen.kernels import KernelGroup
from fblc.codegen.kernels.contraction import (Digits, matmul_operands, merged_rows, row_axis, texel_columns,
                                              tile_reduction)
from fblc.codegen.kernels.conv import (CHANNEL_BLOCK, FLAT_TEXEL_INDEX, STATIC_PRODUCTS, TAP_BLOCK, ConvPlan, ConvShape,
                                       ConvTile, conv_reduction, conv_shape, conv_tile, last_tap_axis, texels_per_item)
from fblc.codegen.kernels.conv import flattened_pointwise as flattened_conv
from fblc.codegen.kernels.conv_transpose import texels_fit, transpose_reduction, transpose_shape, weights_side_by_side
from fblc.codegen.kernels.conv_transpose import flattened_pointwise as flattened_transpose
from fblc.codegen.kernels.movement import transpose_block
from fblc.codegen.kernels.normalize import has_statistics, item_texels, layer_norm_geometry
from fblc.codegen.kernels.reduce import REDUCTIONS, reduced_axes
from fblc.codegen.kernels.texel import LANES, Reduction
from fblc.codegen.reads import ValueReads
from fblc.codegen.schedule import (Schedule, apply_overrides, consecutive, group_choices, pairs_mask_bytes,
                                   reduction_choices)
from fblc.codegen.schedule import tile as tile_of
from fblc.codegen.shape_key import shape_key
from fblc.codegen.textures import TextureTable
from fblc.compiler import keys
from fblc.compiler.index_map import common_digits, view_root
from fblc.compiler.values import attr, numel, static_shape
from fblc.errors import FblcError, UnsupportedOpError
from fblc.profiles.profile import PRIVATE_FLOATS, REDUCTION_GROUP
from fblc.texel_layout import TexelLayout, mask_layout

TILE_ROWS = (8, 4)  # output rows of a contraction's tile, the first that divides the output's rows
TILE_COLUMNS = 2  # texels: a tile is 8 x 8 outputs (64 accumulators, as mobile GEMM kernels keep)
#: a contraction tile's rows a schedule file may choose: one, or multiples of 4 (the emitters read A's
#: rows of a tile as whole texels from a row that is a multiple of 4)
ROW_CHOICES = (1, 4, 8, 16)
COLUMN_CHOICES = (1, 2, 4)  # its texel columns
# A conv's register tile (R-Tile codegen; docs/ARCHITECTURE.md §3, "Under `--layout rtile`") within PRIVATE_FLOATS
# accumulators. A saved mask whose bytes it splits falls back to r_mask4 (schedule.pairs_mask_bytes): twice the
# mask's bits, 1/16 of the float tensor's, for 1/rows of the input reads.
CHANNEL_ROWS = (8, 4, 2)  # output channels of a conv's register tile, the first that fits
BATCH_ROWS = (8, 4, 2)  # batch elements of a channel tile's register tile, the first that fits
SPATIAL_ROWS = (4, 3, 2)  # output rows of a 2-D spatial tile where channels cannot stack
#: rows at least this long (no multiple of 4) take tiles of two texel columns on the row path: whole bytes of a
#: saved mask, more lanes sharing the weights, where most pairs lie within one row
PAIR_ROW = 16
T = TypeVar("T")  # a candidate tile


@dataclass(frozen=True)
class TileBudget:
    """What a kernel's register tile is chosen within: R-Tile codegen or not (`tiled`: under naive, one texel
    row), the target's accumulators per work-item (`private`: Profile.private_floats), the work-items the
    device runs at once (`device_items`; 0 on a CPU, whose tiles keep their own rules), the kernel's output
    texels, whether it writes saved masks (`masks`: a work-item of an odd number of texels then takes two
    tiles, KernelBuilder.finish) and whether its reduction may be dealt out to a work-group (`splits`)."""

    tiled: bool
    private: int
    device_items: int
    texels: int
    masks: bool
    splits: bool

    @staticmethod
    def of(table: TextureTable, group: KernelGroup) -> "TileBudget":
        profile, masks = table.profile, bool(_saved_masks(group))
        return TileBudget(table.tiled, profile.private_floats, 0 if profile.cpu else profile.device_items,
                          -(-numel(static_shape(group.outputs[0])) // LANES), masks, not masks)

    def pick(self, candidates: Sequence[T], texels_per_item: Callable[[T], int],
             group: Callable[[T, int], int | None] | None = None, fallback: Sequence[T] = ()) -> T:
        """Of `candidates` (largest tile first; each within `private`), the first whose items fill the device;
        where none does and the reduction may be split: with `group` (the work-items that would share a
        candidate's reduction given its tiles: Profile.tile_group, capped by the reduction's length and
        loop), the first whose tiles x group fill it, then of the `fallback` tiles (smaller ones, without
        register reuse), else of all the one that comes closest (of equals, the larger tile); without it,
        the first (a work-group per tile is assumed to fill it and the tile keeps its register reuse).
        Where it may not be split, the last candidate (the most work-items)."""
        def work_items(candidate: T) -> int:
            per = texels_per_item(candidate)
            return self.texels // (2 * per if self.masks and per % 2 else per)

        def launched(candidate: T) -> int:
            tiles = work_items(candidate)
            return tiles * ((group(candidate, tiles) or 1) if group is not None else 1)

        if self.device_items:
            filling = [c for c in candidates if work_items(c) >= self.device_items]
            if filling:
                return filling[0]
            if not self.splits:
                return candidates[-1]
            if group is not None:
                everything = [*candidates, *fallback]
                split = [c for c in everything if launched(c) >= self.device_items]
                return split[0] if split else max(everything, key=launched)
        return candidates[0]


Rule = Callable[[TextureTable, KernelGroup], dict[str, Schedule]]
#: a reducing family's decision: (schedule, its geometry for the emitter, outputs reduced together; 0: per lane)
Reducing = Callable[[TextureTable, KernelGroup], tuple[Schedule, Any, int]]


def _saved_masks(group: KernelGroup) -> list[ir.Value]:
    """The group's outputs that are saved masks (whose bytes pair texels of two work-items)."""
    return [value for value in group.outputs
            if keys.json_of(view_root(value).metadata_props, keys.LAYOUT, {}).get("kind") in ("mask8", "mask4")]


def _reducing(decide: Reducing) -> Rule:
    """The rule of a family whose work-item reduces outputs together: their reduction's fields are choices
    (where the family offers its own values of one, e.g. a conv's group sizes, those)."""
    def rule(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
        schedule, detail, lanes = decide(table, group)
        schedule.detail = detail
        if lanes:
            schedule.choices = {**reduction_choices(table.profile, lanes, bool(_saved_masks(group))),
                                **schedule.choices}
        return {group.name: schedule}

    return rule


#: the work-items that would share a contraction tile's reduction, given the tile and its count of tiles
Split = Callable[[tuple[int, int], int], int | None]


def _contraction_tile(budget: TileBudget, out_shape: tuple[int, ...], rows: int, column_texels: int | None,
                      split: Split | None = None) -> tuple[Schedule, None, int]:
    """A contraction's tile: up to 8 x TILE_COLUMNS texels under R-Tile layouts where the output's rows and
    texel columns come in such groups (a tile reads each operand texel once for all its rows or columns),
    within the target's accumulators and by the device's size (TileBudget.pick, told by `split` the
    work-group each tile's reduction would really get, with one texel as the last resort), else one
    texel. `rows`, `column_texels`: the runs of rows and texel columns the operands step through by one
    stride (a folded axis's innermost digit); the tile's rows are whole output rows apart."""
    row_texels = out_shape[-1] // LANES
    run = row_texels if column_texels is None else column_texels
    wide = TILE_COLUMNS if row_texels % TILE_COLUMNS == 0 and run % TILE_COLUMNS == 0 else 1
    tiles = [(n, c) for n in TILE_ROWS for c in sorted({wide, 1}, reverse=True)
             if rows % n == 0 and n * c * LANES <= budget.private]
    if budget.tiled and tiles:
        tiles.sort(key=lambda tile: -tile[0] * tile[1])  # the largest first; of equal ones, more rows
        tile_rows, columns = budget.pick(tiles, lambda tile: tile[0] * tile[1], split, [(1, 1)] if split else ())
        schedule = tile_of(tile_rows, columns, row_texels)
    else:
        schedule = consecutive(1)
    schedule.choices = {"tile_rows": tuple(n for n in ROW_CHOICES if rows % n == 0),
                        "tile_columns": tuple(n for n in COLUMN_CHOICES if row_texels % n == 0 and run % n == 0)}
    return schedule, None, LANES * schedule.texels_per_item


def _tile_split(table: TextureTable, group: KernelGroup, k_digits: Digits | None) -> Split | None:
    """What Profile.tile_group deals a tile's reduction over K (cut into `k_digits`, outermost first) out
    to (contraction.tile_reduction: its length and the loop a group shares); None where that is unknown or
    its tiles may not be split (saved masks)."""
    profile = table.profile
    if k_digits is None or _saved_masks(group):
        return None
    return lambda tile, tiles: profile.tile_group(*tile_reduction(k_digits, *tile), LANES * tile[0] * tile[1], tiles)


def _matmul(table: TextureTable, group: KernelGroup) -> tuple[Schedule, Any, int]:
    out_shape = static_shape(group.outputs[0])
    (_, a_axes), (_, w_axes) = matmul_operands(ValueReads(table, out_shape), group.anchor)
    a_rank, b_rank = (len(static_shape(value)) for value in group.anchor.inputs)
    if not (a_rank >= 2 and texel_columns(out_shape, w_axes, b_rank >= 2)):
        return consecutive(1), None, 0
    k_digits = common_digits([a_axes[-1], w_axes[-2]])
    rows = merged_rows(a_axes, w_axes) or a_axes[-2][-1][0]
    return _contraction_tile(TileBudget.of(table, group), out_shape, rows, w_axes[-1][-1][0] // LANES,
                             _tile_split(table, group, k_digits[0] if k_digits else None))


def _gemm(table: TextureTable, group: KernelGroup) -> tuple[Schedule, Any, int]:
    out_shape = static_shape(group.outputs[0])
    if lane_axis(out_shape) != 1:
        return consecutive(1), None, 0
    a_shape = static_shape(group.anchor.inputs[0])
    k = a_shape[0] if attr(group.anchor, "transA", 0) else a_shape[1]
    return _contraction_tile(TileBudget.of(table, group), out_shape, out_shape[0], None,
                             _tile_split(table, group, [(k, 1)]))


def _conv(table: TextureTable, group: KernelGroup) -> tuple[Schedule, ConvPlan, int]:
    """The conv's tile (see the module docstring) as the ConvPlan its emitter follows."""
    scratch = ValueReads(table, static_shape(group.outputs[0]))  # numbers the names of the trial reductions
    budget, view = TileBudget.of(table, group), flattened_conv(conv_shape(group.anchor))
    tile, row = conv_tile(view, budget.private, budget.device_items), row_axis(view.out_shape, first=2)
    prefix = FLAT_TEXEL_INDEX if view.flat else TEXEL_INDEX

    def masked_of(candidate: ConvTile) -> int | None:
        return candidate.axis if candidate.axis is not None else last_tap_axis(view)

    def trial(candidate: ConvTile) -> Reduction:
        return conv_reduction(scratch, Block(scratch.numbering), view, prefix, candidate, masked_of(candidate))

    split = _tile_group(table, group, trial)
    if tile is not None:
        if tile.rows == 1:  # a spatial tile: its texels along the row by the device's size
            tile = dataclasses.replace(tile, length=LANES * _spatial_texels(budget, view, tile, split), multiple=0)
        per = tile.lanes // LANES
        schedule = consecutive(per)
        masked = masked_of(tile)
        if tile.rows == 1:  # a spatial tile
            # where channels cannot stack (a depthwise conv): rows along the axis before, where its taps overlap
            k, s = view.window.kernel, view.window.strides
            schedule = _spatial_rows(budget, view, tile, lambda x: k[x] <= TAP_BLOCK and k[x - 1] > s[x - 1], split)
        elif not _sums_instead_of_batches(scratch, view, prefix, tile, masked, budget, split):  # a channel tile
            tile.batches = batch_count(budget, view.out_shape, tile, split)
            schedule = tile_of(tile.batches, per, numel(view.out_shape[1:]) // LANES)  # one batch element apart
        schedule.choices["group_size"] = _group_sizes(table, group, tile, trial(tile))
        return schedule, ConvPlan(view, tile, masked, names_taken=scratch.numbering.count), tile.lanes
    if row is not None:
        tile, schedule = _row_texels(dataclasses.replace(budget, splits=False), view, row, 1)
        schedule.choices["group_size"] = (1,)  # its reduction is its texels' own (reduce_guarded)
        return schedule, ConvPlan(view, row=tile), tile.lanes
    return consecutive(1), ConvPlan(view), 0


#: the work-items that would share a conv tile's reduction, given the tile and its count of tiles
TileSplit = Callable[[ConvTile, int], int | None]


def _tile_group(table: TextureTable, group: KernelGroup, reduction: Callable[[ConvTile], Reduction]
                ) -> TileSplit | None:
    """What Profile.tile_group deals a conv tile's reduction (`reduction`: a trial one for a candidate tile, its
    multiply-adds per accumulator and the loop a group shares) out to, as reduce_into will; None where its tiles
    may not be split (saved masks) or on a CPU (whose tiles keep their own rules: TileBudget)."""
    profile = table.profile
    if _saved_masks(group) or profile.cpu:
        return None
    known: dict[tuple[Any, ...], tuple[int, int]] = {}

    def split(tile: ConvTile, tiles: int) -> int | None:
        key = dataclasses.astuple(tile)
        if key not in known:
            trial = reduction(tile)
            known[key] = (trial.serial(tile.lanes), trial.shared_loop()[1])
        serial, trips = known[key]
        return profile.tile_group(serial, trips, tile.lanes, tiles)

    return split


def _group_sizes(table: TextureTable, group: KernelGroup, tile: ConvTile, reduction: Reduction) -> tuple[int, ...]:
    """The group sizes a conv `tile` whose `reduction` the emitter builds may take: up to the least power of two
    that leaves each work-item one iteration of the loop a group deals out (schedule.reduction_choices; 1 where
    it has none: more work-items would change nothing but their idle merge)."""
    trips = reduction.shared_loop()[1]
    return reduction_choices(table.profile, tile.lanes, bool(_saved_masks(group)), trips)["group_size"]


def _tiles_of(split: TileSplit | None, tile_of_candidate: Callable[[T], ConvTile]
              ) -> Callable[[T, int], int | None] | None:
    """TileBudget.pick's `group` for candidates that `tile_of_candidate` makes conv tiles of."""
    return None if split is None else lambda candidate, tiles: split(tile_of_candidate(candidate), tiles)


def _sums_instead_of_batches(b: ValueReads, cs: ConvShape, prefix: str, tile: ConvTile, masked: int | None,
                             budget: TileBudget, split: TileSplit | None = None) -> bool:
    """Whether a channel tile keeps one batch element, its outputs summing float4s along the reduction
    (the "sums" form), rather than take several in texels (batch_count): the sums must be chosen for the
    tile alone and cost fewer instructions per product than the batched tile's texels."""
    def trial(candidate: ConvTile) -> Reduction:
        return conv_reduction(b, Block(b.numbering), cs, prefix, candidate, masked)

    single = trial(tile)
    if single.accumulator_form(b, tile.lanes) != "sums":
        return False
    batched = dataclasses.replace(tile, batches=batch_count(budget, cs.out_shape, tile, split))
    return batched.batches == 1 or single.cost("sums") < trial(batched).cost("texels")


def _conv_transpose(table: TextureTable, group: KernelGroup) -> tuple[Schedule, ConvPlan, int]:
    """The ConvTranspose's tile (see conv_transpose.py's docstring) as the ConvPlan its emitter follows."""
    budget, view = TileBudget.of(table, group), flattened_transpose(transpose_shape(group.anchor))
    axis, row, window = lane_axis(view.out_shape), row_axis(view.out_shape, first=2), view.window
    if axis is not None and axis >= 2 and texels_fit(view, axis):
        scratch = ValueReads(table, static_shape(group.outputs[0]))
        prefix = FLAT_TEXEL_INDEX if view.flat else TEXEL_INDEX
        split = _tile_group(table, group, lambda candidate: transpose_reduction(scratch, view, prefix, candidate))
        tile = ConvTile(1, LANES * _spatial_texels(budget, view, ConvTile(1, LANES, axis - 2), split), axis - 2)
        # where channels cannot stack (a depthwise conv's input gradient) rows along a stride-1 axis before
        schedule = _spatial_rows(budget, view, tile,
                                 lambda x: window.strides[x - 1] == 1 and window.kernel[x - 1] != 1, split,
                                 weights_side_by_side(view))
        schedule.choices["group_size"] = _group_sizes(table, group, tile,
                                                      transpose_reduction(scratch, view, prefix, tile))
        return schedule, ConvPlan(view, tile), tile.lanes
    if row is not None and texels_fit(view, row[0]):
        tile, schedule = _row_texels(dataclasses.replace(budget, splits=False), view, row,
                                     window.strides[row[0] - 2])
        schedule.choices["group_size"] = (1,)  # its reduction is its texels' own (reduce_guarded)
        return schedule, ConvPlan(view, row=tile), tile.lanes
    return consecutive(1), ConvPlan(view), 0


def _spatial_texels(budget: TileBudget, view: ConvShape, tile: ConvTile, split: TileSplit | None = None) -> int:
    """Texels along window axis `tile.axis` a spatial tile's work-item covers: of the counts up to
    conv.texels_per_item's (the most, up to 5, that divide a row) that divide the row, TileBudget.pick's,
    told by `split` the work-group each would really get."""
    axis = tile.axis
    row = view.out_shape[2 + axis] // LANES if axis is not None else 1
    most = texels_per_item(row)
    return budget.pick([n for n in range(most, 0, -1) if row % n == 0], lambda n: n,
                       _tiles_of(split, lambda n: dataclasses.replace(tile, length=LANES * n, multiple=0)))


def _spatial_rows(budget: TileBudget, view: ConvShape, tile: ConvTile, stacks: Callable[[int], bool],
                  split: TileSplit | None = None, whole_rows: bool = False) -> Schedule:
    """The schedule of a spatial tile, whose rows it sets: under R-Tile codegen, the same positions of several
    output channels (channel_rows), or where none stack and `stacks(window axis x)`, the next output positions
    along the axis before, `stride` texels apart: of SPATIAL_ROWS that divide it within the target's accumulators
    and STATIC_PRODUCTS products (taps x input channels) per block, the one TileBudget.pick takes (told by
    `split` the work-group each would really get). They share input rows, (rows - 1) * stride + (taps - 1) *
    dilation + 1 of them read instead of rows * taps."""
    x, per, kernel = tile.axis, tile.length // LANES, view.window.kernel
    tile.rows, tile.row_step, _, stride = channel_rows(
        budget, view.out_shape, view.cg_out, (per,),
        _tiles_of(split, lambda rows: dataclasses.replace(tile, rows=rows[0], row_step=rows[1])), whole_rows)
    if tile.rows == 1 and budget.tiled and x and stacks(x):
        products = tile.lanes * kernel[x - 1] * kernel[x] * min(CHANNEL_BLOCK, view.cg_in)
        fits = [rows for rows in SPATIAL_ROWS if view.out_shape[1 + x] % rows == 0
                and rows * tile.lanes <= budget.private and rows * products <= STATIC_PRODUCTS]
        tile.y_rows = budget.pick([*fits, 1], lambda rows: rows * per, _tiles_of(
            split, lambda rows: dataclasses.replace(tile, y_rows=rows, row_axis=x - 1 if rows > 1 else None)))
        tile.row_axis, stride = (x - 1 if tile.y_rows > 1 else None), numel(view.out_shape[2 + x:]) // LANES
    return tile_of(tile.rows * tile.y_rows, per, stride)


def channel_rows(budget: TileBudget, out_shape: Sequence[int], cg_out: int, choices: Sequence[int],
                 group: Callable[[tuple[int, int, int, int], int], int | None] | None = None,
                 whole_rows: bool = False) -> tuple[int, int, int, int]:
    """(rows, row_step, columns, stride): a work-item of `columns` consecutive texels of one output channel
    (of `choices`, largest first) also computes the same positions of rows - 1 more channels of its
    group (cg_out), row_step apart: positions line up with texel columns only every 4 * columns /
    gcd(plane, 4 * columns) channels. Its rows are `stride` texels apart. Of the ones within the target's
    accumulators, TileBudget.pick's (`group`: the work-group a candidate's reduction would get); (1, 1, the
    last choice, 1) where none fits, or under naive: one channel. With `whole_rows` (a pointwise transpose:
    consecutive channels' weights side by side in W) rows by 4 of consecutive channels, whose weights are whole
    texels, come first, sharing their reduction in a work-group where their tiles alone leave the device idle;
    the other tiles are the fallback."""
    plane = numel(out_shape[2:])
    fits = []
    if budget.tiled:
        for columns in choices:
            step = LANES * columns // math.gcd(plane, LANES * columns)
            stride = step * plane // LANES
            fits += [(rows, step, columns, stride) for rows in CHANNEL_ROWS
                     if cg_out % (rows * step) == 0 and rows * columns * LANES <= budget.private]
    rest = [*fits, (1, 1, choices[-1], 1)]
    whole = [fit for fit in fits if fit[1] == 1 and fit[0] % LANES == 0] if whole_rows else []
    if whole and group is not None and budget.splits:
        return budget.pick(whole, lambda tile: tile[0] * tile[2], group, [fit for fit in rest if fit not in whole])
    return budget.pick(rest, lambda tile: tile[0] * tile[2], group)


def batch_count(budget: TileBudget, out_shape: Sequence[int], tile: ConvTile, split: TileSplit | None = None) -> int:
    """Batch elements a channel `tile`'s work-item computes under R-Tile codegen (they share every weight read;
    the weight gradient's batch axis is the input channels, sharing the dY reads): of BATCH_ROWS within the
    target's accumulators, TileBudget.pick's (told by `split` the work-group each would really get); 1 under
    naive."""
    lanes = tile.lanes // tile.batches
    fits = [batches for batches in BATCH_ROWS if out_shape[0] % batches == 0 and batches * lanes <= budget.private]
    return budget.pick([*fits, 1], lambda batches: batches * lanes // LANES,
                       _tiles_of(split, lambda batches: dataclasses.replace(tile, batches=batches))
                       ) if budget.tiled else 1


def _row_texels(budget: TileBudget, view: ConvShape, row: tuple[int, int], multiple: int
                ) -> tuple[ConvTile, Schedule]:
    """A row path's tile (its texels start at a multiple of `multiple`) and schedule."""
    axis, length = row
    choices = (2, 1) if length >= PAIR_ROW else (1,)
    rows, step, columns, stride = channel_rows(budget, view.out_shape, view.cg_out, choices)
    return ConvTile(rows, LANES * columns, axis - 2, multiple, row_step=step), tile_of(rows, columns, stride)


def _row_group(table: TextureTable, count: int, output: ir.Value) -> Schedule:
    """One output texel of `output` per work-item, or a work-group per texel for a reduction of `count`
    elements that is long or whose texels alone leave the device idle (Profile.reduction_group)."""
    schedule = consecutive(1)
    schedule.group_size = table.profile.reduction_group(count, -(-numel(static_shape(output)) // LANES)) or 1
    bound = min(REDUCTION_GROUP, table.profile.max_work_group_size)
    schedule.choices = {"group_size": tuple(g for g in group_choices(table.profile, 1) if g <= bound)}
    return schedule


def _reduce(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    """Sibling reductions fold alike but total ones (passes/fuse.py), whose inputs differ: the longest decides."""
    counts = [numel([static_shape(n.inputs[0])[a] for a in reduced_axes(n)]) for n in group.nodes
              if n.op_type in REDUCTIONS]
    return {group.name: _row_group(table, max(counts), group.outputs[0])}


def _layer_norm(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    _, _, count = layer_norm_geometry(group.anchor)
    if has_statistics(group.anchor):
        return {f"{group.name}_stats": _row_group(table, count, group.anchor.outputs[1]), group.name: consecutive(1)}
    return {group.name: consecutive(item_texels(count // 4) if count % 4 == 0 else 1)}


def _transpose(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    """A lone Transpose that moves the lanes' axis (movement.TransposeBlock): under R-Tile codegen a 4 x 4
    block per work-item, 4 whole input texels for 4 output texels instead of one lane of 16, where its
    items still fill the device (nothing to split: else one texel each); floats only (a mask's texel is no
    4 elements)."""
    block = transpose_block(group.anchor) if len(group.nodes) == 1 else None
    values = (group.anchor.inputs[0], group.anchor.outputs[0])
    if block is None or not table.tiled or any(table.of(value).mask_elements for value in values):
        return {group.name: consecutive(1)}
    budget = dataclasses.replace(TileBudget.of(table, group), splits=False)
    return {group.name: tile_of(budget.pick([LANES, 1], lambda rows: rows), 1, block.stride)}


REDUCE_OPS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "ReduceLogSumExp", "GlobalAveragePool")
SCHEDULE_RULES: dict[str, Rule] = {
    "MatMul": _reducing(_matmul), "Gemm": _reducing(_gemm), "Conv": _reducing(_conv),
    "ConvTranspose": _reducing(_conv_transpose), **dict.fromkeys(REDUCE_OPS, _reduce),
    "LayerNormalization": _layer_norm, "InstanceNormalization": _layer_norm, "Transpose": _transpose,
}


def decide_schedules(table: TextureTable, groups: list[KernelGroup],
                     overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Schedule]:
    """Every kernel's schedule by kernel name, the overrides applied, and the mask fallbacks decided."""
    schedules: dict[str, Schedule] = {}
    owners: dict[str, KernelGroup] = {}
    for group in groups:
        decided = {group.name: consecutive(1)}
        if group.anchor.op_type in SCHEDULE_RULES:
            try:
                decided = SCHEDULE_RULES[group.anchor.op_type](table, group)
            except UnsupportedOpError:  # its emitter refuses it too, and lower() names it with the others
                pass
        schedules.update(decided)
        owners.update({name: group for name in decided})
    shapes = {name: shape_key(owners[name], name, table.float_format, table.tiled) for name in schedules}
    apply_overrides(schedules, overrides or {}, lambda name, schedule: _refine(table, owners[name], schedule), shapes)
    for name, schedule in schedules.items():
        if not pairs_mask_bytes(schedule):  # a byte's two texels would lie in two work-items' tiles
            schedule.mask4 = tuple(view_root(value).name for value in _saved_masks(owners[name]))
    return schedules


def _refine(table: TextureTable, group: KernelGroup, schedule: Schedule) -> None:
    """What follows from a schedule file's fields: a contraction tile's rows stay whole output rows apart,
    and its accumulators within PRIVATE_FLOATS."""
    if "tile_rows" not in schedule.choices:  # not a contraction's tile (_contraction_tile)
        return
    row_texels = static_shape(group.outputs[0])[-1] // LANES
    schedule.tile_stride = row_texels if schedule.texels_per_item > 1 else 1
    lanes = LANES * schedule.texels_per_item
    if lanes > PRIVATE_FLOATS:
        raise FblcError(f"schedule of kernel '{group.name}': a tile of {schedule.tile_rows} x {schedule.tile_columns} "
                        f"texels holds {lanes} accumulators, more than the {PRIVATE_FLOATS} a work-item keeps",
                        f"choose tile_rows x tile_columns x 4 <= {PRIVATE_FLOATS}")
    group_size = schedule.group_size or 1
    if group_size not in reduction_choices(table.profile, lanes, bool(_saved_masks(group)))["group_size"]:
        raise FblcError(f"schedule of kernel '{group.name}': group_size {group_size} does not fit a tile of "
                        f"{lanes} accumulators", "choose a smaller group_size or tile")


def mask4_layouts(schedules: Mapping[str, Schedule], table: TextureTable, graph: ir.Graph) -> dict[str, TexelLayout]:
    """The r_mask4 layouts of the saved masks the schedules store that way, by value name."""
    wanted = {name for schedule in schedules.values() for name in schedule.mask4}
    layouts = {}
    for value in [*graph.inputs, *graph.initializers.values(), *(v for n in graph for v in n.outputs)]:
        if value is not None and value.name in wanted and value.name not in layouts:
            count = numel(static_shape(value))
            layouts[value.name] = mask_layout("mask4", count, *table.profile.placement_limits(-(-count // 4)))
    return layouts
