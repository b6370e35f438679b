"""Apache TVM as the third numeric reference (fblc/baselines): the same ONNX step through TVM's CPU build
equals onnxruntime's (and fblc's device step), every output within fblc.tools.verify's fp32 tolerance.

The rewrites that make TVM import a step correctly are checked on onnxruntime one by one; a
disagreement is bisected to the first differing node, and a failed build to the first failing one.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.baselines import tvm_rewrites
from fblc.baselines.opencl_kernels import count_kernels, kernels
from fblc.baselines.tvm_rewrites import CPU_TARGET, OPENCL_TARGET, check_rewrites, prepare
from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optimizers import OptimizerConfig
from fblc.compiler.reference import ReferenceStep
from fblc.errors import FblcError
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from tests.support import models, zoo

if importlib.util.find_spec("tvm") is None:
    if os.environ.get("FBLC_CI") == "1":
        raise RuntimeError("apache-tvm is missing (FBLC_CI=1: the README's test command installs '.[test,tvm]')")
    pytest.skip("apache-tvm is missing: pip install -e '.[tvm]'", allow_module_level=True)

from fblc.baselines import tvm  # noqa: E402  (after the skip: it needs the extra)

ADAMW = TrainingOptions(optimizer=OptimizerConfig("adamw", lr=1e-3))


BUILDERS = {"mlp": models.mlp, "tresnet": models.tresnet, "llama": lambda d: models.llama(d)[0],
            "resnet": models.resnet_legacy, "gpt2": lambda d: zoo.build(zoo.BY_NAME["gpt2"], d),
            "mobilenet_v2": models.mobilenet_v2}
#: the rewrites each model's step needs on TVM's CPU target
CPU_REWRITES = {"mlp": set(), "tresnet": set(), "llama": {"Constant"}, "resnet": {"MaxPool"},
                "gpt2": {"LayerNormalization"}, "mobilenet_v2": set()}


def _step(name: str, directory: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, np.ndarray]]:
    exported = BUILDERS[name](directory)
    step = build_training_graph(load_model(exported.path), ADAMW)
    path = os.path.join(directory, f"{name}_step.onnx")
    save_model_atomically(step, path)
    feeds = {**exported.inputs, "labels": exported.labels}
    reference = ReferenceStep(path)
    reference.step(dict(feeds))
    return onnx.load(path), feeds, reference.last


#: under `-m slow` for the suite's time: T-ResNet's convs need no rewrite, so the ResNet zoo export (convs
#: and the MaxPool rewrite) covers them; MobileNetV2 is the largest step; the Llama decoder's step covers
#: GPT-2's rewrites (LayerNormalization's is checked on its own below); the MLP's TVM step is checked
#: against fblc's device step (test_three_references_agree_on_the_mlp), which matches onnxruntime's
SLOW_ON_TVM = ("tresnet", "mobilenet_v2", "gpt2", "mlp")


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_ON_TVM else [])
                                  for name in BUILDERS])
def test_tvm_step_equals_onnxruntime(name: str, tmp_path) -> None:
    step, feeds, expected = _step(name, str(tmp_path))
    comparison = tvm.compare_step(step, feeds, expected)
    assert comparison.ok, [str(comparison.difference)] + [r.name for r in comparison.rows if not r.ok]
    assert len(comparison.rows) == len(step.graph.output)
    assert {r.op_type for r in comparison.rewrites} == CPU_REWRITES[name]
    assert check_rewrites(step, CPU_TARGET, feeds) == comparison.rewrites


def test_three_references_agree_on_the_mlp(tmp_path) -> None:
    """TVM's CPU step against fblc's device step of the same bundle (onnxruntime's is the test above,
    under -m slow for the MLP; test_device_models checks the device step against onnxruntime)."""
    from fblc.codegen.compile import compile_model
    from fblc.runtime.local import LocalRunner
    from fblc.tools.verify import compare

    exported = models.mlp(str(tmp_path))
    step, _ = compile_model(exported.path, str(tmp_path / "bundle"), "adreno830", "fp32", ADAMW)
    feeds = {**exported.inputs, "labels": exported.labels}
    runner = LocalRunner(str(tmp_path / "bundle"), storage="image")
    runner.step(feeds)
    path = str(tmp_path / "step.onnx")
    save_model_atomically(step, path)
    got = tvm.run_on_cpu(onnx.load(path), feeds).outputs
    rows = compare({name: runner.read_before_swap(name) for name in got}, got, "fp32")
    assert len(rows) > 20 and all(row.ok for row in rows), [r for r in rows if not r.ok]


def test_a_wrong_import_is_bisected_to_its_node(monkeypatch, tmp_path) -> None:
    """Negative case: without the LayerNorm rewrite TVM imports only Y and the gradients differ; the
    bisection names the LayerNormalization node."""
    rng = np.random.default_rng(4)
    inits = {"scale": rng.uniform(0.5, 1.5, 6).astype(np.float32), "bias": rng.standard_normal(6).astype(np.float32),
             "weight": rng.standard_normal((3, 6)).astype(np.float32)}
    nodes = [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["normed"], name="norm"),
             helper.make_node("Gemm", ["normed", "weight"], ["logits"], name="head", transB=1)]
    path = str(tmp_path / "norm.onnx")
    onnx.save(_model(nodes, {"x": [4, 6]}, {"logits": (TensorProto.FLOAT, [4, 3])}, inits), path)
    step_path = str(tmp_path / "step.onnx")
    save_model_atomically(build_training_graph(load_model(path), ADAMW), step_path)
    feeds = {"x": rng.standard_normal((4, 6)).astype(np.float32), "labels": np.array([0, 2, 1, 2], np.int64)}
    reference = ReferenceStep(step_path)
    reference.step(dict(feeds))
    step = onnx.load(step_path)
    assert tvm.compare_step(step, feeds, reference.last).ok  # with the rewrite
    monkeypatch.delitem(tvm_rewrites.REWRITES, "LayerNormalization")
    comparison = tvm.compare_step(step, feeds, reference.last)
    assert not comparison.ok and comparison.difference is not None
    assert (comparison.difference.node.op_type, comparison.difference.node.name) == ("LayerNormalization", "norm")


def _model(nodes: list[onnx.NodeProto], inputs: dict[str, list[int]], outputs: dict[str, tuple[int, list[int]]],
           initializers: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()],
        [helper.make_tensor_value_info(k, t, s) for k, (t, s) in outputs.items()],
        [numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_failed_build_is_bisected_to_its_node(monkeypatch) -> None:
    """Negative case: TVM's importer cannot give MaxPool's Indices; without the rewrite the build fails
    and the error names the MaxPool node."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["y", "i"], name="pool", kernel_shape=[2, 2], strides=[2, 2])]
    model = _model(nodes, {"x": [1, 2, 4, 4]}, {"y": (TensorProto.FLOAT, [1, 2, 2, 2]),
                                                 "i": (TensorProto.INT64, [1, 2, 2, 2])})
    monkeypatch.delitem(tvm_rewrites.REWRITES, "MaxPool")
    with pytest.raises(tvm.TvmBuildError, match="first failing node 'pool' \\(MaxPool"):
        tvm.run_on_cpu(model, {"x": np.zeros((1, 2, 4, 4), np.float32)})


def _tiny_step(directory: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The AdamW step of one Gemm (4 samples, 6 features, 3 classes): few fused kernels to tune."""
    rng = np.random.default_rng(5)
    head = helper.make_node("Gemm", ["x", "weight"], ["logits"], name="head", transB=1)
    path = os.path.join(directory, "gemm.onnx")
    onnx.save(_model([head], {"x": [4, 6]}, {"logits": (TensorProto.FLOAT, [4, 3])},
                     {"weight": rng.standard_normal((3, 6)).astype(np.float32)}), path)
    step_path = os.path.join(directory, "step.onnx")
    save_model_atomically(build_training_graph(load_model(path), ADAMW), step_path)
    feeds = {"x": rng.standard_normal((4, 6)).astype(np.float32), "labels": np.array([0, 2, 1, 2], np.int64)}
    reference = ReferenceStep(step_path)
    reference.step(dict(feeds))
    return onnx.load(step_path), feeds, reference.last


@pytest.mark.slow  # MetaSchedule's start alone (its tensor intrinsics) takes about 40 s on 2 cores
def test_tuned_step_equals_onnxruntime_and_its_records_are_reused(tmp_path) -> None:
    from fblc.tools.verify import compare

    step, feeds, expected = _tiny_step(str(tmp_path))
    cache = str(tmp_path / "records")
    first = tvm.run_tuned_on_cpu(step, feeds, trials_per_task=1, cache=cache)
    rows = compare(first.outputs, {k: v for k, v in expected.items() if k in first.outputs}, "fp32")
    assert len(rows) == len(step.graph.output) and all(row.ok for row in rows), [r for r in rows if not r.ok]
    assert not first.cached and first.tasks > 0 and first.trials_per_task == 1
    assert os.listdir(cache) == [os.path.basename(first.records)]  # the staging folder moved into place
    again = tvm.run_tuned_on_cpu(step, feeds, trials_per_task=1, cache=cache)
    assert again.cached and again.records == first.records and again.tuning_s == first.tuning_s
    assert all(np.array_equal(again.outputs[k], first.outputs[k]) for k in first.outputs)


def test_a_tuning_budget_of_no_trials_is_refused() -> None:
    with pytest.raises(FblcError, match="budget of 0 trials per task tunes nothing"):
        tvm.run_tuned_on_cpu(onnx.ModelProto(), {}, trials_per_task=0)


# --- each rewrite equals the op it replaces, on onnxruntime (no TVM needed) ------------------------

def _check(model: onnx.ModelProto, target: str, feeds: dict[str, np.ndarray], op_type: str) -> None:
    onnx.checker.check_model(model, full_check=True)
    applied = check_rewrites(model, target, feeds)
    assert [a.op_type for a in applied] == [op_type]
    assert op_type not in {n.op_type for n in prepare(model, target)[0].graph.node}


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_rewrite_gives_y_mean_and_inverse_std(bias: bool) -> None:
    rng = np.random.default_rng(0)
    inits = {"scale": rng.standard_normal(6).astype(np.float32), "bias": rng.standard_normal(6).astype(np.float32)}
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"][:3 if bias else 2], ["y", "mean", "inv"],
                            name="ln", axis=-1, epsilon=1e-3)
    out = {"y": (TensorProto.FLOAT, [2, 3, 6]), "mean": (TensorProto.FLOAT, [2, 3, 1]),
           "inv": (TensorProto.FLOAT, [2, 3, 1])}
    model = _model([node], {"x": [2, 3, 6]}, out, inits)
    _check(model, CPU_TARGET, {"x": rng.standard_normal((2, 3, 6)).astype(np.float32)}, "LayerNormalization")


@pytest.mark.parametrize("kernel,stride,pad,dilation", [(2, 2, 0, 1), (3, 1, 1, 1), (3, 2, 1, 2), (2, 1, 0, 1)])
def test_max_pool_rewrite_gives_onnxruntimes_indices(kernel: int, stride: int, pad: int, dilation: int) -> None:
    x = np.random.default_rng(1).integers(-3, 3, (2, 3, 7, 6)).astype(np.float32)  # ties: the first wins
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], name="pool", kernel_shape=[kernel] * 2,
                            strides=[stride] * 2, pads=[pad] * 4, dilations=[dilation] * 2)
    size = [(d + 2 * pad - (kernel - 1) * dilation - 1) // stride + 1 for d in (7, 6)]
    model = _model([node], {"x": [2, 3, 7, 6]}, {"y": (TensorProto.FLOAT, [2, 3, *size]),
                                                  "i": (TensorProto.INT64, [2, 3, *size])})
    _check(model, CPU_TARGET, {"x": x}, "MaxPool")


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_add_rewrite_sums_repeated_and_negative_indices(axis: int) -> None:
    rng = np.random.default_rng(2)
    shape, index_shape = [4, 5], [4, 5]
    index_shape[axis] = 7
    indices = rng.integers(-shape[axis], shape[axis], index_shape).astype(np.int64)
    node = helper.make_node("ScatterElements", ["data", "idx", "upd"], ["y"], name="scatter", axis=axis,
                            reduction="add")
    model = _model([node], {"data": shape, "upd": index_shape}, {"y": (TensorProto.FLOAT, shape)}, {"idx": indices})
    feeds = {"data": rng.standard_normal(shape).astype(np.float32),
             "upd": rng.standard_normal(index_shape).astype(np.float32)}
    _check(model, OPENCL_TARGET, feeds, "ScatterElements")


def test_sum_max_and_constant_rewrites() -> None:
    rng = np.random.default_rng(3)
    feeds = {k: rng.standard_normal((2, 3)).astype(np.float32) for k in "abc"}
    total = helper.make_node("Sum", ["a", "b", "c"], ["y"], name="sum")
    _check(_model([total], {k: [2, 3] for k in "abc"}, {"y": (TensorProto.FLOAT, [2, 3])}), OPENCL_TARGET, feeds, "Sum")
    larger = helper.make_node("Max", ["a", "b"], ["y"], name="max")
    larger_model = _model([larger], {"a": [2, 3], "b": [2, 3]}, {"y": (TensorProto.FLOAT, [2, 3])})
    _check(larger_model, OPENCL_TARGET, feeds, "Max")
    shape = helper.make_node("Constant", [], ["s"], name="shape", value_ints=[3, 2])
    reshaped = helper.make_node("Reshape", ["a", "s"], ["y"], name="reshape")
    model = _model([shape, reshaped], {"a": [2, 3]}, {"y": (TensorProto.FLOAT, [3, 2])})
    applied = check_rewrites(model, CPU_TARGET, feeds)
    assert [a.op_type for a in applied] == ["Constant"]


def test_kernel_counts_read_definitions_textures_and_movement() -> None:
    source = """
__kernel void fused_reshape3_transpose2_kernel(__global float* restrict a, __global float* restrict b);
__kernel void fused_reshape3_transpose2_kernel(__global float* restrict a, __global float* restrict b) { }
__kernel void matmul2_kernel(__global float* a, __global float* b) { }
__kernel void k7_Transpose(__read_only image2d_t x, __write_only image2d_t y) { }
__kernel void k8_Gemm(__read_only image2d_t x, __read_only image2d_t w, __write_only image2d_t y) { }
__kernel void fused_transpose_relu_kernel(__global float* a) { }
__kernel void k9_Conv(write_only image2d_t out0, read_only image2d_t in0 TRACE_PARAM) { }
"""
    assert [k.name for k in kernels(source)][:2] == ["fused_reshape3_transpose2_kernel", "matmul2_kernel"]
    assert kernels(source)[-1].arguments == ("write_only image2d_t out0", "read_only image2d_t in0 TRACE_PARAM")
    counts = count_kernels(source)
    assert (counts.kernels, counts.data_movement, counts.with_textures) == (6, 2, 3)


def test_planned_storage_counts_buffers_in_bytes_and_textures_in_texels() -> None:
    script = ('storage = R.vm.alloc_storage(R.shape([512]), 0, R.dtype("uint8"), R.str("global"))\n'
              'texture = R.vm.alloc_storage(R.shape([4, 8, 4]), 0, R.dtype("float16"), R.str("global.texture"))')
    assert tvm._storage_bytes(script) == 512 + 4 * 8 * 4 * 2
