"""`fblc export`: the bundle's source model with trained parameters, adapters merged, as a standard ONNX file.

Graph mode (onnxruntime, no PoCL): random trained values for every tensor the bundle trains (the merge is
what is under test, not the training), then onnxruntime's logits on the exported file against the step's
forward with those values (the model after the import passes and the adapter's pass: LoRA's x W + (x A) B,
MemFLoRA's Conv(x, W) + Conv(Conv1x1(x, P), U) before BatchNorm, FuRA-S's input transform), within 1e-5.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fblc import bundle_format as fmt
from fblc.cli import main
from fblc.errors import FblcError
from fblc.compiler.adapters import AdapterConfig
from fblc.compiler.model_io import load_model
from fblc.passes.fura_s import FuraS
from fblc.passes.memory_floor import MemoryFloor
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes
from fblc.runtime.specialist import load_file
from support import models
from support.bundles import edit_manifest
from tests.conftest import make_model

def tied(directory: str) -> models.ExportedModel:
    """One weight W [8, 8] read three times, as a tied embedding and head are: Gather(W, ids), then MatMul(., W)
    and MatMul(., Transpose(W)), two adapter sites, each of which must read its own merged copy."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Gather", ["W", "ids"], ["e"], name="embed"),
             helper.make_node("MatMul", ["e", "W"], ["h"], name="mix"), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["r", "Wt"], ["logits"], name="head")]
    path = os.path.join(directory, "tied.onnx")
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
                         [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 8])],
                         {"W": rng.standard_normal((8, 8)).astype(np.float32)}), path)
    return models.ExportedModel("tied", path, None, {"ids": np.array([1, 5, 0, 7])}, np.array([0, 1, 2, 3]),
                                lambda module: None)


#: case -> (test model, adapter kind, compile flags)
CASES = {"full": (models.mlp, "none", []),
         "memflora": (models.small_convnet, "memflora", ["--adapter", "memflora"]),
         "lora": (models.mlp, "lora", ["--adapter", "lora"]),
         "fura-s": (models.mlp, "fura-s", ["--adapter", "fura-s"]),
         "tied lora": (tied, "lora", ["--adapter", "lora"])}


def _logits(model: ir.Model | str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = model if isinstance(model, str) else ir.to_proto(model).SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None, inputs)[0]


def _step_forward(path: str, kind: str, trained: dict[str, np.ndarray], inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The step's forward (import passes, then the adapter's pass) with `trained` in place of its trainables."""
    model = run_passes(load_model(path), import_passes(TrainingOptions()))
    config = AdapterConfig(kind)
    (FuraS(config) if kind == "fura-s" else MemoryFloor(config))(model)
    for name, array in trained.items():
        model.graph.initializers[name].const_value = ir.tensor(array, name=name)
    return _logits(model, inputs)


_EXPORTED: dict[str, tuple] = {}


def _exported(case: str, tmp_path_factory) -> tuple:
    """(source model, trained values, bundle, the exported file) of a case, made once per session."""
    if case not in _EXPORTED:
        _EXPORTED[case] = _export(case, str(tmp_path_factory.mktemp(f"export_{case.replace(' ', '_')}")))
    return _EXPORTED[case]


def _export(case: str, folder: str) -> tuple:
    build, kind, flags = CASES[case]
    source = build(str(folder))
    bundle = os.path.join(folder, "bundle")
    assert main(["compile", source.path, "-o", bundle, "-q", *flags]) == 0
    rng = np.random.default_rng(7)
    trained = {p["name"]: (rng.standard_normal(p["shape"]) * 0.2).astype(np.float32)
               for p in fmt.load_manifest(bundle)["parameters"]}
    params = os.path.join(folder, "trained.npz")
    np.savez(params, **trained)
    out = os.path.join(folder, "model.onnx")
    specialist = ["--keep-adapters", os.path.join(folder, "specialist.npz")] if kind != "none" else []
    assert main(["export", bundle, "--params", params, "-o", out, "-q", *specialist]) == 0
    if specialist:  # the adapter's trained tensors alone (MemFLoRA's P is frozen: not in it)
        kept = load_file(specialist[1])  # with the bundle's fingerprint (what a served bundle checks)
        assert sorted(kept) == sorted(trained) and kept.fingerprint == fmt.load_manifest(bundle)["fingerprint"]
    return source, trained, bundle, out


@pytest.mark.parametrize("case", list(CASES))
def test_the_export_computes_the_trained_step_forward(case, tmp_path_factory) -> None:
    source, trained, _, out = _exported(case, tmp_path_factory)
    _, kind, _ = CASES[case]
    expected = _step_forward(source.path, kind, trained, source.inputs)
    got = _logits(out, source.inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # the training changed the model (else the check above says little), and the graph is the source's
    assert not np.allclose(got, _logits(source.path, source.inputs), rtol=1e-3, atol=1e-3)
    original, written = onnx.load(source.path), onnx.load(out)
    def graph(proto: onnx.ModelProto) -> tuple:
        return ({(o.domain or "", o.version) for o in proto.opset_import},
                [(n.op_type, list(n.input), list(n.output)) for n in proto.graph.node],
                [v.name for v in proto.graph.input], [v.name for v in proto.graph.output],
                [(i.name, list(i.dims), i.data_type) for i in proto.graph.initializer])

    if case != "tied lora":
        assert graph(written) == graph(original)
        return
    # the Gather reads W as it was, each MatMul its merged copy; W is still the embedding's
    readers = {n.name: list(n.input) for n in written.graph.node}
    assert readers["embed"][0] == "W" and readers["mix"][1] == "W.mix.merged"
    assert [i.name for i in written.graph.initializer] == ["W", "W.mix.merged", "W.head.merged"]


def test_export_refuses_a_changed_model_and_foreign_params(tmp_path_factory, tmp_path, capsys) -> None:
    source, trained, bundle, _ = _exported("lora", tmp_path_factory)
    params = str(tmp_path / "other.npz")
    np.savez(params, **{**trained, "stranger": np.zeros(2, np.float32)})
    assert main(["export", bundle, "--params", params, "-o", str(tmp_path / "m.onnx")]) == 2
    assert "tensor(s) the bundle does not train, e.g. 'stranger'" in capsys.readouterr().err
    name = next(iter(trained))
    np.savez(params, **{**trained, name: np.zeros(3, np.float32)})
    assert main(["export", bundle, "--params", params, "-o", str(tmp_path / "m.onnx")]) == 2
    assert f"tensor '{name}' in '{params}' has shape [3]" in capsys.readouterr().err
    np.savez(params, **trained)
    before = open(source.path, "rb").read()
    assert main(["export", bundle, "--params", params, "-o", source.path]) == 2  # the recorded path: not an INPUT
    assert "is the model the bundle was compiled from" in capsys.readouterr().err
    assert open(source.path, "rb").read() == before
    moved = str(tmp_path / "moved.onnx")
    edit_manifest(bundle, lambda m: m["export"]["source"].update(path=moved))
    assert main(["export", bundle, "--params", params, "-o", str(tmp_path / "m.onnx")]) == 2
    assert f"'{moved}', is not there" in capsys.readouterr().err
    with open(moved, "wb") as handle:
        handle.write(open(source.path, "rb").read() + b"\0")
    assert main(["export", bundle, "--params", params, "-o", str(tmp_path / "m.onnx"), "--model", moved]) == 2
    assert "is not the model" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "m.onnx")
    specialist = str(tmp_path / "lora.npz")
    assert main(["export", bundle, "--params", params, "-o", str(tmp_path / "m.onnx"), "--model", source.path,
                 "--keep-adapters", specialist]) == 0
    assert f"wrote {specialist} ({os.path.getsize(specialist):,} bytes): 6 adapter tensors" in capsys.readouterr().out
    assert sorted(load_file(specialist)) == sorted(trained)
    edit_manifest(bundle, lambda m: m["export"]["source"].update(path=os.path.abspath(source.path)))


def test_export_checks_external_data_by_its_sampled_digest(tmp_path) -> None:
    """The source record keeps each external data file's size and sampled digest (export_record.sampled_sha256):
    a changed small tensor (read whole), a changed first page of a large one, and another size are refused; a
    bundle of before, whose record is the whole file's sha256, is checked against it. No compile: the check alone."""
    from fblc.codegen.export_record import source_record
    from fblc.tools.export import _source_model

    rng = np.random.default_rng(0)
    weights = {"W": rng.standard_normal((256, 256)).astype(np.float32), "b": np.ones(256, np.float32)}  # 256 KiB, 1 KiB
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    path = str(tmp_path / "m.onnx")
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])], weights), path,
              save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    data = path + ".data"
    offsets = {t.name: int({e.key: e.value for e in t.external_data}.get("offset", 0))
               for t in onnx.load(path, load_external_data=False).graph.initializer}
    export = {"source": source_record(path)}
    assert set(export["source"]["external_data"]) == {"m.onnx.data"}
    assert _source_model(export, None, "B") == os.path.abspath(path)
    original = open(data, "rb").read()

    def refused_with(where: int, change: bytes = b"\x7f", record: dict = export) -> str:
        with open(data, "wb") as handle:
            handle.write(original[:where] + change + original[where + 1:])
        with pytest.raises(FblcError) as caught:
            _source_model(record, None, "B")
        return caught.value.args[0]

    assert "differ where sampled" in refused_with(offsets["b"] + 700)  # a small tensor: every byte read
    assert "differ where sampled" in refused_with(offsets["W"] + 5)
    assert f"{len(original) + 1:,} bytes, not {len(original):,}" in refused_with(len(original), b"\0")
    with open(data, "wb") as handle:
        handle.write(original)
    old = {"source": {**export["source"], "external_data": {"m.onnx.data": fmt.sha256_of(data)}}}
    assert _source_model(old, None, "B") == os.path.abspath(path)
    assert "its sha256 differs" in refused_with(offsets["W"] + 3, record=old)
