"""The `cache` object of report.json: simulated texture-cache behaviour of a bundle's training step.

The bundle's own kernels run on the local OpenCL device with read tracing on (fblc.runtime.trace):
for each launch, up to `sample` work-groups spread over the launch record the texels they read,
in issue order; the texture-cache model of the target profile (2-D blocks, sets, LRU; flushed
before each work-group, as in fblc.profiles.cache_model.simulate) replays them. Per launch and
for the whole step: texel reads, cache-block fetches (distinct blocks per work-group),
simulated misses and the hit rate, scaled from the sampled groups (and from the recorded
prefix of each work-item's reads) to the whole launch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from fblc.profiles import Profile
from fblc.profiles.cache_model import CacheGeometry, CacheStats, TextureCache, simulate
from fblc.compiler.reference import random_feeds
from fblc.runtime.trace import ReadTracer

TEXTURE_STRIDE = 1 << 16  # block rows of one texture before the next texture's: images never alias


def launch_stats(cache: TextureCache, tracer: ReadTracer, index: int, sample: int) -> CacheStats:
    def reads(group: int) -> tuple[np.ndarray, np.ndarray, int]:
        traced = tracer.reads(index, group)
        # each texture its own band of block rows: images never alias
        return traced.xs, traced.ys + traced.textures * TEXTURE_STRIDE * cache.geometry.block_height, traced.issued

    return simulate(cache.geometry, reads, tracer.groups(index), sample, cache)


def cache_report(bundle: str, profile: Profile, feeds: Mapping[str, np.ndarray], sample: int = 2,
                 device: str | None = None, progress: Callable[[int, int], None] | None = None,
                 tracer: ReadTracer | None = None) -> dict[str, Any]:
    """Simulated cache figures of `bundle`'s step on `feeds` under `profile`'s cache geometry (through
    `tracer`, a ReadTracer of the bundle, when one is built already)."""
    tracer = tracer or ReadTracer(bundle, device)
    tracer.step(feeds)
    cache = TextureCache(CacheGeometry.of(profile))
    kernels, total = [], CacheStats()
    for index, spec in enumerate(tracer.plan["kernels"]):
        stats = launch_stats(cache, tracer, index, sample)
        total += stats
        kernels.append({"kernel": spec["name"], "family": spec["family"], "texel_reads": stats.texel_reads,
                        "block_fetches": stats.block_fetches, "misses": stats.misses,
                        "hit_rate": round(stats.hit_rate, 4)})
        if progress is not None:
            progress(index + 1, len(tracer.plan["kernels"]))
    return {"profile": profile.name, "block": [profile.tex_block_width, profile.tex_block_height],
            "sets": cache.geometry.sets, "ways": cache.geometry.ways, "work_group": tracer.group_size,
            "sampled_groups_per_launch": sample, "texel_reads": total.texel_reads,
            "block_fetches": total.block_fetches, "misses": total.misses, "hit_rate": round(total.hit_rate, 4),
            "kernels": kernels}


def cache_annex(profile: Profile) -> Callable[[str, ir.Model], dict[str, Any]]:
    """The report.json `cache` object for `compile_model`'s `annexes`: the bundle's step on a random batch."""
    return lambda bundle, step: cache_report(bundle, profile, random_feeds(step))


def cache_summary(cache: dict[str, Any], top: int = 8) -> str:
    """The readable version `fblc compile --cache-report` prints."""
    block = "x".join(str(side) for side in cache["block"])
    lines = [f"texture cache ({cache['profile']}: {block}-texel blocks, {cache['sets']} sets x {cache['ways']} ways, "
             f"work-groups of {cache['work_group']}): {cache['texel_reads']} texel reads, {cache['block_fetches']} "
             f"block fetches, {cache['misses']} misses, hit rate {cache['hit_rate']:.3f}",
             f"  {'kernel':<28} {'family':<14} {'reads':>10} {'fetches':>9} {'misses':>9} {'hit rate':>8}"]
    for k in sorted(cache["kernels"], key=lambda k: -k["misses"])[:top]:
        lines.append(f"  {k['kernel'][:28]:<28} {k['family']:<14} {k['texel_reads']:10d} {k['block_fetches']:9d} "
                     f"{k['misses']:9d} {k['hit_rate']:8.3f}")
    return "\n".join(lines)
