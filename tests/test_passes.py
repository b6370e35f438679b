"""Pass tests: a golden before/after case, a case the pass leaves alone, and a numeric case."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fblc.compiler import keys
from fblc.errors import ShapeError, TrainableSetError
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.attach_loss import AttachLoss
from fblc.passes.bn_batch_stats import BatchNormBatchStats
from fblc.passes.build_gradients import BuildGradients
from fblc.passes.classify_initializers import ClassifyInitializers
from fblc.passes.eliminate_noops import EliminateNoops
from fblc.passes.fix_input_shapes import FixInputShapes
from fblc.passes.fold_constants import FoldConstants
from fblc.passes.infer_shapes import InferShapes
from fblc.passes.mark_trainable import MarkTrainable
from fblc.passes.optimizer_step import OptimizerStep
from fblc.compiler.model_io import load_model
from fblc.passes.pipeline import TrainingOptions, build_training_graph, run_passes, training_pipeline
from tests.conftest import make_model, mlp_proto

RTOL, ATOL = 1e-5, 1e-6  # fp32, same ops in the same order as onnxruntime's own run


def ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def checked(model: ir.Model) -> ir.Model:
    """The pass left a valid model (as every pass must)."""
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    return model


def run_onnx(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options)
    return session.run(None, feeds)


def imported(proto: onnx.ModelProto, **shapes: tuple[int, ...]) -> ir.Model:
    model = ir.from_proto(proto)
    return run_passes(model, [FixInputShapes(shapes), ClassifyInitializers(), FoldConstants(), EliminateNoops(),
                              InferShapes()])


def shape_chain_proto() -> onnx.ModelProto:
    """What exporters write: x.reshape(x.shape[0], -1) through Shape/Gather/Concat, and a CastLike constant."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0, name="take_batch"),
        helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"], name="n_vec"),
        helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0, name="target"),
        helper.make_node("Reshape", ["x", "target"], ["flat"], name="flatten"),
        helper.make_node("Constant", [], ["two"], value=helper.make_tensor("two", TensorProto.DOUBLE, [], [2.0])),
        helper.make_node("CastLike", ["two", "flat"], ["two_f"], name="castlike"),
        helper.make_node("Mul", ["flat", "two_f"], ["y"], name="scale"),
    ]
    inits = {"zero": np.array(0, np.int64), "axes0": np.array([0], np.int64),
             "minus_one": np.array([-1], np.int64)}
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 12])], inits)


# fix_input_shapes ---------------------------------------------------------------------------

def test_fix_input_shapes_golden() -> None:
    model = ir.from_proto(shape_chain_proto())
    result = FixInputShapes({"x": (5, 3, 4)})(model)
    assert result.modified
    assert list(model.graph.inputs[0].shape) == [5, 3, 4]


def test_fix_input_shapes_leaves_static_inputs_alone() -> None:
    model = ir.from_proto(mlp_proto(batch=4))
    assert not FixInputShapes({})(model).modified


def test_fix_input_shapes_errors_name_the_input() -> None:
    with pytest.raises(ShapeError, match=r"'x' has dynamic dims \[\?x3x4\].*--input-shape x="):
        FixInputShapes({})(ir.from_proto(shape_chain_proto()))
    with pytest.raises(ShapeError, match="'y', which is not a model input.*inputs are: x"):
        FixInputShapes({"y": (1,)})(ir.from_proto(shape_chain_proto()))
    with pytest.raises(ShapeError, match="sets dim 1 to 7 but the model fixes it at 3"):
        FixInputShapes({"x": (5, 7, 4)})(ir.from_proto(shape_chain_proto()))


# classify_initializers / fold_constants / eliminate_noops / infer_shapes -------------------------

def test_classify_marks_weights_and_bn_statistics() -> None:
    model = ir.from_proto(bn_model_proto())
    assert ClassifyInitializers()(model).modified
    roles = {name: keys.get_role(v) for name, v in model.graph.initializers.items()}
    assert roles == {"w": "param", "gamma": "param", "beta": "param", "mean": "frozen", "var": "frozen"}
    assert not ClassifyInitializers()(model).modified


def test_fold_constants_golden_and_numeric() -> None:
    model = ir.from_proto(shape_chain_proto())
    run_passes(model, [FixInputShapes({"x": (5, 3, 4)}), ClassifyInitializers()])
    assert ops(model) == ["Shape", "Gather", "Unsqueeze", "Concat", "Reshape", "Constant", "CastLike", "Mul"]
    assert FoldConstants()(model).modified
    assert ops(checked(model)) == ["Reshape", "Mul"]
    x = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)
    (y,) = run_onnx(model, {"x": x})
    np.testing.assert_allclose(y, x.reshape(5, 12) * 2, rtol=RTOL, atol=ATOL)


def test_fold_constants_never_folds_through_a_weight() -> None:
    """Transpose(W) before a MatMul must stay: folding it would rename the weight and stop it training."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0], name="t"),
             helper.make_node("MatMul", ["x", "wt"], ["y"], name="mm")]
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                       {"w": rng.standard_normal((4, 3)).astype(np.float32)})
    model = ir.from_proto(proto)
    ClassifyInitializers()(model)
    assert not FoldConstants()(model).modified
    assert ops(model) == ["Transpose", "MatMul"]


def test_eliminate_noops_golden_and_leave_alone() -> None:
    model = ir.from_proto(mlp_proto())
    assert EliminateNoops()(model).modified
    assert ops(checked(model)) == ["Gemm", "Relu", "MatMul", "Add"]
    assert not EliminateNoops()(model).modified


def test_inference_dropout_mask_is_all_true() -> None:
    """onnx's test_dropout_default_mask: the mask of an inference Dropout was a view of x; it is all true, by
    onnxruntime on the rewritten graph (x with a NaN and an inf), and its reader reads it."""
    nodes = [helper.make_node("Dropout", ["x"], ["y", "z"], name="drop"),
             helper.make_node("Not", ["z"], ["dropped"], name="flip")]
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                        helper.make_tensor_value_info("z", TensorProto.BOOL, [2, 3]),
                        helper.make_tensor_value_info("dropped", TensorProto.BOOL, [2, 3])], {})
    model = imported(proto)
    assert ops(model) == ["IsNaN", "Not", "Or", "Dropout", "Not"]  # y, a graph output, keeps its Dropout (a view)
    x = np.array([[1.0, np.nan, -2.0], [np.inf, 0.0, 3.0]], np.float32)
    y, z, dropped = run_onnx(checked(model), {"x": x})
    np.testing.assert_array_equal(y, x)
    assert z.dtype == np.bool_ and z.all() and not dropped.any()


def test_infer_shapes_fills_every_value() -> None:
    model = imported(shape_chain_proto(), x=(5, 3, 4))
    assert [list(n.outputs[0].shape) for n in model.graph] == [[5, 12], [5, 12]]
    assert not InferShapes()(model).modified


# bn_batch_stats --------------------------------------------------------------------------------

def bn_model_proto() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], name="bn")]
    inits = {"w": rng.standard_normal((4, 2, 3, 3)).astype(np.float32),
             "gamma": rng.uniform(0.5, 1.5, 4).astype(np.float32), "beta": rng.standard_normal(4).astype(np.float32),
             "mean": rng.standard_normal(4).astype(np.float32), "var": rng.uniform(0.5, 2, 4).astype(np.float32)}
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2, 5, 5])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4, 5, 5])], inits)


def test_bn_batch_stats_golden_and_numeric() -> None:
    model = imported(bn_model_proto())
    assert BatchNormBatchStats(enabled=True)(model).modified
    assert "BatchNormalization" not in ops(checked(model))
    assert [v.name for v in model.graph.outputs] == ["y", "mean.new", "var.new"]
    x = np.random.default_rng(2).standard_normal((3, 2, 5, 5)).astype(np.float32)
    y, mean_new, var_new = run_onnx(model, {"x": x, "mean": np.zeros(4, np.float32), "var": np.ones(4, np.float32)})
    c = run_onnx(_conv_only(model), {"x": x})[0]  # the conv output, from onnxruntime
    batch_mean, batch_var = c.mean(axis=(0, 2, 3)), c.var(axis=(0, 2, 3))
    gamma = model.graph.initializers["gamma"].const_value.numpy()
    beta = model.graph.initializers["beta"].const_value.numpy()
    expect = (c - batch_mean[None, :, None, None]) / np.sqrt(batch_var[None, :, None, None] + 1e-5)
    expect = expect * gamma[None, :, None, None] + beta[None, :, None, None]
    np.testing.assert_allclose(y, expect, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mean_new, 0.1 * batch_mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(var_new, 0.9 + 0.1 * c.var(axis=(0, 2, 3), ddof=1), rtol=1e-4, atol=1e-6)


def _conv_only(model: ir.Model) -> ir.Model:
    proto = ir.to_proto(model)
    conv_out = next(n for n in proto.graph.node if n.op_type == "Conv").output[0]
    del proto.graph.output[:]
    proto.graph.output.append(helper.make_tensor_value_info(conv_out, TensorProto.FLOAT, [3, 4, 5, 5]))
    return ir.from_proto(proto)


def test_bn_batch_stats_leaves_eval_mode_alone() -> None:
    model = imported(bn_model_proto())
    assert not BatchNormBatchStats(enabled=False)(model).modified
    assert not BatchNormBatchStats(enabled=True)(imported(mlp_proto())).modified



def test_a_weight_standardised_conv_from_the_legacy_exporter_trains_like_torch(tmp_path) -> None:
    """timm's and BiT's StdConv2d normalise the weight by its own statistics with F.batch_norm(training=True):
    the legacy exporter writes a training-mode BatchNormalization fed by ReduceMeans of the weight. It is
    rewritten to batch statistics without --bn-train (nothing stored to update) and trains like torch."""
    import torch
    import torch.nn.functional as F

    class StdConv(torch.nn.Conv2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                             momentum=0.0, eps=1e-6).reshape_as(self.weight)
            return F.conv2d(x, w, self.bias, self.stride, self.padding)

    torch.manual_seed(0)
    module = torch.nn.Sequential(StdConv(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                 torch.nn.Linear(4 * 6 * 6, 2))
    x, labels = torch.randn(2, 3, 6, 6), torch.randn(2, 2)
    path = str(tmp_path / "std_conv.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), path, dynamo=False, input_names=["x"], output_names=["y"])
    assert any(n.op_type == "BatchNormalization" for n in onnx.load(path).graph.node)
    step = build_training_graph(load_model(path), TrainingOptions(loss="mse", optimizer=OptimizerConfig("sgd")))
    assert "BatchNormalization" not in ops(step)
    feeds = {"x": x.numpy(), "labels": labels.numpy()}
    params = [v.name for v in step.graph.inputs if v.name not in feeds]
    weight = next(name for name in params if np.prod(step.graph.initializers[name].shape) == 4 * 27)
    got = dict(zip([v.name for v in step.graph.outputs], run_onnx(step, feeds)))
    loss = F.mse_loss(module(x), labels)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(got[f"{weight}.grad"].reshape(4, 3, 3, 3), module[0].weight.grad.numpy(),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["0.bias.grad"], module[0].bias.grad.numpy(), rtol=1e-4, atol=1e-6)

# mark_trainable / attach_loss / build_gradients / optimizer_step ----------------------------------

def test_mark_trainable_golden_and_patterns() -> None:
    model = imported(mlp_proto())
    assert MarkTrainable(freeze="^b")(model).modified
    assert [v.name for v in model.graph.inputs] == ["x", "w1", "w2"]
    assert {n: keys.get_role(v) for n, v in model.graph.initializers.items()} == {
        "w1": "param", "b1": "frozen", "w2": "param", "b2": "frozen"}
    again = imported(mlp_proto())
    assert MarkTrainable()(again).modified
    assert not MarkTrainable()(again).modified


@pytest.mark.parametrize("train, freeze, message", [
    ("nothing_matches", None, "--train 'nothing_matches' matches no parameter"),
    (None, ".", "nothing to train"),
    ("(", None, "not a valid regular expression"),
])
def test_mark_trainable_errors(train: str | None, freeze: str | None, message: str) -> None:
    with pytest.raises(TrainableSetError, match=message.replace("(", r"\(")):
        MarkTrainable(train=train, freeze=freeze)(imported(mlp_proto()))


def test_attach_loss_golden_and_numeric() -> None:
    model = imported(mlp_proto())
    MarkTrainable()(model)
    assert AttachLoss("cross_entropy")(model).modified
    assert [v.name for v in model.graph.inputs][:2] == ["x", "labels"]
    assert [v.name for v in model.graph.outputs] == ["loss"]
    assert ops(checked(model))[:4] == ["Gemm", "Relu", "MatMul", "Add"]
    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    labels = np.array([0, 2, -100, 1])
    weights = {k: v.const_value.numpy() for k, v in model.graph.initializers.items() if keys.get_role(v) == "param"}
    (loss,) = run_onnx(model, {"x": x, "labels": labels, **weights})
    logits = np.maximum(x @ weights["w1"].T + weights["b1"], 0) @ weights["w2"] + weights["b2"]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    counted = labels != -100
    expect = -log_probs[np.arange(4)[counted], labels[counted]].mean()
    np.testing.assert_allclose(loss, expect, rtol=1e-5)


def _step_model(optimizer: OptimizerConfig) -> ir.Model:
    model = imported(mlp_proto())
    return run_passes(model, [MarkTrainable(), AttachLoss("cross_entropy"), BuildGradients(), OptimizerStep(optimizer)])


def test_build_gradients_and_optimizer_step_interface() -> None:
    model = _step_model(OptimizerConfig("adam", lr=0.01))
    checked(model)
    assert [v.name for v in model.graph.outputs] == [
        "loss", "w1.grad", "w1.new", "b1.grad", "b1.new", "w2.grad", "w2.new", "b2.grad", "b2.new",
        "w1.exp_avg.new", "w1.exp_avg_sq.new", "b1.exp_avg.new", "b1.exp_avg_sq.new", "w2.exp_avg.new",
        "w2.exp_avg_sq.new", "b2.exp_avg.new", "b2.exp_avg_sq.new", "optimizer.step.new"]
    assert [v.name for v in model.graph.inputs][:6] == ["x", "labels", "w1", "b1", "w2", "b2"]
    assert model.graph.inputs[-1].name == "optimizer.step"
    saved = {v.name for n in model.graph for v in n.outputs if keys.get_role(v) == "saved"}
    assert saved >= {"a"}  # the ReLU output: its mask and fc2's weight gradient read it


def test_build_gradients_numeric_against_finite_differences() -> None:
    model = _step_model(OptimizerConfig("sgd", lr=0.5))
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((4, 6)).astype(np.float32), "labels": np.array([0, 1, 2, 1])}
    params = {k: v.const_value.numpy().astype(np.float64) for k, v in model.graph.initializers.items()
              if keys.get_role(v) == "param" and v.is_graph_input()}
    names = [o.name for o in model.graph.outputs]
    outputs = dict(zip(names, run_onnx(model, {**feeds, **{k: v.astype(np.float32) for k, v in params.items()}})))

    def loss_of(p: dict[str, np.ndarray]) -> float:
        h = np.maximum(feeds["x"] @ p["w1"].T + p["b1"], 0)
        logits = h @ p["w2"] + p["b2"]
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return float(-log_probs[np.arange(4), feeds["labels"]].mean())

    for name, value in params.items():
        numeric = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            for sign in (1, -1):
                bumped = dict(params)
                bumped[name] = value.copy()
                bumped[name][index] += sign * 1e-6
                numeric[index] += sign * loss_of(bumped) / 2e-6
        np.testing.assert_allclose(outputs[f"{name}.grad"], numeric, rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(outputs[f"{name}.new"], value - 0.5 * outputs[f"{name}.grad"], rtol=1e-5, atol=1e-6)


def test_build_gradients_demotes_parameters_the_loss_ignores() -> None:
    proto = mlp_proto()
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(3, np.float32), "unused"))
    model = imported(proto)
    run_passes(model, [MarkTrainable(), AttachLoss("cross_entropy"), BuildGradients()])
    assert "unused" not in [v.name for v in model.graph.inputs]
    assert model.metadata_props[keys.UNUSED_PARAMS] == "unused"


def test_shape_rules_agree_with_onnx_inference() -> None:
    """The emitter's own shapes for loss/backward/optimizer ops equal onnx's shape inference."""
    from fblc.compiler.shapes import _weightless_proto

    model = run_passes(ir.from_proto(mlp_proto()), training_pipeline(TrainingOptions(
        optimizer=OptimizerConfig("adamw", weight_decay=0.1), bn_train=False)))
    inferred = onnx.shape_inference.infer_shapes(_weightless_proto(model), strict_mode=True)
    found = {v.name: v.type.tensor_type for v in inferred.graph.value_info}
    compared = 0
    for node in model.graph:
        for value in node.outputs:
            if value.name in found:
                expect = found[value.name]
                assert tuple(d.dim_value for d in expect.shape.dim) == tuple(value.shape), value.name
                assert expect.elem_type == int(value.dtype), value.name
                compared += 1
    assert compared > 50


def _kernels_of_outputs(options: TrainingOptions, leave_out: str = "") -> tuple[dict[str, str | None], list[list[str]]]:
    """The MLP's step through fuse (without the pass named `leave_out`): the kernel that makes each `.grad` /
    `.new` output, and the kernels that hold optimizer nodes only (launches of their own)."""
    from fblc.passes.pipeline import compile_pipeline
    from fblc.profiles.profile import load_profile

    passes = [p for p in compile_pipeline(options, load_profile("adreno830")) if getattr(p, "name", "") != leave_out]
    model = run_passes(ir.from_proto(mlp_proto()), passes)
    kernels: dict[str, list[ir.Node]] = {}
    made: dict[str, str | None] = {}
    for node in model.graph:
        kernel = node.metadata_props.get(keys.KERNEL)
        made.update({v.name: kernel for v in node.outputs})
        if kernel not in (None, "alias"):
            kernels.setdefault(kernel, []).append(node)
    alone = [[n.op_type for n in nodes] for nodes in kernels.values()
             if all(n.metadata_props.get(keys.STAGE) == "optimizer" for n in nodes)]
    return {v.name: made.get(v.name) for v in model.graph.outputs}, alone


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fuse_joins_each_update_to_the_kernel_of_its_gradient(optimizer: str) -> None:
    """Golden: every parameter's update (SGD with momentum, AdamW with its two moments) is computed in the
    kernel that makes its gradient (Gemm and MatMul epilogues, the bias sums' reduction kernels): `P.grad`,
    `P.new` and its state's `.new` come from one kernel; only Adam's once-per-step scalars launch alone.
    Under dynamic loss scaling too: commit_if_finite leaves the skipped step's updates uncommitted instead of
    gating them on the finite check. Negative: without it every update waits for the check over all gradients,
    so none joins its gradient's kernel."""
    config = OptimizerConfig(optimizer, weight_decay=0.1, momentum=0.9 if optimizer == "sgd" else 0.0)
    made, alone = _kernels_of_outputs(TrainingOptions(optimizer=config))
    states = {"sgd": ["momentum"], "adamw": ["exp_avg", "exp_avg_sq"]}[optimizer]
    for param in ("w1", "b1", "w2", "b2"):
        group = {made[f"{param}.grad"], made[f"{param}.new"], *(made[f"{param}.{s}.new"] for s in states)}
        assert len(group) == 1 and None not in group, (param, group)
    assert alone == ([] if optimizer == "sgd" else [["Add", "Pow", "Sub", "Pow", "Sub", "Div", "Sqrt", "Reciprocal"]])
    scaled = TrainingOptions(optimizer=config, dtype="fp16", loss_scale="dynamic")
    committed, _ = _kernels_of_outputs(scaled)
    for param in ("w1", "b1", "w2", "b2"):
        group = {committed[f"{param}.grad"], committed[f"{param}.new"], *(committed[f"{param}.{s}.new"] for s in states)}
        assert len(group) == 1 and None not in group, (param, group)
    gated, _ = _kernels_of_outputs(scaled, leave_out="commit_if_finite")
    assert all(gated[f"{p}.grad"] != gated[f"{p}.new"] for p in ("w1", "b1", "w2", "b2")), gated


def test_fuse_sees_a_path_through_a_kernel_that_spans_the_graph() -> None:
    """Kernel X = {x1 = Exp(a), x2 = x1 + s^T} spans the graph; g = ReduceSum(x1) lies wholly before
    s = Sigmoid(b), and t = s + g. Merging s with t would close the cycle s -> X -> g -> t, though every
    node of g comes before s (the node-position pruning fuse had missed it: NetworkXUnfeasible); kernel
    levels see it, so s and t stay apart and the kernels have a launch order."""
    from fblc.passes.fuse import FuseKernels
    from fblc.passes.tile_remap import TileRemap

    nodes = [helper.make_node("Exp", ["a"], ["x1"], name="x1"),
             helper.make_node("ReduceSum", ["x1", "axes"], ["g"], name="g", keepdims=1),
             helper.make_node("Sigmoid", ["b"], ["s"], name="s"),
             helper.make_node("Transpose", ["s"], ["st"], name="st", perm=[1, 0]),
             helper.make_node("Add", ["x1", "st"], ["x2"], name="x2"),
             helper.make_node("Add", ["s", "g"], ["t"], name="t")]
    square = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in ("a", "b", "x2", "t")]
    step = TileRemap()(InferShapes()(ir.serde.deserialize_model(make_model(
        nodes, square[:2], square[2:], {"axes": np.array([0], np.int64)}))).model).model
    FuseKernels()(step)
    kernel = {n.name: n.metadata_props[keys.KERNEL] for n in step.graph}
    assert kernel["x1"] == kernel["x2"] and kernel["st"] == "alias", kernel
    assert len({kernel["s"], kernel["t"], kernel["g"], kernel["x1"]}) == 4, kernel


def test_fuse_folds_total_reductions_of_one_stage_whatever_their_inputs() -> None:
    """Golden: sums over whole tensors of three shapes in one stage (the finite check's, one per gradient) fold
    in one kernel with the Adds of their results. Negative: one of another stage (the loss's) keeps its own,
    and so does a reduction that keeps an axis."""
    from fblc.passes.fuse import FuseKernels
    from fblc.passes.tile_remap import TileRemap

    shapes = {"a": [3, 5], "b": [7], "c": [2, 2, 6], "d": [4, 4]}
    nodes = [helper.make_node("ReduceSum", [x], [f"s{x}"], name=f"s{x}", keepdims=0) for x in "abc"]
    nodes += [helper.make_node("ReduceSum", ["d"], ["sd"], name="sd", keepdims=0),
              helper.make_node("ReduceSum", ["d", "axes"], ["rows"], name="rows", keepdims=0),
              helper.make_node("Add", ["sa", "sb"], ["ab"], name="ab"),
              helper.make_node("Add", ["ab", "sc"], ["abc"], name="abc")]
    model = make_model(nodes, [helper.make_tensor_value_info(x, TensorProto.FLOAT, s) for x, s in shapes.items()],
                       [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (("abc", []), ("sd", []),
                                                                                      ("rows", [4]))],
                       {"axes": np.array([1], np.int64)})
    step = TileRemap()(InferShapes()(ir.serde.deserialize_model(model)).model).model
    for node in step.graph:
        node.metadata_props[keys.STAGE] = "loss" if node.name == "sd" else "optimizer"
    FuseKernels()(step)
    kernel = {n.name: n.metadata_props[keys.KERNEL] for n in step.graph}
    assert kernel["sa"] == kernel["sb"] == kernel["sc"] == kernel["ab"] == kernel["abc"], kernel
    assert len({kernel["sa"], kernel["sd"], kernel["rows"]}) == 3, kernel
