"""Every kernel group's schedule (fblc/codegen/schedule.py), decided before any kernel is built.

One rule per anchor op type (SCHEDULE_RULES) turns the group's sizes and the target profile into the
kernels' `Schedule`s, by kernel name; the emitters then take them (KernelBuilder.schedule) instead of
deciding. Groups without a rule get one texel per work-item. The rules are the decisions the emitters
made while writing C, moved here unchanged:
- MatMul / Gemm on their texel path under R-Tile codegen: a tile of the first of TILE_ROWS output rows
  that divides the rows, by TILE_COLUMNS texel columns where the row's texels come in such runs.
- Conv / ConvTranspose (see conv.py's docstring): a channel tile, or a spatial tile or row texels under
  R-Tile codegen also of 2 to 8 output channels (conv_tiles.channel_rows), else of 2 to 4 output rows
  where channels cannot stack (_conv_spatial_rows); a channel tile of 2 to 8 batch elements
  (conv_tiles.batch_count) unless its sums form is cheaper alone (_sums_instead_of_batches).
- Reductions and row statistics: a work-group per output when the reduced run is long
  (Profile.reduction_group); LayerNormalization's output: the texels of a row (normalize._item_texels).
Then a schedule file's overrides, and the saved masks whose bytes a 2-D tile splits (r_mask4).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import onnx_ir as ir

from fblc.codegen.builder import TEXEL_INDEX, lane_axis
from fblc.codegen.ir import Block
from fblc.codegen.kernels import KernelGroup
from fblc.codegen.kernels.contraction import root_digits, row_axis
from fblc.codegen.kernels.conv import (CHANNEL_BLOCK, FLAT_TEXEL_INDEX, TAP_BLOCK, ConvPlan, conv_reduction,
                                       conv_shape, conv_tile, ConvShape, last_tap_axis, ConvTile)
from fblc.codegen.kernels.conv import flattened_pointwise as flattened_conv
from fblc.codegen.kernels.conv_tiles import (batch_count, batch_stride, channel_rows, row_columns, stack_rows,
                                             texels_per_item)
from fblc.codegen.kernels.conv_transpose import TransposePlan, row_stride_fits, transpose_shape, TransposeShape
from fblc.codegen.kernels.conv_transpose import flattened_pointwise as flattened_transpose
from fblc.codegen.kernels.texel import Reduction
from fblc.codegen.kernels.normalize import has_statistics, item_texels, layer_norm_geometry
from fblc.codegen.kernels.reduce import reduced_axes
from fblc.codegen.reads import ValueReads
from fblc.codegen.schedule import (Schedule, apply_overrides, consecutive, group_choices, pairs_mask_bytes,
                                   reduction_choices)
from fblc.codegen.schedule import tile as tile_of
from fblc.codegen.textures import TextureTable
from fblc.compiler import keys
from fblc.compiler.index_map import view_root
from fblc.compiler.values import numel, static_shape
from fblc.errors import FblcError, UnsupportedOpError
from fblc.profiles.profile import PRIVATE_FLOATS, REDUCTION_GROUP
from fblc.texel_layout import TexelLayout, mask_layout

LANES = 4
TILE_ROWS = (8, 4)  # output rows of a contraction's tile, the first that divides the output's rows
TILE_COLUMNS = 2  # texels: a tile is 8 x 8 outputs (64 accumulators, as mobile GEMM kernels keep)
#: a contraction tile's rows a schedule file may choose: one, or multiples of 4 (the emitters read A's
#: rows of a tile as whole texels from a row that is a multiple of 4)
ROW_CHOICES = (1, 4, 8, 16)
COLUMN_CHOICES = (1, 2, 4)  # its texel columns

@dataclass(frozen=True)
class ContractionTile:
    """A MatMul's or Gemm's tile geometry: its rows are whole output rows (`row_texels`) apart."""

    row_texels: int


Rule = Callable[[TextureTable, KernelGroup], dict[str, Schedule]]
SCHEDULE_RULES: dict[str, Rule] = {}


def rule(*op_types: str) -> Callable[[Rule], Rule]:
    def register(function: Rule) -> Rule:
        for op_type in op_types:
            SCHEDULE_RULES[op_type] = function
        return function

    return register


def _masks(group: KernelGroup) -> bool:
    """Whether the group writes a saved mask (whose bytes pair texels of two work-items)."""
    return any(_layout_kind(value) in ("mask8", "mask4") for value in group.outputs)


def _layout_kind(value: ir.Value) -> str:
    annotated = view_root(value).metadata_props.get(keys.LAYOUT)
    return json.loads(annotated).get("kind", "flat") if annotated else "flat"


def _contraction_tile(tiled: bool, out_shape: tuple[int, ...], rows: int, column_texels: int | None) -> Schedule:
    """A contraction's tile: up to 8 x TILE_COLUMNS texels under R-Tile layouts when the output's rows and
    texel columns come in such groups (a tile reads each operand texel once for all its rows or columns: the
    transposed operands of the backward then cost no more than plain ones, and the reads per multiply-add
    fall with the tile's size), else one texel, the conventional per-texel kernel. `rows`, `column_texels`:
    the runs of rows and of texel columns that the operands step through by one stride (a folded axis's
    innermost digit); the tile's rows are whole output rows apart."""
    row_texels = out_shape[-1] // LANES
    run = row_texels if column_texels is None else column_texels
    tile_rows = next((n for n in TILE_ROWS if rows % n == 0), None)
    if tiled and tile_rows is not None:
        columns = TILE_COLUMNS if row_texels % TILE_COLUMNS == 0 and run % TILE_COLUMNS == 0 else 1
        schedule = tile_of(tile_rows, columns, row_texels)
    else:
        schedule = consecutive(1)
    schedule.choices = {"tile_rows": tuple(n for n in ROW_CHOICES if rows % n == 0),
                        "tile_columns": tuple(n for n in COLUMN_CHOICES if row_texels % n == 0 and run % n == 0)}
    schedule.detail = ContractionTile(row_texels)
    return schedule


def _with_reduction_choices(table: TextureTable, group: KernelGroup, schedule: Schedule) -> Schedule:
    schedule.choices.update(reduction_choices(table.profile, LANES * schedule.texels_per_item, _masks(group)))
    return schedule


@rule("MatMul")
def _matmul(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    node = group.anchor
    a, w = node.inputs
    a_shape, b_shape = static_shape(a), static_shape(w)
    a2 = a_shape if len(a_shape) >= 2 else (1, a_shape[0])
    b2 = b_shape if len(b_shape) >= 2 else (b_shape[0], 1)
    out_shape = static_shape(group.outputs[0])
    reads = ValueReads(table, out_shape)
    (_, a_axes), (_, w_axes) = root_digits(reads, a, a2), root_digits(reads, w, b2)
    (m_rows, _), (n_run, _) = a_axes[-2][-1], w_axes[-1][-1]
    texel = len(b_shape) >= 2 and lane_axis(out_shape) == len(out_shape) - 1 and n_run % LANES == 0
    if not (texel and len(a_shape) >= 2):
        return {group.name: consecutive(1)}
    return {group.name: _with_reduction_choices(
        table, group, _contraction_tile(table.tiled, out_shape, m_rows, n_run // LANES))}


@rule("Gemm")
def _gemm(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    out_shape = static_shape(group.outputs[0])
    if lane_axis(out_shape) != 1:
        return {group.name: consecutive(1)}
    return {group.name: _with_reduction_choices(table, group,
                                                _contraction_tile(table.tiled, out_shape, out_shape[0], None))}


@rule("Conv")
def _conv(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    plan, schedule = _conv_plan(table.tiled, ValueReads(table, static_shape(group.outputs[0])), group.anchor)
    schedule.detail = plan
    lanes = plan.tile.lanes if plan.tile is not None else plan.row[2] * LANES * plan.row[4] if plan.row else 0
    if lanes:
        schedule.choices = reduction_choices(table.profile, lanes, _masks(group))
    return {group.name: schedule}


@rule("ConvTranspose")
def _conv_transpose(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    plan, schedule, lanes = _transpose_plan(table.tiled, group.anchor)
    schedule.detail = plan
    if lanes:
        schedule.choices = reduction_choices(table.profile, lanes, _masks(group))
    return {group.name: schedule}


def _conv_plan(tiled: bool, scratch: ValueReads, node: ir.Node) -> tuple[ConvPlan, Schedule]:
    """The conv's tile (see the module docstring) and its schedule; `scratch` numbers the names of
    the trial reductions that weigh a channel tile's accumulator forms (no kernel is built)."""
    cs = conv_shape(node)
    view = flattened_conv(cs)
    texel = FLAT_TEXEL_INDEX if view is not cs else TEXEL_INDEX
    tile, row = conv_tile(view), row_axis(view.out_shape, first=2)
    if tile is not None:
        per = tile.lanes // LANES
        schedule = consecutive(per)
        masked = tile.axis if tile.axis is not None else last_tap_axis(view)
        if tile.rows == 1:  # a spatial tile: under R-Tile codegen, of several output channels, or rows
            rows, tile.row_step, _, stride = channel_rows(tiled, view.out_shape, view.cg_out, (per,))
            if rows > 1:
                tile.rows, schedule = rows, tile_of(rows, per, stride)
            else:
                tile.y_rows, tile.row_axis = _conv_spatial_rows(tiled, view, tile)
                if tile.y_rows > 1:
                    schedule = tile_of(tile.y_rows, per, stack_rows(view.out_shape, 2 + tile.row_axis, 0, 0)[1])
        elif not _sums_instead_of_batches(scratch, view, texel, tile, masked, tiled):  # a channel tile
            tile.batches = batch_count(tiled, view.out_shape, tile.lanes)
            if tile.batches > 1:
                schedule = tile_of(tile.batches, per, batch_stride(view.out_shape))
        return ConvPlan(view, tile, masked, names_taken=scratch.numbering.count, flat=view is not cs), schedule
    if row is not None:
        axis, length = row
        rows, step, columns, stride = channel_rows(tiled, view.out_shape, view.cg_out, row_columns(length))
        schedule = tile_of(rows, columns, stride) if rows > 1 else consecutive(1)
        return ConvPlan(view, row=(axis, length, rows, step, columns), flat=view is not cs), schedule
    return ConvPlan(view, flat=view is not cs), consecutive(1)


def _sums_instead_of_batches(b: ValueReads, cs: ConvShape, prefix: str, tile: ConvTile, masked: int | None,
                             tiled: bool) -> bool:
    """Whether a channel tile keeps one batch element, its outputs summing float4s along the reduction
    (accumulators' "sums" form), rather than take several batch elements (batch_rows, R-Tile codegen's
    register tile) in texels: the sums must be chosen for the tile alone and cost fewer instructions per
    product than the batched tile's texels."""
    def trial(candidate: ConvTile) -> Reduction:
        return conv_reduction(b, Block(b.numbering), cs, prefix, candidate, masked)

    single = trial(tile)
    if single.accumulator_form(b, tile.lanes) != "sums":
        return False
    batched = dataclasses.replace(tile, batches=batch_count(tiled, cs.out_shape, tile.lanes))
    return batched.batches == 1 or single.cost("sums") < trial(batched).cost("texels")


def _conv_spatial_rows(tiled: bool, cs: ConvShape, tile: ConvTile) -> tuple[int, int | None]:
    """(rows, window axis): under R-Tile codegen a spatial tile whose channels cannot stack (a
    depthwise conv has one output channel per group) stacks consecutive output positions along the
    window axis before its own, the first of SPATIAL_ROWS that divides that axis and fits
    PRIVATE_FLOATS, where its taps overlap (more taps than stride): the tile's rows then share
    input rows, (rows - 1) * stride + (taps - 1) * dilation + 1 of them read instead of rows * taps.
    (1, None) when none fits, or under the naive layout."""
    window = cs.window
    if not tiled or not tile.axis or window.kernel[tile.axis] > TAP_BLOCK:
        return 1, None
    y = tile.axis - 1
    if window.kernel[y] <= window.strides[y]:
        return 1, None
    rows, _ = stack_rows(cs.out_shape, 2 + y, tile.lanes,
                         window.kernel[y] * window.kernel[tile.axis] * min(CHANNEL_BLOCK, cs.cg_in))
    return (rows, y) if rows > 1 else (1, None)


def _transpose_plan(tiled: bool, node: ir.Node) -> tuple[TransposePlan, Schedule, int]:
    """The ConvTranspose's tile, its schedule and the lanes its work-item reduces together (0: per lane)."""
    ts = transpose_shape(node)
    view = flattened_transpose(ts)
    flat = view is not ts
    axis, row = lane_axis(view.out_shape), row_axis(view.out_shape, first=2)
    if axis is not None and axis >= 2 and LANES % view.strides[axis - 2] == 0 and view.kernel[axis - 2] <= TAP_BLOCK:
        per = texels_per_item(view.out_shape[axis] // LANES)
        lanes = LANES * per
        rows, step, _, stride = channel_rows(tiled, view.out_shape, view.cg_out, (per,))
        schedule, along = (tile_of(rows, per, stride) if rows > 1 else consecutive(per)), None
        if rows == 1:
            (rows, step), along, stride = _transpose_spatial_rows(tiled, view, axis - 2, lanes)
            if along is not None:
                schedule = tile_of(rows, per, stride)
        return TransposePlan(view, flat, axis, (rows, step), along, lanes=lanes), schedule, lanes * rows
    if row is not None and row_stride_fits(view.strides[row[0] - 2], row[1]) and view.kernel[row[0] - 2] <= TAP_BLOCK:
        axis, length = row
        count, step, columns, stride = channel_rows(tiled, view.out_shape, view.cg_out, row_columns(length))
        schedule = tile_of(count, columns, stride) if count > 1 else consecutive(1)
        return TransposePlan(view, flat, row=(axis, length, count, step, columns)), schedule, LANES * columns * count
    return TransposePlan(view, flat), consecutive(1), 0


def _transpose_spatial_rows(tiled: bool, ts: TransposeShape, lane: int, lanes: int
                  ) -> tuple[tuple[int, int], int | None, int]:
    """((rows, 1), window axis, stride): as _conv_spatial_rows, consecutive output positions along the
    spatial axis before `lane` where output channels cannot stack (a depthwise conv's input
    gradient), when that axis has stride 1 and several taps: the rows share input rows, `stride`
    texels apart. ((1, 1), None, 1) where none fits or under naive."""
    if not tiled or lane == 0 or ts.strides[lane - 1] != 1 or ts.kernel[lane - 1] == 1:
        return (1, 1), None, 1
    rows, stride = stack_rows(ts.out_shape, 1 + lane, lanes,
                              ts.kernel[lane - 1] * ts.kernel[lane] * min(CHANNEL_BLOCK, ts.cg_in))
    return ((rows, 1), lane - 1, stride) if rows > 1 else ((1, 1), None, 1)


def _row_group(table: TextureTable, count: int) -> Schedule:
    """One output per work-item, or a work-group per output for a reduction of `count` elements."""
    schedule = consecutive(1)
    schedule.group_size = table.profile.reduction_group(count) or 1
    bound = min(REDUCTION_GROUP, table.profile.max_work_group_size)
    schedule.choices = {"group_size": tuple(g for g in group_choices(table.profile, 1) if g <= bound)}
    return schedule


@rule("ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "ReduceLogSumExp", "GlobalAveragePool")
def _reduce(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    node = group.anchor
    shape = static_shape(node.inputs[0])
    return {group.name: _row_group(table, numel([shape[a] for a in reduced_axes(node)]))}


@rule("LayerNormalization", "InstanceNormalization")
def _layer_norm(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    node = group.anchor
    _, _, count = layer_norm_geometry(node)
    if has_statistics(node):
        return {f"{group.name}_stats": _row_group(table, count), group.name: consecutive(1)}
    return {group.name: consecutive(item_texels(count // 4) if count % 4 == 0 else 1)}


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
    apply_overrides(schedules, overrides or {}, lambda name, schedule: _refine(table, owners[name], schedule))
    for name, schedule in schedules.items():
        if not pairs_mask_bytes(schedule):  # a byte's two texels would lie in two work-items' tiles
            schedule.mask4 = tuple(view_root(v).name for v in owners[name].outputs  # mask4: kernel_schedules's
                                   if _layout_kind(v) in ("mask8", "mask4"))
    return schedules


def _refine(table: TextureTable, group: KernelGroup, schedule: Schedule) -> None:
    """What follows from a schedule file's fields: a contraction tile's rows stay whole output rows apart,
    and its accumulators within PRIVATE_FLOATS."""
    if not isinstance(schedule.detail, ContractionTile):
        return
    schedule.tile_stride = schedule.detail.row_texels if schedule.texels_per_item > 1 else 1
    lanes = LANES * schedule.texels_per_item
    if lanes > PRIVATE_FLOATS:
        raise FblcError(f"schedule of kernel '{group.name}': a tile of {schedule.tile_rows} x {schedule.tile_columns} "
                        f"texels holds {lanes} accumulators, more than the {PRIVATE_FLOATS} a work-item keeps",
                        f"choose tile_rows x tile_columns x 4 <= {PRIVATE_FLOATS}")
    group_size = schedule.group_size or 1
    if group_size not in reduction_choices(table.profile, lanes, _masks(group))["group_size"]:
        raise FblcError(f"schedule of kernel '{group.name}': group_size {group_size} does not fit a tile of "
                        f"{lanes} accumulators", "choose a smaller group_size or tile")


def mask4_layouts(schedules: Mapping[str, Schedule], table: TextureTable, graph: ir.Graph) -> dict[str, TexelLayout]:
    """The r_mask4 layouts of the saved masks the schedules store that way, by value name."""
    wanted = {name for schedule in schedules.values() for name in schedule.mask4}
    layouts = {}
    for value in _values(graph):
        if value.name in wanted and value.name not in layouts:
            count = numel(static_shape(value))
            layouts[value.name] = mask_layout("mask4", count, *table.profile.placement_limits(-(-count // 4)))
    return layouts


def _values(graph: ir.Graph) -> list[ir.Value]:
    return list(graph.inputs) + list(graph.initializers.values()) + [v for n in graph for v in n.outputs if v is not None]
