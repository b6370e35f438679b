"""Normalisation, pooling and gather/scatter kernels: one training step on PoCL against onnxruntime.

Each model is the op under test on trainable initializers followed by ReduceSum(y * R), R a
fixed random constant, so the loss is the model's output and every gradient is non-trivial.
The step runs the forward kernel and the backward's kernels (ScatterND for MaxPool and
embeddings, ScatterElements for cross-entropy, ConvTranspose for AveragePool).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.codegen.verify import verify_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from tests.conftest import make_model

SGD = OptimizerConfig("sgd", lr=0.1)


def _check(tmp_path, model: onnx.ModelProto, loss: str = "output") -> None:
    path = str(tmp_path / "model.onnx")
    onnx.save(model, path)
    rows = verify_model(path, TrainingOptions(loss=loss, optimizer=SGD))
    assert rows
    bad = [r for r in rows if not r.ok]
    assert not bad, bad


def _op_then_loss(op: onnx.NodeProto, y_shape: list[int], inits: dict[str, np.ndarray],
                  inputs: list[onnx.ValueInfoProto] | None = None, seed: int = 1,
                  extra: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    """`op` (output "y") then loss = ReduceSum(y * R)."""
    rng = np.random.default_rng(seed)
    r = numpy_helper.from_array(rng.standard_normal(y_shape).astype(np.float32), "R")
    nodes = (extra or []) + [op,
                             helper.make_node("Constant", [], ["R"], value=r, name="r"),
                             helper.make_node("Mul", ["y", "R"], ["yr"], name="mul"),
                             helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0, name="sum")]
    return make_model(nodes, inputs or [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("op_type,axis", [("Softmax", 1), ("Softmax", -1), ("LogSoftmax", -1), ("LogSoftmax", 0)])
def test_softmax(tmp_path, op_type: str, axis: int) -> None:
    op = helper.make_node(op_type, ["x"], ["y"], axis=axis, name="sm")
    _check(tmp_path, _op_then_loss(op, [3, 5, 6], {"x": _randn(3, 5, 6, scale=2.0)}))


@pytest.mark.parametrize("axis", [-1, -2])
def test_layer_norm(tmp_path, axis: int) -> None:
    shape = [2, 3, 4, 6]
    norm_shape = shape[axis:]
    op = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=axis, epsilon=1e-5, name="ln")
    inits = {"x": _randn(*shape, scale=3.0) + 1.5, "scale": _randn(*norm_shape, seed=2) + 1.0,
             "bias": _randn(*norm_shape, seed=3)}
    _check(tmp_path, _op_then_loss(op, shape, inits))


@pytest.mark.parametrize("pads,include", [([0, 0, 0, 0], 0), ([1, 1, 1, 1], 0), ([1, 0, 1, 1], 1)])
def test_average_pool(tmp_path, pads: list[int], include: int) -> None:
    op = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=pads,
                          count_include_pad=include, name="pool")
    h_out = (7 + pads[0] + pads[2] - 3) // 2 + 1
    w_out = (8 + pads[1] + pads[3] - 3) // 2 + 1
    _check(tmp_path, _op_then_loss(op, [2, 3, h_out, w_out], {"x": _randn(2, 3, 7, 8)}))


@pytest.mark.parametrize("pads,strides,dilations", [([1, 1, 1, 1], [1, 1], [1, 1]), ([1, 0, 0, 1], [2, 1], [1, 2])])
def test_max_pool(tmp_path, pads: list[int], strides: list[int], dilations: list[int]) -> None:
    op = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 2], strides=strides, pads=pads,
                          dilations=dilations, name="pool")
    dims = [(n + pads[a] + pads[a + 2] - ((k - 1) * d + 1)) // s + 1
            for a, (n, k, s, d) in enumerate(zip([6, 7], [3, 2], strides, dilations))]
    _check(tmp_path, _op_then_loss(op, [2, 3, *dims], {"x": _randn(2, 3, 6, 7)}))


def test_embedding_with_repeated_ids(tmp_path) -> None:
    """Gather of a [5, 4] table by [3, 8] ids: 24 ids over 5 rows repeat, so ScatterND must add."""
    op = helper.make_node("Gather", ["table", "ids"], ["y"], axis=0, name="embed")
    model = _op_then_loss(op, [3, 8, 4], {"table": _randn(5, 4)},
                          inputs=[helper.make_tensor_value_info("ids", TensorProto.INT64, [3, 8])])
    _check(tmp_path, model)


def test_gather_inner_axis_negative_index(tmp_path) -> None:
    """Gather along axis 1 of an input (not trained) with constant indices, one negative."""
    idx = numpy_helper.from_array(np.array([[2, -1], [0, 0]], np.int64), "idx")
    extra = [helper.make_node("Constant", [], ["idx"], value=idx, name="idx"),
             helper.make_node("Gather", ["x", "idx"], ["g"], axis=1, name="gather")]
    op = helper.make_node("Mul", ["g", "w"], ["y"], name="scale")
    model = _op_then_loss(op, [3, 2, 2, 2], {"w": _randn(2, 2, 2, seed=4)}, extra=extra,
                          inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 2])])
    _check(tmp_path, model)


def test_scatter_forward(tmp_path) -> None:
    """ScatterND (replace, a negative index) into ScatterElements (add, repeated targets) as forward ops."""
    nd_idx = np.array([[2, -1], [0, 1]], np.int64)
    el_idx = np.array([[[1, 1, -4], [3, 0, 3], [2, 2, 2]]] * 3, np.int64)
    extra = [helper.make_node("Constant", [], ["nd_idx"], value=numpy_helper.from_array(nd_idx), name="nd_idx"),
             helper.make_node("Constant", [], ["el_idx"], value=numpy_helper.from_array(el_idx), name="el_idx"),
             helper.make_node("ScatterND", ["x", "nd_idx", "u"], ["s"], name="scatter_nd"),
             helper.make_node("ScatterElements", ["s", "el_idx", "v"], ["e"], axis=2, reduction="add",
                              name="scatter_el")]
    op = helper.make_node("Mul", ["e", "w"], ["y"], name="scale")
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
              for name, shape in [("x", [3, 3, 4]), ("u", [2, 4]), ("v", [3, 3, 3])]]
    _check(tmp_path, _op_then_loss(op, [3, 3, 4], {"w": _randn(3, 3, 4, seed=7)}, inputs=inputs, extra=extra))


@pytest.mark.parametrize("label_shape", [[6], [2, 3]])
def test_cross_entropy(tmp_path, label_shape: list[int]) -> None:
    """logits = x @ W + b, then loss=cross_entropy: LogSoftmax, GatherElements and ScatterElements."""
    in_shape = [*label_shape, 5]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="fc"),
             helper.make_node("Add", ["m", "b"], ["logits"], name="bias")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
                       [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*label_shape, 7])],
                       {"w": _randn(5, 7, seed=5), "b": _randn(7, seed=6)})
    _check(tmp_path, model, loss="cross_entropy")
