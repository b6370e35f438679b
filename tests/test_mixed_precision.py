"""Mixed precision (--dtype fp16): storage_precision, dynamic loss scaling (skip_nonfinite), convergence.

Half textures hold activations and their gradients; parameters, the gradients the optimizer
reads and its state stay fp32; the backward starts from a loss scale; a step with inf/NaN
gradients is skipped. References: onnxruntime for the scaled step graph, the fp32 bundle's
loss curve for the fp16 one (50 AdamW steps within 2 %).
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fblc.codegen.compile import compile_model
from fblc.compiler import keys
from fblc.compiler.loss_scale import INITIAL_SCALE
from fblc.compiler.model_io import load_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.errors import FblcError
from fblc.passes.fuse import FuseKernels
from fblc.passes.infer_shapes import InferShapes
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from fblc.passes.storage_precision import StoragePrecision
from fblc.profiles.profile import READ_IMAGE_ARGS
from fblc.runtime.local import LocalRunner
from tests.conftest import make_model, mlp_proto
from tests.support import zoo

ADAMW = OptimizerConfig("adamw", lr=3e-3, weight_decay=1e-2)


def _formats(bundle: str) -> dict[str, str]:
    """Value name -> the format of the texture that stores it (plan.json)."""
    plan = json.load(open(os.path.join(bundle, "plan.json")))
    return {name: texture["format"] for texture in plan["textures"] for name in texture["values"]}


def _mlp_feeds(step: ir.Model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((4, 6)).astype(np.float32), "labels": np.array([0, 2, 1, 2], np.int64)}


def test_fp16_keeps_parameters_gradients_and_optimizer_state_in_fp32(mlp_path, tmp_path) -> None:
    """Golden: under --dtype fp16 the master copy of training is fp32, activations are half; fp32 is all fp32."""
    options = TrainingOptions(optimizer=ADAMW)
    formats = {}
    for dtype in ("fp32", "fp16"):
        step, report = compile_model(mlp_path, str(tmp_path / dtype), "adreno830", dtype, options)
        formats[dtype] = _formats(str(tmp_path / dtype))
    assert set(formats["fp32"].values()) <= {"rgba_f32", "rgba_i32", "r_mask8", "r_mask4"}
    half = formats["fp16"]
    for name in ("w1", "w1.new", "w1.grad", "w1.exp_avg", "w1.exp_avg_sq.new", "optimizer.step", "loss",
                 "loss_scale", "loss_scale.new"):
        assert half[name] == "rgba_f32", name
    assert half["a"] == "rgba_f16"  # relu's output, an activation fc2 saves for its weight gradient
    params = [v for v in step.graph.inputs if keys.get_role(v) == "param"]
    assert all(v.metadata_props[keys.STORAGE] == "fp32" for v in params)
    assert any(v.metadata_props.get(keys.STORAGE) == "fp16" for n in step.graph for v in n.outputs)


def test_the_memory_report_counts_half_textures_at_two_bytes(mlp_path, tmp_path) -> None:
    """The memory plan counts bytes by each tensor's storage: the parameters and the optimizer's
    moments as in fp32 (masters), a saved half activation at 2 bytes an element."""
    memory = {}
    for dtype in ("fp32", "fp16"):
        _, report = compile_model(mlp_path, str(tmp_path / dtype), "adreno830", dtype, TrainingOptions(optimizer=ADAMW))
        memory[dtype] = report["memory"]
    scale_state = 8  # loss_scale and its good-step count, fp32 scalars
    assert memory["fp16"]["optimizer"] == memory["fp32"]["optimizer"] + scale_state
    assert memory["fp16"]["grads"] == memory["fp32"]["grads"]
    half = [e for e in memory["fp16"]["floor"]["saved"] if e["dtype"] == "float16"]
    assert half and all(e["bytes"] == 2 * int(np.prod(e["shape"])) for e in half)
    assert memory["fp16"]["saved_activations"] < memory["fp32"]["saved_activations"]
    assert "fp16 2" in memory["fp16"]["accounting"]
    for dtype in ("fp32", "fp16"):  # one device figure: what the runtime allocates (PoCL: no row padding)
        runner = LocalRunner(str(tmp_path / dtype), progress=False, storage="image")
        if "portable" in runner.device.platform.name.lower():
            assert runner.allocated_bytes == memory[dtype]["device_peak"], dtype


def test_bad_precision_options_are_clear_errors(mlp_path) -> None:
    with pytest.raises(FblcError, match="unknown --dtype 'bf16'"):
        StoragePrecision("bf16")
    with pytest.raises(FblcError, match="--trainer es"):
        build_training_graph(load_model(mlp_path), TrainingOptions(trainer="es", loss_scale="dynamic"))
    with pytest.raises(FblcError, match="unknown --loss-scale"):
        build_training_graph(load_model(mlp_path), TrainingOptions(loss_scale="static"))


def _run(model: ir.Model, feeds: dict[str, np.ndarray], path: str) -> dict[str, np.ndarray]:
    ir.save(model, path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = {i.name for i in (*session.get_inputs(), *session.get_overridable_initializers())}
    initial = {v.name: v.const_value.numpy() for v in model.graph.inputs if v.const_value is not None}
    given = {**initial, **feeds}
    outputs = session.run(None, {k: v for k, v in given.items() if k in names})
    return dict(zip([o.name for o in session.get_outputs()], outputs))


def test_a_scaled_step_matches_the_unscaled_one_and_a_nonfinite_step_is_skipped(mlp_path, tmp_path) -> None:
    """onnxruntime on the step graph: the scaled backward gives the unscaled gradients and update,
    reports scale and skipped; an inf scale (gradients inf/NaN) leaves every state as it was and
    resets the good-step count; without the scale nothing of it is in the graph."""
    plain = build_training_graph(load_model(mlp_path), TrainingOptions(optimizer=ADAMW))
    scaled = build_training_graph(load_model(mlp_path), TrainingOptions(optimizer=ADAMW, loss_scale="dynamic"))
    assert "loss_scale" not in {v.name for v in plain.graph.inputs}
    feeds = _mlp_feeds(plain)
    reference = _run(plain, feeds, str(tmp_path / "plain.onnx"))
    result = _run(scaled, feeds, str(tmp_path / "scaled.onnx"))
    for name, value in reference.items():
        np.testing.assert_allclose(result[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    assert result["skipped"] == 0 and result["scale"] == INITIAL_SCALE
    assert result["loss_scale.new"] == INITIAL_SCALE and result["loss_scale.good_steps.new"] == 1
    state = {v.name: v.const_value.numpy() for v in scaled.graph.inputs if v.const_value is not None}
    state["loss_scale.good_steps"] = np.array(5, np.float32)
    skipped = _run(scaled, {**feeds, **state, "loss_scale": np.array(np.inf, np.float32)}, str(tmp_path / "skip.onnx"))
    assert skipped["skipped"] == 1 and skipped["loss_scale.good_steps.new"] == 0
    for name, value in state.items():
        if name.startswith("loss_scale"):
            continue
        np.testing.assert_array_equal(skipped[f"{name}.new"], value, err_msg=name)


def test_an_overflowing_scale_on_the_device_skips_the_step_and_halves(tmp_path) -> None:
    """On PoCL in fp16: a scale of 2^24 overflows the half activation gradients: the step is
    skipped, the parameters stay, the scale halves, until it fits; then the steps train."""
    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp_proto(), path)
    bundle = str(tmp_path / "bundle")
    compile_model(path, bundle, "adreno830", "fp16", TrainingOptions(optimizer=ADAMW))
    runner = LocalRunner(bundle, progress=False, storage="image")
    scale = next(s for s in runner.manifest["states"] if s["name"] == "loss_scale")
    runner.upload(scale["texture"], np.array([2.0**24], np.float32))
    before = runner.parameters()
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32),
             "labels": np.array([0, 2, 1, 2], np.int64)}
    runner.step(feeds)
    assert runner.metrics == {"skipped": 1.0, "scale": 2.0**24}
    for name, value in runner.parameters().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    runner.step(feeds)
    assert runner.metrics["scale"] == 2.0**23
    scales = []
    for _ in range(12):  # halving until the half gradients fit, then finite steps at that scale
        runner.step(feeds)
        scales.append(runner.metrics["scale"])
    assert runner.metrics["skipped"] == 0.0 and scales[-1] == scales[-2] < 2.0**23, scales
    assert any(not np.array_equal(value, before[name]) for name, value in runner.parameters().items())


def test_fuse_keeps_a_sum_over_many_gradients_within_the_read_image_limit(tmp_path) -> None:
    """A tree of scalar Adds over 300 inputs (the finite check over every parameter's gradient)
    would fuse into one kernel reading 300 images; each kernel reads at most READ_IMAGE_ARGS."""
    count = 300
    nodes, names = [], [f"x{i}" for i in range(count)]
    level = 0
    while len(names) > 1:
        pairs = []
        for i in range(0, len(names) - 1, 2):
            out = f"s{level}_{i}"
            nodes.append(helper.make_node("Add", [names[i], names[i + 1]], [out], name=out))
            pairs.append(out)
        names = pairs + names[len(names) - len(names) % 2:]
        level += 1
    model = make_model(nodes, [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in
                               (f"x{i}" for i in range(count))],
                       [helper.make_tensor_value_info(names[0], TensorProto.FLOAT, [])], {})
    step = InferShapes()(ir.serde.deserialize_model(model)).model
    FuseKernels()(step)
    reads: dict[str, set[str]] = {}
    made: dict[str, set[str]] = {}
    for node in step.graph:
        kernel = node.metadata_props[keys.KERNEL]
        reads.setdefault(kernel, set()).update(v.name for v in node.inputs)
        made.setdefault(kernel, set()).update(v.name for v in node.outputs)
    assert len(reads) > 1
    assert max(len(reads[k] - made[k]) for k in reads) <= READ_IMAGE_ARGS


# the CNN's 50 steps are under `-m slow` for the suite's time (33 s on a cold kernel cache); fp16 conv
# kernels have their own device tests (test_device_models' fp16 T-ResNet step, the fp16 contraction tests)
@pytest.mark.parametrize("arch,lr", [("gpt2", 3e-3), pytest.param("resnet", 1e-4, marks=pytest.mark.slow)])
def test_fp16_training_follows_fp32_for_50_adamw_steps(arch: str, lr: float, tmp_path) -> None:
    """The issue's divergence (fp16 NaN from step 8 on a tiny GPT-2 at lr 3e-3): with fp32 masters and
    a loss scale, 50 AdamW steps of a transformer and of a CNN end within 2 % of fp32's loss, and
    the loss fell."""
    model = zoo.build(zoo.BY_NAME[arch], str(tmp_path))
    feeds = {**model.inputs, "labels": model.labels}
    curves = {}
    for dtype in ("fp32", "fp16"):
        bundle = str(tmp_path / dtype)
        compile_model(model.path, bundle, "adreno830", dtype,
                      TrainingOptions(optimizer=OptimizerConfig("adamw", lr=lr, weight_decay=1e-2)))
        runner = LocalRunner(bundle, progress=False, storage="image")
        curves[dtype] = [float(runner.step(feeds)) for _ in range(50)]
    fp32, fp16 = curves["fp32"], curves["fp16"]
    assert np.all(np.isfinite(fp16)), fp16
    assert fp32[-1] < 0.6 * fp32[0]
    assert abs(fp16[-1] - fp32[-1]) <= 0.02 * fp32[-1], (fp16[-1], fp32[-1])
