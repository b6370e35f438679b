"""LoRA at linear layers (pass memory_floor, `--adapter lora` on MatMul/Gemm sites) and ES over its factors.

y = x W (+ b) + (x A) B with A [in, r] random, B [r, out] zero, W frozen. References: onnxruntime on
the original model (at init the adapted model is the model), PyTorch autograd on the same layers with
the LoRA branch written out (torch.nn.Linear forward hooks, or the MLP by hand), and a numpy ES update
from the rewards the step reports.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F

from fblc.cli import main
from fblc.codegen.compile import compile_model
from fblc.compiler.adapters import AdapterConfig
from fblc.compiler.es import EsConfig
from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optional_state import input_defaults
from fblc.compiler.optimizers import OptimizerConfig
from fblc.compiler.reference import ReferenceStep, onnxruntime_session
from fblc.errors import FblcError
from fblc.passes.memory_floor import MemoryFloor
from fblc.passes.pipeline import TrainingOptions, build_training_graph, import_passes, run_passes
from fblc.runtime.local import LocalRunner
from fblc.tools.verify import reference_graph
from fblc.compiler import keys
from support import models
from tests.conftest import make_model, mlp_proto

SGD = OptimizerConfig("sgd", lr=0.1)


def _session(model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run_step(step: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of the step; `feeds` may override its parameters (initializers that are also inputs)."""
    session = onnxruntime_session(step)
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _exported(name: str, directory: str) -> models.ExportedModel:
    return models.mlp(directory) if name == "mlp" else models.llama(directory)[name == "llama_opt"]


def _lora_sites(model: ir.Model) -> list[dict]:
    return json.loads(model.metadata_props[keys.ADAPTER])["sites"]


# the dynamo exports read their Linear weights through Transpose (llama) or pre-transposed (llama_opt)
@pytest.mark.parametrize("name, count", [("mlp", 3), ("llama", 15), ("llama_opt", 15)])
def test_the_adapted_model_at_init_is_the_model(tmp_path_factory, name, count) -> None:
    exported = _exported(name, str(tmp_path_factory.mktemp("lora_models")))
    base = run_passes(load_model(exported.path), import_passes(TrainingOptions()))
    expected = _session(base).run(None, exported.inputs)[0]
    adapted = run_passes(load_model(exported.path), import_passes(TrainingOptions()))
    assert MemoryFloor(AdapterConfig("lora", rank=2, seed=1))(adapted).modified
    sites = _lora_sites(adapted)
    assert len(sites) == count and all(s["kind"] == "linear" for s in sites)
    for site in sites:
        a, b = (adapted.graph.initializers[site[k]].const_value.numpy() for k in ("P", "U"))
        assert a.shape == (site["c_in"], 2) and b.shape == (2, site["c_out"]) and not b.any() and a.std() > 0.3
    np.testing.assert_allclose(_session(adapted).run(None, exported.inputs)[0], expected, rtol=1e-5, atol=1e-5)


def _factors(step: ir.Model, seed: int) -> dict[str, np.ndarray]:
    """Every LoRA factor of the step at a random value: B nonzero, so that A has a gradient too."""
    rng = np.random.default_rng(seed)
    values = {}
    for site in _lora_sites(step):
        a = step.graph.initializers[site["P"]].const_value.numpy()
        values[site["P"]] = a
        values[site["U"]] = rng.normal(0, 0.05, (a.shape[1], site["c_out"])).astype(np.float32)
    return values


def _torch_mlp(module: models.TorchMLP, factors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """examples/mlp.py with every layer y = x W^T + b + (x A) B (Gemm layers) or x W + b + (x A) B."""
    for index, (layer, uses_gemm) in enumerate(zip(module.layers, module.gemm)):
        y = F.linear(x, layer.weight, layer.bias) if uses_gemm else x @ layer.weight + layer.bias
        x = y + (x @ factors[f"layers.{index}.adapter_A"]) @ factors[f"layers.{index}.adapter_B"]
        if index < len(module.layers) - 1:
            x = torch.relu(x)
    return x


def _torch_loss(exported: models.ExportedModel, step: ir.Model, factors: dict[str, torch.Tensor]) -> torch.Tensor:
    module = copy.deepcopy(exported.module).eval()
    for p in module.parameters():
        p.requires_grad_(False)
    if exported.name == "mlp":
        logits = _torch_mlp(module, factors, torch.from_numpy(exported.inputs["x"]))
        return F.cross_entropy(logits, torch.from_numpy(exported.labels), ignore_index=models.IGNORE_INDEX)
    layers = dict(module.named_modules())
    for site in _lora_sites(step):  # the export keeps torch's parameter names: <module>.weight
        a, b = factors[site["P"]], factors[site["U"]]
        layers[site["weight"][: -len(".weight")]].register_forward_hook(
            lambda _, inputs, output, a=a, b=b: output + (inputs[0] @ a) @ b)
    return exported.loss_of(module)


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_the_backprop_step_gives_pytorchs_gradients_of_a_and_b(tmp_path_factory, name) -> None:
    exported = _exported(name, str(tmp_path_factory.mktemp("lora_models")))
    step = build_training_graph(load_model(exported.path), TrainingOptions(
        input_shapes=exported.input_shapes, optimizer=SGD, adapter=AdapterConfig("lora", rank=2)))
    trained = sorted(v.name for v in step.graph.inputs if keys.get_role(v) == "param")
    factors = _factors(step, seed=4)
    assert trained == sorted(factors)  # A and B of every linear layer train, nothing else
    got = _run_step(ir.to_proto(step), {**exported.inputs, "labels": exported.labels, **factors})
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in factors.items()}
    loss = _torch_loss(exported, step, tensors)
    loss.backward()
    assert float(got["loss"]) == pytest.approx(loss.item(), rel=1e-5)
    for key, tensor in tensors.items():
        want = tensor.grad.numpy()
        assert np.abs(want).max() > 0, key
        # fp32 both sides, different summation orders: 1e-4 relative, and 3e-5 of the tensor's largest
        # gradient for its near-zero elements (a Llama gradient spans orders of magnitude; measured: 7e-6)
        np.testing.assert_allclose(got[f"{key}.grad"], want, rtol=1e-4, atol=3e-5 * np.abs(want).max(), err_msg=key)
        np.testing.assert_allclose(got[f"{key}.new"], factors[key] - 0.1 * want, rtol=1e-4, atol=1e-6, err_msg=key)


def test_es_over_lora_builds_and_its_onnx_step_moves_b(tmp_path, capsys) -> None:
    """`--trainer es --adapter lora`: one step on onnxruntime from noise we give it, whose update is the numpy
    ES update of the rewards the step reports (z-scores, antithetic direction, lr * sigma); the bundle's first
    step on the device equals the ONNX step."""
    exported = models.mlp(str(tmp_path))
    pairs, sigma, lr = 3, 0.05, 1.0
    out = str(tmp_path / "step.onnx")
    assert main(["train-graph", exported.path, "-o", out, "--trainer", "es", "--adapter", "lora", "--pairs", str(pairs),
                 "--sigma", str(sigma), "--lr", str(lr)]) == 0
    capsys.readouterr()
    step = onnx.load(out)
    params = [i for i in step.graph.input if i.name.endswith(("adapter_A", "adapter_B"))]  # in input order
    names = {p.name for p in params}
    initial = {name: value for name, value in input_defaults(step).items() if name in names}
    width = sum(v.size for v in initial.values())
    noise = np.random.default_rng(6).standard_normal((pairs, width)).astype(np.float32)
    got = _run_step(step, {**exported.inputs, "labels": exported.labels, "noise": noise})
    rewards = got["rewards"]
    assert rewards.shape == (2 * pairs,) and np.all(np.isfinite(rewards)) and rewards.std() > 1e-4
    z = (rewards.astype(np.float64) - rewards.mean()) / rewards.std()
    direction = ((z[:pairs] - z[pairs:]) @ noise.astype(np.float64)) / (2 * pairs)
    offset = 0
    for param in params:  # noise columns follow the parameters in input order
        size = initial[param.name].size
        moved = got[f"{param.name}.new"] - initial[param.name]
        np.testing.assert_allclose(moved.reshape(-1), lr * sigma * direction[offset:offset + size], rtol=1e-3,
                                   atol=1e-6, err_msg=param.name)
        offset += size
        if param.name.endswith("adapter_B"):
            assert np.abs(got[f"{param.name}.new"]).max() > 1e-3, param.name  # B leaves zero
    options = TrainingOptions(trainer="es", adapter=AdapterConfig("lora", rank=2),
                              es=EsConfig(pairs=pairs, sigma=sigma), optimizer=OptimizerConfig("sgd", lr=lr))
    compiled, report = compile_model(exported.path, str(tmp_path / "bundle"), "adreno830", "fp32", options)
    assert report["memory"]["adapter"]["sites"][0]["kind"] == "linear"
    assert {t["name"] for t in report["trained"]["tensors"]} == set(initial)
    # the bundle on the device: one step equals the ONNX step fed the same Philox noise (fp32, as the FuRA-S test)
    save_model_atomically(reference_graph(compiled, exported.path, options), str(tmp_path / "reference.onnx"))
    reference, runner = ReferenceStep(str(tmp_path / "reference.onnx")), LocalRunner(str(tmp_path / "bundle"),
                                                                                    progress=False, storage="image")
    feeds = {**exported.inputs, "labels": exported.labels}
    assert runner.step(feeds) == pytest.approx(reference.step(feeds), rel=1e-5)
    np.testing.assert_allclose(runner.read("rewards"), reference.last["rewards"], rtol=1e-5)
    for name, update in reference.parameters().items():  # z-scores scale last-bit reward differences up
        np.testing.assert_allclose(runner.parameters()[name], update, atol=1e-3 * np.abs(update - initial[name]).max(),
                                   err_msg=name)


def _conv_classifier(path: str) -> str:
    """x [2, 3, 6, 5] -> Conv 3x3 -> Relu -> GlobalAveragePool -> Flatten -> Gemm (transB) -> logits [2, 5]."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "conv.weight"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc")]
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 5])],
                         [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 5])],
                         {"conv.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
                          "fc.weight": rng.standard_normal((5, 4)).astype(np.float32),
                          "fc.bias": np.zeros(5, np.float32)}), path)
    return path


def test_a_cnn_keeps_conv_lora_and_adapter_sites_linear_takes_the_classifier(tmp_path) -> None:
    path = _conv_classifier(str(tmp_path / "cnn.onnx"))
    chosen = {}
    for sites in ("auto", "linear"):
        model = run_passes(load_model(path), import_passes(TrainingOptions()))
        MemoryFloor(AdapterConfig("lora", rank=2, sites=sites))(model)
        chosen[sites] = [(s["kind"], s["conv"]) for s in _lora_sites(model)]
    assert chosen == {"auto": [("conv", "conv")], "linear": [("linear", "fc")]}


def test_check_says_lora_applies_to_an_mlp(mlp_path, capsys) -> None:
    assert main(["check", mlp_path]) == 0
    stdout = capsys.readouterr().out
    assert "lora: yes - 2 linear sites" in stdout and "memflora: no - no Conv with groups == 1" in stdout


@pytest.mark.parametrize("args, message", [
    (["--adapter", "lora", "--rank", "7"], "--rank 7 is larger than the features of every one of the 2 adapter sites: "
                                           "linear layer 'fc1' (weight 'w1': 6 in, 8 out), linear layer 'fc2' "
                                           "(weight 'w2': 8 in, 3 out); use --rank 6 or less"),
    (["--adapter", "memflora", "--adapter-sites", "linear"], "--adapter-sites linear is given with --adapter memflora"),
])
def test_bad_linear_lora_options_are_one_clear_error(mlp_path, tmp_path, capsys, args, message) -> None:
    out = str(tmp_path / "step.onnx")
    assert main(["train-graph", mlp_path, "-o", out, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "internal error" not in err
    assert not os.path.exists(out)


def test_rank_error_names_the_layer_and_the_largest_rank_and_no_site_is_an_error(tmp_path) -> None:
    from tests.test_runtime import elementwise_model

    model = run_passes(ir.from_proto(mlp_proto()), import_passes(TrainingOptions()))
    with pytest.raises(FblcError, match=r"linear layer 'fc2'.*use --rank 6 or less"):  # fc1 fits up to 6
        MemoryFloor(AdapterConfig("lora", rank=7))(model)
    model = run_passes(load_model(elementwise_model(str(tmp_path / "m.onnx"))), import_passes(TrainingOptions()))
    with pytest.raises(FblcError, match="--adapter lora found no eligible site.*no MatMul/Gemm"):
        MemoryFloor(AdapterConfig("lora", rank=2))(model)
