"""transposed_products: Y = Transpose(MatMul(A, B)) becomes Y = MatMul(B^T, A^T), a swap Transpose read through.

- golden: the autodiff's shape of a transposed weight's gradient, (X^T dY)^T, becomes MatMul(dY^T, X): one
  Transpose (a view under tile_remap) instead of two and no strided result; Y keeps its name and stage;
- negative: a product that something else reads too, and a Transpose that moves a batch axis, stay;
- numeric: the rewritten graph in onnxruntime equals the original, 2-D and batched; the kernels are the
  MatMul's (test_kernels_contraction.py), a Llama step on PoCL through this pass (test_device_models.py).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper

from fblc.compiler import keys
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes
from fblc.passes.transposed_products import TransposedProducts

TOLERANCE = 1e-5  # fp32 both sides: the same products, summed in the same order


def _model(x_shape: list[int], dy_shape: list[int], perm: list[int], extra_reader: bool = False,
           transposed_x: bool = True) -> onnx.ModelProto:
    """y = Transpose(MatMul(Transpose(x), dy), perm) (+ z = Neg(p) when `extra_reader`; x itself, given as its
    transpose's shape, where not `transposed_x`)."""
    rank = len(x_shape)
    swap = [*range(rank - 2), rank - 1, rank - 2]
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=swap, name="xt") if transposed_x
             else helper.make_node("Identity", ["x"], ["xt"], name="xt"),
             helper.make_node("MatMul", ["xt", "dy"], ["p"], name="product"),
             helper.make_node("Transpose", ["p"], ["y"], perm=perm, name="grad")]
    y_shape = [([*x_shape[:-2], x_shape[-1], dy_shape[-1]])[i] for i in perm]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["p"], ["z"], name="other"))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    x_given = x_shape if transposed_x else [*x_shape[:-2], x_shape[-1], x_shape[-2]]
    graph = helper.make_graph(nodes, "transposed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_given),
                                                    helper.make_tensor_value_info("dy", TensorProto.FLOAT, dy_shape)],
                              outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _rewrite(model: onnx.ModelProto) -> tuple[ir.Model, bool]:
    imported = run_passes(ir.from_proto(model), import_passes(TrainingOptions()))
    for node in imported.graph:
        node.metadata_props[keys.STAGE] = "backward"  # the stage a rewrite must keep
    result = TransposedProducts()(imported)
    return result.model, result.modified


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0]


def test_golden_a_transposed_weight_gradient_is_computed_in_its_own_order() -> None:
    graph, modified = _rewrite(_model([32, 64], [32, 128], [1, 0]))
    assert modified
    assert [n.op_type for n in graph.graph] == ["Transpose", "MatMul"]
    transpose, product = list(graph.graph)
    assert transpose.inputs[0].name == "dy" and [v.name for v in product.inputs] == [transpose.outputs[0].name, "x"]
    assert product.outputs[0].name == "y" and graph.graph.outputs[0] is product.outputs[0]
    assert list(product.outputs[0].shape) == [128, 64]
    assert all(n.metadata_props.get(keys.STAGE) == "backward" for n in graph.graph)


def test_a_product_read_elsewhere_a_batch_axis_move_or_more_transposes_stay() -> None:
    """...and a product whose operands are no transposes: two new Transposes for one (copies under naive)."""
    for model in (_model([32, 64], [32, 128], [1, 0], extra_reader=True), _model([2, 8, 4], [2, 8, 12], [1, 0, 2]),
                  _model([32, 64], [32, 128], [1, 0], transposed_x=False)):
        graph, modified = _rewrite(model)
        assert not modified and [n.op_type for n in graph.graph].count("MatMul") == 1
        assert next(n for n in graph.graph if n.op_type == "MatMul").name == "product"


def test_the_rewritten_product_equals_the_original() -> None:
    rng = np.random.default_rng(39)
    for x_shape, dy_shape, perm in (([32, 64], [32, 128], [1, 0]), ([3, 16, 8], [3, 16, 12], [0, 2, 1])):
        model = _model(x_shape, dy_shape, perm)
        feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
                 "dy": rng.standard_normal(dy_shape).astype(np.float32)}
        graph, modified = _rewrite(model)
        assert modified
        np.testing.assert_allclose(_run(ir.to_proto(graph), feeds), _run(model, feeds), rtol=TOLERANCE,
                                   atol=TOLERANCE)
