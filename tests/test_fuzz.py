"""The fuzzer's seeded run (fblc/tools/fuzz.py), its generator, and the findings it made.

The CI run (CI_GRAPHS random graphs, those of CI_DEVICE_SEEDS also on the local OpenCL device in
their drawn modes, and CI_MUTATIONS broken files: the figures are stated there alone, and README's
sentence on it is checked against them); `python -m fblc.tools.fuzz --graphs 3000 ...` is the long run.
"""

from __future__ import annotations

import os
import re
import types

import numpy as np
import onnx
import pytest

from fblc.compiler.model_io import load_model
from fblc.errors import ModelLoadError
from fblc.tools import fuzz, mutations
from fblc.tools.random_graphs import random_graph

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


#: the CI run: 64 graphs and 300 broken files; 2 of the graphs also on the device, chosen so that each value of
#: the device modes (dtype, storage, layout) appears among them with an attention and a trained-BatchNorm graph
#: (the suite's time: seed 13 is fp32 image rtile with both, seed 16 fp16 buffer naive with a ConvTranspose; the 4
#: seeds before, 8 16 32 40, cost 8 CPU s more and covered no device mode more; every 8th graph cost twice that)
CI_GRAPHS, CI_MUTATIONS = 64, 300
CI_DEVICE_SEEDS = (13, 16)
#: what the generator must reach in the CI seed set: the op types the issue named among them
REQUIRED_OPS = ("Exp", "Log", "Pow", "Clip", "Cast", "Resize", "ConvTranspose", "Split", "Gather", "Softmax",
                "MatMul", "BatchNormalization", "Conv")
#: the MODES that matter only on the device, covered by the device graphs themselves
DEVICE_MODES = ("dtype", "storage", "layout")


def _ci_seeds(device: bool) -> list[int]:
    return [seed for seed in range(CI_GRAPHS) if not device or seed in CI_DEVICE_SEEDS]


def test_seeded_run_finds_nothing(tmp_path) -> None:
    summary = fuzz.fuzz(graphs=CI_GRAPHS, seed=0, device_every=0, mutations=CI_MUTATIONS, workdir=str(tmp_path),
                        device_seeds=CI_DEVICE_SEEDS)
    assert summary.graphs == CI_GRAPHS and summary.mutations == CI_MUTATIONS
    assert summary.device_graphs == len(_ci_seeds(device=True)) == len(CI_DEVICE_SEEDS)
    assert summary.findings == [], "\n".join(str(f) for f in summary.findings)


def test_ci_seed_set_covers_every_op_and_mode() -> None:
    """Computed from the CI run's graphs: every generator op (and the issue's list) appears, every MODES value
    in some graph, the device-only ones (dtype, storage, layout) among the device graphs; token graphs with a
    padding mask and attention over activations are among them."""
    graphs = {seed: fuzz.graph_of(seed) for seed in _ci_seeds(device=False)}
    used = set().union(*(graph.ops for graph in graphs.values()))
    assert set(REQUIRED_OPS) <= used, sorted(set(REQUIRED_OPS) - used)
    for device, names in ((False, [n for n in fuzz.MODES if n not in DEVICE_MODES]), (True, DEVICE_MODES)):
        drawn = [fuzz.draw_mode(seed) for seed in _ci_seeds(device)]
        for name in names:
            assert {mode[name] for mode in drawn} == set(fuzz.MODES[name]), (name, device)
    kinds = {spec.kind for graph in graphs.values() for spec in graph.inputs}
    assert kinds == {"float", "ids", "mask"}
    attention = [seed for seed, graph in graphs.items() if graph.ops.count("MatMul") >= 5 and "Softmax" in graph.ops]
    assert attention and set(attention) & set(_ci_seeds(device=True)), "no attention block (on the device)"
    trained_batchnorm = [seed for seed, graph in graphs.items()
                         if fuzz.draw_mode(seed)["batchnorm"] == "train" and "BatchNormalization" in graph.ops]
    assert trained_batchnorm and set(trained_batchnorm) & set(_ci_seeds(device=True))


def test_the_readme_states_the_ci_run_s_figures() -> None:
    """README's "CI runs N graphs (D on the device) and M broken files" is this module's CI run (it said
    300 and 400 while CI ran 200 and 300)."""
    text = " ".join(open(README, encoding="utf-8").read().split())
    stated = re.search(r"CI runs (\d+) graphs \((\d+) on the device\) and (\d+) broken files", text)
    assert stated, "README no longer states the fuzzer's CI run"
    assert tuple(map(int, stated.groups())) == (CI_GRAPHS, len(CI_DEVICE_SEEDS), CI_MUTATIONS)


def test_generated_graphs_are_valid_and_differ() -> None:
    graphs = [random_graph(seed) for seed in range(20)]
    for graph in graphs:
        onnx.checker.check_model(graph.model, full_check=True)
    assert len({graph.model.SerializeToString() for graph in graphs}) == 20
    assert random_graph(7).model.SerializeToString() == random_graph(7).model.SerializeToString()


def test_a_wrong_gradient_rule_is_found(monkeypatch, tmp_path) -> None:
    """Negative case: Tanh's gradient 5 % too large is a `gradient` finding in most graphs that use it."""
    from fblc.compiler.autodiff import GRADIENTS

    assert "Tanh" in GRADIENTS
    rule = GRADIENTS._entries["Tanh"]

    def five_percent_off(e, node, grads, needed):  # type: ignore[no-untyped-def]
        return [None if g is None else e.op("Mul", g, e.scalar(1.05, g)) for g in rule(e, node, grads, needed)]

    monkeypatch.setitem(GRADIENTS._entries, "Tanh", five_percent_off)
    seeds = [seed for seed in range(60) if "Tanh" in random_graph(seed).ops]
    stages = [[f.stage for f in fuzz.check_graph(seed, str(tmp_path))[1]] for seed in seeds]
    stages = [[stage for stage in found if not stage.startswith("mode")] for found in stages]
    # a Tanh on a side branch (a Concat's) moves the parameters' gradients by less than 1 %
    assert sum(found == ["gradient"] for found in stages) >= len(seeds) // 2, list(zip(seeds, stages))
    assert all(found in ([], ["gradient"]) for found in stages)


@pytest.mark.parametrize("findings", [0, 1, 10, 20])
def test_the_exit_code_is_1_when_any_finding_was_made(findings: int, monkeypatch, tmp_path, capsys) -> None:
    """Each of 10 graphs finds `findings` // 10 (or one graph finds one): 10 and 20 findings exit 1 too (the
    summary line "10 findings" contains "0 findings", which the exit code once looked for)."""
    per_graph = [[fuzz.Finding(seed, "gradient", "planted")] * (findings // 10) for seed in range(10)]
    if findings == 1:
        per_graph[3] = [fuzz.Finding(3, "gradient", "planted")]
    monkeypatch.setattr(fuzz, "check_graph",
                        lambda seed, workdir, device=False: (types.SimpleNamespace(ops=["Relu"]), per_graph[seed]))
    code = fuzz.main(["--graphs", "10", "--mutations", "0", "--device-every", "0", "--keep", str(tmp_path)])
    assert f"broken files: {findings} findings" in capsys.readouterr().out
    assert code == (1 if findings else 0)


@pytest.mark.parametrize("seed", [32, 8])  # CI device seeds: fp32, and fp16 (judged by the tensor's scale)
def test_a_wrong_device_value_is_found(seed: int, monkeypatch, tmp_path) -> None:
    """Negative case: one gradient read back from the device 2 % of its scale off is a `device` finding
    (the CI run built these kernels: cached)."""
    from fblc.runtime.local import LocalRunner

    read = LocalRunner.read_before_swap

    def off(self, name):  # type: ignore[no-untyped-def]
        value = read(self, name)
        return value + 0.02 * np.abs(value).max() + 0.01 if name.endswith(".grad") else value

    monkeypatch.setattr(LocalRunner, "read_before_swap", off)
    stages = [finding.stage for finding in fuzz.check_graph(seed, str(tmp_path), device=True)[1]]
    assert stages == [f"device ({fuzz.draw_mode(seed)['dtype']}, {fuzz.draw_mode(seed)['storage']}, "
                      f"{fuzz.draw_mode(seed)['layout']})"]


def _write(tmp_path, name: str, data: bytes) -> str:
    path = os.path.join(tmp_path, name)
    with open(path, "wb") as handle:
        handle.write(data)
    return path


def _two_relus() -> bytes:
    """x -> Relu (node 'first_node', output 'middle') -> Relu -> y, serialised."""
    nodes = [onnx.helper.make_node("Relu", ["x"], ["middle"], name="first_node"),
             onnx.helper.make_node("Relu", ["middle"], ["y"], name="second_node")]
    value = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2, 3]) for n in ("x", "y")]
    graph = onnx.helper.make_graph(nodes, "g", value[:1], value[1:])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)]).SerializeToString()


def test_finding_a_node_name_that_is_not_utf8_is_a_load_error(tmp_path) -> None:
    """Finding (flipped bytes, e.g. seed 205): a node name with non-UTF-8 bytes reached onnx_ir as bytes and
    crashed the shape inference's serialisation (SerdeError from ir.to_proto)."""
    path = _write(tmp_path, "name.onnx", _two_relus().replace(b"first_node", b"fir\x98t_node"))
    with pytest.raises(ModelLoadError, match="node name b'fir\\\\x98t_node' of a Relu node is not UTF-8"):
        load_model(path)


def test_finding_an_input_name_that_is_not_utf8_is_a_load_error(tmp_path) -> None:
    """Finding (flipped bytes, e.g. seeds 29, 157): onnx's checker raised UnicodeDecodeError on a node
    input name with non-UTF-8 bytes."""
    data = _two_relus()
    second = data.index(b"middle", data.index(b"middle") + 1)  # the second Relu's input, not the output
    path = _write(tmp_path, "input.onnx", data[:second] + b"mid\xa3le" + data[second + len(b"middle"):])
    with pytest.raises(ModelLoadError, match="not UTF-8"):
        load_model(path)


def test_finding_a_type_that_onnx_ir_cannot_read_is_a_load_error(tmp_path) -> None:
    """Finding (flipped bytes, seed 5765): an initializer of data type 54 passes onnx's checker, and
    onnx_ir's deserialisation raised SerdeError."""
    bias = onnx.numpy_helper.from_array(np.ones(3, np.float32), "bias")
    bias.data_type = 54
    values = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [3]) for n in ("x", "y")]
    graph = onnx.helper.make_graph([onnx.helper.make_node("Add", ["x", "bias"], ["y"], name="add")], "g",
                                   values[:1], values[1:], [bias])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    path = _write(tmp_path, "type.onnx", model.SerializeToString())
    with pytest.raises(ModelLoadError, match="54 is not a valid DataType"):
        load_model(path)


@pytest.mark.parametrize("kind", sorted(mutations.MUTATIONS))
def test_each_mutation_kind_gives_a_clear_error_or_a_step(kind: str, tmp_path) -> None:
    seed = sorted(mutations.MUTATIONS).index(kind)  # check_mutation picks the kind from the seed
    assert fuzz.check_mutation(seed, str(tmp_path)) == (kind, None)


def _upsampling_classifier(conv_transpose: bool) -> onnx.ModelProto:
    """x [2, 2, 3, 3] -> Conv (trainable) -> Resize x2 (nearest, its scales a float initializer) to [2, 2, 6, 6], or a
    trainable ConvTranspose (2 groups, strides [2, 1], dilations [1, 2], pads [1, 0, 0, 1], output_padding [1, 0])
    to [2, 2, 7, 6] -> Flatten -> Gemm to 3 classes."""
    rng = np.random.default_rng(0)
    features = 84 if conv_transpose else 72
    weights = {"w": rng.standard_normal((2, 2, 1, 1)), "fc": rng.standard_normal((3, features)) * 0.1}
    if conv_transpose:
        weights["up"] = rng.standard_normal((2, 1, 3, 3)) * 0.5
        upsample = onnx.helper.make_node("ConvTranspose", ["conv", "up"], ["big"], kernel_shape=[3, 3], strides=[2, 1],
                                         dilations=[1, 2], pads=[1, 0, 0, 1], output_padding=[1, 0], group=2)
    else:
        weights["scales"] = np.array([1, 1, 2, 2])
        upsample = onnx.helper.make_node("Resize", ["conv", "", "scales"], ["big"], mode="nearest")
    nodes = [onnx.helper.make_node("Conv", ["x", "w"], ["conv"]), upsample,
             onnx.helper.make_node("Flatten", ["big"], ["flat"]),
             onnx.helper.make_node("Gemm", ["flat", "fc"], ["logits"], transB=1)]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2, 3, 3])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])


def test_finding_a_resize_scales_initializer_is_a_constant(tmp_path) -> None:
    """Finding (seed 1 of the first extended generator, whose float constants were initializers): a Resize whose
    scales are a float initializer (tf2onnx's and torch's constant-folded exports) was refused, `op Resize (node
    ...) has no gradient for its input 2 ('scales'), which a trainable parameter feeds`: every float initializer
    was a parameter. One read only in Resize's roi/scales slots is a constant now (trainable.CONSTANT_SLOTS)."""
    from fblc.compiler import keys
    from fblc.passes.pipeline import build_training_graph

    path = _write(tmp_path, "resize.onnx", _upsampling_classifier(conv_transpose=False).SerializeToString())
    step = build_training_graph(load_model(path), fuzz.OPTIONS)
    params = {v.name for v in step.graph.inputs if keys.get_role(v) == "param"}
    assert params == {"w", "fc"}


def test_finding_a_trainable_conv_transpose_trains(tmp_path) -> None:
    """Finding (ConvTranspose added to the generator): fblc had no gradient rule for ConvTranspose, so a trainable
    one (a decoder's upsampling), or one between a parameter and the loss, was refused with `no gradient rule for
    op ConvTranspose`. Its rule (fblc/compiler/gradients/linalg.py) is the adjoint Conv; its gradients agree with
    finite differences of the float64 forward."""
    from fblc.compiler import keys
    from fblc.compiler.model_io import save_model_atomically
    from fblc.compiler.reference import run_model
    from fblc.passes.pipeline import build_training_graph

    model = _upsampling_classifier(conv_transpose=True)
    path = _write(tmp_path, "deconv.onnx", model.SerializeToString())
    step = build_training_graph(load_model(path), fuzz.OPTIONS)
    save_model_atomically(step, str(tmp_path / "step.onnx"))
    params = [v.name for v in step.graph.inputs if keys.get_role(v) == "param"]
    assert "up" in params
    rng = np.random.default_rng(1)
    feeds, labels = {"x": rng.standard_normal((2, 2, 3, 3)).astype(np.float32)}, np.array([0, 2])
    outputs = run_model(onnx.load(str(tmp_path / "step.onnx")), {**feeds, "labels": labels})
    forward = fuzz._Forward(model, params, feeds, labels)
    assert np.isclose(float(outputs["loss"]), forward(), rtol=fuzz.LOSS_RTOL)
    assert fuzz._gradient_error(forward, {p: outputs[f"{p}.grad"] for p in params}, rng) is None


def test_a_trainable_conv_transpose_steps_on_the_device(tmp_path) -> None:
    """The new rule's kernels (dX a grouped, dilated Conv of dY; dW the weight-gradient Conv with X and dY swapped)
    agree with onnxruntime on the local OpenCL device."""
    from fblc.tools.verify import verify_model

    path = _write(tmp_path, "deconv.onnx", _upsampling_classifier(conv_transpose=True).SerializeToString())
    rows = verify_model(path, fuzz.OPTIONS, target="adreno830", work_dir=str(tmp_path))
    assert "up.grad" in {row.name for row in rows} and all(row.ok for row in rows), [r for r in rows if not r.ok]


def test_finding_fp16_step_of_seed_80_compiles(tmp_path) -> None:
    """Fixed finding (device sweep, seed 80 of the d302c98 generator, fp16; rebuilt here node for node): FuseKernels
    made a cycle of kernels and compiling raised NetworkXUnfeasible. The fp16 step's elementwise backward chain
    (grad/log_12/Mul_47 ... optimizer/Mul_73) is one kernel; it feeds ReduceSum -> Reshape (single kernels), which
    feed optimizer/Mul_75, merged with optimizer/Reciprocal_72 whose output feeds optimizer/Mul_73 back in the first
    kernel. When Mul_75 merged with the Reciprocal's kernel, `_Groups.reaches_through_third` pruned the Reshape
    kernel (its last node, 48, before the source kernel's first, 68), but the source reaches it through the first
    kernel, which spans both. The check now prunes by kernel levels (test_passes.py has the pattern in six nodes)."""
    from fblc.codegen.compile import compile_model

    rng = np.random.default_rng(80)
    scalar = lambda name: onnx.numpy_helper.from_array(np.array(0.5 + rng.random(), np.float32), name)  # noqa: E731
    weights = [onnx.numpy_helper.from_array((rng.random((3, 6, 2, 4)) + 0.5).astype(np.float32), "p_0"),
               scalar("p_6"), scalar("p_10"),
               onnx.numpy_helper.from_array(rng.standard_normal((4, 48)).astype(np.float32) * 0.1, "p_14"),
               onnx.numpy_helper.from_array(np.zeros(4, np.float32), "p_15")]
    make = onnx.helper.make_node
    nodes = [make("Div", ["x", "p_0"], ["div_1"]), make("Tanh", ["div_1"], ["tanh_2"]),
             make("Exp", ["tanh_2"], ["exp_3"]),
             make("Constant", [], ["c_4"], value=onnx.numpy_helper.from_array(np.array(1.5, np.float32), "c_4")),
             make("Mul", ["exp_3", "exp_3"], ["mul_5"]), make("Add", ["mul_5", "p_6"], ["add_7"]),
             make("Pow", ["add_7", "c_4"], ["pow_8"]), make("Mul", ["pow_8", "pow_8"], ["mul_9"]),
             make("Add", ["mul_9", "p_10"], ["add_11"]), make("Log", ["add_11"], ["log_12"]),
             make("Flatten", ["log_12"], ["flatten_13"], axis=1),
             make("Gemm", ["flatten_13", "p_14", "p_15"], ["gemm_16"], transB=1)]
    graph = onnx.helper.make_graph(
        nodes, "seed80", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 6, 2, 4])],
        [onnx.helper.make_tensor_value_info("gemm_16", onnx.TensorProto.FLOAT, [3, 4])], weights)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    path = _write(tmp_path, "seed80.onnx", model.SerializeToString())
    compile_model(path, str(tmp_path / "bundle"), "adreno830", "fp16", fuzz.replace(fuzz.OPTIONS, dtype="fp16"))


#: graphs of the generator as of d302c98 whose fp16 device steps were findings: file, seed, its input's shape, classes
FP16_FINDINGS = {"backprop": ("seed16_fura_s_fp16.onnx", 16, (3, 6, 2, 5), 3),
                 "es": ("seed68_memflora_es_fp16.onnx", 68, (2, 3, 5, 6), 4)}


def _kept_finding_error(name: str, seed: int, shape: tuple[int, ...], classes: int, tmp_path) -> str | None:
    """The device stage of kept graph `name` under seed `seed`'s mode, on check_graph's feeds of that seed."""
    path = os.path.join(os.path.dirname(__file__), "support", "fuzz_findings", name)
    mode = fuzz.draw_mode(seed)
    rng = np.random.default_rng(seed + 1_000_003)
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "labels": rng.integers(0, classes, shape[0]).astype(np.int64)}
    return fuzz._device_error(path, fuzz.mode_options(mode), mode, feeds, str(tmp_path))


@pytest.mark.parametrize("trainer", sorted(FP16_FINDINGS))
def test_finding_fp16_outputs_are_judged_by_their_scale(trainer: str, tmp_path) -> None:
    """Findings of a device sweep (every 4th of seeds 0-159), kept in tests/support/fuzz_findings: fp16 outputs
    judged elementwise (fblc verify's 1e-2) failed where half rounding moves a small element by a fraction of
    its tensor's scale. Seed 16 (FuRA-S backprop, buffer): fura_s.delta.grad off by 0.0017 on -0.032 beside
    1.04. Seed 68 (a Conv, two ConvTransposes, Pow 3; MemFLoRA ES, buffer): the ES estimate off by 0.0017 of its
    0.025 scale, since half activations round the member losses (5.6725 for 5.6675) by about the sigma |g|
    they differ by. Each now agrees within FP16_SCALED_TOLERANCE[trainer] (and fails the tighter one)."""
    name, seed, shape, classes = FP16_FINDINGS[trainer]
    assert (fuzz.draw_mode(seed)["trainer"], fuzz.draw_mode(seed)["dtype"]) == (trainer, "fp16")
    assert _kept_finding_error(name, seed, shape, classes, tmp_path) is None


def test_finding_fp16_scalar_gradient_through_log_and_layer_norm(tmp_path) -> None:
    """Finding (device sweep, seed 276; BatchNorm, Max, BatchNorm, Transpose, Log(x * x + c), LayerNorm,
    Softmax; backprop fp16, buffer storage, rtile): the gradient of the scalar c, a sum of 441 terms that
    LayerNorm's gradient (orthogonal to a shift of its row) nearly cancels, read -0.0320 on the device for
    -0.0074. Cause: half storage of the row statistics (LayerNorm's mean, the backward's row means), whose
    rounding shifts a whole row at once (onnxruntime with only the half textures rounded gave -0.0301;
    PoCL computes in float); storage_precision now keeps statistics in fp32: -0.0070, within tolerance.
    Left, and not a fault: p_18.new, the Adam step of LayerNorm's bias p_18, whose gradient is exactly zero
    (the Softmax runs along an axis the bias is constant on): Adam scales its rounding noise (half's 1e-5,
    fp32's 1e-9, against eps 1e-8) to a step of lr with either sign."""
    assert (fuzz.draw_mode(276)["trainer"], fuzz.draw_mode(276)["dtype"]) == ("backprop", "fp16")
    error = _kept_finding_error("seed276_log_layernorm_fp16.onnx", 276, (3, 7, 3, 7), 5, tmp_path)
    assert error is not None and error.startswith("1 of 50 outputs differ") and "worst 'p_18.new'" in error, error
