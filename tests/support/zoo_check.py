"""The zoo harness: export one architecture, build fblc's SGD step, run it in onnxruntime, compare with torch.

Used by tests/test_zoo.py (which asserts) and benchmarks/zoo.py (which prints the table).

Tolerance, per tensor: |fblc - torch| <= RTOL * |torch| + floor, where the floor scales with the
model's gradients: ATOL_SCALE * (largest |gradient| of any parameter), times the learning rate for
`P.new`. Gradients that are zero in exact arithmetic (an attention key bias: softmax is invariant to
adding a constant to every score) come out of both sides as fp32 noise around 1e-9 and cannot meet
a relative tolerance; the floor is what lets them pass without loosening the others.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
import torch

from fblc.compiler.optimizers import OptimizerConfig
from fblc.compiler.trainable import folded_torch_sources

from . import zoo
from .steps import Step, TorchTrainer, build_step

LR = 0.1
SGD = OptimizerConfig(name="sgd", lr=LR, momentum=0.0, weight_decay=0.0)
RTOL = 1e-3
ATOL_SCALE = 1e-5
LOSS_RTOL = 1e-4


def torch_sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.0, weight_decay=0.0)


@dataclass
class Outcome:
    """One architecture's step against torch: what differs, how close the rest is, and how long it took."""

    name: str
    ops: int = 0  # nodes of the exported model
    step_ops: int = 0
    trainables: int = 0
    loss: float = float("nan")
    torch_loss: float = float("nan")
    worst: float = 0.0  # max over tensors of |error| / (RTOL |torch| + floor); <= 1 passes
    worst_tensor: str = ""
    mismatched: list[str] = field(default_factory=list)
    trainable_diff: str = ""  # non-empty when fblc's trainable set is not torch's
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.trainable_diff and self.loss_ok

    @property
    def loss_ok(self) -> bool:
        return bool(np.isclose(self.loss, self.torch_loss, rtol=LOSS_RTOL, atol=1e-6))

    def failure(self) -> str:
        parts = []
        if self.trainable_diff:
            parts.append(self.trainable_diff)
        if not self.loss_ok:
            parts.append(f"loss {self.loss} vs torch {self.torch_loss}")
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} tensors differ:\n" + "\n".join(self.mismatched[:20]))
        return "; ".join(parts)


def trainable_difference(step: Step, trained: set[str]) -> str:
    """'' when fblc trains exactly `trained` (torch's parameters), each once; else what differs."""
    wanted = trained
    linked = [link.torch_name for link in step.links.values()]
    problems = []
    if len(linked) != len(set(linked)):
        problems.append("two ONNX tensors link to one torch parameter")
    if set(linked) - wanted:
        problems.append(f"fblc trains what torch does not: {sorted(set(linked) - wanted)}")
    if wanted - set(linked):
        problems.append(f"fblc does not train: {sorted(wanted - set(linked))}")
    return "; ".join(problems)


def compare(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], outcome: Outcome) -> None:
    """Fill `outcome.worst`/`mismatched` from step outputs `got` against torch's `expected`."""
    grads = [np.abs(v).max(initial=0.0) for k, v in expected.items() if k.endswith(".grad")]
    floor = ATOL_SCALE * max(grads, default=0.0)
    missing = set(expected) ^ (set(got) - {"loss"})
    if missing:
        outcome.mismatched.append(f"outputs differ from the torch values: {sorted(missing)[:10]}")
    for name, want in expected.items():
        if name not in got:
            continue
        have = got[name]
        if have.shape != want.shape:
            outcome.mismatched.append(f"{name}: shape {have.shape} vs torch {want.shape}")
            continue
        atol = floor * (LR if name.endswith(".new") else 1.0)
        ratio = float((np.abs(have - want) / (RTOL * np.abs(want) + atol + 1e-30)).max(initial=0.0))
        if ratio > outcome.worst:
            outcome.worst, outcome.worst_tensor = ratio, name
        if not ratio <= 1.0:
            outcome.mismatched.append(f"{name}: max abs error {np.abs(have - want).max():.3g} "
                                      f"(max |torch| {np.abs(want).max():.3g}, floor {atol:.3g})")


def check(arch: zoo.Architecture, directory: str) -> Outcome:
    """Export `arch` into `directory`, build and run fblc's SGD step, compare it with torch's."""
    import onnx

    start = time.perf_counter()
    outcome = Outcome(arch.name)
    model = zoo.build(arch, directory)
    outcome.ops = len(onnx.load(model.path, load_external_data=False).graph.node)
    step = build_step(model, SGD, os.path.join(directory, f"{arch.name}_step.onnx"), freeze=arch.freeze)
    outcome.step_ops, outcome.trainables = step.op_count, len(step.params)
    trainer = TorchTrainer(step, torch_sgd)
    torch_loss, expected = trainer.train_step()
    # torch trains the requires_grad parameters its autograd reaches (DINOv2's mask_token is one
    # that this forward never reads: it has no gradient and is no tensor of the ONNX file)
    trained = {name for name, p in trainer.module.named_parameters() if p.requires_grad and p.grad is not None}
    if arch.folded:  # gone from the file: fblc must say so, and train everything else as torch does
        folded = {name for name in trained if re.search(arch.folded, name)}
        named = {s for names in folded_torch_sources(ir.load(step.path).graph).values() for s in names}
        assert folded and folded <= named, f"{arch.name}: folded {sorted(folded)}, fblc names {sorted(named)}"
        trained -= folded
    outcome.trainable_diff = trainable_difference(step, trained)
    got = step.run()
    outcome.loss, outcome.torch_loss = float(got["loss"]), torch_loss
    compare(got, expected, outcome)
    outcome.seconds = time.perf_counter() - start
    return outcome
