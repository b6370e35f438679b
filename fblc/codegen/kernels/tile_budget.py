"""The register-tile budget every reducing family's schedule is chosen within (kernels/schedules.py,
kernels/conv_schedules.py): the target's accumulators per work-item against the work-items the device holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import onnx_ir as ir

from fblc.bundle_format import TEXEL_BYTES

from fblc.codegen.kernels import KernelGroup
from fblc.codegen.kernels.texel import LANES
from fblc.codegen.textures import TextureTable
from fblc.compiler import keys
from fblc.compiler.index_map import view_root
from fblc.compiler.values import numel, static_shape
from fblc.profiles.roofline import LaunchWork, launch_time

T = TypeVar("T")  # a candidate tile


@dataclass(frozen=True)
class TileBudget:
    """What a kernel's register tile is chosen within: R-Tile codegen or not (`tiled`: under naive, one texel
    row), the target's accumulators per work-item (`private`: Profile.private_floats), the work-items the
    device runs at once (`device_items`; 0 on a CPU, whose tiles keep their own rules), the kernel's output
    texels, whether it writes saved masks (`masks`: a work-item of an odd number of texels then takes two
    tiles, KernelBuilder.finish) and whether its reduction may be dealt out to a work-group (`splits`); on a
    GPU the target's profile (`profile`: its roofline weighs tiles that fill the device, TileBudget.pick) and
    the bytes of a texel fetched (`texel_bytes`)."""

    tiled: bool
    private: int
    device_items: int
    texels: int
    masks: bool
    splits: bool
    profile: Any = None
    texel_bytes: int = TEXEL_BYTES["rgba_f32"]

    @staticmethod
    def of(table: TextureTable, group: KernelGroup) -> "TileBudget":
        profile, masks = table.profile, bool(saved_masks(group))
        return TileBudget(table.tiled, profile.private_floats, 0 if profile.cpu else profile.device_items,
                          -(-numel(static_shape(group.outputs[0])) // LANES), masks, not masks,
                          None if profile.cpu else profile,
                          TEXEL_BYTES[table.float_format])

    def pick(self, candidates: Sequence[T], texels_per_item: Callable[[T], int],
             group: Callable[[T, int], int | None] | None = None, fallback: Sequence[T] = (),
             fetches: Callable[[T], float] | None = None, work: Callable[[T], float] | None = None) -> T:
        """Of `candidates` (largest tile first; each within `private`), the first whose items fill the device;
        told `fetches` and `work` too (a candidate's multiply-adds in one work-item alone) on a GPU, of it and
        the larger ones before it the one the roofline times fastest (TileBudget.roofline_ms): a larger tile
        reads each texel for more outputs, and its fewer work-items cost occupancy only where the arithmetic,
        not the texture units, bounds the launch;
        where none does and the reduction may be split: with `group` (the work-items that would share a
        candidate's reduction given its tiles: Profile.tile_group, capped by the reduction's length and
        loop), the first whose tiles x group fill it, then of the `fallback` tiles (smaller ones, without
        register reuse), else of all the one that comes closest (of equals, the larger tile); without it,
        the first (a work-group per tile is assumed to fill it and the tile keeps its register reuse).
        With `fetches` too (a candidate's texel fetches per step of its reduction), of all the one that
        fetches least in its slowest work-item (TileBudget.fetch_time): a smaller launch with register reuse
        beats one that fills the device by reading each texel for one output. Where it may not be split (saved
        masks: one work-item a tile), with `fetches` the candidate that fetches least in its slowest work-item
        (a larger tile reads each texel for more outputs where its fewer work-items still take one round),
        without them the last candidate (the most work-items)."""
        def paired(candidate: T) -> int:  # tiles a work-item runs in turn: 2 where a mask byte spans two
            return 2 if self.masks and texels_per_item(candidate) % 2 else 1

        def work_items(candidate: T) -> int:
            return self.texels // (paired(candidate) * texels_per_item(candidate))

        def launched(candidate: T) -> int:
            tiles = work_items(candidate)
            return tiles * ((group(candidate, tiles) or 1) if group is not None else 1)

        if self.device_items:
            filling = [c for c in candidates if work_items(c) >= self.device_items]
            if filling:
                if fetches is None or work is None or self.profile is None:
                    return filling[0]
                larger = candidates[:candidates.index(filling[0]) + 1]
                # of equal times the one of more work-items (resident waves hide latency, which the roofline omits)
                return min(reversed(larger), key=lambda c: self.roofline_ms(
                    work_items(c), (group(c, work_items(c)) or 1) if group is not None else 1,
                    paired(c) * fetches(c), paired(c) * work(c)))
            if not self.splits:  # one work-item a tile: the fewest fetches in its slowest one (or the most items)
                if fetches is None:
                    return candidates[-1]
                return min(candidates, key=lambda c: self.fetch_time(work_items(c), paired(c) * fetches(c)))
            if group is not None:
                everything = [*candidates, *fallback]
                if fetches is not None:  # min keeps the first (larger) of equal ones
                    return min(everything, key=lambda c: self.fetch_time(
                        launched(c), fetches(c) / (group(c, work_items(c)) or 1)))
                split = [c for c in everything if launched(c) >= self.device_items]
                return split[0] if split else max(everything, key=launched)
        return candidates[0]

    def roofline_ms(self, items: int, group: int, fetches: float, work: float) -> float:
        """The time fblc/profiles/roofline.py gives a launch of `items` tiles whose reduction `group` work-items
        share, each tile's `fetches` texel fetches and `work` multiply-adds (one issue slot a lane each): the
        slower of the arithmetic at the occupancy its waves give and the texture units' bytes. DRAM and the
        launch cost the same whatever the tile, and a split's merge is left out."""
        launched = items * group
        padded, local = self.profile.launch_size(launched)
        return launch_time(self.profile, LaunchWork(launched, padded, local, items * work, 0.0,
                                                    items * fetches * self.texel_bytes, 0.0)).ms

    def fetch_time(self, items: int, fetches: float) -> float:
        """A launch's time in texel fetches (`items` work-items of `fetches` each): the rounds of device_items
        it takes times one work-item's fetches, so a launch under device_items takes one round whatever
        lanes it leaves idle. A model: a phone GPU's texture units, not its ALUs, bound a contraction that
        reads a texel per output texel and K step; the multiply-adds and a split reduction's merge (a few
        barriers) are left out."""
        return -(-items // self.device_items) * fetches


def saved_masks(group: KernelGroup) -> list[ir.Value]:
    """The group's outputs that are saved masks (whose bytes pair texels of two work-items)."""
    return [value for value in group.outputs
            if keys.json_of(view_root(value).metadata_props, keys.LAYOUT, {}).get("kind") in ("mask8", "mask4")]
