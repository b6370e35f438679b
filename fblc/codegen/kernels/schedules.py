"""Every kernel group's schedule (fblc/codegen/schedule.py), decided before any kernel is built.

One rule per anchor op type (SCHEDULE_RULES) turns the group's sizes and the target profile into the
kernels' `Schedule`s, by kernel name; the emitters then take them (KernelBuilder.schedule) instead of
deciding. Groups without a rule get one texel per work-item. The rules are the decisions the emitters
made while writing C, moved here unchanged:
- MatMul / Gemm on their texel path under R-Tile codegen: a tile of the first of TILE_ROWS output rows
  that divides the rows, by TILE_COLUMNS texel columns where the row's texels come in such runs.
- Conv / ConvTranspose: conv.conv_plan / conv_transpose.transpose_plan (channel, spatial, batch rows).
- Reductions and row statistics: a work-group per output when the reduced run is long
  (Profile.reduction_group); LayerNormalization's output: the texels of a row (normalize._item_texels).
Then a schedule file's overrides, and the saved masks whose bytes a 2-D tile splits (r_mask4).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import onnx_ir as ir

from fblc.codegen.builder import lane_axis
from fblc.codegen.kernels import KernelGroup
from fblc.codegen.kernels.contraction import _root_digits
from fblc.codegen.kernels.conv import conv_plan
from fblc.codegen.kernels.conv_transpose import transpose_plan
from fblc.codegen.kernels.normalize import _has_statistics, _item_texels, _layer_norm_geometry
from fblc.codegen.kernels.reduce import reduced_axes
from fblc.codegen.reads import ValueReads
from fblc.codegen.schedule import (Schedule, apply_overrides, consecutive, group_choices, pairs_mask_bytes,
                                   reduction_choices, tile)
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
ROW_CHOICES = (1, 2, 4, 8, 16)  # a contraction tile's rows a schedule file may choose
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
        schedule = tile(tile_rows, columns, row_texels)
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
    (_, a_axes), (_, w_axes) = _root_digits(reads, a, a2), _root_digits(reads, w, b2)
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
    plan, schedule = conv_plan(table.tiled, ValueReads(table, static_shape(group.outputs[0])), group.anchor)
    schedule.detail = plan
    lanes = plan.tile.lanes if plan.tile is not None else plan.row[2] * LANES * plan.row[4] if plan.row else 0
    if lanes:
        schedule.choices = reduction_choices(table.profile, lanes, _masks(group))
    return {group.name: schedule}


@rule("ConvTranspose")
def _conv_transpose(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    plan, schedule, lanes = transpose_plan(table.tiled, group.anchor)
    schedule.detail = plan
    if lanes:
        schedule.choices = reduction_choices(table.profile, lanes, _masks(group))
    return {group.name: schedule}


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
    _, _, count = _layer_norm_geometry(node)
    if _has_statistics(node):
        return {f"{group.name}_stats": _row_group(table, count), group.name: consecutive(1)}
    return {group.name: consecutive(_item_texels(count // 4) if count % 4 == 0 else 1)}


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
