"""sort_topk: a TopK over a long line becomes a stable merge sort (MergeRuns) and a slice of its first k.

- golden: the op types after (the axis moved last and back, the values negated for largest), the
  outputs' names and the stage kept; a short line, or a k the kernel's selection does cheaply, is
  left alone (sort_pays);
- numeric: device-only (onnxruntime has no MergeRuns): the resample merged step's TopK cases of 80
  and 70 elements a line (tests/test_kernels_resample.py) run through this pass on PoCL.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler import keys
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes
from fblc.passes.sort_topk import PICK_READS, SortTopK, launches, sort_pays, sort_reads


def _model(shape: list[int], k: int, axis: int, largest: int) -> onnx.ModelProto:
    out = list(shape)
    out[axis] = k
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([k], np.int64))),
             helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest, name="topk")]
    graph = helper.make_graph(nodes, "topk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("v", TensorProto.FLOAT, out),
                               helper.make_tensor_value_info("i", TensorProto.INT64, out)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _sort(model: onnx.ModelProto) -> tuple[ir.Model, bool]:
    imported = run_passes(ir.from_proto(model), import_passes(TrainingOptions()))
    result = SortTopK()(imported)
    return result.model, result.modified


@pytest.mark.parametrize("axis,largest", [(0, 1), (1, 0)])
def test_golden_sort(axis: int, largest: int) -> None:
    model = _model([100, 100], 30, axis, largest)
    for node in model.graph.node:
        node.metadata_props.add(key=keys.STAGE, value="forward")
    graph, modified = _sort(model)
    assert modified
    ops = [n.op_type for n in graph.graph if n.op_type not in ("Constant", "Reshape", "Expand")]
    moved, negated = ["Transpose"] if axis == 0 else [], ["Neg"] if largest else []
    # 100 elements padded to 128: runs of 1 .. 32, then each run's first 30 (a Slice of the values' and the
    # positions') before merging runs of 30 (a line of 120, then of 60)
    heads = ["MergeRuns", "Slice", "Slice"]
    expected = moved + negated + ["Concat"] + ["MergeRuns"] * 4 + heads * 2 + ["MergeRuns"]
    assert ops == expected + ["Slice"] + negated + moved + ["Slice"] + moved, ops
    assert all(n.metadata_props.get(keys.STAGE) == "forward" for n in graph.graph)
    assert {"v", "i"} <= {v.name for n in graph.graph for v in n.outputs}


def test_sort_pays_only_past_the_line_and_for_a_large_k() -> None:
    assert not sort_pays(64, 64)  # a line the kernel always ranks
    # 1000 keeping 6: the selection's 21,000 reads against the sort's 26,040 (a line of 1,024, runs of 1..4, then
    # 768, 384, ..); keeping 7: 28,000 against 27,648
    assert not sort_pays(1000, 6) and sort_pays(1000, 7)
    assert not sort_pays(65, 8) and sort_pays(80, 20)  # 65 pads to 128; 80 keeping 20: 16,800 against 4,148
    graph, modified = _sort(_model([3, 1000], 5, 1, 1))
    assert not modified and "TopK" in [n.op_type for n in graph.graph]


def test_sort_reads_are_linear_per_doubling() -> None:
    """A work-item's later outputs resume its merge: a full sort of 2^16 reads at most PICK_READS + 2 an output
    per launch (one search step or less an output), where a search per output reads 2 log2(2 run) more."""
    n = 1 << 16
    assert launches(n, n) == [(n, 1 << r) for r in range(16)]
    assert sort_reads(n, n) <= 16 * n * (PICK_READS + 2)
    assert sort_reads(n, n, resumed=False) == sum(n * PICK_READS + n * 2 * (r + 2) for r in range(16))
