"""Schedules as data: how a kernel's work is cut up, decided before the kernel is built (docs/ARCHITECTURE.md §3,
"Schedules are data"). Fields left None are decided where the reduction's length and products are known
(`resolve_*`) unless a schedule file fixed them (`apply_overrides`); the builder records what was used (plan.json).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from fblc.codegen.kernels.accumulators import FORMS, choose_form, float4_count, pairings, vector_texels
from fblc.errors import FblcError
from fblc.profiles import Profile
from fblc.profiles.profile import SERIAL_REDUCTION, SHARED_TILE_FLOATS, SOURCE_KINDS

#: the fields a schedule file may name (a kernel's `choices` say which of them it takes)
OVERRIDABLE = ("tile_rows", "tile_columns", "group_size", "accumulator_form", "pair_stride")
SHAPE_SEPARATOR = "/"  # in a shape key (codegen/shape_key.py), never in a kernel name (k12_Conv)
#: what an entry may say about itself besides its fields: where its values came from (`fblc tune` writes
#: "measured: fblc tune DATE DEVICE"), the kernel shape it is for, the times that chose it
ABOUT = ("source", "shape", "measured_ms")
EXAMPLE = ('write an object like {"k3_Gemm": {"tile_rows": 2}} (by kernel name) or {"Gemm/0123456789abcdef": '
           '{"tile_rows": 2, "source": "measured: ..."}} (by the shape_key plan.json records)')


@dataclass
class Schedule:
    """One kernel's schedule (see the module docstring); `choices`: its overridable fields' valid values."""

    tile_rows: int = 1
    tile_columns: int = 1
    tile_stride: int = 1
    group_size: int | None = None  # None: decided at the reduction; 1: one work-item per item
    tiles_per_group: int = 1
    accumulator_form: str | None = None  # None: decided at the reduction (or the kernel has none)
    pair_stride: int | None = None
    pair_width: int = 2  # float4s a paired accumulator vector holds: 2 (float8) or 4 (float16), set with pair_stride
    mask4: tuple[str, ...] = ()  # saved masks this kernel writes as r_mask4 (its tile splits their bytes)
    #: saved masks this kernel writes as r_mask8 whose bytes pair its tile's rows, tile_stride apart (pairs_rows)
    paired_masks: tuple[str, ...] = ()
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict, repr=False, compare=False)
    fixed: frozenset[str] = field(default=frozenset(), repr=False, compare=False)  # fields a file set
    shape_key: str = field(default="", repr=False, compare=False)  # codegen/shape_key.py: what decides the kernel
    detail: Any = field(default=None, repr=False, compare=False)  # the family's geometry behind the fields

    @property
    def texels_per_item(self) -> int:
        return self.tile_rows * self.tile_columns

    @property
    def vector_width(self) -> int:
        """Floats per accumulator variable: 8 or 16 grouped float4s, 4 float4s, 1 scalar lanes (or no reduction)."""
        return 4 * self.pair_width if self.pair_stride else 4 if self.accumulator_form in ("texels", "sums") else 1

    def decided(self) -> dict[str, Any]:
        """The schedule as decided before its kernel is built (None: decided at the reduction)."""
        return {"tile_rows": self.tile_rows, "tile_columns": self.tile_columns, "tile_stride": self.tile_stride,
                "group_size": self.group_size, "accumulator_form": self.accumulator_form,
                "pair_stride": self.pair_stride, "mask4": list(self.mask4), "paired_masks": list(self.paired_masks)}

    def record(self) -> dict[str, Any]:
        """The schedule as plan.json records it, with the values a schedule file may give each field it takes."""
        return {"tile_rows": self.tile_rows, "tile_columns": self.tile_columns, "tile_stride": self.tile_stride,
                "texels_per_item": self.texels_per_item, "group_size": self.group_size or 1,
                "tiles_per_group": self.tiles_per_group, "accumulator_form": self.accumulator_form,
                "pair_stride": self.pair_stride or 0, "vector_width": self.vector_width, "mask4": list(self.mask4),
                "paired_masks": list(self.paired_masks),
                "choices": {key: list(values) for key, values in self.choices.items()},  # what a file may set
                "shape_key": self.shape_key}


def consecutive(texels: int) -> Schedule:
    """A work-item of `texels` consecutive texels."""
    return Schedule(tile_rows=texels)


def tile(rows: int, columns: int, stride: int) -> Schedule:
    """A work-item's 2-D tile: `rows` rows `stride` texels apart, each `columns` consecutive texels
    (one row: `columns` consecutive texels)."""
    if rows == 1:
        return consecutive(columns)
    assert stride % columns == 0, f"a tile of {columns} texel columns in rows {stride} texels apart"
    return Schedule(tile_rows=rows, tile_columns=columns, tile_stride=stride)


def pairs_mask_bytes(schedule: Schedule) -> bool:
    """A work-item's texels hold both texels of every mask byte they touch: consecutive texels (odd counts
    run two items in turn, KernelBuilder.finish), or a 2-D tile's rows of an even number of texels, an even
    number apart."""
    columns, stride = schedule.tile_columns, schedule.tile_stride
    return stride <= columns or (columns % 2 == 0 and stride % 2 == 0)  # stride <= columns: no 2-D tile


def pairs_rows(schedule: Schedule) -> int:
    """The stride P of the texels a mask8 byte pairs that every work-item of `schedule` holds both of where
    consecutive texels lie in two (pairs_mask_bytes false): rows 2j and 2j + 1 of a 2-D tile of an even number
    of rows (its bands of rows x P texels start at multiples of 2P, its columns at offsets below P); 0 where the
    tile has none (an odd number of rows, or no 2-D tile)."""
    columns, rows, stride = schedule.tile_columns, schedule.tile_rows, schedule.tile_stride
    return stride if rows % 2 == 0 and stride > columns else 0


def group_choices(profile: Profile, lanes: int) -> tuple[int, ...]:
    """Work-items a tile's reduction may be dealt out to: 1, or powers of two within the device's
    max_work_group_size and SHARED_TILE_FLOATS of partials (`lanes` per work-item)."""
    bound = min(profile.max_work_group_size, SHARED_TILE_FLOATS // max(1, lanes))
    return (1,) + tuple(2 ** k for k in range(1, 16) if 2 ** k <= bound)


def reduction_choices(profile: Profile, lanes: int, masks: bool, trips: int | None = None
                      ) -> dict[str, tuple[Any, ...]]:
    """The overridable fields of a kernel whose work-item reduces `lanes` outputs together (`masks`: it
    writes saved masks, whose bytes pair texels of two work-items, so it keeps one work-item per tile;
    `trips`, where known: the iterations of the loop a work-group deals out, 0 where there is none; a group
    takes up to the least power of two that leaves each work-item one iteration, as Profile.loop_group).
    Float4 forms need whole texels; the pairings offered here suit some form, the ones of the form taken
    replace them when the kernel is built (offered_pairings)."""
    groups = (1,) if masks else tuple(g for g in group_choices(profile, lanes) if trips is None or g < 2 * trips
                                      or g == 1)
    return {"group_size": groups, "accumulator_form": FORMS if lanes % 4 == 0 else ("lanes",),
            "pair_stride": pairings(lanes) if lanes % 4 == 0 else (0,)}


def offered_pairings(form: str, lanes: int) -> tuple[int, ...]:
    """The pair_stride values a kernel of `lanes` accumulators in `form` takes (resolve_pair refuses the others)."""
    return pairings(float4_count(form, lanes)) if form != "lanes" else (0,)


def resolve_group(schedule: Schedule, profile: Profile, serial: int, trips: int, lanes: int, tiles: int,
                  masks: bool) -> int | None:
    """Work-items sharing each tile's reduction of `serial` multiply-adds per accumulator (its longest
    dealt loop `trips` long; Profile.tile_group), or the file's group_size; None: one work-item."""
    if schedule.group_size is not None:
        return schedule.group_size if schedule.group_size > 1 else None
    return None if masks else profile.tile_group(serial, trips, lanes, tiles)


def resolve_form(schedule: Schedule, profile: Profile, products: Sequence[tuple[int, int, int]], lanes: int,
                 serial: int, widest: int = 2) -> str:
    """The accumulator form (accumulators.choose_form on one block's products, float4s grouped up to `widest`
    to a vector), or the file's."""
    if schedule.accumulator_form is not None and "accumulator_form" in schedule.fixed:
        return schedule.accumulator_form
    return choose_form(products, lanes, serial > SERIAL_REDUCTION, profile.cpu, profile.simd_floats, widest)


def resolve_pair(schedule: Schedule, profile: Profile, products: Sequence[tuple[int, int, int]], form: str,
                 lanes: int, kernel: str, widest: int = 2) -> tuple[int, int]:
    """(the pairing stride, float4s a vector: accumulators.vector_texels up to `widest`), or the file's stride
    (float8s), checked against the form's float4s."""
    if "pair_stride" not in schedule.fixed or schedule.pair_stride is None:
        width, stride = vector_texels(products, form, lanes, profile.simd_floats, widest)
        return stride, width
    stride, count = schedule.pair_stride, float4_count(form, lanes) if form != "lanes" else 0
    valid = offered_pairings(form, lanes)
    if stride not in valid:
        raise FblcError(f"schedule of kernel '{kernel}': pair_stride {stride} does not pair its {count} float4 "
                        f"accumulators (form '{form}')", f"choose one of: {', '.join(map(str, valid))}")
    return stride, 2


def is_shape_key(name: str) -> bool:
    """Whether a schedules entry is keyed by kernel shape (codegen/shape_key.py: "Gemm/<digest>"), not by name."""
    return SHAPE_SEPARATOR in name


def load_overrides(path: str | None, profile: Profile) -> dict[str, dict[str, Any]]:
    """Schedule overrides by kernel name or kernel shape key: the profile's `schedules` section (a shape's
    entry says where its values came from in `source`, like every figure), then the file's (`fblc compile
    --schedules FILE`: a JSON object, kernel name or shape key -> {field: value}) over it."""
    where = f"profile '{profile.name}'"
    raw_profile = profile.raw.get("schedules", {})
    overrides = _overrides_object(raw_profile, where)
    for key, fields in raw_profile.items():
        source = fields.get("source") if isinstance(fields, dict) else None
        if is_shape_key(str(key)) and not (isinstance(source, str) and source.startswith(SOURCE_KINDS)):
            raise FblcError(f"{where}: schedules entry '{key}' has source {source!r}",
                            f"give it a source starting with one of: {', '.join(SOURCE_KINDS)} (fblc tune writes "
                            "'measured: fblc tune DATE DEVICE')")
    if path is None:
        return overrides
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except OSError as error:
        raise FblcError(f"cannot read the schedule file '{path}': {error.strerror}", "check the path") from None
    except json.JSONDecodeError as error:
        raise FblcError(f"schedule file '{path}' is not JSON: {error}", EXAMPLE) from None
    for name, fields in _overrides_object(raw, f"schedule file '{path}'").items():
        overrides[name] = {**overrides.get(name, {}), **fields}
    return overrides


def _overrides_object(raw: Any, source: str) -> dict[str, dict[str, Any]]:
    """The entries' fields by kernel name or shape key (what an entry says about itself, ABOUT, left out)."""
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise FblcError(f"{source}: schedules must be an object of kernel name -> {{field: value}}", EXAMPLE)
    return {str(name): {k: v for k, v in fields.items() if k not in ABOUT} for name, fields in raw.items()}


def by_kernel(overrides: Mapping[str, Mapping[str, Any]], shape_keys: Mapping[str, str]
              ) -> dict[str, tuple[dict[str, Any], str]]:
    """Each kernel's overrides and what gave them ("kernel 'k3_Gemm'" or "kernel shape 'Gemm/...'
    (kernel 'k3_Gemm')"): its shape's entry (`shape_keys`: kernel name -> shape key), then its name's over
    it. A shape no kernel of this step has is skipped (a profile's entries serve every model); an unknown
    kernel name is an FblcError naming the kernels there are."""
    found: dict[str, tuple[dict[str, Any], str]] = {}
    for name, key in shape_keys.items():
        if key in overrides:
            found[name] = (dict(overrides[key]), f"kernel shape '{key}' (kernel '{name}')")
    for name, fields in overrides.items():
        if is_shape_key(name):
            continue
        if name not in shape_keys:
            listed = sorted(shape_keys, key=_launch_order)
            raise FblcError(f"schedule override for kernel '{name}', which this step does not have",
                            f"name one of its kernels: {', '.join(listed[:40])}{' ...' if len(listed) > 40 else ''}")
        shaped = found.get(name, ({}, ""))[0]
        found[name] = ({**shaped, **fields}, f"kernel '{name}'")
    return found


def apply_overrides(schedules: Mapping[str, Schedule], overrides: Mapping[str, Mapping[str, Any]],
                    refine: Callable[[str, Schedule], None], shape_keys: Mapping[str, str] | None = None) -> None:
    """Set each override's fields on its kernel's schedule (by name, or by shape key: `shape_keys`, kernel
    name -> key, also recorded on the schedules), every one checked first: an unknown kernel, an unknown
    field, a field the kernel does not take or a value outside its choices is an FblcError naming them and
    what is valid. `refine(name, schedule)` re-derives what follows from changed fields."""
    keys = dict(shape_keys) if shape_keys is not None else {name: "" for name in schedules}
    for name, key in keys.items():
        schedules[name].shape_key = key
    for name, (fields, given) in by_kernel(overrides, keys).items():
        schedule = schedules[name]
        for key, value in fields.items():
            if key not in OVERRIDABLE:
                raise FblcError(f"schedule override for {given}: unknown field '{key}'",
                                f"the fields are: {', '.join(OVERRIDABLE)}")
            valid = schedule.choices.get(key)
            if valid is None:
                offered = ", ".join(schedule.choices) or "none"
                raise FblcError(f"schedule override for {given}: its schedule has no choice of '{key}'",
                                f"the fields it takes: {offered}")
            if isinstance(value, bool) or value not in valid:
                raise FblcError(f"schedule override for {given}: {key} {value!r} is not valid for it",
                                f"choose one of: {', '.join(map(str, valid))}")
        for key, value in fields.items():
            setattr(schedule, key, value)
        schedule.fixed = schedule.fixed | frozenset(fields)
        refine(name, schedule)


def _launch_order(name: str) -> tuple[int, str]:
    digits = name[1:].split("_", 1)[0]
    return (int(digits) if digits.isdigit() else 1 << 30, name)

