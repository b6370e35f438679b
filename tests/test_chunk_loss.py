"""chunk_loss: the cross-entropy over vocabulary chunks against PyTorch autograd, and the logits gone from the plan.

A two-layer LM (x -> MatMul -> Relu -> head MatMul -> logits [B, T, V]) with V = 50 classes in chunks of
16 (the last chunk 2 wide: 16 does not divide 50); the head's weight either as it is stored ([D, V]) or
as torch's nn.Linear exports it (Transpose of [V, D]). The step graph runs in onnxruntime; its loss and
every P.grad must match float64 torch autograd of F.cross_entropy (ignore_index -100 included).
"""

from __future__ import annotations

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


def _step(path: str, out: str, chunk: int) -> onnx.ModelProto:
    step = build_training_graph(load_model(path), TrainingOptions(loss_chunk=chunk,
                                                                  optimizer=OptimizerConfig(name="sgd", lr=0.0)))
    save_model_atomically(step, out)
    return step


@pytest.mark.parametrize("transposed", [False, True], ids=["w", "linear"])
def test_chunked_loss_gradients_match_torch(tmp_path, transposed: bool) -> None:
    weights = _lm(str(tmp_path / "lm.onnx"), transposed)
    step = _step(str(tmp_path / "lm.onnx"), str(tmp_path / "step.onnx"), chunk=16)
    # golden: no loss or backward value holds a whole row of V logits; the chunks do (16 and the last 2)
    widths = {static_shape(o)[-1] for n in step.graph if n.metadata_props.get("fblc.stage") in ("loss", "backward")
              for o in n.outputs if o is not None and len(static_shape(o)) == 2 and static_shape(o)[0] == B * T}
    assert V not in widths and {16, 2} <= widths
    rng = np.random.default_rng(3)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    labels = rng.integers(0, V, size=(B, T)).astype(np.int64)
    labels[0, 1] = -100
    labels[1, 0] = V - 1  # in the last, short chunk
    session = ort.InferenceSession(str(tmp_path / "step.onnx"), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x, "labels": labels})))
    tensors = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in weights.items()}
    head = tensors["head"].T if transposed else tensors["head"]
    logits = torch.relu(torch.tensor(x.astype(np.float64)) @ tensors["w1"]) @ head
    loss = F.cross_entropy(logits.reshape(-1, V), torch.from_numpy(labels).reshape(-1), ignore_index=-100)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=RTOL, atol=ATOL)
    for name, tensor in tensors.items():
        np.testing.assert_allclose(got[f"{name}.grad"], tensor.grad.numpy(), rtol=RTOL, atol=ATOL, err_msg=name)


def test_chunking_is_left_out_where_not_asked_or_not_possible(tmp_path) -> None:
    _lm(str(tmp_path / "lm.onnx"), transposed=False)
    for options, reason in ((TrainingOptions(loss_chunk=0), ""), (TrainingOptions(loss_chunk=-1), "below the chunk"),
                            (TrainingOptions(loss_chunk=16, loss="mse"), "only cross_entropy"),
                            (TrainingOptions(loss_chunk=16, freeze="head", weights=WeightFormat("int4", 8)),
                             "quantized")):
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
