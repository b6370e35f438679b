"""One training step of each named case on whatever OpenCL device this process sees, against onnxruntime.

    oclgrind --data-races python -m tests.support.oclgrind_steps DIR CASE..

tests/test_oclgrind.py runs it under oclgrind, whose simulated device checks every memory access
and race, and reads its last line: JSON {case: [names of the tensors that differ from onnxruntime]}.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import numpy as np

from fblc.compiler.adapters import MEMORY_FLOOR_ADAPTERS, AdapterConfig
from fblc.compiler.es import EsConfig
from fblc.compiler.gradients import segment_sum
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from fblc.tools.verify import verify_model
from tests.support import models

Case = Callable[[str], tuple[str, dict[str, np.ndarray], TrainingOptions]]


ADAMW = OptimizerConfig("adamw", lr=1e-3)


def _exported(build: Callable[[str], models.ExportedModel], **options: Any) -> Case:
    def case(directory: str) -> tuple[str, dict[str, np.ndarray], TrainingOptions]:
        exported = build(directory)
        return (exported.path, {**exported.inputs, "labels": exported.labels},
                TrainingOptions(input_shapes=exported.input_shapes, **{"optimizer": ADAMW, **options}))
    return case


def _zoo(name: str) -> Case:
    def build(directory: str) -> models.ExportedModel:
        from tests.support import zoo

        return zoo.build(zoo.BY_NAME[name], directory)
    return _exported(build)


def _embedding(directory: str) -> tuple[str, dict[str, np.ndarray], TrainingOptions]:
    """Repeated and negative token ids: the sorted row scatter (MergeRuns, ScatterSortedRows)."""
    from tests.test_sort_scatter_rows import OPTIONS, embedding

    segment_sum.ONE_HOT_ELEMENTS = 0
    path = os.path.join(directory, "embedding.onnx")
    embedding(path, 37, 8, (2, 70))
    return path, {"ids": np.random.default_rng(3).integers(-37, 37, (2, 70)).astype(np.int64)}, OPTIONS


def _shared_tiles(directory: str) -> tuple[str, dict[str, np.ndarray], TrainingOptions]:
    """A 3x3 weight gradient over 40 x 36 dY maps, past SERIAL_REDUCTION: a work-group per tile deals
    out the dY rows and sums its partial tiles in __local memory."""
    from tests.test_kernels_contraction import OPTIONS, TILE_CASES, write_case

    path = os.path.join(directory, "shared_tiles.onnx")
    nodes, inits, _ = TILE_CASES["conv3x3_weight_grad_shared"]
    return write_case(path, nodes, inits), {}, OPTIONS


def _shared_sums(directory: str) -> tuple[str, dict[str, np.ndarray], TrainingOptions]:
    """A temporal conv's weight gradient shared by a work-group, compiled for the local CPU target: each
    output sums a float4 along T (accumulators' "sums" form) before the group's merge."""
    from tests.test_kernels_contraction import OPTIONS, TILE_CASES, write_case

    path = os.path.join(directory, "shared_sums.onnx")
    nodes, inits, _ = TILE_CASES["conv_temporal_weight_grad_shared"]
    return write_case(path, nodes, inits), {}, OPTIONS


def _group_reductions(directory: str) -> tuple[str, dict[str, np.ndarray], TrainingOptions]:
    """2 rows of 1100, past SERIAL_REDUCTION: LayerNorm's statistics (whole texels, a private copy of each
    work-item's share: 275 texels over 64 work-items, some shares one shorter), the one-pass LogSumExp (max,
    then rescaled sums) and the gradients' ReduceMeans, each a work-group per output texel (2 of its 4 lanes
    past the last row) merging in its __local tree (oclgrind has no sub-groups)."""
    from onnx import helper

    from tests.test_kernels_contraction import OPTIONS, write_case

    nodes = [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("axes", 7, [1], [1])),
             helper.make_node("ReduceLogSumExp", ["n", "axes"], ["y"], keepdims=1)]
    path = os.path.join(directory, "group_reductions.onnx")
    return write_case(path, nodes, {"x": (2, 1100), "scale": (1100,), "bias": (1100,)}), {}, OPTIONS


def _vit_attention(directory: str) -> tuple[str, dict[str, np.ndarray], TrainingOptions]:
    """A ViT's self-attention as torch's dynamo exporter writes it (2 images of 4 patches and a class token, 2
    heads of 4): Q and the transposed K each scaled by d**-0.25 (K^T materialised, read along its tokens by the
    Q.K^T MatMul: the `(p + 5k) & 3` lane indices that optimised oclgrind 21.10 gets wrong), Softmax, .V."""
    from onnx import helper, numpy_helper

    from tests.test_kernels_contraction import OPTIONS, write_case

    images, tokens, heads, width = 2, 5, 2, 4
    hidden = heads * width
    rng = np.random.default_rng(5)
    weights = {name: (0.25 * rng.standard_normal((hidden, hidden))).astype(np.float32) for name in ("wq", "wk", "wv")}
    constants = {"split_heads": np.array([images, tokens, heads, width], np.int64),
                 "root_scale": np.array(width ** -0.25, np.float32)}
    nodes = [helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))
             for name, value in constants.items()]
    for name, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):  # k as K^T
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}_rows"]),
                  helper.make_node("Reshape", [f"{name}_rows", "split_heads"], [f"{name}_heads"]),
                  helper.make_node("Transpose", [f"{name}_heads"], [name], perm=perm)]
    nodes += [helper.make_node("Mul", ["q", "root_scale"], ["q_scaled"]),
              helper.make_node("Mul", ["k", "root_scale"], ["k_scaled"]),
              helper.make_node("MatMul", ["q_scaled", "k_scaled"], ["scores"]),
              helper.make_node("Softmax", ["scores"], ["weights"], axis=-1),
              helper.make_node("MatMul", ["weights", "v"], ["y"])]
    activations = rng.standard_normal((images, tokens, hidden)).astype(np.float32)
    path = os.path.join(directory, "vit_attention.onnx")
    return write_case(path, nodes, {"x": activations, **weights}), {}, OPTIONS


CASES: dict[str, Case] = {
    "mlp": _exported(models.mlp),  # contractions, log-softmax as a reduction and a map, the fused AdamW
    # norms, rotary views, attention, gathers; one decoder layer, as a second simulates the same kernels
    "llama": _exported(lambda directory: models.llama(directory, layers=1)[0]),
    "embedding": _embedding,
    "shared tiles": _shared_tiles,
    "shared sums": _shared_sums,
    "group reductions": _group_reductions,
    "resnet": _exported(models.resnet_legacy),  # convolutions, BatchNorm, the MaxPool stem, residuals, GAP
    # depthwise, pointwise, grouped and strided convolutions, BatchNorm on batch statistics, both pools
    "convnet": _exported(models.small_convnet, bn_train=True, optimizer=OptimizerConfig("sgd", lr=0.01, momentum=0.9)),
    **{f"convnet {kind}": _exported(models.small_convnet, adapter=AdapterConfig(kind, rank=2))
       for kind in MEMORY_FLOOR_ADAPTERS},  # each memory-floor adapter's forward, backward and replay
    "gpt2": _zoo("gpt2"),  # LayerNormalization, Gelu, tied embeddings, the causal mask from the exporter
    "vit attention": _vit_attention,  # Q.K^T of activations, Softmax, .V: a ViT step's attention
    "mlp fura-s": _exported(models.mlp, adapter=AdapterConfig("fura-s", block=16), trainer="es",
                            es=EsConfig(pairs=2, sigma=0.05, seed=1), optimizer=OptimizerConfig("sgd", lr=1.0)),
}


#: cases that run again in LocalRunner's buffer storage, where oclgrind reports a read past the end of a
#: texture's buffer (it cannot for an image): every conv, pool and mask path, the gathers and row scatters
IN_BUFFERS = {f"{name} in buffers": name for name in ("convnet", "embedding", "shared sums", "group reductions")}
CASES.update({case: CASES[name] for case, name in IN_BUFFERS.items()})
#: cases compiled for the local target (a CPU's profile) rather than adreno830
LOCAL_TARGET = {"shared sums", "shared sums in buffers"}


def main(directory: str, names: list[str]) -> int:
    differing = {}
    for name in names:
        path, feeds, options = CASES[name](directory)
        rows = verify_model(path, options, target="local" if name in LOCAL_TARGET else "adreno830", feeds=feeds,
                            storage="buffer" if name in IN_BUFFERS else "image")
        differing[name] = [row.name for row in rows if not row.ok] if rows else ["(nothing compared)"]
    print(json.dumps(differing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
