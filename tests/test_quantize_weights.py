"""Quantized frozen weights (issue 40, part 1): the quantize_weights pass, the packed layout, DequantizeLinear.

Golden: with LoRA, every frozen MatMul/Gemm weight becomes DequantizeLinear(q, scale) with groups along its
reduction axis; the adapter's factors and trainable weights stay float. Negative: nothing frozen, nothing
quantized; a bad group size is refused. Numeric: the quantization error and the packing against numpy; a model
that arrives quantized (blocked int4, per-axis uint8 with zero points) runs its step on PoCL against
onnxruntime on that same graph (tests/test_kernels_other.py's harness: rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler import keys
from fblc.compiler.adapters import AdapterConfig
from fblc.compiler.model_io import load_model
from fblc.compiler.quantize import WeightFormat, dequantize, pack_words, quantize, relative_error
from fblc.errors import FblcError
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from tests.conftest import mlp_proto
from tests.test_kernels_other import _check, _randn


def _step(tmp_path, weights: WeightFormat, adapter: str = "lora") -> ir.Model:
    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp_proto(), path)
    options = TrainingOptions(adapter=AdapterConfig(kind=adapter, rank=2, sites="linear") if adapter != "none"
                              else AdapterConfig(), weights=weights)
    return build_training_graph(load_model(path), options)


def test_lora_frozen_weights_become_groups(tmp_path) -> None:
    model = _step(tmp_path, WeightFormat("int4", group=4))
    graph = model.graph
    dequantized = {n.name: n for n in graph if n.op_type == "DequantizeLinear"}
    assert sorted(dequantized) == ["w1.dequantize", "w2.dequantize"]
    # w1 [8, 6] is Gemm's transB operand: K is its axis 1 (groups 4, 2); w2 [8, 3] is MatMul's B: K axis 0
    w1, w2 = (dequantized[f"{w}.dequantize"] for w in ("w1", "w2"))
    assert (w1.attributes["axis"].value, w1.attributes["block_size"].value) == (1, 4)
    assert (w2.attributes["axis"].value, w2.attributes["block_size"].value) == (0, 4)
    assert w1.inputs[0].dtype == ir.DataType.INT4 and list(w1.inputs[1].shape) == [8, 2]
    assert w1.inputs[1].metadata_props[keys.STORAGE] == "fp16"
    assert "w1" not in graph.initializers and model.opset_imports[""] == 21
    factors = [v for v in graph.initializers.values() if keys.ADAPTER_FACTOR in v.metadata_props]
    assert factors and all(v.dtype == ir.DataType.FLOAT for v in factors)
    records = {r["weight"]: r for r in json.loads(model.metadata_props[keys.QUANTIZED])}
    w = mlp_proto().graph.initializer[0]
    assert w.name == "w1"
    array = numpy_helper.to_array(w)
    q, scale = quantize(array, 1, 4, ir.DataType.INT4)
    assert records["w1"]["error"] == pytest.approx(relative_error(array, dequantize(q, scale, None, 1, 4)))
    assert 0.0 < records["w1"]["error"] < 0.2


def test_fp16_weights_in_half_textures(tmp_path) -> None:
    graph = _step(tmp_path, WeightFormat("fp16")).graph
    w1 = graph.initializers["w1"]
    assert w1.metadata_props[keys.STORAGE] == "fp16" and keys.QUANTIZED in w1.metadata_props
    values = w1.const_value.numpy()
    assert np.array_equal(values, values.astype(np.float16).astype(np.float32))
    assert isinstance(w1.const_value, ir.LazyTensor)  # rounded where read: no rounded copy held in host memory
    assert not any(n.op_type == "DequantizeLinear" for n in graph)
    assert {use.node.op_type for use in w1.uses()} <= {"Gemm", "MatMul", "Transpose"}  # no Cast, no copy


def test_trainable_weights_never_quantized(tmp_path) -> None:
    graph = _step(tmp_path, WeightFormat("int8"), adapter="none").graph
    assert not any(n.op_type == "DequantizeLinear" for n in graph)
    with pytest.raises(FblcError, match="weight-group"):
        WeightFormat("int8", group=0).validate()


def test_quantize_pack_and_error() -> None:
    w = _randn(64, 24, seed=3)
    for dtype, bound in ((ir.DataType.INT8, 0.01), (ir.DataType.INT4, 0.15)):
        q, scale = quantize(w, 0, 32, dtype)
        assert scale.shape == (2, 24) and np.array_equal(scale, scale.astype(np.float16).astype(np.float32))
        assert relative_error(w, dequantize(q, scale, None, 0, 32)) < bound
    words = pack_words(np.array([1, -1, 2, -8, 7, 0, 0, 0, 3], np.int8), 4)
    assert words.tolist() == [0x000782F1, 0x3]


def test_quantize_in_slices_equals_whole(monkeypatch) -> None:
    """The pass quantizes a large table a slice of whole groups at a time (bounded host memory): the same q,
    scales and relative error as quantize() of the whole, for groups along either axis and ragged slices."""
    from fblc.passes import quantize_weights
    monkeypatch.setattr(quantize_weights, "SLICE_ELEMENTS", 100)
    w = _randn(37, 50, seed=2)
    for axis, dtype in ((0, ir.DataType.INT4), (1, ir.DataType.INT8)):
        q, scale, error = quantize_weights._quantize_in_slices(w, axis, 8, dtype)
        whole_q, whole_scale = quantize(w, axis, 8, dtype)
        assert np.array_equal(q, whole_q) and np.array_equal(scale, whole_scale)
        assert error == pytest.approx(relative_error(w, dequantize(whole_q, whole_scale, None, axis, 8)), rel=1e-9)
    half = w.astype(np.float16).astype(np.float32)
    assert quantize_weights._relative_error_in_slices(w, half) == pytest.approx(relative_error(w, half), rel=1e-9)


def _nbits_weight(n: int, k: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' B bytes [n, blocks, block / 2] (4 bits, low nibble first), scales [n * blocks], zero point
    bytes, and the dequantized W [n, k] by numpy."""
    grouped = _randn(n, k, seed=5).reshape(n, k // block, block)
    scale = (np.abs(grouped).max(axis=-1) / 7).astype(np.float32)
    zero = np.random.default_rng(6).integers(6, 11, size=(n, k // block)).astype(np.uint8)
    q = np.clip(np.rint(grouped / scale[..., None]) + zero[..., None], 0, 15).astype(np.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    zero_bytes = (zero[:, 0::2] | (zero[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    return packed, scale.reshape(-1), zero_bytes, ((q - zero[..., None].astype(np.float32)) * scale[..., None]
                                                   ).reshape(n, k)


def test_quantized_import_matches_onnxruntime(tmp_path) -> None:
    """A model that arrives quantized: h = x MatMulNBits(W0) (onnxruntime's 4 bits, blocks of 16, uint8 zero
    points), then DQ(q1) per axis (uint8, zero points, the last axis), then DQ(q2) signed int4 in blocks of 4
    along K (axis 0). onnxruntime's own MatMulNBits (and DequantizeLinear) equal numpy's dequantized product; the lowering keeps B's
    bytes (its packed words are B); the step on PoCL equals onnxruntime on the lowered graph."""
    from fblc.compiler.model_io import save_model_atomically
    from fblc.compiler.reference import onnxruntime_session
    from fblc.passes.pipeline import import_passes, run_passes

    packed, scales, zeros, w0 = _nbits_weight(12, 32, 16)
    w1, w2 = _randn(12, 8, seed=4), _randn(8, 6, seed=3)
    s1 = (np.abs(w1).max(axis=0) / 100).astype(np.float32)
    z1 = np.arange(120, 128, dtype=np.uint8)
    q1 = np.clip(np.rint(w1 / s1) + z1, 0, 255).astype(np.uint8)
    q2, s2 = quantize(w2, 0, 4, ir.DataType.INT4)
    nodes = [helper.make_node("MatMulNBits", ["x", "B", "scales", "zeros"], ["h0"], domain="com.microsoft", K=32,
                              N=12, bits=4, block_size=16, name="nbits"),
             helper.make_node("DequantizeLinear", ["q1", "s1", "z1"], ["w1"], axis=1, name="dq1"),
             helper.make_node("DequantizeLinear", ["q2", "s2"], ["w2"], axis=0, block_size=4, name="dq2"),
             helper.make_node("MatMul", ["h0", "w1"], ["h1"], name="mm1"),
             helper.make_node("MatMul", ["h1", "w2"], ["y"], name="mm2"),
             helper.make_node("Mul", ["y", "R"], ["yr"], name="mul"),
             helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0, name="sum")]
    arrays = {"x": _randn(4, 32), "R": _randn(4, 6, seed=1), "B": packed, "scales": scales, "zeros": zeros,
              "q1": q1, "s1": s1, "z1": z1, "s2": s2}
    inits = [numpy_helper.from_array(v, k) for k, v in arrays.items()]
    inits.append(helper.make_tensor("q2", TensorProto.INT4, q2.shape, q2.astype(np.int8).reshape(-1).tolist()))
    graph = helper.make_graph(nodes, "quantized", [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    session = onnxruntime_session(model)  # its int4 DequantizeLinear not fused into int8 arithmetic (reference.py)
    deq1 = dequantize(q1, s1, z1, 1, 0)
    expected = ((arrays["x"] @ w0.T @ deq1 @ dequantize(q2, s2, None, 0, 4)) * arrays["R"]).sum()
    assert session.run(None, {})[0] == pytest.approx(float(expected), rel=1e-4, abs=1e-4)
    path = str(tmp_path / "quantized.onnx")
    save_model_atomically(ir.serde.deserialize_model(model), path)
    lowered = run_passes(load_model(path), import_passes(TrainingOptions()))
    kept = lowered.graph.initializers["B.q"]
    assert kept.dtype == ir.DataType.UINT4 and keys.get_role(kept) == "frozen"
    assert pack_words(kept.const_value.numpy(), 4).view(np.uint8).tobytes() == packed.tobytes()
    _check(tmp_path, model)


def test_fura_s_svd_takes_the_dequantized_weight(tmp_path) -> None:
    """FuRA-S's R spans the row space of each block of the weight the device holds: deq(q(W)) [3, 8] at block 8,
    rank 3 (R R^T projects; the float W's R would leave deq(W)'s quantization error outside its span)."""
    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp_proto(), path)
    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=8, fura_sites="fc2"),
                              weights=WeightFormat("int4", group=4))
    graph = build_training_graph(load_model(path), options).graph
    right = graph.initializers["w2.fura_R"].const_value.numpy()[0].astype(np.float64)  # [8, 3]
    w2 = numpy_helper.to_array(mlp_proto().graph.initializer[2])  # [8, 3]: MatMul's B, K on axis 0
    q, scale = quantize(w2, 0, 4, ir.DataType.INT4)
    stored = dequantize(q, scale, None, 0, 4).T  # [3, 8]
    # R is held in half under int4 (passes/fura_s.HALF_R): the projection errs by its rounding, 2^-11 a column
    # (measured 3.7e-4 relative), far inside the float W's distance from deq(W)'s span (measured 3.0e-2)
    outside = lambda w: np.linalg.norm(w @ right @ right.T - w) / np.linalg.norm(w)  # noqa: E731
    assert outside(stored) < 1.5e-3 and outside(w2.T) > 1e-2
    assert any(n.op_type == "DequantizeLinear" for n in graph)


def _tied_embedding_proto() -> onnx.ModelProto:
    """ids [2, 6] -> Gather(E [20, 16]) -> MatMul(W [16, 16]) -> MatMul(E^T): the LM head tied to the embedding
    (as Llama's and GPT-2's), loss = sum(logits * R)."""
    from tests.conftest import make_model
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"], axis=0, name="embed"),
             helper.make_node("MatMul", ["h", "W"], ["h2"], name="fc"),
             helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0], name="tied"),
             helper.make_node("MatMul", ["h2", "Et"], ["logits"], name="head"),
             helper.make_node("Mul", ["logits", "R"], ["lr"], name="mul"),
             helper.make_node("ReduceSum", ["lr"], ["loss"], keepdims=0, name="sum")]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 6])
    return make_model(nodes, [ids], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                      {"E": _randn(20, 16, seed=7), "W": _randn(16, 16, seed=8, scale=0.3),
                       "R": _randn(2, 6, 20, seed=9)})


def test_tied_embedding_table_quantized(tmp_path) -> None:
    """Golden: a table read by a Gather and (through Transpose) as the head's B becomes one DequantizeLinear,
    grouped along the hidden axis (the head's K, each gathered row's own groups), dequantized in both readers
    (the step test: no dequantize kernel); no gradient of the frozen table. Negative: a table
    some other op reads too stays float."""
    path = str(tmp_path / "tied.onnx")
    onnx.save(_tied_embedding_proto(), path)
    options = TrainingOptions(loss="output", adapter=AdapterConfig(kind="lora", rank=2, sites="linear"),
                              weights=WeightFormat("int4", group=8))
    graph = build_training_graph(load_model(path), options).graph
    table = next(n for n in graph if n.name == "E.dequantize")
    assert (table.attributes["axis"].value, table.attributes["block_size"].value) == (1, 8)
    assert list(table.inputs[1].shape) == [20, 2] and "E" not in graph.initializers
    assert {use.node.name for use in table.outputs[0].uses()} == {"embed", "tied"}  # the Gather, the head's E^T
    # no embedding gradient (full fine-tuning builds one: grad/embed/..., a one-hot MatMul or a scatter)
    assert not any(n.name.startswith("grad/embed/") or n.op_type in ("ScatterND", "ScatterElements") for n in graph)

    fp16 = build_training_graph(load_model(path), replace(options, weights=WeightFormat("fp16"))).graph
    table = fp16.initializers["E"]  # rounded to fp16, a half texture both readers read: no Cast, no copy
    assert table.metadata_props[keys.STORAGE] == "fp16" and {u.node.name for u in table.uses()} == {"embed", "tied"}

    proto = _tied_embedding_proto()
    proto.graph.node.append(helper.make_node("Relu", ["E"], ["E_relu"], name="other"))
    proto.graph.output.append(helper.make_tensor_value_info("E_relu", TensorProto.FLOAT, [20, 16]))
    onnx.save(proto, path)
    graph = build_training_graph(load_model(path), options).graph
    assert "E" in graph.initializers and not any(n.name == "E.dequantize" for n in graph)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_tied_embedding_step_matches_onnxruntime(tmp_path, weights: str) -> None:
    """Numeric: the LoRA step (forward and backward: the head's input gradient reads E too) on PoCL equals
    onnxruntime on the same quantized step graph (rtol 1e-4, atol 1e-5: tools/verify.compare)."""
    from fblc.tools.verify import verify_model
    path = str(tmp_path / "tied.onnx")
    onnx.save(_tied_embedding_proto(), path)
    bundle = str(tmp_path / "bundle")
    options = TrainingOptions(loss="output", adapter=AdapterConfig(kind="lora", rank=2, sites="linear"),
                              weights=WeightFormat(weights, group=8))
    rows = verify_model(path, options, keep_bundle=bundle)
    assert rows and not [r for r in rows if not r.ok]
    plan = json.loads(open(f"{bundle}/plan.json").read())
    assert not any(k["family"] == "dequantize" for k in plan["kernels"])  # dequantized in registers


def _conv_model() -> onnx.ModelProto:
    """x + b (b trains), a 3x3 Conv (C_in 4), a depthwise 3x3 stride 2, a 1x1 Conv over 3 x 3 planes (texels
    straddle them: its input gradient reads W^T, pointwise_transposes), loss = sum(y * R)."""
    from tests.conftest import make_model
    nodes = [helper.make_node("Add", ["x", "b"], ["h0"], name="bias"),
             helper.make_node("Conv", ["h0", "w1"], ["h1"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Conv", ["h1", "w2"], ["h2"], pads=[1, 1, 1, 1], strides=[2, 2], group=8, name="dw"),
             helper.make_node("Conv", ["h2", "w3"], ["y"], name="pw"),
             helper.make_node("Mul", ["y", "R"], ["yr"], name="mul"),
             helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0, name="sum")]
    inits = {"x": _randn(2, 4, 5, 6), "b": _randn(4, 1, 1, seed=1), "w1": _randn(8, 4, 3, 3, seed=2),
             "w2": _randn(8, 1, 3, 3, seed=3), "w3": _randn(6, 8, 1, 1, seed=4), "R": _randn(2, 6, 3, 3, seed=5)}
    return make_model(nodes, [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_conv_weights_dequantized_in_their_loads(tmp_path, weights: str) -> None:
    """Golden: frozen Conv weights become DequantizeLinear (group 4: w1 [8, 4, 3, 3] and w3 [6, 8, 1, 1] in groups
    of 4 input channels at one tap, axis 1; the depthwise w2 [8, 1, 3, 3] one scale per output channel, axis 0);
    every conv kernel (forward Convs, the input gradients' ConvTransposes, the 1x1's Conv over W^T, whose integers
    pointwise_transposes transposed at compile time) dequantizes as it loads: no DequantizeLinear or Transpose
    kernel in the plan. Numeric: the step (int8: image storage, int4: buffer) on PoCL equals onnxruntime on the same
    quantized graph (fblc verify's tolerances)."""
    from fblc.tools.verify import verify_model
    from tests.test_kernels_other import SGD
    path = str(tmp_path / "conv.onnx")
    onnx.save(_conv_model(), path)
    options = TrainingOptions(loss="output", optimizer=SGD, train="^b$", weights=WeightFormat(weights, group=4))
    graph = build_training_graph(load_model(path), options).graph
    dequantized = {n.name: n for n in graph if n.op_type == "DequantizeLinear"}
    assert sorted(dequantized) == ["w1.dequantize", "w2.dequantize", "w3.dequantize"]
    axes = {name.split(".")[0]: (n.attributes["axis"].value, n.attributes.get("block_size")) for name, n in
            dequantized.items()}
    assert axes["w1"][0] == axes["w3"][0] == 1 and axes["w1"][1].value == axes["w3"][1].value == 4
    assert axes["w2"] == (0, None) and list(dequantized["w2.dequantize"].inputs[1].shape) == [8]
    for storage in ("buffer",) if weights == "int4" else ("image",):
        bundle = str(tmp_path / f"bundle_{storage}")
        rows = verify_model(path, options, storage=storage, keep_bundle=bundle)
        assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]
        with open(f"{bundle}/plan.json") as plan:
            kernels = [k["name"] for k in json.load(plan)["kernels"]]
        assert not [k for k in kernels if k.endswith(("_DequantizeLinear", "_Transpose"))], kernels
        assert sum("ConvTranspose" in k for k in kernels) == 2 and sum(k.endswith("_Conv") for k in kernels) == 4


def test_a_retry_reuses_the_first_builds_quantization(tmp_path, monkeypatch) -> None:
    """reused_quantization (a --device-memory retry's scope, codegen.compile.build_program): a weight read again
    from the same external data is not quantized again, and its q has the values of a build outside the scope;
    another group size is quantized anew. Graph mode, the test MLP's two weights."""
    from fblc.passes import quantize_weights

    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp_proto(), path, save_as_external_data=True, location="mlp.onnx.data", size_threshold=0)
    options = TrainingOptions(adapter=AdapterConfig(kind="lora", rank=2, sites="linear"),
                              weights=WeightFormat("int4", group=4))
    runs = []
    quantize = quantize_weights._quantize_in_slices
    monkeypatch.setattr(quantize_weights, "_quantize_in_slices", lambda *a, **k: runs.append(1) or quantize(*a, **k))

    def quantized(options: TrainingOptions) -> tuple[int, dict[str, np.ndarray]]:
        before = len(runs)
        model = build_training_graph(load_model(path), options)
        return len(runs) - before, {v.name: v.const_value.numpy() for v in model.graph.initializers.values()
                                    if v.name.endswith(".q")}

    alone = quantized(options)
    with quantize_weights.reused_quantization():
        first, again = quantized(options), quantized(options)
        other = quantized(replace(options, weights=WeightFormat("int4", group=2)))
    assert [alone[0], first[0], again[0], other[0]] == [2, 2, 0, 2]
    for name, q in alone[1].items():
        assert np.array_equal(q, again[1][name]) and np.array_equal(q, first[1][name])
    assert quantize_weights._REUSED is None  # the scope closed: nothing kept
