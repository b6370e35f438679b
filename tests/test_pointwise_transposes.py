"""pointwise_transposes: a 1x1 ConvTranspose over planes that texels straddle becomes Conv(dY, Transpose(W)).

- golden: the op types after, the Transpose marked a packing that tile_remap keeps a copy, dX's name and stage;
- negative: planes of whole texels, a stride, a group or padding leave the ConvTranspose alone;
- numeric: the rewritten graph in onnxruntime equals the original; the kernels are test_kernels_contraction.py's
  pointwise cases (a step on PoCL through this pass), the MobileNetV2 step of test_device_models.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fblc.compiler import keys
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes
from fblc.passes.pointwise_transposes import PointwiseTransposes
from fblc.passes.storage_precision import StoragePrecision
from fblc.passes.tile_remap import PACKED, TileRemap

TOLERANCE = 1e-5  # fp32 both sides: the same products over the input channels


def _model(dy_shape: list[int], w_shape: list[int], **attributes: Any) -> onnx.ModelProto:
    nodes = [helper.make_node("ConvTranspose", ["dy", "w"], ["dx"], name="dx", **attributes)]
    graph = helper.make_graph(nodes, "pointwise", [helper.make_tensor_value_info("dy", TensorProto.FLOAT, dy_shape),
                                                   helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape)],
                              [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _rewrite(model: onnx.ModelProto) -> tuple[ir.Model, bool]:
    imported = run_passes(ir.from_proto(model), import_passes(TrainingOptions()))
    for node in imported.graph:
        node.metadata_props[keys.STAGE] = "backward"  # the stage a rewrite must keep
    result = PointwiseTransposes()(imported)
    return result.model, result.modified


def test_golden_a_pointwise_input_gradient_reads_its_weights_packed() -> None:
    graph, modified = _rewrite(_model([2, 16, 3, 5], [16, 8, 1, 1]))
    assert modified
    assert [n.op_type for n in graph.graph] == ["Transpose", "Conv"]
    transpose, conv = list(graph.graph)
    assert list(transpose.attributes["perm"].value) == [1, 0, 2, 3] and transpose.inputs[0].name == "w"
    assert conv.outputs[0].name == "dx" and list(conv.outputs[0].shape) == [2, 8, 3, 5]
    assert all(n.metadata_props.get(keys.STAGE) == "backward" for n in graph.graph)
    TileRemap()(graph)  # a Transpose into a Conv would otherwise be a strided view: read one lane per fetch
    assert transpose.metadata_props[keys.REMAP] == PACKED and keys.INDEX_MAP not in transpose.metadata_props


@pytest.mark.parametrize("dy_shape,w_shape,attributes", [
    ([2, 16, 4, 5], [16, 8, 1, 1], {}),  # a plane of 20: whole texels, the transposed kernel's rows are consecutive
    # planes of 1 and 2 (a last stage's 1 x 1 map): a texel holds whole planes of consecutive channels, whose
    # weights lie side by side in W: the ConvTranspose reads them as whole texels without a copy of W^T
    ([2, 16, 1, 1], [16, 8, 1, 1], {}),
    ([2, 16, 1, 2], [16, 8, 1, 1], {}),
    ([2, 16, 3, 5], [16, 8, 1, 1], {"strides": [2, 2]}),
    ([2, 16, 3, 5], [16, 4, 1, 1], {"group": 2}),
    ([2, 16, 3, 5], [16, 8, 1, 1], {"pads": [0, 1, 0, 1]}),
    ([2, 16, 3, 5], [16, 8, 3, 3], {}),
])
def test_other_transposes_stay(dy_shape: list[int], w_shape: list[int], attributes: dict[str, Any]) -> None:
    graph, modified = _rewrite(_model(dy_shape, w_shape, **attributes))
    assert not modified and [n.op_type for n in graph.graph] == ["ConvTranspose"]


@pytest.mark.parametrize("dy_shape,w_shape", [([2, 16, 3, 5], [16, 8, 1, 1]), ([1, 4, 7], [4, 12, 1])])
def test_the_conv_equals_the_transpose(dy_shape: list[int], w_shape: list[int]) -> None:
    rng = np.random.default_rng(39)
    feeds = {"dy": rng.standard_normal(dy_shape).astype(np.float32),
             "w": rng.standard_normal(w_shape).astype(np.float32)}
    model = _model(dy_shape, w_shape)
    graph, modified = _rewrite(model)
    assert modified

    def run(proto: onnx.ModelProto) -> np.ndarray:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        return ort.InferenceSession(proto.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"]).run(["dx"], feeds)[0]

    np.testing.assert_allclose(run(ir.to_proto(graph)), run(model), rtol=TOLERANCE, atol=TOLERANCE)


def test_a_packing_of_a_master_weight_keeps_its_format() -> None:
    """Under --dtype fp16 the parameters stay fp32 (storage_precision): so does W's packed copy, which the
    input gradient now reads instead of W; a packing of an activation is half like it."""
    graph, _ = _rewrite(_model([2, 16, 3, 5], [16, 8, 1, 1]))
    TileRemap()(graph)
    transpose = next(n for n in graph.graph if n.op_type == "Transpose")
    StoragePrecision("fp16").call(graph)
    assert transpose.outputs[0].metadata_props[keys.STORAGE] == "fp16"
    keys.set_role(next(v for v in graph.graph.inputs if v.name == "w"), keys.Role.PARAM)
    StoragePrecision("fp16").call(graph)
    assert transpose.outputs[0].metadata_props[keys.STORAGE] == "fp32"


def test_a_frozen_weight_is_packed_at_compile_time() -> None:
    """A constant W (frozen: no graph input) becomes a transposed initializer; no Transpose runs per step."""
    model = _model([2, 16, 3, 5], [16, 8, 1, 1])
    w = np.random.default_rng(5).standard_normal((16, 8, 1, 1)).astype(np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(w, "w"))
    del model.graph.input[1]
    graph, modified = _rewrite(model)
    assert modified and [n.op_type for n in graph.graph] == ["Conv"]
    packed = graph.graph.node(0).inputs[1]
    np.testing.assert_array_equal(packed.const_value.numpy(), w.transpose(1, 0, 2, 3))
