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

import numpy as np
import pytest

from fblc import bundle_format as fmt
from fblc.cli import main
from fblc.compiler.reference import onnxruntime_session
from fblc.errors import FblcError
from fblc.runtime.local import LocalRunner
from fblc.runtime.specialist import load_file
from support import models

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
