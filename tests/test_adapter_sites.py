"""Which layers an adapter takes, which it skips and why, and what the summaries say chose the trained set.

LoRA and MemFLoRA skip a site narrower than the rank (a one-channel stem) and refuse only when no site
is left; FuRA-S chooses a block that fits every layer when --block is not given; the output and
report.json name the adapted and the skipped sites; the trained-set chooser and the note on fixed
tables are said where they apply. Hand-built models, the import and adapter passes or a compile of a
few kernels: no device step.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from fblc.cli import main
from fblc.compiler.adapters import AdapterConfig
from fblc.compiler.optimizers import OptimizerConfig
from fblc.compiler.reference import onnxruntime_session
from fblc.compiler.summary import summarize_step, trained_set_source
from fblc.errors import FblcError
from fblc.passes.fura_s import FuraS
from fblc.passes.memory_floor import MemoryFloor
from fblc.passes.pipeline import TrainingOptions, build_training_graph, import_passes, run_passes
from fblc.compiler import keys
from tests.conftest import make_model, mlp_proto


def _conv_net(path: str) -> str:
    """x [2, 1, 6, 6] -> Conv 'stem' (1 -> 4, 3x3) -> Relu -> Conv 'body' (4 -> 4) -> Relu -> pool -> Gemm 'fc'."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "stem.weight"], ["s"], pads=[1, 1, 1, 1], name="stem"),
             helper.make_node("Relu", ["s"], ["sr"], name="stem_relu"),
             helper.make_node("Conv", ["sr", "body.weight"], ["b"], pads=[1, 1, 1, 1], name="body"),
             helper.make_node("Relu", ["b"], ["br"], name="body_relu"),
             helper.make_node("GlobalAveragePool", ["br"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc")]
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 6, 6])],
                         [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3])],
                         {"stem.weight": rng.standard_normal((4, 1, 3, 3)).astype(np.float32),
                          "body.weight": rng.standard_normal((4, 4, 3, 3)).astype(np.float32),
                          "fc.weight": rng.standard_normal((3, 4)).astype(np.float32),
                          "fc.bias": np.zeros(3, np.float32)}), path)
    return path


def _width_32_mlp(path: str) -> str:
    """x [4, 64] -> MatMul 'l0' (64 -> 32) -> Relu -> 'l1' (32 -> 32) -> Relu -> 'l2' (32 -> 10): logits."""
    rng = np.random.default_rng(0)
    nodes, inits, h = [], {}, "x"
    for index, (n_in, n_out) in enumerate([(64, 32), (32, 32), (32, 10)]):
        inits[f"l{index}.weight"] = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        out = "logits" if index == 2 else f"r{index}"
        nodes.append(helper.make_node("MatMul", [h, f"l{index}.weight"], [out if index == 2 else f"m{index}"],
                                      name=f"l{index}"))
        if index < 2:
            nodes.append(helper.make_node("Relu", [f"m{index}"], [out], name=f"relu{index}"))
        h = out
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                         [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 10])], inits), path)
    return path


def _imported(proto_or_path: onnx.ModelProto | str) -> ir.Model:
    model = ir.from_proto(proto_or_path if isinstance(proto_or_path, onnx.ModelProto) else onnx.load(proto_or_path))
    return run_passes(model, import_passes(TrainingOptions()))


def _compiled(capsys: pytest.CaptureFixture[str], model: str, out: str, *flags: str) -> tuple[str, dict]:
    assert main(["compile", model, "-o", out, *flags]) == 0
    return capsys.readouterr().out, json.loads(open(f"{out}/report.json").read())


# LoRA / MemFLoRA: a site narrower than the rank is skipped, and said to be --------------------------

@pytest.mark.parametrize("adapter, trained", [("lora", "both factors of the branch at 1 site"),
                                               ("memflora", "the factor U at 1 site (P stays fixed)")])
def test_a_one_channel_stem_is_skipped_and_the_output_and_report_say_why(tmp_path, capsys, adapter, trained) -> None:
    model = _conv_net(str(tmp_path / "cnn.onnx"))
    printed, report = _compiled(capsys, model, str(tmp_path / "bundle"), "--adapter", adapter, "--rank", "2")
    reason = "--rank 2 is larger than its channels (1 in, 4 out)"
    assert f"adapter {adapter}, rank 2: adapted 1 of 2 sites ('body'); skipped 1:\n  conv 'stem': {reason}" in printed
    assert f"chosen by --adapter {adapter}: {trained};" in printed
    assert report["adapter"]["adapted"] == ["body"]
    assert [(s["node"], s["kind"], s["in"], s["out"], s["reason"]) for s in report["adapter"]["skipped"]] == [
        ("stem", "conv", 1, 4, reason)]
    assert report["memory"]["adapter"]["skipped"] == report["adapter"]["skipped"]


def test_lora_on_linear_layers_skips_the_layer_narrower_than_the_rank() -> None:
    model = _imported(mlp_proto())  # fc1 6 -> 8, fc2 8 -> 3
    MemoryFloor(AdapterConfig("lora", rank=4))(model)
    meta = json.loads(model.metadata_props[keys.ADAPTER])
    assert [(s["conv"], s["kind"]) for s in meta["sites"]] == [("fc1", "linear")]
    assert [(s["node"], s["weight"], s["reason"]) for s in meta["skipped"]] == [
        ("fc2", "w2", "--rank 4 is larger than its features (8 in, 3 out)")]


def test_no_site_left_is_refused_naming_every_site_and_the_largest_rank_that_fits(tmp_path, capsys) -> None:
    model = _conv_net(str(tmp_path / "cnn.onnx"))
    with pytest.raises(FblcError) as error:
        MemoryFloor(AdapterConfig("memflora", rank=5))(_imported(model))
    assert error.value.one_line() == (
        "--rank 5 is larger than the channels of every one of the 2 adapter sites: conv 'stem' (1 in, 4 out), "
        "conv 'body' (4 in, 4 out); use --rank 4 or less (the largest rank that fits a site)")
    assert main(["compile", model, "-o", str(tmp_path / "bundle"), "--adapter", "lora", "--rank", "5"]) == 2
    assert "conv 'stem' (1 in, 4 out)" in capsys.readouterr().err and not (tmp_path / "bundle").exists()


def test_the_step_with_a_skipped_layer_gives_pytorchs_loss_and_gradients() -> None:
    """mlp_proto under LoRA rank 4: fc1 carries the branch, fc2 (3 outputs) stays frozen; onnxruntime runs
    the step, PyTorch autograd the same layers written out."""
    step = build_training_graph(ir.from_proto(mlp_proto()), TrainingOptions(
        optimizer=OptimizerConfig("sgd", lr=0.1), adapter=AdapterConfig("lora", rank=4)))
    assert sorted(v.name for v in step.graph.inputs if keys.get_role(v) == "param") == [
        "w1.adapter_A", "w1.adapter_B"]
    proto = ir.to_proto(step)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in mlp_proto().graph.initializer}  # fc2 is w2 [8, 3]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    labels = np.array([0, 2, 1, 2], np.int64)
    factors = {"w1.adapter_A": step.graph.initializers["w1.adapter_A"].const_value.numpy(),
               "w1.adapter_B": rng.normal(0, 0.1, (4, 8)).astype(np.float32)}  # B nonzero: A has a gradient
    session = onnxruntime_session(proto)  # fed the factors over their initializers
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x, "labels": labels, **factors})))
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in factors.items()}
    w = {k: torch.tensor(v) for k, v in weights.items()}
    xt = torch.from_numpy(x)
    hidden = torch.relu(F.linear(xt, w["w1"], w["b1"]) + (xt @ tensors["w1.adapter_A"]) @ tensors["w1.adapter_B"])
    loss = F.cross_entropy(hidden @ w["w2"] + w["b2"], torch.from_numpy(labels))
    loss.backward()
    assert float(got["loss"]) == pytest.approx(loss.item(), rel=1e-5)
    for key, tensor in tensors.items():
        want = tensor.grad.numpy()
        assert np.abs(want).max() > 0, key
        np.testing.assert_allclose(got[f"{key}.grad"], want, rtol=1e-4, atol=1e-6, err_msg=key)


# FuRA-S: a block that fits, the layers adapted and skipped --------------------------------------------

def test_fura_s_without_block_chooses_one_that_fits_every_layer_of_a_width_32_mlp(tmp_path, capsys) -> None:
    path = _width_32_mlp(str(tmp_path / "mlp.onnx"))
    model = _imported(path)
    FuraS(AdapterConfig(kind="fura-s"))(model)
    meta = json.loads(model.metadata_props[keys.FURA_S])
    assert meta["block"] == 32 and [s["node"] for s in meta["sites"]] == ["l0", "l1", "l2"]
    assert not meta["skipped_sites"]
    printed, report = _compiled(capsys, path, str(tmp_path / "bundle"), "--adapter", "fura-s")
    assert ("adapter fura-s, block 32 (chosen: the largest power of two <= 64 that divides every adapted layer's "
            "input features; --block sets it): adapted 3 of 3 layers ('l0', 'l1', 'l2')") in printed
    values = 2 * 32 + 32 + 10  # K * min(out, block) per layer
    assert (f"trains 1 tensor ({values} values), chosen by --adapter fura-s: the block singular values of 3 layers "
            "(block 32);") in printed
    assert report["adapter"]["block"] == 32 and report["adapter"]["adapted"] == ["l0", "l1", "l2"]


def test_fura_s_with_block_64_lists_the_layers_it_skips(tmp_path, capsys) -> None:
    path = _width_32_mlp(str(tmp_path / "mlp.onnx"))
    printed, report = _compiled(capsys, path, str(tmp_path / "bundle"), "--adapter", "fura-s", "--block", "64")
    assert ("adapter fura-s, block 64 (given by --block): adapted 1 of 3 layers ('l0'); skipped 2:\n"
            "  'l1' (weight 'l1.weight'): block 64 is wider than its 32 input features\n"
            "  'l2' (weight 'l2.weight'): block 64 is wider than its 32 input features") in printed
    assert "trains 1 tensor (32 values), chosen by --adapter fura-s: the block singular values of 1 layer (block 64)" \
        in printed
    assert [(s["node"], s["in"]) for s in report["adapter"]["skipped"]] == [("l1", 32), ("l2", 32)]


def test_a_given_block_that_fits_no_layer_names_the_layers_input_widths(tmp_path, capsys) -> None:
    path = _width_32_mlp(str(tmp_path / "mlp.onnx"))
    assert main(["train-graph", path, "-o", str(tmp_path / "step.onnx"), "--adapter", "fura-s", "--block", "5"]) == 2
    assert capsys.readouterr().err == (
        "fblc: error: --adapter fura-s found no site for --block 5: it divides the input features of no MatMul/Gemm "
        "layer (input features: 32 ('l1', 'l2'), 64 ('l0')); leave --block out (--block 32 fits every layer), or "
        "give a --block that divides some layers' input features\n")


# what chose the trained set, and the note on fixed tables ---------------------------------------------

DEFAULT_RULE = "every float initializer but BatchNorm statistics (the ONNX file names no parameters)"


@pytest.mark.parametrize("options, chooser", [
    (TrainingOptions(), DEFAULT_RULE),
    (TrainingOptions(freeze="fc2|b2"), f"--freeze 'fc2|b2' over {DEFAULT_RULE}"),
    (TrainingOptions(adapter=AdapterConfig("lora", rank=2)), "--adapter lora: both factors of the branch at 2 sites"),
    (TrainingOptions(adapter=AdapterConfig("lora", rank=4), train="adapter_B"),
     "--train 'adapter_B' over --adapter lora: both factors of the branch at 1 site"),
    (TrainingOptions(adapter=AdapterConfig("fura-s", block=2)),
     "--adapter fura-s: the block singular values of 2 layers (block 2)"),
])
def test_the_summary_names_what_chose_the_trained_set(options, chooser) -> None:
    step = build_training_graph(ir.from_proto(mlp_proto()), options)
    assert trained_set_source(step.graph) == chooser
    assert f"trained tensors, chosen by {chooser}:" in summarize_step(step)


def _table_model(gathered: bool) -> onnx.ModelProto:
    """A table added to the input (x + positions), or token embeddings gathered at the input ids plus a
    table gathered at fixed positions; then Gemm 'fc' (6 -> 3)."""
    rng = np.random.default_rng(0)
    inits = {"fc.weight": rng.standard_normal((3, 6)).astype(np.float32), "fc.bias": np.zeros(3, np.float32)}
    if gathered:
        inits.update({"tokens": rng.standard_normal((10, 6)).astype(np.float32),
                      "positions": rng.standard_normal((8, 6)).astype(np.float32),
                      "position_ids": np.arange(4, dtype=np.int64)})
        nodes = [helper.make_node("Gather", ["tokens", "ids"], ["t"], name="embed"),
                 helper.make_node("Gather", ["positions", "position_ids"], ["p"], name="embed_positions"),
                 helper.make_node("Add", ["t", "p"], ["h"], name="add")]
        inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, [4])]
    else:
        inits["positions"] = rng.standard_normal((4, 6)).astype(np.float32)
        nodes = [helper.make_node("Add", ["x", "positions"], ["h"], name="add")]
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])]
    nodes.append(helper.make_node("Gemm", ["h", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc"))
    return make_model(nodes, inputs, [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 3])], inits)


NOTE = "(read as a table, not as a layer's weight): a torch parameter with requires_grad=False"


@pytest.mark.parametrize("proto, options, noted", [
    (_table_model(gathered=False), TrainingOptions(), "positions"),
    (_table_model(gathered=True), TrainingOptions(), "positions"),  # not tokens: gathered at the input ids
    (_table_model(gathered=False), TrainingOptions(freeze="positions"), None),
    (_table_model(gathered=False), TrainingOptions(adapter=AdapterConfig("lora", rank=2)), None),
    (mlp_proto(), TrainingOptions(), None),
])
def test_the_fixed_table_note_is_printed_only_where_a_trained_tensor_is_read_as_a_table(proto, options,
                                                                                        noted) -> None:
    text = summarize_step(build_training_graph(ir.from_proto(proto), options))
    if noted is None:
        assert "requires_grad" not in text, text
    else:
        assert f"note on {noted} {NOTE}" in text, text


def test_check_counts_the_sites_the_rank_fits_and_names_the_skipped_one(tmp_path, capsys) -> None:
    assert main(["check", _conv_net(str(tmp_path / "cnn.onnx"))]) == 0
    assert "lora: yes - 1 conv site, 1 skipped (conv 'stem': --rank 2 is larger than its channels (1 in, 4 out))" \
        in capsys.readouterr().out
