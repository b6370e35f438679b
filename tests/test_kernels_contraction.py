"""MatMul, Gemm, Conv and ConvTranspose kernels: one training step on PoCL against onnxruntime.

Each model is the op under test (its float operands are initializers, so they train) followed
by `ReduceSum(Mul(y, R))` with a fixed random R; the loss is that sum. A step checks the
forward kernel, the backward kernels (Conv: ConvTranspose and the grouped weight-gradient Conv;
MatMul: Transpose + MatMul) and the SGD update.

TEXEL_CASES are shapes where the texel-wide paths apply (an innermost output axis of length
% 4 == 0, or a weight gradient with short kernel rows) next to ones that fall back to per-lane
code; `test_contraction_paths` checks which path each kernel of a step took. The steps of CASES, TEXEL_CASES,
TILE_CASES, SPECTRAL_CASES (lower_dft's) and TRANSPOSE_CASES run merged, CHUNK to a step, in fp32 (MERGED_SETS;
tests/support/merged_steps.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("pyopencl")

from fblc.codegen import ir as kir
from fblc.codegen.compile import compile_model
from fblc.tools.verify import verify_model
from fblc.compiler.keys import KERNEL
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.fuse import ALIAS
from fblc.passes.pipeline import TrainingOptions
from tests.support import merged_steps
from tests.support.kernel_ir import loads_of, lowered_kernels, of_type, profile_with, statements

OPTIONS = TrainingOptions(loss="output", optimizer=OptimizerConfig("sgd", lr=0.1))


def _rand(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _node(op: str, inputs: list[str], output: str = "y", **attrs: Any) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], **attrs)


def _y_shape(nodes: list[onnx.NodeProto], arrays: dict[str, np.ndarray],
             feeds: list[onnx.ValueInfoProto]) -> tuple[int, ...]:
    graph = helper.make_graph(nodes + [helper.make_node("Identity", ["y"], ["probe"])], "probe", feeds,
                              [helper.make_tensor_value_info("probe", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in arrays.items()])
    inferred = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), strict_mode=True)
    value = next(v for v in inferred.graph.value_info if v.name == "y")
    return tuple(d.dim_value for d in value.type.tensor_type.shape.dim)


def write_case(path: str, nodes: list[onnx.NodeProto], inits: dict[str, tuple[int, ...] | np.ndarray],
               seed: int = 0, inputs: dict[str, tuple[int, ...]] | None = None) -> str:
    """Model: `nodes` computing `y`, then out = ReduceSum(y * R); shapes in `inits` become random initializers.

    `inputs` become float graph inputs (fed, not trained).
    """
    onnx.save(case_model(nodes, inits, seed, inputs), path)
    return path


def case_model(nodes: list[onnx.NodeProto], inits: dict[str, tuple[int, ...] | np.ndarray], seed: int = 0,
               inputs: dict[str, tuple[int, ...]] | None = None) -> onnx.ModelProto:
    """write_case's model, not saved."""
    rng = np.random.default_rng(seed)
    arrays = {k: (v if isinstance(v, np.ndarray) else _rand(rng, v)) for k, v in inits.items()}
    feeds = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v)) for k, v in (inputs or {}).items()]
    y_shape = _y_shape(nodes, arrays, feeds)
    r = numpy_helper.from_array(_rand(rng, y_shape), "R")
    nodes = nodes + [helper.make_node("Constant", [], ["R"], value=r),
                     helper.make_node("Mul", ["y", "R"], ["yr"]),
                     helper.make_node("ReduceSum", ["yr"], ["out"], keepdims=0)]
    graph = helper.make_graph(nodes, "case", feeds, [helper.make_tensor_value_info("out", TensorProto.FLOAT, [])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in arrays.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def assert_step_matches(path: str, dtype: str = "fp32", storage: str = "image") -> None:
    rows = verify_model(path, OPTIONS, dtype=dtype, storage=storage)
    assert rows, "verify compared nothing"
    bad = [r for r in rows if not r.ok]
    assert not bad, "\n".join(f"{r.name}: max_abs {r.max_abs:.3g} max_rel {r.max_rel:.3g}" for r in bad)


def conv(x: tuple[int, ...], w: tuple[int, ...], bias: bool = False, **attrs: Any) -> tuple:
    inputs = ["x", "w"] + (["b"] if bias else [])
    inits: dict[str, Any] = {"x": x, "w": w}
    if bias:
        inits["b"] = (w[0],)
    return [_node("Conv", inputs, **attrs)], inits


CASES = {
    "matmul_2d": ([_node("MatMul", ["a", "b"])], {"a": (5, 8), "b": (8, 6)}),
    "matmul_3d_broadcast": ([_node("MatMul", ["a", "b"])], {"a": (2, 3, 8), "b": (8, 5)}),
    "matmul_4d_broadcast": ([_node("MatMul", ["a", "b"])], {"a": (2, 1, 3, 4), "b": (1, 3, 4, 5)}),
    "matmul_1d_2d": ([_node("MatMul", ["a", "b"])], {"a": (6,), "b": (6, 4)}),
    "matmul_2d_1d_odd_k": ([_node("MatMul", ["a", "b"])], {"a": (3, 5), "b": (5,)}),  # K % 4 != 0: scalar tail
    "gemm_trans_alpha_beta": ([_node("Gemm", ["a", "b", "c"], transA=1, transB=1, alpha=0.5, beta=2.0)],
                              {"a": (8, 3), "b": (7, 8), "c": (7,)}),  # rows of 7: B^T's columns K apart
    "gemm_plain_column_c": ([_node("Gemm", ["a", "b", "c"])], {"a": (4, 6), "b": (6, 3), "c": (4, 1)}),
    "conv2d": conv((2, 3, 6, 6), (4, 3, 3, 3)),
    "conv2d_strided_asym_pads": conv((1, 2, 7, 6), (3, 2, 3, 2), strides=[2, 2], pads=[1, 0, 0, 1]),
    "conv2d_dilated": conv((1, 2, 7, 7), (2, 2, 3, 3), dilations=[2, 2], pads=[1, 1, 1, 1]),
    "conv2d_grouped": conv((2, 4, 5, 5), (6, 2, 3, 3), group=2, pads=[1, 1, 1, 1]),
    "conv2d_depthwise": conv((1, 4, 6, 6), (4, 1, 3, 3), group=4, strides=[2, 2], pads=[1, 1, 1, 1]),
    "conv2d_bias_1x1": conv((2, 8, 3, 3), (4, 8, 1, 1), bias=True),
    "conv1d": conv((2, 3, 9), (4, 3, 3), bias=True, strides=[2], pads=[1, 0]),
    "conv_temporal_k1": conv((1, 2, 8, 3), (3, 2, 3, 1), pads=[1, 0, 1, 0]),
    "conv_same_upper": conv((1, 2, 6, 5), (3, 2, 3, 3), auto_pad="SAME_UPPER", strides=[2, 2]),
    # AveragePool's gradient is a depthwise ConvTranspose over a constant ones kernel
    "conv_avgpool": ([_node("Conv", ["x", "w"], "c", pads=[1, 1, 1, 1]),
                      _node("AveragePool", ["c"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])],
                     {"x": (1, 2, 6, 6), "w": (3, 2, 3, 3)}),
}


#: lower_dft's rewrites, after the other cases in the merged steps (each case's seed is its index there), one case:
#: a complex DFT along axis 1 cut to 5 of 6 points (Transpose, Slice, Reshape, MatMul by the constant cosine/sine
#: matrix, Reshape, Transpose; its gradient MatMul's by the transposed matrix), and torch.stft's center=True: a
#: reflect Pad (here after an edge Pad; their kernels read mirrored positions, their gradients fold them back),
#: then STFT as a stride-3 Conv by the Hann-weighted cosine/sine taps
SPECTRAL_CASES = {
    "spectral_dft_stft_padded": (
        [_node("DFT", ["x", "n"], "d", axis=1),
         _node("Pad", ["s", "edge_pads"], "e", mode="edge"),
         _node("Pad", ["e", "reflect_pads"], "r", mode="reflect"),
         helper.make_node("Constant", [], ["window"], value=numpy_helper.from_array(np.hanning(8).astype(np.float32))),
         _node("STFT", ["r", "step", "window"], "f", onesided=1),  # onnx's inference assumes 0 where it is left
         _node("Reshape", ["d", "flat"], "d1"),  # out (the spec, onnxruntime and lower_dft: 1)
         _node("Reshape", ["f", "flat"], "f1"),
         _node("Concat", ["d1", "f1"], axis=0)],
        {"x": (2, 6, 3, 2), "n": np.array(5), "s": (2, 17, 1), "edge_pads": np.array([0, 1, 0, 0, 2, 0]),
         "reflect_pads": np.array([0, 4, 0, 0, 4, 0]), "step": np.array(3), "flat": np.array([-1])}),
}

#: ConvTranspose as a model op (a decoder's upsampling), after the spectral case in the merged steps (the earlier
#: cases keep their seeds and chunks): its input, weight and bias trained: the forward kernel, dX (a Conv of dY),
#: dW (a grouped Conv of dY against X), db; every attribute the exporters write
TRANSPOSE_CASES = {
    "conv_transpose_trained": ([_node("ConvTranspose", ["x", "wt", "b"], group=2, strides=[2, 1],
                                      pads=[1, 0, 0, 1], dilations=[1, 2], output_padding=[1, 0])],
                               {"x": (2, 4, 3, 4), "wt": (4, 3, 3, 2), "b": (6,)}),
    "conv_transpose_same_upper": ([_node("ConvTranspose", ["x", "wt"], strides=[2, 2], auto_pad="SAME_UPPER")],
                                  {"x": (1, 2, 3, 5), "wt": (2, 3, 3, 3)}),
    "conv_transpose_output_shape": ([_node("ConvTranspose", ["x", "wt"], strides=[2, 2], output_shape=[6, 8])],
                                    {"x": (1, 2, 3, 4), "wt": (2, 3, 3, 3)}),  # tf2onnx's form: pads derived
}


# name -> (nodes, initializers, the paths of the contraction kernels of the step by role):
# "tile" a work-item computes several texels, "texel" its 4 lanes together, "row" its 4 lanes together unless
# they cross the end of a row (a length >= 6 that is not a multiple of 4), "lane" per-lane code
TEXEL_CASES = {
    # T-ResNet's temporal convs: [N, C, T, 1], T % 4 == 0; the weight gradients are channel tiles
    "conv_temporal_k8": (*conv((2, 5, 12, 1), (4, 5, 8, 1), bias=True, pads=[3, 0, 4, 0]),
                         {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv_temporal_k5": (*conv((2, 6, 12, 1), (8, 6, 5, 1), pads=[2, 0, 2, 0]),
                         {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv_temporal_k3": (*conv((2, 3, 16, 1), (4, 3, 3, 1), pads=[1, 0, 1, 0]),
                         {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv_temporal_1x1": (*conv((2, 7, 8, 1), (4, 7, 1, 1), bias=True),
                          {"forward": "tile", "dx": "tile", "dw": "texel"}),
    # images with width % 4 == 0: strided (dX: a stride-2 transpose), dilated, depthwise
    "conv2d_w8_strided": (*conv((1, 2, 9, 16), (3, 2, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1]),
                          {"forward": "tile", "dx": "tile", "dw": "texel"}),
    "conv2d_w12_dilated": (*conv((1, 2, 8, 12), (2, 2, 3, 3), dilations=[2, 2], pads=[2, 2, 2, 2]),
                           {"forward": "tile", "dx": "tile", "dw": "lane"}),
    "conv2d_w8_depthwise": (*conv((2, 4, 6, 8), (4, 1, 3, 3), group=4, pads=[1, 1, 1, 1]),
                            {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv2d_w4_grouped": (*conv((1, 4, 6, 6), (8, 2, 3, 3), group=2, pads=[1, 0, 1, 0]),
                          {"forward": "texel", "dx": "row", "dw": "tile"}),
    # a stride of 3 does not divide 4: the input gradient falls back to per-lane code (its 6 x 24 planes, more
    # than a CPU tile's 128 accumulators, take no plane tile)
    "conv2d_stride3": (*conv((1, 2, 6, 24), (2, 2, 3, 3), strides=[1, 3]),
                       {"forward": "tile", "dx": "lane", "dw": "lane"}),
    # weight gradients with 40 dY taps: in blocks of 16 (spatial tile, then per lane)
    "conv_long_taps_tile": (*conv((1, 2, 40, 1), (3, 2, 8, 1), pads=[3, 0, 4, 0]),
                            {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv_long_taps_lane": (*conv((1, 2, 40, 1), (3, 2, 5, 1), pads=[2, 0, 2, 0]),
                            {"forward": "tile", "dx": "tile", "dw": "lane"}),
    "conv1d_channel_tile": (*conv((2, 4, 10), (8, 4, 3)), {"forward": "tile", "dx": "row", "dw": "tile"}),
    # rows of 7, 11, 15; a stride-2 transpose takes the row path where the stride divides the row (14 here)
    "conv2d_row_strided": (*conv((1, 2, 9, 14), (3, 2, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1]),
                           {"forward": "row", "dx": "row", "dw": "texel"}),
    "conv2d_row_strided_odd": (*conv((1, 2, 9, 15), (3, 2, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1]),
                               {"forward": "tile", "dx": "lane", "dw": "lane"}),
    "conv2d_row_dilated": (*conv((1, 2, 6, 11), (2, 2, 3, 3), dilations=[2, 2], pads=[2, 2, 2, 2], bias=True),
                           {"forward": "row", "dx": "row", "dw": "lane"}),
    # 1x1 convs over the flattened spatial axes: 15 and 12 positions
    "conv_pointwise_row": (*conv((2, 8, 3, 5), (8, 8, 1, 1)), {"forward": "row", "dx": "row", "dw": "texel"}),
    "conv_pointwise_tile": (*conv((2, 4, 2, 6), (4, 4, 1, 1), bias=True),
                            {"forward": "tile", "dx": "tile", "dw": "texel"}),
    "conv_1x1_padded": (*conv((2, 3, 5, 5), (4, 3, 1, 1), pads=[1, 1, 1, 1]),
                        {"forward": "row", "dx": "lane", "dw": "texel"}),
    "conv_1x1_w8": (*conv((2, 8, 3, 8), (4, 8, 1, 1), bias=True), {"forward": "tile", "dx": "tile", "dw": "texel"}),
    "matmul_texel": ([_node("MatMul", ["a", "b"])], {"a": (5, 20), "b": (20, 8)},
                     {"forward": "texel", "grad": "texel"}),
    "matmul_texel_k36_batched": ([_node("MatMul", ["a", "b"])], {"a": (2, 3, 36), "b": (36, 4)},
                                 {"forward": "texel", "grad": "texel"}),
    # attention's scores over 7 tokens (N % 4 != 0, batched B): texels within a row of scores reduce texel-wide
    "matmul_attention_rows": ([_node("MatMul", ["a", "b"])], {"a": (2, 3, 7, 8), "b": (2, 3, 8, 7)},
                              {"forward": "row", "grad": "row texel"}),
    "gemm_texel_trans_b": ([_node("Gemm", ["a", "b", "c"], transB=1, alpha=0.5)],
                           {"a": (3, 20), "b": (8, 20), "c": (8,)}, {"forward": "texel", "grad": "texel"}),
    "gemm_texel_trans_a": ([_node("Gemm", ["a", "b", "c"], transA=1, beta=2.0)],
                           {"a": (20, 3), "b": (20, 8), "c": (3, 8)}, {"forward": "texel", "grad": "texel lane"}),
}


#: staged kernels whose work-groups take blocks of runs of items (kernels/staging.py grouped_items): a temporal conv
#: with enough channels that on the local profile its forward, input and weight gradients' groups share both
#: operands (test_staging checks that they do); last in the merged sets, so that the cases before keep their seeds
GROUPED_CASES = {"conv_temporal_grouped_items": conv((4, 32, 48, 1), (32, 32, 5, 1), pads=[2, 0, 2, 0]),
                 # the forward and input gradient groups take runs a batch element apart, x copied run by run
                 "conv_temporal_run_spans": conv((8, 32, 24, 1), (32, 32, 5, 1), pads=[2, 0, 2, 0])}
#: a mean of a 1x1 Conv's and a 1x1 ConvTranspose's outputs: their dY is one element broadcast over the map (stride
#: 0), which the weight gradients' flattened pointwise form once read as a run of distinct elements
#: (conv_tiles._merged_stride)
BROADCAST_CASES = {"conv1x1_weight_grads_of_a_mean": (
    [_node("Conv", ["x", "w"], "c"), _node("ConvTranspose", ["x", "wt"], "t"),
     _node("ReduceMean", ["c"], "mc", keepdims=1), _node("ReduceMean", ["t"], "mt", keepdims=1),
     _node("Add", ["mc", "mt"])], {"x": (2, 8, 6, 6), "w": (16, 8, 1, 1), "wt": (8, 4, 1, 1)})}


def _case_model(folder: str, name: str, seed: int) -> onnx.ModelProto:
    every = CASES | TEXEL_CASES | TILE_CASES | SPECTRAL_CASES | TRANSPOSE_CASES | GROUPED_CASES | BROADCAST_CASES
    nodes, inits = every[name][:2]
    return onnx.load(write_case(os.path.join(folder, f"{name}.onnx"), nodes, inits, seed=seed))


#: (storage, dtype) -> the cases whose steps run merged, CHUNK to a step (tests/support/merged_steps.py: one PoCL
#: build for CHUNK cases, each case judged on its own rows; PoCL's time per kernel grows with its program, so
#: not all in one). Each case draws its values with its own seed (its index), since tie_weights would make
#: equal initializers of two cases one parameter.
MERGED_SETS: dict[tuple[str, str], list[str]] = {}
CHUNK = 12


@pytest.fixture(scope="module")
def merged_rows(tmp_path_factory) -> Callable[[str, str, str], list]:
    built: dict[tuple[str, str, int], list] = {}

    def rows(storage: str, dtype: str, name: str) -> list:
        names = MERGED_SETS[storage, dtype]
        chunk = names.index(name) // CHUNK
        if (storage, dtype, chunk) not in built:
            folder = str(tmp_path_factory.mktemp(f"contraction_{storage}_{dtype}_{chunk}"))
            cases = {case: _case_model(folder, case, seed) for seed, case in enumerate(names)
                     if seed // CHUNK == chunk}
            built[storage, dtype, chunk] = merged_steps.verify_merged(cases, OPTIONS, folder, dtype=dtype,
                                                                      storage=storage)
        return built[storage, dtype, chunk]

    return rows


def _assert_merged_case_matches(merged_rows: Callable[[str, str, str], list], name: str, storage: str = "image",
                                dtype: str = "fp32") -> None:
    merged_steps.assert_case_matches(merged_rows(storage, dtype, name), name, MERGED_SETS[storage, dtype])


@pytest.mark.xdist_group("contraction-merged-image")  # one worker builds the merged step for all its tests
@pytest.mark.parametrize("name", sorted(CASES) + sorted(TEXEL_CASES) + sorted(SPECTRAL_CASES) + sorted(TRANSPOSE_CASES)
                         + sorted(GROUPED_CASES) + sorted(BROADCAST_CASES))
def test_contraction_step(name: str, merged_rows) -> None:
    _assert_merged_case_matches(merged_rows, name)


def _role(kernel: Any) -> str:
    if kernel.name.endswith("ConvTranspose") or "/packed/" in kernel.nodes[0]:  # a 1x1 one: pointwise_transposes
        return "dx"
    grad = kernel.nodes[0].startswith("grad/")
    if kernel.name.endswith("_Conv"):
        return "dw" if grad else "forward"
    return "grad" if grad else "forward"


def _declared(kernel: Any) -> list[kir.Var]:
    return [s.var for s in statements(kernel) if isinstance(s, (kir.Declare, kir.DeclareArray))]


def _path(kernel: Any) -> str:
    if any(call.function == "get_group_id" for call in of_type(kernel, kir.Call)):  # a work-group shares each tile
        return "shared"
    declared = _declared(kernel)
    if any(var.name == "g" for var in declared):  # a work-item's tile of texels
        return "tile"
    if any(var.kind == "whole" for var in declared):  # texels that do not cross a row reduce texel-wide
        return "row"
    return "texel" if any(var.name == "u0" for var in declared) else "lane"


def _contractions(path: str, target: str = "local", options: TrainingOptions | None = None) -> list[Any]:
    """The step's conv and matmul kernels (each with its IR)."""
    return [k for k in lowered_kernels(path, target, "fp32", options or OPTIONS) if k.family in ("conv", "matmul")]


def _accumulator_arrays(kernel: Any) -> list[kir.DeclareArray]:
    return [s for s in statements(kernel) if isinstance(s, kir.DeclareArray) and s.var.kind in ("acc", "accv")]


# Under R-Tile layouts a MatMul/Gemm work-item computes an output tile of 8 or 4 rows (whichever divides
# the rows) by 2 texels (8 columns) or 1: matmul_tile is 8x8, the batched case 4x8, gemm_tile_trans_b 4x4;
# a Conv or ConvTranspose work-item a tile of output channels (or batch elements) by its texels.
TILE_CASES = {
    "matmul_tile": ([_node("MatMul", ["a", "b"])], {"a": (8, 20), "b": (20, 8)}, {"forward": "tile", "grad": "tile"}),
    "matmul_tile_batched": ([_node("MatMul", ["a", "b"])], {"a": (2, 4, 12), "b": (2, 12, 8)},
                            {"forward": "tile", "grad": "tile"}),
    # M = 6 rows (no multiple of 4) under a weight without a batch: the tile's rows run over A's batch x M (12)
    "matmul_tile_merged_rows": ([_node("MatMul", ["a", "b"])], {"a": (2, 6, 12), "b": (12, 8)},
                                {"forward": "tile", "grad": "tile"}),
    # M = 1 (FuRA-S's block rows, x L of [B*T, 1, 1, K] @ [1, K, N]): the tile's rows are A's batch rows, a row
    # stride apart, not M's (extent 1, stride 0: every row read row 0, `fblc verify` of llama FuRA-S ES)
    "matmul_tile_merged_rows_m1": ([_node("Reshape", ["a", "shape"], "ar"), _node("MatMul", ["ar", "b"])],
                                   {"a": (2, 4, 12), "shape": np.array([8, 1, 1, 12], np.int64), "b": (1, 12, 8)},
                                   {"forward": "tile", "grad": "tile"}),
    # heads merged back ([2, 2, 6, 4] -> [2, 6, 8]: a ViT's o_proj over 65 tokens) under a weight: A's rows are 4
    # apart within a batch element and 48 across, no one stride: a tile's 4 rows each from their own base
    "matmul_tile_heads_rows": ([_node("Transpose", ["a"], "at", perm=[0, 2, 1, 3]),
                                _node("Reshape", ["at", "shape"], "ar"), _node("MatMul", ["ar", "b"])],
                               {"a": (2, 2, 6, 4), "shape": np.array([2, 6, 8], np.int64), "b": (8, 8)},
                               {"forward": "tile", "grad": "tile"}),
    # M = 7 rows under a batched B' (attention's P @ V over 65 tokens), which no tile of rows may cross:
    # one row of 4 texel columns (16 outputs; its input gradient's rows of 2 texels: 2 columns)
    "matmul_tile_one_row_batched": ([_node("MatMul", ["a", "b"])], {"a": (2, 3, 7, 8), "b": (2, 3, 8, 16)},
                                    {"forward": "tile", "grad": "tile"}),
    # attention's scores over 14 tokens (N % 4 != 0) under 8 batch matrices: a row path's tile of 4 texels 14 apart
    # (the same columns of rows 4 apart: texels 0-1 of a matrix's rows 0-1 reduce as a tile, the others texel by
    # texel or, crossing a row, per lane); B's gradient [2, 4, 8, 14] has rows of 8 tokens: tiles of 2 rows
    "matmul_attention_rows_apart": ([_node("MatMul", ["a", "b"])], {"a": (2, 4, 14, 8), "b": (2, 4, 8, 14)},
                                    {"forward": "tile", "grad": "tile"}),
    "gemm_tile_trans_a": ([_node("Gemm", ["a", "b", "c"], transA=1, beta=2.0)],
                          {"a": (20, 8), "b": (20, 8), "c": (8, 8)}, {"forward": "tile", "grad": "tile"}),
    "gemm_tile_trans_b": ([_node("Gemm", ["a", "b", "c"], transB=1, alpha=0.5)],
                          {"a": (4, 20), "b": (12, 20), "c": (12,)}, {"forward": "tile", "grad": "tile"}),
    # conv register tiles: a work-item also computes the same positions of 4 or 2 more output channels
    # (rows 4 / gcd(plane, 4) channels apart where a channel's plane is no multiple of 4: 15 here), or of
    # more batch elements (a channel tile; the weight gradient's batch axis is the input channels)
    "conv_pointwise_rows_odd_plane": (*conv((2, 8, 3, 5), (16, 8, 1, 1)),
                                      {"forward": "tile", "dx": "tile", "dw": "tile"}),
    # rows of 30: two texel columns per tile row, channels 2 apart (a plane of 180 = 4 mod 8)
    "conv3x3_rows_two_columns": (*conv((1, 4, 6, 30), (8, 4, 3, 3), pads=[1, 1, 1, 1]),
                                 {"forward": "tile", "dx": "tile", "dw": "tile"}),
    # a grouped spatial tile: the 4 rows stay within a group of 8 output channels
    "conv_grouped_rows": (*conv((1, 8, 5, 8), (16, 4, 3, 3), group=2, pads=[1, 1, 1, 1]),
                          {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv_channel_tile_batches": (*conv((8, 4, 1, 6), (8, 4, 1, 3)), {"forward": "tile", "dx": "tile", "dw": "tile"}),
    # a 1x1 conv over planes of whole texels: its input gradient stays a ConvTranspose, whose tile rows are
    # consecutive channels, a pair of lanes of one W texel (test_a_tiles_channel_pairs_read_one_texel_of_w)
    "conv_pointwise_transpose_pairs": (*conv((1, 8, 6, 8), (8, 8, 1, 1)), {"forward": "tile", "dx": "tile",
                                                                           "dw": "tile"}),
    # depthwise: one channel per group, so a tile stacks output rows instead (4, 3 or 2 that divide the
    # height), which share their input rows; padded, strided, dilated and asymmetric windows
    "conv_depthwise_rows": (*conv((2, 4, 8, 8), (4, 1, 3, 3), group=4, pads=[1, 1, 1, 1], bias=True),
                            {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv_depthwise_rows_strided": (*conv((1, 4, 12, 16), (4, 1, 3, 3), group=4, strides=[2, 2], pads=[1, 1, 1, 1]),
                                    {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv_depthwise_rows_dilated": (*conv((1, 4, 10, 12), (4, 1, 3, 5), group=4, dilations=[2, 1],
                                          pads=[1, 2, 3, 2]), {"forward": "tile", "dx": "tile", "dw": "tile"}),
    # depthwise where no output rows stack (height 5; a row path's width 6): the same positions of 4 or 8
    # consecutive channels from a multiple of 4 (their weights and bias whole texels), in the forward and the
    # input gradient (a stride-2 one, whose transpose keeps its row taps a loop)
    "conv_depthwise_channel_rows": (*conv((2, 8, 5, 8), (8, 1, 3, 3), group=8, pads=[1, 1, 1, 1], bias=True),
                                    {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv_depthwise_channel_rows_strided": (*conv((1, 8, 12, 12), (8, 1, 3, 3), group=8, strides=[2, 2],
                                                  pads=[1, 1, 1, 1]), {"forward": "tile", "dx": "tile", "dw": "tile"}),
    # a 3x3 weight gradient over dY maps wider than TAP_BLOCK: 4 channels' 3x3 taps per work-item (36
    # lanes), the dY rows a loop under a row mask; the batch inside it, alone (2 x 360) or with a
    # run past SERIAL_REDUCTION (4 x 400) shared by a work-group per tile, and a strided conv's (dY taps
    # dilated by 2)
    "conv3x3_weight_grad_tile": (*conv((2, 4, 18, 20), (8, 4, 3, 3), pads=[1, 1, 1, 1]),
                                 {"forward": "tile", "dx": "tile", "dw": "tile"}),
    # a last stage's dY map (2 x 2) smaller than its 3 x 3 taps: the same tile (was per lane); and dY rows of
    # 16 under a batch of 4 (4 x 16 x 36 products a block of 4 channels: blocks of 1 keep it within STATIC_PRODUCTS)
    "conv3x3_weight_grad_small_map": (*conv((4, 8, 2, 2), (8, 8, 3, 3), pads=[1, 1, 1, 1]),
                                      {"forward": "tile", "dx": "tile", "dw": "tile"}),
    # its input gradient: a plane tile (whole 2 x 2 planes of 8 channels, was per lane); a strided conv's over
    # planes of 3 x 5 (rows neither of 4 texels nor of ROW_MIN): 4 channels' planes, 60 lanes
    "conv3x3_transpose_plane_strided": (*conv((2, 4, 3, 5), (8, 4, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1]),
                                        {"forward": "tile", "dx": "tile", "dw": "tile"}),
    # a depthwise one's over 4 x 2 planes (MobileNetV2's last maps): one channel's plane, 2 texels read at literal lanes
    "conv_depthwise_transpose_plane": (*conv((2, 8, 4, 2), (8, 1, 3, 3), group=8, pads=[1, 1, 1, 1]),
                                       {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv3x3_weight_grad_channel_blocks": (*conv((4, 4, 6, 16), (4, 4, 3, 3), pads=[1, 1, 1, 1]),
                                           {"forward": "tile", "dx": "tile", "dw": "tile"}),
    "conv3x3_weight_grad_batch_shared": (*conv((4, 4, 20, 20), (8, 4, 3, 3), pads=[1, 1, 1, 1]),
                                         {"forward": "tile", "dx": "tile", "dw": "shared"}),
    "conv3x3_weight_grad_tile_strided": (*conv((1, 3, 34, 36), (8, 3, 3, 3), strides=[2, 2], pads=[1, 0, 1, 1]),
                                         {"forward": "tile", "dx": "tile", "dw": "tile"}),
    # reductions longer than SERIAL_REDUCTION: a work-group per tile deals out the dY rows (40 x 36 and
    # a depthwise conv's 48 x 40 maps), or the blocks of K (1100), and sums its partial tiles in __local memory
    "conv3x3_weight_grad_shared": (*conv((1, 4, 40, 36), (8, 4, 3, 3), pads=[1, 1, 1, 1]),
                                   {"forward": "tile", "dx": "tile", "dw": "shared"}),
    "conv_depthwise_weight_grad_shared": (*conv((1, 8, 48, 40), (8, 1, 3, 3), group=8, pads=[1, 1, 1, 1]),
                                          {"forward": "tile", "dx": "tile", "dw": "shared"}),
    "matmul_long_k_shared": ([_node("MatMul", ["a", "b"])], {"a": (8, 1100), "b": (1100, 8)},
                             {"forward": "shared", "grad": "tile"}),
    # a temporal conv's weight gradient (T-ResNet's [N, C, T, 1]), 8 x 160 steps shared by a work-group: on
    # the local CPU its 3 taps x 4 channels sum float4s along T (test_a_cpu_weight_gradient_sums_along...)
    "conv_temporal_weight_grad_shared": (*conv((8, 8, 160, 1), (8, 8, 3, 1), pads=[1, 0, 1, 0]),
                                         {"forward": "tile", "dx": "tile", "dw": "shared"}),
}


MERGED_SETS["image", "fp32"] = (sorted(CASES) + sorted(TEXEL_CASES) + sorted(TILE_CASES) + sorted(SPECTRAL_CASES)
                                + sorted(TRANSPOSE_CASES) + sorted(GROUPED_CASES) + sorted(BROADCAST_CASES))
MERGED_SETS["buffer", "fp32"] = ["conv3x3_weight_grad_channel_blocks", "matmul_tile_merged_rows", "matmul_tile_heads_rows",
                                 "matmul_attention_rows", "conv3x3_weight_grad_small_map", "matmul_tile_one_row_batched",
                                 "matmul_attention_rows_apart", "spectral_dft_stft_padded",
                                 "conv_transpose_trained", "conv_temporal_grouped_items",
                                 *sorted(BROADCAST_CASES)]


def _conv_bn_tile() -> tuple[list[onnx.NodeProto], dict[str, Any]]:
    channels = 8
    nodes = [_node("Conv", ["x", "w"], "c", pads=[1, 1, 1, 1]),
             _node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], "bn"), _node("Relu", ["bn"])]
    rng = np.random.default_rng(5)
    inits = {"x": (2, 3, 9, 10), "w": (channels, 3, 3, 3), "scale": rng.uniform(0.5, 2.0, channels).astype(np.float32),
             "bias": (channels,), "mean": (channels,), "var": rng.uniform(0.5, 2.0, channels).astype(np.float32)}
    return nodes, inits


#: models of the tests below whose kernels are checked one by one (a CPU weight gradient's sums, a float16 row of
#: a MatMul tile, per-channel reads of a tile, epilogues): their local steps (loss, every gradient and update
#: against onnxruntime) run as one merged step, EXTRA (tests/support/merged_steps.py: one PoCL build where they
#: were five; each case's kernels the ones it runs alone, judged on its own rows; values of a seed of its own)
EXTRA_CASES: dict[str, tuple[list[onnx.NodeProto], dict[str, Any]]] = {
    "temporal_weight_grad": conv((8, 6, 160, 1), (8, 6, 3, 1), pads=[1, 0, 1, 0]),
    "matmul_float16_rows": ([_node("MatMul", ["a", "b"])], {"a": (4, 16), "b": (16, 16)}),
    "conv_bn_tile": _conv_bn_tile(),
    "conv_transpose_relu": ([_node("Conv", ["x", "w"], "c", pads=[1, 1, 1, 1]),
                             _node("Transpose", ["c"], "ct", perm=[1, 0, 2, 3]),  # [2, 2, 5, 5] -> [2, 2, 5, 5]
                             _node("Relu", ["ct"])], {"x": (2, 2, 5, 5), "w": (2, 2, 3, 3)}),
    "mm_add_sigmoid": ([_node("MatMul", ["a", "b"], "m"), _node("Add", ["m", "c"], "s"), _node("Sigmoid", ["s"])],
                       {"a": (4, 8), "b": (8, 6), "c": (6,)}),
}
EXTRA = merged_steps.MergedCases(OPTIONS)
for _seed, (_name, (_nodes, _inits)) in enumerate(EXTRA_CASES.items()):
    EXTRA.add(_name, case_model(_nodes, _inits, seed=100 + _seed))
EXTRA_GROUP = pytest.mark.xdist_group("contraction-merged-extra")  # one worker builds EXTRA's step


@pytest.mark.xdist_group("contraction-merged-image")
@pytest.mark.parametrize("name", sorted(TILE_CASES))
def test_tiled_contraction_step(name: str, merged_rows) -> None:
    _assert_merged_case_matches(merged_rows, name)


@pytest.mark.xdist_group("contraction-merged-buffer")
@pytest.mark.parametrize("name", MERGED_SETS["buffer", "fp32"])
def test_tiled_contraction_step_in_buffers(name: str, merged_rows) -> None:
    """Tiles and texel-wide rows that were per lane until issue 39's unseen models (a conv weight gradient's
    blocks of fewer channels, a MatMul's rows across A's batch, attention's rows of 7 scores, an input
    gradient's plane tile, a one-row tile under a batched B'), in buffer storage too (whose row texels read B' with unaligned vload4s)."""
    _assert_merged_case_matches(merged_rows, name, storage="buffer")


def test_a_tiles_rows_of_heads_merged_back_read_a_from_their_own_bases(tmp_path) -> None:
    """A MatMul over heads merged back ([2, 2, 6, 4] -> [2, 6, 8]) under a weight: M = 6 takes no tile of whole
    rows and A's rows over the batch are no one stride apart, yet its 12 rows take 4-row tiles (was one row of
    texels), each row of A from its own base (texel.Operand.rows); its gradient's dY rows are one stride apart:
    one base. (Numbers: test_tiled_contraction_step[matmul_tile_heads_rows] and its buffer case.)"""
    nodes, inits, _ = TILE_CASES["matmul_tile_heads_rows"]
    kernels = _contractions(write_case(str(tmp_path / "heads.onnx"), nodes, inits))
    bases = {_role(k): [v for v in _declared(k) if v.kind == "ar"] for k in kernels}
    assert len(bases["forward"]) == 4 and not bases["grad"], bases


def test_a_weight_gradient_tile_of_a_map_smaller_than_its_taps_is_taken_on_a_gpu_too(tmp_path) -> None:
    """The 2-D weight-gradient tile of a dY map smaller than its taps, in whole blocks of 4 input channels: taken
    on the CPU (local) and for adreno830 alike, though its 32 tiles leave the 830's 1,536 work-items idle: per
    lane it read 1.5 texels per multiply-add (MobileNetV2 [1,3,32,32]'s depthwise weight gradients on 2 x 2 and
    1 x 1 maps), the tile's whole texels of 4 channels' maps fewer than one, and its padding taps are dropped at
    compile time (conv_tiles.conv_tile). Its numbers: test_device_models' MobileNetV2 step for adreno830, whose last
    stage's depthwise weight gradient (dY 4 x 2 under 3 x 3 taps) takes this tile."""
    from fblc.tools.kernel_stats import kernel_figures

    nodes, inits, _ = TILE_CASES["conv3x3_weight_grad_small_map"]
    path = write_case(str(tmp_path / "small_map.onnx"), nodes, inits)
    dw = {target: [k for k in _contractions(path, target) if _role(k) == "dw"] for target in ("local", "adreno830")}
    assert {target: {_path(k) for k in kernels} for target, kernels in dw.items()} == \
        {"local": {"tile"}, "adreno830": {"tile"}}
    figures = [kernel_figures(k.ir, k.global_size, getattr(k, "group_size", None)) for k in dw["adreno830"]]
    assert all(f.fetch_runs < sum(f.fused_runs.values()) for f in figures), [
        (f.fetch_runs, sum(f.fused_runs.values())) for f in figures]


@pytest.mark.parametrize("x, w, written", [((4, 8, 12, 1), (8, 8, 3, 1), True), ((2, 3, 6, 6), (8, 3, 3, 3), False),
                                           ((8, 8, 300, 1), (8, 8, 3, 1), False)])
def test_a_weight_gradient_is_written_in_the_weights_order_and_its_update_joins_it(
        x: tuple[int, ...], w: tuple[int, ...], written: bool, tmp_path) -> None:
    """Golden: a conv weight gradient whose input channels fill whole texels (C_in % 4 == 0) is written in W's
    own order [C_out, C_in, k..] (linalg.conv_weight_grad, keys.WRITTEN_BY_PRODUCER; conv_tiles.swapped_tile: rows of
    output channels, each consecutive input channels' taps), so W's update joins its kernel, and the step equals
    onnxruntime's in buffer storage. Negative: 3 input channels keep the [C_in, C_out, k..] conv that a
    transposed view reorders, and the update, reading it across texels, stays a kernel of its own; so does a
    reduction of 8 x 300 products per output (past WRITTEN_WEIGHT_GRADIENT_REDUCTION: T-ResNet's channel tile is
    faster) and a GPU target (adreno830: not a `cpu` profile), whose channel tile keeps its half arithmetic."""
    nodes, inits = conv(x, w, pads=[1, 0, 1, 0] if x[3] == 1 else [1, 1, 1, 1])
    path = write_case(str(tmp_path / "dw.onnx"), nodes, inits)
    dw = [k for k in _contractions(path) if _role(k) == "dw"]
    assert len(dw) == 1 and (_path(dw[0]) == "tile" or not written), [(k.name, _path(k)) for k in dw]
    assert any(not node.startswith("grad/") for node in dw[0].nodes) == written, dw[0].nodes
    gpu = [k for k in _contractions(path, "adreno830") if _role(k) == "dw"]
    assert len(gpu) == 1 and all(node.startswith("grad/") for node in gpu[0].nodes), gpu[0].nodes
    if written:
        assert_step_matches(path, storage="buffer")


@pytest.mark.parametrize("name", ["conv3x3_weight_grad_shared", "conv_depthwise_weight_grad_shared"])
def test_shared_tiles_under_a_wave_share_a_work_group(name: str, tmp_path) -> None:
    """For adreno830 (64-wide waves) the weight gradient over 32 dY rows takes 32 work-items a tile, one
    per row, half a wave: its work-groups hold two tiles, each merging in its own slice of the group's
    __local pool, and the step still equals onnxruntime's. (TILE_CASES' 40 rows take 64 work-items a
    tile, each one row at most, where their few tiles leave the device idle (Profile.loop_group): one tile
    a group; under oclgrind too, test_oclgrind's "shared tiles". Its forward and input gradient, whose
    few outputs leave the device idle, share their shorter reductions too: Profile.tile_group.)"""
    x, w, attributes = {"conv3x3_weight_grad_shared": ((1, 4, 32, 36), (8, 4, 3, 3), {}),
                        "conv_depthwise_weight_grad_shared": ((1, 8, 32, 40), (8, 1, 3, 3), {"group": 8})}[name]
    nodes, inits = conv(x, w, pads=[1, 1, 1, 1], **attributes)
    path = write_case(str(tmp_path / f"{name}.onnx"), nodes, inits)
    kernels = _contractions(path, "adreno830")
    pooled = [k for k in kernels if any(s.local and s.var.name == "pool" for s in of_type(k, kir.DeclareArray))]
    # the weight gradient's conv, its update in its epilogue (written in W's own order: linalg.conv_weight_grad)
    weight_grads = [k for k in pooled if k.name.endswith("_Conv") and k.nodes[0].startswith("grad/")]
    assert len(weight_grads) == 1, [(k.name, k.nodes) for k in pooled]
    assert any(s.var.kind == "accv" and s.var.dtype == kir.FLOAT4 for s in _accumulator_arrays(weight_grads[0])), \
        "a group kernel's partial tile sums in float4 texels"
    assert weight_grads[0].group_size == 64
    rows = verify_model(path, OPTIONS, target="adreno830")
    assert rows and not [r.name for r in rows if not r.ok]


@EXTRA_GROUP
@pytest.mark.parametrize("target, form", [("local", "sums"), ("adreno830", "texels")])
def test_a_cpu_weight_gradient_sums_along_its_reduction(target: str, form: str, tmp_path, merged_folder) -> None:
    """A shared weight gradient whose 3 taps mix two channels in a texel keeps a float4 sum per output
    along T where the target's float4 is one SIMD register (local: PoCL on the CPU), texels on a GPU
    (accumulators.choose_form), two batch elements to a tile where the sums hold them; both steps equal
    onnxruntime's. (6 input channels: 8 would write the gradient in W's own order on the CPU, whose tile's
    texels are one output channel's: written_in_the_weights_order.)"""
    path = write_case(str(tmp_path / "temporal.onnx"), *EXTRA_CASES["temporal_weight_grad"])
    arrays = [s for k in _contractions(path, target) for s in _accumulator_arrays(k)]
    # an output's total: the sum of its float4's components (sums), or a component of a texel (texels)
    sums = any(s.var.kind == "acc" and s.init and isinstance(s.init[0], kir.Binary) for s in arrays)
    assert (form == "sums") == sums, form
    assert any(s.var.kind == "accv" and s.var.dtype.lanes in (4, 8) for s in arrays)
    if form == "sums":  # 2 batch elements x 4 channels x 3 taps, sharing each dY texel (conv_schedules._sums_batches)
        assert any(s.var.kind == "acc" and len(s.init) == 24 for s in arrays), [len(s.init) for s in arrays]
    if target == "local":  # its step in EXTRA's merged step (its kernels the ones it runs alone)
        EXTRA.check("temporal_weight_grad", merged_folder)
        return
    rows = verify_model(path, OPTIONS, target=target)
    assert rows and not [r.name for r in rows if not r.ok]


@pytest.mark.parametrize("target", ["local", "adreno830"])
def test_a_wide_simd_cpu_pairs_a_tiles_float4s_into_float8s(target: str, tmp_path) -> None:
    """Where a SIMD register holds 8 floats (local: PoCL on an x86-64 CPU), a conv tile's neighbouring
    texels, which share each scalar weight, are one float8 multiply-add (accumulators.pair_stride); a
    GPU keeps float4s. On both, only the texels that masked taps alone read are clamped. Both steps
    equal onnxruntime's."""
    nodes, inits, _ = TILE_CASES["conv3x3_weight_grad_tile"]
    path = write_case(str(tmp_path / "conv.onnx"), nodes, inits)
    kernels = _contractions(path, target)
    # accv[k] += (float8)(...) * w: a float8 multiply-add of two texels' x
    paired = [s for k in kernels for s in of_type(k, kir.Assign) if s.op == "+=" and isinstance(s.value, kir.Binary)
              and isinstance(s.value.a, kir.Vector) and s.value.a.dtype == kir.FLOAT8]
    assert bool(paired) == (target == "local"), target
    # the padded conv's edge taps may read outside the input: their texels are clamped into it, while a
    # texel an unmasked tap reads lies inside wherever the kernel runs and is read as is (fetch's `inside`;
    # oclgrind's "convnet in buffers" checks every such read stays within its buffer)
    def from_q(texel: kir.Expr) -> bool:  # a texel of fetch's texel-aligned base q (plus a literal)
        base = texel.a if isinstance(texel, kir.Binary) else texel
        return isinstance(base, kir.Var) and base.kind == "q"

    def clamped(load: kir.Load) -> bool:
        return isinstance(load.texel, kir.Call) and load.texel.function == "clamp" and from_q(load.texel.args[0])

    mixed = [k for k in kernels if k.name.endswith("_Conv") and any(map(clamped, loads_of(k, "in0")))
             and any(from_q(load.texel) for load in loads_of(k, "in0"))]
    assert mixed, "no conv kernel reads both clamped edge texels and unclamped inner ones"
    if target == "local":  # the same model's local step: test_tiled_contraction_step[conv3x3_weight_grad_tile]
        return
    rows = verify_model(path, OPTIONS, target=target)
    assert rows and not [r.name for r in rows if not r.ok]


@EXTRA_GROUP
@pytest.mark.parametrize("target", ["local", "adreno830"])
def test_a_16_float_simd_cpu_takes_a_gemm_tiles_row_as_one_float16(target: str, tmp_path, merged_folder) -> None:
    """Where a SIMD register holds 16 floats (local: AVX-512), a MatMul tile is 8 rows x 4 texels and each row
    one float16 accumulator (a multiply-add per A element and K step); a GPU keeps tiles of 2 texels. The step
    equals onnxruntime's. (The input gradient reads B along K: its 4 x 4 texel tile's 64 float4 sums along K
    (the sums form) group four to a float16 too, 16 registers as PAIRED_SUM_FLOAT4S's 40 float8 halves are
    20 (accumulators.sum_float4s); a float16 gathered from lanes of several texels is refused, which
    test_accumulators' unit test checks.)"""
    path = write_case(str(tmp_path / "matmul.onnx"), *EXTRA_CASES["matmul_float16_rows"])
    kernels = _contractions(path, target)
    widths = {k.name: {s.var.dtype.lanes for s in _accumulator_arrays(k) if s.var.kind == "accv"} for k in kernels}
    assert any(16 in lanes for lanes in widths.values()) == (target == "local"), widths
    sums = [k.name for k in kernels for s in _accumulator_arrays(k) if s.var.dtype.lanes == 16 and s.length == 16]
    assert bool(sums) == (target == "local"), widths  # 64 float4 sums in 16 float16s
    if target == "local":
        EXTRA.check("matmul_float16_rows", merged_folder)


@pytest.mark.parametrize("name", sorted(TEXEL_CASES) + sorted(TILE_CASES))
def test_contraction_paths(name: str, tmp_path) -> None:
    """Each contraction kernel of the step takes the texel-wide path its output layout allows:
    the conventional per-texel kernels under --layout naive, output tiles under rtile."""
    nodes, inits, expected = TEXEL_CASES[name] if name in TEXEL_CASES else TILE_CASES[name]
    path = write_case(str(tmp_path / f"{name}.onnx"), nodes, inits)
    layout = "naive" if name in TEXEL_CASES else "rtile"
    found: dict[str, set[str]] = {}
    for kernel in _contractions(path, options=dataclasses.replace(OPTIONS, layout=layout)):
        found.setdefault(_role(kernel), set()).add(_path(kernel))
    assert found == {role: set(paths.split()) for role, paths in expected.items()}


def _conv_kernels(tmp_path, name: str, x: tuple[int, ...], w: tuple[int, ...], **attrs: Any) -> dict[str, Any]:
    """The forward Conv kernel and the input gradient's ConvTranspose kernel of a conv's step, by role."""
    path = write_case(str(tmp_path / f"{name}.onnx"), *conv(x, w, **attrs))
    return {_role(k): k for k in _contractions(path) if _role(k) in ("forward", "dx")}


def _accumulates(kernel: Any, lanes: int) -> bool:
    """Whether the kernel's work-item sums `lanes` outputs: an array of that many float totals."""
    return any(s.var.kind == "acc" and s.var.dtype == kir.FLOAT and s.length == lanes
               for s in _accumulator_arrays(kernel))


def test_depthwise_tile_rows_share_input_rows(tmp_path) -> None:
    """A depthwise 3x3 conv over 8x8 maps: a work-item computes 4 output rows of 8 (32 accumulators, 8
    texels) and reads each of the 6 input rows they see once, 2 texels each: 12 reads of x where 4 rows
    apart would read 3 rows each, 24; its input gradient (a ConvTranspose) takes the same tile. Where
    no row count divides the height (5), or the kernel does not overlap along it (1 tap), a work-item
    takes the same positions of 4 consecutive channels from a multiple of 4 instead (32 accumulators too):
    their 4 x 3 x 3 (4 x 1 x 3) weights are 9 (3) whole texels, which a tile of one channel would read as
    windows over 2 texels per tap row."""
    kernels = _conv_kernels(tmp_path, "rows", (1, 4, 8, 8), (4, 1, 3, 3), group=4, pads=[1, 1, 1, 1])
    x_reads = [load.argument.name for load in of_type(kernels["forward"], kir.Load)]
    assert x_reads.count(x_reads[0]) == 12
    assert all(_accumulates(kernel, 32) for kernel in kernels.values())
    for name, x, w, pads, w_texels in [("odd_height", (1, 4, 5, 8), (4, 1, 3, 3), [1, 1, 1, 1], 9),
                                       ("one_tap", (1, 4, 8, 8), (4, 1, 1, 3), [0, 1, 0, 1], 3)]:
        kernels = _conv_kernels(tmp_path, name, x, w, group=4, pads=pads)
        assert all(_accumulates(kernel, 32) for kernel in kernels.values()), name
        for kernel in kernels.values():
            reads = [load.argument.name for load in of_type(kernel, kir.Load)]
            assert reads.count("in1") == w_texels, (name, kernel.name, reads)


def _compiled(path: str, out_dir: str) -> tuple[Any, dict[str, Any], int]:
    """The fused step graph, the compile report, and how many nodes run in kernels (views and constants do not)."""
    step, report = compile_model(path, out_dir, "local", "fp32", OPTIONS)
    computing = [n for n in step.graph if n.metadata_props.get(KERNEL) not in (None, ALIAS) and n.op_type != "Constant"]
    return step, report, len(computing)


def _forward_kernels(step: Any, op_types: tuple[str, ...]) -> set[str]:
    return {n.metadata_props[KERNEL] for n in step.graph
            if n.op_type in op_types and n.metadata_props.get("fblc.stage") is None}


def test_conv_bn_relu_epilogue_fuses(tmp_path) -> None:
    """Two Conv+BN+Relu sites of one map shape: each site's forward is one kernel; the four BatchNorm sums (each
    site's dgamma and dbeta) are one reduction kernel (fuse: siblings, then SAME_SHAPE_REDUCTIONS), dgamma's
    dy * x_hat computed in it as it reads (fuse.reduction_prologue: no texture holds the product)."""
    channels = 4
    nodes = [_node("Conv", ["x", "w"], "c", pads=[1, 1, 1, 1]),
             _node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], "bn"),
             _node("Relu", ["bn"], "r"), _node("Conv", ["r", "w2"], "c2", pads=[1, 1, 1, 1]),
             _node("BatchNormalization", ["c2", "scale2", "bias2", "mean2", "var2"], "bn2"), _node("Relu", ["bn2"])]
    rng = np.random.default_rng(3)
    inits = {"x": (2, 3, 5, 5), "w": (channels, 3, 3, 3), "scale": (channels,), "bias": (channels,),
             "mean": (channels,), "var": rng.uniform(0.5, 2.0, channels).astype(np.float32),
             "w2": (channels, channels, 3, 3), "scale2": (channels,), "bias2": (channels,), "mean2": (channels,),
             "var2": rng.uniform(0.5, 2.0, channels).astype(np.float32)}
    path = write_case(str(tmp_path / "conv_bn_relu.onnx"), nodes, inits)
    assert_step_matches(path)
    step, report, computing = _compiled(path, str(tmp_path / "bundle"))
    assert report["kernels"] < computing
    assert len(_forward_kernels(step, ("Conv", "BatchNormalization", "Relu"))) == 2, "Conv+BN+Relu: one kernel"
    assert report["kernels_per_family"]["conv"] == 6  # per site forward, dX (ConvTranspose), dW (grouped Conv)
    # BatchNorm's dgamma and dbeta: sums over N, H, W in one reduction kernel, their updates its epilogue
    made = {v.name: n.metadata_props.get(KERNEL) for n in step.graph for v in n.outputs}
    assert len({made[f"{p}.{s}"] for p in ("scale", "bias", "scale2", "bias2") for s in ("grad", "new")}) == 1, made
    reductions = {n.metadata_props[KERNEL] for n in step.graph if n.op_type.startswith("Reduce")}
    assert report["kernels_per_family"]["reduction"] == len(reductions) == 2, reductions  # and the loss's sum
    sums = [n for n in step.graph if n.op_type == "ReduceSum" and n.metadata_props[KERNEL] == made["scale.grad"]]
    products = [n.inputs[0].producer() for n in sums if n.inputs[0].producer().op_type == "Mul"]
    assert len(sums) == 4 and len(products) == 2, [n.name for n in sums]  # dgamma's dy * x_hat, each site's
    assert all(p.metadata_props[KERNEL] == made["scale.grad"] for p in products), products
    with open(tmp_path / "bundle" / "plan.json") as handle:
        stored = {name for texture in json.load(handle)["textures"] for name in texture["values"]}
    assert not stored & {p.outputs[0].name for p in products}, "the product is computed where it is read"
    # the four sums fold in one loop (reduce.fuse_sums): each site's dy, in sum(dy) and sum(dy * x_hat), read once
    source = (tmp_path / "bundle" / "kernels.cl").read_text()
    sums_kernel = next(body for body in source.split("__kernel ")[1:]
                       if body.split("(", 1)[0].endswith("_ReduceSum") and body.count("write_imagef") >= 4)
    reads = re.findall(r"read_imagef\((in\d+)", sums_kernel)
    assert len(reads) == len(set(reads)) == 8, reads  # two sites' dy and x_hat, four inputs of the updates
    # rows of 5: a texel's lanes see one or two channels, whose 1 / sqrt(var + eps) is taken once each before
    # the lane loop (ValueReads.load_channel's `apply`), not once per lane
    forward = next(body for body in (tmp_path / "bundle" / "kernels.cl").read_text().split("__kernel ") if "rsqrt" in body)
    before, _, lane_loop = forward.partition("for (int lane = 0;")
    assert before.count("rsqrt(") == 2 and "rsqrt(" not in lane_loop, forward


@EXTRA_GROUP
def test_a_tiles_per_channel_values_are_read_once_per_run_of_its_texels(tmp_path, merged_folder) -> None:
    """A tile of texels over a plane of 90 (9 x 10: no width align_widths widens), where some texels straddle two
    channels: BatchNorm's per-channel values are read once per run, before its lanes (its first element's and,
    only where the run straddles, its last one's), never per lane."""
    path = write_case(str(tmp_path / "conv_bn_tile.onnx"), *EXTRA_CASES["conv_bn_tile"])
    EXTRA.check("conv_bn_tile", merged_folder)
    _compiled(path, str(tmp_path / "bundle"))
    forward = next(body for body in (tmp_path / "bundle" / "kernels.cl").read_text().split("__kernel ") if "rsqrt" in body)
    reads, _, lanes = forward.partition("for (int lane = 0;")
    # the run's first element's 1 / sqrt(var + eps) and, read only where the run straddles, its last one's
    assert reads.count("rsqrt(") == 2 and "rsqrt(" not in lanes, forward


@EXTRA_GROUP
def test_no_epilogue_through_a_reordering_view(tmp_path, merged_folder) -> None:
    """A consumer that reads the conv's output through a transposed view of the same shape (a
    weight gradient's layout change before the optimizer) is no epilogue: element i of the view is
    not element i of the conv, so it runs in a kernel of its own, and the step still matches."""
    path = write_case(str(tmp_path / "conv_transpose_relu.onnx"), *EXTRA_CASES["conv_transpose_relu"])
    EXTRA.check("conv_transpose_relu", merged_folder)
    step, _, _ = _compiled(path, str(tmp_path / "bundle"))
    assert len(_forward_kernels(step, ("Conv", "Relu"))) == 2, "Relu reads c transposed: its own kernel"


@EXTRA_GROUP
def test_matmul_add_sigmoid_epilogue(tmp_path, merged_folder) -> None:
    path = write_case(str(tmp_path / "mm_add_sigmoid.onnx"), *EXTRA_CASES["mm_add_sigmoid"])
    EXTRA.check("mm_add_sigmoid", merged_folder)
    step, report, computing = _compiled(path, str(tmp_path / "bundle"))
    assert report["kernels"] < computing
    assert len(_forward_kernels(step, ("MatMul", "Add", "Sigmoid"))) == 1, "MatMul+Add+Sigmoid: one kernel"
    assert report["kernels_per_family"]["matmul"] == 3  # forward, dA, dB


def _half_images() -> bool:
    import pyopencl as cl

    try:
        context = cl.create_some_context(interactive=False)
    except cl.Error:  # pragma: no cover - no OpenCL device
        return False
    formats = cl.get_supported_image_formats(context, cl.mem_flags.READ_WRITE, cl.mem_object_type.IMAGE2D)
    return any(f.channel_order == cl.channel_order.RGBA and f.channel_data_type == cl.channel_type.HALF_FLOAT
               for f in formats)


# conv2d_bias_1x1: its input gradient a Conv over a packed transposed W (pointwise_transposes), kept fp32
# unmerged: an fp16 step's finite check (dynamic loss scaling) reads every gradient in one kernel, across cases
@pytest.mark.parametrize("name", ["matmul_3d_broadcast", "conv2d_strided_asym_pads", "conv_depthwise_rows_dilated",
                                  "conv2d_bias_1x1", "matmul_attention_rows"])
def test_contraction_step_fp16(name: str, tmp_path) -> None:
    """Half textures, fp32 accumulation: within the fp16 tolerance of verify."""
    if not _half_images():
        pytest.skip("this OpenCL device has no RGBA half-float images")
    nodes, inits = CASES[name] if name in CASES else (TILE_CASES | TEXEL_CASES)[name][:2]
    assert_step_matches(write_case(str(tmp_path / f"{name}.onnx"), nodes, inits), dtype="fp16")


def test_a_texels_lane_loop_is_unrolled_unless_the_tensor_ends_inside_it(tmp_path) -> None:
    """A texel's lane loop runs 4 times: unrolled (#pragma unroll) it indexes its accumulators and
    results by constants, which the compiler keeps in registers (on PoCL the MLP's AdamW-fused weight
    gradients ran 1.4x faster). A tensor whose element count is no multiple of 4 ends inside its last
    texel: that loop keeps its break and is not unrolled (LLVM warns it cannot unroll an early exit).
    A MatMul's whole texels need no loop: their lanes are one float4 (tests/test_texel_wide.py)."""
    cases = {"even": ([_node("Conv", ["x", "w"], pads=[1, 1, 1, 1])], {"x": (1, 2, 4, 4), "w": (4, 2, 3, 3)}, 64),
             "tail": ([_node("MatMul", ["a", "b"])], {"a": (3, 5), "b": (5, 3)}, 9),
             "float4": ([_node("MatMul", ["a", "b"])], {"a": (8, 20), "b": (20, 8)}, 64)}
    for name, (nodes, inits, numel) in cases.items():
        path = write_case(str(tmp_path / f"{name}.onnx"), nodes, inits)
        forward = next(k for k in _contractions(path) if _role(k) == "forward")
        loop = [s for s in of_type(forward, kir.For) if s.var.name == "lane"]
        if name == "float4":
            assert not loop, name
        else:
            assert len(loop) == 1 and (loop[0].stop, loop[0].step) == (kir.const(4), 1), loop
            assert loop[0].unroll == (name == "even"), name
            past = kir.If(kir.Var("i", 0, kir.INT, "i").ge(numel), [kir.Break()])
            assert (past in loop[0].body) == (name == "tail"), name
        rows = verify_model(path, OPTIONS)
        assert rows and not [r.name for r in rows if not r.ok], name


def test_a_depthwise_row_paths_weights_are_one_run_read_once(tmp_path) -> None:
    """A depthwise 3x3 conv over 5 x 7 planes (no multiple of 4: no tile of consecutive channels lines up
    with texels; rows of 7 take the row path): its forward and stride-1 input gradient enumerate the row
    taps instead of looping over them, in the texel-wide path and in the lanes of texels that cross a row,
    so a channel's 9 weights are one run read once as the 3 texels that cover it (the middle one whole),
    not 2 texels at every trip of a loop over the tap rows, for a GPU (a CPU keeps its loops); the step equals
    onnxruntime's."""
    nodes, inits = conv((2, 4, 5, 7), (4, 1, 3, 3), group=4, pads=[1, 1, 1, 1], bias=True)
    path = write_case(str(tmp_path / "dw_rows.onnx"), nodes, inits)
    kernels = {_role(k): k for k in _contractions(path, "adreno830") if _role(k) in ("forward", "dx")}
    assert set(kernels) == {"forward", "dx"}
    for kernel in kernels.values():
        assert _path(kernel) == "row", kernel.name
        taps = [s for s in of_type(kernel, kir.For) if s.var.kind == "k"]
        assert not taps, (kernel.name, "a loop over the taps")
        reads = [load.argument.name for load in of_type(kernel, kir.Load)]
        assert reads.count("in1") == 6, (kernel.name, reads)  # 3 texels in each of the two paths
    local = [k for k in _contractions(path) if _role(k) == "forward"]
    assert [s for s in of_type(local[0], kir.For) if s.var.kind == "k"], "a CPU's taps stay a loop"
    rows = verify_model(path, OPTIONS, target="adreno830")
    assert rows and all(r.ok for r in rows), [(r.name, r.max_abs) for r in rows if not r.ok]


def test_a_tile_of_consecutive_channels_reads_its_per_channel_values_as_whole_texels(tmp_path) -> None:
    """A depthwise tile of 8 consecutive channels from a multiple of 8 (planes of 5 x 8: whole texels): its bias,
    one element per channel, is 2 whole texels read once in the work-item's prologue, each texel's value a lane
    of one of them, not one texel per tile row for one lane (test_tiled_contraction_step runs the case)."""
    nodes, inits, _ = TILE_CASES["conv_depthwise_channel_rows"]
    path = write_case(str(tmp_path / "dw_bias.onnx"), nodes, inits)
    forward = next(k for k in _contractions(path) if _role(k) == "forward")
    assert _path(forward) == "tile"
    texels = next(s for s in of_type(forward, kir.For) if s.var.name == "tt")
    bias = [load for load in of_type(forward, kir.Load) if load.argument.name == "in2"]
    assert len(bias) == 2, bias
    inside = [e for s in kir.walk(texels.body) for expr in kir.statement_exprs(s) for e in kir.walk_expr(expr)
              if isinstance(e, kir.Load) and e.argument.name == "in2"]
    assert not inside, inside


def test_a_row_crossing_texels_lanes_reduce_in_a_loop_before_the_unrolled_lane_loop(tmp_path) -> None:
    """Rows of 11: most texels reduce texel-wide; a texel that crosses a row's end reduces its lanes one by
    one in a loop of their own before the lane loop (reduce_guarded), so the unrolled lane loop holds
    one select and no copies of the per-lane loops; the step equals onnxruntime's."""
    nodes, inits, _ = TEXEL_CASES["conv2d_row_dilated"]
    path = write_case(str(tmp_path / "rows.onnx"), nodes, inits)
    assert_step_matches(path)
    guarded = [k for k in _contractions(path) if _path(k) == "row"]
    assert guarded
    for kernel in guarded:
        *fallbacks, lane_loop = [s for s in of_type(kernel, kir.For) if s.var.name == "lane"]
        assert lane_loop.unroll and len(fallbacks) == 1
        leftover = [s.var for s in of_type(kernel, kir.DeclareArray) if s.var.kind == "fb" and s.length == 4]
        assert leftover and any(isinstance(s, kir.Assign) and isinstance(s.target, kir.Element)
                                and s.target.array == leftover[0] for s in kir.walk(fallbacks[0].body))
        inner = list(kir.walk(lane_loop.body))
        per_lane = [s for s in inner if isinstance(s, kir.For) and not s.var.name]
        assert not per_lane, "a per-lane loop left in the lane loop"
        assert any(isinstance(s, kir.Declare) and isinstance(s.init, kir.Select) and s.init.condition.kind == "whole"
                   and isinstance(s.init.if_false, kir.Element) and s.init.if_false.array == leftover[0]
                   for s in inner)


def test_a_strided_transposes_per_lane_taps_step_by_the_stride(tmp_path) -> None:
    """Rows of 15 under a stride-2 conv: the input gradient goes per lane, its tap loops starting at the
    tap whose numerator the stride divides and stepping by 2 (1 or 2 of 3 taps, no parity test)."""
    nodes, inits, _ = TEXEL_CASES["conv2d_row_strided_odd"]
    path = write_case(str(tmp_path / "strided.onnx"), nodes, inits)
    transpose = next(k for k in _contractions(path) if k.name.endswith("ConvTranspose"))
    stepped = [s for s in of_type(transpose, kir.For) if s.step == 2 and s.stop == kir.const(3)
               and isinstance(s.start, kir.Binary) and s.start.op == "&" and s.start.b == kir.const(1)]
    assert len(stepped) == 2, stepped
    parity = [e for e in of_type(transpose, kir.Binary) if e.op == "==" and isinstance(e.a, kir.Binary)
              and e.a.op == "&" and e.a.b == kir.const(1)]
    assert not parity


@pytest.mark.parametrize("storage", ["image", "buffer"])
def test_a_packed_weights_transpose_takes_4x4_blocks_where_they_fill_the_device(storage: str, tmp_path) -> None:
    """pointwise_transposes' per-step copy W^T moves the lanes' axis: for adreno830 a work-item takes a 4 x 4
    block, 4 whole texels of W for 4 texels of W^T, where its items fill the device (W^T of 128 x 192: 1536
    blocks, adreno830's 1536 work-items), and one texel (4 reads of one lane each) where they would not (W^T of
    8 x 16); both steps equal onnxruntime's, in image and in buffer storage (the blocks: on the CPU target
    too, test_contraction_step's conv_pointwise_rows_odd_plane; fp16: conv2d_bias_1x1's)."""
    for x, w, per_item in [((1, 128, 3, 5), (192, 128, 1, 1), 4), ((2, 8, 3, 5), (16, 8, 1, 1), 1)]:
        path = write_case(str(tmp_path / f"packed{w[0]}.onnx"), *conv(x, w))
        copy = next(k for k in lowered_kernels(path, "adreno830", options=OPTIONS) if k.name.endswith("_Transpose"))
        lane_loop = next(s for s in of_type(copy, kir.For) if s.var.name == "lane")
        in_lane_loop = [e for s in kir.walk(lane_loop.body) for e in kir.statement_exprs(s)
                        for e in kir.walk_expr(e) if isinstance(e, kir.Load)]
        assert (copy.global_size, len(of_type(copy, kir.Load)), len(in_lane_loop)) == (
            (w[0] * w[1] // 4 // per_item, 4, 0) if per_item == 4 else (w[0] * w[1] // 4, 1, 1))
        rows = verify_model(path, OPTIONS, target="adreno830", storage=storage)
        assert rows and not [r.name for r in rows if not r.ok]


@pytest.mark.parametrize("target", ["local", "adreno830", "mali-g925"])
def test_a_tiles_channel_pairs_read_one_texel_of_w(target: str, tmp_path) -> None:
    """The input gradient of conv_pointwise_transpose_pairs (a ConvTranspose of W [8, 8, 1, 1]) takes 2 rows of
    consecutive channels: the first is even, so at each of a block's 4 input channels their 2 weights lie in
    one texel of W at a runtime shift of 0 or 2 (texel.fetch): 4 reads of W a block, not 8 (its numbers:
    test_tiled_contraction_step). The local CPU at a GPU's 64 accumulator floats: its own 128 take 8 rows."""
    nodes, inits, _ = TILE_CASES["conv_pointwise_transpose_pairs"]
    path = write_case(str(tmp_path / "pairs.onnx"), nodes, inits)
    profile = profile_with(str(tmp_path), "local", private_floats=64) if target == "local" else target
    transpose = next(k for k in _contractions(path, profile) if k.name.endswith("ConvTranspose"))
    assert len(loads_of(transpose, "in1")) == 4
    assert not [e for e in of_type(transpose, kir.Call) if e.function in ("WINDOW", "window4")]


def test_a_saved_mask_is_read_once_per_texel(tmp_path) -> None:
    """The MLP's ReLU gradients read their saved r_mask8 masks in the output's own order: one byte per
    output texel before the lane loop (its nibble's bits per lane), none in the lane loop (numbers:
    test_buffer_storage's and test_oclgrind's steps of the MLP and the conv net, which read them so)."""
    from tests.support import models

    exported = models.mlp(str(tmp_path))
    options = dataclasses.replace(OPTIONS, input_shapes=exported.input_shapes, loss="cross_entropy")
    readers = [k for k in lowered_kernels(exported.path, "adreno830", options=options)
               if any(a.kind == "uint" and a.role == "in" for a in k.ir.arguments)]
    assert readers
    for kernel in readers:
        lane_loops = [s for s in of_type(kernel, kir.For) if s.var.name == "lane"]
        in_lane_loops = [e for loop in lane_loops for s in kir.walk(loop.body) for top in kir.statement_exprs(s)
                         for e in kir.walk_expr(top) if isinstance(e, kir.Load) and e.argument.kind == "uint"]
        assert not in_lane_loops, kernel.name


def test_a_pointwise_input_gradient_reads_its_weights_as_whole_texels(tmp_path) -> None:
    """A 1x1 conv's input gradient dX [8, 160, 4, 2] (2,560 texels) reads W [128, 160] along its output
    channels, whose weights lie side by side: its work-item takes rows of consecutive output channels by 4
    (a multiple of 4 apart from channel 0), so every weight read is a whole texel at literal lanes, on a GPU
    too, where one row a work-item would fill the adreno830 (1,536 work-items) alone: there the rows'
    reduction (128) is shared by a work-group instead. Every fetch uses its 4 lanes. (Such kernels' numbers:
    test_device_models' MobileNetV2 for adreno830, whose pointwise input gradients take these tiles.)"""
    from fblc.tools.kernel_stats import kernel_figures

    path = write_case(str(tmp_path / "pointwise_dx.onnx"), *conv((8, 160, 4, 2), (128, 160, 1, 1)))
    for target in ("adreno830", "local"):
        dx = next(k for k in _contractions(path, target) if _role(k) == "dx")
        assert kernel_figures(dx.ir, dx.global_size, dx.group_size).whole_share(True) == 1.0, target
        staged = any(isinstance(s, kir.Stage) for s in kir.walk(dx.ir.body))  # staging's groups share no tile
        assert (dx.group_size is not None and not staged) == (target == "adreno830"), target  # the CPU's tiles whole
