"""lower_recurrent: ONNX RNN, GRU and LSTM unrolled into ops fblc differentiates and runs.

- forward: the imported (unrolled) model in onnxruntime against onnxruntime's own RNN/GRU/LSTM on
  the original node, for each form (directions, initial states, constant and fed sequence_lens,
  clip, linear_before_reset, peepholes, input_forget, activations with alphas and betas, outputs
  read alone); layout 1 (which onnxruntime refuses) against the layout-0 node between Transposes;
- refusals: a dynamic sequence length and an activation outside the table, each naming the node;
- gradients: real exports of nn.GRU, nn.LSTM and nn.RNN (tanh, relu) by the legacy exporter (and
  nn.LSTM by dynamo, which writes the ONNX GRU and LSTM ops too, from Slice/Concat of the torch
  parameters, but decomposes nn.RNN into MatMul/Tanh itself) with
  two layers, bidirectional, batch_first and initial states: one SGD-momentum step's loss, every
  gradient and every updated parameter against torch autograd + torch.optim (support/steps.py);
- one training step on PoCL of a GRU and an LSTM (a merged step, support/merged_steps.py) against
  onnxruntime, in image and buffer storage.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler.optimizers import OptimizerConfig
from fblc.compiler.summary import table_like_trained
from fblc.errors import ShapeError, UnsupportedOpError
from fblc.passes.lower_recurrent import LOWERINGS
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes
from fblc.tools.coverage import check_model
from support.models import ExportedModel
from support.steps import TorchTrainer, build_step
from tests.support import merged_steps

FORWARD_RTOL, FORWARD_ATOL = 1e-5, 1e-5  # fp32 on both sides, summation order differs
STEP_RTOL, STEP_ATOL = 1e-4, 1e-5  # as test_exported_models.py: fp32 step against fp32 torch
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _node_model(op: str, seed: int, steps: int = 4, batch: int = 2, inputs: int = 3, hidden: int = 5,
                directions: int = 1, layout: int = 0, lens: list[int] | None = None, initial: bool = True,
                peepholes: bool = False, outputs: tuple[str, ...] = ("Y", "Y_h", "Y_c"), fed_lens: bool = False,
                **attributes: object) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One `op` node on x, its weights, bias and states as initializers, its read outputs as model outputs."""
    rng = np.random.default_rng(seed)
    gates = GATES[op]
    x = rng.standard_normal((batch, steps, inputs) if layout else (steps, batch, inputs)).astype(np.float32)
    inits = {"W": rng.uniform(-0.7, 0.7, (directions, gates * hidden, inputs)),
             "R": rng.uniform(-0.7, 0.7, (directions, gates * hidden, hidden)),
             "B": rng.uniform(-0.5, 0.5, (directions, 2 * gates * hidden))}
    feeds = {"x": x}
    names = ["x", "W", "R", "B", "lens" if lens is not None else ""]
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)]
    if lens is not None and fed_lens:
        feeds["lens"] = np.asarray(lens, np.int32)
        graph_inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, [batch]))
    state = (batch, directions, hidden) if layout else (directions, batch, hidden)
    names += ["h0" if initial else "", "c0" if initial and op == "LSTM" else ""]
    if initial:
        inits["h0"] = rng.standard_normal(state)
        if op == "LSTM":
            inits["c0"] = rng.standard_normal(state)
    if peepholes:
        inits["P"] = rng.uniform(-0.5, 0.5, (directions, 3 * hidden))
        names.append("P")
    arrays = {k: np.asarray(v, np.float32) for k, v in inits.items()}
    if lens is not None and not fed_lens:
        arrays["lens"] = np.asarray(lens, np.int32)
    read = [o if o in outputs else "" for o in ("Y", "Y_h", "Y_c")[: 3 if op == "LSTM" else 2]]
    direction = attributes.pop("direction", "bidirectional" if directions == 2 else "forward")
    node = helper.make_node(op, names[: 8 if op == "LSTM" else 6], read, name=f"{op.lower()}_node",
                            hidden_size=hidden, direction=direction, layout=layout, **attributes)
    graph = helper.make_graph([node], "recurrent", graph_inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in read if o],
                              initializer=[numpy_helper.from_array(v, k) for k, v in arrays.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), feeds


def _imported(model: onnx.ModelProto) -> onnx.ModelProto:
    return ir.to_proto(run_passes(ir.from_proto(model), import_passes(TrainingOptions())))


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


#: id -> (op, _node_model's options)
FORMS: dict[str, tuple[str, dict[str, object]]] = {}
for _op in GATES:
    FORMS.update({
        f"{_op}-bidirectional": (_op, {"directions": 2}),
        f"{_op}-reverse-no-initial-state": (_op, {"direction": "reverse", "initial": False}),
        f"{_op}-lens-reverse": (_op, {"direction": "reverse", "lens": [3, 1]}),
        f"{_op}-fed-lens-bidirectional": (_op, {"directions": 2, "lens": [2, 3], "fed_lens": True}),
        f"{_op}-clip": (_op, {"directions": 2, "clip": 0.7}),
    })
FORMS.update({
    "GRU-linear-before-reset": ("GRU", {"directions": 2, "linear_before_reset": 1}),
    "GRU-linear-before-reset-lens-clip": ("GRU", {"linear_before_reset": 1, "lens": [2, 4], "clip": 0.5}),
    "GRU-Y_h-only": ("GRU", {"outputs": ("Y_h",)}),
    "LSTM-peepholes": ("LSTM", {"directions": 2, "peepholes": True}),
    "LSTM-input-forget": ("LSTM", {"input_forget": 1, "peepholes": True}),
    "LSTM-Y_c-only": ("LSTM", {"outputs": ("Y_c",)}),
    "RNN-relu": ("RNN", {"activations": ["Relu"]}),
    "RNN-leaky-hard-sigmoid": ("RNN", {"directions": 2, "activations": ["LeakyRelu", "HardSigmoid"],
                                       "activation_alpha": [0.3, 0.4], "activation_beta": [0.6]}),
    "RNN-thresholded-relu": ("RNN", {"activations": ["ThresholdedRelu"], "activation_alpha": [0.2]}),
    "GRU-hard-sigmoid-scaled-tanh": ("GRU", {"activations": ["HardSigmoid", "ScaledTanh"],
                                             "activation_alpha": [0.3, 0.9], "activation_beta": [0.6, 1.1]}),
    "LSTM-hard-sigmoid-affine-elu": ("LSTM", {"activations": ["HardSigmoid", "Affine", "Elu"],
                                              "activation_alpha": [0.3, 0.9, 0.7], "activation_beta": [0.6, 0.1]}),
    "LSTM-softsign-softplus": ("LSTM", {"activations": ["sigmoid", "Softsign", "Softplus"]}),
})


@pytest.mark.parametrize("form", list(FORMS))
def test_unrolled_forward_matches_onnxruntime(form: str) -> None:
    op, options = FORMS[form]
    model, feeds = _node_model(op, seed=len(form), **options)  # type: ignore[arg-type]
    lowered = _imported(model)
    assert not {n.op_type for n in lowered.graph.node} & set(LOWERINGS)
    got, want = _ort(lowered, feeds), _ort(model, feeds)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=FORWARD_RTOL, atol=FORWARD_ATOL, err_msg=f"{form} {name}")


def _transposed_states(model: onnx.ModelProto) -> onnx.ModelProto:
    """The layout-1 `model` as a layout-0 node between Transposes (onnxruntime runs layout 0 only)."""
    graph = model.graph
    node = graph.node[0]
    for init in graph.initializer:
        if init.name in ("h0", "c0"):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).transpose(1, 0, 2).copy(), init.name))
    renamed = {o: f"{o}_layout0" for o in node.output if o}
    moves = [helper.make_node("Transpose", ["x"], ["x_layout0"], perm=[1, 0, 2])]
    moves += [helper.make_node("Transpose", [renamed[o]], [o], perm=[2, 0, 1, 3] if o == "Y" else [1, 0, 2])
              for o in renamed]
    node.input[0] = "x_layout0"
    node.output[:] = [renamed.get(o, o) for o in node.output]
    for attribute in node.attribute:
        if attribute.name == "layout":
            attribute.i = 0
    nodes = [moves[0], node, *moves[1:]]
    del graph.node[:]
    graph.node.extend(nodes)
    return model


@pytest.mark.parametrize("op", list(GATES))
def test_batch_first_layout_matches_layout_0(op: str) -> None:
    model, feeds = _node_model(op, seed=3, directions=2, layout=1, lens=[3, 4])
    got = _ort(_imported(model), feeds)
    want = _ort(_transposed_states(model), feeds)
    assert set(got) == set(want) and got["Y"].shape == (2, 4, 2, 5)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=FORWARD_RTOL, atol=FORWARD_ATOL, err_msg=name)


def test_dynamic_sequence_length_is_refused_naming_node_and_input() -> None:
    """The import fixes model inputs' shapes (fix_input_shapes): here the length is x's first `n` steps, with n
    fed at run time."""
    model, _ = _node_model("GRU", seed=1)
    graph = model.graph
    graph.input.append(helper.make_tensor_value_info("n", TensorProto.INT64, [1]))
    graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.int64), "zero"))
    graph.node.insert(0, helper.make_node("Slice", ["x", "zero", "n", "zero"], ["first_n"]))
    graph.node[1].input[0] = "first_n"
    with pytest.raises(ShapeError, match="GRU node 'gru_node'.*input X 'first_n'.*--input-shape"):
        _imported(model)


def test_unknown_activation_is_refused_by_name() -> None:
    model, _ = _node_model("RNN", seed=1)
    model.graph.node[0].attribute.append(helper.make_attribute("activations", ["Gelu"]))
    with pytest.raises(UnsupportedOpError, match="RNN node 'rnn_node' uses activation 'Gelu'") as raised:
        _imported(model)
    assert raised.value.ops == ("RNN",)


# ---------------------------------------------------------------- real exports against torch autograd

INPUT, CLASSES = 4, 3


class _Recurrent(torch.nn.Module):
    """A recurrent stack and a linear head reading Y (mean over time), Y_h and Y_c (the last layer's)."""

    def __init__(self, kind: str, hidden: int, layers: int, bidirectional: bool, batch_first: bool,
                 nonlinearity: str = "tanh") -> None:
        super().__init__()
        torch.manual_seed(len(kind) * 10 + hidden)
        extra = {"nonlinearity": nonlinearity} if kind == "RNN" else {}
        self.kind, self.batch_first = kind, batch_first
        self.rnn = getattr(torch.nn, kind)(INPUT, hidden, num_layers=layers, bidirectional=bidirectional,
                                           batch_first=batch_first, **extra)
        width = hidden * (2 if bidirectional else 1) + hidden * (2 if kind == "LSTM" else 1)
        self.head = torch.nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "LSTM":
            y, (h, c) = self.rnn(x, (h0, c0))
            last = torch.cat([h[-1], c[-1]], dim=1)
        else:
            y, h = self.rnn(x, h0)
            last = h[-1]
        return self.head(torch.cat([y.mean(dim=1 if self.batch_first else 0), last], dim=1))


class _Packed(_Recurrent):
    """The stack over a padded batch of sequence lengths `lens` (pack_padded_sequence, lengths in decreasing
    order): the legacy exporter writes them as the node's sequence_lens, fed at run time."""

    def forward(self, x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lens, batch_first=self.batch_first)
        y, state = self.rnn(packed)
        y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, batch_first=self.batch_first, total_length=x.shape[1])
        h, c = state if self.kind == "LSTM" else (state, None)
        last = torch.cat([h[-1], c[-1]], dim=1) if c is not None else h[-1]
        return self.head(torch.cat([y.mean(dim=1 if self.batch_first else 0), last], dim=1))


#: id -> (kind, hidden, layers, bidirectional, batch_first, nonlinearity, dynamo); "packed" in the id: _Packed
EXPORTS = {
    "GRU-2layers-bidirectional-batch-first-legacy": ("GRU", 5, 2, True, True, "tanh", False),
    "LSTM-2layers-bidirectional-legacy": ("LSTM", 4, 2, True, False, "tanh", False),
    "RNN-tanh-bidirectional-batch-first-legacy": ("RNN", 3, 1, True, True, "tanh", False),
    "RNN-relu-2layers-legacy": ("RNN", 6, 2, False, False, "relu", False),
    "LSTM-2layers-batch-first-dynamo": ("LSTM", 3, 2, False, True, "tanh", True),
    "LSTM-packed-bidirectional-legacy": ("LSTM", 4, 1, True, True, "tanh", False),
}


def _exported(name: str, folder: str) -> ExportedModel:
    kind, hidden, layers, bidirectional, batch_first, nonlinearity, dynamo = EXPORTS[name]
    packed = "packed" in name
    module = (_Packed if packed else _Recurrent)(kind, hidden, layers, bidirectional, batch_first, nonlinearity).eval()
    rng = np.random.default_rng(len(name))
    steps, batch, directions = 4, 2, 2 if bidirectional else 1
    x = rng.standard_normal((batch, steps, INPUT) if batch_first else (steps, batch, INPUT)).astype(np.float32)
    inputs = {"x": x, "h0": rng.standard_normal((layers * directions, batch, hidden)).astype(np.float32)}
    if packed:
        inputs = {"x": x, "lens": np.array([4, 2], np.int64)}
    elif kind == "LSTM":
        inputs["c0"] = rng.standard_normal((layers * directions, batch, hidden)).astype(np.float32)
    args = tuple(torch.from_numpy(v) for v in inputs.values())
    path = os.path.join(folder, f"{name}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, args, path, dynamo=True, optimize=False, opset_version=18, verbose=False,
                              input_names=list(inputs))
        else:
            torch.onnx.export(module, args, path, dynamo=False, do_constant_folding=False, opset_version=18,
                              input_names=list(inputs), output_names=["logits"])
    written = [n for n in onnx.load(path).graph.node if n.op_type == kind]
    assert written and all((len(n.input) > 4 and n.input[4] != "") == packed for n in written)  # sequence_lens
    labels = rng.integers(0, CLASSES, size=(batch,)).astype(np.int64)
    target = torch.from_numpy(labels)
    return ExportedModel(name, path, module, inputs, labels,
                         lambda m: torch.nn.functional.cross_entropy(m(*args), target))


SGD = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9)


@pytest.mark.parametrize("name", list(EXPORTS))
def test_exported_step_matches_torch(name: str, tmp_path) -> None:
    model = _exported(name, str(tmp_path))
    step = build_step(model, SGD, str(tmp_path / "step.onnx"))
    assert {link.torch_name for link in step.links.values()} == {n for n, _ in model.module.named_parameters()}
    loss, expected = TorchTrainer(step, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)).train_step()
    got = step.run()
    np.testing.assert_allclose(got["loss"], loss, rtol=STEP_RTOL, atol=STEP_ATOL, err_msg="loss")
    assert set(expected) == set(got) - {"loss"}
    bad = [f"{k}: max abs error {np.abs(got[k] - v).max():.3g}" for k, v in expected.items()
           if got[k].shape != v.shape or not np.allclose(got[k], v, rtol=STEP_RTOL, atol=STEP_ATOL)]
    assert not bad, "\n".join(bad)
    # the exporters build W and R as Concats of the torch weights' gate slices: read as a layer's weights, no table
    assert table_like_trained(ir.load(step.path).graph) == []


# ---------------------------------------------------------------- on the device (PoCL) against onnxruntime

def _device_case(op: str, seed: int, **options: object) -> onnx.ModelProto:
    """`op` at tiny sizes with a scalar loss reading Y and Y_h: ReduceSum(Y * K) + ReduceSum(Y_h)."""
    model, _ = _node_model(op, seed, steps=3, batch=2, inputs=3, hidden=4, outputs=("Y", "Y_h"), **options)
    graph = model.graph
    rng = np.random.default_rng(seed + 100)
    y_shape = (3, 2 if options.get("directions") == 2 else 1, 2, 4)
    graph.initializer.append(numpy_helper.from_array(rng.uniform(-1, 1, y_shape).astype(np.float32), "K"))
    graph.node.extend([helper.make_node("Mul", ["Y", "K"], ["weighted"]),
                       helper.make_node("ReduceSum", ["weighted"], ["y_sum"], keepdims=0),
                       helper.make_node("ReduceSum", ["Y_h"], ["h_sum"], keepdims=0),
                       helper.make_node("Add", ["y_sum", "h_sum"], ["loss"])])
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    return model


DEVICE_CASES = {
    "gru_linear_before_reset": _device_case("GRU", 11, linear_before_reset=1),  # as PyTorch writes it
    "lstm_lens": _device_case("LSTM", 12, lens=[3, 2]),
}


def test_gru_and_lstm_step_on_pocl_match_onnxruntime(tmp_path) -> None:
    """Image storage; buffer storage (verify_merged's storage="buffer") passed by hand too, at another ~12 s of
    PoCL build: the unrolled steps read their Split views at different offsets, so kernels differ per step."""
    options = TrainingOptions(loss="output", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    rows = merged_steps.verify_merged(DEVICE_CASES, options, str(tmp_path))
    for case in DEVICE_CASES:
        merged_steps.assert_case_matches(rows, case, list(DEVICE_CASES))


def test_check_names_the_lowered_ops_and_supports_the_step() -> None:
    model = ir.from_proto(_device_case("LSTM", 13, directions=2, lens=[2, 3]))
    coverage = check_model(model, TrainingOptions(loss="output"))
    assert coverage.supported, (coverage.imports, coverage.trains, coverage.runs)
    assert coverage.lowered == {"LSTM": 1}
    assert not {row.op for row in coverage.rows} & set(LOWERINGS)
