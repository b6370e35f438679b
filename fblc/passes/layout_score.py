"""Scoring texel layouts against a tensor's access patterns with the target's cache geometry.

rtile_select ranks every candidate layout of a stored tensor here: R-Tile tiles of a [rows, cols]
matrix (`rank_candidates`) and, for a tensor that stays flat, the fold of its texels into a 2-D image
(`rank_folds`). A wave's reads are replayed for WAVE_STEPS lockstep steps of synthetic walks, and
the distinct cache blocks they touch give each walk's efficiency. Given the reads the step's kernels
really make (traced on a device: fblc.tools.traced_layouts), `rescore_traced` replays those
through the best candidates and the texture-cache model (fblc.profiles.cache_model: sets, ways,
LRU). Either way the fetched blocks enter each kernel's time on the target (`kernel_ms`,
codegen.reports (estimate)'s max(arithmetic, bytes over bandwidth)), and the least estimated time decides.
(Re-scoring the synthetic walks with the cache model changed no choice on any model: a wave's
eight steps never fill the L1.) Images stay within profiles.placement_limits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from fblc.profiles import Profile, placement_limits
from fblc.profiles.cache_model import CacheGeometry, TextureCache
from fblc.texel_layout import TexelLayout, flat_layout, matrix_layout, rtile_layout

TILE_ROWS = (1, 2, 4, 8, 16, 32, 64)
TILE_COLS = (4, 8, 16, 32, 64, 128)  # elements
MAX_PADDING = 0.10
WAVE_STEPS = 8  # lockstep steps of a wave that the score replays
FOLD_WIDTHS = tuple(2 ** k for k in range(3, 15))  # image widths a flat tensor may fold to, 8 .. 16384 texels
TEXEL_BYTES = 16  # a fetched block's texels, as codegen.reports (estimate) counts them


@dataclass(frozen=True)
class Geometry:
    """What the score needs from the profile."""

    wave: int
    line_bytes: int
    block_width: int
    block_height: int
    max_width: int  # the device's image limits
    max_height: int
    sets: int = 16
    ways: int = 4
    bandwidth_gbps: float = 1.0  # the estimates divide bytes by it
    peak_gflops: float = 1.0  # and FLOPs by it

    @classmethod
    def of(cls, profile: Profile) -> Geometry:
        return cls(profile.wave_size, profile.line_bytes, profile.tex_block_width, profile.tex_block_height,
                   profile.image2d_max_width, profile.image2d_max_height, profile.l1_sets, profile.l1_ways,
                   profile.bandwidth_gbps, profile.peak_gflops)

    def limits(self, cells: int) -> tuple[int, int]:
        """(max width, max height) to place an image of `cells` texels within (profiles.placement_limits)."""
        return placement_limits(self.max_width, self.max_height, cells)

    @property
    def cache(self) -> CacheGeometry:
        return CacheGeometry(self.block_width, self.block_height, self.sets, self.ways)


# scoring ---------------------------------------------------------------------------------------

def wave_reads(pattern: str, rows: int, texel_cols: int, wave: int) -> list[np.ndarray]:
    """Texel indices a wave reads in issue order (every item's k-th read before any (k+1)-th), for
    WAVE_STEPS lockstep steps, at two sampled places of the tensor."""
    samples = []
    for half in (0, 1):
        if pattern == "rows":  # items own rows r0.., walking along them
            r = np.arange(min(rows, wave)) + half * max(0, rows - wave)
            j = np.arange(min(texel_cols, WAVE_STEPS)) + half * max(0, texel_cols - WAVE_STEPS)
            samples.append((j[:, None] + r[None, :] * texel_cols).reshape(-1))
        elif pattern == "columns":  # items own texel columns q0.., walking down them
            q = np.arange(min(texel_cols, wave)) + half * max(0, texel_cols - wave)
            i = np.arange(min(rows, WAVE_STEPS)) + half * max(0, rows - WAVE_STEPS)
            samples.append((i[:, None] * texel_cols + q[None, :]).reshape(-1))
        else:  # stream: a grid-stride walk over consecutive texels
            total = rows * texel_cols
            start = half * (total // 2)
            samples.append(np.arange(start, min(total, start + wave * WAVE_STEPS)))
    return [s for s in samples if s.size]


@lru_cache(maxsize=65536)
def block_efficiency(layout: TexelLayout, pattern: str, rows: int, texel_cols: int, geometry: Geometry) -> float:
    """Texels read over the texels of the distinct cache blocks they touch (an unbounded cache)."""
    useful = fetched = 0
    for texels in wave_reads(pattern, rows, texel_cols, geometry.wave):
        x, y = layout.coords(texels)
        blocks = np.unique((y // geometry.block_height << 24) + x // geometry.block_width).size
        useful += texels.size
        fetched += blocks * geometry.block_width * geometry.block_height
    return useful / fetched if fetched else 1.0


def gflops_factor(layout: TexelLayout, wave: int) -> float:
    """Share of wave lanes that do useful work when waves cover whole tiles."""
    if layout.kind == "flat":
        return 1.0
    texels = layout.tile_h * layout.tile_texels_w
    return texels / (-(-texels // wave) * wave)


class Access(NamedTuple):
    """How one kernel (a tensor's writer, or one of its readers) walks the tensor, and what else it costs
    on the target (codegen.reports (estimate)'s terms; 0 where unknown)."""

    pattern: str  # stream, rows or columns
    weight: float  # the elements it moves
    compute_ms: float = 0.0  # its arithmetic: FLOPs over the profile's peak
    other_ms: float = 0.0  # its other tensors' bytes over bandwidth


ELEMENT_BYTES = 4  # fp32 (the layouts are chosen before storage precision halves activations)


def kernel_ms(compute_ms: float, other_ms: float, fetched_bytes: float, geometry: Geometry) -> float:
    """A kernel's estimated time on the target, as codegen.reports (estimate) counts it: max(arithmetic, bytes over
    bandwidth), its bytes `other_ms`' worth plus the `fetched_bytes` of the tensor being placed."""
    return max(compute_ms, other_ms + fetched_bytes / (geometry.bandwidth_gbps * 1e6))


def access_estimate(layout: TexelLayout, accesses: Sequence[Access], rows: int, texel_cols: int,
                    geometry: Geometry) -> float:
    """The estimated ms of the kernels in `accesses` with the tensor in `layout`: each takes
    max(arithmetic, bytes over bandwidth) (codegen.reports (estimate)), its bytes of this tensor those of the
    blocks its walk fetches (block_efficiency), so a kernel bound by its arithmetic adds the same time
    whatever the layout."""
    return sum(kernel_ms(a.compute_ms, a.other_ms,
                         a.weight * ELEMENT_BYTES / block_efficiency(layout, a.pattern, rows, texel_cols, geometry),
                         geometry) for a in accesses)


@dataclass(frozen=True)
class Candidate:
    layout: TexelLayout
    score: float
    relaxed: tuple[str, ...]
    scored_by: str = "block count"
    block_score: float = 0.0  # the block-count score, which breaks ties of the cache model's
    estimate_ms: float | None = None  # the estimated time of the kernels that write and read the tensor


def _constraints(layout: TexelLayout, rows: int, texel_cols: int, geometry: Geometry) -> dict[str, bool]:
    padded = layout.width * layout.height
    return {"C1": (layout.tile_h * layout.tile_texels_w) % geometry.wave == 0,
            "C2": (layout.tile_texels_w * 16) % geometry.line_bytes == 0,
            "C3": padded <= (1 + MAX_PADDING) * rows * texel_cols}


@lru_cache(maxsize=4096)
def rank_candidates(rows: int, cols: int, patterns: tuple[tuple, ...],
                    geometry: Geometry) -> tuple[Candidate, ...]:
    """Every candidate tile that survives pruning, best first by the estimated time of the kernels that
    walk the tensor (`patterns`: Access tuples), then by the block count of their walks."""
    patterns = tuple(Access(*access) for access in patterns)
    texel_cols = cols // 4
    max_width, max_height = geometry.limits(rows * texel_cols)
    survivors: dict[tuple[str, ...], list[Candidate]] = {}
    for tile_h in TILE_ROWS:
        for tile_w in TILE_COLS:
            if tile_h > rows or tile_w // 4 > texel_cols:
                continue
            packing = "strip" if (tile_w // 4) * 16 <= geometry.line_bytes and tile_h > 1 else "block"
            layout = rtile_layout(rows, cols, tile_h, tile_w, packing, max_width)
            checks = _constraints(layout, rows, texel_cols, geometry)
            if not checks["C3"] or layout.width > max_width or layout.height > max_height:
                continue
            relaxed = tuple(name for name in ("C1", "C2") if not checks[name])
            score = _score(layout, patterns, rows, texel_cols, geometry, block_efficiency)
            survivors.setdefault(relaxed, []).append(Candidate(
                layout, score, relaxed, block_score=score,
                estimate_ms=access_estimate(layout, patterns, rows, texel_cols, geometry)))
    for relaxed in ((), ("C1",), ("C2",), ("C1", "C2")):
        if relaxed in survivors:
            return tuple(sorted(survivors[relaxed], key=lambda c: (c.estimate_ms, -c.score)))
    return ()


def _score(layout: TexelLayout, patterns: tuple[Access, ...], rows: int, texel_cols: int,
           geometry: Geometry, efficiency: Callable[..., float]) -> float:
    """Eq. 2: GFLOPS factor x memory efficiency, weighted over the tensor's access patterns."""
    total = sum(a.weight for a in patterns) or 1.0
    return gflops_factor(layout, geometry.wave) * sum(
        a.weight / total * efficiency(layout, a.pattern, rows, texel_cols, geometry) for a in patterns)


@lru_cache(maxsize=4096)
def rank_folds(shape: tuple[int, ...], patterns: tuple[tuple, ...],
               geometry: Geometry) -> tuple[Candidate, ...]:
    """Flat layouts of a tensor, best first: its texels folded into images of the FOLD_WIDTHS (and the
    widest and one-row-per-matrix-row folds) that fit the placement limits with at most MAX_PADDING
    padding, scored like tiles. A 2-D cache fetches blocks several texel rows tall, so a wide strip wastes
    most of each block a stream of consecutive texels fetches. Best first by the estimated time of the
    kernels that walk the tensor, then by block count; ties go to less padding, then the wider image."""
    patterns = tuple(Access(*access) for access in patterns)
    texels = max(1, -(-int(np.prod(shape, dtype=np.int64)) // 4))
    max_width, max_height = geometry.limits(texels)
    widest = flat_layout(texels, max_width)
    folds = {widest, matrix_layout(shape, max_width, max_height)}
    folds.update(TexelLayout("flat", width, -(-texels // width)) for width in FOLD_WIDTHS
                 if width < texels and width <= max_width and -(-texels // width) <= max_height)
    fitting = [f for f in folds if f.width * f.height <= (1 + MAX_PADDING) * texels] or [widest]
    if len(shape) >= 2 and shape[-1] % 4 == 0:  # a matrix: rows and columns walks keep their meaning
        rows, texel_cols = texels // (shape[-1] // 4), shape[-1] // 4
    else:
        rows, texel_cols = 1, texels
        patterns = tuple(a._replace(pattern="stream") for a in patterns)  # a vector: every walk streams it

    def blocks(fold: TexelLayout) -> Candidate:
        score = _score(fold, patterns, rows, texel_cols, geometry, block_efficiency)
        return Candidate(fold, score, (), "block count", score,
                         access_estimate(fold, patterns, rows, texel_cols, geometry))

    return tuple(sorted((blocks(f) for f in fitting), key=lambda c: (
        c.estimate_ms, -c.score, c.layout.width * c.layout.height, -c.layout.width)))


# scoring on traced access streams ---------------------------------------------------------------

class TracedStream(NamedTuple):
    """The logical texels (row-major texel indices) one traced work-group read from a tensor, in issue
    order, and the launch it stands for."""

    texels: np.ndarray
    weight: float  # scales the group to its launch's share of the step's reads of the tensor
    kernel: str = ""  # the launch (the flat bundle's kernel name)
    compute_ms: float = 0.0  # the launch's arithmetic on the target: its FLOPs over the profile's peak
    other_ms: float = 0.0  # the launch's other bytes (its writes, its other textures read once) over bandwidth


#: a root tensor's name -> the streams every launch that reads it read from it (fblc.tools.traced_layouts)
TracedReads = Mapping[str, Sequence[TracedStream]]
TRACED_CANDIDATES = 6  # candidates (best by block count) that the traced streams re-score
TRACED_READS = 1024  # reads of one work-group's stream that the cache model replays (its issue-order prefix)


def traced_estimate(layout: TexelLayout, streams: Sequence[TracedStream], geometry: Geometry) -> tuple[float, float]:
    """(estimated ms, efficiency) of the launches that read `streams` through `layout`.

    The cache model replays each work-group's prefix (flushed before each, as cache_model.simulate
    does), scaled to its launch; a launch's reads of the tensor are its missed blocks. Each launch
    then takes codegen.reports (estimate)'s time, max(arithmetic, bytes over bandwidth), so a layout that saves
    misses in a launch bound by its arithmetic saves nothing. Efficiency: texels read over texels fetched."""
    cache = TextureCache(geometry.cache)
    block = geometry.block_width * geometry.block_height
    useful = fetched = 0.0
    launches: dict[str, list[float]] = {}  # kernel -> [compute ms, other ms, fetched bytes]
    for stream in streams:
        prefix = stream.texels[:TRACED_READS]
        cache.flush()
        x, y = layout.coords(prefix)
        scale = stream.weight * stream.texels.size / max(1, prefix.size)
        blocks = scale * cache.access(*cache.blocks_of(x, y))
        useful += scale * prefix.size
        fetched += blocks * block
        launches.setdefault(stream.kernel, [stream.compute_ms, stream.other_ms, 0.0])[2] += blocks * block * TEXEL_BYTES
    ms = sum(kernel_ms(compute, other, fetched_bytes, geometry) for compute, other, fetched_bytes in launches.values())
    return ms, (useful / fetched if fetched else 1.0)


def rescore_traced(ranked: Sequence[Candidate], streams: Sequence[TracedStream],
                   geometry: Geometry) -> tuple[Candidate, ...]:
    """`ranked` (best first by block count) with its best TRACED_CANDIDATES ordered by the estimated time
    of the launches that read the tensor (traced_estimate), then by efficiency, then by block count."""
    rescored = []
    for candidate in ranked[:TRACED_CANDIDATES]:
        ms, efficiency = traced_estimate(candidate.layout, streams, geometry)
        rescored.append(Candidate(candidate.layout, efficiency, candidate.relaxed, "traced estimate",
                                  candidate.block_score, ms))
    return tuple(sorted(rescored, key=lambda c: (c.estimate_ms, -c.score, -c.block_score))) + tuple(
        ranked[TRACED_CANDIDATES:])
