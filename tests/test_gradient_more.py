"""Gradient rules of issue 12 against PyTorch autograd: HardSwish, HardSigmoid, ReduceL2, ReduceLogSumExp,
InstanceNormalization, and AveragePool / MaxPool with ceil_mode.

The harness is test_gradient_rules.py's (a tiny opset-18 model, the loss ReduceSum(y * R), the
step graph run in onnxruntime, float64 torch autograd as the reference); only the cases are
new. The loss check also compares the forward, so a ceil_mode shape or divisor that differs
from onnxruntime's fails there before any gradient is read.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fblc.compiler.autodiff import supported_ops
from tests import test_gradient_rules as rules
from tests.test_gradient_rules import Case, Tensors, away, check, i64, node, pos, rand

_rng = np.random.default_rng(4321)


def _off_kinks(x: np.ndarray, kinks: Sequence[float], margin: float = 0.1) -> np.ndarray:
    """x with every value within `margin` of a kink moved 3 margins past it (the slope is not
    continuous there, and float32 against float64 could land on either side)."""
    for kink in kinks:
        x = np.where(np.abs(x - kink) < margin, x + 3 * margin, x)
    return x.astype(np.float32)


def activation_cases() -> list[Case]:
    spread = _off_kinks(_rng.uniform(-5.0, 5.0, size=(3, 7)), [-3.0, 3.0])
    # exactly on the kinks: torch's hardswish takes the outer pieces there (slopes 0 at -3, 1 at 3),
    # and its hardsigmoid passes no gradient at either
    kinks = np.array([[-3.0, 3.0, -4.0, 4.0], [0.0, 1.5, -1.5, 2.999]], dtype=np.float32)
    sixth = 1.0 / 6.0
    return [
        Case("HardSwish-spread", [node("HardSwish", ["x"])], {"x": spread}, lambda t: F.hardswish(t["x"])),
        Case("HardSwish-at-kinks", [node("HardSwish", ["x"])], {"x": kinks}, lambda t: F.hardswish(t["x"])),
        Case("HardSwish-4d", [node("HardSwish", ["x"])], {"x": _off_kinks(_rng.uniform(-4, 4, (2, 3, 2, 4)), [-3, 3])},
             lambda t: F.hardswish(t["x"])),
        # the ONNX defaults (alpha 0.2, beta 0.5): bounds at -2.5 and 2.5
        Case("HardSigmoid-onnx-defaults", [node("HardSigmoid", ["x"])],
             {"x": _off_kinks(_rng.uniform(-4, 4, (3, 6)), [-2.5, 2.5])},
             lambda t: torch.clamp(0.2 * t["x"] + 0.5, 0.0, 1.0)),
        # what the exporters write for F.hardsigmoid
        Case("HardSigmoid-torch", [node("HardSigmoid", ["x"], alpha=sixth, beta=0.5)], {"x": spread},
             lambda t: F.hardsigmoid(t["x"])),
        Case("HardSigmoid-torch-at-kinks", [node("HardSigmoid", ["x"], alpha=sixth, beta=0.5)], {"x": kinks},
             lambda t: F.hardsigmoid(t["x"])),
        # a negative slope: the bounds swap (x > 2.4 gives 0, x < -1.6 gives 1)
        Case("HardSigmoid-negative-alpha", [node("HardSigmoid", ["x"], alpha=-0.25, beta=0.4)],
             {"x": _off_kinks(_rng.uniform(-3, 3, (2, 5)), [-2.4, 1.6])},
             lambda t: torch.clamp(-0.25 * t["x"] + 0.4, 0.0, 1.0)),
        # the MobileNetV3 squeeze-excitation gate: x * hardsigmoid(x @ w)
        Case("HardSigmoid-gate", [node("MatMul", ["x", "w"], ["h"]), node("HardSigmoid", ["h"], ["g"], alpha=sixth,
                                                                          beta=0.5), node("Mul", ["x", "g"])],
             {"x": rand(3, 4), "w": rand(4, 4, low=-3, high=3)}, lambda t: t["x"] * F.hardsigmoid(t["x"] @ t["w"])),
    ]


def _torch_l2(x: torch.Tensor, axes: list[int] | None, keep: bool) -> torch.Tensor:
    return torch.linalg.vector_norm(x, 2, dim=axes, keepdim=keep)


def reduce_l2_cases() -> list[Case]:
    def l2(x: np.ndarray, axes: list[int] | None, keepdims: int, label: str = "") -> Case:
        name = f"axes{'_'.join(map(str, axes)) if axes else '-all'}-keepdims{keepdims}{label}"
        inputs = ["x", "axes"] if axes is not None else ["x"]
        consts = {"axes": i64(axes)} if axes is not None else {}
        return Case(f"ReduceL2-{name}", [node("ReduceL2", inputs, keepdims=keepdims)], {"x": x},
                    lambda t: _torch_l2(t["x"], axes, bool(keepdims)), consts=consts)

    cases = [l2(rand(2, 3, 4), axes, keepdims) for axes, keepdims in
             [([1], 1), ([-1], 0), ([0, -1], 0), ([-2], 1), (None, 0), (None, 1)]]
    # a zero norm: torch's subgradient there is 0 (no NaN), in the rows of zeros and nowhere else
    zero_rows = rand(4, 5)
    zero_rows[[1, 3]] = 0.0
    cases.append(l2(zero_rows, [1], 1, "-zero-rows"))
    cases.append(l2(np.zeros((2, 3), np.float32), None, 0, "-all-zero"))
    # noop_with_empty_axes: y = |x| (onnxruntime's result), so dx = sign(x) dy
    cases.append(Case("ReduceL2-noop-with-empty-axes", [node("ReduceL2", ["x"], noop_with_empty_axes=1)],
                      {"x": away(2, 3)}, lambda t: t["x"].abs()))
    # torch.nn.utils.weight_norm: w = g * v / ||v|| over every axis but the output channel
    cases.append(Case("ReduceL2-weight-norm", [node("ReduceL2", ["v", "axes"], ["norm"], keepdims=1),
                                               node("Div", ["v", "norm"], ["direction"]),
                                               node("Mul", ["g", "direction"], ["w"]), node("MatMul", ["x", "w"])],
                      {"v": rand(4, 3), "g": pos(4, 1), "x": rand(2, 4)},
                      lambda t: t["x"] @ (t["g"] * t["v"] / torch.linalg.vector_norm(t["v"], dim=1, keepdim=True)),
                      consts={"axes": i64([1])}))
    return cases


def instance_norm_cases() -> list[Case]:
    def instance_norm(label: str, shape: tuple[int, ...], epsilon: float = 1e-5) -> Case:
        channels = shape[1]
        params = {"x": rand(*shape, low=-2, high=3), "scale": rand(channels), "bias": rand(channels)}
        return Case(f"InstanceNormalization-{label}",
                    [node("InstanceNormalization", ["x", "scale", "bias"], epsilon=epsilon)], params,
                    lambda t: F.instance_norm(t["x"], weight=t["scale"], bias=t["bias"], eps=epsilon))

    return [
        instance_norm("2d-plane-multiple-of-4", (2, 3, 4, 5)),
        instance_norm("2d-odd-plane", (1, 2, 3, 3)),
        instance_norm("1d-speech", (2, 4, 7), epsilon=1e-3),
        instance_norm("3d", (1, 2, 2, 3, 2)),
        instance_norm("one-element-per-row-of-two", (3, 2, 2)),
    ]


# ---------------------------------------------------------------- ceil_mode pooling

def _ceil_out(n: int, k: int, s: int, pb: int, pe: int) -> int:
    """The definition (onnxruntime's and torch's): ceil, then drop a last window that starts in the end padding."""
    out = math.ceil((n + pb + pe - k) / s) + 1
    return out - 1 if (out - 1) * s >= n + pb else out


def torch_avg_pool_ceil(x: torch.Tensor, kernel: Sequence[int], strides: Sequence[int], pads: Sequence[int],
                        count_include_pad: bool) -> torch.Tensor:
    """AveragePool with ceil_mode, for any pads, from its definition: window sums of x zero-padded far
    enough for the last window, divided by each window's taps inside the input (count_include_pad=0)
    or inside the padded input [-pads_begin, n + pads_end) (count_include_pad=1)."""
    rank = len(kernel)
    spatial = list(x.shape[2:])
    outs = [_ceil_out(n, k, s, pads[i], pads[i + rank]) for i, (n, k, s) in enumerate(zip(spatial, kernel, strides))]
    begin, declared_end = list(pads[:rank]), list(pads[rank:])
    # end padding that holds every tap of the last window (at least the declared one)
    end = [max(e, (o - 1) * s + k - b - n) for e, o, s, k, b, n in zip(declared_end, outs, strides, kernel, begin,
                                                                        spatial)]
    ones = torch.ones_like(x)
    if count_include_pad:
        counted = F.pad(F.pad(ones, rules._torch_pads(begin + declared_end), value=1.0),
                        rules._torch_pads([0] * rank + [e - d for e, d in zip(end, declared_end)]))
    else:
        counted = F.pad(ones, rules._torch_pads(begin + end))
    padded = F.pad(x, rules._torch_pads(begin + end))
    channels = x.shape[1]
    window = torch.ones((channels, 1, *kernel), dtype=x.dtype)
    conv = {1: F.conv1d, 2: F.conv2d}[rank]
    sums = conv(padded, window, stride=list(strides), groups=channels)
    counts = conv(counted, window, stride=list(strides), groups=channels)
    keep = (slice(None), slice(None)) + tuple(slice(0, o) for o in outs)
    return (sums / counts)[keep]


def pooling_cases() -> list[Case]:
    cases: list[Case] = []

    def avg(label: str, x: np.ndarray, kernel: list[int], strides: list[int], pads: list[int] | None,
            count_include_pad: int, reference: Callable[[Tensors], torch.Tensor] | None = None) -> Case:
        rank = len(kernel)
        attributes: dict[str, object] = {"kernel_shape": kernel, "strides": strides, "ceil_mode": 1,
                                         "count_include_pad": count_include_pad}
        if pads:
            attributes["pads"] = pads
        p = pads or [0] * 2 * rank
        if reference is None:
            def reference(t: Tensors) -> torch.Tensor:
                return torch_avg_pool_ceil(t["x"], kernel, strides, p, bool(count_include_pad))
        return Case(f"AveragePool-ceil-{label}-cip{count_include_pad}", [node("AveragePool", ["x"], **attributes)],
                    {"x": x}, reference)

    for cip in (0, 1):
        include = bool(cip)
        # global pooling as AvgPool2d(4, ceil_mode=True) on 7x7: a full window and a partial one per axis
        cases.append(avg("global-k4-7x7", rand(2, 3, 7, 7), [4, 4], [4, 4], None, cip,
                         lambda t, c=include: F.avg_pool2d(t["x"], 4, ceil_mode=True, count_include_pad=c)))
        # the last window runs past the end pad: count_include_pad=1 divides by its taps inside the pads only
        cases.append(avg("k3-s2-pad1-6x6", rand(1, 2, 6, 6), [3, 3], [2, 2], [1, 1, 1, 1], cip,
                         lambda t, c=include: F.avg_pool2d(t["x"], 3, 2, 1, ceil_mode=True, count_include_pad=c)))
        # ceil would add a window that starts in the end padding: it is dropped (onnx's inference keeps it)
        cases.append(avg("dropped-window-k2-s3-pad1", rand(1, 2, 5, 8), [2, 2], [3, 3], [1, 1, 1, 1], cip,
                         lambda t, c=include: F.avg_pool2d(t["x"], 2, 3, 1, ceil_mode=True, count_include_pad=c)))
        # asymmetric pads (no torch equivalent: the definition is the reference)
        cases.append(avg("asymmetric-pads", rand(1, 2, 6, 7), [3, 2], [2, 2], [0, 1, 1, 0], cip))
        cases.append(avg("1d", rand(2, 3, 9), [2], [2], [1, 1], cip,
                         lambda t, c=include: F.avg_pool1d(t["x"], 2, 2, 1, ceil_mode=True, count_include_pad=c)))
    # ceil_mode with nothing left over: the floor shape
    cases.append(avg("exact-k2-s2", rand(1, 2, 4, 4), [2, 2], [2, 2], None, 0,
                     lambda t: F.avg_pool2d(t["x"], 2, ceil_mode=True)))

    def max_pool(label: str, x: np.ndarray, kernel: int, stride: int, pad: int) -> Case:
        rank = x.ndim - 2
        attributes = {"kernel_shape": [kernel] * rank, "strides": [stride] * rank, "pads": [pad] * 2 * rank,
                      "ceil_mode": 1}
        pool = {1: F.max_pool1d, 2: F.max_pool2d}[rank]
        return Case(f"MaxPool-ceil-{label}", [node("MaxPool", ["x"], **attributes)], {"x": x},
                    lambda t: pool(t["x"], kernel, stride, pad, ceil_mode=True))

    cases += [max_pool("k3-s2-6x6", rand(1, 2, 6, 6), 3, 2, 0), max_pool("dropped-window", rand(1, 2, 5, 5), 2, 3, 1),
              max_pool("1d", rand(2, 2, 8), 3, 2, 1)]
    return cases


def reduce_log_sum_exp_cases() -> list[Case]:
    def lse(x: np.ndarray, axes: list[int] | None, keepdims: int) -> Case:
        name = f"axes{'_'.join(map(str, axes)) if axes else '-all'}-keepdims{keepdims}"
        inputs = ["x", "axes"] if axes is not None else ["x"]
        dims = axes if axes is not None else list(range(x.ndim))
        return Case(f"ReduceLogSumExp-{name}", [node("ReduceLogSumExp", inputs, keepdims=keepdims)], {"x": x},
                    lambda t: torch.logsumexp(t["x"], dim=dims, keepdim=bool(keepdims)),
                    consts={"axes": i64(axes)} if axes is not None else {})

    # offset by 30: an exp without the maximum subtracted would lose the rows' spread
    return [lse(rand(2, 3, 5) + 30.0, [-1], 1), lse(rand(3, 4), [0], 0), lse(rand(2, 3), None, 0)]


CASES: list[Case] = (activation_cases() + reduce_l2_cases() + reduce_log_sum_exp_cases() + instance_norm_cases()
                     + pooling_cases())


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_gradient_matches_torch(case: Case, tmp_path) -> None:
    check(case, tmp_path)


def test_new_rules_have_cases_here() -> None:
    """The rules this file is for are registered, and each has a case here (test_gradient_rules.py's
    coverage check reads only its own cases)."""
    tested = {n.op_type for c in CASES for n in c.nodes} - {"Constant"}
    new = {"HardSwish", "HardSigmoid", "ReduceL2", "ReduceLogSumExp", "InstanceNormalization"}
    assert new <= set(supported_ops())
    assert new <= tested
