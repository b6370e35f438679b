"""Layout passes (ftd_taxonomy, tile_remap, rtile_select) and the texel layouts the codegen reads.

Golden before/after annotations on a small attention block, the cases each pass leaves alone,
and the numeric check: one training step with `--layout rtile` and with `--layout naive`
equals onnxruntime's run of the same step (fp32, rtol 1e-4 / atol 1e-5, fblc.tools.verify).
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from fblc.codegen.compile import compile_model
from fblc.tools.verify import verify_model
from fblc.compiler import keys
from fblc.compiler.index_map import IndexMap, view_root
from fblc.compiler.model_io import load_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.ftd_taxonomy import FtdTaxonomy
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from fblc.passes.layout_score import Candidate, Geometry, rank_candidates
from fblc.passes.rtile_select import RTileSelect, state_pairs
from fblc.profiles import load_profile
from fblc.texel_layout import TexelLayout, mask_layout, pack, rtile_layout, unpack
from tests.conftest import make_model

B, T, H, D = 2, 8, 4, 4
C = H * D
OPTIONS = TrainingOptions(loss="output", optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9))


def attention_proto() -> onnx.ModelProto:
    """x[B,T,C] -> q,k,v heads (Reshape + Transpose) -> softmax(q k^T) v -> merge heads -> Wo -> mean."""
    rng = np.random.default_rng(0)
    nodes, inits = [], {}
    for name in ("q", "k", "v"):
        inits[f"w{name}"] = (rng.standard_normal((C, C)) / 4).astype(np.float32)
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}_flat"], name=f"proj_{name}"),
                  helper.make_node("Reshape", [f"{name}_flat", "split_shape"], [f"{name}_split"], name=f"split_{name}"),
                  helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3],
                                   name=f"heads_{name}")]
    inits["split_shape"] = np.array([B, T, H, D], dtype=np.int64)
    inits["merge_shape"] = np.array([B, T, C], dtype=np.int64)
    inits["wo"] = (rng.standard_normal((C, C)) / 4).astype(np.float32)
    nodes += [
        helper.make_node("Transpose", ["k_heads"], ["k_t"], perm=[0, 1, 3, 2], name="k_transpose"),
        helper.make_node("MatMul", ["q_heads", "k_t"], ["scores"], name="scores"),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["probs", "v_heads"], ["context"], name="context"),
        helper.make_node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3], name="unheads"),
        helper.make_node("Reshape", ["context_t", "merge_shape"], ["merged"], name="merge"),
        helper.make_node("MatMul", ["merged", "wo"], ["out"], name="proj_o"),
        helper.make_node("ReduceMean", ["out"], ["loss_value"], keepdims=0, name="mean"),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, T, C])],
                      [helper.make_tensor_value_info("loss_value", TensorProto.FLOAT, [])], inits)


@pytest.fixture(scope="module")
def attention_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("layout") / "attention.onnx")
    onnx.save(attention_proto(), path)
    return path


def lowered(path: str, layout: str = "rtile", target: str = "local") -> ir.Model:
    return build_training_graph(load_model(path), TrainingOptions(loss="output", layout=layout),
                                lower=load_profile(target))


def node(model: ir.Model, name: str) -> ir.Node:
    return next(n for n in model.graph if n.name == name)


# index maps -----------------------------------------------------------------------------------

def test_index_map_composition() -> None:
    root = IndexMap.identity((B, T, C))
    split = root.reshaped((B, T, H, D))
    assert split == IndexMap((B, T, H, D), (T * C, C, D, 1))
    heads = split.transposed([0, 2, 1, 3])
    assert heads == IndexMap((B, H, T, D), (T * C, D, C, 1)) and not heads.contiguous
    assert heads.transposed([0, 1, 3, 2]).strides == (T * C, D, 1, C)
    # B and H are not contiguous with each other after the transpose: B * H is a folded axis of two digits
    assert heads.reshaped((B * H, T, D)) == IndexMap((B * H, T, D), (D, C, 1), folds=(((B, T * C),), (), ()))
    assert heads.transposed([0, 2, 1, 3]).reshaped((B, T, C)) == root  # the inverse permutation merges again
    assert IndexMap.identity((3, 1)).broadcast((2, 3, 5)).strides == (0, 1, 0)


# ftd_taxonomy ---------------------------------------------------------------------------------

def test_ftd_taxonomy_golden(attention_path: str) -> None:
    step = lowered(attention_path)
    classes = {n.name: n.metadata_props[keys.FTD] for n in step.graph}
    assert classes["proj_q"] == classes["scores"] == "FTD-D"
    # split_softmax ran first: the softmax is its row statistic and its map (whose last node keeps its name)
    split = {n.op_type: classes[n.name] for n in step.graph
             if n.name == "softmax" or n.name.startswith("softmax/split/")}
    assert split == {"ReduceLogSumExp": "FTI-D", "Sub": "FTI-C", "Exp": "FTD-C"}
    assert classes["heads_q"] == classes["merge"] == "FTI-D"
    assert all(label in ("FTD-D", "FTD-C", "FTI-D", "FTI-C") for label in classes.values())


def test_ftd_taxonomy_gives_an_unknown_op_the_class_that_assumes_nothing() -> None:
    # the class is a layout hint: an op the compiler cannot run is reported by the kernel emitters
    graph = ir.Graph([], [], nodes=[ir.Node("", "Hardmax", [ir.Value(name="x")], name="odd")], name="g")
    FtdTaxonomy()(ir.Model(graph, ir_version=10))
    assert graph[0].metadata_props[keys.FTD] == "FTI-D"


# tile_remap -----------------------------------------------------------------------------------

def test_tile_remap_golden(attention_path: str) -> None:
    step = lowered(attention_path)
    maps = {n.name: IndexMap.from_json(n.metadata_props[keys.INDEX_MAP]) for n in step.graph
            if keys.INDEX_MAP in n.metadata_props}
    assert maps["split_q"] == IndexMap((B, T, H, D), (T * C, C, D, 1))
    assert maps["heads_q"] == IndexMap((B, H, T, D), (T * C, D, C, 1))
    assert maps["k_transpose"] == IndexMap((B, H, D, T), (T * C, D, 1, C))  # q k^T reads k in place
    # the heads merge back after a transpose: C folds H (stride D) over D (stride 1), which proj_o walks as two loops
    assert maps["merge"] == IndexMap((B, T, C), (T * C, D, 1), folds=((), (), ((H, T * D),)))
    # the backward of `scores` needs k (not k^T): a Transpose of the view that maps back
    transposes = [n for n in step.graph if n.op_type == "Transpose"]
    assert all(keys.INDEX_MAP in n.metadata_props for n in transposes), [n.name for n in transposes
                                                                          if keys.INDEX_MAP not in n.metadata_props]


def test_tile_remap_leaves_naive_and_graph_outputs(attention_path: str) -> None:
    naive = lowered(attention_path, "naive")
    assert not any(keys.INDEX_MAP in n.metadata_props for n in naive.graph)
    assert all(n.metadata_props[keys.KERNEL].startswith("k") for n in naive.graph if n.op_type == "Transpose")
    step = lowered(attention_path)
    outputs = {id(v) for v in step.graph.outputs}
    for n in step.graph:
        if any(id(v) in outputs for v in n.outputs) and n.op_type in ("Transpose", "Reshape"):
            assert n.metadata_props[keys.REMAP] in ("remapped", "kept: graph output (the runtimes read it as "
                                                                  "a plain tensor)")


def _save_scaled_step(path: str, middle: list[onnx.NodeProto], summed: str, seed: int) -> str:
    """xw = x[4, 3, 16] * w, then `middle` (which makes `summed` and proj = ... @ p[8, 4]); out =
    sum(summed) + sum(proj). Saved at `path`."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"], name="scale"), *middle,
             helper.make_node("ReduceSum", [summed], ["r1"], keepdims=0, name=f"sum_{summed}"),
             helper.make_node("ReduceSum", ["proj"], ["r2"], keepdims=0, name="sum_proj"),
             helper.make_node("Add", ["r1", "r2"], ["out"], name="out")]
    rng = np.random.default_rng(seed)
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 16])],
                         [helper.make_tensor_value_info("out", TensorProto.FLOAT, [])],
                         {"w": rng.standard_normal((4, 3, 16)).astype(np.float32),
                          "p": rng.standard_normal((8, 4)).astype(np.float32)}), path)
    return path


def _rotary_halves(path: str) -> str:
    """y = concat(-x[..., 8:], x[..., :8]) * w (a rotary embedding's rotate_half), then a MatMul that
    reads a slice directly: the two halves are views; the MatMul, which reads by strides alone, keeps its
    slice a copy."""
    starts = {"lo": [0], "hi": [8], "mid": [4]}
    ends = {"lo": [8], "hi": [16], "mid": [12]}
    constants = [helper.make_node("Constant", [], [f"{k}_{part}"], value=helper.make_tensor(
                 f"{k}_{part}", TensorProto.INT64, [1], values[part])) for k, values in (("s", starts), ("e", ends))
                 for part in starts] + [helper.make_node("Constant", [], ["ax"], value=helper.make_tensor(
                     "ax", TensorProto.INT64, [1], [-1]))]
    return _save_scaled_step(path, constants + [
        helper.make_node("Slice", ["xw", "s_lo", "e_lo", "ax"], ["lo"], name="slice_lo"),
        helper.make_node("Slice", ["xw", "s_hi", "e_hi", "ax"], ["hi"], name="slice_hi"),
        helper.make_node("Slice", ["xw", "s_mid", "e_mid", "ax"], ["mid"], name="slice_mid"),
        helper.make_node("Neg", ["hi"], ["neg"], name="neg"),
        helper.make_node("Concat", ["neg", "lo"], ["rot"], axis=-1, name="cat"),
        helper.make_node("MatMul", ["mid", "p"], ["proj"], name="proj")], "rot", seed=5)


def test_slices_become_views_where_their_readers_add_the_offset(tmp_path) -> None:
    step = lowered(_rotary_halves(str(tmp_path / "rotary.onnx")))
    maps = {n.name: IndexMap.from_json(n.metadata_props[keys.INDEX_MAP]) for n in step.graph
            if keys.INDEX_MAP in n.metadata_props}
    assert maps["slice_lo"] == IndexMap((4, 3, 8), (48, 16, 1), 0)
    assert maps["slice_hi"] == IndexMap((4, 3, 8), (48, 16, 1), 8)  # read by Neg: starts 8 elements in
    assert "slice_mid" not in maps  # read by the MatMul, whose kernel reads strides but no offset
    assert "no offset" in node(step, "slice_mid").metadata_props[keys.REMAP]
    rows = verify_model(str(tmp_path / "rotary.onnx"), OPTIONS)
    assert rows and not [r.name for r in rows if not r.ok]


def _split_into_matmul(path: str) -> str:
    """(a, b) = Split(x * w) along the last axis; b feeds a MatMul, whose kernel reads no view offset."""
    return _save_scaled_step(path, [
        helper.make_node("Constant", [], ["sizes"], value=helper.make_tensor("sizes", TensorProto.INT64, [2], [8, 8])),
        helper.make_node("Split", ["xw", "sizes"], ["a", "b"], axis=-1, name="split"),
        helper.make_node("Neg", ["a"], ["na"], name="neg"),
        helper.make_node("MatMul", ["b", "p"], ["proj"], name="proj")], "na", seed=6)


def test_splits_become_views_when_every_output_can_be_one(tmp_path) -> None:
    """The Concat's gradient Split (read by Neg's gradient and the Slice's Pad) becomes two views of dy
    and runs no kernel; a Split with an output read by a MatMul stays one Split kernel; both
    steps equal onnxruntime's."""
    step = lowered(_rotary_halves(str(tmp_path / "rotary.onnx")))
    assert "Split" not in [n.op_type for n in step.graph]
    views = [IndexMap.from_json(n.metadata_props[keys.INDEX_MAP]) for n in step.graph
             if n.op_type == "Slice" and "/view/" in n.name]
    # dy of the Concat is the loss's broadcast (stride 0): each half a view of it
    assert [v.shape for v in views] == [(4, 3, 8), (4, 3, 8)]
    kept = lowered(_split_into_matmul(str(tmp_path / "split.onnx")))
    assert [n.name for n in kept.graph if n.op_type == "Split"] == ["split"]
    assert not [n for n in kept.graph if n.op_type == "Slice"]  # the tried Slices are gone again
    for path in (tmp_path / "rotary.onnx", tmp_path / "split.onnx"):
        rows = verify_model(str(path), OPTIONS)
        assert rows and not [r.name for r in rows if not r.ok], path


def _gathers_into_elementwise(path: str) -> str:
    """y = concat(-x[..., 8:], x[..., :8]) * s + pad(x[..., :8], 8 after): the Concat and the Pad are read
    by elementwise ops only; q = -(x * v) feeds both a Pad (through a slice) and the Add that reads it."""
    def ints(name: str, values: list[int]) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64,
                                                                                  [len(values)], values))
    nodes = [ints("lo_s", [0]), ints("lo_e", [8]), ints("hi_s", [8]), ints("hi_e", [16]), ints("ax", [-1]),
             ints("pads", [0, 0, 0, 0, 0, 8]),
             helper.make_node("Mul", ["x", "w"], ["xw"], name="scale"),
             helper.make_node("Slice", ["xw", "lo_s", "lo_e", "ax"], ["lo"], name="slice_lo"),
             helper.make_node("Slice", ["xw", "hi_s", "hi_e", "ax"], ["hi"], name="slice_hi"),
             helper.make_node("Neg", ["hi"], ["neg"], name="neg"),
             helper.make_node("Concat", ["neg", "lo"], ["rot"], axis=-1, name="cat"),
             helper.make_node("Pad", ["lo", "pads"], ["padded"], name="pad"),
             helper.make_node("Mul", ["rot", "s"], ["rs"], name="rot_scale"),
             helper.make_node("Add", ["rs", "padded"], ["y"], name="join"),
             helper.make_node("Mul", ["x", "v"], ["xv"], name="q_scale"),
             helper.make_node("Neg", ["xv"], ["q"], name="q"),
             helper.make_node("Slice", ["q", "lo_s", "lo_e", "ax"], ["q_lo"], name="q_slice"),
             helper.make_node("Pad", ["q_lo", "pads"], ["q_pad"], name="q_pad"),
             helper.make_node("Add", ["q_pad", "q"], ["z"], name="q_join"),
             helper.make_node("Add", ["y", "z"], ["yz"], name="both"),
             helper.make_node("ReduceSum", ["yz"], ["out"], keepdims=0, name="total")]
    rng = np.random.default_rng(7)
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 16])],
                         [helper.make_tensor_value_info("out", TensorProto.FLOAT, [])],
                         {name: rng.standard_normal((4, 3, 16)).astype(np.float32) for name in ("w", "s", "v")}), path)
    return path


def test_concat_and_pad_fuse_into_the_elementwise_chains_that_read_them(tmp_path) -> None:
    """Golden: rotate_half's Concat and a Pad join the chain that reads them (one kernel, no movement
    kernel for either); negative: a Pad whose input's producer the reading chain also computes stays
    apart (it reads that input at other elements), as does a Concat read by a reduction (_rotary_halves);
    both steps equal onnxruntime's under both layouts."""
    path = _gathers_into_elementwise(str(tmp_path / "gathers.onnx"))
    step = lowered(path)
    kernel = {n.name: n.metadata_props.get(keys.KERNEL) for n in step.graph}
    assert kernel["cat"] == kernel["pad"] == kernel["rot_scale"] == kernel["join"]
    assert kernel["neg"] != kernel["cat"]  # it makes the Concat's input
    assert kernel["q_pad"] != kernel["q"]  # the Add reads q itself: the Pad stays its own kernel
    rotary = lowered(_rotary_halves(str(tmp_path / "rotary.onnx")))
    rotary_kernel = {n.name: n.metadata_props.get(keys.KERNEL) for n in rotary.graph}
    assert rotary_kernel["cat"] not in (rotary_kernel["neg"], rotary_kernel["sum_rot"])  # read by a reduction
    for layout in ("rtile", "naive"):
        rows = verify_model(path, TrainingOptions(loss="output", layout=layout, optimizer=OPTIONS.optimizer))
        assert rows and not [r.name for r in rows if not r.ok], layout


@pytest.mark.parametrize("layout", ["rtile", "naive"])
def test_attention_step_matches_onnxruntime(attention_path: str, layout: str) -> None:
    rows = verify_model(attention_path, TrainingOptions(loss="output", layout=layout, optimizer=OPTIONS.optimizer))
    assert rows and not [r.name for r in rows if not r.ok]


def test_report_counts_data_movement(attention_path: str, tmp_path) -> None:
    _, rtile = compile_model(attention_path, str(tmp_path / "rtile"), "adreno830", "fp32", OPTIONS)
    _, naive = compile_model(attention_path, str(tmp_path / "naive"), "adreno830", "fp32",
                             TrainingOptions(loss="output", layout="naive", optimizer=OPTIONS.optimizer))
    stored = json.loads((tmp_path / "rtile" / "report.json").read_text())["layout"]
    assert stored["data_movement_before"] == naive["layout"]["data_movement_after"] > 0
    assert stored["data_movement_after"] < naive["layout"]["data_movement_after"]
    assert stored["conversion_kernels"] <= stored["data_movement_after"]
    assert stored["movement_kernels"] == rtile["kernels_per_family"].get("movement", 0) \
        == sum(stored["movement_kernels_by_op"].values())
    assert naive["layout"]["conversion_kernels"] == naive["layout"]["data_movement_after"]
    assert rtile["kernels_per_family"].get("movement", 0) < naive["kernels_per_family"]["movement"]
    assert stored["textures_by_layout"].get("rtile", 0) > 0


# rtile_select and texel layouts ---------------------------------------------------------------

def test_rtile_select_golden(attention_path: str) -> None:
    step = lowered(attention_path, target="adreno830")
    assert step.graph.metadata_props[keys.LAYOUT_MODE] == "rtile"
    layouts = {v.name: TexelLayout.from_dict(json.loads(v.metadata_props[keys.LAYOUT]))
               for n in step.graph for v in n.outputs if keys.LAYOUT in v.metadata_props}
    scores = layouts["scores"]  # [B, H, T, T]: 64 x 8, tiled
    assert scores.kind == "rtile" and (scores.rows, scores.cols) == (B * H * T, T)
    pairs = state_pairs(step.graph)
    for value in list(step.graph.inputs) + list(step.graph.outputs):  # the runtimes write and read these flat
        assert json.loads(view_root(value).metadata_props[keys.LAYOUT])["kind"] == "flat", value.name
    for old, new in pairs:  # a parameter or its optimizer state and its update swap images: one layout, and
        assert old.metadata_props[keys.LAYOUT] == new.metadata_props[keys.LAYOUT], old.name  # flat but traced
        assert json.loads(old.metadata_props[keys.LAYOUT])["kind"] == "flat", old.name
    assert "rtile" in node(step, "scores").metadata_props[keys.LAYOUT_NOTE]


def test_rtile_select_leaves_odd_widths_flat() -> None:
    proto = make_model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                        helper.make_node("Relu", ["h"], ["y"], name="relu"),
                        helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0, name="sum")],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 16])],
                       [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
                       {"w": np.ones((16, 7), np.float32)})
    model = ir.from_proto(proto)
    step = build_training_graph(model, TrainingOptions(loss="output"), lower=load_profile("local"))
    h = next(v for n in step.graph for v in n.outputs if v.name == "h")
    assert json.loads(h.metadata_props[keys.LAYOUT])["kind"] == "flat"  # 7 columns: a texel would span rows


def _tile(candidate: Candidate) -> tuple[int, int, str]:
    return candidate.layout.tile_h, candidate.layout.tile_w, candidate.layout.packing


@pytest.mark.parametrize("rows, cols, patterns", [(256, 256, ("columns", "rows", "stream")),
                                                  (64, 512, ("rows", "stream"))])
def test_two_profiles_choose_different_tiles(rows: int, cols: int, patterns: tuple[str, ...]) -> None:
    """The same tensor and accesses under adreno830 (8x4 blocks, 64-wide waves, 8 sets) and mali-g925
    (4x4 blocks, 16-wide waves, 16 sets): each profile's choice has an estimated time no longer than the
    other's there, or the other's is pruned (C1: a tile's texels must fill whole waves)."""
    weighted = tuple((p, 1.0) for p in patterns)
    ranked = {name: rank_candidates(rows, cols, weighted, Geometry.of(load_profile(name)))
              for name in ("adreno830", "mali-g925")}
    adreno, mali = ranked["adreno830"][0], ranked["mali-g925"][0]
    assert _tile(adreno) != _tile(mali)
    for own, other, name in ((adreno, mali, "adreno830"), (mali, adreno, "mali-g925")):
        rival = next((c for c in ranked[name] if _tile(c) == _tile(other)), None)
        explanation = [(_tile(c), c.estimate_ms, round(c.score, 3), c.scored_by) for c in ranked[name][:5]]
        assert own.scored_by == "block count", explanation
        assert rival is None or own.estimate_ms <= rival.estimate_ms, explanation


@pytest.mark.parametrize("tile", [(1, 16, "block"), (4, 16, "strip"), (8, 64, "block"), (2, 8, "strip")])
def test_texel_layout_round_trip(tile: tuple[int, int, str]) -> None:
    rows, cols = 24, 40
    layout = rtile_layout(rows, cols, *tile, max_width=64)
    x, y = layout.coords(np.arange(rows * cols // 4))
    assert len(set(zip(x.tolist(), y.tolist()))) == rows * cols // 4  # no two texels share a place
    assert x.max() < layout.width and y.max() < layout.height
    data = np.arange(rows * cols, dtype=np.float32)
    assert np.array_equal(unpack(pack(data, layout, np.float32), layout, data.size), data)


def test_rtile_select_is_stable(attention_path: str) -> None:
    step = lowered(attention_path)
    assert not RTileSelect(load_profile("local"))(step).modified


# the texture-cache report -----------------------------------------------------------------------

def test_traced_reads_are_the_texels_a_kernel_reads(tmp_path) -> None:
    """x [64, 16] * w [16] -> Relu -> ReduceSum: the fused forward+backward elementwise kernel's
    work-item i of work-group g reads texel 64g + i of x once (x * w and dw share it: the texel's
    4 lanes are its 4 elements, read before the lane loop) and the texel of w under it once
    (flat layouts); the trace must give exactly that back."""
    from fblc.tools.cache_report import cache_report
    from fblc.runtime.trace import ReadTracer

    proto = make_model([helper.make_node("Mul", ["x", "w"], ["xw"], name="scale"),
                        helper.make_node("Relu", ["xw"], ["y"], name="relu"),
                        helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0, name="sum")],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 16])],
                       [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])], {"w": np.ones(16, np.float32)})
    path = str(tmp_path / "relu.onnx")
    onnx.save(proto, path)
    bundle = str(tmp_path / "bundle")
    compile_model(path, bundle, "adreno830", "fp32", TrainingOptions(loss="output", layout="naive"))
    tracer = ReadTracer(bundle)
    feeds = {"x": np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)}
    tracer.step(feeds)
    x_texture, w_texture = tracer.plan["values"]["x"], tracer.plan["values"]["w"]
    relu = next(i for i, k in enumerate(tracer.plan["kernels"]) if x_texture in k["inputs"])
    width = tracer.plan["textures"][x_texture]["width"]
    reads = tracer.reads(relu, 1)
    assert reads.issued == len(reads.textures)  # nothing past the recording capacity
    on_x, on_w = reads.textures == x_texture, reads.textures == w_texture
    texels, counts = np.unique((reads.ys * width + reads.xs)[on_x], return_counts=True)
    assert texels.tolist() == list(range(64, 128)) and (counts == 1).all()
    w_texels = (reads.ys * 4 + reads.xs)[on_w]
    assert on_w.sum() == 64 and w_texels.tolist() == [t % 4 for t in range(64, 128)]
    assert (reads.ys * width + reads.xs)[on_x][:64].tolist() == list(range(64, 128))  # every item's 1st read first
    report = cache_report(bundle, load_profile("adreno830"), feeds)
    kernels = {k["kernel"]: k for k in report["kernels"]}
    sampled = [tracer.reads(relu, group).issued for group in (0, tracer.groups(relu) - 1)]  # what it samples
    assert kernels[tracer.plan["kernels"][relu]["name"]]["texel_reads"] == round(sum(sampled) * 4 / 2)
    assert report["texel_reads"] == sum(k["texel_reads"] for k in report["kernels"])
    assert 0 < report["misses"] <= report["texel_reads"] and report["block_fetches"] <= report["misses"] * 2


def test_mask8_packs_eight_booleans_per_byte_lsb_first() -> None:
    """Element i is bit i & 7 of byte i >> 3, as numpy's packbits(bitorder="little") and the public
    MemFLoRA code pack; the image is exactly ceil(n / 8) bytes when a width divides them."""
    mask = np.zeros(19, bool)
    mask[[0, 9, 10, 18]] = True
    layout = mask_layout("mask8", mask.size, 16, 16)
    assert (layout.kind, layout.width, layout.height) == ("mask8", 3, 1)
    image = pack(mask, layout, np.uint8)
    assert image.dtype == np.uint8 and image.tolist() == [0b1, 0b110, 0b100]
    assert np.array_equal(image, np.packbits(mask, bitorder="little"))
    assert np.array_equal(unpack(image, layout, mask.size), mask.astype(np.uint8))
    random = np.random.default_rng(0).random(1001) > 0.5
    wide = mask_layout("mask8", random.size, 16, 64)  # 126 bytes: 14 x 9, no padding
    assert (wide.width, wide.height) == (14, 9)
    assert np.array_equal(unpack(pack(random, wide, np.uint8), wide, random.size), random.astype(np.uint8))
    fallback = mask_layout("mask4", mask.size, 16, 16)  # a texel's 4 elements in the low bits of its byte
    assert pack(mask, fallback, np.uint8).tolist() == [0b1, 0b0, 0b110, 0b0, 0b100]
    assert mask_layout("mask8", 8 * 4099, 4096, 4096).width == 4096  # 4099 is prime: rows of 4096, padded


def test_mask8_bytes_pairing_texels_three_apart_hold_rows_2j_and_2j_plus_1() -> None:
    """mask_pair_stride P = 3: texel t is nibble (t / 3) & 1 of byte (t / 6) * 3 + t % 3, so bytes 0..2 hold
    texels 0..2 (low) and 3..5 (high), bytes 3..5 texels 6..8 and 9..11; still ceil(n / 8) bytes; pack and
    unpack agree with that map (the runtimes read and write saved masks through them)."""
    mask = np.zeros(48, bool)  # 12 texels
    mask[[0, 13, 14, 47]] = True  # texel 0 lane 0, texel 3 lanes 1 and 2, texel 11 lane 3
    layout = mask_layout("mask8", mask.size, 16, 16, pair_stride=3)
    assert (layout.kind, layout.width, layout.height, layout.mask_pair_stride) == ("mask8", 6, 1, 3)
    image = pack(mask, layout, np.uint8)
    assert image.tolist() == [0b1 | 0b0110 << 4, 0, 0, 0, 0, 0b1000 << 4]
    assert np.array_equal(unpack(image, layout, mask.size), mask.astype(np.uint8))
    assert TexelLayout.from_dict(json.loads(layout.to_json())) == layout
    assert "mask_pair_stride" not in mask_layout("mask8", mask.size, 16, 16).to_json()  # unpaired: as before
    random = np.random.default_rng(1).random(7 * 4 * 10) > 0.5  # 70 texels in runs of 14
    paired = mask_layout("mask8", random.size, 64, 64, pair_stride=7)
    assert paired.width * paired.height == random.size // 8
    assert np.array_equal(unpack(pack(random, paired, np.uint8), paired, random.size), random.astype(np.uint8))
    with pytest.raises(ValueError, match="pairs none"):
        mask_layout("mask4", mask.size, 16, 16, pair_stride=3)


def _masked_conv_proto(batch: int, channels: int, height: int, width: int, hidden: int = 0) -> onnx.ModelProto:
    """x [batch, 3, height, width] -> Conv 3x3 (pads 1) -> Relu -> GlobalAveragePool -> Flatten [-> Gemm
    -> Relu -> Gemm]: under MemFLoRA every Relu saves a mask, written by the kernel that computes it."""
    rng = np.random.default_rng(3)
    inits = {"conv.weight": rng.standard_normal((channels, 3, 3, 3)).astype(np.float32),
             "conv.bias": rng.standard_normal(channels).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["a"], name="relu"),
             helper.make_node("GlobalAveragePool", ["a"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["y" if not hidden else "f"], name="flatten")]
    classes = channels
    if hidden:
        classes = 5
        inits.update({"fc1.weight": rng.standard_normal((hidden, channels)).astype(np.float32),
                      "fc1.bias": rng.standard_normal(hidden).astype(np.float32),
                      "fc2.weight": rng.standard_normal((classes, hidden)).astype(np.float32)})
        nodes += [helper.make_node("Gemm", ["f", "fc1.weight", "fc1.bias"], ["h"], transB=1, name="fc1"),
                  helper.make_node("Relu", ["h"], ["r"], name="relu_fc"),
                  helper.make_node("Gemm", ["r", "fc2.weight"], ["y"], transB=1, name="fc2")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, height, width])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, classes])], inits)


MASK_WRITERS = {  # case -> (batch, channels, height, width, hidden), the (format, byte pair stride) of the masks
    "per-lane conv, 7 texels: pairs of 1-texel items, the last alone": ((1, 3, 3, 3, 0), [("r_mask8", 1)]),
    "conv over row texels (rows of 7), a prologue per texel": ((1, 3, 3, 7, 0), [("r_mask8", 1)]),
    "conv spatial tile of 5 texels, 9 items: pairs, the last alone": ((1, 3, 3, 20, 0), [("r_mask8", 1)]),
    "conv channel tile of 6 texels": ((1, 8, 1, 6, 0), [("r_mask8", 1)]),
    # the conv's register tile of 4 channels splits consecutive texels (rows of 1 texel, 4 apart): its mask's bytes
    # pair the tile's rows 2j and 2j + 1 (mask_pair_stride 4), one bit an element as ever, where it was r_mask4
    "gemm 2-D tile, 2 texel columns": ((8, 4, 4, 4, 16), [("r_mask8", 4), ("r_mask8", 1)]),
    # and the Gemm's 2-D tile of rows of 3 texels too (stride 3, odd): bytes pair texels 3 apart
    "gemm 2-D tile, rows of 3 texels: bytes pairing its rows": ((8, 4, 4, 4, 12), [("r_mask8", 4), ("r_mask8", 3)]),
}


@pytest.mark.parametrize("case", list(MASK_WRITERS))
def test_mask_writers_write_whole_bytes_and_the_step_matches_onnxruntime(tmp_path, case: str) -> None:
    """Each way a kernel covers its texels (one, a row's 5, a channel tile, 2-D tiles) writes its
    saved mask in whole bytes of one bit an element (r_mask8; a 2-D tile whose consecutive texels lie in
    two work-items, in bytes pairing its rows); the memory plan accounts the images the bundle
    allocates; the MemFLoRA step (whose adapter gradients go through the masks) equals onnxruntime's."""
    from fblc.compiler.adapters import AdapterConfig

    shape, formats = MASK_WRITERS[case]
    path = str(tmp_path / "net.onnx")
    onnx.save(_masked_conv_proto(*shape), path)
    options = TrainingOptions(loss="cross_entropy", optimizer=OptimizerConfig("sgd", lr=0.1),
                              adapter=AdapterConfig("memflora", rank=2))
    step, report = compile_model(path, str(tmp_path / "b"), "local", "fp32", options)
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    masks = [t for t in plan["textures"] if t["format"].startswith("r_mask")]
    assert [(t["format"], t["layout"].get("mask_pair_stride", 1)) for t in masks] == formats
    writers = {name: k["schedule"] for k in plan["kernels"] for name in k["schedule"].get("paired_masks", [])}
    for texture in masks:  # bytes pair texels P apart only where the writer's tile has rows P apart
        pair = texture["layout"].get("mask_pair_stride", 1)
        assert pair == 1 or (writers[texture["name"]]["tile_stride"], writers[texture["name"]]["tile_columns"]) \
            == (pair, 1)
    # the mask layouts are on the step before its one memory plan: the graph's fblc.mem agrees with report.json
    planned = {v.name: json.loads(v.metadata_props[keys.MEM])["bytes"] for n in step.graph for v in n.outputs
               if v is not None and keys.MEM in v.metadata_props}
    for texture in masks:
        per_byte = 8 if texture["format"] == "r_mask8" else 4
        assert texture["layout"]["kind"] == texture["format"][2:]
        assert texture["width"] * texture["height"] == -(-int(np.prod(texture["shape"])) // per_byte)
        assert planned[texture["name"]] == texture["width"] * texture["height"], texture["name"]
    assert report["memory"]["saved_masks"] == sum(t["width"] * t["height"] for t in masks)
    bundle = str(tmp_path / "verified")
    rows = verify_model(path, options, work_dir=str(tmp_path), keep_bundle=bundle)
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]
    if any(t["layout"].get("mask_pair_stride", 1) != 1 for t in masks):  # bytes pairing rows: read back as written
        _assert_masks_read_back(path, bundle, shape, masks)


def _assert_masks_read_back(path: str, bundle: str, shape: tuple[int, ...], masks: list[dict]) -> None:
    """The masks the device wrote, unpacked on the host through their layouts (LocalRunner.read), are the
    forward's own: conv output > 0 (mask 'conv/...') and hidden Gemm output > 0 (mask 'relu_fc/...')."""
    import onnxruntime as ort

    from fblc.runtime.local import LocalRunner

    batch, _, height, width, _ = shape
    x = np.random.default_rng(3).standard_normal((batch, 3, height, width)).astype(np.float32)
    model = onnx.load(path)
    model.graph.output.extend([helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("c", "h")])
    conv, hidden = ort.InferenceSession(model.SerializeToString()).run(["c", "h"], {"x": x})
    runner = LocalRunner(bundle, storage="image")
    runner.step({"x": x, "labels": np.zeros(batch, np.int64)})
    for texture in masks:
        expected = (conv if texture["name"].startswith("conv/") else hidden) > 0
        assert np.array_equal(runner.read(texture["name"]).reshape(expected.shape).astype(bool), expected), \
            texture["name"]


def test_saved_masks_are_mask8_textures_the_runtime_allocates_as_planned(tmp_path) -> None:
    """MemFLoRA keeps only q = P x and the activation's mask for the backward: the mask is an r_mask8
    texture of ceil(n / 8) bytes, which the kernel computing the activation writes a byte (two
    texels) at a time and LocalRunner allocates as the memory plan accounts it; the step still
    equals onnxruntime's."""
    from fblc.compiler.adapters import AdapterConfig
    from fblc.runtime.local import LocalRunner
    from tests.test_memory_floor import conv_bn_relu6_proto

    path = str(tmp_path / "conv.onnx")
    onnx.save(conv_bn_relu6_proto(), path)
    options = TrainingOptions(loss="cross_entropy", optimizer=OPTIONS.optimizer, adapter=AdapterConfig("memflora", rank=2))
    _, report = compile_model(path, str(tmp_path / "b"), "local", "fp32", options)
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    masks = [t for t in plan["textures"] if t["format"] == "r_mask8"]
    assert masks and all(t["layout"]["kind"] == "mask8" for t in masks)
    assert not [t for t in plan["textures"] if t["format"] == "r_mask4"]
    assert [t["width"] * t["height"] for t in masks] == [-(-int(np.prod(t["shape"])) // 8) for t in masks]
    assert re.search(r"write_imageui\(out0, [^;]*\(t >> 1\b", (tmp_path / "b" / "kernels.cl").read_text())  # byte t/2
    runner = LocalRunner(str(tmp_path / "b"), storage="image")
    mask_images = {t["image"] for t in masks}
    allocated = sum(int(runner.images[i].get_info(runner.cl.mem_info.SIZE)) for i in mask_images)
    if "portable" in runner.device.platform.name.lower():  # PoCL: an image takes exactly its texels
        assert allocated == report["memory"]["saved_masks"] == sum(t["width"] * t["height"] for t in masks)
    rows = verify_model(path, options)
    assert rows and all(r.ok for r in rows)


def test_a_mask_writing_conv_too_small_for_the_gpu_takes_the_tile_that_fetches_least(tmp_path) -> None:
    """A forward conv that writes a saved mask may not split its reduction (one work-item a tile), so where no
    tile fills the 830 (8 x 8 x 8 outputs: 128 texels) TileBudget.pick weighs its tiles by their fetches: a
    2 x 2 tile of texels (each input window read for 4 output texels, the mask's bytes whole in each
    work-item) rather than a texel a work-item, which fetched over 3x the texels. The step, run on the local
    device with the 830's kernels, equals onnxruntime's."""
    from fblc.compiler.adapters import AdapterConfig

    path = str(tmp_path / "net.onnx")
    onnx.save(_masked_conv_proto(1, 8, 8, 8), path)
    options = TrainingOptions(loss="cross_entropy", optimizer=OptimizerConfig("sgd", lr=0.1),
                              adapter=AdapterConfig("memflora", rank=2))
    rows = verify_model(path, options, target="adreno830", work_dir=str(tmp_path), keep_bundle=str(tmp_path / "b"))
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    masks = {k for k, t in enumerate(plan["textures"]) if t["format"].startswith("r_mask")}
    writers = [k for k in plan["kernels"] if k["family"] == "conv" and masks & set(k["outputs"])]
    assert [t["format"] for t in plan["textures"] if t["format"].startswith("r_mask")] == ["r_mask8"]
    assert [(k["schedule"]["texels_per_item"], k["items"]) for k in writers] == [(4, 32)]
