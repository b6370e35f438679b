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
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any, Callable

import numpy as np

from fblc.compiler.errors import FblcError
from fblc.profiles.cache_model import PATTERNS
from fblc.profiles.profile import TARGETS_DIR, parse_profile

THREADS = (8, 16, 32, 64)
IMAGE_SIDE = 2048  # 2048 x 2048 RGBA fp32 = 64 MiB: past the last-level cache of phones and most desktops
READS_PER_THREAD = 8
PAIR_OFFSETS = (0, 1, 2, 4, 8, 16)  # texels; the probe places pairs on a 16-texel grid
PAIR_ROUNDS = 5
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


class Profiler:
    """Microbenchmarks on one pyopencl device."""

    def __init__(self, device: Any) -> None:
        import pyopencl as cl

        self.cl = cl
        self.device = device
        self.context = cl.Context([device])
        self.queue = cl.CommandQueue(self.context, properties=cl.command_queue_properties.PROFILING_ENABLE)
        try:
            self.program = cl.Program(self.context, SOURCE).build()
        except cl.RuntimeError as error:
            raise FblcError(f"{device.name.strip()} rejected fblc's benchmark kernels: {str(error).strip()[-2000:]}",
                            REMEDY) from None
        self.pattern_kernel = cl.Kernel(self.program, "pattern_read")
        self.pair_kernel = cl.Kernel(self.program, "pair_read")
        self.footprint_kernel = cl.Kernel(self.program, "footprint_read")
        self.fma_kernel = cl.Kernel(self.program, "fma_loop")
        side = min(IMAGE_SIDE, device.image2d_max_width, device.image2d_max_height)
        self.width = self.height = side
        texels = np.random.default_rng(0).standard_normal((side, side, 4)).astype(np.float32)
        fmt = cl.ImageFormat(cl.channel_order.RGBA, cl.channel_type.FLOAT)
        self.image = cl.create_image(self.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, fmt,
                                     shape=(side, side), hostbuf=texels)
        self.out = cl.Buffer(self.context, cl.mem_flags.WRITE_ONLY, size=4 * side * side)

    def _seconds(self, kernel: Any, global_size: int, local_size: int | None, *args: Any, repeats: int = 5) -> float:
        kernel.set_args(*args)
        best = float("inf")
        for _ in range(repeats):
            event = self.cl.enqueue_nd_range_kernel(self.queue, kernel, (global_size,),
                                                    None if local_size is None else (local_size,))
            event.wait()
            best = min(best, (event.profile.end - event.profile.start) * 1e-9)
        return best

    def pattern_throughput(self, progress: Progress) -> dict[str, dict[int, float]]:
        """Texel reads per second, per pattern and work-group size."""
        total = self.width * self.height // READS_PER_THREAD
        table: dict[str, dict[int, float]] = {}
        for index, pattern in enumerate(PATTERNS):
            table[pattern] = {}
            for threads in THREADS:
                if threads > self.device.max_work_group_size:
                    continue
                seconds = self._seconds(self.pattern_kernel, total, threads, self.image, self.out, np.int32(index),
                                        np.int32(self.width), np.int32(self.height), np.int32(READS_PER_THREAD),
                                        np.int32(total))
                table[pattern][threads] = total * READS_PER_THREAD / seconds
                progress(f"{pattern} x {threads}")
        return table

    def _pair_cost(self, offset_x: int, offset_y: int) -> float:
        work_items, pairs = 1024, 256
        seconds = self._seconds(self.pair_kernel, work_items, None, self.image, self.out, np.int32(offset_x),
                                np.int32(offset_y), np.int32(pairs), np.int32(self.width), np.int32(self.height),
                                np.int32(0), repeats=1)
        return seconds / (work_items * pairs)

    @staticmethod
    def _knee(costs: dict[int, float]) -> int:
        """The block edge: the smallest offset from which every larger offset costs at least 40 % of the way
        from the cheapest to the dearest (one noisy cheap or dear offset does not move it)."""
        low, high = min(costs.values()), max(costs.values())
        threshold = low + 0.4 * (high - low)
        offsets = sorted(costs)
        return next((offset for k, offset in enumerate(offsets) if all(costs[o] >= threshold for o in offsets[k:])),
                    offsets[-1])  # no edge inside the probed offsets: the block is at least that wide

    def block_geometry(self, progress: Progress) -> tuple[int, int]:
        """Offsets measured round-robin, PAIR_ROUNDS times, keeping each one's cheapest run: slow drifts
        of a shared CPU then hit every offset alike."""
        width_runs: dict[int, list[float]] = {s: [] for s in PAIR_OFFSETS}
        height_runs: dict[int, list[float]] = {s: [] for s in PAIR_OFFSETS}
        for _ in range(PAIR_ROUNDS):
            for s in PAIR_OFFSETS:
                width_runs[s].append(self._pair_cost(s, 0))
                height_runs[s].append(self._pair_cost(0, s))
        progress("block width and height")
        return tuple(max(1, self._knee({s: min(r) for s, r in runs.items()}))  # type: ignore[return-value]
                     for runs in (width_runs, height_runs))

    def l1_capacity(self, block_width: int, progress: Progress) -> int:
        """Bytes: the largest footprint of blocks (`block_width` texels) read over and over at the small-footprint speed."""
        costs = {}
        for blocks in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
            repeats = max(1, 65536 // blocks)
            seconds = self._seconds(self.footprint_kernel, 1, 1, self.image, self.out, np.int32(blocks),
                                    np.int32(block_width), np.int32(repeats), np.int32(self.width),
                                    np.int32(self.height))
            costs[blocks] = seconds / (blocks * repeats)
        progress("capacity")
        base = min(costs[16], costs[32])
        fitting = [blocks for blocks, cost in sorted(costs.items()) if cost <= 1.5 * base]
        return max(fitting) * block_width * 16

    def bandwidth_gbps(self) -> float:
        total = self.width * self.height // READS_PER_THREAD
        seconds = self._seconds(self.pattern_kernel, total, 64 if self.device.max_work_group_size >= 64 else None,
                                self.image, self.out, np.int32(0), np.int32(self.width), np.int32(self.height),
                                np.int32(READS_PER_THREAD), np.int32(total))
        return self.width * self.height * 16 / seconds / 1e9

    def peak_gflops(self) -> float:
        work_items, iterations = 1 << 14, 2048
        seconds = self._seconds(self.fma_kernel, work_items, None, self.out, np.int32(iterations))
        return work_items * iterations * 4 * 4 * 2 / seconds / 1e9  # 4 float4 fmas, 2 flops each

    def wave_size(self) -> int:
        return int(self.pattern_kernel.get_work_group_info(
            self.cl.kernel_work_group_info.PREFERRED_WORK_GROUP_SIZE_MULTIPLE, self.device))


def profile_device(device: Any, name: str, progress: Progress = lambda step: None) -> dict[str, Any]:
    """Measure `device` and return a profile document (valid for parse_profile)."""
    started = time.perf_counter()
    profiler = Profiler(device)
    done = ["building the kernels"]

    def step(name: str) -> None:
        done[0] = name
        progress(name)

    step("kernels built")
    try:
        patterns = profiler.pattern_throughput(step)
        block_width, block_height = profiler.block_geometry(step)
        l1_bytes = profiler.l1_capacity(block_width, step)
        bandwidth, gflops, wave = profiler.bandwidth_gbps(), profiler.peak_gflops(), profiler.wave_size()
    except profiler.cl.Error as error:
        raise FblcError(f"{device.name.strip()} failed a benchmark kernel after '{done[0]}': {error}", REMEDY) from None
    step("bandwidth and flops")
    today = datetime.date.today().isoformat()
    measured = f"measured {today} by fblc profile on {device.name.strip()}"
    queried = f"measured {today}: clGetDeviceInfo of {device.name.strip()}"
    with open(f"{TARGETS_DIR}/local.json", encoding="utf-8") as handle:
        figures = json.load(handle)["figures"]
    figures.update({
        "image2d_max_width": {"value": int(device.image2d_max_width), "source": queried},
        "image2d_max_height": {"value": int(device.image2d_max_height), "source": queried},
        "max_work_group_size": {"value": int(device.max_work_group_size), "source": queried},
        "wave_size": {"value": max(1, min(wave, int(device.max_work_group_size))),
                      "source": f"{queried} (preferred work-group size multiple)"},
        "tex_block_width": {"value": block_width, "source": f"{measured}: strided-x probe"},
        "tex_block_height": {"value": block_height, "source": f"{measured}: strided-y probe"},
        "line_bytes": {"value": block_width * 16, "source": f"{measured}: block width x 16-byte texels"},
        "l1_bytes": {"value": max(l1_bytes, block_width * block_height * 16 * figures["l1_ways"]["value"]),
                     "source": f"{measured}: repeated-footprint probe"},
        "l2_bytes": {"value": max(int(device.global_mem_cache_size), l1_bytes),
                     "source": f"{queried} (global memory cache size)"},
        "bandwidth_gbps": {"value": round(bandwidth, 2), "source": f"{measured}: row-major image stream"},
        "peak_gflops": {"value": round(gflops, 1), "source": f"{measured}: float4 FMA loop"},
    })
    document = {
        "name": name, "vendor": device.vendor.strip() or "unknown", "gpu": device.name.strip(),
        "opencl_version": device.version.strip(), "figures": figures,
        "measurements": {
            "date": today, "seconds": round(time.perf_counter() - started, 2),
            "pattern_reads_per_second": {p: {str(t): v for t, v in row.items()} for p, row in patterns.items()},
            "relative_to_column_major": {p: {str(t): v / patterns["column-major"][t] for t, v in row.items()}
                                         for p, row in patterns.items()},
        },
    }
    parse_profile(document, f"<profile of {device.name.strip()}>")  # what we write must load
    return document
