"""split_resize: a Resize with tap tables past the kernel's limit becomes a gather, a multiply and a
ReduceSum an axis.

- golden: the op types after, the Resize's output name, node name and stage kept; a Resize within
  the limit, and an integer nearest upsampling of any length (no table), are left alone;
- numeric: the split graph in onnxruntime equals the original Resize (nearest, linear, cubic,
  antialiased), the limit lowered so the shapes stay tiny; the kernels are the resample merged
  step's case of 8195 outputs (tests/test_kernels_resample.py), a step on PoCL through this pass.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler import keys
from fblc.compiler.reference import onnxruntime_session
from fblc.passes import split_resize
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes
from fblc.passes.split_resize import SplitResize

TOLERANCE = 1e-6  # the same float32 taps on both sides; only the order of the sums differs


def _model(x_shape: list[int], y_shape: list[int], **attributes: object) -> onnx.ModelProto:
    sizes = helper.make_node("Constant", [], ["sizes"], value=numpy_helper.from_array(np.array(y_shape, np.int64)))
    nodes = [sizes, helper.make_node("Resize", ["x", "", "", "sizes"], ["r"], name="up", **attributes),
             helper.make_node("Neg", ["r"], ["y"], name="neg")]
    graph = helper.make_graph(nodes, "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)


def _split(model: onnx.ModelProto) -> tuple[ir.Model, bool]:
    imported = run_passes(ir.from_proto(model), import_passes(TrainingOptions()))
    result = SplitResize()(imported)
    return result.model, result.modified


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return onnxruntime_session(model).run(["y"], {"x": x})[0]


def test_golden_split(monkeypatch) -> None:
    monkeypatch.setattr(split_resize, "TABLE_LIMIT", 6)
    model = _model([1, 2, 3, 4], [1, 2, 5, 7], mode="cubic")
    for node in model.graph.node:
        node.metadata_props.add(key=keys.STAGE, value="backward")  # the stage a rewrite must keep
    graph, modified = _split(model)
    assert modified
    ops = [n.op_type for n in graph.graph if n.op_type not in ("Reshape", "Expand", "Constant")]
    assert ops == ["GatherElements", "Mul", "ReduceSum"] * 2 + ["Neg"], ops  # both resized axes, H then W
    assert all(n.metadata_props.get(keys.STAGE) == "backward" for n in graph.graph)
    assert next(n for n in graph.graph if "r" in {v.name for v in n.outputs}).name == "up"


@pytest.mark.parametrize("x_shape,y_shape,attributes", [
    ([1, 2, 3, 4], [1, 2, 5, 7], {"mode": "linear"}),  # every axis within the limit
    ([1, 1, 2, 5], [1, 1, 4, 10], {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                                   "nearest_mode": "floor"}),  # integer nearest: o / s, no table at any length
])
def test_within_the_tables_is_left_alone(monkeypatch, x_shape, y_shape, attributes) -> None:
    monkeypatch.setattr(split_resize, "TABLE_LIMIT", 7 if attributes["mode"] == "linear" else 4)
    graph, modified = _split(_model(x_shape, y_shape, **attributes))
    assert not modified and "Resize" in [n.op_type for n in graph.graph]


@pytest.mark.parametrize("x_shape,y_shape,attributes", [
    ([2, 3, 4, 5], [2, 3, 7, 9], {"mode": "linear", "coordinate_transformation_mode": "align_corners"}),
    ([1, 2, 5, 4], [1, 2, 8, 3], {"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1}),
    ([1, 2, 9, 8], [1, 2, 4, 3], {"mode": "linear", "antialias": 1}),
    ([1, 2, 5, 6], [1, 2, 9, 4], {"mode": "nearest", "coordinate_transformation_mode": "tf_half_pixel_for_nn",
                                  "nearest_mode": "ceil"}),
], ids=["linear", "cubic-tf", "antialias", "nearest"])
def test_split_computes_the_resize(monkeypatch, x_shape, y_shape, attributes) -> None:
    monkeypatch.setattr(split_resize, "TABLE_LIMIT", 3)
    x = np.random.default_rng(5).standard_normal(x_shape).astype(np.float32)
    model = _model(x_shape, y_shape, **attributes)
    graph, modified = _split(model)
    assert modified and "Resize" not in [n.op_type for n in graph.graph]
    np.testing.assert_allclose(_run(ir.to_proto(graph), x), _run(model, x), rtol=TOLERANCE, atol=TOLERANCE)
