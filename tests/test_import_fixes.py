"""Import passes of issue 12, each with a golden before/after case, a case it leaves alone and a
numeric case: fold_constants folding ConstantOfShape (the legacy exporter's computed `F.pad`
amounts), and infer_shapes on ceil_mode pools (onnx's inference keeps a window that onnxruntime
and torch drop).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from fblc.compiler.model_io import load_model
from fblc.compiler.values import attr, const_array
from fblc.passes.classify_initializers import ClassifyInitializers
from fblc.passes.fix_input_shapes import FixInputShapes
from fblc.passes.fold_constants import FoldConstants
from fblc.passes.infer_shapes import InferShapes
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes
from tests.conftest import make_model

RTOL, ATOL = 1e-5, 1e-6


def ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def run_onnx(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


# fold_constants: ConstantOfShape ------------------------------------------------------------------

class PadToMultiple(torch.nn.Module):
    """Pads the sequence to a multiple of 4 before a conv, the amounts computed from the input's length."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (4 - x.shape[-1] % 4) % 4
        return self.conv(F.pad(x, (pad // 2, pad - pad // 2)))


@pytest.fixture(scope="module")
def legacy_pad(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    """The legacy exporter at opset 18, batch and length dynamic: the pads are a Shape/Mod/Sub/Concat
    chain whose Concat with ConstantOfShape zeros fills the amounts of the axes F.pad leaves alone."""
    torch.manual_seed(0)
    module = PadToMultiple().eval()
    path = os.path.join(tmp_path_factory.mktemp("legacy_pad"), "pad.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(1, 2, 5),), path, dynamo=False, opset_version=18,
                          input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch", 2: "length"}, "y": {0: "batch", 2: "out"}})
    return path, module


def _pad_node(model: ir.Model) -> ir.Node:
    return next(n for n in model.graph if n.op_type == "Pad")


def test_fold_constant_of_shape_golden(legacy_pad) -> None:
    path, _ = legacy_pad
    model = run_passes(load_model(path), [FixInputShapes({"x": (2, 2, 5)}), ClassifyInitializers()])
    assert "ConstantOfShape" in ops(model)
    assert FoldConstants()(model).modified
    assert ops(model) == ["Pad", "Conv"]
    pads = const_array(_pad_node(model).inputs[1])
    assert pads is not None and pads.tolist() == [0, 0, 1, 0, 0, 2]  # length 5 -> 8: one before, two after
    # the rest of the import now has static shapes (it stopped at the Pad before), and fold_pads merges it
    imported = run_passes(load_model(path), import_passes(TrainingOptions(input_shapes={"x": (2, 2, 5)})))
    assert ops(imported) == ["Conv"]
    assert list(attr(next(iter(imported.graph)), "pads")) == [1, 2]
    assert list(imported.graph.outputs[0].shape) == [2, 3, 6]


def test_fold_constant_of_shape_leaves_runtime_shapes_alone() -> None:
    """A ConstantOfShape of a shape known only at run time is no constant: nothing to fold."""
    nodes = [helper.make_node("ConstantOfShape", ["n"], ["zeros"], name="fill",
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])),
             helper.make_node("Add", ["x", "zeros"], ["y"], name="add")]
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
                               helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], {})
    model = ir.from_proto(proto)
    ClassifyInitializers()(model)
    assert not FoldConstants()(model).modified
    assert ops(model) == ["ConstantOfShape", "Add"]


@pytest.mark.parametrize("length", [5, 8, 11])
def test_fold_constant_of_shape_numeric(legacy_pad, length: int) -> None:
    """The folded model gives the exported model's (dynamic) result and torch's, for lengths padded by 3, 0 and 1."""
    path, module = legacy_pad
    x = np.random.default_rng(length).standard_normal((2, 2, length)).astype(np.float32)
    model = run_passes(load_model(path), [FixInputShapes({"x": x.shape}), ClassifyInitializers(), FoldConstants()])
    assert "ConstantOfShape" not in ops(model)
    (folded,) = run_onnx(ir.to_proto(model), {"x": x})
    (exported,) = run_onnx(onnx.load(path), {"x": x})
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(folded, exported, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(folded, expected, rtol=RTOL, atol=ATOL)


# infer_shapes: ceil_mode pools --------------------------------------------------------------------

def _pool_proto(op_type: str, size: int, kernel: int, stride: int, pad: int, out: int, cip: int = 1,
                exporter_shapes: bool = True) -> onnx.ModelProto:
    """x [1, 2, size, size] -> pool (ceil_mode) -> Relu; with `exporter_shapes`, value_info of the
    right (torch's) shapes, as exporters write it."""
    attributes = {"count_include_pad": cip} if op_type == "AveragePool" else {}
    nodes = [helper.make_node(op_type, ["x"], ["p"], name="pool", kernel_shape=[kernel] * 2, strides=[stride] * 2,
                              pads=[pad] * 4, ceil_mode=1, **attributes),
             helper.make_node("Relu", ["p"], ["y"], name="relu")]
    shape = [1, 2, out, out]
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, size, size])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                      shape if exporter_shapes else ["n", "c", "h", "w"])], {})
    if exporter_shapes:
        proto.graph.value_info.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, shape))
    return proto


def _torch_pool(op_type: str, x: np.ndarray, kernel: int, stride: int, pad: int, cip: int) -> np.ndarray:
    tensor = torch.from_numpy(x)
    if op_type == "AveragePool":
        pooled = F.avg_pool2d(tensor, kernel, stride, pad, ceil_mode=True, count_include_pad=bool(cip))
    else:
        pooled = F.max_pool2d(tensor, kernel, stride, pad, ceil_mode=True)
    return torch.relu(pooled).numpy()


def test_infer_shapes_ceil_mode_golden() -> None:
    """k2 s3 p1 on 5: ceil((7 - 2) / 3) + 1 = 3 windows, but the third starts in the end padding and
    is dropped; onnx's inference says 3 (and fails against the exporter's 2), ceil_mode=0 gives 2."""
    proto = _pool_proto("AveragePool", 5, 2, 3, 1, out=2)
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    model = ir.from_proto(proto)
    assert InferShapes()(model).modified
    pool = next(iter(model.graph))
    assert attr(pool, "ceil_mode") == 0 and list(attr(pool, "pads")) == [1, 1, 1, 1]
    assert [list(v.shape) for v in (pool.outputs[0], model.graph.outputs[0])] == [[1, 2, 2, 2]] * 2
    onnx.checker.check_model(ir.to_proto(model), full_check=True)  # onnxruntime's session now loads it


def test_infer_shapes_keeps_a_ceil_mode_that_adds_a_window() -> None:
    """k3 s2 on 6: the third window starts inside the input and runs past it; it stays, as ceil_mode."""
    model = ir.from_proto(_pool_proto("AveragePool", 6, 3, 2, 0, out=3))
    InferShapes()(model)
    pool = next(iter(model.graph))
    assert attr(pool, "ceil_mode") == 1
    assert list(model.graph.outputs[0].shape) == [1, 2, 3, 3]
    assert not InferShapes()(model).modified


@pytest.mark.parametrize("op_type,size,kernel,stride,pad,out,cip", [
    ("AveragePool", 5, 2, 3, 1, 2, 1),  # the dropped window, both divisors
    ("AveragePool", 5, 2, 3, 1, 2, 0),
    ("MaxPool", 5, 2, 3, 1, 2, 0),
    ("AveragePool", 6, 3, 2, 0, 3, 1),  # a kept partial window (ceil_mode stays)
    ("AveragePool", 9, 2, 2, 1, 5, 1),
])
def test_infer_shapes_ceil_mode_numeric(op_type: str, size: int, kernel: int, stride: int, pad: int, out: int,
                                        cip: int) -> None:
    """The imported model, with or without the exporter's shapes, computes torch's pooling."""
    x = np.random.default_rng(size).standard_normal((1, 2, size, size)).astype(np.float32)
    expected = _torch_pool(op_type, x, kernel, stride, pad, cip)
    for exporter_shapes in (True, False):
        model = ir.from_proto(_pool_proto(op_type, size, kernel, stride, pad, out, cip, exporter_shapes))
        InferShapes()(model)
        assert list(model.graph.outputs[0].shape) == list(expected.shape)
        (y,) = run_onnx(ir.to_proto(model), {"x": x})
        np.testing.assert_allclose(y, expected, rtol=RTOL, atol=ATOL)


def test_infer_shapes_settles_a_pool_after_a_pool() -> None:
    """The second pool's decision depends on the first one's true output: given the stale 3x3 that
    onnx's inference would leave between them (as the folder's per-node inference does), it keeps
    ceil_mode at first, and drops it once the first pool is settled and the 2x2 is inferred."""
    nodes = [helper.make_node("AveragePool", ["x"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[3, 3],
                              pads=[1, 1, 1, 1], ceil_mode=1),
             helper.make_node("MaxPool", ["p1"], ["y"], name="pool2", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)]
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 5])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "c", "h", "w"])], {})
    proto.graph.value_info.append(helper.make_tensor_value_info("p1", TensorProto.FLOAT, [1, 2, 3, 3]))
    model = ir.from_proto(proto)
    assert InferShapes()(model).modified
    assert [attr(n, "ceil_mode") for n in model.graph] == [0, 0]
    x = np.random.default_rng(3).standard_normal((1, 2, 5, 5)).astype(np.float32)
    pooled = F.avg_pool2d(torch.from_numpy(x), 2, 3, 1, ceil_mode=True, count_include_pad=False)  # ONNX's default
    expected = F.max_pool2d(pooled, 2, 2, ceil_mode=True)
    assert list(model.graph.outputs[0].shape) == list(expected.shape) == [1, 2, 1, 1]
    (y,) = run_onnx(ir.to_proto(model), {"x": x})
    np.testing.assert_allclose(y, expected.numpy(), rtol=RTOL, atol=ATOL)


def test_group_norm_18_loads_though_the_checker_calls_it_deprecated(tmp_path) -> None:
    """onnx's checker refuses GroupNormalization-18 (deprecated by opset 21); onnxruntime runs it and
    lower_composites lowers it, so load_model lets that one complaint through, and only that one."""
    from onnx import TensorProto, helper

    from fblc.compiler.model_io import load_model
    from fblc.errors import ModelLoadError

    def saved(op: str, name: str) -> str:
        node = helper.make_node(op, ["x", "s", "b"], ["y"], num_groups=2, name="gn")
        shapes = {"x": [1, 4, 2, 2], "s": [2], "b": [2]}
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v)
                                                for k, v in shapes.items()],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 2])])
        path = str(tmp_path / name)
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
        return path

    assert [n.op_type for n in load_model(saved("GroupNormalization", "gn.onnx")).graph] == ["GroupNormalization"]
    with pytest.raises(ModelLoadError, match="not a valid ONNX model"):
        load_model(saved("NoSuchOp", "bad.onnx"))


# tie_weights: a tied embedding the exporter wrote twice -------------------------------------------

class TiedLM(torch.nn.Module):
    """An embedding whose transpose is also the output projection (GPT-2, OPT, BLOOM, T5 tie them)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 4)
        self.mix = torch.nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.embed(ids))) @ self.embed.weight.T


@pytest.fixture(scope="module")
def legacy_tied(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, TiedLM, np.ndarray]:
    """The legacy exporter with its default constant folding writes the tied weight twice: `embed.weight`
    for the Gather and a folded transpose `onnx::MatMul_...` for the MatMul."""
    module = TiedLM().eval()
    ids = np.array([[1, 4, 7], [10, 0, 3]], np.int64)
    path = str(tmp_path_factory.mktemp("tied") / "tied.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.from_numpy(ids),), path, dynamo=False, opset_version=18,
                          input_names=["ids"], output_names=["logits"])
    names = [i.name for i in onnx.load(path).graph.initializer]
    assert "embed.weight" in names and any(n.startswith("onnx::MatMul") for n in names), names
    return path, module, ids


def test_tie_weights_golden(legacy_tied) -> None:
    from fblc.passes.tie_weights import TieWeights

    path, _, _ = legacy_tied
    model = run_passes(load_model(path), [FixInputShapes({"ids": (2, 3)}), ClassifyInitializers()])
    assert TieWeights()(model).modified
    assert not any(name.startswith("onnx::MatMul") and "embed" not in name for name in model.graph.initializers
                   if model.graph.initializers[name].const_value.numpy().shape == (4, 11))
    transposes = [n for n in model.graph if n.op_type == "Transpose"]
    assert len(transposes) == 1 and transposes[0].inputs[0].name == "embed.weight"
    assert [u.node.op_type for u in transposes[0].outputs[0].uses()] == ["MatMul"]


def test_tie_weights_leaves_distinct_and_constant_tensors_alone() -> None:
    """Weights that differ stay apart; so do equal constant-valued ones (two fresh all-ones weights)."""
    from fblc.passes.tie_weights import TieWeights

    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "a"], ["h"]), helper.make_node("MatMul", ["h", "b"], ["h2"]),
             helper.make_node("MatMul", ["h2", "c"], ["h3"]), helper.make_node("MatMul", ["h3", "d"], ["y"])]
    inits = {"a": w, "b": w + 1e-3, "c": np.ones((3, 3), np.float32), "d": np.ones((3, 3), np.float32)}
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
    model = ir.from_proto(proto)
    ClassifyInitializers()(model)
    assert not TieWeights()(model).modified
    assert sorted(model.graph.initializers) == ["a", "b", "c", "d"]


def test_tie_weights_numeric(legacy_tied, tmp_path) -> None:
    """One trained tensor for the tied weight, whose gradient is torch's (the sum over both uses)."""
    from fblc.compiler.model_io import save_model_atomically
    from fblc.passes.pipeline import build_training_graph

    path, module, ids = legacy_tied
    labels = np.array([[2, 5, 9], [1, 1, 0]], np.int64)
    step = build_training_graph(load_model(path), TrainingOptions(input_shapes={"ids": (2, 3)}))
    params = {v.name: tuple(v.shape) for v in step.graph.inputs if v.name not in ("ids", "labels")}
    # mix.weight trains as the legacy exporter's folded transpose, the tied weight once, as embed.weight
    assert sorted(params.values()) == [(4,), (4, 4), (11, 4)] and params["embed.weight"] == (11, 4)
    step_path = str(tmp_path / "step.onnx")
    save_model_atomically(step, step_path)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(step_path, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, {"ids": ids, "labels": labels})))
    loss = F.cross_entropy(module(torch.from_numpy(ids)).reshape(-1, 11), torch.from_numpy(labels).reshape(-1))
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["embed.weight.grad"], module.embed.weight.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_infer_shapes_takes_a_folded_initializers_shape_from_its_data() -> None:
    """A node output that a pass folds into an initializer keeps the unknown dimension inference gave it
    (a legacy Longformer export's NonZero path ended in `internal error: Invalid item in shape: None`);
    inference must read the initializer's shape from its tensor."""
    nodes = [helper.make_node("Add", ["x", "w"], ["y"], name="add")]
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 300])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
                       {"w": np.ones((2, 300), np.float32)})  # over the 1 KiB that inference sees inline
    model = ir.from_proto(proto)
    model.graph.initializers["w"].shape = ir.Shape([2, None])  # as a folded node output may leave it
    assert InferShapes()(model).modified
    assert list(model.graph.outputs[0].shape) == [2, 300]
