"""One training step of real exported models, in onnxruntime, against PyTorch autograd + torch.optim.

For each model (transformers models through the dynamo and legacy exporters, with and without
onnxscript's optimizer, and fblc's own builders) and each optimizer, fblc builds step.onnx;
onnxruntime runs it; the loss, every `P.grad`, every `P.new` and every optimizer state
`S.new` must equal what torch computes for the same module in eval mode (BN on running
statistics, dropout off), within fp32 tolerances. The trainable set must be the torch
parameter set. A second AdamW step, fed from the first step's `.new` outputs, must also
match.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from support import models
from support.models import ExportedModel, Link

# fp32 on both sides; differences come from summation order only
RTOL, ATOL = 1e-4, 1e-5

# the T-ResNet reference uses torch's padding='same' for its even kernel on purpose
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")

TorchOptimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, tuple[OptimizerConfig, TorchOptimizer]] = {
    "sgd": (OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4),
            lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)),
    "adamw": (OptimizerConfig(name="adamw", lr=1e-3, weight_decay=1e-2),
              lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)),
}
#: fblc's state name suffix -> torch.optim's state key
STATE_KEYS = {"momentum": "momentum_buffer", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

MODELS: dict[str, Callable[[str], ExportedModel]] = {
    "mobilenet_v2": models.mobilenet_v2,
    "resnet_legacy": models.resnet_legacy,
    "resnet_dynamo_opt": models.resnet_dynamo_optimized,
    "llama": lambda directory: models.llama(directory)[0],
    "llama_opt": lambda directory: models.llama(directory)[1],
    "mlp": models.mlp,
    "tresnet": models.tresnet,
}


@dataclass
class Step:
    """step.onnx of one model and optimizer, its session, and how its trainables map to torch."""

    model: ExportedModel
    path: str
    session: ort.InferenceSession
    params: list[str]  # trainable names, in output order
    states: list[str]  # optimizer state names, in output order
    initial: dict[str, np.ndarray]  # the initializer of every param and state input
    links: dict[str, Link]

    def run(self, feeds: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        inputs = {**self.model.inputs, "labels": self.model.labels, **(feeds or {})}
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(None, inputs)))


def _build_step(model: ExportedModel, optimizer: OptimizerConfig, path: str) -> Step:
    step = build_training_graph(load_model(model.path), TrainingOptions(
        input_shapes=model.input_shapes, loss="cross_entropy", optimizer=optimizer))
    save_model_atomically(step, path)
    outputs = [v.name for v in step.graph.outputs]
    params = [name[: -len(".grad")] for name in outputs if name.endswith(".grad")]
    param_set = set(params)
    states = [name[: -len(".new")] for name in outputs
              if name.endswith(".new") and name[: -len(".new")] not in param_set]
    initial = {name: step.graph.initializers[name].const_value.numpy().copy() for name in params + states}
    options = ort.SessionOptions()
    options.log_severity_level = 3  # initializers that are also inputs are the point of step.onnx
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    links = models.link_parameters(model.path, params, model.module)
    return Step(model, path, session, params, states, initial, links)


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("exported"))


@pytest.fixture(scope="session")
def steps(export_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Step]:
    """step(model, optimizer), built once per session."""
    cache: dict[tuple[str, str], Step] = {}
    folder = tmp_path_factory.mktemp("steps")

    def get(model_name: str, optimizer: str) -> Step:
        key = (model_name, optimizer)
        if key not in cache:
            model = MODELS[model_name](export_dir)
            cache[key] = _build_step(model, OPTIMIZERS[optimizer][0], str(folder / f"{model_name}_{optimizer}.onnx"))
        return cache[key]

    return get


class TorchTrainer:
    """The torch side: a copy of the reference module, started from step.onnx's initial values."""

    def __init__(self, step: Step, optimizer: str) -> None:
        self.step = step
        self.module = copy.deepcopy(step.model.module).eval()
        models.load_linked(self.module, step.links, step.initial)
        named = dict(self.module.named_parameters())
        self.params = {name: named[link.torch_name] for name, link in step.links.items()}
        self.optimizer = OPTIMIZERS[optimizer][1](list(self.module.parameters()))

    def train_step(self) -> tuple[float, dict[str, np.ndarray]]:
        """One step; returns the loss and, by ONNX output name, every grad, new param and new state."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.step.model.loss_of(self.module)
        loss.backward()
        grads = {name: p.grad.detach().numpy().copy() for name, p in self.params.items()}
        self.optimizer.step()
        values: dict[str, np.ndarray] = {}
        for name, p in self.params.items():
            link = self.step.links[name]
            values[f"{name}.grad"] = link.to_onnx(grads[name])
            values[f"{name}.new"] = link.to_onnx(p.detach().numpy())
            state = self.optimizer.state[p]
            for suffix, key in STATE_KEYS.items():
                if f"{name}.{suffix}" in self.step.states:
                    values[f"{name}.{suffix}.new"] = link.to_onnx(state[key].detach().numpy())
            if "optimizer.step" in self.step.states:
                values["optimizer.step.new"] = np.asarray(float(state["step"]), np.float32)
        return float(loss.detach()), values


def _assert_step_matches(got: dict[str, np.ndarray], loss: float, expected: dict[str, np.ndarray], what: str) -> None:
    np.testing.assert_allclose(got["loss"], loss, rtol=RTOL, atol=ATOL, err_msg=f"{what}: loss")
    assert set(expected) == set(got) - {"loss"}, f"{what}: outputs differ from the torch values"
    mismatched = []
    for name, want in expected.items():
        have = got[name]
        if have.shape != want.shape or not np.allclose(have, want, rtol=RTOL, atol=ATOL):
            error = np.abs(have - want).max() if have.shape == want.shape else f"shape {have.shape} vs {want.shape}"
            mismatched.append(f"{name}: max abs error {error} (max |torch| {np.abs(want).max():.3g})")
    assert not mismatched, f"{what}: {len(mismatched)} of {len(expected)} tensors differ:\n" + "\n".join(mismatched)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_trainable_set_is_the_torch_parameter_set(steps: Callable[[str, str], Step], model_name: str) -> None:
    step = steps(model_name, "sgd")
    torch_names = {name for name, p in step.model.module.named_parameters() if p.requires_grad}
    linked = [link.torch_name for link in step.links.values()]
    assert len(linked) == len(set(linked)), "two ONNX tensors link to one torch parameter"
    assert set(linked) == torch_names
    assert not any(k.endswith(("running_mean", "running_var")) for k in step.params), "BN statistics must not train"


@pytest.mark.parametrize("model_name", ["mobilenet_v2", "llama_opt"])
def test_step_interface(steps: Callable[[str, str], Step], model_name: str) -> None:
    """Inputs: model inputs, labels, then params and states; outputs: loss, (P.grad, P.new)..., S.new..."""
    step = steps(model_name, "adamw")
    graph = onnx.load(step.path).graph  # onnxruntime lists no input that has an initializer
    inputs = [i.name for i in graph.input]
    model_inputs = list(step.model.inputs) + ["labels"]
    assert inputs[: len(model_inputs)] == model_inputs
    assert sorted(inputs[len(model_inputs):]) == sorted(step.params + step.states)
    assert step.states[-1] == "optimizer.step"
    expected = ["loss"] + [f"{p}.{kind}" for p in step.params for kind in ("grad", "new")]
    assert [o.name for o in graph.output] == expected + [f"{s}.new" for s in step.states]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_one_step_matches_torch(steps: Callable[[str, str], Step], model_name: str, optimizer: str) -> None:
    step = steps(model_name, optimizer)
    loss, expected = TorchTrainer(step, optimizer).train_step()
    _assert_step_matches(step.run(), loss, expected, f"{model_name}/{optimizer}")


@pytest.mark.parametrize("model_name", ["tresnet", "llama_opt"])
def test_second_adamw_step_from_new_outputs(steps: Callable[[str, str], Step], model_name: str) -> None:
    step = steps(model_name, "adamw")
    trainer = TorchTrainer(step, "adamw")
    trainer.train_step()
    first = step.run()
    loss, expected = trainer.train_step()
    feeds = {name: first[f"{name}.new"] for name in step.params + step.states}
    assert feeds["optimizer.step"] == 1.0
    _assert_step_matches(step.run(feeds), loss, expected, f"{model_name}/adamw step 2")
