"""A texture-cache model: 2-D blocks of texels, set-associative, LRU within a set.

Input: the texel coordinates a kernel's work-groups read, in issue order. A block is
`tex_block_width x tex_block_height` texels; block (bx, by) maps to set
(bx + by * row_offset) % sets, where row_offset is about half the sets so that vertically
adjacent blocks (which 2-D tiles touch together) do not collide. Work-groups run one after
another through one L1, as one shader core serves consecutive work-groups; within a
work-group every thread issues its k-th read before any thread issues its (k+1)-th.
Large launches are sampled: every n-th work-group is simulated (the cache is flushed before
each sampled group, so the estimate is per group) and the counts are scaled back up.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from fblc.profiles.profile import Profile


@dataclass(frozen=True)
class CacheGeometry:
    block_width: int
    block_height: int
    sets: int
    ways: int

    @classmethod
    def of(cls, profile: Profile) -> "CacheGeometry":
        return cls(profile.tex_block_width, profile.tex_block_height, profile.l1_sets, profile.l1_ways)


@dataclass
class CacheStats:
    texel_reads: int = 0
    block_fetches: int = 0  # distinct blocks each work-group touches, summed over work-groups
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.texel_reads if self.texel_reads else 1.0

    def __iadd__(self, other: "CacheStats") -> "CacheStats":
        self.texel_reads += other.texel_reads
        self.block_fetches += other.block_fetches
        self.misses += other.misses
        return self

    def scaled(self, factor: float) -> "CacheStats":
        return CacheStats(round(self.texel_reads * factor), round(self.block_fetches * factor), round(self.misses * factor))


class TextureCache:
    """The L1 itself: `access(blocks)` runs block ids through the sets and counts misses."""

    def __init__(self, geometry: CacheGeometry) -> None:
        self.geometry = geometry
        self.row_offset = max(1, geometry.sets // 2 + 1)
        self.sets: list[OrderedDict[tuple[int, int], None]] = [OrderedDict() for _ in range(geometry.sets)]

    def flush(self) -> None:
        for cache_set in self.sets:
            cache_set.clear()

    def blocks_of(self, xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return xs // self.geometry.block_width, ys // self.geometry.block_height

    def access(self, bxs: np.ndarray, bys: np.ndarray) -> int:
        misses = 0
        sets, ways, offset = self.geometry.sets, self.geometry.ways, self.row_offset
        for bx, by in zip(bxs.tolist(), bys.tolist()):
            cache_set = self.sets[(bx + by * offset) % sets]
            key = (bx, by)
            if key in cache_set:
                cache_set.move_to_end(key)
                continue
            misses += 1
            cache_set[key] = None
            if len(cache_set) > ways:
                cache_set.popitem(last=False)
        return misses


#: work-group index -> (xs, ys), the texels it reads in issue order (thread-interleaved), or
#: (xs, ys, issued) when those are a recorded prefix of `issued` reads (counts are scaled up to it)
WorkGroupReads = Callable[[int], tuple[np.ndarray, ...]]


def sampled_groups(work_groups: int, sample: int) -> list[int]:
    """At most `sample` of a launch's work-groups, spread evenly over it (the first and the last included)."""
    return sorted(set(np.linspace(0, work_groups - 1, min(sample, work_groups)).round().astype(int).tolist()))


def simulate(geometry: CacheGeometry, reads: WorkGroupReads, work_groups: int, sample: int = 64,
             cache: TextureCache | None = None) -> CacheStats:
    """Simulated reads, block fetches and misses of `work_groups` groups, sampling at most `sample` of them
    evenly (the cache is flushed before each: the estimate is per group, scaled to all of them)."""
    cache = cache or TextureCache(geometry)
    chosen = sampled_groups(work_groups, sample)
    total = CacheStats()
    for group in chosen:
        xs, ys, *issued = reads(group)
        bxs, bys = cache.blocks_of(np.asarray(xs), np.asarray(ys))
        cache.flush()
        distinct = len(set(zip(bxs.tolist(), bys.tolist())))
        stats = CacheStats(len(bxs), distinct, cache.access(bxs, bys))
        if issued:  # a recorded prefix: scale to every read the group made
            stats = stats.scaled(issued[0] / len(bxs)) if len(bxs) else CacheStats(issued[0], 0, 0)
        total += stats
    return total.scaled(work_groups / len(chosen)) if chosen else total


# --- the profiler's read patterns, as the model sees them ---------------------------------------

PATTERNS = ("row-major", "column-major", "block-4", "block-8")


def pattern_coordinates(pattern: str, ids: np.ndarray, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """The texel that global work-item `ids` reads under `pattern` in a width x height image."""
    if pattern == "row-major":
        return ids % width, (ids // width) % height
    if pattern == "column-major":
        return (ids // height) % width, ids % height
    side = int(pattern.split("-")[1])
    per_block = side * side
    block, inside = ids // per_block, ids % per_block
    blocks_per_row = width // side
    return ((block % blocks_per_row) * side + inside % side) % width, \
        ((block // blocks_per_row) * side + inside // side) % height


def pattern_reads(pattern: str, threads: int, reads_per_thread: int, width: int, height: int,
                  total_threads: int) -> WorkGroupReads:
    """Reads of one work-group of the profiler's kernel: read r of thread t is item t + r * total_threads."""

    def reads(group: int) -> tuple[np.ndarray, np.ndarray]:
        ids = group * threads + np.arange(threads)
        items = (ids[None, :] + np.arange(reads_per_thread)[:, None] * total_threads).reshape(-1)
        return pattern_coordinates(pattern, items, width, height)

    return reads
