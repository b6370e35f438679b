"""Every kernel group's schedule (fblc/codegen/schedule.py), decided before any kernel is built (docs/ARCHITECTURE.md
§3, "Schedules are data"): SCHEDULE_RULES by anchor op type, else one texel per work-item. A family whose work-item
reduces outputs together (`_reducing`: MatMul, Gemm, Conv, ConvTranspose) offers its reduction's fields as choices
and hands its emitter its geometry (`detail`: ConvPlan).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import onnx_ir as ir

from fblc.codegen.builder import lane_axis
from fblc.codegen.kernels import KernelGroup
from fblc.codegen.kernels.accumulators import VECTOR_TEXELS
from fblc.codegen.kernels.contraction import (Digits, matmul_operands, merged_rows, one_stride, row_digits,
                                               texel_columns, tile_fetches, tile_reduction)
from fblc.codegen.kernels.contraction_paths import row_axis
from fblc.codegen.kernels.conv_schedules import conv_schedule, conv_transpose_schedule
from fblc.codegen.kernels.movement import transpose_block
from fblc.codegen.kernels.normalize import has_statistics, item_texels, layer_norm_geometry
from fblc.codegen.kernels.reduce import REDUCTIONS, reduced_axes
from fblc.codegen.kernels.texel import LANES
from fblc.codegen.kernels.tile_budget import TileBudget, saved_masks
from fblc.codegen.reads import ValueReads
from fblc.codegen.schedule import (Schedule, apply_overrides, consecutive, group_choices, pairs_mask_bytes,
                                   pairs_rows, reduction_choices)
from fblc.codegen.schedule import tile as tile_of
from fblc.codegen.shape_key import shape_key
from fblc.codegen.textures import TextureTable
from fblc.passes.sort_topk import merge_texels
from fblc.compiler.index_map import common_digits, view_root
from fblc.compiler.values import attr, numel, static_shape
from fblc.errors import FblcError, UnsupportedOpError
from fblc.profiles.profile import REDUCTION_GROUP, Profile, private_limit
from fblc.texel_layout import TexelLayout, mask_bytes, mask_layout

TILE_ROWS = (8, 4)  # output rows of a contraction's tile, the first that divides the output's rows
TILE_COLUMNS = 2  # texels: a tile is 8 x 8 outputs (64 accumulators, as mobile GEMM kernels keep)
#: a contraction tile's rows a schedule file may choose: one, or multiples of 4 (the emitters read A's
#: rows of a tile as whole texels from a row that is a multiple of 4)
ROW_CHOICES = (1, 4, 8, 16)
COLUMN_CHOICES = (1, 2, 4)  # its texel columns
#: texel columns of a one-row tile, taken where no tile of TILE_ROWS rows divides the output's rows (M = 65
#: tokens under a batched B', which no tile may cross): each A element read once for 16 columns (ViT's
#: attention MatMuls on PoCL: 0.8-1.0 -> 0.26-0.43 ms; its MatMuls in all 25.2 -> 20.3 ms, with 2 columns 21.6)
ROW_TILE_COLUMNS = (4, 2)
#: rows of a row path's tile (N % 4 != 0: texels N apart, the same columns of rows 4 apart, which share each of
#: B's windows; contraction_paths.reduce_rows_apart), largest first, where its bands of rows divide the output's
#: texels (ViT's attention on PoCL buffers, one launch: Q K^T 0.33 -> 0.29 ms, dK^T 0.44 -> 0.21 ms)
ROWS_APART = (4, 2)
Rule = Callable[[TextureTable, KernelGroup], dict[str, Schedule]]
#: a reducing family's decision: (schedule, its geometry for the emitter, outputs reduced together; 0: per lane)
Reducing = Callable[[TextureTable, KernelGroup], tuple[Schedule, Any, int]]


def _reducing(decide: Reducing) -> Rule:
    """The rule of a family whose work-item reduces outputs together: their reduction's fields are choices
    (where the family offers its own values of one, e.g. a conv's group sizes, those)."""
    def rule(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
        schedule, detail, lanes = decide(table, group)
        schedule.detail = detail
        if lanes:
            schedule.choices = {**reduction_choices(table.profile, lanes, bool(saved_masks(group))),
                                **schedule.choices}
        return {group.name: schedule}

    return rule


#: the work-items that would share a contraction tile's reduction, given the tile and its count of tiles
Split = Callable[[tuple[int, int], int], int | None]


def tile_columns(profile: Profile) -> int:
    """Texel columns of a contraction's tile: TILE_COLUMNS, or where a SIMD register holds four texels (AVX-512:
    simd_floats 16) that many: each row's outputs one float16 accumulator (accumulators.VECTOR_TEXELS), one
    multiply-add per A element and K step (PoCL, one thread: GPT-2 2L h128's 40 contraction launches 13.0 ->
    11.0 ms a step)."""
    widest = VECTOR_TEXELS[-1]
    return widest if profile.simd_floats >= LANES * widest else TILE_COLUMNS


def _contraction_tile(budget: TileBudget, out_shape: tuple[int, ...], rows: int, column_texels: int | None,
                      split: Split | None = None,
                      fetches: Callable[[tuple[int, int]], float] | None = None,
                      columns: int = TILE_COLUMNS) -> tuple[Schedule, None, int]:
    """A contraction's tile: up to 8 x `columns` (tile_columns) texels, else 8 x TILE_COLUMNS, under R-Tile layouts where the output's rows and
    texel columns come in such groups (a tile reads each operand texel once for all its rows or columns),
    within the target's accumulators and by the device's size (TileBudget.pick, told by `split` the
    work-group each tile's reduction would really get, with one texel as the last resort); where no such
    group of rows exists, one row of ROW_TILE_COLUMNS texels; else one texel. `rows`, `column_texels`: the
    runs of rows and texel columns the operands step through by one stride (a folded axis's innermost digit);
    the tile's rows are whole output rows apart. `fetches`: a tile's texel fetches per K step
    (contraction.tile_fetches), by which split tiles and one texel per item are weighed where no tile fills
    the device alone (TileBudget.pick)."""
    row_texels = out_shape[-1] // LANES
    run = row_texels if column_texels is None else column_texels
    wide = next((c for c in (columns, TILE_COLUMNS) if row_texels % c == 0 and run % c == 0), 1)
    tiles = [(n, c) for n in TILE_ROWS for c in sorted({wide, 1}, reverse=True)
             if rows % n == 0 and n * c * LANES <= budget.private]
    if not tiles:
        tiles = [(1, c) for c in ROW_TILE_COLUMNS if row_texels % c == 0 and run % c == 0 and c * LANES <= budget.private]
    if budget.tiled and tiles:
        tiles.sort(key=lambda tile: -tile[0] * tile[1])  # the largest first; of equal ones, more rows
        tile_rows, columns = budget.pick(tiles, lambda tile: tile[0] * tile[1], split, [(1, 1)] if split else (),
                                         fetches)
        # one row: `columns` texel columns as _contract reads them (tile_of would make them rows)
        schedule = (tile_of(tile_rows, columns, row_texels) if tile_rows > 1
                    else Schedule(tile_rows=1, tile_columns=columns, tile_stride=row_texels))
    else:
        schedule = consecutive(1)
    # one field at a time (as fblc tune varies them): each offered value within the accumulators with the other's
    schedule.choices = {"tile_rows": tuple(n for n in ROW_CHOICES if rows % n == 0
                                           and n * schedule.tile_columns * LANES <= budget.private),
                        "tile_columns": tuple(n for n in COLUMN_CHOICES if row_texels % n == 0 and run % n == 0
                                              and schedule.tile_rows * n * LANES <= budget.private)}
    return schedule, None, LANES * schedule.texels_per_item


def _tile_split(table: TextureTable, group: KernelGroup, k_digits: Digits | None) -> Split | None:
    """What Profile.tile_group deals a tile's reduction over K (cut into `k_digits`, outermost first) out
    to (contraction.tile_reduction: its length and the loop a group shares); None where that is unknown or
    its tiles may not be split (saved masks)."""
    profile = table.profile
    if k_digits is None or saved_masks(group):
        return None
    return lambda tile, tiles: profile.tile_group(*tile_reduction(k_digits, *tile), LANES * tile[0] * tile[1], tiles)


def _matmul(table: TextureTable, group: KernelGroup) -> tuple[Schedule, Any, int]:
    out_shape = static_shape(group.outputs[0])
    (_, a_axes), (_, w_axes) = matmul_operands(ValueReads(table, out_shape), group.anchor)
    a_rank, b_rank = (len(static_shape(value)) for value in group.anchor.inputs)
    k_digits = common_digits([a_axes[-1], w_axes[-2]])
    # rows each from their own base (merged rows no one stride apart) share no texel of A: as if rows were far apart
    merged = merged_rows(a_axes, w_axes) and row_digits(a_axes)  # rows over batch x M: their innermost real digit
    a_row = (0 if not one_stride(row_digits(a_axes)) else row_digits(a_axes)[-1][1]) if merged else a_axes[-2][-1][1]
    fetches = None if k_digits is None else tile_fetches(k_digits[0][-1][1], a_row, k_digits[1][-1][1],
                                                         w_axes[-1][-1][1])
    if not (a_rank >= 2 and texel_columns(out_shape, w_axes, b_rank >= 2)):
        # a row path's tile shares B's windows along N; where K runs along B's lanes (dO V^T) a texel reads
        # whole texels of B already, and the tile measured slower (ViT's on PoCL: 0.30 -> 0.45 ms)
        windows = k_digits is not None and k_digits[1][-1][1] != 1
        row_path = (_rows_apart(table, group, out_shape, a_axes[-2], fetches) if a_rank >= 2 and b_rank >= 2 and windows
                    else consecutive(1))
        return row_path, None, 0
    rows = merged_rows(a_axes, w_axes) or a_axes[-2][-1][0]
    return _contraction_tile(TileBudget.of(table, group), out_shape, rows, w_axes[-1][-1][0] // LANES,
                             _tile_split(table, group, k_digits[0] if k_digits else None), fetches,
                             tile_columns(table.profile))


def _rows_apart(table: TextureTable, group: KernelGroup, out_shape: tuple[int, ...], a_rows: Digits,
                fetches: Callable[[tuple[int, int]], float] | None) -> Schedule:
    """A row path's tile (contraction_paths.rows_apart) under R-Tile layouts: ROWS_APART rows where a band of 4 x rows
    rows of N elements (rows x N texels) divides the output's texels and a batch matrix's rows hold such a tile,
    and A's rows 4 apart are 4 row strides apart (a folded row axis, heads merged after a transpose, only where
    its innermost digit holds whole bands: rows 4 apart would otherwise fall in another head),
    by the device's size (TileBudget.pick: one texel a work-item where the tiles would leave it idle and
    fetch no less); else one texel."""
    row, budget = row_axis(out_shape), TileBudget.of(table, group)
    if row is None or row[0] != len(out_shape) - 1 or not budget.tiled:
        return consecutive(1)
    n, m = out_shape[-1], out_shape[-2]
    tiles = [(r, 1) for r in ROWS_APART if budget.texels % (r * n) == 0 and LANES * (r - 1) < m
             and (len(a_rows) == 1 or a_rows[-1][0] % (LANES * r) == 0)
             and r * LANES <= budget.private]
    if not tiles:
        return consecutive(1)
    rows, _ = dataclasses.replace(budget, splits=False).pick([*tiles, (1, 1)], lambda tile: tile[0], fetches=fetches)
    return Schedule(tile_rows=rows, tile_columns=1, tile_stride=n) if rows > 1 else consecutive(1)


def _gemm(table: TextureTable, group: KernelGroup) -> tuple[Schedule, Any, int]:
    out_shape = static_shape(group.outputs[0])
    if lane_axis(out_shape) != 1:
        return consecutive(1), None, 0
    a_shape = static_shape(group.anchor.inputs[0])
    trans_a, trans_b = attr(group.anchor, "transA", 0), attr(group.anchor, "transB", 0)
    k = a_shape[0] if trans_a else a_shape[1]
    m, n = out_shape
    fetches = tile_fetches(m if trans_a else 1, 1 if trans_a else k, 1 if trans_b else n, k if trans_b else 1)
    return _contraction_tile(TileBudget.of(table, group), out_shape, out_shape[0], None,
                             _tile_split(table, group, [(k, 1)]), fetches, tile_columns(table.profile))


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


def _merge_runs(table: TextureTable, group: KernelGroup) -> dict[str, Schedule]:
    texels = table.of(group.outputs[0]).texels
    return {group.name: consecutive(merge_texels(int(attr(group.anchor, "run")), texels))}


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
    "MatMul": _reducing(_matmul), "Gemm": _reducing(_gemm), "Conv": _reducing(conv_schedule),
    "ConvTranspose": _reducing(conv_transpose_schedule), **dict.fromkeys(REDUCE_OPS, _reduce),
    "LayerNormalization": _layer_norm, "InstanceNormalization": _layer_norm, "Transpose": _transpose,
    "MergeRuns": _merge_runs,
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
        if pairs_mask_bytes(schedule):
            continue
        # a byte's two consecutive texels would lie in two work-items' tiles: bytes that pair the tile's rows
        # (one bit per element still), else r_mask4 (two)
        masks = tuple(view_root(value).name for value in saved_masks(owners[name]))
        if pairs_rows(schedule):
            schedule.paired_masks = masks
        else:
            schedule.mask4 = masks
    return schedules


def _refine(table: TextureTable, group: KernelGroup, schedule: Schedule) -> None:
    """What follows from a schedule file's fields: a contraction tile's rows stay whole output rows apart,
    and its accumulators within profile.private_limit."""
    if "tile_rows" not in schedule.choices:  # not a contraction's tile (_contraction_tile)
        return
    row_texels = static_shape(group.outputs[0])[-1] // LANES
    schedule.tile_stride = row_texels if schedule.texels_per_item > 1 else 1
    lanes = LANES * schedule.texels_per_item
    limit = private_limit(table.profile.cpu)
    if lanes > limit:
        raise FblcError(f"schedule of kernel '{group.name}': a tile of {schedule.tile_rows} x {schedule.tile_columns} "
                        f"texels holds {lanes} accumulators, more than the {limit} a work-item keeps",
                        f"choose tile_rows x tile_columns x 4 <= {limit}")
    group_size = schedule.group_size or 1
    if group_size not in reduction_choices(table.profile, lanes, bool(saved_masks(group)))["group_size"]:
        raise FblcError(f"schedule of kernel '{group.name}': group_size {group_size} does not fit a tile of "
                        f"{lanes} accumulators", "choose a smaller group_size or tile")


def mask_layouts(schedules: Mapping[str, Schedule], table: TextureTable, graph: ir.Graph) -> dict[str, TexelLayout]:
    """The layouts of the saved masks whose writers' tiles split consecutive texels, by value name: r_mask4, or
    r_mask8 with bytes pairing the tile's rows (mask_pair_stride: its tile_stride)."""
    wanted = {name: ("mask4", 1) for schedule in schedules.values() for name in schedule.mask4}
    wanted.update({name: ("mask8", schedule.tile_stride) for schedule in schedules.values()
                   for name in schedule.paired_masks})
    layouts = {}
    for value in [*graph.inputs, *graph.initializers.values(), *(v for n in graph for v in n.outputs)]:
        if value is not None and value.name in wanted and value.name not in layouts:
            kind, pair = wanted[value.name]
            count = numel(static_shape(value))
            limits = table.profile.placement_limits(mask_bytes(kind, -(-count // 4), pair))
            layouts[value.name] = mask_layout(kind, count, *limits, pair_stride=pair)
    return layouts
