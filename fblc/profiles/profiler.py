"""`fblc profile`: measure a device's texture-cache geometry and limits with OpenCL microbenchmarks.

Measured on the device itself:
- pattern reads: row-major, column-major, Block-4 and Block-8 orders of reading an RGBA fp32
  image larger than the last-level cache, with 8, 16, 32 and 64 work-items per work-group;
  throughput is reported relative to column-major (FBLayout's figure);
- block probes: pairs of reads a growing offset apart along x (then y), at scrambled places
  no prefetcher follows, each pair's places depending on the previous pair's data (so latency,
  not throughput, is timed); the second read stops hitting once the offset leaves the block
  the first brought in: that offset is the block width (height). Walking a growing number of
  scrambled blocks over and over, the cost per read jumps when they no longer fit: that
  footprint is the L1 capacity;
- bandwidth (a streaming image read), fp32 peak (an FMA loop), and what clGetDeviceInfo says.
Everything else in the profile is copied from the `local` target and marked estimated.

Measuring and interpreting are apart, so that a phone needs no Python: `measurement_plan()` is a
JSON document with the benchmarks' OpenCL source, the image and buffer they read and write, and
every launch to time, in order. A timing backend runs it and returns raw results (device facts,
the best device time of each launch): pyopencl here (pyopencl_timing.py), or the native runner's
`--profile` mode (`fblc profile --device native` / `adb:SERIAL`, fblc/runtime/adb_profile.py).
`interpret` turns plan and results into the profile, the same way for every backend. The capacity
probe is planned for every block width the block probe can find and `interpret` keeps the one it
found, so that one plan, run once, is all a device needs.
"""

from __future__ import annotations

import datetime
import json
import re
from typing import Any, Callable

import numpy as np

from fblc.errors import FblcError
from fblc.profiles.cache_model import PATTERNS
from fblc.profiles.profile import TARGETS_DIR, parse_profile

THREADS = (8, 16, 32, 64)
IMAGE_SIDE = 2048  # 2048 x 2048 RGBA fp32 = 64 MiB: past the last-level cache of phones and most desktops;
#                    every OpenCL device with images allows it (2048 is the embedded profile's minimum)
READS_PER_THREAD = 8
PAIR_OFFSETS = (0, 1, 2, 4, 8, 16)  # texels; the probe places pairs on a 16-texel grid
PAIR_ROUNDS = 5
PAIR_WORK_ITEMS, PAIRS_PER_ITEM = 1024, 256
FOOTPRINT_BLOCKS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FOOTPRINT_READS = 65536
FMA_WORK_ITEMS, FMA_ITERATIONS = 1 << 14, 2048
REPEATS = 5  # each launch's best of REPEATS runs (the block probe's launches run once, PAIR_ROUNDS times round-robin)
PLAN_FORMAT, RESULTS_FORMAT, FORMAT_VERSION = "fblc-profile-plan", "fblc-profile-results", 1
REMEDY = ("profile another device ('fblc devices' lists them), or copy a shipped profile from "
          "fblc/profiles/targets/ and edit its figures by hand")

SOURCE = """
__constant sampler_t SMP = CLK_NORMALIZED_COORDS_FALSE | CLK_ADDRESS_CLAMP_TO_EDGE | CLK_FILTER_NEAREST;

int2 pattern_texel(int pattern, int id, int width, int height) {
  if (pattern == 0) return (int2)(id % width, (id / width) % height);
  if (pattern == 1) return (int2)((id / height) % width, id % height);
  const int side = pattern == 2 ? 4 : 8;
  const int block = id / (side * side), inside = id % (side * side), per_row = width / side;
  return (int2)(((block % per_row) * side + inside % side) % width, ((block / per_row) * side + inside / side) % height);
}

__kernel void pattern_read(read_only image2d_t img, __global float *out, int pattern, int width, int height,
                           int reads, int total) {
  const int gid = get_global_id(0);
  float4 acc = (float4)(0.0f);
  for (int r = 0; r < reads; ++r) acc += read_imagef(img, SMP, pattern_texel(pattern, gid + r * total, width, height));
  out[gid] = acc.x + acc.y + acc.z + acc.w;
}

uint scramble(uint v) { v ^= v >> 16; v *= 0x7feb352dU; v ^= v >> 15; v *= 0x846ca68bU; v ^= v >> 16; return v; }

// Pairs of reads `offset` apart, at scrambled block-aligned places (no prefetcher can follow): the
// second read of a pair hits while `offset` stays inside the block the first one brought in.
__kernel void pair_read(read_only image2d_t img, __global float *out, int offset_x, int offset_y, int pairs,
                        int width, int height, int zero) {
  const int gid = get_global_id(0);
  float4 acc = (float4)(0.0f);
  int chain = 0;  // each pair's places depend on the previous pair's data: latency, not throughput, is timed
  for (int i = 0; i < pairs; ++i) {
    const uint h = scramble((uint)(gid * pairs + i) + (uint)chain);
    const int x = (int)(h % (uint)(width / 16)) * 16, y = (int)((h >> 8) % (uint)(height - 16));
    const float4 first = read_imagef(img, SMP, (int2)(x, y));
    const float4 second = read_imagef(img, SMP, (int2)(x + offset_x + (as_int(first.x) & zero), y + offset_y));
    chain = as_int(second.x) & zero;
    acc += first + second;
  }
  out[gid] = acc.x + acc.y + acc.z + acc.w;
}

// Walk `blocks` scrambled blocks `block_x` texels wide again and again: at L1 speed while they fit.
__kernel void footprint_read(read_only image2d_t img, __global float *out, int blocks, int block_x, int repeats,
                             int width, int height) {
  float4 acc = (float4)(0.0f);
  for (int k = 0; k < repeats; ++k)
    for (int b = 0; b < blocks; ++b) {
      const uint h = scramble((uint)b);
      acc += read_imagef(img, SMP, (int2)((int)(h % (uint)(width / block_x)) * block_x, (int)((h >> 12) % (uint)height)));
    }
  out[get_global_id(0)] = acc.x + acc.y + acc.z + acc.w;
}

__kernel void fma_loop(__global float *out, int iterations) {
  float4 a = (float4)(get_global_id(0)), b = (float4)(0.999f), c = (float4)(0.001f), d = a, e = a + 1.0f, f = a + 2.0f;
  for (int i = 0; i < iterations; ++i) { a = fma(a, b, c); d = fma(d, b, c); e = fma(e, b, c); f = fma(f, b, c); }
  out[get_global_id(0)] = a.x + d.y + e.z + f.w;
}
"""

Progress = Callable[[str], None]
Plan = dict[str, Any]
Results = dict[str, Any]


# --- the plan --------------------------------------------------------------------------------------------
def kernel_lines(source: str) -> list[dict[str, Any]]:
    """Each `__kernel`'s name and first and last line (1-based, as compilers number them), so that a build
    log's line names the kernel that failed, in either backend."""
    found = []
    for match in re.finditer(r"__kernel\s+void\s+(\w+)\s*\(", source):
        depth, opening = 0, source.index("{", match.end())
        for at in range(opening, len(source)):
            depth += {"{": 1, "}": -1}.get(source[at], 0)
            if depth == 0:
                break
        found.append({"name": match.group(1), "first_line": source.count("\n", 0, match.start()) + 1,
                      "last_line": source.count("\n", 0, at) + 1})
    return found


def kernel_at_line(plan: Plan, line: int) -> str | None:
    return next((k["name"] for k in plan["kernels"] if k["first_line"] <= line <= k["last_line"]), None)


def _launch(ident: str, step: str, kernel: str, args: list[dict[str, Any]], global_size: int, local_size: int | None,
            measures: dict[str, Any], repeats: int = REPEATS, too_large: str = "skip") -> dict[str, Any]:
    return {"id": ident, "step": step, "kernel": kernel, "args": args, "global": [global_size],
            "local": None if local_size is None else [local_size], "too_large": too_large, "repeats": repeats,
            "measures": measures}


def measurement_plan() -> Plan:
    """Every benchmark launch, in the order it runs; `measures` (which backends ignore) tells `interpret`
    what each one measured. A launch whose `local` size a kernel cannot take is skipped (`too_large`:
    "skip") or left to the driver ("driver")."""
    side = IMAGE_SIDE
    image, out = {"image": "img"}, {"buffer": "out"}
    total = side * side // READS_PER_THREAD
    launches = []
    for index, pattern in enumerate(PATTERNS):
        for threads in THREADS:
            launches.append(_launch(f"pattern {pattern} x {threads}", f"{pattern} x {threads}", "pattern_read",
                                    [image, out, {"int": index}, {"int": side}, {"int": side},
                                     {"int": READS_PER_THREAD}, {"int": total}], total, threads,
                                    {"probe": "pattern", "pattern": pattern, "threads": threads,
                                     "texel_reads": total * READS_PER_THREAD}))
    for round_ in range(PAIR_ROUNDS):  # round-robin: slow drifts of a shared CPU hit every offset alike
        for offset in PAIR_OFFSETS:
            for axis, (dx, dy) in (("x", (offset, 0)), ("y", (0, offset))):
                launches.append(_launch(f"pair {axis}+{offset} round {round_ + 1}", "block width and height",
                                        "pair_read", [image, out, {"int": dx}, {"int": dy}, {"int": PAIRS_PER_ITEM},
                                                      {"int": side}, {"int": side}, {"int": 0}],
                                        PAIR_WORK_ITEMS, None,
                                        {"probe": "pair", "axis": axis, "offset": offset,
                                         "pairs": PAIR_WORK_ITEMS * PAIRS_PER_ITEM}, repeats=1))
    for width in sorted({max(1, offset) for offset in PAIR_OFFSETS}):  # every block width the probe can find
        for blocks in FOOTPRINT_BLOCKS:
            repeats = max(1, FOOTPRINT_READS // blocks)
            launches.append(_launch(f"footprint {blocks} blocks of {width}", "capacity", "footprint_read",
                                    [image, out, {"int": blocks}, {"int": width}, {"int": repeats}, {"int": side},
                                     {"int": side}], 1, 1,
                                    {"probe": "footprint", "block_width": width, "blocks": blocks,
                                     "reads": blocks * repeats}))
    launches.append(_launch("bandwidth", "bandwidth and flops", "pattern_read",
                            [image, out, {"int": 0}, {"int": side}, {"int": side}, {"int": READS_PER_THREAD},
                             {"int": total}], total, 64, {"probe": "bandwidth", "bytes": side * side * 16},
                            too_large="driver"))
    launches.append(_launch("fma", "bandwidth and flops", "fma_loop", [out, {"int": FMA_ITERATIONS}], FMA_WORK_ITEMS,
                            None, {"probe": "fma", "flops": FMA_WORK_ITEMS * FMA_ITERATIONS * 4 * 4 * 2}))
    return {"format": PLAN_FORMAT, "version": FORMAT_VERSION, "source": SOURCE, "kernels": kernel_lines(SOURCE),
            "images": [{"name": "img", "width": side, "height": side, "order": "RGBA", "type": "FLOAT",
                        "fill": "uniform", "seed": 0}],
            "buffers": [{"name": "out", "bytes": 4 * side * side}],
            "launches": launches}


def plan_steps(plan: Plan) -> list[str]:
    """The progress steps a backend reports, in order: one per run of launches with the same `step`."""
    steps: list[str] = []
    for launch in plan["launches"]:
        if not steps or steps[-1] != launch["step"]:
            steps.append(launch["step"])
    return steps


def fill_texels(width: int, height: int, seed: int) -> np.ndarray:
    """The plan's "uniform" fill, float32 [height, width, 4] in [-1, 1): element k is
    (scramble(k ^ seed) >> 8) / 2^23 - 1, bit for bit what the native runner writes (its fill_uniform)."""
    v = np.arange(width * height * 4, dtype=np.uint32) ^ np.uint32(seed)
    v ^= v >> np.uint32(16)
    v *= np.uint32(0x7FEB352D)
    v ^= v >> np.uint32(15)
    v *= np.uint32(0x846CA68B)
    v ^= v >> np.uint32(16)
    return ((v >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -23) - np.float32(1.0)).reshape(height, width, 4)


def with_log(remedy: str, log: str) -> str:
    """The remedy, then the compiler's log on the lines below: the error's first line stays whole."""
    return f"{remedy}. The compiler's log:\n{log.strip()[-3000:]}" if log.strip() else remedy


# --- interpreting, for every backend ---------------------------------------------------------------------
def block_edge(costs: dict[int, float]) -> int:
    """The block edge: the smallest offset from which every larger offset costs at least 40 % of the way
    from the cheapest to the dearest (one noisy cheap or dear offset does not move it)."""
    low, high = min(costs.values()), max(costs.values())
    threshold = low + 0.4 * (high - low)
    offsets = sorted(costs)
    return next((offset for k, offset in enumerate(offsets) if all(costs[o] >= threshold for o in offsets[k:])),
                offsets[-1])  # no edge inside the probed offsets: the block is at least that wide


def _timed(plan: Plan, results: Results) -> list[tuple[dict[str, Any], float | None]]:
    """(what each launch measures, its best seconds or None when skipped), checking the results fit the plan."""
    problem = None
    if not isinstance(results, dict) or results.get("format") != RESULTS_FORMAT:
        problem = "are not fblc profile results"
    elif results.get("version") != FORMAT_VERSION:
        problem = f"have version {results.get('version')}, this fblc reads {FORMAT_VERSION}"
    elif [e.get("id") for e in results.get("launches", [])] != [launch["id"] for launch in plan["launches"]]:
        problem = "time other launches than the plan holds"
    if problem:
        raise FblcError(f"the benchmark results {problem}", "rebuild the native runner from this fblc (README: "
                                                            "'Phones') and profile again")
    timed = []
    for launch, entry in zip(plan["launches"], results["launches"]):
        seconds = entry.get("seconds")
        if "skipped" not in entry and not (isinstance(seconds, (int, float)) and seconds > 0):
            raise FblcError(f"the benchmark launch '{launch['id']}' took {seconds!r} s on the device: its timer "
                            "gives no usable time", REMEDY)
        timed.append((launch["measures"], None if "skipped" in entry else float(seconds)))
    return timed


def _device_size(device: dict[str, Any], wave: int, gflops: float, queried: str, measured: str
                 ) -> dict[str, dict[str, Any]]:
    """compute_units as the driver reports them, and waves_per_unit from the measured fp32 peak: the lanes
    that run at once (GFLOP/s over 2 flops an FMA at the reported clock) per compute unit, in waves."""
    units = int(device.get("max_compute_units", 0))
    if units <= 0:  # a runner that does not report it: local.json's estimate stays
        return {}
    figures = {"compute_units": {"value": units, "source": f"{queried} (max compute units)"}}
    clock_mhz = int(device.get("max_clock_frequency", 0))
    if clock_mhz > 0 and gflops > 0:
        lanes = gflops * 1e3 / (2 * clock_mhz)
        figures["waves_per_unit"] = {
            "value": max(1, round(lanes / (units * wave))),
            "source": f"{measured}: float4 FMA peak / (2 x {clock_mhz} MHz) = {lanes:.0f} lanes "
                      f"over {units} units of {wave}-wide waves"}
    return figures


def interpret(plan: Plan, results: Results, name: str) -> dict[str, Any]:
    """The profile document (valid for parse_profile) that `results`, the timings of `plan`, show."""
    timed = _timed(plan, results)
    device, gpu = results["device"], results["device"]["name"]
    patterns: dict[str, dict[int, float]] = {p: {} for p in PATTERNS}
    pairs: dict[str, dict[int, list[float]]] = {"x": {}, "y": {}}
    footprints: dict[int, dict[int, float]] = {}
    bandwidth = gflops = 0.0  # both launches always run (bandwidth's local size falls back to the driver's)
    for what, seconds in timed:
        if seconds is None:
            continue
        if what["probe"] == "pattern":
            patterns[what["pattern"]][what["threads"]] = what["texel_reads"] / seconds
        elif what["probe"] == "pair":
            pairs[what["axis"]].setdefault(what["offset"], []).append(seconds / what["pairs"])
        elif what["probe"] == "footprint":
            footprints.setdefault(what["block_width"], {})[what["blocks"]] = seconds / what["reads"]
        elif what["probe"] == "bandwidth":
            bandwidth = what["bytes"] / seconds / 1e9
        elif what["probe"] == "fma":
            gflops = what["flops"] / seconds / 1e9
    # each offset's cheapest round: slow drifts of a shared CPU hit every offset alike
    block_width, block_height = (max(1, block_edge({s: min(runs) for s, runs in pairs[axis].items()}))
                                 for axis in ("x", "y"))
    costs = footprints[block_width]  # the capacity probe run with the block width just found
    base = min(costs[FOOTPRINT_BLOCKS[0]], costs[FOOTPRINT_BLOCKS[1]])
    l1_bytes = max(blocks for blocks, cost in sorted(costs.items()) if cost <= 1.5 * base) * block_width * 16
    wave = int(results["kernels"]["pattern_read"]["preferred_work_group_size_multiple"])
    today = datetime.date.today().isoformat()
    measured = f"measured {today} by fblc profile on {gpu}"
    queried = f"measured {today}: clGetDeviceInfo of {gpu}"
    with open(f"{TARGETS_DIR}/local.json", encoding="utf-8") as handle:
        figures = json.load(handle)["figures"]
    figures.update({
        "image2d_max_width": {"value": int(device["image2d_max_width"]), "source": queried},
        "image2d_max_height": {"value": int(device["image2d_max_height"]), "source": queried},
        "max_work_group_size": {"value": int(device["max_work_group_size"]), "source": queried},
        "wave_size": {"value": max(1, min(wave, int(device["max_work_group_size"]))),
                      "source": f"{queried} (preferred work-group size multiple)"},
        "tex_block_width": {"value": block_width, "source": f"{measured}: strided-x probe"},
        "tex_block_height": {"value": block_height, "source": f"{measured}: strided-y probe"},
        "line_bytes": {"value": block_width * 16, "source": f"{measured}: block width x 16-byte texels"},
        "l1_bytes": {"value": max(l1_bytes, block_width * block_height * 16 * figures["l1_ways"]["value"]),
                     "source": f"{measured}: repeated-footprint probe"},
        "l2_bytes": {"value": max(int(device["global_mem_cache_size"]), l1_bytes),
                     "source": f"{queried} (global memory cache size)"},
        "bandwidth_gbps": {"value": round(bandwidth, 2), "source": f"{measured}: row-major image stream"},
        "peak_gflops": {"value": round(gflops, 1), "source": f"{measured}: float4 FMA loop"},
    })
    figures.update(_device_size(device, figures["wave_size"]["value"], gflops, queried, measured))
    if "cpu" in device:  # runners built before the device type was recorded keep local.json's estimate
        figures["cpu"] = {"value": bool(device["cpu"]), "source": f"{queried} (device type)"}
        figures["local_staging"] = {"value": bool(device["cpu"]), "source": f"estimated from {queried} (device type): "
                                    "a CPU's images are software (staging pays: local.json), a GPU's are texture units"}
    if "simd_floats" in device:
        figures["simd_floats"] = {"value": max(1, int(device["simd_floats"])),
                                  "source": f"{queried} (native float vector width)"}
    if "subgroups" in device:  # runners built before extensions were recorded keep local.json's estimate
        figures["subgroups"] = {"value": bool(device["subgroups"]), "source": f"{queried} (cl_khr_subgroups in its extensions)"}
    patterns = {p: row for p, row in patterns.items() if row}
    document = {
        "name": name, "vendor": device["vendor"] or "unknown", "gpu": gpu, "opencl_version": device["version"],
        "figures": figures,
        "measurements": {
            "date": today, "seconds": round(float(results["seconds"]), 2), "backend": results["backend"],
            "pattern_reads_per_second": {p: {str(t): v for t, v in row.items()} for p, row in patterns.items()},
            "relative_to_column_major": {p: {str(t): v / patterns["column-major"][t] for t, v in row.items()}
                                         for p, row in patterns.items()},
            "pair_read_ns": {axis: {str(s): round(min(runs) * 1e9, 3) for s, runs in sorted(pairs[axis].items())}
                             for axis in ("x", "y")},
            "footprint_read_ns": {str(b): round(c * 1e9, 3) for b, c in sorted(costs.items())},
        },
    }
    parse_profile(document, f"<profile of {gpu}>")  # what we write must load
    return document

