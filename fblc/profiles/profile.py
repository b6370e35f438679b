"""The target profile: device facts fblc compiles for, each with where it came from.

A profile is JSON: `name`, `vendor`, `gpu`, `opencl_version`, then `figures`, one entry per
fact, `{"value": V, "source": S}`. S says where V came from and must start with one of
"measured" (by `fblc profile`, with the date and device), "vendor documentation:",
"paper:" (with the citation), or "estimated" (with the reasoning). Loading validates every
figure (present, of the right type, possible) and fails with what to fix.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from fblc.errors import FblcError

#: figure -> (type, unit / meaning). Integers must be positive.
FIGURES: dict[str, tuple[type, str]] = {
    "image2d_max_width": (int, "texels"),
    "image2d_max_height": (int, "texels"),
    "wave_size": (int, "work-items per wave / warp / subgroup"),
    "max_work_group_size": (int, "work-items"),
    "fp16": (bool, "cl_khr_fp16: kernels compute in half under --dtype fp16; half textures need no figure"),
    "cpu": (bool, "a CPU: a work-item's float4 is one SIMD register, a work-group's items run in turn on one core"),
    "simd_floats": (int, "floats one SIMD instruction of a work-item takes (CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT)"),
    "subgroups": (bool, "sub-group built-ins (cl_khr_subgroups): group reductions merge within sub-groups first"),
    "local_staging": (bool, "a work-group's copy of its shared texels in __local memory costs less than its work-items' "
                            "image reads of them (codegen/kernels/staging.py)"),
    "tex_block_width": (int, "texels per texture-cache block, horizontally"),
    "tex_block_height": (int, "texels per texture-cache block, vertically"),
    "line_bytes": (int, "bytes per cache line"),
    "l1_bytes": (int, "texture L1 capacity, bytes"),
    "l1_ways": (int, "texture L1 associativity"),
    "l2_bytes": (int, "L2 capacity, bytes"),
    "bandwidth_gbps": (float, "DRAM bandwidth, GB/s"),
    "peak_gflops": (float, "fp32 peak, GFLOP/s"),
    "compute_units": (int, "compute units: shader processors / cores (CL_DEVICE_MAX_COMPUTE_UNITS)"),
    "waves_per_unit": (int, "waves a compute unit runs at once: its fp32 lanes / wave_size"),
    "private_floats": (int, "accumulator floats a work-item keeps in registers at full occupancy (a tile's limit)"),
    "half_rate": (float, "half arithmetic throughput over fp32's (lane-operations a clock; 1: half computes as float)"),
    "launch_us": (float, "host-to-GPU cost of one kernel launch in an in-order queue, microseconds"),
    "texture_bytes_per_clock": (int, "bytes a compute unit's texture L1 returns a clock (whole texels)"),
    "image2d_from_buffer": (bool, "cl_khr_image2d_from_buffer: images over sub-ranges of one arena buffer, so textures "
                                  "of any format and size share device memory (codegen/arena.py)"),
    "image_pitch_alignment": (int, "bytes an image-over-buffer's row pitch and start are multiples of "
                                   "(CL_DEVICE_IMAGE_PITCH_ALIGNMENT, CL_DEVICE_IMAGE_BASE_ADDRESS_ALIGNMENT: pixels, "
                                   "the larger, times the widest texel a bundle's images have)"),
    "base_address_alignment": (int, "bytes a sub-buffer's origin is a multiple of (CL_DEVICE_MEM_BASE_ADDR_ALIGN / 8)"),
}
#: The image edge, in texels, that every OpenCL device fblc targets allows: the PoCL that pip installs
#: (pocl-binary-distribution 3.0), oclgrind and most phone drivers stop at 8192 x 8192, while some
#: targets' profiles allow 16384 or more. A texture is placed within this edge whenever it fits, so a
#: bundle compiled for any target runs on all of them; only a larger one uses its target's own limit.
PORTABLE_IMAGE_EDGE = 8192
#: work-items a launch's work-group aims at: enough waves per group to hide texture latency (Adreno's and
#: Mali's OpenCL guides recommend 64 to 128), within the device's max_work_group_size
GROUP_ITEMS = 64
#: texels (float4) a kernel's staging copies may hold together: 32 KiB, the least CL_DEVICE_LOCAL_MEM_SIZE of
#: OpenCL's full profile (PoCL's CPU device offers more; a GPU's __local is its L1, where 32 KiB is common)
LOCAL_TEXELS = 2048
#: an operand is staged where its group's copy is at most this fraction of the group's own reads of it: the
#: barriers and the copy's __local stores and loads take the rest (benchmarks/staging_trial.py: T-ResNet's k8,
#: reads 11.8M -> 2.2M, its time 0.50x)
STAGE_GAIN = 0.5
#: what a staged block costs a work-group beyond its texel reads (its two barriers and copy loops), in texel reads
#: of a device that stages (local_staging: PoCL): fitted to MobileNetV2 [8,3,97,60] kernels that read about as
#: many texels per work-item in groups of 32 or 64 as in groups of 240 and took 1.2-1.45x the time (k42, k75:
#: 1.5-1.8 us more per group and block, 250-300 reads of ~6 ns, benchmarks/image_read_forms.py)
STAGED_BLOCK_READS = 256
#: what a texel read left to each work-item of a staged kernel costs there, in the copies' texel reads: fitted to
#: MobileNetV2's k20 and k123, which ran 1.3-1.4x slower staging one operand in groups of 224 than both in groups
#: of 56 (fewer reads counted alike; the device compiler can vectorise a block's arithmetic only once none of
#: its reads is a call)
UNSTAGED_READ_WEIGHT = 2
#: the fewest blocks of a staged reduction (its copies' barriers, per work-item) whose work-items carry their slots
#: and accumulators across the barriers as codegen/kernels/carried.py writes them, on a `cpu` device (PoCL, one
#: thread, each launch timed against its twin in turns: benchmarks/launch_times.py --against, image storage):
#: MobileNetV2 [8,3,97,60]'s step 350 -> 313 ms and T-ResNet B=64's 639 -> 528 ms with 4; with 1, MobileNetV2's
#: kernels of 1 or 2 blocks gained and lost alike (k88 -1.4 ms, k73 +2.0 ms; the step 349 -> 346 ms)
CARRIED_BLOCKS = 4
#: the longest run one work-item folds alone; a longer reduction is shared by a work-group
SERIAL_REDUCTION = 1024
#: the longest reduction per weight element (batch x dY map: the weight-gradient conv's kernel) whose weight
#: gradient a `cpu` target's conv writes in W's own order, so that the optimizer's update joins it (passes/
#: tile_remap.py): measured on PoCL (benchmarks/step_time.py --threads 1 --clock cpu, 2 runs each): the
#: transformers ResNet-4, reductions of 16 to 1,024, took 12-14 % less per step; T-ResNet B=64, 3,840, 3-7 %
#: more, its channel tile sharing each x window across 4 output channels where the written tile shares fewer
WRITTEN_WEIGHT_GRADIENT_REDUCTION = 2048
#: the fewest steps (elements, or multiply-adds per accumulator) each work-item of a group keeps when a
#: shorter reduction is shared only to fill the device: below it the merge through __local memory (a
#: barrier per tree level) costs about what the split saves
SPLIT_STEPS = 16
#: the most updates a row scatter's target row scans one by one; a longer line of updates is sorted by
#: row number first (pass sort_scatter_rows: log2(N) merge launches, then a binary search per row)
SORTED_SCATTER_UPDATES = 64
#: the longest line TopK's kernel always ranks directly (each of k outputs scans the line once per rank
#: before it: n k (k + 1) / 2 reads a line); a longer one is merge-sorted when that costs fewer reads (pass
#: sort_topk: O(n log k) reads, sort_reads, in ceil(log2 n) launches)
SORTED_TOPK_LINE = 64
#: the floats one work-item's accumulators may take at most on a GPU target: an 8 x 8 tile, what mobile GEMM
#: kernels keep in registers (Adreno's and Mali's guides: more spills to private memory, which is device
#: memory). A target's own limit is its `private_floats` figure (Profile.private_floats), at most this.
PRIVATE_FLOATS = 64
#: the same limit on a `cpu` profile: a work-item there runs alone in a core's 32 SIMD registers (x86-64 with
#: AVX-512, arm64), not beside hundreds of others in a shared register file; 128 floats are 16 float8s, half
#: of them, the rest holding a block's operands (private_limit)
CPU_PRIVATE_FLOATS = 128


def private_limit(cpu: bool) -> int:
    """The most accumulator floats a work-item may keep on a CPU (`cpu`) or GPU target."""
    return CPU_PRIVATE_FLOATS if cpu else PRIVATE_FLOATS


#: the float4 partial sums a work-item keeps where its float4 is one SIMD register (a `cpu` profile):
#: of the 32 vector registers of x86-64 with AVX-512 or of arm64, the rest hold a block's operands
SIMD_SUM_FLOAT4S = 24
#: the same where a SIMD register holds two float4s (simd_floats >= 8: the sums pair into float8s): 20 of the
#: 32 registers. Measured on PoCL (x86-64, AVX-512; one thread, process CPU time, min of 5): T-ResNet B=64's
#: 5-tap weight gradients, 2 batch elements x 4 channels x 5 taps in float8 sums instead of 4 x 5 (each dY
#: texel read for 40 outputs, not 20), 15.0 -> 11.6 ms in buffers, 114 -> 75 ms in images; MobileNetV2
#: [8,3,97,60]'s step in buffers 157 -> 140 ms, its 8-channel tiles summing float8s instead of texels
PAIRED_SUM_FLOAT4S = 40
#: the most images one kernel reads: OpenCL 1.2's least CL_DEVICE_MAX_READ_IMAGE_ARGS, what every
#: device takes (the fuse pass merges elementwise chains only within it)
READ_IMAGE_ARGS = 128
#: the most images one kernel writes where fblc chooses it (co-launched kernels, codegen/co_launch.py): OpenCL 2.0's
#: least CL_DEVICE_MAX_WRITE_IMAGE_ARGS (1.2's is 8, which a kernel of four BatchNorm sites' sums and updates passes)
WRITE_IMAGE_ARGS = 64
#: the largest work-group a shared reduction uses (its __local partials: 4 bytes a work-item)
REDUCTION_GROUP = 256
#: register tiles per compute unit that keep a CPU busy without sharing their reductions: PoCL runs a work-group's
#: items in turn on one core, so a group sharing a tile's reduction gains parallelism only where the tiles are
#: too few to spread over the cores, and its merge through __local memory costs time (T-ResNet's weight
#: gradients ran 1.4x-1.6x faster unshared on this 2-core CPU; unshared, its four of 256 and 512 tiles took
#: 0.45-0.6x their time in image storage and 0.55-0.7x in buffers, MobileNetV2's eight of 16 to 108 tiles
#: 0.35-0.85x and 0.5-0.9x, one PoCL thread: their groups of items then stage both operands)
CPU_BUSY_TILES = 8
#: the __local memory a work-group's merge of partial register tiles may take (its accumulators times
#: its work-items, in floats): half of the 32 KiB that Adreno's and Mali's OpenCL drivers give a group
SHARED_TILE_FLOATS = 4096
SOURCE_KINDS = ("measured", "vendor documentation:", "paper:", "estimated")
TARGETS_DIR = os.path.join(os.path.dirname(__file__), "targets")


@dataclass(frozen=True)
class Profile:
    name: str
    vendor: str
    gpu: str
    opencl_version: str
    image2d_max_width: int
    image2d_max_height: int
    wave_size: int
    max_work_group_size: int
    fp16: bool
    cpu: bool
    simd_floats: int
    subgroups: bool
    local_staging: bool
    tex_block_width: int
    tex_block_height: int
    line_bytes: int
    l1_bytes: int
    l1_ways: int
    l2_bytes: int
    bandwidth_gbps: float
    peak_gflops: float
    compute_units: int
    waves_per_unit: int
    private_floats: int
    half_rate: float
    launch_us: float
    texture_bytes_per_clock: int
    image2d_from_buffer: bool
    image_pitch_alignment: int
    base_address_alignment: int
    sources: dict[str, str]
    raw: dict[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def device_items(self) -> int:
        """Work-items the device runs at once: a launch of fewer leaves compute units (or lanes) idle."""
        return self.compute_units * self.waves_per_unit * self.wave_size

    def fills_device(self, items: int) -> bool:
        """Whether a launch of `items` work-items keeps the device busy alone. A CPU (PoCL) counts as
        filled: its speed rules are its own (CPU_BUSY_TILES; a work-group's items run in turn on one core)."""
        return self.cpu or items >= self.device_items

    @property
    def l1_sets(self) -> int:
        return max(1, self.l1_bytes // (self.block_bytes * self.l1_ways))

    def placement_limits(self, cells: int) -> tuple[int, int]:
        """(max width, max height) for placing an image of `cells` texels (bytes for a mask)."""
        return placement_limits(self.image2d_max_width, self.image2d_max_height, cells)

    def launch_size(self, items: int) -> tuple[int, int]:
        """(global size, work-group size) of a launch of `items` work-items: groups of whole waves,
        GROUP_ITEMS work-items (fewer for a smaller launch), within max_work_group_size; the global
        size padded to whole groups (the kernels return early past `items`)."""
        waves = -(-min(max(items, 1), GROUP_ITEMS) // self.wave_size)
        group = max(1, min(waves * self.wave_size, self.max_work_group_size))
        return -(-max(items, 1) // group) * group, group

    def reduction_group(self, count: int, outputs: int = 0) -> int | None:
        """Work-items that share a reduction of `count` elements into each of `outputs` items (a power of
        two within max_work_group_size), or None: one work-item each. A long reduction (past
        SERIAL_REDUCTION) takes up to REDUCTION_GROUP, each work-item folding 16 elements or more; on a GPU
        a shorter one whose items leave the device idle takes what fills it (Profile.filling_group), each
        work-item still folding SPLIT_STEPS elements or more: a group under a wave where the items are that
        few (its idle lanes cost less than an idle device)."""
        if count > SERIAL_REDUCTION:
            return _power_of_two_group(min(REDUCTION_GROUP, self.max_work_group_size, count // 16))
        return self.filling_group(outputs, min(REDUCTION_GROUP, self.max_work_group_size, count // SPLIT_STEPS))

    def filling_group(self, items: int, bound: int) -> int | None:
        """Work-items per item that make `items` items fill the device: the least power of two that does,
        within `bound` (its largest power of two where none does); None where the items fill it alone (or on
        a CPU: Profile.fills_device) or no split fits `bound`."""
        if items <= 0 or self.fills_device(items):
            return None
        cap = _power_of_two_group(bound)
        if cap is None:
            return None
        group = 2
        while group < cap and items * group < self.device_items:
            group *= 2
        return group

    def tile_group(self, serial: int, trips: int, lanes: int, tiles: int) -> int | None:
        """Work-items that share a register tile's reduction of `serial` multiply-adds per accumulator
        (`lanes` accumulators, `tiles` tiles) whose longest loop runs `trips` times, or None: one work-item
        a tile. A power of two, up to GROUP_ITEMS (a group's whole waves), within max_work_group_size,
        SHARED_TILE_FLOATS of partials and the loop's share (Profile.loop_group): the most of them for a
        reduction past SERIAL_REDUCTION (unless a CPU's tiles keep its cores busy alone: CPU_BUSY_TILES); on a GPU,
        for a shorter one whose tiles leave the device idle, what fills it (Profile.filling_group), each
        work-item still taking SPLIT_STEPS multiply-adds per accumulator or more."""
        bound = min(GROUP_ITEMS, self.max_work_group_size, self.loop_group(trips, tiles), SHARED_TILE_FLOATS // lanes)
        if serial > SERIAL_REDUCTION:
            return None if self.cpu and tiles >= CPU_BUSY_TILES * self.compute_units else _power_of_two_group(bound)
        return self.filling_group(tiles, min(bound, serial // SPLIT_STEPS))

    def loop_group(self, trips: int, tiles: int) -> int:
        """The most work-items that may deal out a loop of `trips` iterations of each of `tiles` tiles: one
        per iteration (the largest power of two within `trips`), or where those leave a GPU idle, the least
        power of two that gives each work-item one iteration at most: its slowest work-item sets a group's
        time, and the idle ones cost only their part of the merge, where a busy device would lose their
        slots (a CPU runs a group's work-items in turn: one per iteration). 0: no loop to deal out."""
        most = _power_of_two_group(trips) or (1 if trips >= 1 else 0)
        if most < trips and not self.fills_device(tiles * most):
            return 2 * most
        return most

    def tiles_per_group(self, group: int, lanes: int, tiles: int) -> int:
        """Register tiles one work-group holds when a tile's `group` work-items (Profile.tile_group) fill
        less than a wave: the wave's idle lanes take further tiles. A power of two that divides `tiles`
        (every group then holds only whole, real tiles, and reaches its barriers whole), within
        max_work_group_size and SHARED_TILE_FLOATS of partials for all of its tiles (`lanes` each)."""
        bound = min(self.wave_size // group, self.max_work_group_size // group, SHARED_TILE_FLOATS // (group * lanes))
        count = _power_of_two_group(bound) or 1
        while tiles % count:
            count //= 2
        return count

    @property
    def block_bytes(self) -> int:
        """Bytes of one texture-cache block of RGBA fp32 texels."""
        return self.tex_block_width * self.tex_block_height * 16


def _power_of_two_group(bound: int) -> int | None:
    """The largest power of two within `bound` work-items, or None when that is one (no group)."""
    group = 1
    while group * 2 <= bound:
        group *= 2
    return group if group > 1 else None


def placement_limits(max_width: int, max_height: int, cells: int) -> tuple[int, int]:
    """The image edges to place `cells` within: the device's limits capped at PORTABLE_IMAGE_EDGE when the
    cells fit in that square, else the device's own limits (the bundle then needs a device that has them)."""
    width, height = min(max_width, PORTABLE_IMAGE_EDGE), min(max_height, PORTABLE_IMAGE_EDGE)
    return (width, height) if cells <= width * height else (max_width, max_height)


def shipped_targets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(TARGETS_DIR) if f.endswith(".json"))


def _fail(path: str, problem: str, remedy: str = "fix the file, or measure the device with 'fblc profile'") -> FblcError:
    return FblcError(f"profile '{path}': {problem}", remedy)


def parse_profile(raw: Any, path: str) -> Profile:
    """Validate a profile document and return it as a Profile."""
    if not isinstance(raw, dict):
        raise _fail(path, "is not a JSON object")
    for key in ("name", "vendor", "gpu", "opencl_version"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise _fail(path, f"'{key}' is missing or empty")
    figures = raw.get("figures")
    if not isinstance(figures, dict):
        raise _fail(path, "has no 'figures' object")
    missing = [name for name in FIGURES if name not in figures]
    if missing:
        raise _fail(path, f"lacks the figures {', '.join(missing)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, (kind, unit) in FIGURES.items():
        entry = figures[name]
        if not isinstance(entry, dict) or "value" not in entry or "source" not in entry:
            raise _fail(path, f"figure '{name}' must be {{\"value\": ..., \"source\": ...}}")
        value, source = entry["value"], entry["source"]
        if not isinstance(source, str) or not source.startswith(SOURCE_KINDS):
            raise _fail(path, f"figure '{name}' has source {source!r}; it must start with one of {', '.join(SOURCE_KINDS)}")
        if kind is bool:
            if not isinstance(value, bool):
                raise _fail(path, f"figure '{name}' ({unit}) must be true or false, not {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, f"figure '{name}' ({unit}) must be a number{' (integer)' if kind is int else ''}, "
                              f"not {value!r}")
        elif not math.isfinite(value):  # JSON as Python reads it takes NaN and Infinity
            raise _fail(path, f"figure '{name}' ({unit}) is {value}: it must be a finite positive number")
        elif kind is int and value != int(value):
            raise _fail(path, f"figure '{name}' ({unit}) must be an integer, not {value!r}")
        elif value <= 0:
            raise _fail(path, f"figure '{name}' ({unit}) is {value}: it must be positive")
        values[name] = kind(value)
        sources[name] = source
    _check_possible(values, path)
    return Profile(raw["name"], raw["vendor"], raw["gpu"], raw["opencl_version"], **values, sources=sources, raw=raw)


def _check_possible(v: dict[str, Any], path: str) -> None:
    for name in ("tex_block_width", "tex_block_height"):
        if v[name] & (v[name] - 1) or v[name] > 64:
            raise _fail(path, f"{name} is {v[name]}: a texture-cache block side is a power of two up to 64 texels")
    block_bytes = v["tex_block_width"] * v["tex_block_height"] * 16
    if v["l1_bytes"] < block_bytes * v["l1_ways"]:
        raise _fail(path, f"l1_bytes {v['l1_bytes']} cannot hold {v['l1_ways']} ways of {block_bytes}-byte blocks")
    if v["l2_bytes"] < v["l1_bytes"]:
        raise _fail(path, f"l2_bytes {v['l2_bytes']} is smaller than l1_bytes {v['l1_bytes']}")
    limit = private_limit(v["cpu"])
    if not 4 <= v["private_floats"] <= limit or v["private_floats"] % 4:
        raise _fail(path, f"private_floats is {v['private_floats']}: a work-item's accumulators are whole float4s, "
                          f"4 to {limit} floats on a {'CPU' if v['cpu'] else 'GPU'} target")
    if not 1 <= v["half_rate"] <= 4:
        raise _fail(path, f"half_rate is {v['half_rate']}: half arithmetic runs 1 to 4 times the fp32 rate "
                          "(1: as float)")
    if v["wave_size"] > v["max_work_group_size"]:
        raise _fail(path, f"wave_size {v['wave_size']} exceeds max_work_group_size {v['max_work_group_size']}")


def load_profile(target: str) -> Profile:
    """A shipped target by name, or a profile JSON file by path."""
    path = target if target.endswith(".json") else os.path.join(TARGETS_DIR, f"{target}.json")
    if not os.path.isfile(path):
        if target.endswith(".json"):
            raise FblcError(f"profile file '{target}' does not exist", "check the path, or write one with 'fblc profile'")
        raise FblcError(f"unknown target '{target}'",
                        f"choose one of: {', '.join(shipped_targets())}, or give a profile .json file")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except ValueError as error:
        raise _fail(path, f"is not valid JSON ({error})") from None
    return parse_profile(raw, path)
