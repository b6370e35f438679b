"""Kernels of issue 12's index and scan ops, one training step on PoCL against onnxruntime:
Resize (its gather kernel, nearest, linear, cubic and antialiased, and the backward's ReduceSum /
strided-conv / gather forms), CumSum,
Trilu, TopK (values and indices, and the scatter of its gradient), ArgMax, ArgMin, OneHot.

Each model is the op on trainable initializers, then ReduceSum(y * R) (tests/test_kernels_other.py's
harness, which compares every output of the step, the loss and each gradient, with its tolerance).
Integer-valued ops (ArgMax, ArgMin, OneHot) feed a Cast and a Mul with a trained w, so the step
trains something and the integer result reaches the loss (and the step's outputs) exactly.
The cases of MERGED run 12 to a step (tests/support/merged_steps.py: one PoCL build for 12 cases, each case
judged on its own rows); the exported models run alone.
"""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from tests.support import merged_steps
from tests.test_kernels_other import _check, _op_then_loss, _randn


def _const(name: str, array: np.ndarray) -> object:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name), name=f"c_{name}")


NEAREST = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}


RESIZES = [
    ([1, 2, 4, 5], [1, 2, 8, 10], True, NEAREST),  # nn.Upsample(scale_factor=2): o / 2, ReduceSum backward
    ([2, 2, 4, 5], [2, 2, 6, 7], False, NEAREST),  # tables, segment-sum backward
    ([1, 2, 5, 3], [1, 2, 7, 8], False, {"mode": "nearest", "coordinate_transformation_mode": "half_pixel",
                                         "nearest_mode": "round_prefer_ceil"}),
    ([1, 3, 4, 4], [1, 3, 8, 8], True, {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}),
    ([2, 2, 4, 5], [2, 2, 7, 9], False, {"mode": "linear", "coordinate_transformation_mode": "align_corners"}),
    ([1, 2, 7, 9], [1, 2, 3, 4], False, {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}),
    ([2, 3, 5], [2, 3, 10], True, {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}),
    ([2, 2, 7, 6], [2, 2, 3, 4], False, NEAREST),  # downsampling
    ([1, 2, 3, 4, 3], [1, 2, 5, 6, 4], False, {"mode": "linear"}),  # trilinear, the default half_pixel
    # the modes no torch export writes, checked against onnxruntime's taps only
    ([1, 2, 5, 6], [1, 2, 8, 9], False, {"mode": "nearest"}),  # half_pixel, round_prefer_floor
    ([1, 2, 5, 6], [1, 2, 9, 4], False, {"mode": "nearest", "coordinate_transformation_mode": "tf_half_pixel_for_nn",
                                         "nearest_mode": "ceil"}),
    ([1, 2, 5, 6], [1, 2, 8, 9], False, {"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}),
    ([1, 2, 5, 6], [1, 2, 8, 3], False, {"mode": "linear", "coordinate_transformation_mode": "asymmetric"}),
    # integer linear upsamplings: the strided-conv adjoint, its border rows at one end or both
    ([1, 2, 4, 6], [1, 2, 8, 12], True, {"mode": "linear", "coordinate_transformation_mode": "asymmetric"}),
    ([2, 2, 5, 4], [2, 2, 15, 12], False, {"mode": "linear"}),
    # cubic (TF's a -0.5 with exclude_outside: 4 taps, the gather adjoint) and antialiased downsampling (torch's
    # antialias=True on bicubic: a filter window of 6 to 8 taps); graph-mode tests cover the other combinations
    ([1, 2, 5, 4], [1, 2, 8, 3], False, {"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1}),
    ([1, 2, 9, 8], [1, 2, 4, 3], False, {"mode": "cubic", "cubic_coeff_a": -0.5, "antialias": 1, "exclude_outside": 1}),
    # 8195 outputs, past the kernel's tap tables: split_resize's gathers forward, the gather adjoint backward
    ([1, 1, 4097, 2], [1, 1, 8195, 3], False, {"mode": "linear"}),
]
CUMSUMS = [([3, 6], 1, 0, 0), ([4, 5], 0, 1, 0), ([2, 3, 5], -1, 0, 1), ([2, 5, 3], 1, 1, 1)]
TRILUS = [([4, 5], None, 1), ([2, 4, 4], 1, 0), ([3, 5, 6], -2, 1)]
TOPKS = [([3, 9], 3, -1, 1, False), ([6, 4], 2, 0, 0, False), ([2, 5, 3], 5, 1, 1, False), ([4, 12], 5, -1, 0, True),
         ([3, 10], 10, 1, 1, True),
         # a line past SORTED_TOPK_LINE: pass sort_topk's merge sort, with ties, along an axis moved last and back
         ([80, 2], 20, 0, 1, True)]
ARG_EXTREMA = [("ArgMax", 1, 1, 0), ("ArgMin", 0, 0, 0), ("ArgMax", -1, 0, 1), ("ArgMin", 2, 1, 1)]
ONE_HOT_AXES = [-1, 0, 1]


def _resize_case(x_shape: list[int], y_shape: list[int], by_scales: bool, attributes: dict[str, str],
                 seed: int) -> onnx.ModelProto:
    if by_scales:
        scales = np.array([b / a for a, b in zip(x_shape, y_shape)], np.float32)
        extra, inputs = [_const("scales", scales)], ["x", "", "scales"]
    else:
        extra, inputs = [_const("sizes", np.array(y_shape, np.int64))], ["x", "", "", "sizes"]
    op = helper.make_node("Resize", inputs, ["y"], name="resize", **attributes)
    return _op_then_loss(op, y_shape, {"x": _randn(*x_shape, seed=seed)}, extra=extra, seed=seed + 1)


def _resize_after_conv_case(seed: int) -> onnx.ModelProto:
    extra = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             _const("scales", np.array([1, 1, 2, 2], np.float32))]
    op = helper.make_node("Resize", ["c", "", "scales"], ["y"], name="up", **NEAREST)
    return _op_then_loss(op, [1, 4, 10, 10], {"x": _randn(1, 3, 5, 5, seed=seed),
                                              "w": _randn(4, 3, 3, 3, seed=seed + 2)}, extra=extra, seed=seed + 1)


def _cumsum_case(shape: list[int], axis: int, exclusive: int, reverse: int, seed: int) -> onnx.ModelProto:
    op = helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse, name="cumsum")
    return _op_then_loss(op, shape, {"x": _randn(*shape, seed=seed)}, seed=seed + 1,
                         extra=[_const("axis", np.array(axis, np.int64))])


def _trilu_case(shape: list[int], k: int | None, upper: int, seed: int) -> onnx.ModelProto:
    extra = [_const("k", np.array(k, np.int64))] if k is not None else []
    op = helper.make_node("Trilu", ["x", "k"] if k is not None else ["x"], ["y"], upper=upper, name="trilu")
    return _op_then_loss(op, shape, {"x": _randn(*shape, seed=seed)}, extra=extra, seed=seed + 1)


def _topk_case(shape: list[int], k: int, axis: int, largest: int, coarse: bool, seed: int) -> onnx.ModelProto:
    x = _randn(*shape, seed=seed)
    if coarse:
        x = np.round(x * 2) / 2
    y_shape = list(shape)
    y_shape[axis] = k
    extra = [_const("k", np.array([k], np.int64)),
             helper.make_node("TopK", ["x", "k"], ["v", "idx"], axis=axis, largest=largest, name="topk"),
             helper.make_node("Cast", ["idx"], ["fidx"], to=TensorProto.FLOAT, name="cast")]
    op = helper.make_node("Add", ["v", "fidx"], ["y"], name="join")
    return _op_then_loss(op, y_shape, {"x": x}, extra=extra, seed=seed + 1)


def _arg_extremum_case(op_type: str, axis: int, keepdims: int, last: int, seed: int) -> onnx.ModelProto:
    shape = [3, 4, 5]
    x = np.round(_randn(*shape, seed=seed) * 2) / 2  # coarse values: ties, where select_last_index matters
    y_shape = list(shape)
    if keepdims:
        y_shape[axis] = 1
    else:
        del y_shape[axis]
    extra = [helper.make_node(op_type, ["x"], ["a"], axis=axis, keepdims=keepdims, select_last_index=last,
                              name="arg"),
             helper.make_node("Cast", ["a"], ["fa"], to=TensorProto.FLOAT, name="cast")]
    op = helper.make_node("Mul", ["fa", "w"], ["y"], name="scale")
    return _op_then_loss(op, y_shape, {"x": x, "w": _randn(*y_shape, seed=seed + 3)}, extra=extra, seed=seed + 1)


def _one_hot_case(axis: int, seed: int) -> onnx.ModelProto:
    x = _randn(2, 3, 5, seed=seed + 5)
    y_shape = [2, 3]
    y_shape.insert(axis % 3 if axis >= 0 else 2, 5)
    extra = [helper.make_node("ArgMax", ["x"], ["a"], axis=-1, keepdims=0, name="arg"),
             _const("two", np.array(2, np.int64)), helper.make_node("Sub", ["a", "two"], ["indices"], name="shift"),
             _const("depth", np.array(5, np.int64)), _const("values", np.array([0.25, 2.0], np.float32)),
             helper.make_node("OneHot", ["indices", "depth", "values"], ["h"], axis=axis, name="onehot")]
    op = helper.make_node("Mul", ["h", "w"], ["y"], name="scale")
    return _op_then_loss(op, y_shape, {"x": x, "w": _randn(*y_shape, seed=seed + 3)}, extra=extra, seed=seed + 1)


#: every case of the tests below, each drawing its values with seeds of its own (10 apart)
MERGED = merged_steps.MergedCases(TrainingOptions(loss="output", optimizer=OptimizerConfig("sgd", lr=0.1)))
for _prefix, _build, _params in [("resize", _resize_case, RESIZES), ("resizeconv", _resize_after_conv_case, [()]),
                                 ("cumsum", _cumsum_case, CUMSUMS), ("trilu", _trilu_case, TRILUS),
                                 ("topk", _topk_case, TOPKS), ("arg", _arg_extremum_case, ARG_EXTREMA),
                                 ("onehot", _one_hot_case, [(a,) for a in ONE_HOT_AXES])]:
    for _index, _args in enumerate(_params):
        MERGED.add(_prefix if _args == () else f"{_prefix}{_index}", _build(*_args, seed=10 * len(MERGED.models)))
MERGED_GROUP = pytest.mark.xdist_group("resample-merged")  # one worker builds the merged steps for all their tests


@MERGED_GROUP
@pytest.mark.parametrize("x_shape,y_shape,by_scales,attributes", RESIZES)
def test_resize(merged_folder, x_shape: list[int], y_shape: list[int], by_scales: bool,
                attributes: dict[str, str]) -> None:
    MERGED.check(f"resize{RESIZES.index((x_shape, y_shape, by_scales, attributes))}", merged_folder)


@MERGED_GROUP
def test_resize_after_conv(merged_folder) -> None:
    """A decoder's conv then nn.Upsample(scale_factor=2): the Resize reads a conv output's texture."""
    MERGED.check("resizeconv", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("shape,axis,exclusive,reverse", CUMSUMS)
def test_cumsum(merged_folder, shape: list[int], axis: int, exclusive: int, reverse: int) -> None:
    MERGED.check(f"cumsum{CUMSUMS.index((shape, axis, exclusive, reverse))}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("shape,k,upper", TRILUS)
def test_trilu(merged_folder, shape: list[int], k: int | None, upper: int) -> None:
    MERGED.check(f"trilu{TRILUS.index((shape, k, upper))}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("shape,k,axis,largest,coarse", TOPKS)
def test_topk(merged_folder, shape: list[int], k: int, axis: int, largest: int, coarse: bool) -> None:
    """Values train (the scatter of the gradient); the indices, cast, join the loss as a constant.
    Coarse values tie: the lower index comes first, as in onnxruntime."""
    MERGED.check(f"topk{TOPKS.index((shape, k, axis, largest, coarse))}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("op_type,axis,keepdims,last", ARG_EXTREMA)
def test_arg_extremum(merged_folder, op_type: str, axis: int, keepdims: int, last: int) -> None:
    """Coarse values: ties, where select_last_index matters."""
    MERGED.check(f"arg{ARG_EXTREMA.index((op_type, axis, keepdims, last))}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("axis", ONE_HOT_AXES)
def test_one_hot(merged_folder, axis: int) -> None:
    """Indices computed on the device (constant ones would fold at import): ArgMax of an
    initializer, minus 2, so they span [-2, 2] and the negative ones count from the end."""
    MERGED.check(f"onehot{ONE_HOT_AXES.index(axis)}", merged_folder)


class _Decoder(torch.nn.Module):
    """conv -> F.interpolate -> ReduceSum(y * r): the exported Resize between trained convs."""

    def __init__(self, interpolate: Callable[[torch.Tensor], torch.Tensor], out_shape: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.interpolate = interpolate
        self.register_buffer("r", torch.randn(out_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.interpolate(self.conv(x)) * self.r).sum()


EXPORTED = {
    "upsample-nearest": (torch.nn.Upsample(scale_factor=2, mode="nearest"), (1, 3, 8, 10)),
    "bilinear": (lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=False), (1, 3, 8, 10)),
    "bilinear-align-corners-size": (lambda t: F.interpolate(t, size=(7, 9), mode="bilinear", align_corners=True),
                                    (1, 3, 7, 9)),
}


@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("label", list(EXPORTED))
def test_exported_interpolate(tmp_path, label: str, dynamo: bool) -> None:
    """What torch.onnx.export writes for nn.Upsample / F.interpolate (opset 18, both exporters):
    its scales or sizes fold at import, and the step on PoCL matches onnxruntime."""
    interpolate, out_shape = EXPORTED[label]
    path = tmp_path / "exported.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Decoder(interpolate, out_shape).eval(), (torch.randn(1, 2, 4, 5),), str(path),
                          dynamo=dynamo, opset_version=18, input_names=["x"], output_names=["loss"])
    model = onnx.load(str(path))
    assert [n.op_type for n in model.graph.node].count("Resize") == 1
    _check(tmp_path, model)
