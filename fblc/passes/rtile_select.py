"""rtile_select: one texel layout per stored tensor, serving its forward and backward kernels (DESIGN.md 6).

Rewrite: writes `fblc.layout` (a TexelLayout as JSON) on every value that owns a texture, and
a readable summary as `fblc.layout` on every node (Netron shows node metadata). Values the
runtimes read or write (graph inputs and outputs, initializers, constants) and tensors that
are not [rows, cols] matrices with cols a multiple of 4 stay flat. For the others:
- candidates: tile_h x tile_w for tile_h in TILE_ROWS, tile_w in TILE_COLS; `strip` packing
  when a tile row fits a cache line, else `block`; arranged by texel_layout.rtile_layout;
- pruning: C1 a tile's texels are a multiple of the wave size; C2 a tile row is a multiple of
  the cache line; C3 padding at most 10 %. Constraints are relaxed in the order C1, C2 when
  nothing survives (the report says which);
- score (the paper's eq. 2): sum over every kernel that touches the tensor (its writer and
  every reader, through index maps, forward and backward) of weight x GFLOPS factor x memory
  efficiency. Memory efficiency is the texels a wave of work-items reads in one lockstep step
  over the texels of the distinct cache blocks (the profile's block geometry) it touches.
  Access patterns: `stream` (consecutive texels), `rows` (each work-item walks its own row),
  `columns` (each work-item walks its own column);
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
from functools import lru_cache

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.index_map import IndexMap, is_view, map_of, view_root
from fblc.compiler.values import attr, numel, static_shape
from fblc.passes.ftd_taxonomy import Ftd
from fblc.profiles import Profile
from fblc.texel_layout import TexelLayout, flat_layout, rtile_layout

TILE_ROWS = (1, 2, 4, 8, 16, 32, 64)
TILE_COLS = (4, 8, 16, 32, 64, 128)  # elements
MAX_PADDING = 0.10
MIN_TEXELS = 64  # smaller tensors stay flat: one work-group reads them whole
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

    @classmethod
    def of(cls, profile: Profile) -> Geometry:
        return cls(profile.wave_size, profile.line_bytes, profile.tex_block_width, profile.tex_block_height,
                   profile.image2d_max_width)


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

def _footprints(pattern: str, rows: int, texel_cols: int, wave: int) -> list[np.ndarray]:
    """Texel indices one wave reads in one lockstep step, at a few sampled places."""
    steps = []
    if pattern == "stream":
        total = rows * texel_cols
        for start in (0, total // 3, (2 * total) // 3):
            steps.append(np.arange(start, min(total, start + wave)))
    elif pattern == "rows":  # work-items own rows r0.., all at texel column j
        for r0, j in ((0, 0), (rows // 2, texel_cols // 2), (max(0, rows - wave), texel_cols - 1)):
            r = np.arange(r0, min(rows, r0 + wave))
            steps.append(r * texel_cols + j)
    else:  # columns: work-items own texel columns q0.., all at row i
        for i, q0 in ((0, 0), (rows // 2, texel_cols // 2), (rows - 1, max(0, texel_cols - wave))):
            q = np.arange(q0, min(texel_cols, q0 + wave))
            steps.append(i * texel_cols + q)
    return [s for s in steps if s.size]


def memory_efficiency(layout: TexelLayout, pattern: str, rows: int, texel_cols: int, geometry: Geometry) -> float:
    """Texels read over texels fetched (whole cache blocks), summed over the sampled lockstep steps."""
    steps = _footprints(pattern, rows, texel_cols, geometry.wave)
    if not steps:
        return 1.0
    texels = np.concatenate(steps)
    sample = np.repeat(np.arange(len(steps)), [s.size for s in steps])
    x, y = layout.coords(texels)
    blocks = np.unique((sample << 40) + (y // geometry.block_height << 20) + x // geometry.block_width).size
    return texels.size / (blocks * geometry.block_width * geometry.block_height)


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


def _constraints(layout: TexelLayout, rows: int, texel_cols: int, geometry: Geometry) -> dict[str, bool]:
    padded = layout.width * layout.height
    return {"C1": (layout.tile_h * layout.tile_texels_w) % geometry.wave == 0,
            "C2": (layout.tile_texels_w * 16) % geometry.line_bytes == 0,
            "C3": padded <= (1 + MAX_PADDING) * rows * texel_cols}


@lru_cache(maxsize=4096)
def rank_candidates(rows: int, cols: int, patterns: tuple[tuple[str, float], ...],
                    geometry: Geometry) -> tuple[Candidate, ...]:
    """Every candidate tile that survives pruning, best first, with its score."""
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
            efficiency = sum(weight * memory_efficiency(layout, pattern, rows, texel_cols, geometry)
                             for pattern, weight in patterns)
            score = gflops_factor(layout, geometry.wave) * efficiency
            survivors.setdefault(relaxed, []).append(Candidate(layout, score, relaxed))
    for relaxed in ((), ("C1",), ("C2",), ("C1", "C2")):
        if relaxed in survivors:
            return tuple(sorted(survivors[relaxed], key=lambda c: -c.score))
    return ()


# the pass --------------------------------------------------------------------------------------

def _eligible(value: ir.Value, host_visible: set[int]) -> tuple[int, int] | None:
    """(rows, cols) when `value` may take an R-Tile layout."""
    shape = static_shape(value)
    if id(value) in host_visible or len(shape) < 2 or shape[-1] % 4 or numel(shape) < 4 * MIN_TEXELS:
        return None
    producer = value.producer()
    if producer is None or producer.op_type == "Constant":
        return None
    return numel(shape) // shape[-1], shape[-1]


class RTileSelect(ir.passes.InPlacePass):
    """Choose and annotate each stored tensor's texel layout (in place)."""

    name = "rtile_select"

    def __init__(self, profile: Profile, mode: str = "rtile") -> None:
        super().__init__()
        self.geometry = Geometry.of(profile)
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
                texels = max(1, -(-numel(static_shape(value)) // 4))
                chosen[id(value)] = (flat_layout(texels, self.geometry.max_width), "flat", None)
            layout, how, candidate = chosen[id(value)]
            text = layout.to_json()
            if value.metadata_props.get(keys.LAYOUT) != text:
                value.metadata_props[keys.LAYOUT] = text
                modified = True
            if candidate is not None:
                value.metadata_props[CHOICE] = json.dumps({"how": how, "score": round(candidate.score, 4),
                                                           "relaxed": list(candidate.relaxed)})
        for node in graph:
            described = []
            for out in node.outputs:
                if out is None or not out.name:
                    continue
                if is_view(node):
                    described.append(f"{out.name}: view of {view_root(out).name}")
                elif id(out) in chosen:
                    described.append(f"{out.name}: {chosen[id(out)][0].describe()}")
            node.metadata_props[keys.LAYOUT] = "; ".join(described)
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
