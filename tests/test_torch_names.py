"""Torch names: the exporters' `val_*` and `onnx::MatMul_*` initializers are recorded as the torch parameters
they are, `--train`/`--freeze` take either name, listings and the manifest show them; and onnxruntime loads a
`fblc train-graph` step without a warning per parameter. Compile-level and onnxruntime only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from typing import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from torch import nn

from fblc.cli import main
from fblc.codegen.compile import compile_model
from fblc.compiler.model_io import load_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.compiler.optional_state import input_defaults
from fblc.compiler.summary import trained_set_lines, trained_tensors
from fblc.compiler.torch_names import renamed_note, torch_name_of, torch_state_dict
from fblc.errors import TrainableSetError
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from tests.conftest import mlp_proto
from tests.test_bad_values import refused
from tests.support import zoo

EXPORTERS = ("dynamo_opt", "dynamo", "legacy")


class Stack(nn.Module):
    """Three Linears on [2, 3, 6]: the legacy exporter writes each weight transposed as `onnx::MatMul_N`
    (3-D input), onnxscript's optimizer as `val_N`; fc2 has no bias to anchor its module path."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class EmbedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


MODULES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "stack": (Stack, lambda: torch.randn(2, 3, 6)),
    "embed_head": (EmbedHead, lambda: torch.randint(0, 10, (2, 3))),
}


def _export(module: nn.Module, example: torch.Tensor, stem: str) -> dict[str, str]:
    """`module` through each exporter (one dynamo trace, saved before and after onnxscript's optimizer)."""
    paths = {exporter: f"{stem}_{exporter}.onnx" for exporter in EXPORTERS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (example,), paths["legacy"], dynamo=False, opset_version=18)
        program = torch.onnx.export(module, (example,), dynamo=True, optimize=False, opset_version=18, verbose=False)
        program.save(paths["dynamo"])
        program.optimize()
        program.save(paths["dynamo_opt"])
    return paths


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, dict[str, str]]]:
    folder = tmp_path_factory.mktemp("torch_names")
    torch.manual_seed(0)
    built = {}
    for name, (make, example) in MODULES.items():
        module = make().eval()
        built[name] = (module, _export(module, example(), str(folder / name)))
    return built


def _step(path: str, **options: object) -> ir.Model:
    return build_training_graph(load_model(path), TrainingOptions(**options))  # type: ignore[arg-type]


def _torch_value(module: nn.Module, value: ir.Value) -> np.ndarray:
    """The torch parameter `value` records, in the ONNX tensor's layout."""
    recorded = torch_name_of(value)
    assert recorded is not None, f"'{value.name}' records no torch name"
    array = module.state_dict()[recorded.name].detach().numpy()  # tied weights under each of their names
    return array.T if recorded.transposed else array


def _trained_torch_names(step: ir.Model, module: nn.Module) -> set[str]:
    """The torch names of the trained tensors, each checked by value against the torch parameter."""
    names = set()
    for value in trained_tensors(step.graph):
        np.testing.assert_array_equal(value.const_value.numpy(), _torch_value(module, value), err_msg=value.name)
        names.add(torch_name_of(value).name)  # type: ignore[union-attr]
    return names


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", MODULES)
def test_each_trained_tensor_records_the_torch_parameter_it_is(exports, name, exporter) -> None:
    module, paths = exports[name]
    step = _step(paths[exporter])
    assert _trained_torch_names(step, module) == {n for n, _ in module.named_parameters()}
    listing = "\n".join(trained_set_lines(step.graph))
    assert "onnx::" not in listing and "val_" not in listing, listing


TORCH_PATTERNS = {  # module -> (--train, what it trains; --freeze, what then trains)
    "stack": (r"^fc2\.weight$", {"fc2.weight"}, r"^fc3\.", {"fc1.weight", "fc1.bias", "fc2.weight"}),
    "embed_head": (r"head\.weight", {"head.weight"}, r"^head\.", {"emb.weight"}),
}


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", MODULES)
def test_train_and_freeze_take_torch_names(exports, name, exporter) -> None:
    module, paths = exports[name]
    train, trained, freeze, left = TORCH_PATTERNS[name]
    assert _trained_torch_names(_step(paths[exporter], train=train), module) == trained
    assert _trained_torch_names(_step(paths[exporter], freeze=freeze), module) == left


def test_a_pattern_that_matches_nothing_lists_torch_names(exports) -> None:
    _, paths = exports["stack"]
    with pytest.raises(TrainableSetError) as refusal:
        _step(paths["legacy"], train="nothing_like_this")
    message = str(refusal.value)
    assert "fc1.weight" in message and "fc3.weight" in message and "onnx::" not in message, message


@pytest.mark.parametrize("arch, pattern, expected", [
    ("llama", "up_proj", {"model.layers.0.mlp.up_proj.weight"}),  # dynamo + onnxscript: a `val_N`
    # Falcon's own `weight.T`, folded into a constant named after its FX node (`permute_2`)
    ("falcon", "dense_h_to_4h", {"transformer.h.0.mlp.dense_h_to_4h.weight"}),
    # legacy: `onnx::MatMul_N` under `/decoder/...`, whose module path lacks the `model.` of the torch name
    ("opt", r"self_attn\.q_proj", {"model.decoder.layers.0.self_attn.q_proj.weight",
                                   "model.decoder.layers.0.self_attn.q_proj.bias"}),
])
def test_torch_regexes_select_the_tensors_of_transformers_models(tmp_path, arch, pattern, expected) -> None:
    exported = zoo.build(zoo.BY_NAME[arch], str(tmp_path))
    step = _step(exported.path, train=pattern)
    assert _trained_torch_names(step, exported.module) == expected
    frozen = _step(exported.path, freeze=pattern)
    assert not _trained_torch_names(frozen, exported.module) & expected


def test_the_manifest_names_each_parameter_as_torch_does(exports, tmp_path) -> None:
    """A bundle of the legacy export: each parameter entry carries its torch name; the arrays `--save-params`
    would write (ONNX names) become a state dict torch loads, and the note after saving names the renames."""
    module, paths = exports["stack"]
    compile_model(paths["legacy"], str(tmp_path / "bundle"), "adreno830", "fp32", TrainingOptions())
    with open(tmp_path / "bundle" / "manifest.json") as handle:
        entries = json.load(handle)["parameters"]
    assert {e["torch_name"] for e in entries} == {n for n, _ in module.named_parameters()}
    assert all(e["name"].startswith("onnx::MatMul") == e.get("torch_transposed", False) for e in entries)
    saved = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(paths["legacy"]).graph.initializer}
    fresh = Stack().eval()
    fresh.load_state_dict({k: torch.tensor(v) for k, v in torch_state_dict(saved, entries).items()})
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(fresh(x), module(x), rtol=0, atol=0)
    note = renamed_note(entries)
    assert note is not None and "3 of them" in note and "is fc1.weight transposed" in note, note


ORT_LOG = """
import sys, numpy as np, onnxruntime as ort
options = ort.SessionOptions()
options.log_severity_level = 1
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
session.run(None, {"x": np.zeros((4, 6), np.float32), "labels": np.zeros(4, np.int64)})
"""


def _run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def test_onnxruntime_loads_a_train_graph_step_without_a_warning_and_it_computes_the_same(tmp_path, capsys) -> None:
    """The step file's parameters and optimizer state stay inputs that default to their current values: run
    without them it equals the step graph (state inputs that are also initializers) run the same way, and
    fed the next state it equals that step's second step."""
    model, out = str(tmp_path / "mlp.onnx"), str(tmp_path / "step.onnx")
    onnx.save(mlp_proto(), model)
    assert main(["train-graph", model, "-o", out, "-q", "--optimizer", "adam", "--lr", "0.05"]) == 0
    log = subprocess.run([sys.executable, "-c", ORT_LOG, out], capture_output=True, text=True, check=True).stderr
    assert "appears in graph inputs" not in log and "[W:" not in log, log
    plain = ir.to_proto(_step(model, optimizer=OptimizerConfig("adam", lr=0.05)))
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((4, 6)).astype(np.float32), "labels": np.array([0, 1, 2, 1])}
    first, reference = _run(out, batch), _run(plain, batch)
    assert first.keys() == reference.keys()
    for name in reference:
        np.testing.assert_array_equal(first[name], reference[name], err_msg=name)
    state = {name[: -len(".new")]: value for name, value in reference.items() if name.endswith(".new")}
    assert state.keys() == input_defaults(onnx.load(out)).keys() == input_defaults(plain).keys()
    second, reference = _run(out, {**batch, **state}), _run(plain, {**batch, **state})
    for name in reference:
        np.testing.assert_array_equal(second[name], reference[name], err_msg=name)


def test_plain_state_inputs_keep_initializers_as_input_defaults(tmp_path) -> None:
    """For importers without optional types (TVM's): the plain form, each state input also an initializer."""
    model, out = str(tmp_path / "mlp.onnx"), str(tmp_path / "step.onnx")
    onnx.save(mlp_proto(), model)
    assert main(["train-graph", model, "-o", out, "-q", "--plain-state-inputs"]) == 0
    step = onnx.load(out)
    initializers = {t.name for t in step.graph.initializer}
    states = [i.name for i in step.graph.input if i.name in initializers]
    assert states and not any(i.type.HasField("optional_type") for i in step.graph.input)
    assert set(states) == set(input_defaults(step)) >= {"w1", "b1", "w2", "b2"}


def test_a_model_value_named_like_a_state_read_is_refused_not_duplicated(tmp_path, capsys) -> None:
    """The optional-state form adds `P.value` per state input: a model value of that name is a clear refusal,
    not an ONNX file with two values of one name."""
    proto = mlp_proto()
    for node in proto.graph.node:
        node.input[:] = ["w1.value" if name == "h" else name for name in node.input]
        node.output[:] = ["w1.value" if name == "h" else name for name in node.output]
    model = str(tmp_path / "mlp.onnx")
    onnx.save(proto, model)
    message = refused(capsys, str(tmp_path), "train-graph", model, "-o", str(tmp_path / "step.onnx"))
    assert message == ("the step reads its input 'w1' through a value named 'w1.value', a name the model already "
                       "uses; rename that tensor in the model, or write the step with --plain-state-inputs")
