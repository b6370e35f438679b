"""Specialists on a served model (issue 42 item 3): a forward bundle compiled with adapter sites
(`--trainer none --adapter KIND`) serves the adapter tensors that `fblc export --keep-adapters` wrote for a trained
bundle, swapped at run time without recompiling. Reference: onnxruntime on the merged export of the same training
(`fblc export` without --keep-adapters), an independent path (the merge is numpy; the step graph is not involved).

The LoRA bundle trains STEPS steps on the device; the MemFLoRA and FuRA-S bundles take random adapter values as
their --save-params (what is under test is serving the exported specialist, not the training, which
tests/test_adapters*.py check; their training steps' kernel builds would double this file's time).
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fblc import bundle_format as fmt
from fblc.cli import main
from fblc.compiler.reference import onnxruntime_session
from fblc.errors import FblcError
from fblc.runtime.local import LocalRunner
from fblc.runtime.native import write_data
from fblc.runtime.specialist import FINGERPRINT, load_file, write_native
from support import models
from support.bundles import edit_manifest
from tests.test_native_runner import runner_binary  # noqa: F401  (fixture, built once per session)

#: kind -> (test model, compile flags): LoRA at the mlp's linear layers, MemFLoRA at the convnet's pointwise conv
#: (its BatchNorm's scale on the branch), FuRA-S at the mlp's MatMul/Gemm (a Slice of delta per layer)
KINDS = {"lora": (models.mlp, ["--adapter", "lora"]), "memflora": (models.small_convnet, ["--adapter", "memflora"]),
         "fura-s": (models.mlp, ["--adapter", "fura-s"])}
STEPS, LR = 3, "0.05"


def _logits(path: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    session = onnxruntime_session(path)
    return session.run(None, inputs)[0]


def _close(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    """1e-5 relative to the logits' scale: fp32 kernels against onnxruntime on the merged weights."""
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=what)


_MADE: dict[str, tuple] = {}


def _served(kind: str, tmp_path_factory) -> tuple:
    """(model, a runner of the forward bundle with adapter sites, {specialist file: merged export}, the training
    bundle) of a kind, made once: the training bundle's parameters exported merged and as a specialist."""
    if kind not in _MADE:
        folder = str(tmp_path_factory.mktemp(f"specialist_{kind}"))
        build, flags = KINDS[kind]
        model = build(folder)
        training, serving = os.path.join(folder, "train"), os.path.join(folder, "serve")
        assert main(["compile", model.path, "-o", training, "-q", "--lr", LR, *flags]) == 0
        assert main(["compile", model.path, "-o", serving, "-q", "--trainer", "none", *flags]) == 0
        if kind == "lora":
            runner = LocalRunner(training, storage="buffer", progress=False)
            for _ in range(STEPS):
                runner.step({**model.inputs, "labels": model.labels})
            trained = runner.parameters()
        else:
            rng = np.random.default_rng(7)
            trained = {p["name"]: (rng.standard_normal(p["shape"]) * 0.2).astype(np.float32)
                       for p in fmt.load_manifest(training)["parameters"]}
        params, merged, kept = (os.path.join(folder, name) for name in ("trained.npz", "merged.onnx", "s.npz"))
        np.savez(params, **trained)
        assert main(["export", training, "--params", params, "-o", merged, "-q", "--keep-adapters", kept]) == 0
        _MADE[kind] = (model, LocalRunner(serving, storage="buffer", progress=False), {kept: merged}, training)
    return _MADE[kind]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_trained_specialist_served_equals_the_merged_export(kind, tmp_path_factory) -> None:
    """The forward bundle without a specialist is the base model (the adapter's identity); with the specialist
    `fblc export --keep-adapters` wrote after training, it equals onnxruntime on the merged export, which the
    training moved away from the base model."""
    model, runner, specialists, _ = _served(kind, tmp_path_factory)
    (kept, merged), = specialists.items()
    manifest, serving = runner.manifest, runner.bundle
    assert sorted(e["name"] for e in manifest["specialist"]) == sorted(load_file(kept))
    runner.load_specialist(None)
    base, trained = _logits(model.path, model.inputs), _logits(merged, model.inputs)
    assert not np.allclose(base, trained, rtol=1e-3, atol=1e-3 * np.abs(base).max())  # the training did something
    _close(runner.infer(model.inputs)["logits"], base, f"{kind}: no specialist")
    _close(runner.infer(model.inputs, specialist=kept)["logits"], trained, f"{kind}: the trained specialist")
    report = fmt.read_json(os.path.join(serving, fmt.REPORT))["weights"]
    assert report["bytes"]["specialist"] == sum(e["nbytes"] for e in manifest["specialist"]) > 0
    assert report["shared"] > report["bytes"]["specialist"]


def test_two_specialists_switched_in_one_runner(tmp_path_factory, tmp_path, capsys) -> None:
    """One LoRA runner serves two specialists in turn (and the base again) with each one's outputs; `fblc run
    --infer --specialist` prints the bytes it uploaded, the adapter tensors' textures alone."""
    model, runner, specialists, training = _served("lora", tmp_path_factory)
    serving = runner.bundle
    (first, first_merged), = specialists.items()
    rng = np.random.default_rng(5)  # a second specialist: other adapter values, merged by fblc export too
    other = {name: (rng.standard_normal(a.shape) * 0.2).astype(np.float32) for name, a in load_file(first).items()}
    params, second, second_merged = (str(tmp_path / name) for name in ("other.npz", "s2.npz", "m2.onnx"))
    np.savez(params, **other)
    assert main(["export", training, "--params", params, "-o", second_merged, "-q", "--keep-adapters", second]) == 0
    uploaded = runner.load_specialist(second)
    assert uploaded == sum(e["nbytes"] for e in runner.manifest["specialist"])
    for path, merged in ((second, second_merged), (first, first_merged), (second, second_merged)):
        _close(runner.infer(model.inputs, specialist=path)["logits"], _logits(merged, model.inputs), path)
    runner.load_specialist(None)
    _close(runner.infer(model.inputs)["logits"], _logits(model.path, model.inputs), "back to the base model")

    data, out = str(tmp_path / "in.npz"), str(tmp_path / "out.npz")
    np.savez(data, **model.inputs)
    capsys.readouterr()
    assert main(["run", serving, "--infer", "--data", data, "--specialist", second, "-o", out]) == 0
    assert (f"specialist {second}: 6 adapter tensors (596 values), {uploaded:,} bytes uploaded"
            in capsys.readouterr().out)
    with np.load(out) as written:
        _close(written["logits"], _logits(second_merged, model.inputs), "fblc run --infer --specialist")


def test_a_mismatched_specialist_is_refused_by_name(tmp_path_factory, tmp_path, capsys) -> None:
    """Checked before a kernel is built: a tensor of another shape (another rank), a missing one, a stranger;
    a bundle without adapter sites; --specialist without --infer."""
    model, runner, specialists, _ = _served("lora", tmp_path_factory)
    (kept, _), = specialists.items()
    serving = runner.bundle
    tensors = load_file(kept)
    data, out, bad = (str(tmp_path / name) for name in ("in.npz", "out.npz", "bad.npz"))
    np.savez(data, **model.inputs)

    def refused(specialist: dict[str, np.ndarray], bundle: str = serving) -> str:
        np.savez(bad, **specialist)
        assert main(["run", bundle, "--infer", "--data", data, "--specialist", bad, "-o", out]) == 2
        return capsys.readouterr().err

    capsys.readouterr()
    err = refused({**tensors, "layers.1.adapter_B": np.zeros((4, 64), np.float32)})
    assert f"tensor 'layers.1.adapter_B' of specialist '{bad}' has shape [4, 64]; the adapter site" in err
    assert "has shape [2, 64]" in err
    assert f"has no tensor 'layers.0.adapter_A', an adapter site of '{serving}' (shape [32, 2])" in refused(
        {k: v for k, v in tensors.items() if k != "layers.0.adapter_A"})
    assert "holds 1 tensor(s) that are no adapter site" in refused({**tensors, "fura_s.delta": np.zeros(3)})
    plain = str(tmp_path / "plain")
    assert main(["compile", model.path, "-o", plain, "-q", "--trainer", "none"]) == 0
    assert f"'{plain}' has no adapter sites, so it takes no specialist" in refused(tensors, plain)
    assert main(["run", serving, "--data", data, "--specialist", kept]) == 2
    assert "--specialist is given without --infer" in capsys.readouterr().err
    assert not os.path.exists(out)
    with pytest.raises(FblcError, match="tensor 'layers.0.adapter_A' of the specialist holds non-finite values"):
        runner.load_specialist({**tensors, "layers.0.adapter_A": np.full((32, 2), np.nan, np.float32)})


def _other_weights(path: str, out: str) -> str:
    """The model at `path` with its first adapted weight moved a little: same graph and shapes, other base."""
    model = onnx.load(path)
    weight = next(i for i in model.graph.initializer if i.name == "layers.0.weight")
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) + np.float32(0.01), weight.name))
    onnx.save(model, out)
    return out


def test_a_specialist_trained_against_other_factors_or_weights_is_refused(tmp_path_factory, tmp_path, capsys,
                                                                         runner_binary) -> None:  # noqa: F811
    """The specialist file carries its training bundle's fingerprint: a forward bundle compiled with another --seed
    (MemFLoRA's P drawn differently) or from other base weights (FuRA-S's R and W differ) has the same sites and
    shapes but refuses it, naming what differs and what to do; the native runner refuses its file's fingerprint id
    before any device work. A specialist without a fingerprint (an older file) loads with a warning."""
    data, out = str(tmp_path / "in.npz"), str(tmp_path / "out.npz")
    model, runner, specialists, training = _served("memflora", tmp_path_factory)
    (kept, _), = specialists.items()
    np.savez(data, **model.inputs)
    reseeded = str(tmp_path / "seed3")
    assert main(["compile", model.path, "-o", reseeded, "-q", "--trainer", "none", "--adapter", "memflora",
                 "--seed", "3"]) == 0
    served, trained = fmt.load_manifest(reseeded)["fingerprint"], fmt.load_manifest(training)["fingerprint"]
    assert served["frozen_sha256"] != trained["frozen_sha256"] and served["base_sha256"] == trained["base_sha256"]
    assert load_file(kept).fingerprint == trained == runner.manifest["fingerprint"]
    capsys.readouterr()
    assert main(["run", reseeded, "--infer", "--data", data, "--specialist", kept, "-o", out]) == 2
    err = capsys.readouterr().err
    assert (f"the frozen projection specialist '{kept}' was trained against was drawn with --seed 0; '{reseeded}' "
            "was compiled with --seed 3; compile the served bundle with --seed 0") in err

    model, runner, specialists, _ = _served("fura-s", tmp_path_factory)
    (kept, _), = specialists.items()
    other = str(tmp_path / "other")
    other_model = _other_weights(model.path, str(tmp_path / "other.onnx"))
    assert main(["compile", other_model, "-o", other, "-q", "--trainer", "none", "--adapter", "fura-s"]) == 0
    with pytest.raises(FblcError, match=f"specialist '{kept}' was trained on other base weights \\('{model.path}'"):
        LocalRunner(other, storage="buffer", progress=False).load_specialist(kept)
    manifest, plan = fmt.load_verified(other)  # the runner's own check, past Python's: the file written directly
    native, feeds = str(tmp_path / "s.bin"), str(tmp_path / "data.bin")
    write_native(native, manifest, plan, load_file(kept))
    write_data(feeds, manifest, plan, [model.inputs])
    done = subprocess.run([runner_binary, other, "--data", feeds, "--steps", "1", "--out", str(tmp_path),
                           "--specialist", native], capture_output=True, text=True)
    assert done.returncode == 2 and (f"the specialist '{native}' was trained against other frozen factors or base "
                                     f"weights (fingerprint {load_file(kept).fingerprint['id']})") in done.stderr
    assert f"than '{other}' holds ({manifest['fingerprint']['id']})" in done.stderr

    older = str(tmp_path / "older.npz")  # a specialist written before fingerprints: served, with a warning
    np.savez(older, **{k: v for k, v in np.load(kept).items() if k != FINGERPRINT})
    capsys.readouterr()
    assert runner.load_specialist(older) == sum(e["nbytes"] for e in runner.manifest["specialist"])
    assert f"warning: specialist '{older}' carries no fingerprint" in capsys.readouterr().err
    runner.load_specialist(kept)
    assert "warning" not in capsys.readouterr().err
    lora = next(iter(_served("lora", tmp_path_factory)[2]))  # another adapter: named before the sites' shapes
    with pytest.raises(FblcError, match=f"specialist '{lora}' was trained with the adapter lora; '{runner.bundle}' "
                                        "has fura-s sites"):
        runner.load_specialist(lora)
    edit_manifest(other, lambda m: m.pop("fingerprint"))  # a bundle compiled before fingerprints: served, warned
    LocalRunner(other, storage="buffer", progress=False).load_specialist(kept)
    assert f"warning: '{other}' records no fingerprint" in capsys.readouterr().err
