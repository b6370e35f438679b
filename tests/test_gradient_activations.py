"""Gradient rules of fblc/compiler/gradients/activations.py against PyTorch autograd: LeakyRelu,
PRelu (with its slope's gradient), Elu, Selu, Celu, ThresholdedRelu, Softplus, Mish, Softsign,
Gelu (opset 20, exact and tanh), Abs, and the variadic Max, Min and Sum.

The harness is test_gradient_rules.py's (the loss ReduceSum(y * R), the step graph run in
onnxruntime, float64 torch autograd as the reference). Random values stay off the kinks (the
slope jumps there, and float32 against float64 could fall on either side); separate cases put
values exactly on them, where the rules must take torch's side: LeakyRelu / PRelu the negative
slope at 0, the ELU family the left piece, ThresholdedRelu 0 at alpha, Abs 0 at 0, Max / Min
half of dy to each of two equal inputs. Gelu is an opset-20 op: its cases build opset-20 models
(the import keeps opsets from 18 on as they are).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fblc.compiler.autodiff import supported_ops
from fblc.errors import UnsupportedOpError
from tests import test_gradient_rules as rules
from tests.test_gradient_more import _off_kinks
from tests.test_gradient_rules import Case, Tensors, check, node, rand

_rng = np.random.default_rng(2468)

#: cases whose model is built at opset 20 (Gelu exists from opset 20 on)
OPSET_20 = "Gelu"


def _spread(*shape: int, low: float = -4.0, high: float = 4.0, kinks: tuple[float, ...] = (0.0,)) -> np.ndarray:
    return _off_kinks(_rng.uniform(low, high, size=shape), list(kinks))


AT_ZERO = np.array([[0.0, -0.0, 1.0, -1.0], [0.5, -2.0, 0.0, 3.0]], dtype=np.float32)
LARGE = np.array([[-100.0, 100.0, -30.0, 30.0], [-20.5, 20.5, 0.0, -1.0]], dtype=np.float32)


def _torch_selu(x: torch.Tensor, alpha: float, gamma: float) -> torch.Tensor:
    return gamma * F.elu(x, alpha)


def unary_cases() -> list[Case]:
    def unary(label: str, op: str, x: np.ndarray, reference, **attributes) -> Case:
        return Case(f"{op}-{label}", [node(op, ["x"], **attributes)], {"x": x}, lambda t: reference(t["x"]))

    alpha, gamma = 1.67326319217681884765625, 1.05070102214813232421875  # torch's SELU constants in float32
    return [
        unary("default", "LeakyRelu", _spread(3, 7), lambda x: F.leaky_relu(x, 0.01)),
        unary("alpha", "LeakyRelu", _spread(2, 3, 4), lambda x: F.leaky_relu(x, 0.2), alpha=0.2),
        unary("at-zero", "LeakyRelu", AT_ZERO, lambda x: F.leaky_relu(x, 0.2), alpha=0.2),
        unary("default", "Elu", _spread(3, 7), F.elu),
        unary("alpha", "Elu", _spread(2, 5), lambda x: F.elu(x, 0.7), alpha=0.7),
        unary("at-zero-and-large", "Elu", np.concatenate([AT_ZERO, LARGE]), lambda x: F.elu(x, 0.7), alpha=0.7),
        unary("default", "Selu", _spread(3, 7), torch.selu),
        unary("at-zero", "Selu", AT_ZERO, torch.selu),
        unary("attributes", "Selu", _spread(2, 5), lambda x: _torch_selu(x, 1.3, 0.8), alpha=1.3, gamma=0.8),
        unary("default", "Celu", _spread(3, 7), F.celu),
        unary("alpha", "Celu", _spread(2, 5), lambda x: F.celu(x, 0.5), alpha=0.5),
        unary("at-zero-and-large", "Celu", np.concatenate([AT_ZERO, LARGE]), lambda x: F.celu(x, 2.0), alpha=2.0),
        unary("default", "ThresholdedRelu", _spread(3, 6, kinks=(1.0,)), lambda x: F.threshold(x, 1.0, 0.0)),
        unary("alpha-at-kink", "ThresholdedRelu", np.array([[0.5, 0.5001, 0.4999, -1.0, 2.0]], np.float32),
              lambda x: F.threshold(x, 0.5, 0.0), alpha=0.5),
        # F.softplus (beta 1, threshold 20) is what exports as Softplus; past 20 its slope is 1
        unary("spread", "Softplus", rand(3, 7, low=-6, high=6), F.softplus),
        unary("large", "Softplus", LARGE, F.softplus),
        unary("spread", "Mish", rand(3, 7, low=-5, high=5), F.mish),
        unary("large", "Mish", LARGE, F.mish),
        unary("spread", "Softsign", rand(3, 7, low=-5, high=5), F.softsign),
        unary("at-zero-and-large", "Softsign", np.concatenate([AT_ZERO, LARGE]), F.softsign),
        unary("spread", "Gelu", rand(3, 7, low=-4, high=4), F.gelu),
        unary("large", "Gelu", LARGE, F.gelu),
        unary("tanh-spread", "Gelu", rand(3, 7, low=-4, high=4), lambda x: F.gelu(x, approximate="tanh"),
              approximate="tanh"),
        unary("tanh-large", "Gelu", LARGE, lambda x: F.gelu(x, approximate="tanh"), approximate="tanh"),
        unary("spread", "Abs", _spread(3, 7), torch.abs),
        unary("at-zero", "Abs", AT_ZERO, torch.abs),
    ] + [Case("Selu-onnx-defaults-are-torch", [node("Selu", ["x"], alpha=alpha, gamma=gamma)], {"x": _spread(2, 4)},
              lambda t: torch.selu(t["x"]))]


def prelu_cases() -> list[Case]:
    def prelu(label: str, x: np.ndarray, slope: np.ndarray, reference) -> Case:
        return Case(f"PRelu-{label}", [node("PRelu", ["x", "slope"])], {"x": x, "slope": slope}, reference)

    def per_channel(t: Tensors) -> torch.Tensor:
        return F.prelu(t["x"], t["slope"].reshape(-1))

    channels = 3
    return [
        # nn.PReLU(C) on NCHW: the exporter writes the slope as [C, 1, 1]
        prelu("per-channel-C11", _spread(2, channels, 3, 4), rand(channels, 1, 1, low=0.05, high=0.5), per_channel),
        # nn.PReLU(C) on [N, C]: slope [C]
        prelu("per-channel-C", _spread(4, channels), rand(channels, low=0.05, high=0.5), per_channel),
        # nn.PReLU(): one slope, [1]
        prelu("shared-1", _spread(2, 3, 5), rand(1, low=0.05, high=0.5), lambda t: F.prelu(t["x"], t["slope"])),
        # zeros: dx takes the slope, dslope gets 0 (torch's prelu backward)
        prelu("at-zero", AT_ZERO.reshape(2, 4, 1, 1) * np.ones((1, 1, 2, 1), np.float32),
              rand(4, 1, 1, low=0.05, high=0.5), per_channel),
        # the slope behind a conv, as in a conv-PReLU block
        Case("PRelu-after-matmul", [node("MatMul", ["x", "w"], ["h"]), node("PRelu", ["h", "slope"])],
             {"x": rand(3, 4), "w": rand(4, 5), "slope": rand(5, low=-0.5, high=0.5)},
             lambda t: F.prelu(t["x"] @ t["w"], t["slope"])),
    ]


def _stacked(op, tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.amax / amin over the inputs broadcast and stacked on a new axis (ties share evenly)."""
    return op(torch.stack(torch.broadcast_tensors(*tensors)), dim=0)


def variadic_cases() -> list[Case]:
    cases: list[Case] = []
    for op, pair, stacked in (("Max", torch.maximum, torch.amax), ("Min", torch.minimum, torch.amin)):
        a, b = rand(3, 4), rand(3, 4)
        b[0, :2] = a[0, :2]  # ties: half of dy to each, as torch.maximum / minimum
        cases += [
            Case(f"{op}-two-with-ties", [node(op, ["a", "b"])], {"a": a, "b": b}, lambda t, f=pair: f(t["a"], t["b"])),
            Case(f"{op}-broadcast", [node(op, ["a", "b"])], {"a": rand(2, 3, 4), "b": rand(3, 1)},
                 lambda t, f=pair: f(t["a"], t["b"])),
            # a row vector tying with every row of a matrix in one column: the broadcast input sums its halves
            Case(f"{op}-broadcast-ties", [node(op, ["a", "b"])],
                 {"a": np.array([[0.5, 0.1, -0.3], [0.5, 0.9, 0.2]], np.float32),
                  "b": np.array([0.5, 0.4, 0.0], np.float32)}, lambda t, f=pair: f(t["a"], t["b"])),
            Case(f"{op}-three-broadcast", [node(op, ["a", "b", "c"])],
                 {"a": rand(2, 3), "b": rand(3), "c": rand(2, 1)}, lambda t, f=stacked: _stacked(f, [t["a"], t["b"],
                                                                                                     t["c"]])),
            # three inputs all equal in places: a third each (torch.amax over the stack)
            Case(f"{op}-three-ties", [node(op, ["a", "b", "c"])],
                 {"a": np.array([1.0, 2.0, 0.0, 3.0], np.float32), "b": np.array([1.0, 2.0, 1.0, -1.0], np.float32),
                  "c": np.array([1.0, 0.0, 1.0, 3.0], np.float32)},
                 lambda t, f=stacked: _stacked(f, [t["a"], t["b"], t["c"]])),
            Case(f"{op}-one-input", [node(op, ["a"])], {"a": rand(2, 3)}, lambda t: t["a"]),
        ]
    cases += [
        Case("Sum-two", [node("Sum", ["a", "b"])], {"a": rand(3, 4), "b": rand(3, 4)}, lambda t: t["a"] + t["b"]),
        Case("Sum-three-broadcast", [node("Sum", ["a", "b", "c"])], {"a": rand(2, 3, 4), "b": rand(4), "c": rand(3, 1)},
             lambda t: t["a"] + t["b"] + t["c"]),
        Case("Sum-one-input", [node("Sum", ["a"])], {"a": rand(2, 3)}, lambda t: t["a"]),
    ]
    return cases


def rounding_cases() -> list[Case]:
    """y = x * f(x): the gradient is f(x) + x * f'(x), with f' = 0 as torch (the jumps included: x
    holds integers and halves, where floor, ceil, round and sign jump)."""
    jumps = np.array([[-2.0, -1.5, -0.5, 0.0, 0.5, 1.5], [2.5, 3.0, -0.7, 0.3, 1.2, -2.6]], np.float32)
    torch_ops = {"Floor": torch.floor, "Ceil": torch.ceil, "Round": torch.round, "Sign": torch.sign}
    return [Case(f"{op}-times-x", [node(op, ["x"], ["f"]), node("Mul", ["x", "f"])], {"x": x},
                 lambda t, f=f: t["x"] * f(t["x"]))
            for op, f in torch_ops.items() for x in [jumps]]


CASES: list[Case] = unary_cases() + prelu_cases() + variadic_cases() + rounding_cases()


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_gradient_matches_torch(case: Case, tmp_path, monkeypatch) -> None:
    if any(n.op_type == OPSET_20 for n in case.nodes):
        monkeypatch.setattr(rules, "OPSET", 20)
    check(case, tmp_path)


def test_new_rules_have_cases_here() -> None:
    """The rules this file is for are registered, and each has a case here."""
    tested = {n.op_type for c in CASES for n in c.nodes}
    new = {"LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "ThresholdedRelu", "Softplus", "Mish", "Softsign", "Gelu",
           "Abs", "Max", "Min", "Sum", "Floor", "Ceil", "Round", "Sign"}
    assert new <= set(supported_ops())
    assert new <= tested


@pytest.mark.parametrize("approximate", ["erf", "fast"])
def test_gelu_unknown_approximation_is_refused(tmp_path, monkeypatch, approximate: str) -> None:
    """onnx's checker accepts any string; the rule refuses it, naming the node and the two forms."""
    monkeypatch.setattr(rules, "OPSET", 20)
    case = Case(f"Gelu-{approximate}", [node("Gelu", ["x"], name="gelu_odd", approximate=approximate)],
                {"x": rand(2, 3)}, F.gelu)
    with pytest.raises(UnsupportedOpError, match=f"Gelu with approximate='{approximate}'.*gelu_odd.*none.*tanh"):
        rules._step(rules._model(case, rules._upstream(case, (2, 3))), tmp_path)
