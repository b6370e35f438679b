"""rtile_select: one texel layout per stored tensor, serving its forward and backward kernels.

Rewrite: writes `fblc.layout` (a TexelLayout as JSON) on every value that owns a texture, and
a readable summary as `fblc.layout` on every node (Netron shows node metadata). Under the traced
search parameters and optimizer state may take tiles: the state and its `.new` update, which swap
images after each step, get one layout scored on the reads of both (the runtimes pack params.bin
and unpack parameters through it). Other values the runtimes read or write (data inputs, other graph
outputs, constants) and tensors that are not [rows, cols] matrices with cols a multiple of 4
stay flat (linear addressing; a matrix
then gets one image row per matrix row, texel_layout.matrix_layout). Boolean tensors the step
keeps (activation masks saved for the backward) take `mask8`: one bit per element, 8 to a byte
(kernel_schedules stores it as `mask4` for a writer that cannot write whole bytes). For the others:
- candidates: tile_h x tile_w for tile_h in TILE_ROWS, tile_w in TILE_COLS; `strip` packing
  when a tile row fits a cache line, else `block`; arranged by texel_layout.rtile_layout;
- pruning: C1 a tile's texels are a multiple of the wave size; C2 a tile row is a multiple of
  the cache line; C3 padding at most 10 %. Constraints are relaxed in the order C1, C2 when
  nothing survives (the report says which);
- score: over every kernel that touches the tensor (its writer and every reader, through index
  maps, forward and backward), the memory efficiency of its walk, the texels a wave reads in
  WAVE_STEPS lockstep steps over the texels of the distinct cache blocks (the profile's block
  geometry) fetched for them. Access patterns: `stream` (consecutive texels), `rows` (each
  work-item walks its own row), `columns` (each walks its own column). The candidates rank by the
  target's estimated time of those kernels (layout_score.access_estimate: each takes max(FLOPs over
  peak, bytes over bandwidth), its bytes of this tensor the fetched blocks), so the walks of kernels
  bound by their arithmetic decide nothing; then by the paper's eq. 2 (GFLOPS factor, the share of
  wave lanes busy on whole tiles, x the efficiencies weighted by the elements each kernel moves);
- every tensor takes its own best: its score already weighs every kernel that reads it, forward
  and backward. No conversion kernel is ever needed: every kernel addresses each texture through
  its own layout, so no op class has to pull a region onto one layout (docs/ARCHITECTURE.md,
  section 2: the ablation that removed the FTD-guided anchors and propagation).
The search (`--layout-search`): "blocks" (the default) as above; "traced" re-scores the best
candidates by block count, tiles and folds alike, on the texels the step's own kernels read from
the tensor (every reader, forward and backward, traced work-group by work-group under the plan's
schedule: fblc.tools.traced_layouts), replayed through the target's texture-cache model: each
reading launch's missed blocks enter the target's time estimate (max(arithmetic, bytes over
bandwidth), as report.json's `estimate`), and the least estimated time decides (fewer misses
break ties, as where every reader is bound by its arithmetic); "flat" every tensor takes the
conventional flat layout (kernels, register tiles
and remapping as under rtile, so only the layouts differ). With mode "naive" every value is
flat (the conventional baseline). Preconditions: fused or unfused step graph with static shapes,
after tile_remap. In place.
"""

from __future__ import annotations

import json

import onnx_ir as ir

from fblc import choices
from fblc.compiler import keys, ops
from fblc.compiler.index_map import IndexMap, is_view, map_of, read_uses, view_root
from fblc.compiler.values import attr, numel, static_shape
from fblc.errors import FblcError
from fblc.compiler.flops import node_flops
from fblc.passes.layout_score import (
    ELEMENT_BYTES,
    Access,
    Candidate,
    Geometry,
    TracedReads,
    rank_candidates,
    rank_folds,
    rescore_traced,
)
from fblc.profiles import Profile
from fblc.texel_layout import TexelLayout, flat_layout, mask_layout
from fblc.passes.contracts import ContractPass

MIN_TEXELS = 64  # smaller tensors stay flat: one work-group reads them whole
STREAM = (Access("stream", 1.0),)
#: --layout-search: how tensors are scored (flat: not at all, every tensor flat)
LAYOUT_SEARCHES = choices.LAYOUT_SEARCHES
#: ops that walk one axis as a row (the op table's `row_axis`, fblc/compiler/ops.py)
ROW_AXIS_OPS = ops.ops_where(lambda entry: entry.row_axis)


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


def _node_costs(node: ir.Node | None, skip: ir.Value, geometry: Geometry) -> tuple[float, float]:
    """(arithmetic ms, ms of its other tensors' bytes) of `node` on the target (codegen.reports (estimate)'s terms,
    per node before fusion), leaving out `skip`, the tensor being placed."""
    if node is None:
        return 0.0, 0.0
    others = [v for v in list(node.inputs) + list(node.outputs) if v is not None and v is not skip and v.shape]
    moved = sum(numel(static_shape(v)) for v in others) * ELEMENT_BYTES
    return node_flops(node) / (geometry.peak_gflops * 1e6), moved / (geometry.bandwidth_gbps * 1e6)


def _accesses(root: ir.Value, geometry: Geometry) -> tuple[Access, ...]:
    """How the root's writer (a stream) and each of its readers walk it, with what else each costs."""
    accesses = [Access("stream", float(numel(static_shape(root))), *_node_costs(root.producer(), root, geometry))]
    for value, use in read_uses(root):
        pattern = access_pattern(use.node, use.idx, map_of(value))
        accesses.append(Access(pattern, float(numel(static_shape(value))), *_node_costs(use.node, value, geometry)))
    return tuple(accesses)


# the pass --------------------------------------------------------------------------------------

def _eligible(value: ir.Value, host_visible: set[int], state: bool = False) -> tuple[int, int] | None:
    """(rows, cols) when `value` may take an R-Tile layout (`state`: a parameter or optimizer state that
    the runtimes swap with its update, which they unpack through its layout)."""
    shape = static_shape(value)
    if (id(value) in host_visible and not state) or len(shape) < 2 or shape[-1] % 4 \
            or numel(shape) < 4 * MIN_TEXELS or value.dtype == ir.DataType.BOOL:
        return None
    producer = value.producer()
    if not state and (producer is None or producer.op_type == "Constant"):
        return None
    return numel(shape) // shape[-1], shape[-1]


def state_pairs(graph: ir.Graph) -> list[tuple[ir.Value, ir.Value]]:
    """(state, the root of its update): the parameters and optimizer state whose `.new` output takes
    their image after each step, so both must share one layout."""
    inputs = {v.name: v for v in graph.inputs}
    return [(inputs[o.name[: -len(".new")]], view_root(o)) for o in graph.outputs
            if o.name.endswith(".new") and o.name[: -len(".new")] in inputs]


def _annotate(item: ir.Value | ir.Node, key: str, text: str) -> bool:
    """Set metadata `key`; True when it changed."""
    if item.metadata_props.get(key) == text:
        return False
    item.metadata_props[key] = text
    return True


class RTileSelect(ContractPass):
    """Choose and annotate each stored tensor's texel layout (in place)."""

    name = "rtile_select"
    requires_facts = ("static shapes", "index maps")
    ensures_facts = ("layouts",)

    def __init__(self, profile: Profile, mode: str = "rtile", search: str = "blocks",
                 traced: TracedReads | None = None) -> None:
        super().__init__()
        if search == "traced" and traced is None and mode == "rtile":
            raise FblcError("layout search 'traced' needs the reads of the step's kernels",
                            "pass the options through fblc.tools.traced_layouts.with_traced_reads first (fblc "
                            "compile --layout-search traced does)")
        self.geometry = Geometry.of(profile)
        self.mode, self.traced = mode, traced or {}
        self.searched = search != "flat"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        host_visible = {id(view_root(v)) for v in list(graph.inputs) + list(graph.outputs)
                        + list(graph.initializers.values())}
        roots = [v for v in list(graph.inputs) + list(graph.initializers.values())]
        roots += [v for n in graph if not is_view(n) for v in n.outputs if v is not None and v.name]
        chosen: dict[int, tuple[TexelLayout, str, Candidate | None]] = {}
        if self.mode == "rtile" and self.searched:
            self._select(graph, host_visible, chosen)
        modified = graph.metadata_props.get(keys.LAYOUT_MODE) != self.mode
        graph.metadata_props[keys.LAYOUT_MODE] = self.mode  # the codegen tiles its kernels under "rtile"
        for value in roots:
            if id(value) not in chosen:
                chosen[id(value)] = self._flat(value, host_visible)
            layout, how, candidate = chosen[id(value)]
            modified |= _annotate(value, keys.LAYOUT, layout.to_json())
            if candidate is not None:
                choice = {"how": how, "score": round(candidate.score, 4), "scored_by": candidate.scored_by,
                          "relaxed": list(candidate.relaxed)}
                if candidate.estimate_ms is not None:
                    choice["estimate_ms"] = round(candidate.estimate_ms, 6)
                modified |= _annotate(value, keys.LAYOUT_CHOICE, json.dumps(choice))
        for node in graph:
            described = []
            for out in node.outputs:
                if out is None or not out.name:
                    continue
                if is_view(node):
                    described.append(f"{out.name}: view of {view_root(out).name}")
                elif id(out) in chosen:
                    described.append(f"{out.name}: {chosen[id(out)][0].describe()}")
            modified |= _annotate(node, keys.LAYOUT_NOTE, "; ".join(described))
        return ir.passes.PassResult(model, modified)

    def _flat(self, value: ir.Value, host_visible: set[int]) -> tuple[TexelLayout, str, Candidate | None]:
        """The layout of a tensor that takes no tile: a mask, or its texels folded into an image (under
        rtile the fold the score prefers; under naive the conventional widest rows)."""
        shape = static_shape(value)
        count = numel(shape)
        if value.dtype == ir.DataType.BOOL and id(value) not in host_visible:  # saved masks: 8 bits a byte
            layout = mask_layout("mask8", count, *self.geometry.limits(-(-count // 8)))
            return layout, layout.kind, None
        if self.mode == "rtile" and self.searched:
            # what the runtimes exchange is folded by its shape alone: a parameter and its update (P, P.new),
            # which swap images after every step, must share one layout
            patterns = STREAM if id(value) in host_visible else _accesses(value, self.geometry)
            ranked = rank_folds(shape, patterns, self.geometry)
            streams = None if id(value) in host_visible else self.traced.get(value.name)
            best = (rescore_traced(ranked, streams, self.geometry) if streams else ranked)[0]
            return best.layout, "fold", best
        texels = max(1, -(-count // 4))
        return flat_layout(texels, self.geometry.limits(texels)[0]), "flat", None

    def _best(self, value: ir.Value, host_visible: set[int], update: ir.Value | None = None) -> Candidate | None:
        """The best layout for `value` (and for `update`, the state's `.new` that swaps images with it)."""
        matrix = _eligible(value, host_visible, state=update is not None)
        if matrix is None:
            return None
        patterns = _accesses(value, self.geometry) + (_accesses(update, self.geometry) if update is not None else ())
        ranked = rank_candidates(*matrix, patterns, self.geometry)
        streams = list(self.traced.get(value.name, ())) + list(self.traced.get(update.name, ()) if update else ())
        if streams:  # tiles and folds alike, on what the kernels read: a flat fold may serve them best
            folds = rank_folds(static_shape(value), patterns, self.geometry)
            ranked = rescore_traced(sorted(ranked + folds, key=lambda c: -c.block_score), streams, self.geometry)
        return ranked[0] if ranked else None

    def _select(self, graph: ir.Graph, host_visible: set[int],
                chosen: dict[int, tuple[TexelLayout, str, Candidate | None]]) -> None:
        # tiled state only on traced reads: the block count of synthetic walks, which cannot see that the
        # optimizer streams a parameter while the contractions walk it, tiled the Llama decoder's weights
        # into 43 % more simulated misses on adreno830 (2,083,817 against 1,459,105 flat)
        for state, update in state_pairs(graph) if self.traced else ():
            best = self._best(state, host_visible, update)
            if best is not None and id(update) not in chosen:
                chosen[id(state)] = chosen[id(update)] = (best.layout, "its own and its update's accesses", best)
        for node in graph:
            if is_view(node):
                continue
            for out in node.outputs:
                if out is not None and out.name and id(out) not in chosen:
                    best = self._best(out, host_visible)
                    if best is not None:
                        chosen[id(out)] = (best.layout, "own accesses", best)
