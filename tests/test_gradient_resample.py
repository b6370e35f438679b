"""Gradient rules of issue 12's index and scan ops against PyTorch autograd: Resize (nearest, linear,
cubic and antialiased, every form of its adjoint), CumSum, Trilu, TopK.

The harness is test_gradient_rules.py's (a tiny opset-18 model, the loss ReduceSum(y * R), the
step graph run in onnxruntime, float64 torch autograd as the reference); the loss check also
compares the forward, so taps that differ from onnxruntime's (a rounding mode, a coordinate
transform) fail there before any gradient is read. The Resize attributes are the ones
torch.onnx.export writes for nn.Upsample and F.interpolate (both exporters, opset 18):
asymmetric + floor for nearest, half_pixel for linear with align_corners=False, align_corners;
cubic with cubic_coeff_a -0.75 (bicubic), antialias=1 with exclude_outside=1 and -0.5 for bicubic
(antialias=True, dynamo only). TF's cubic (-0.5, exclude_outside) has no torch op: its reference is
onnxruntime's own Resize read as a matrix (its response to each unit input), differentiated by torch.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from fblc.compiler.gradients import resample
from fblc.errors import UnsupportedOpError
from onnx import TensorProto, helper
from tests.test_gradient_rules import OPSET, Case, check, const_node, i64, node, rand


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


def ort_resize_matrix(hw: tuple[int, int], out_hw: tuple[int, int], **attributes: object) -> np.ndarray:
    """onnxruntime's Resize of [H, W] to out_hw as a [out_h * out_w, H * W] matrix: its output for
    each unit input (Resize is linear in x)."""
    count = hw[0] * hw[1]
    sizes = helper.make_tensor("sizes", TensorProto.INT64, [4], [count, 1, *out_hw])
    graph = helper.make_graph([helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], **attributes)], "m",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [count, 1, *hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [sizes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    unit = np.eye(count, dtype=np.float32).reshape(count, 1, *hw)
    return session.run(None, {"x": unit})[0].reshape(count, -1).T


def _by_onnxruntime(label: str, shape: tuple[int, ...], out_hw: tuple[int, int], **attributes: object) -> Case:
    matrix = torch.from_numpy(ort_resize_matrix(shape[2:], out_hw, **attributes).astype(np.float64))

    def reference(x: torch.Tensor) -> torch.Tensor:
        return (x.reshape(*shape[:2], -1) @ matrix.T).reshape(*shape[:2], *out_hw)
    return _resize(label, shape, reference, sizes=[*shape[:2], *out_hw], **attributes)


NEAREST = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
LINEAR = {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}
CORNERS = {"mode": "linear", "coordinate_transformation_mode": "align_corners"}
CUBIC = {"mode": "cubic", "coordinate_transformation_mode": "half_pixel", "cubic_coeff_a": -0.75}


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
        # bicubic (torch exports cubic_coeff_a -0.75, exclude_outside 0): x2 takes form 2 (the strided conv)
        _resize("cubic-x2", (2, 2, 4, 5), lambda x: F.interpolate(x, scale_factor=2, mode="bicubic",
                                                                   align_corners=False),
                scales=[1, 1, 2, 2], **CUBIC),
        _resize("cubic-sizes", (1, 2, 4, 5), lambda x: F.interpolate(x, size=(7, 9), mode="bicubic",
                                                                      align_corners=False),
                sizes=[1, 2, 7, 9], **CUBIC),
        _resize("cubic-down", (1, 2, 8, 9), lambda x: F.interpolate(x, size=(3, 4), mode="bicubic",
                                                                     align_corners=False),
                sizes=[1, 2, 3, 4], **CUBIC),
        _resize("cubic-align-corners", (1, 2, 4, 5),
                lambda x: F.interpolate(x, size=(7, 3), mode="bicubic", align_corners=True),
                sizes=[1, 2, 7, 3], **{**CUBIC, "coordinate_transformation_mode": "align_corners"}),
        # antialias=True (torch.onnx.export dynamo: antialias 1, exclude_outside 1, bicubic's a -0.5)
        _resize("antialias-linear-down", (1, 2, 8, 9),
                lambda x: F.interpolate(x, size=(3, 4), mode="bilinear", antialias=True, align_corners=False),
                sizes=[1, 2, 3, 4], **LINEAR, antialias=1, exclude_outside=1),
        _resize("antialias-cubic-down", (1, 2, 9, 8),
                lambda x: F.interpolate(x, size=(4, 3), mode="bicubic", antialias=True, align_corners=False),
                sizes=[1, 2, 4, 3], **{**CUBIC, "cubic_coeff_a": -0.5}, antialias=1, exclude_outside=1),
        # torch's antialias with align_corners=True is not what its export means: onnxruntime runs the exported
        # Resize (align_corners, antialias 1) to another function (loss -0.083 against torch's 0.145 here), so the
        # reference of that export is onnxruntime's
        _by_onnxruntime("antialias-cubic-align-corners", (1, 2, 9, 8), (4, 3), mode="cubic", cubic_coeff_a=-0.5,
                        coordinate_transformation_mode="align_corners", antialias=1, exclude_outside=1),
        # TF's cubic (a -0.5, exclude_outside) and the transforms torch never writes: onnxruntime's matrix
        _by_onnxruntime("cubic-tf-exclude-outside", (1, 2, 5, 4), (8, 3), mode="cubic", cubic_coeff_a=-0.5,
                        exclude_outside=1, coordinate_transformation_mode="half_pixel"),
        _by_onnxruntime("cubic-asymmetric", (1, 1, 4, 6), (7, 4), mode="cubic",
                        coordinate_transformation_mode="asymmetric"),
        _by_onnxruntime("cubic-half-pixel-symmetric", (1, 1, 5, 4), (3, 7), mode="cubic",
                        coordinate_transformation_mode="half_pixel_symmetric", exclude_outside=1),
        _by_onnxruntime("antialias-linear-keep-outside", (1, 1, 9, 7), (4, 3), mode="linear", antialias=1,
                        coordinate_transformation_mode="pytorch_half_pixel"),
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


@pytest.mark.parametrize("label", ["linear-half-pixel-x2", "nearest-upsample2", "cubic-x2"])
def test_resize_gather_form(label: str, tmp_path, monkeypatch) -> None:
    """Form 3 of the adjoint (a gather of the outputs that read each input), forced for the integer
    upsamplings that take forms 1 and 2: the form every other scale takes."""
    monkeypatch.setattr(resample, "_conv_plan", lambda taps: None)
    monkeypatch.setattr(resample.AxisTaps, "repeat_factor", lambda self: None)
    check(next(c for c in CASES if c.id == f"Resize-{label}"), tmp_path)


@pytest.mark.parametrize("attributes,match", [
    ({"mode": "cubic", "coordinate_transformation_mode": "tf_crop_and_resize"}, "tf_crop_and_resize"),
    ({"mode": "linear", "exclude_outside": 1}, "exclude_outside"),
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


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_taps_are_onnxruntimes(mode: str) -> None:
    """The taps (resize_taps: what the kernel and the gradient read) against onnxruntime's Resize as a
    matrix, for every coordinate transform, antialias and exclude_outside, up and down, a of torch and TF."""
    import itertools

    import onnx_ir as ir

    from fblc.compiler.resize_taps import resize_taps

    for transform, antialias, exclude, a, (hw, out_hw) in itertools.product(
            ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric",
             "tf_half_pixel_for_nn"], [0, 1], [0, 1], [-0.75, -0.5], [((5, 7), (9, 3)), ((9, 8), (2, 5))]):
        if (mode == "linear" and (a != -0.75 or (exclude and not antialias))):
            continue  # linear has no a; onnxruntime refuses exclude_outside without antialias
        attributes = dict(mode=mode, coordinate_transformation_mode=transform, antialias=antialias,
                          exclude_outside=exclude, cubic_coeff_a=a)
        expected = ort_resize_matrix(hw, out_hw, **attributes)
        x = ir.Value(name="x", shape=ir.Shape([1, 1, *hw]), type=ir.TensorType(ir.DataType.FLOAT))
        sizes = ir.Value(name="sizes", const_value=ir.tensor(np.array([1, 1, *out_hw], np.int64)))
        resize = ir.Node("", "Resize", [x, None, None, sizes], name="r",
                         attributes=[ir.AttrString("mode", mode), ir.AttrString("coordinate_transformation_mode",
                                                                                 transform),
                                     ir.AttrInt64("antialias", antialias), ir.AttrInt64("exclude_outside", exclude),
                                     ir.AttrFloat32("cubic_coeff_a", a)])
        resize.outputs[0].shape = ir.Shape([1, 1, *out_hw])
        taps = {t.axis: t.matrix() for t in resize_taps(resize)}
        got = np.kron(taps.get(2, np.eye(hw[0], dtype=np.float32)), taps.get(3, np.eye(hw[1], dtype=np.float32)))
        np.testing.assert_allclose(got, expected, atol=2e-6, err_msg=str(attributes))


class _Interpolated(torch.nn.Module):
    """conv -> F.interpolate(**kw) -> ReduceSum(y * r): a trained conv under the exported Resize."""

    def __init__(self, out_hw: tuple[int, int], **kw: object) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.kw = torch.nn.Conv2d(2, 2, 3, padding=1), kw
        self.register_buffer("r", torch.randn(1, 2, *out_hw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.interpolate(self.conv(x), **self.kw) * self.r).sum()


@pytest.mark.parametrize("dynamo,out_hw,kw", [
    (False, (9, 7), {"mode": "bicubic", "align_corners": False}),
    (False, (4, 6), {"mode": "bicubic", "align_corners": True}),
    # antialias=True exports only with dynamo (~7 s cold here): its attributes are the antialias cases' above
], ids=["bicubic-legacy", "bicubic-align-corners-legacy"])
def test_exported_interpolate_trains_as_torch(tmp_path, dynamo: bool, out_hw: tuple[int, int],
                                              kw: dict[str, object]) -> None:
    """torch.onnx.export's own Resize (cubic, a -0.75): the step graph's loss and conv gradients
    (onnxruntime) against torch autograd of the module."""
    import warnings

    import onnx

    from tests.test_gradient_rules import _run, _step

    module = _Interpolated(out_hw, size=out_hw, **kw)
    x = torch.from_numpy(rand(1, 2, 5, 4))
    path = tmp_path / "interpolate.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=dynamo, opset_version=18, input_names=["x"],
                          output_names=["loss"])
    model = onnx.load(str(path))
    resize = next(n for n in model.graph.node if n.op_type == "Resize")
    assert onnx.helper.get_attribute_value(next(a for a in resize.attribute if a.name == "mode")) == b"cubic"
    # x as an initializer: the step graph has no inputs to feed
    model.graph.initializer.append(onnx.numpy_helper.from_array(x.numpy(), "x"))
    del model.graph.input[:]
    (tmp_path / "step").mkdir()
    got = _run(_step(model, tmp_path / "step"))
    loss = module(x)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-4, atol=1e-5)
    for name, parameter in module.named_parameters():
        np.testing.assert_allclose(got[f"{name}.grad"], parameter.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
