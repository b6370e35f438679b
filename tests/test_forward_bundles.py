"""Forward bundles (`fblc compile --trainer none`, issue 42 item 2): the model's forward alone, with no loss,
labels, backward or optimizer, run by LocalRunner.infer and `fblc run --infer`, against onnxruntime on the
original model file (an independent reference: the step graph is not involved)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fblc import bundle_format as fmt
from fblc.cli import main
from fblc.compiler.adapters import AdapterConfig
from fblc.compiler.quantize import WeightFormat
from fblc.compiler.reference import onnxruntime_session
from fblc.errors import BundleError, FblcError
from fblc.passes.pipeline import TrainingOptions, training_passes
from fblc.runtime.local import DataError, LocalRunner
from fblc.tools.verify import verify_model
from support import models

RTOL, ATOL = 1e-4, 1e-5  # fp32 kernels against onnxruntime (fblc.tools.verify.TOLERANCES)
TRAINING_PASSES = {"mark_trainable", "attach_loss", "build_gradients", "es_gradients", "chunk_loss", "optimizer_step"}


def _onnxruntime(path: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = onnxruntime_session(path)
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def test_forward_pipeline_leaves_out_the_training_passes() -> None:
    names = [p.name for p in training_passes(TrainingOptions(trainer="none"))]
    assert "forward_step" in names and not TRAINING_PASSES & set(names)
    assert TRAINING_PASSES - {"es_gradients"} <= {p.name for p in training_passes(TrainingOptions())}
    with pytest.raises(FblcError, match="--adapter memflora-sg is given with --trainer none"):
        training_passes(TrainingOptions(trainer="none", adapter=AdapterConfig(kind="memflora-sg")))


def test_forward_bundle_equals_onnxruntime_in_both_storages(tmp_path) -> None:
    """small_convnet (strided, depthwise, grouped convs, eval BatchNorm, pools, a head) on image and buffer
    textures; its manifest has no loss, labels or parameters, and a forward bundle does not train."""
    model = models.small_convnet(str(tmp_path))
    bundle = str(tmp_path / "forward")
    assert main(["compile", model.path, "-o", bundle, "-q", "--trainer", "none"]) == 0
    manifest = fmt.load_manifest(bundle)
    assert fmt.is_forward(manifest) and "loss" not in manifest and not manifest["parameters"]
    assert [e["name"] for e in manifest["inputs"]] == list(model.inputs)
    expected = _onnxruntime(model.path, model.inputs)
    assert [e["name"] for e in manifest["outputs"]] == list(expected)
    for storage in ("image", "buffer"):
        runner = LocalRunner(bundle, storage=storage, progress=False)
        outputs = runner.infer(model.inputs)
        assert list(outputs) == list(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(outputs[name], value, rtol=RTOL, atol=ATOL, err_msg=f"{name} ({storage})")
    with pytest.raises(DataError, match="'labels' is not an input of the forward bundle"):
        runner.infer({**model.inputs, "labels": model.labels})
    with pytest.raises(BundleError, match="is a forward bundle"):
        runner.step(model.inputs)


def test_run_infer_round_trip_and_refusals(tmp_path, capsys) -> None:
    """`fblc run --infer`: two batches of the mlp through the CLI, joined, equal onnxruntime's; a data file
    with labels and a forward bundle run without --infer are refused by name before any kernel is built."""
    model = models.mlp(str(tmp_path))
    bundle = str(tmp_path / "forward")
    assert main(["compile", model.path, "-o", bundle, "-q", "--trainer", "none"]) == 0
    x = np.concatenate([model.inputs["x"], -model.inputs["x"][::-1]])  # two batches of the compiled 8 rows
    data, out = str(tmp_path / "inputs.npz"), str(tmp_path / "outputs.npz")
    np.savez(data, x=x)
    assert main(["run", bundle, "--infer", "--data", data, "-o", out, "-q"]) == 0
    batch = len(model.inputs["x"])
    expected = np.concatenate([_onnxruntime(model.path, {"x": x[k:k + batch]})["logits"] for k in (0, batch)])
    with np.load(out) as written:
        assert written.files == ["logits"]
        np.testing.assert_allclose(written["logits"], expected, rtol=RTOL, atol=ATOL)
    capsys.readouterr()
    labelled = str(tmp_path / "labelled.npz")
    np.savez(labelled, x=x, labels=np.zeros(len(x), np.int64))
    assert main(["run", bundle, "--infer", "--data", labelled, "-o", out]) != 0
    assert "'labels' is not an input of the forward bundle" in capsys.readouterr().err
    assert main(["run", bundle, "--data", data]) != 0
    assert f"'{bundle}' is a forward bundle" in capsys.readouterr().err
    assert os.path.getsize(out) > 0


def test_verify_an_int4_forward_bundle(tmp_path) -> None:
    """`fblc verify --trainer none --weights int4`: every weight of a forward bundle is a constant, so all are
    stored packed; the kernels match onnxruntime on the step graph (its DequantizeLinear), and the rounding
    itself is visible against the model file (so the reference is not the model there)."""
    model = models.mlp(str(tmp_path))
    options = TrainingOptions(trainer="none", weights=WeightFormat("int4"))
    rows = verify_model(model.path, options, storage="buffer", feeds=model.inputs, keep_bundle=str(tmp_path / "b"))
    assert [r.name for r in rows] == ["logits"] and all(r.ok for r in rows), rows
    assert fmt.read_json(str(tmp_path / "b" / fmt.REPORT))["weights"]["quantized"]
    served = LocalRunner(str(tmp_path / "b"), storage="buffer", progress=False).infer(model.inputs)["logits"]
    original = _onnxruntime(model.path, model.inputs)["logits"]
    assert not np.allclose(served, original, rtol=RTOL, atol=ATOL)  # int4's rounding, which the model lacks


def _one_node_model(path: str, op: str, inputs: dict[str, tuple[int, ...]], out_shape: list[int],
                    dtype: int = 1, **attributes: object) -> str:
    import onnx
    from onnx import helper

    graph = helper.make_graph([helper.make_node(op, list(inputs), ["y"], **attributes)], "g",
                              [helper.make_tensor_value_info(n, dtype, list(s)) for n, s in inputs.items()],
                              [helper.make_tensor_value_info("y", dtype, out_shape)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)
    return path


def test_a_step_of_views_alone_runs_and_unrunnable_values_are_named(tmp_path, capsys) -> None:
    """From ONNX's node tests (benchmarks/onnx_conformance.py): a forward whose output is a view of its input
    (a lone Transpose: no launch at all) was an internal error in the memory plan; it runs and equals numpy.
    A string tensor and a zero-element float tensor were internal errors deep in codegen; each is refused
    naming the tensor."""
    path = _one_node_model(str(tmp_path / "t.onnx"), "Transpose", {"x": (2, 3)}, [3, 2], perm=[1, 0])
    bundle = str(tmp_path / "t")
    assert main(["compile", path, "-o", bundle, "-q", "--trainer", "none"]) == 0
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(LocalRunner(bundle).infer({"x": x})["y"], x.T)
    strings = _one_node_model(str(tmp_path / "s.onnx"), "Identity", {"x": (2,)}, [2], dtype=8)
    assert main(["compile", strings, "-o", str(tmp_path / "s"), "--trainer", "none"]) != 0
    assert "'x' holds strings" in capsys.readouterr().err
    import onnx
    from onnx import helper, numpy_helper

    split = numpy_helper.from_array(np.array([3, 0], np.int64), "parts")
    graph = helper.make_graph([helper.make_node("Split", ["x", "parts"], ["a", "b"], axis=1),
                               helper.make_node("Concat", ["a", "b"], ["y"], axis=1)], "g",
                              [helper.make_tensor_value_info("x", 1, [2, 3])],
                              [helper.make_tensor_value_info("y", 1, [2, 3])], initializer=[split])
    empty = str(tmp_path / "e.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), empty)
    assert main(["compile", empty, "-o", str(tmp_path / "e"), "--trainer", "none"]) != 0
    assert "'b' (made by node" in (err := capsys.readouterr().err) and "has shape [2, 0]: no element" in err
    assert "internal error" not in err
    # an integer one (onnx's test_constantofshape_int_shape_zero): refused where its kernel would write it
    fill = helper.make_node("ConstantOfShape", ["x"], ["y"], name="fill",
                            value=numpy_helper.from_array(np.array([0], np.int32)))
    graph = helper.make_graph([fill], "g", [helper.make_tensor_value_info("x", 7, [1])],
                              [helper.make_tensor_value_info("y", 6, [0])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), empty)
    assert main(["compile", empty, "-o", str(tmp_path / "i"), "--trainer", "none"]) != 0
    assert "'y' (made by node 'fill', ConstantOfShape) has shape [0]: no element" in (err := capsys.readouterr().err)
    assert "internal error" not in err


def _token_attention_model(path: str) -> str:
    """The decoder family's forward in miniature: int64 ids -> embedding Gather -> one causal attention head with
    a residual -> vocabulary logits [2, 4, 16]."""
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {"E": (16, 8), "wq": (8, 8), "wk": (8, 8), "wv": (8, 8), "wo": (8, 16)}
    initializers = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in weights.items()]
    initializers += [numpy_helper.from_array(np.triu(np.full((4, 4), -1e4, np.float32), 1), "mask"),
                     numpy_helper.from_array(np.array(8 ** -0.5, np.float32), "scale")]
    nodes = [helper.make_node("Gather", ["E", "ids"], ["x"]),
             *[helper.make_node("MatMul", ["x", f"w{n}"], [n]) for n in "qkv"],
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Add", ["ss", "mask"], ["sm"]), helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["h"]), helper.make_node("Add", ["h", "x"], ["r"]),
             helper.make_node("MatMul", ["r", "wo"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", 7, [2, 4])],
                              [helper.make_tensor_value_info("logits", 1, [2, 4, 16])], initializer=initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_token_ids_through_a_causal_attention_forward_bundle(tmp_path) -> None:
    """The LLM families' forward path (benchmarks/forward_zoo.py runs the zoo's gpt2, distilbert and bart this
    way): int64 ids fed to a forward bundle compiled for a phone profile, embedded, attended and projected, equal
    onnxruntime in buffer storage (the mlp and convnet tests above feed floats only)."""
    model = _token_attention_model(str(tmp_path / "tokens.onnx"))
    bundle = str(tmp_path / "forward")
    assert main(["compile", model, "-o", bundle, "-q", "--trainer", "none", "--target", "adreno830"]) == 0
    ids = np.array([[3, 15, 0, 7], [9, 9, 2, 12]], np.int64)
    got = LocalRunner(bundle, storage="buffer", progress=False).infer({"ids": ids})["logits"]
    np.testing.assert_allclose(got, _onnxruntime(model, {"ids": ids})["logits"], rtol=RTOL, atol=ATOL)
