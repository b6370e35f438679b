"""split_softmax: Softmax and LogSoftmax become ReduceLogSumExp and an elementwise map.

- golden: the op types before and after, stages and names kept;
- negative: a graph without a softmax is left alone (`modified` false);
- numeric: the split graph in onnxruntime equals the original (rows offset by 20, where an exp
  without the maximum subtracted would overflow); the kernels are test_kernels_other.py's
  softmax rows, a step on PoCL through this pass.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fblc.compiler import keys
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes
from fblc.passes.split_softmax import SplitSoftmax

TOLERANCE = 1e-5  # fp32 on both sides; exp(x - logsumexp) against onnxruntime's own softmax


def _model(op: str, shape: list[int], axis: int) -> onnx.ModelProto:
    nodes = [helper.make_node(op, ["x"], ["s"], axis=axis, name="sm"), helper.make_node("Neg", ["s"], ["y"], name="neg")]
    graph = helper.make_graph(nodes, "softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _split(model: onnx.ModelProto) -> tuple[ir.Model, bool]:
    imported = run_passes(ir.from_proto(model), import_passes(TrainingOptions()))
    result = SplitSoftmax()(imported)
    return result.model, result.modified


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": x})[0]


@pytest.mark.parametrize("op,split", [("Softmax", ["ReduceLogSumExp", "Sub", "Exp", "Neg"]),
                                      ("LogSoftmax", ["ReduceLogSumExp", "Sub", "Neg"])])
def test_golden_split(op: str, split: list[str]) -> None:
    model = _model(op, [3, 10], -1)
    for node in model.graph.node:
        node.metadata_props.add(key=keys.STAGE, value="backward")  # the stage a rewrite must keep
    graph, modified = _split(model)
    assert modified
    assert [n.op_type for n in graph.graph] == split
    lse = next(n for n in graph.graph if n.op_type == "ReduceLogSumExp")
    assert lse.attributes["keepdims"].value == 1 and list(lse.inputs[1].const_value.numpy()) == [1]
    assert all(n.metadata_props.get(keys.STAGE) == "backward" for n in graph.graph)
    assert "s" in {v.name for n in graph.graph for v in n.outputs}, "the softmax's output keeps its name"
    # and its node the softmax's name, which the gradient rules' nodes give as their fblc.grad_of
    assert next(n for n in graph.graph if "s" in {v.name for v in n.outputs}).name == "sm"


def test_a_graph_without_softmax_is_left_alone() -> None:
    model = _model("Softmax", [3, 10], -1)
    model.graph.node[0].op_type = "Relu"
    del model.graph.node[0].attribute[:]
    graph, modified = _split(model)
    assert not modified and [n.op_type for n in graph.graph] == ["Relu", "Neg"]


@pytest.mark.parametrize("op,shape,axis", [("Softmax", [2, 3, 7], -1), ("Softmax", [4, 6], 0),
                                           ("LogSoftmax", [2, 9], 1), ("LogSoftmax", [3, 2, 5], 1)])
def test_split_computes_the_softmax(op: str, shape: list[int], axis: int) -> None:
    x = (np.random.default_rng(4).standard_normal(shape) * 4.0 + 20.0).astype(np.float32)
    model = _model(op, shape, axis)
    graph, _ = _split(model)
    np.testing.assert_allclose(_run(ir.to_proto(graph), x), _run(model, x), rtol=TOLERANCE, atol=TOLERANCE)
