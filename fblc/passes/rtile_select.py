"""rtile_select: one texel layout per stored tensor, serving its forward and backward kernels (DESIGN.md 6).

Rewrite: writes `fblc.layout` (a TexelLayout as JSON) on every value that owns a texture, and
a readable summary as `fblc.layout` on every node (Netron shows node metadata). Values the
runtimes read or write (graph inputs and outputs, initializers, constants) and tensors that
are not [rows, cols] matrices with cols a multiple of 4 stay flat (linear addressing; a matrix
then gets one image row per matrix row, texel_layout.matrix_layout). Boolean tensors the step
keeps (activation masks saved for the backward) take `mask8`: one bit per element, 8 to a byte
(the codegen falls back to `mask4` for a writer that cannot write whole bytes). For the others:
- candidates: tile_h x tile_w for tile_h in TILE_ROWS, tile_w in TILE_COLS; `strip` packing
  when a tile row fits a cache line, else `block`; arranged by texel_layout.rtile_layout;
- pruning: C1 a tile's texels are a multiple of the wave size; C2 a tile row is a multiple of
  the cache line; C3 padding at most 10 %. Constraints are relaxed in the order C1, C2 when
  nothing survives (the report says which);
- score (the paper's eq. 2): over every kernel that touches the tensor (its writer and every
  reader, through index maps, forward and backward), weighted by the elements it moves: GFLOPS
  factor (share of wave lanes busy on whole tiles) x memory efficiency, the texels a wave reads
  in WAVE_STEPS lockstep steps over the texels fetched for them. Access patterns: `stream`
  (consecutive texels), `rows` (each work-item walks its own row), `columns` (each walks its
  own column). Every candidate is first scored by counting the distinct cache blocks (the
  profile's block geometry) the wave touches; the best SIMULATED are then scored by the
  texture-cache model (fblc.profiles.cache_model: the profile's blocks, sets, ways, LRU), whose
  misses decide;
- global selection, activation-guided: FTD-D nodes by decreasing input size give their
  operands the best tile; the choice propagates to same-shape outputs of FTD-C and FTI-C
  consumers; every other tensor takes its own best. No conversion kernel is ever needed:
  every kernel addresses each texture through its own layout.
With mode "naive" every value is flat (the conventional baseline). Preconditions: fused or
unfused step graph with static shapes, after ftd_taxonomy and tile_remap. In place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.index_map import IndexMap, is_view, map_of, view_root
from fblc.compiler.values import attr, numel, static_shape
from fblc.passes.ftd_taxonomy import Ftd
from fblc.profiles import Profile
from fblc.profiles.cache_model import CacheGeometry, TextureCache
from fblc.texel_layout import TexelLayout, flat_layout, mask_layout, matrix_layout, rtile_layout

TILE_ROWS = (1, 2, 4, 8, 16, 32, 64)
TILE_COLS = (4, 8, 16, 32, 64, 128)  # elements
MAX_PADDING = 0.10
MIN_TEXELS = 64  # smaller tensors stay flat: one work-group reads them whole
WAVE_STEPS = 8  # lockstep steps of a wave that the score replays
SIMULATED = 4  # candidates (best by block count) that the cache model re-scores
CHOICE = "fblc.layout_choice"  # on a value: the score table of its choice (the report reads it)
ROW_AXIS_OPS = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "ReduceSum", "ReduceMean", "ReduceMax"})


@dataclass(frozen=True)
class Geometry:
    """What the score needs from the profile."""

    wave: int
    line_bytes: int
    block_width: int
    block_height: int
    max_width: int
    sets: int = 16
    ways: int = 4

    @classmethod
    def of(cls, profile: Profile) -> Geometry:
        return cls(profile.wave_size, profile.line_bytes, profile.tex_block_width, profile.tex_block_height,
                   profile.image2d_max_width, profile.l1_sets, profile.l1_ways)

    @property
    def cache(self) -> CacheGeometry:
        return CacheGeometry(self.block_width, self.block_height, self.sets, self.ways)


# access patterns -------------------------------------------------------------------------------

def _walk(reduced_stride: int) -> str:
    return "rows" if reduced_stride == 1 else "columns"


def access_pattern(reader: ir.Node, slot: int, view: IndexMap) -> str:
    """How `reader` walks its input `slot`, which reads the root through `view`."""
    op, rank = reader.op_type, len(view.shape)
    if op == "MatMul" and rank >= 2:
        return _walk(view.strides[-1] if slot == 0 else view.strides[-2])
    if op == "Gemm" and slot < 2 and rank == 2:
        transposed = int(attr(reader, "transA" if slot == 0 else "transB", 0))
        k_axis = (0 if transposed else 1) if slot == 0 else (1 if transposed else 0)
        return _walk(view.strides[k_axis])
    if op in ROW_AXIS_OPS and rank >= 1:
        axes = attr(reader, "axes") or [attr(reader, "axis", -1)]
        axis = int(axes[-1]) % rank if axes and axes[-1] is not None else rank - 1
        return _walk(view.strides[axis])
    return "stream"


def _accesses(root: ir.Value) -> dict[str, float]:
    """Pattern -> weight (elements moved) over the root's writer and all its readers."""
    weights: dict[str, float] = {"stream": float(numel(static_shape(root)))}

    def visit(value: ir.Value) -> None:
        for use in value.uses():
            node = use.node
            if is_view(node):
                for out in node.outputs:
                    visit(out)
                continue
            pattern = access_pattern(node, use.idx, map_of(value))
            weights[pattern] = weights.get(pattern, 0.0) + float(numel(static_shape(value)))

    visit(root)
    return weights


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


def block_efficiency(layout: TexelLayout, pattern: str, rows: int, texel_cols: int, geometry: Geometry) -> float:
    """Texels read over the texels of the distinct cache blocks they touch (an unbounded cache)."""
    useful = fetched = 0
    for texels in wave_reads(pattern, rows, texel_cols, geometry.wave):
        x, y = layout.coords(texels)
        blocks = np.unique((y // geometry.block_height << 24) + x // geometry.block_width).size
        useful += texels.size
        fetched += blocks * geometry.block_width * geometry.block_height
    return useful / fetched if fetched else 1.0


def cache_efficiency(layout: TexelLayout, pattern: str, rows: int, texel_cols: int, geometry: Geometry) -> float:
    """Texels read over the texels the cache model fetches (misses x block): the L1's sets, ways and
    LRU included, so a walk whose blocks do not stay resident pays for them again."""
    cache = TextureCache(geometry.cache)
    useful = fetched = 0
    for texels in wave_reads(pattern, rows, texel_cols, geometry.wave):
        cache.flush()
        x, y = layout.coords(texels)
        misses = cache.access(*cache.blocks_of(x, y))
        useful += texels.size
        fetched += misses * geometry.block_width * geometry.block_height
    return useful / fetched if fetched else 1.0


def gflops_factor(layout: TexelLayout, wave: int) -> float:
    """Share of wave lanes that do useful work when waves cover whole tiles."""
    if layout.kind == "flat":
        return 1.0
    texels = layout.tile_h * layout.tile_texels_w
    return texels / (-(-texels // wave) * wave)


@dataclass(frozen=True)
class Candidate:
    layout: TexelLayout
    score: float
    relaxed: tuple[str, ...]
    scored_by: str = "block count"
    block_score: float = 0.0  # the block-count score, which breaks ties of the cache model's


def _constraints(layout: TexelLayout, rows: int, texel_cols: int, geometry: Geometry) -> dict[str, bool]:
    padded = layout.width * layout.height
    return {"C1": (layout.tile_h * layout.tile_texels_w) % geometry.wave == 0,
            "C2": (layout.tile_texels_w * 16) % geometry.line_bytes == 0,
            "C3": padded <= (1 + MAX_PADDING) * rows * texel_cols}


@lru_cache(maxsize=4096)
def rank_candidates(rows: int, cols: int, patterns: tuple[tuple[str, float], ...],
                    geometry: Geometry) -> tuple[Candidate, ...]:
    """Every candidate tile that survives pruning, best first, with its score. The block count
    ranks them all; the cache model re-scores the best SIMULATED, which then lead."""
    texel_cols = cols // 4
    survivors: dict[tuple[str, ...], list[Candidate]] = {}
    for tile_h in TILE_ROWS:
        for tile_w in TILE_COLS:
            if tile_h > rows or tile_w // 4 > texel_cols:
                continue
            packing = "strip" if (tile_w // 4) * 16 <= geometry.line_bytes and tile_h > 1 else "block"
            layout = rtile_layout(rows, cols, tile_h, tile_w, packing, geometry.max_width)
            checks = _constraints(layout, rows, texel_cols, geometry)
            if not checks["C3"]:
                continue
            relaxed = tuple(name for name in ("C1", "C2") if not checks[name])
            score = _score(layout, patterns, rows, texel_cols, geometry, block_efficiency)
            survivors.setdefault(relaxed, []).append(Candidate(layout, score, relaxed, block_score=score))
    for relaxed in ((), ("C1",), ("C2",), ("C1", "C2")):
        if relaxed in survivors:
            ranked = sorted(survivors[relaxed], key=lambda c: -c.score)
            simulated = [Candidate(c.layout, _score(c.layout, patterns, rows, texel_cols, geometry, cache_efficiency),
                                   relaxed, "cache model", c.block_score) for c in ranked[:SIMULATED]]
            return tuple(sorted(simulated, key=lambda c: (-c.score, -c.block_score))) + tuple(ranked[SIMULATED:])
    return ()


def _score(layout: TexelLayout, patterns: tuple[tuple[str, float], ...], rows: int, texel_cols: int,
           geometry: Geometry, efficiency: Callable[..., float]) -> float:
    """Eq. 2: GFLOPS factor x memory efficiency, weighted over the tensor's access patterns."""
    total = sum(weight for _, weight in patterns) or 1.0
    return gflops_factor(layout, geometry.wave) * sum(
        weight / total * efficiency(layout, pattern, rows, texel_cols, geometry) for pattern, weight in patterns)


# the pass --------------------------------------------------------------------------------------

def _eligible(value: ir.Value, host_visible: set[int]) -> tuple[int, int] | None:
    """(rows, cols) when `value` may take an R-Tile layout."""
    shape = static_shape(value)
    if id(value) in host_visible or len(shape) < 2 or shape[-1] % 4 or numel(shape) < 4 * MIN_TEXELS \
            or value.dtype == ir.DataType.BOOL:
        return None
    producer = value.producer()
    if producer is None or producer.op_type == "Constant":
        return None
    return numel(shape) // shape[-1], shape[-1]


def _annotate(item: ir.Value | ir.Node, key: str, text: str) -> bool:
    """Set metadata `key`; True when it changed."""
    if item.metadata_props.get(key) == text:
        return False
    item.metadata_props[key] = text
    return True


class RTileSelect(ir.passes.InPlacePass):
    """Choose and annotate each stored tensor's texel layout (in place)."""

    name = "rtile_select"

    def __init__(self, profile: Profile, mode: str = "rtile") -> None:
        super().__init__()
        self.geometry = Geometry.of(profile)
        self.max_height = profile.image2d_max_height
        self.mode = mode

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        host_visible = {id(view_root(v)) for v in list(graph.inputs) + list(graph.outputs)
                        + list(graph.initializers.values())}
        roots = [v for v in list(graph.inputs) + list(graph.initializers.values())]
        roots += [v for n in graph if not is_view(n) for v in n.outputs if v is not None and v.name]
        chosen: dict[int, tuple[TexelLayout, str, Candidate | None]] = {}
        if self.mode == "rtile":
            self._select(graph, host_visible, chosen)
        modified = graph.metadata_props.get(keys.LAYOUT) != self.mode
        graph.metadata_props[keys.LAYOUT] = self.mode  # the codegen tiles its kernels under "rtile"
        for value in roots:
            if id(value) not in chosen:
                shape = static_shape(value)
                texels = max(1, -(-numel(shape) // 4))
                if value.dtype == ir.DataType.BOOL and id(value) not in host_visible:  # saved masks: 8 bits a byte
                    flat = mask_layout("mask8", numel(shape), self.geometry.max_width, self.max_height)
                elif self.mode == "rtile":
                    flat = matrix_layout(shape, self.geometry.max_width, self.max_height)
                else:
                    flat = flat_layout(texels, self.geometry.max_width)
                chosen[id(value)] = (flat, flat.kind, None)
            layout, how, candidate = chosen[id(value)]
            modified |= _annotate(value, keys.LAYOUT, layout.to_json())
            if candidate is not None:
                modified |= _annotate(value, CHOICE, json.dumps({
                    "how": how, "score": round(candidate.score, 4), "scored_by": candidate.scored_by,
                    "relaxed": list(candidate.relaxed)}))
        for node in graph:
            described = []
            for out in node.outputs:
                if out is None or not out.name:
                    continue
                if is_view(node):
                    described.append(f"{out.name}: view of {view_root(out).name}")
                elif id(out) in chosen:
                    described.append(f"{out.name}: {chosen[id(out)][0].describe()}")
            modified |= _annotate(node, keys.LAYOUT, "; ".join(described))
        return ir.passes.PassResult(model, modified)

    def _best(self, value: ir.Value, host_visible: set[int]) -> Candidate | None:
        matrix = _eligible(value, host_visible)
        if matrix is None:
            return None
        patterns = tuple(sorted(_accesses(value).items()))
        ranked = rank_candidates(*matrix, patterns, self.geometry)
        return ranked[0] if ranked else None

    def _select(self, graph: ir.Graph, host_visible: set[int],
                chosen: dict[int, tuple[TexelLayout, str, Candidate | None]]) -> None:
        anchors = [n for n in graph if n.metadata_props.get(keys.FTD) == Ftd.DEPENDENT_DIVERGENT.value]
        anchors.sort(key=lambda n: -max((numel(static_shape(v)) for v in n.inputs if v is not None), default=0))
        followers = {Ftd.DEPENDENT_CONSISTENT.value, Ftd.INDEPENDENT_CONSISTENT.value}
        for anchor in anchors:
            for operand in list(anchor.inputs) + list(anchor.outputs):
                if operand is None:
                    continue
                root = view_root(operand)
                if id(root) in chosen:
                    continue
                best = self._best(root, host_visible)
                if best is None:
                    continue
                chosen[id(root)] = (best.layout, f"anchor {anchor.op_type} '{anchor.name}'", best)
                self._propagate(root, best, host_visible, followers, chosen)
        for node in graph:
            if is_view(node):
                continue
            for out in node.outputs:
                if out is not None and out.name and id(out) not in chosen:
                    best = self._best(out, host_visible)
                    if best is not None:
                        chosen[id(out)] = (best.layout, "own accesses", best)

    def _propagate(self, root: ir.Value, candidate: Candidate, host_visible: set[int], followers: set[str],
                   chosen: dict[int, tuple[TexelLayout, str, Candidate | None]]) -> None:
        shape = static_shape(root)
        for use in root.uses():
            node = use.node
            if node.metadata_props.get(keys.FTD) not in followers or is_view(node):
                continue
            for out in node.outputs:
                if (out is not None and out.name and id(out) not in chosen and static_shape(out) == shape
                        and _eligible(out, host_visible) is not None):
                    chosen[id(out)] = (candidate.layout, f"propagated from '{root.name}'", candidate)
