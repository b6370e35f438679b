"""One training step of an exported model on both sides: fblc's step.onnx in onnxruntime, and torch.

`build_step` makes step.onnx with fblc's pipeline and links its trainables to the torch
parameters (models.link_parameters); `TorchTrainer` runs the same step with torch autograd and a
torch.optim optimizer from the same initial values, and names its results as step.onnx's
outputs (`P.grad`, `P.new`, `S.new`). Shared by test_exported_models.py and test_zoo.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnxruntime as ort
import torch

from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions, build_training_graph

from . import models
from .models import ExportedModel, Link

TorchOptimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

#: fblc's state name suffix -> torch.optim's state key
STATE_KEYS = {"momentum": "momentum_buffer", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


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
    op_count: int = 0  # nodes of step.onnx

    def run(self, feeds: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        inputs = {**self.model.inputs, "labels": self.model.labels, **(feeds or {})}
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(None, inputs)))


def build_step(model: ExportedModel, optimizer: OptimizerConfig, path: str, freeze: str | None = None) -> Step:
    """fblc's step.onnx for `model` (saved at `path`), an onnxruntime session on it, and its links."""
    step = build_training_graph(load_model(model.path), TrainingOptions(
        input_shapes=model.input_shapes, loss="cross_entropy", optimizer=optimizer, freeze=freeze))
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
    return Step(model, path, session, params, states, initial, links, len(step.graph))


class TorchTrainer:
    """The torch side: a copy of the reference module, started from step.onnx's initial values."""

    def __init__(self, step: Step, optimizer: TorchOptimizer) -> None:
        self.step = step
        self.module = copy.deepcopy(step.model.module).eval()
        models.load_linked(self.module, step.links, step.initial)
        named = dict(self.module.named_parameters())
        self.params = {name: named[link.torch_name] for name, link in step.links.items()}
        self.optimizer = optimizer([p for p in self.module.parameters() if p.requires_grad])

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
