"""Forward-only training: the FuRA-S adapter (pass fura_s), the ES step (pass es_gradients) and its
device form (pass es_noise, the PhiloxNormal kernel).

References: onnxruntime on the original model, on the model with explicitly recomposed weights
W'_k = L_k diag(s_k (1 + delta_k)) R_k^T (numpy's SVD, not fblc's), a numpy ES update from
rewards that onnxruntime computes member by member, and Random123's Philox known answers.
"""

from __future__ import annotations

import json
from dataclasses import replace
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from fblc.cli import main
from fblc.compiler import keys
from fblc.codegen.compile import compile_model
from fblc.compiler.adapters import AdapterConfig
from fblc.compiler.es import EsConfig
from fblc.compiler.fura_s import DELTA
from fblc.compiler.losses import IGNORE_INDEX
from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optimizers import OptimizerConfig
from fblc.compiler.quantize import WeightFormat
from fblc.compiler.philox import es_noise, philox4x32
from fblc.compiler.reference import ReferenceStep
from fblc.passes.fura_s import FuraS
from fblc.passes.pipeline import TrainingOptions, build_training_graph, import_passes, run_passes
from fblc.runtime.local import LocalRunner
from fblc.tools.verify import reference_graph
from support import models

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from mlp import build_mlp  # noqa: E402

BLOCK = 8


def _session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _adapted(path: str, out: str, block: int, delta: np.ndarray | None = None) -> dict:
    """The model after the import passes and fura_s, with `delta` (zeros when None) written into its
    initializer; returns the site table."""
    model = load_model(path)
    run_passes(model, import_passes(TrainingOptions()) + [FuraS(AdapterConfig(kind="fura-s", block=block))])
    meta = json.loads(model.metadata_props[keys.FURA_S])
    if delta is not None:
        import onnx_ir as ir

        model.graph.initializers[DELTA].const_value = ir.tensor(delta.astype(np.float32), name=DELTA)
    save_model_atomically(model, out)
    return meta


def _recomposed(path: str, out: str, meta: dict, delta: np.ndarray) -> None:
    """The original model with every site's weight replaced by its blocks' L diag(s (1 + delta)) R^T."""
    proto = onnx.load(path)
    tensors = {t.name: t for t in proto.graph.initializer}
    for site in meta["sites"]:
        tensor = tensors[site["weight"]]
        stored = numpy_helper.to_array(tensor).astype(np.float64)
        transposed = site["transposed"]  # stored [out, in]
        w = stored.T if transposed else stored  # [in, out]
        values = delta[site["offset"]:site["offset"] + site["values"]].reshape(site["blocks"], site["rank"])
        for k in range(site["blocks"]):
            rows = slice(k * BLOCK, (k + 1) * BLOCK)
            left, s, right_t = np.linalg.svd(w[rows].T, full_matrices=False)
            w[rows] = (left @ np.diag(s * (1 + values[k])) @ right_t).T
        tensor.CopyFrom(numpy_helper.from_array((w.T if transposed else w).astype(np.float32), tensor.name))
    onnx.save(proto, out)


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_the_adapted_forward_is_the_model_at_zero_and_the_recomposed_model_at_any_delta(tmp_path, name) -> None:
    exported = models.mlp(str(tmp_path)) if name == "mlp" else models.llama(str(tmp_path))[0]
    feeds = exported.inputs
    base = _session(exported.path).run(None, feeds)[0]
    meta = _adapted(exported.path, str(tmp_path / "zero.onnx"), BLOCK)
    assert meta["sites"] and not meta["skipped_sites"]
    np.testing.assert_allclose(_session(str(tmp_path / "zero.onnx")).run(None, feeds)[0], base, rtol=1e-5, atol=1e-5)
    delta = np.random.default_rng(1).uniform(-0.5, 0.5, meta["trainable_params"])
    _adapted(exported.path, str(tmp_path / "delta.onnx"), BLOCK, delta)
    _recomposed(exported.path, str(tmp_path / "recomposed.onnx"), meta, delta)
    adapted = _session(str(tmp_path / "delta.onnx")).run(None, feeds)[0]
    recomposed = _session(str(tmp_path / "recomposed.onnx")).run(None, feeds)[0]
    assert np.abs(adapted - base).max() > 1e-2  # the delta changes the model
    np.testing.assert_allclose(adapted, recomposed, rtol=1e-4, atol=1e-4)


def _cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    counted = labels != IGNORE_INDEX
    return float(-log_probs[counted, labels[counted]].mean())


def test_one_es_step_is_the_numpy_update_of_the_members_rewards(tmp_path) -> None:
    exported = models.mlp(str(tmp_path))
    pairs, sigma, lr = 3, 0.05, 0.7
    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=BLOCK), trainer="es",
                              es=EsConfig(pairs=pairs, sigma=sigma), optimizer=OptimizerConfig("sgd", lr=lr))
    step = build_training_graph(load_model(exported.path), options)
    # pick_log_probs: the members' loss picks x[label] - logsumexp(x); no [N, C] log-probabilities (checked below
    # against numpy's log-softmax cross-entropy)
    ops = [n.op_type for n in step.graph]
    assert "LogSoftmax" not in ops and ops.count("ReduceLogSumExp") == 2 * pairs + 1
    save_model_atomically(step, str(tmp_path / "step.onnx"))
    meta = _adapted(exported.path, str(tmp_path / "probe.onnx"), BLOCK)
    width = meta["trainable_params"]
    delta = np.random.default_rng(2).uniform(-0.2, 0.2, width).astype(np.float32)
    noise = np.random.default_rng(3).standard_normal((pairs, width)).astype(np.float32)
    session = _session(str(tmp_path / "step.onnx"))
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, {**exported.inputs, "labels": exported.labels, "noise": noise,
                                             DELTA: delta})))

    def reward(d: np.ndarray) -> float:
        _adapted(exported.path, str(tmp_path / "member.onnx"), BLOCK, d)
        return -_cross_entropy(_session(str(tmp_path / "member.onnx")).run(None, exported.inputs)[0], exported.labels)

    rewards = np.array([reward(delta + s * sigma * noise[i]) for s in (1, -1) for i in range(pairs)])
    np.testing.assert_allclose(got["rewards"], rewards, rtol=1e-5, atol=1e-6)
    assert got["loss"] == pytest.approx(-reward(delta), rel=1e-5)
    z = (rewards - rewards.mean()) / rewards.std()
    direction = ((z[:pairs] - z[pairs:]) @ noise.astype(np.float64)) / (2 * pairs)
    np.testing.assert_allclose(got[f"{DELTA}.new"], delta + lr * sigma * direction, rtol=1e-4, atol=2e-5)


def test_the_accuracy_reward_is_each_members_share_of_right_labels(tmp_path) -> None:
    """--reward accuracy: ArgMax over the classes (its shape rule), counted against the labels that are not
    ignored; each member's reward is numpy's accuracy of onnxruntime's logits at that member's delta."""
    exported = models.mlp(str(tmp_path))
    pairs, sigma = 2, 0.5
    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=BLOCK), trainer="es",
                              es=EsConfig(pairs=pairs, sigma=sigma, reward="accuracy"),
                              optimizer=OptimizerConfig("sgd", lr=1.0))
    save_model_atomically(build_training_graph(load_model(exported.path), options), str(tmp_path / "step.onnx"))
    width = _adapted(exported.path, str(tmp_path / "probe.onnx"), BLOCK)["trainable_params"]
    noise = np.random.default_rng(3).standard_normal((pairs, width)).astype(np.float32)
    labels = exported.labels.copy()
    labels[0] = IGNORE_INDEX  # not counted
    session = _session(str(tmp_path / "step.onnx"))
    got = dict(zip([o.name for o in session.get_outputs()],
                   session.run(None, {**exported.inputs, "labels": labels, "noise": noise,
                                      DELTA: np.zeros(width, np.float32)})))

    def accuracy(d: np.ndarray) -> float:
        _adapted(exported.path, str(tmp_path / "member.onnx"), BLOCK, d)
        logits = _session(str(tmp_path / "member.onnx")).run(None, exported.inputs)[0]
        return float((logits.argmax(-1) == labels)[labels != IGNORE_INDEX].mean())

    expected = [accuracy(s * sigma * noise[i]) for s in (1, -1) for i in range(pairs)]
    np.testing.assert_allclose(got["rewards"], expected, rtol=1e-6)


def test_equal_rewards_move_nothing(tmp_path) -> None:
    """sigma so small that every member's loss rounds alike: the z-scores are 0, not rounding noise."""
    exported = models.mlp(str(tmp_path))
    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=BLOCK), trainer="es",
                              es=EsConfig(pairs=2, sigma=1e-12), optimizer=OptimizerConfig("sgd", lr=1.0))
    save_model_atomically(build_training_graph(load_model(exported.path), options), str(tmp_path / "step.onnx"))
    reference = ReferenceStep(str(tmp_path / "step.onnx"))
    reference.step({**exported.inputs, "labels": exported.labels})
    assert np.all(reference.last[f"{DELTA}.new"] == 0)


def test_philox_gives_random123s_known_answers_and_normal_noise() -> None:
    answers = [([0, 0, 0, 0], (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
               ([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
               ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0xA4093822, 0x299F31D0),
                [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1])]
    for counter, key, words in answers:
        assert philox4x32(np.array([counter], np.uint32), key)[0].tolist() == words
    noise = es_noise(7, 3, (400, 250))
    assert abs(noise.mean()) < 0.01 and abs(noise.std() - 1) < 0.01
    assert not np.array_equal(noise, es_noise(7, 4, (400, 250))) and np.array_equal(noise, es_noise(7, 3, (400, 250)))


def _mlp_es(tmp_path) -> tuple[str, dict[str, np.ndarray], TrainingOptions]:
    """A 16-sample MLP classifier, one batch, and FuRA-S ES options (4 pairs, sigma 0.05, SGD lr 1)."""
    path = build_mlp(str(tmp_path / "mlp.onnx"), batch=16, in_features=32, hidden=(32,), classes=6)
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((16, 32)).astype(np.float32), "labels": rng.integers(0, 6, 16)}
    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=BLOCK), trainer="es",
                              es=EsConfig(pairs=4, sigma=0.05, seed=11), optimizer=OptimizerConfig("sgd", lr=1.0))
    return path, feeds, options


def test_the_device_trains_as_the_onnx_step_with_the_same_philox_noise(tmp_path) -> None:
    """The bundle makes its noise on the device; ReferenceStep feeds the ONNX step es_noise of the same
    seed and step. Iteration 1's loss is the model's own; over 20 iterations on one batch it falls."""
    path, feeds, options = _mlp_es(tmp_path)
    step, report = compile_model(path, str(tmp_path / "bundle"), "adreno830", "fp32", options)
    # the members are one forward the plan's loop repeats 8 times: one row kernel, the direction's sum
    assert report["kernels_per_family"].get("random") == 2
    [loop] = json.load(open(tmp_path / "bundle" / "plan.json"))["loops"]
    assert loop["count"] == 8 and report["launches_per_step"] == report["kernels"] + 7 * (loop["end"] - loop["begin"])
    assert not any(n.op_type == "Slice" and n.inputs[0].name == "noise" for n in step.graph)
    save_model_atomically(reference_graph(step, path, options), str(tmp_path / "step.onnx"))
    reference, runner = ReferenceStep(str(tmp_path / "step.onnx")), LocalRunner(str(tmp_path / "bundle"),
                                                                               progress=False, storage="image")
    width = sum(int(np.prod(p["shape"])) for p in runner.manifest["parameters"])
    texture = runner.plan["values"]["es/noise_row"]
    made_by = next(i for i, k in enumerate(runner.plan["kernels"]) if texture in k["outputs"])
    launches, made, repeated = runner.launch_sequence(), 0, 0
    for member, row in ((0, 0), (3, 3), (7, 3)):  # +eps_1, +eps_4, -eps_4: read right after the row's kernel
        for index in launches:
            runner.launch(index)
            made += index == made_by
            repeated += index == loop["end"] - 1
            if made == member + 1:
                break
        np.testing.assert_allclose(runner._read(texture).reshape(-1)[:width], es_noise(11, 0, (4, width))[row],
                                   atol=1e-5)
    # the rest of the loop, so its member counter is back at 0 for the step below, and not the launches after it:
    # the update writes over the parameters (codegen/inplace.py), which the step's loss must not see
    for index in launches:
        runner.launch(index)
        repeated += index == loop["end"] - 1
        if repeated == loop["count"]:
            break
    assert runner.step(feeds) == pytest.approx(_cross_entropy(_session(path).run(None, {"x": feeds["x"]})[0],
                                                               feeds["labels"]), rel=1e-5)
    reference.step(feeds)
    np.testing.assert_allclose(runner.read("rewards"), reference.last["rewards"], rtol=1e-5)
    assert runner.metrics["reward_mean"] == pytest.approx(float(reference.last["reward_mean"]), rel=1e-5)
    # z-scoring divides by the rewards' spread, so their last-bit differences reach the update scaled by
    # |reward| / std(rewards) (about 1e3 here): the update agrees to that, not to 1e-5
    update = reference.last[f"{DELTA}.new"]
    np.testing.assert_allclose(runner.parameters()[DELTA], update, atol=1e-3 * np.abs(update).max())
    losses = [runner.step(feeds) for _ in range(19)]
    assert losses[-1] < losses[0] - 1e-3


def test_fp16_es_on_the_device_follows_the_fp32_onnx_step_with_the_same_philox_noise(tmp_path) -> None:
    """--dtype fp16: the members' forwards run in half textures, while the loss and reward chain, the
    perturbed delta, the z-scores and the direction stay fp32 (storage_precision's ES_MASTER_STAGES).
    Four iterations on the device beside the fp32 ONNX step fed the same Philox noise, each from its own
    state: loss and rewards agree, and every update moves delta the same way by the same amount."""
    path, feeds, options = _mlp_es(tmp_path)
    step, _ = compile_model(path, str(tmp_path / "bundle"), "adreno830", "fp16", options)
    storage: dict[str, set[str]] = {}
    for node in step.graph:
        for value in node.outputs:
            if keys.STORAGE in value.metadata_props:
                stage = node.metadata_props.get(keys.STAGE, "")
                storage.setdefault(stage, set()).add(value.metadata_props[keys.STORAGE])
    assert "fp16" in storage["forward"] and storage["loss"] == storage["es"] == {"fp32"}
    save_model_atomically(reference_graph(step, path, options), str(tmp_path / "step.onnx"))
    reference, runner = ReferenceStep(str(tmp_path / "step.onnx")), LocalRunner(str(tmp_path / "bundle"),
                                                                               progress=False, storage="image")
    for _ in range(4):
        before, reference_before = runner.parameters()[DELTA], reference.parameters()[DELTA]
        loss, reference_loss = runner.step(feeds), reference.step(feeds)
        rewards = runner.read("rewards")
        # Each activation of the forwards is rounded to half (11 significant bits, 4.9e-4 relative); the
        # loss, a mean over 16 samples of log-probabilities computed in fp32 from half logits, moves by
        # less than 1e-4 (measured: 9e-5 at most). 2e-4 is a fifth of half's resolution at the loss (2^-10
        # for 1 <= loss < 2), which rounding the loss chain itself to half would exceed (it was 6e-4..1e-3).
        assert np.all(np.isfinite(rewards)) and loss == pytest.approx(reference_loss, abs=2e-4)
        np.testing.assert_allclose(rewards, reference.last["rewards"], atol=2e-4)
        # The update is lr * sigma * the z-weighted sum of the noise rows. The rewards spread by 4e-4 to 4e-3
        # here, so an error of 1e-4 moves a z-score by 0.1 at most (measured 0.08) and the direction by a few
        # degrees: cos > 0.99 (8 degrees) and the same length within 5 % (measured: 0.9996 and 1.7 %; with a
        # half loss chain an iteration of spread 4e-4 gave cos 0.70 and 26 % less length).
        moved, reference_moved = runner.parameters()[DELTA] - before, reference.parameters()[DELTA] - reference_before
        cosine = float(moved @ reference_moved) / float(np.linalg.norm(moved) * np.linalg.norm(reference_moved))
        assert cosine > 0.99 and np.linalg.norm(moved) == pytest.approx(np.linalg.norm(reference_moved), rel=0.05)


def test_int4_es_on_the_device_is_the_onnx_step_with_half_r(tmp_path) -> None:
    """--weights int4: the frozen weights dequantize in the kernels' loads and FuRA-S's R is stored in half
    (passes/fura_s.HALF_R: rounded at compile time, so the ONNX step holds the same values). Two iterations on
    the device equal the ONNX step fed the same Philox noise (measured: rewards 2e-7, delta 3e-5 of its largest)."""
    path, feeds, options = _mlp_es(tmp_path)
    options = replace(options, weights=WeightFormat("int4", group=8))
    step, _ = compile_model(path, str(tmp_path / "bundle"), "adreno830", "fp32", options)
    rights = [v for n, v in step.graph.initializers.items() if n.endswith(".fura_R")]
    assert rights and all(v.metadata_props[keys.STORAGE] == "fp16" for v in rights)
    assert all(np.array_equal(v.const_value.numpy(), v.const_value.numpy().astype(np.float16)) for v in rights)
    save_model_atomically(reference_graph(step, path, options), str(tmp_path / "step.onnx"))
    reference, runner = ReferenceStep(str(tmp_path / "step.onnx")), LocalRunner(str(tmp_path / "bundle"),
                                                                               progress=False, storage="image")
    for _ in range(2):
        assert runner.step(feeds) == pytest.approx(reference.step(feeds), rel=1e-5)
        np.testing.assert_allclose(runner.read("rewards"), reference.last["rewards"], rtol=1e-5)
        update = reference.last[f"{DELTA}.new"]  # z-scores scale the rewards' last bits (see the fp32 test above)
        np.testing.assert_allclose(runner.parameters()[DELTA], update, atol=1e-3 * np.abs(update).max())


def test_a_transformers_export_trains_forward_only_on_the_device(tmp_path) -> None:
    """The dynamo export of a 2-layer Llama (MatMul of transposed weights, the tied-free LM head): its
    first ES loss is PyTorch's, the device agrees with the ONNX step, and 20 iterations lower the loss."""
    exported = models.llama(str(tmp_path))[0]
    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=16), trainer="es",
                              es=EsConfig(pairs=2, sigma=0.05, seed=1), optimizer=OptimizerConfig("sgd", lr=1.0))
    step, _ = compile_model(exported.path, str(tmp_path / "bundle"), "adreno830", "fp32", options)
    save_model_atomically(reference_graph(step, exported.path, options), str(tmp_path / "step.onnx"))
    reference, runner = ReferenceStep(str(tmp_path / "step.onnx")), LocalRunner(str(tmp_path / "bundle"),
                                                                               progress=False, storage="image")
    feeds = {**exported.inputs, "labels": exported.labels}
    first = runner.step(feeds)
    assert first == pytest.approx(float(exported.loss_of(exported.module).detach()), rel=1e-5)
    assert first == pytest.approx(reference.step(feeds), rel=1e-5)
    np.testing.assert_allclose(runner.read("rewards"), reference.last["rewards"], rtol=1e-5)
    losses = [runner.step(feeds) for _ in range(19)]
    assert losses[-1] < first - 1e-3


def test_an_application_reward_function_scores_the_members_on_the_device_and_in_the_reference(tmp_path,
                                                                                          capsys) -> None:
    """--reward external: the runtime runs the members, hands their outputs to Python, uploads the rewards."""
    path = build_mlp(str(tmp_path / "mlp.onnx"), batch=16, in_features=16, hidden=(16,), classes=4)
    rng = np.random.default_rng(8)
    feeds = {"x": rng.standard_normal((16, 16)).astype(np.float32), "labels": rng.integers(0, 4, 16)}
    seen: list[int] = []

    def solved(outputs: list[np.ndarray]) -> list[float]:  # an outcome only the application checks
        seen.append(len(outputs))
        return [float(np.mean(o.argmax(-1) == feeds["labels"])) + float(o[0, 0]) for o in outputs]

    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=BLOCK), trainer="es",
                              es=EsConfig(pairs=2, sigma=0.1, reward="external"), optimizer=OptimizerConfig("sgd", lr=1.0))
    step, _ = compile_model(path, str(tmp_path / "bundle"), "adreno830", "fp32", options)
    save_model_atomically(reference_graph(step, path, options), str(tmp_path / "step.onnx"))
    reference, runner = ReferenceStep(str(tmp_path / "step.onnx")), LocalRunner(str(tmp_path / "bundle"),
                                                                               progress=False, storage="image")
    for _ in range(2):
        assert runner.step(feeds, reward=solved) == pytest.approx(reference.step(feeds, reward=solved), rel=1e-5)
    assert seen == [4] * 4
    update = reference.parameters()[DELTA]
    assert np.abs(update).max() > 0
    np.testing.assert_allclose(runner.parameters()[DELTA], update, atol=1e-3 * np.abs(update).max())
    with pytest.raises(Exception, match="returned 3 rewards for 4 members"):
        runner.step(feeds, reward=lambda outputs: [0.0] * 3)
    np.savez(tmp_path / "data.npz", **feeds)
    assert main(["run", str(tmp_path / "bundle"), "--data", str(tmp_path / "data.npz"), "--steps", "1"]) == 2
    assert "takes its ES rewards from the application" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--trainer", "es", "--adapter", "fura-s", "--block", "100"], "found no site for --block 100"),
    (["--adapter", "fura-s", "--block", "7", "--fura-sites", "layers.0"], "--block 7 does not fit site"),
    (["--adapter", "fura-s", "--fura-sites", "nothing"], "--fura-sites 'nothing' matches no MatMul/Gemm weight"),
    (["--trainer", "es", "--pairs", "0"], "--pairs 0 is not a number of antithetic pairs >= 1"),
    (["--trainer", "es", "--sigma", "0"], "--sigma 0 is not a perturbation > 0"),
    (["--pairs", "2"], "--pairs is an option of --trainer es"),
    (["--adapter", "fura-s", "--rank", "2"], "--rank 2 is given with --adapter fura-s"),
    (["--trainer", "es", "--adapter", "memflora-sg"], "--adapter memflora-sg"),
    # was ignored: ES stepped with sgd whatever --optimizer said
    (["--trainer", "es", "--optimizer", "adamw"], "--optimizer is for --trainer backprop; under es use --es-optimizer"),
])
def test_bad_fura_s_and_es_options_are_one_clear_error(tmp_path, capsys, args, message) -> None:
    path = build_mlp(str(tmp_path / "mlp.onnx"))
    assert main(["train-graph", path, "-o", str(tmp_path / "step.onnx"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "internal error" not in err
    assert not os.path.exists(tmp_path / "step.onnx")


def _parsed_options(*args: str) -> TrainingOptions:
    from fblc.cli import build_parser
    from fblc.cli.options import check_values, training_options

    parsed = build_parser().parse_args(["train-graph", "model.onnx", "-o", "step.onnx", *args])
    check_values(parsed)
    return training_options(parsed)


def test_es_defaults_are_mobilespec_s_and_help_says_so(capsys) -> None:
    """Under --trainer es without figures: MobileSpec's Table A2 (15 pairs, mu_rel 3e-2, alpha 1; were 4
    pairs and lr 0.01), and --help names the source; backprop and ZO-Adam keep lr 0.01; given figures win."""
    es = _parsed_options("--trainer", "es")
    assert (es.es.pairs, es.es.sigma, es.optimizer.name, es.optimizer.lr) == (15, 3e-2, "sgd", 1.0)
    assert es.es == EsConfig()  # the CLI's defaults are EsConfig's (fblc.choices)
    assert _parsed_options("--trainer", "es", "--es-optimizer", "adam").optimizer.lr == 1e-2
    given = _parsed_options("--trainer", "es", "--lr", "0.5", "--pairs", "3")
    assert (given.optimizer.lr, given.es.pairs) == (0.5, 3)
    backprop = _parsed_options()
    assert (backprop.optimizer.name, backprop.optimizer.lr) == ("sgd", 1e-2)
    assert _parsed_options("--optimizer", "adamw").optimizer.name == "adamw"
    with pytest.raises(SystemExit):
        main(["train-graph", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 15, MobileSpec Table A2)", "(default: 0.03, mu_rel of MobileSpec Table A2)",
                    "--es-optimizer sgd: 1, the step alpha, MobileSpec Table A2)"):
        assert default in text, default


def test_a_model_without_matmul_or_gemm_has_no_fura_s_site(tmp_path, capsys) -> None:
    from tests.test_runtime import elementwise_model

    path = elementwise_model(str(tmp_path / "model.onnx"))
    assert main(["train-graph", path, "-o", str(tmp_path / "step.onnx"), "--adapter", "fura-s"]) == 2
    assert "0 MatMul/Gemm weight(s)" in capsys.readouterr().err
