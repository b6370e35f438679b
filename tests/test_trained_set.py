"""The trained set: what the exporter records, what the summary, `fblc check` and report.json say about it.

The dynamo exporter records parameters and buffers, but not `requires_grad`: a frozen torch
parameter (Whisper's `embed_positions.weight`) is exported as a parameter like any other. fblc
cannot tell, so every listing of the trained set names it, grouped by layer, and `--freeze`
brings the trained set to torch's.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from fblc.cli import main
from fblc.compiler.model_io import load_model
from fblc.compiler.summary import group_by_layer, summarize_step, trained_tensors
from fblc.passes.pipeline import TrainingOptions, build_training_graph


class FrozenTable(torch.nn.Module):
    """Two layers, a frozen positional table (a parameter without grad) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(2)])
        self.positions = torch.nn.Parameter(torch.randn(4, 6), requires_grad=False)
        self.register_buffer("offset", torch.randn(6))
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.positions
        for layer in self.layers:
            h = torch.relu(layer(h)) + self.offset
        return self.head(h)


@pytest.fixture(scope="module", params=["dynamo", "legacy"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("trained") / f"frozen_{request.param}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(FrozenTable().eval(), (torch.randn(4, 6),), path, input_names=["x"], output_names=["logits"],
                          dynamo=request.param == "dynamo", optimize=False, opset_version=18)
    return request.param, path


TORCH_TRAINED = {"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "head.weight", "head.bias"}


def _trained(path: str, freeze: str | None = None) -> set[str]:
    step = build_training_graph(load_model(path), TrainingOptions(freeze=freeze))
    return {v.name for v in trained_tensors(step.graph)}


def test_frozen_parameter_trains_by_default_and_freeze_gives_torchs_set(exported: tuple[str, str]) -> None:
    exporter, path = exported
    names = _trained(path)
    positions = {n for n in names if "positions" in n}
    assert positions, f"{exporter}: the frozen table is not in the default set (did the exporter start recording it?)"
    if exporter == "dynamo":  # the buffer is recorded as one and never trains
        assert not any("offset" in n for n in names)
    assert _trained(path, freeze="positions|offset") == TORCH_TRAINED


def test_summary_groups_layers_and_says_how_the_set_was_chosen(exported: tuple[str, str]) -> None:
    exporter, path = exported
    step = build_training_graph(load_model(path), TrainingOptions())
    text = summarize_step(step)
    source = "the exporter's parameter records" if exporter == "dynamo" else "the ONNX file names no parameters"
    assert source in text
    if exporter == "dynamo":
        groups = {g.pattern: g for g in group_by_layer(trained_tensors(step.graph))}
        assert groups["layers.*.weight"].tensors == 2 and groups["layers.*.weight"].values == 72
        assert "layers.*.weight  (2 tensors, 72 values)" in text
    assert "--freeze REGEX" in text


def test_check_and_compile_report_list_the_trained_tensors(exported: tuple[str, str], tmp_path, capsys) -> None:
    _, path = exported
    assert main(["check", path]) == 0
    checked = capsys.readouterr().out
    assert "trained tensors, chosen by" in checked and "positions" in checked
    bundle = tmp_path / "bundle"
    assert main(["compile", path, "--target", "local", "-o", str(bundle), "--freeze", "positions"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((bundle / "report.json").read_text())
    names = {t["name"] for t in report["trained"]["tensors"]}
    assert names == _trained(path, freeze="positions")
    assert f"trains {len(names)} tensors" in printed


class ClsToken(torch.nn.Module):
    """A cls token expanded over the batch: onnxscript's optimizer folds the expansion, token and all."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, 6))
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1))[:, 0]


def test_parameters_the_optimizer_folded_away_are_named(tmp_path) -> None:
    path = str(tmp_path / "cls.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(ClsToken().eval(), (torch.randn(2, 4, 6),), path, input_names=["x"], dynamo=True,
                          optimize=True)
    step = build_training_graph(load_model(path), TrainingOptions())
    assert not any("cls_token" in v.name for v in trained_tensors(step.graph))
    assert ("not trained: onnxscript's optimizer folded 1 torch parameters into constants (cls_token)"
            in summarize_step(step)), summarize_step(step)
