"""Gradient rules of issue 12's index and scan ops against PyTorch autograd: Resize (nearest and
linear, every form of its adjoint), CumSum, Trilu, TopK.

The harness is test_gradient_rules.py's (a tiny opset-18 model, the loss ReduceSum(y * R), the
step graph run in onnxruntime, float64 torch autograd as the reference); the loss check also
compares the forward, so taps that differ from onnxruntime's (a rounding mode, a coordinate
transform) fail there before any gradient is read. The Resize attributes are the ones
torch.onnx.export writes for nn.Upsample and F.interpolate (both exporters, opset 18):
asymmetric + floor for nearest, half_pixel for linear with align_corners=False, align_corners.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fblc.compiler.gradients import resample
from fblc.errors import UnsupportedOpError
from tests.test_gradient_rules import Case, check, const_node, i64, node, rand


def _f32(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def _resize(label: str, shape: tuple[int, ...], reference, scales: list[float] | None = None,
            sizes: list[int] | None = None, **attributes: object) -> Case:
    """A float initializer would train: the scales are a Constant node (folded at import)."""
    if scales is not None:
        inputs, first, consts = ["x", "", "scales"], [const_node("scales", _f32(scales))], {}
    else:
        inputs, first, consts = ["x", "", "", "sizes"], [], {"sizes": i64(sizes)}
    return Case(f"Resize-{label}", first + [node("Resize", inputs, **attributes)], {"x": rand(*shape)},
                lambda t: reference(t["x"]), consts=consts)


NEAREST = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
LINEAR = {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}
CORNERS = {"mode": "linear", "coordinate_transformation_mode": "align_corners"}


def resize_cases() -> list[Case]:
    return [
        # nn.Upsample(scale_factor=2): form 1 (Reshape + ReduceSum)
        _resize("nearest-upsample2", (2, 3, 4, 5), lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
                scales=[1, 1, 2, 2], **NEAREST),
        _resize("nearest-upsample-3x2", (1, 2, 3, 4), lambda x: F.interpolate(x, scale_factor=(3, 2), mode="nearest"),
                scales=[1, 1, 3, 2], **NEAREST),
        # sizes, not a multiple, and a downsampling: form 3 (segment sums)
        _resize("nearest-sizes", (1, 2, 4, 5), lambda x: F.interpolate(x, size=(6, 7), mode="nearest"),
                sizes=[1, 2, 6, 7], **NEAREST),
        _resize("nearest-down", (2, 2, 7, 6), lambda x: F.interpolate(x, size=(3, 4), mode="nearest"),
                sizes=[2, 2, 3, 4], **NEAREST),
        # F.interpolate(mode='nearest-exact'): half_pixel, round half up
        _resize("nearest-exact", (1, 2, 5, 3), lambda x: F.interpolate(x, size=(7, 8), mode="nearest-exact"),
                sizes=[1, 2, 7, 8], mode="nearest", coordinate_transformation_mode="half_pixel",
                nearest_mode="round_prefer_ceil"),
        # bilinear, align_corners=False: half_pixel (and pytorch_half_pixel, the same for sizes > 1)
        _resize("linear-half-pixel-x2", (2, 3, 4, 5),
                lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
                scales=[1, 1, 2, 2], **LINEAR),
        _resize("linear-x3-by-sizes", (2, 2, 4, 5),
                lambda x: F.interpolate(x, size=(12, 15), mode="bilinear", align_corners=False),
                sizes=[2, 2, 12, 15], **LINEAR),
        _resize("linear-pytorch-half-pixel-sizes", (1, 2, 3, 5),
                lambda x: F.interpolate(x, size=(7, 4), mode="bilinear", align_corners=False),
                sizes=[1, 2, 7, 4], mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
        _resize("linear-down", (1, 2, 7, 9), lambda x: F.interpolate(x, size=(3, 4), mode="bilinear",
                                                                      align_corners=False),
                sizes=[1, 2, 3, 4], **LINEAR),
        _resize("linear-align-corners", (2, 2, 4, 5),
                lambda x: F.interpolate(x, size=(7, 9), mode="bilinear", align_corners=True),
                sizes=[2, 2, 7, 9], **CORNERS),
        # 1-D (F.interpolate(mode='linear') on [N, C, W]) and the opset-18 axes attribute
        _resize("linear-1d", (2, 3, 5), lambda x: F.interpolate(x, scale_factor=2, mode="linear",
                                                                 align_corners=False),
                scales=[1, 1, 2], **LINEAR),
        # trilinear (F.interpolate(mode='trilinear') on [N, C, D, H, W]): three MatMul adjoints
        _resize("linear-3d", (1, 2, 3, 4, 3),
                lambda x: F.interpolate(x, size=(5, 6, 4), mode="trilinear", align_corners=False),
                sizes=[1, 2, 5, 6, 4], **LINEAR),
        _resize("linear-axes-attribute", (2, 3, 4, 5),
                lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
                scales=[2, 2], axes=[2, 3], **LINEAR),
    ]


def _exclusive(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


def _reversed(fn, x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.flip(fn(torch.flip(x, [dim]), dim), [dim])


def scan_cases() -> list[Case]:
    def cumsum(label: str, shape: tuple[int, ...], axis: int, reference, **attributes: int) -> Case:
        return Case(f"CumSum-{label}", [node("CumSum", ["x", "axis"], **attributes)], {"x": rand(*shape)},
                    lambda t: reference(t["x"], axis), consts={"axis": i64(axis)})

    def trilu(label: str, shape: tuple[int, ...], k: int | None, upper: int) -> Case:
        fn = torch.triu if upper else torch.tril
        inputs, consts = (["x", "k"], {"k": i64(k)}) if k is not None else (["x"], {})
        return Case(f"Trilu-{label}", [node("Trilu", inputs, upper=upper)], {"x": rand(*shape)},
                    lambda t: fn(t["x"], k or 0), consts=consts)

    def topk(label: str, shape: tuple[int, ...], k: int, axis: int, largest: int) -> Case:
        return Case(f"TopK-{label}", [node("TopK", ["x", "k"], ["y", "idx"], axis=axis, largest=largest)],
                    {"x": rand(*shape)}, lambda t: torch.topk(t["x"], k, dim=axis, largest=bool(largest)).values,
                    consts={"k": i64([k])})

    return [
        cumsum("inclusive", (3, 5), 1, torch.cumsum),
        cumsum("axis0-exclusive", (4, 3), 0, _exclusive, exclusive=1),
        cumsum("reverse", (2, 3, 4), -1, lambda x, d: _reversed(torch.cumsum, x, d), reverse=1),
        cumsum("reverse-exclusive", (2, 5, 3), 1, lambda x, d: _reversed(_exclusive, x, d), reverse=1, exclusive=1),
        trilu("upper-default-k", (4, 5), None, 1),
        trilu("lower-k1", (2, 4, 4), 1, 0),
        trilu("upper-k-negative", (3, 5, 4), -2, 1),
        topk("largest-last-axis", (3, 7), 3, -1, 1),
        topk("smallest-axis0", (6, 4), 2, 0, 0),
    ]


CASES: list[Case] = resize_cases() + scan_cases()


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_gradient_matches_torch(case: Case, tmp_path) -> None:
    check(case, tmp_path)


@pytest.mark.parametrize("label", ["linear-half-pixel-x2", "linear-align-corners", "nearest-upsample2"])
def test_resize_segment_sum_form(label: str, tmp_path, monkeypatch) -> None:
    """Form 4 of the adjoint (two weighted segment sums), forced by a zero matrix budget: the
    form a large linear resize takes, and the one integer upsampling would take without forms 1, 2."""
    monkeypatch.setattr(resample, "ONE_HOT_ELEMENTS", 0)
    monkeypatch.setattr(resample, "_conv_plan", lambda taps: None)
    monkeypatch.setattr(resample.AxisTaps, "repeat_factor", lambda self: None)
    check(next(c for c in CASES if c.id == f"Resize-{label}"), tmp_path)


@pytest.mark.parametrize("label", ["linear-half-pixel-x2", "linear-1d", "linear-axes-attribute"])
def test_resize_matmul_form(label: str, tmp_path, monkeypatch) -> None:
    """Form 3 (A^T @ dy) for the integer upsamplings that take form 2 (the strided conv)."""
    monkeypatch.setattr(resample, "_conv_plan", lambda taps: None)
    check(next(c for c in CASES if c.id == f"Resize-{label}"), tmp_path)


@pytest.mark.parametrize("attributes,match", [
    ({"mode": "cubic"}, "mode 'cubic'"),
    ({"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}, "tf_crop_and_resize"),
    ({"mode": "linear", "antialias": 1}, "antialias"),
])
def test_resize_refuses_what_it_does_not_run(attributes: dict[str, object], match: str, tmp_path) -> None:
    case = _resize("refused", (1, 1, 6, 6), lambda x: x[..., ::2, ::2], scales=[1, 1, 0.5, 0.5], **attributes)
    with pytest.raises(UnsupportedOpError, match=match):
        check(case, tmp_path)


def test_resize_refuses_dynamic_scales() -> None:
    """Scales computed at run time (not folded to a constant at import) name the node."""
    import onnx_ir as ir

    from fblc.compiler.resize_taps import resize_taps

    x = ir.Value(name="x", shape=ir.Shape([1, 1, 4, 4]), type=ir.TensorType(ir.DataType.FLOAT))
    scales = ir.Value(name="scales", shape=ir.Shape([4]), type=ir.TensorType(ir.DataType.FLOAT))
    resize = ir.Node("", "Resize", [x, None, scales], name="dynamic_up")
    resize.outputs[0].shape = ir.Shape([1, 1, 8, 8])
    with pytest.raises(UnsupportedOpError, match="dynamic_up.*not supported"):
        resize_taps(resize)
