"""Shared fixtures: small hand-built ONNX models for pass and CLI tests."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


def make_model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
               initializers: dict[str, np.ndarray], opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs,
                              initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def mlp_proto(batch: int | str = 4, seed: int = 0) -> onnx.ModelProto:
    """x[batch, 6] -> Gemm(8) -> Relu -> Identity -> MatMul(3) + b: logits [batch, 3]."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1, name="fc1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("Identity", ["a"], ["a2"], name="noop"),
        helper.make_node("MatMul", ["a2", "w2"], ["m"], name="fc2"),
        helper.make_node("Add", ["m", "b2"], ["logits"], name="bias2"),
    ]
    inits = {"w1": rng.standard_normal((8, 6)).astype(np.float32), "b1": rng.standard_normal(8).astype(np.float32),
             "w2": rng.standard_normal((8, 3)).astype(np.float32), "b2": rng.standard_normal(3).astype(np.float32)}
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 6])],
                      [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 3])], inits)


@pytest.fixture
def mlp_path(tmp_path) -> str:
    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp_proto(), path)
    return path
