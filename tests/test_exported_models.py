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

from typing import Callable

import numpy as np
import onnx
import pytest
import torch

from fblc.compiler.optimizers import OptimizerConfig
from support import models
from support.models import ExportedModel
from support.steps import Step, TorchOptimizer, build_step
from support.steps import TorchTrainer as TorchTrainerBase

# fp32 on both sides; differences come from summation order only
RTOL, ATOL = 1e-4, 1e-5

# the T-ResNet reference uses torch's padding='same' for its even kernel on purpose
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")

OPTIMIZERS: dict[str, tuple[OptimizerConfig, TorchOptimizer]] = {
    "sgd": (OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4),
            lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)),
    "adamw": (OptimizerConfig(name="adamw", lr=1e-3, weight_decay=1e-2),
              lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)),
}

MODELS: dict[str, Callable[[str], ExportedModel]] = {
    "mobilenet_v2": models.mobilenet_v2,
    "resnet_legacy": models.resnet_legacy,
    "resnet_dynamo_opt": models.resnet_dynamo_optimized,
    "llama": lambda directory: models.llama(directory)[0],
    "llama_opt": lambda directory: models.llama(directory)[1],
    "mlp": models.mlp,
    "tresnet": models.tresnet,
}


def _by_model(names: list[str]) -> list:
    """`names` as parameters whose tests share a model's xdist group: one worker exports the model and builds its
    steps (the session's `steps` cache), not each worker that runs one of its tests; Llama's two files, one export."""
    return [pytest.param(name, marks=pytest.mark.xdist_group(f"exported-{name.removesuffix('_opt')}"))
            for name in names]


def _build_step(model: ExportedModel, optimizer: OptimizerConfig, path: str) -> Step:
    return build_step(model, optimizer, path)


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


def TorchTrainer(step: Step, optimizer: str) -> TorchTrainerBase:
    """The torch side of `step` with the torch optimizer named `optimizer`."""
    return TorchTrainerBase(step, OPTIMIZERS[optimizer][1])


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


@pytest.mark.parametrize("model_name", _by_model(list(MODELS)))
def test_trainable_set_is_the_torch_parameter_set(steps: Callable[[str, str], Step], model_name: str) -> None:
    step = steps(model_name, "sgd")
    torch_names = {name for name, p in step.model.module.named_parameters() if p.requires_grad}
    linked = [link.torch_name for link in step.links.values()]
    assert len(linked) == len(set(linked)), "two ONNX tensors link to one torch parameter"
    assert set(linked) == torch_names
    assert not any(k.endswith(("running_mean", "running_var")) for k in step.params), "BN statistics must not train"


@pytest.mark.parametrize("model_name", _by_model(["mobilenet_v2", "llama_opt"]))
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
@pytest.mark.parametrize("model_name", _by_model(list(MODELS)))
def test_one_step_matches_torch(steps: Callable[[str, str], Step], model_name: str, optimizer: str) -> None:
    step = steps(model_name, optimizer)
    loss, expected = TorchTrainer(step, optimizer).train_step()
    _assert_step_matches(step.run(), loss, expected, f"{model_name}/{optimizer}")


@pytest.mark.parametrize("model_name", _by_model(["tresnet", "llama_opt"]))
def test_second_adamw_step_from_new_outputs(steps: Callable[[str, str], Step], model_name: str) -> None:
    step = steps(model_name, "adamw")
    trainer = TorchTrainer(step, "adamw")
    trainer.train_step()
    first = step.run()
    loss, expected = trainer.train_step()
    feeds = {name: first[f"{name}.new"] for name in step.params + step.states}
    assert feeds["optimizer.step"] == 1.0
    _assert_step_matches(step.run(feeds), loss, expected, f"{model_name}/adamw step 2")
