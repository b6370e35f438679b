"""fuse across stages, on a residual RMSNorm MLP of two blocks (x + W2 relu(W1 rmsnorm(x)), a Llama block's shape):
a backward node joins a forward kernel only where that frees a saved value, and pass recompute's copies never do.

Before, RMSNorm's Pow backward (2x) joined the kernel making x, the residual stream, which the backward keeps
anyway: 2x was saved beside x (67 MB on the 1B LoRA step); and recompute's copies of a layer joined the forward's
kernels (the Pow copy reading the cut, its ReduceMean beside the forward's), so they ran in the forward and stayed
live to the backward, as if never recomputed. Graph mode: the memory plan of the lowered step, no device.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler import keys
from fblc.compiler.model_io import load_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.memory_plan import plan_memory
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from fblc.profiles import load_profile

B, T, D, H, V, BLOCKS = 1, 128, 16, 64, 10, 2


def _residual_rmsnorm_mlp(path: str) -> None:
    rng = np.random.default_rng(7)
    constants = {"two": np.array(2.0, np.float32), "eps": np.array(1e-6, np.float32), "axes": np.array([-1], np.int64)}
    nodes = [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(v, k)) for k, v in constants.items()]
    weights, x = {}, "x"
    for i in range(BLOCKS):
        weights[f"g{i}"] = rng.uniform(0.5, 1.5, size=(D,)).astype(np.float32)
        weights[f"w1_{i}"] = (rng.normal(size=(D, H)) / 4).astype(np.float32)
        weights[f"w2_{i}"] = (rng.normal(size=(H, D)) / 8).astype(np.float32)
        nodes += [helper.make_node("Pow", [x, "two"], [f"sq{i}"]),
                  helper.make_node("ReduceMean", [f"sq{i}", "axes"], [f"ms{i}"], keepdims=1),
                  helper.make_node("Add", [f"ms{i}", "eps"], [f"mse{i}"]),
                  helper.make_node("Sqrt", [f"mse{i}"], [f"rms{i}"]),
                  helper.make_node("Reciprocal", [f"rms{i}"], [f"inv{i}"]),
                  helper.make_node("Mul", [x, f"inv{i}"], [f"xn{i}"]),
                  helper.make_node("Mul", [f"xn{i}", f"g{i}"], [f"n{i}"]),
                  helper.make_node("MatMul", [f"n{i}", f"w1_{i}"], [f"h{i}"]),
                  helper.make_node("Relu", [f"h{i}"], [f"r{i}"]),
                  helper.make_node("MatMul", [f"r{i}", f"w2_{i}"], [f"d{i}"]),
                  helper.make_node("Add", [x, f"d{i}"], [f"x{i}"])]
        x = f"x{i}"
    weights["head"] = rng.normal(size=(D, V)).astype(np.float32)
    nodes.append(helper.make_node("MatMul", [x, "head"], ["logits"]))
    graph = helper.make_graph(nodes, "rmsmlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, T, D])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [B, T, V])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path)


@pytest.fixture(scope="module")
def rmsmlp(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("rmsmlp") / "rmsmlp.onnx")
    _residual_rmsnorm_mlp(path)
    return path


def _lowered(path: str, budget: int):  # type: ignore[no-untyped-def]
    options = TrainingOptions(device_memory=budget, optimizer=OptimizerConfig(name="sgd", lr=0.0))
    return build_training_graph(load_model(path), options, lower=load_profile("adreno830"))


def _stage(node) -> str:  # type: ignore[no-untyped-def]
    return node.metadata_props.get(keys.STAGE, "forward")


def _sources(node, kernel: str) -> list:  # type: ignore[no-untyped-def]
    """The values `node` is computed from in its kernel: its inputs, through the backward nodes of that kernel."""
    found, stack = [], list(node.inputs)
    while stack:
        value = stack.pop()
        producer = value.producer() if value is not None else None
        if producer is not None and _stage(producer) == "backward" and producer.metadata_props.get(keys.KERNEL) == kernel:
            stack.extend(producer.inputs)
        elif value is not None:
            found.append(value)
    return found


def test_no_backward_value_is_saved_beside_the_forward_value_it_is_made_from(rmsmlp) -> None:
    step = _lowered(rmsmlp, 0)
    saved = [b for b in plan_memory(step).buffers if b.cls == "saved"]
    buffer_of = {name: index for index, b in enumerate(saved) for name in (b.values or [b.name])}
    doubled = [(node.outputs[0].name, value.name) for node in step.graph
               if _stage(node) == "backward" and node.outputs[0].name in buffer_of
               for value in _sources(node, node.metadata_props.get(keys.KERNEL, ""))
               if buffer_of.get(value.name, -1) not in (-1, buffer_of[node.outputs[0].name])]
    assert not doubled, f"saved beside what they are made from: {doubled}"
    assert "x0" in buffer_of  # the residual stream is saved: its RMSNorm's and Mul's backward read it


def test_recompute_copies_run_in_kernels_of_their_own(rmsmlp) -> None:
    step = _lowered(rmsmlp, 1)  # under every floor: each layer recomputed
    kernels: dict[str, set[str]] = {}
    for node in step.graph:
        kernel = node.metadata_props.get(keys.KERNEL, "")
        if kernel.startswith("k"):
            kind = "copy" if keys.RECOMPUTE in node.metadata_props else _stage(node)
            kernels.setdefault(kernel, set()).add(kind)
    assert any("copy" in kinds for kinds in kernels.values())
    mixed = sorted(k for k, kinds in kernels.items() if {"copy", "forward"} <= kinds)
    assert not mixed, f"kernels running recompute copies in the forward: {mixed}"
