"""ScatterND and ScatterElements gradients (issue 41 item 3) against PyTorch autograd.

Real exports (torch.onnx.export, legacy and dynamo, opset 18) of tiny models whose forward writes
into a tensor that trains, and whose written values train too: slice assignment inside a
recurrence (`out[:, t] = h`: legacy writes ScatterND, dynamo ScatterElements), `x[idx] = y`
(index_put: ScatterND with partial and full tuples, negative and repeated indices, constant or
fed), `torch.scatter` and `scatter_add` on every axis (ScatterElements). For each, fblc's SGD
step runs in onnxruntime and its loss, every `P.grad` and every `P.new` must match torch autograd
+ torch.optim.SGD (support/zoo_check.py's tolerances: rtol 1e-3 plus 1e-5 x the largest gradient).

Hand-built cases (test_gradient_rules.py's harness, float64 torch reference) cover what no torch
export writes: negative ScatterElements indices, on every axis. Repeated indices with reduction
"none" follow PyTorch: every update naming a position gets its whole gradient, data none of it.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn as nn

from fblc.errors import UnsupportedOpError
from support import zoo, zoo_check
from support.models import ExportedModel
from support.steps import TorchTrainer, build_step
from tests.test_gradient_rules import Case, check, i64, node, rand

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

B, T, F, H, C = 2, 5, 3, 4, 3


class Recurrence(nn.Module):
    """An unrolled RNN writing its state into a trainable canvas at every other step: the steps
    not written keep the canvas, so its gradient is dy there and zero where h overwrote it; step 0
    is overwritten again at the end, so its first write gets no gradient from the canvas."""

    def __init__(self) -> None:
        super().__init__()
        self.canvas = nn.Parameter(torch.randn(1, T, H))
        self.cell = nn.Linear(F + H, H)
        self.fc = nn.Linear(T * H, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.canvas.repeat(x.shape[0], 1, 1)
        h = torch.zeros(x.shape[0], H)
        for t in range(0, T, 2):
            h = torch.tanh(self.cell(torch.cat([x[:, t], h], 1)))
            out[:, t] = h
        out[:, 0] = h  # written twice: the first h reaches the loss only through the recurrence
        return self.fc(out.reshape(x.shape[0], -1))


class IndexPut(nn.Module):
    """x[rows] = y (rows of a table: ScatterND tuples of 1, updates are slices; -1 and 5 name one
    row, so two updates collide) and x[i, j] = v (whole tuples, a negative entry)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, H))
        self.proj = nn.Linear(F, H)
        self.points = nn.Parameter(torch.randn(2))
        self.fc = nn.Linear(6 * H, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table * 1.0
        rows = self.proj(x[0, :2]) * 2.0
        # -1 and 5 name one row: equal values there, so the forward's winner (which onnxruntime's
        # ScatterND leaves to its threads) does not matter, and each update still gets that row's dy
        table[torch.tensor([-1, 2, 5])] = rows[torch.tensor([0, 1, 0])]
        table[torch.tensor([0, -2]), torch.tensor([1, 3])] = self.points
        return self.fc(table.reshape(1, -1)) + self.proj(x[:, 1])[:, :C]


class FedIndexPut(nn.Module):
    """x[idx] = y with idx a model input (the indices are a graph input, not a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, H))
        self.proj = nn.Linear(F, H)
        self.fc = nn.Linear(6 * H, C)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        table = self.table * 1.0
        table[idx] = self.proj(x[:, 0])
        return self.fc(table.reshape(1, -1)).expand(x.shape[0], C)


class Scatter(nn.Module):
    """torch.scatter / scatter_add of a trainable src into a trainable data along `dim`; the index
    repeats positions along `dim` and is smaller than the data on the other axes."""

    def __init__(self, dim: int, add: bool) -> None:
        super().__init__()
        self.dim, self.add = dim, add
        self.data = nn.Parameter(torch.randn(B, 4, 5))
        shape = [2, 3, 2]
        self.src = nn.Parameter(torch.randn(*shape))
        size = self.data.shape[dim]
        generator = torch.Generator().manual_seed(3 + dim)
        self.register_buffer("index", torch.randint(0, size, shape, generator=generator))
        self.fc = nn.Linear(20, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scatter = torch.scatter_add if self.add else torch.scatter
        z = scatter(self.data, self.dim, self.index, self.src) * x[:, :1, :1]
        return self.fc(z.reshape(x.shape[0], -1))


def _x() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(7).standard_normal((B, T, F)).astype(np.float32)}


#: label -> (module maker, its inputs, exporter)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, np.ndarray]], str]] = {
    "recurrence-legacy": (Recurrence, _x, "legacy"),
    "recurrence-dynamo": (Recurrence, _x, "dynamo"),
    "index-put-legacy": (IndexPut, _x, "legacy"),
    "index-put-dynamo": (IndexPut, _x, "dynamo"),
    "index-put-fed-legacy": (FedIndexPut, lambda: {**_x(), "idx": np.array([4, -6], np.int64)}, "legacy"),
    "scatter-dim0-legacy": (lambda: Scatter(0, False), _x, "legacy"),
    "scatter-dim1-legacy": (lambda: Scatter(1, False), _x, "legacy"),
    "scatter-dim-1-legacy": (lambda: Scatter(-1, False), _x, "legacy"),
    "scatter-add-dim1-legacy": (lambda: Scatter(1, True), _x, "legacy"),
    "scatter-add-dim2-dynamo": (lambda: Scatter(2, True), _x, "dynamo"),
}


@pytest.mark.parametrize("label", list(MODELS))
def test_exported_scatter_trains_like_torch(label: str, tmp_path) -> None:
    make, inputs_of, exporter = MODELS[label]
    torch.manual_seed(0)
    module, inputs = make().eval(), inputs_of()
    path = os.path.join(tmp_path, f"{label}.onnx")
    zoo.export(module, inputs, exporter, path)
    labels = np.array([0, 2], np.int64)
    model = ExportedModel(label, path, module, inputs, labels, zoo.cross_entropy_loss(inputs, labels))
    step = build_step(model, zoo_check.SGD, os.path.join(tmp_path, "step.onnx"))
    import onnx
    scatters = [n.op_type for n in onnx.load(path).graph.node if n.op_type.startswith("Scatter")]
    assert scatters, f"{label}: the export has no scatter to test"
    trainer = TorchTrainer(step, zoo_check.torch_sgd)
    torch_loss, expected = trainer.train_step()
    outcome = zoo_check.Outcome(label)
    trained = {name for name, p in trainer.module.named_parameters() if p.grad is not None}
    outcome.trainable_diff = zoo_check.trainable_difference(step, trained)
    got = step.run()
    outcome.loss, outcome.torch_loss = float(got["loss"]), torch_loss
    zoo_check.compare(got, expected, outcome)
    assert outcome.ok, f"{label} ({scatters}): {outcome.failure()}"


def _reference_scatter_elements(data: torch.Tensor, index: np.ndarray, updates: torch.Tensor, axis: int,
                                add: bool) -> torch.Tensor:
    """ONNX ScatterElements in torch: negative indices wrapped here (torch.scatter takes none)."""
    wrapped = torch.from_numpy(np.where(index < 0, index + data.shape[axis], index))
    return (torch.scatter_add if add else torch.scatter)(data, axis, wrapped, updates)


def _elements(axis: int, add: bool) -> Case:
    shape, index_shape = (3, 4, 5), [2, 3, 4]
    rng = np.random.default_rng(11 + axis)
    size = shape[axis]
    index = rng.integers(-size, size, size=index_shape).astype(np.int64)
    reduction = "add" if add else "none"
    return Case(f"ScatterElements-{reduction}-axis{axis}",
                [node("ScatterElements", ["data", "index", "updates"], axis=axis, reduction=reduction)],
                {"data": rand(*shape), "updates": rand(*index_shape)},
                lambda t: _reference_scatter_elements(t["data"], index, t["updates"], axis, add),
                consts={"index": index})


def _nd(add: bool) -> Case:
    """Partial tuples (k = 2 of rank 3), negative entries, one position named twice (add only:
    with reduction none ONNX leaves the winner undefined, the exported cases above test it)."""
    tuples = np.array([[0, -1], [2, 1], [-3, 3]] if add else [[0, -1], [2, 1], [1, 0]], np.int64)
    reduction = "add" if add else "none"

    def reference(t: dict[str, torch.Tensor]) -> torch.Tensor:
        rows, cols = (torch.from_numpy(tuples[:, j]) for j in range(2))
        return t["data"].index_put((rows, cols), t["updates"], accumulate=add)

    scatter = node("ScatterND", ["data", "index", "updates"], reduction=reduction)
    return Case(f"ScatterND-{reduction}-partial", [scatter],
                {"data": rand(3, 4, 2), "updates": rand(3, 2)}, reference, consts={"index": tuples})


CASES = ([_elements(axis, add) for axis in (0, 1, 2) for add in (False, True)] + [_elements(-1, False)]
         + [_nd(False), _nd(True)])


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_scatter_gradient_matches_torch(case: Case, tmp_path) -> None:
    check(case, tmp_path)


@pytest.mark.parametrize("op_type,reduction", [("ScatterElements", "mul"), ("ScatterND", "max"),
                                               ("ScatterND", "min")])
def test_other_reductions_are_refused_by_name(op_type: str, reduction: str, tmp_path) -> None:
    index = i64([[0], [2]]) if op_type == "ScatterND" else i64([[0, 2]])
    updates = rand(2, 3) if op_type == "ScatterND" else rand(1, 2)
    case = Case("refused", [node(op_type, ["data", "index", "updates"], name="the_scatter", reduction=reduction)],
                {"data": rand(3, 3), "updates": updates}, lambda t: t["data"], consts={"index": index})
    with pytest.raises(UnsupportedOpError, match=f"{op_type} node 'the_scatter' with reduction '{reduction}'.*"
                                                 "supported: reduction none and add"):
        check(case, tmp_path)
