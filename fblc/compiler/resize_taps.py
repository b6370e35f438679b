"""Resize as per-axis taps: which input elements each output element reads, and with what weight.

ONNX Resize (nearest and linear, no antialias) is separable: along each resized axis a, output
coordinate j reads input coordinates first[j] and second[j] with weights w_first[j] and
w_second[j] (nearest: one tap, weight 1), and the output element is the product over the axes
of these one-axis interpolations. The taps depend only on the static shapes, the scales or
sizes (constants after import) and the attributes, so they are computed here once, in float32
arithmetic written the way onnxruntime writes it (get_original_coordinate, get_nearest_pixel,
SetupUpsampleBilinear), and both the forward kernel (fblc/codegen/kernels/resample.py) and the
gradient rule (fblc/compiler/gradients/resample.py) read them; neither re-derives a formula.

Supported: mode nearest (nearest_mode round_prefer_floor, round_prefer_ceil, floor, ceil) and
linear; coordinate_transformation_mode half_pixel, half_pixel_symmetric, pytorch_half_pixel,
align_corners, asymmetric, tf_half_pixel_for_nn; scales or sizes (keep_aspect_ratio_policy
stretch), the opset-18 `axes` attribute. Refused (UnsupportedOpError naming the node): cubic,
tf_crop_and_resize (roi, extrapolation_value), antialias on a linear downsampling, a scales or
sizes input that is not a constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from fblc.compiler.values import attr, const_array, static_shape
from fblc.errors import UnsupportedOpError

F32 = np.float32


@dataclass(frozen=True)
class AxisTaps:
    """The one-axis interpolation of a resized axis: out[j] = w_first[j] x[first[j]] + w_second[j] x[second[j]]."""

    axis: int
    size_in: int
    size_out: int
    first: np.ndarray  # int64 [size_out]
    second: np.ndarray  # int64 [size_out] (== first for nearest)
    w_first: np.ndarray  # float32 [size_out]
    w_second: np.ndarray  # float32 [size_out] (0 for nearest)
    nearest: bool

    def matrix(self) -> np.ndarray:
        """A [size_out, size_in]: out = A @ x along the axis (the adjoint is A^T)."""
        a = np.zeros((self.size_out, self.size_in), np.float32)
        rows = np.arange(self.size_out)
        np.add.at(a, (rows, self.first), self.w_first)
        np.add.at(a, (rows, self.second), self.w_second)
        return a

    def repeat_factor(self) -> int | None:
        """s when every input element is read by s consecutive outputs with weight 1 (nearest, integer
        upsampling: nn.Upsample(scale_factor=s)), else None."""
        if not self.nearest or self.size_out % self.size_in:
            return None
        s = self.size_out // self.size_in
        return s if np.array_equal(self.first, np.arange(self.size_out) // s) else None


def _text(node: ir.Node, name: str, default: str) -> str:
    value = attr(node, name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _refuse(node: ir.Node, what: str, fix: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"Resize {what} (node '{node.name}') is not supported", fix)


# original coordinate of output coordinates x (float32) per coordinate_transformation_mode:
# (x, scale, size_in, size_out) -> float32 array, onnxruntime's get_original_coordinate
def _half_pixel_symmetric(x: np.ndarray, s: np.float32, n_in: int, n_out: int) -> np.ndarray:
    adjustment = F32(n_out) / (s * F32(n_in))
    offset = F32(n_in / 2) * (F32(1) - adjustment)
    return offset + ((x + F32(0.5)) / s - F32(0.5))


COORDINATES: dict[str, Callable[[np.ndarray, np.float32, int, int], np.ndarray]] = {
    "half_pixel": lambda x, s, n_in, n_out: (x + F32(0.5)) / s - F32(0.5),
    "half_pixel_symmetric": _half_pixel_symmetric,
    "pytorch_half_pixel": lambda x, s, n_in, n_out: ((x + F32(0.5)) / s - F32(0.5)) if n_out > 1 else x * F32(0),
    "align_corners": lambda x, s, n_in, n_out: (x * F32(n_in - 1)) / F32(n_out - 1) if n_out > 1 else x * F32(0),
    "asymmetric": lambda x, s, n_in, n_out: x / s,
    "tf_half_pixel_for_nn": lambda x, s, n_in, n_out: (x + F32(0.5)) / s,
}


def _ties(x: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """Round to nearest, `tie` where x is exactly halfway (np.rint is exact off ties)."""
    return np.where(x == np.floor(x) + F32(0.5), tie, np.rint(x))


NEAREST: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "round_prefer_floor": lambda x: _ties(x, np.floor(x)),
    "round_prefer_ceil": lambda x: _ties(x, np.ceil(x)),
    "floor": np.floor,
    "ceil": np.ceil,
}

#: modes fblc runs (cubic would be a four-tap matrix; it is not written yet)
MODES = ("nearest", "linear")


def _scales(node: ir.Node, rank: int, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[np.float32]:
    """Per-axis float32 scale: the scales input, or sizes / input sizes (onnxruntime's float division)."""
    axes = attr(node, "axes")
    axes = [int(a) % rank for a in axes] if axes is not None else list(range(rank))
    scales_value = node.inputs[2] if len(node.inputs) > 2 else None
    sizes_value = node.inputs[3] if len(node.inputs) > 3 else None
    scales = const_array(scales_value) if scales_value is not None else None
    sizes = const_array(sizes_value) if sizes_value is not None else None
    if (scales_value is not None and scales is None) or (sizes_value is not None and sizes is None):
        raise _refuse(node, "with a scales or sizes input that is not a constant",
                      "fblc needs static shapes: export with fixed sizes or scale factors (constants)")
    full = [F32(1)] * rank
    if scales is not None and scales.size:
        for axis, value in zip(axes, np.asarray(scales, np.float32).reshape(-1)):
            full[axis] = F32(value)
        return full
    policy = _text(node, "keep_aspect_ratio_policy", "stretch")
    if policy != "stretch":
        raise _refuse(node, f"keep_aspect_ratio_policy '{policy}'", "use 'stretch' (what torch exports)")
    for axis in axes:
        full[axis] = F32(out_shape[axis]) / F32(in_shape[axis])
    return full


def resize_taps(node: ir.Node) -> list[AxisTaps]:
    """The taps of every axis the Resize changes (an axis it maps onto itself is left out, as is an
    axis of scale 1: onnxruntime copies it even under tf_half_pixel_for_nn, whose formula shifts it)."""
    mode = _text(node, "mode", "nearest")
    if mode not in MODES:
        raise _refuse(node, f"mode '{mode}'", f"supported modes: {', '.join(MODES)}")
    transform = _text(node, "coordinate_transformation_mode", "half_pixel")
    if transform not in COORDINATES:
        raise _refuse(node, f"coordinate_transformation_mode '{transform}'",
                      f"supported: {', '.join(COORDINATES)}")
    rounding = _text(node, "nearest_mode", "round_prefer_floor")
    if mode == "nearest" and rounding not in NEAREST:
        raise _refuse(node, f"nearest_mode '{rounding}'", f"supported: {', '.join(NEAREST)}")
    in_shape, out_shape = static_shape(node.inputs[0]), static_shape(node.outputs[0])
    rank = len(in_shape)
    scales = _scales(node, rank, in_shape, out_shape)
    if mode == "linear" and int(attr(node, "antialias", 0)) and any(s < 1 for s in scales):
        raise _refuse(node, "antialias on a downsampling", "set antialias=0 (F.interpolate(antialias=False))")
    taps = []
    for axis, (n_in, n_out, scale) in enumerate(zip(in_shape, out_shape, scales)):
        if scale == 1 and n_in == n_out:
            continue  # onnxruntime copies an axis of scale 1, even where the transform would shift it
        x = np.arange(n_out, dtype=np.float32)
        original = np.asarray(COORDINATES[transform](x, scale, n_in, n_out), np.float32)
        if mode == "nearest":
            first = np.clip(NEAREST[rounding](original), 0, n_in - 1).astype(np.int64)
            one = AxisTaps(axis, n_in, n_out, first, first, np.ones(n_out, F32), np.zeros(n_out, F32), True)
        else:
            one = _linear(axis, n_in, n_out, original)
        if n_in == n_out and np.array_equal(one.first, np.arange(n_out)) and np.all(one.w_first == 1):
            continue  # the identity along this axis
        taps.append(one)
    return taps


def _linear(axis: int, n_in: int, n_out: int, original: np.ndarray) -> AxisTaps:
    """onnxruntime's SetupUpsampleBilinear: clamp into [0, n_in - 1], the two neighbours and their
    distances; a clamped coordinate (both neighbours the same) reads it with weights 0.5 + 0.5."""
    x = np.clip(original, F32(0), F32(n_in - 1))
    first = np.minimum(x.astype(np.int64), n_in - 1)
    second = np.minimum(first + 1, n_in - 1)
    to_first = np.abs(x - first.astype(np.float32))
    to_second = np.abs(x - second.astype(np.float32))
    same = first == second
    w_first = np.where(same, F32(1), to_second).astype(np.float32)
    w_second = np.where(same, F32(0), to_first).astype(np.float32)
    return AxisTaps(axis, n_in, n_out, first, second, w_first, w_second, False)
