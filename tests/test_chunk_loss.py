"""chunk_loss: the cross-entropy over vocabulary chunks against PyTorch autograd, and the logits gone from the plan.

A two-layer LM (x -> MatMul -> Relu -> head MatMul -> logits [B, T, V]) with V = 50 classes in chunks of
16 (the last chunk 2 wide: 16 does not divide 50); the head's weight either as it is stored ([D, V]) or
as torch's nn.Linear exports it (Transpose of [V, D]). The step graph runs in onnxruntime; its loss and
every P.grad must match float64 torch autograd of F.cross_entropy (ignore_index -100 included).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler.graph import static_shape
from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.chunk_loss import ChunkLoss
from fblc.passes.memory_plan import plan_memory
from fblc.passes.pipeline import TrainingOptions, build_training_graph, training_pipeline, run_passes
from fblc.compiler.quantize import WeightFormat
from fblc.profiles import load_profile

RTOL, ATOL = 1e-4, 1e-5  # fp32 step graph against a float64 reference
B, T, D, V = 2, 5, 8, 50


def _lm(path: str, transposed: bool, vocabulary: int = V, tokens: int = T) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    weights = {"w1": rng.normal(size=(D, D)).astype(np.float32),
               "head": rng.normal(size=(vocabulary, D) if transposed else (D, vocabulary)).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node("Relu", ["h"], ["r"], name="relu")]
    if transposed:
        nodes.append(helper.make_node("Transpose", ["head"], ["head_t"], name="head_t", perm=[1, 0]))
    nodes.append(helper.make_node("MatMul", ["r", "head_t" if transposed else "head"], ["logits"], name="lm_head"))
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, tokens, D])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [B, tokens, vocabulary])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path)
    return weights


def _step(path: str, out: str, chunk: int, weights: str = "fp32") -> onnx.ModelProto:
    options = TrainingOptions(loss_chunk=chunk, optimizer=OptimizerConfig(name="sgd", lr=0.0))
    if weights != "fp32":  # the head frozen and quantized (group 8: one group per row of D = 8)
        options = TrainingOptions(loss_chunk=chunk, optimizer=OptimizerConfig(name="sgd", lr=0.0), freeze="head",
                                  weights=WeightFormat(weights, 8))
    step = build_training_graph(load_model(path), options)
    save_model_atomically(step, out)
    return step


@pytest.mark.parametrize("transposed,weights", [(False, "fp32"), (True, "fp32"), (False, "int4"), (True, "int4")],
                         ids=["w", "linear", "w-int4", "linear-int4"])
def test_chunked_loss_gradients_match_torch(tmp_path, transposed: bool, weights: str) -> None:
    """A quantized head (int4) is chunked too: each chunk dequantizes its own slice of the integers and scales,
    cut at compile time; no DequantizeLinear of the whole head is left. The reference is torch on the head
    quantized and dequantized by numpy (fblc.compiler.quantize)."""
    from fblc.compiler.quantize import dequantize, quantize
    import onnx_ir as ir
    stored = _lm(str(tmp_path / "lm.onnx"), transposed)
    step = _step(str(tmp_path / "lm.onnx"), str(tmp_path / "step.onnx"), chunk=16, weights=weights)
    # golden: no loss or backward value holds a whole row of V logits; the chunks do (16 and the last 2)
    widths = {static_shape(o)[-1] for n in step.graph if n.metadata_props.get("fblc.stage") in ("loss", "backward")
              for o in n.outputs if o is not None and len(static_shape(o)) == 2 and static_shape(o)[0] == B * T}
    assert V not in widths and {16, 2} <= widths
    weights_in = dict(stored)
    if weights == "int4":
        dequantized = [n for n in step.graph if n.op_type == "DequantizeLinear"]
        assert sorted(static_shape(n.outputs[0])[0 if transposed else 1] for n in dequantized) == [2, 16, 16, 16]
        assert "head.q" not in step.graph.initializers and "head" not in step.graph.initializers
        axis = 1 if transposed else 0  # the head's reduction axis (D) as stored
        head = dequantize(*quantize(stored["head"], axis, 8, ir.DataType.INT4), None, axis, 8)
        weights_in = {"w1": stored["w1"], "head": head.astype(np.float32)}
    rng = np.random.default_rng(3)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    labels = rng.integers(0, V, size=(B, T)).astype(np.int64)
    labels[0, 1] = -100
    labels[1, 0] = V - 1  # in the last, short chunk
    session = ort.InferenceSession(str(tmp_path / "step.onnx"), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x, "labels": labels})))
    tensors = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in weights_in.items()}
    head = tensors["head"].T if transposed else tensors["head"]
    logits = torch.relu(torch.tensor(x.astype(np.float64)) @ tensors["w1"]) @ head
    loss = F.cross_entropy(logits.reshape(-1, V), torch.from_numpy(labels).reshape(-1), ignore_index=-100)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=RTOL, atol=ATOL)
    for name, tensor in tensors.items():
        if weights == "fp32" or name != "head":  # a quantized head is frozen: no gradient
            np.testing.assert_allclose(got[f"{name}.grad"], tensor.grad.numpy(), rtol=RTOL, atol=ATOL, err_msg=name)
    assert weights == "fp32" or "head.grad" not in got


def test_quantized_chunked_head_on_the_device_matches_onnxruntime(tmp_path) -> None:
    """Numeric: the chunked loss over an int4 head (nn.Linear's W^T, V = 20 in chunks of 16 and 4) on PoCL equals
    onnxruntime on the same step graph (fblc verify's tolerances); the chunks' MatMuls dequantize in their loads:
    no dequantize kernel, so no float copy of the head."""
    from fblc.tools.verify import verify_model
    _lm(str(tmp_path / "lm.onnx"), transposed=True, vocabulary=20)
    options = TrainingOptions(loss_chunk=16, optimizer=OptimizerConfig(name="sgd", lr=0.1), freeze="head",
                              weights=WeightFormat("int4", 8))
    rows = verify_model(str(tmp_path / "lm.onnx"), options, storage="buffer", keep_bundle=str(tmp_path / "bundle"))
    assert {r.name for r in rows} == {"loss", "w1.grad", "w1.new"} and all(r.ok for r in rows), rows
    with open(tmp_path / "bundle" / "plan.json") as plan:
        assert not [k for k in json.load(plan)["kernels"] if k["family"] == "dequantize"]


def test_chunking_is_left_out_where_not_asked_or_not_possible(tmp_path) -> None:
    _lm(str(tmp_path / "lm.onnx"), transposed=False)
    for options, reason in ((TrainingOptions(loss_chunk=0), ""), (TrainingOptions(loss_chunk=-1), "below the chunk"),
                            (TrainingOptions(loss_chunk=16, loss="mse"), "only cross_entropy")):
        passes = training_pipeline(options)
        step = run_passes(load_model(str(tmp_path / "lm.onnx")), passes)
        chunker = next(p for p in passes if isinstance(p, ChunkLoss))
        assert reason in chunker.skipped and (reason or not chunker.skipped)
        assert any(n.op_type in ("LogSoftmax", "Sub") for n in step.graph)
        assert not any(n.op_type == "Concat" for n in step.graph)  # nothing chunked


def test_chunking_takes_the_logits_out_of_the_live_peak(tmp_path) -> None:
    vocabulary, tokens = 4096, 64  # logits [128, 4096] fp32: 2 MiB, the step's largest tensors by far
    _lm(str(tmp_path / "lm.onnx"), transposed=True, vocabulary=vocabulary, tokens=tokens)
    peaks = {}
    for chunk in (0, 512):
        options = TrainingOptions(loss_chunk=chunk, optimizer=OptimizerConfig(name="sgd"))
        step = build_training_graph(load_model(str(tmp_path / "lm.onnx")), options, lower=load_profile("adreno830"))
        peaks[chunk] = plan_memory(step).summary()["live_peak"]
    logits = B * tokens * vocabulary * 4
    assert peaks[512] <= peaks[0] - logits, peaks


def _tied_lm(path: str) -> None:
    """ids -> Gather(table [V, D]) -> MatMul -> Relu -> MatMul(Transpose(table)): the head tied to the embedding."""
    rng = np.random.default_rng(5)
    weights = {"table": rng.normal(size=(V, D)).astype(np.float32), "w1": rng.normal(size=(D, D)).astype(np.float32)}
    nodes = [helper.make_node("Gather", ["table", "ids"], ["x"], name="embed"),
             helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Transpose", ["table"], ["head_t"], name="head_t", perm=[1, 0]),
             helper.make_node("MatMul", ["r", "head_t"], ["logits"], name="lm_head")]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [B, T])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [B, T, V])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path)


@pytest.mark.parametrize("trainer", ["es", "backprop"])
def test_tied_quantized_head_chunks_equal_the_whole_loss(tmp_path, trainer: str) -> None:
    """A head tied to the embedding and stored int4 (Llama-3.2-1B's) is chunked: the chunks' DequantizeLinears of
    their own row slices are read by the loss's MatMuls and by the embedding, whose Gather becomes one Gather per
    chunk (ids outside a chunk add zeros; negative ids wrap), so the whole table is stored once, in chunks. ES
    (FuRA-S, the members' loss chunked before es_gradients copies it) and LoRA backprop: every step output of the
    chunked step equals the unchunked step's on the same inputs (onnxruntime). ES leaves a float head whole."""
    from fblc.compiler.adapters import AdapterConfig
    from fblc.compiler.es import EsConfig
    _tied_lm(str(tmp_path / "tied.onnx"))
    int4 = WeightFormat("int4", 8)
    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=8), trainer="es", weights=int4,
                              es=EsConfig(pairs=2, sigma=0.05), optimizer=OptimizerConfig("sgd", lr=1.0)) \
        if trainer == "es" else TrainingOptions(adapter=AdapterConfig(kind="lora", rank=2), weights=int4,
                                                optimizer=OptimizerConfig("sgd", lr=0.1))
    rng = np.random.default_rng(3)
    feeds = {"ids": rng.integers(-V, V, size=(B, T)).astype(np.int64),  # negative ids count from the end
             "labels": rng.integers(0, V, size=(B, T)).astype(np.int64), "noise": None}
    feeds["ids"][0, 0], feeds["labels"][1, 1] = V - 1, V - 1  # the last, short chunk
    got = {}
    for chunk in (16, 0):
        passes = training_pipeline(dataclasses.replace(options, loss_chunk=chunk))
        step = run_passes(load_model(str(tmp_path / "tied.onnx")), passes)
        chunker = next(p for p in passes if isinstance(p, ChunkLoss))
        assert chunker.skipped == ""
        tables = [n for n in step.graph if n.op_type == "DequantizeLinear" and static_shape(n.outputs[0])[-1] == D
                  and static_shape(n.outputs[0])[0] != D]
        assert sorted(static_shape(n.outputs[0])[0] for n in tables) == ([2, 16, 16, 16] if chunk else [V])
        gathers = [n for n in step.graph if n.op_type == "Gather"]
        assert {n.inputs[0].producer().name for n in gathers} == {n.name for n in tables}  # the embedding reads them
        save_model_atomically(step, str(tmp_path / f"step{chunk}.onnx"))
        session = ort.InferenceSession(str(tmp_path / f"step{chunk}.onnx"), providers=["CPUExecutionProvider"])
        if trainer == "es":
            width = next(i.shape for i in session.get_inputs() if i.name == "noise")
            feeds["noise"] = np.random.default_rng(4).normal(size=width).astype(np.float32)
        run = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
        got[chunk] = dict(zip([o.name for o in session.get_outputs()], run))
    assert got[16].keys() == got[0].keys() and ("rewards" in got[0]) == (trainer == "es")
    for name, whole in got[0].items():
        np.testing.assert_allclose(got[16][name], whole, rtol=RTOL, atol=ATOL, err_msg=name)
    if trainer == "es":  # a float head's chunks would be run-time Slices, made once and held by every member
        passes = training_pipeline(dataclasses.replace(options, loss_chunk=16, weights=WeightFormat()))
        step = run_passes(load_model(str(tmp_path / "tied.onnx")), passes)
        assert "not quantized" in next(p for p in passes if isinstance(p, ChunkLoss)).skipped
        assert any(n.op_type == "ReduceLogSumExp" for n in step.graph)  # pick_log_probs' whole-vocabulary loss
