"""Resize as per-axis taps: which input elements each output element reads, and with what weight.

ONNX Resize is separable: along each resized axis a, output coordinate j reads the input
coordinates index[j, 0..K-1] with weights weight[j, 0..K-1] (nearest: K = 1, weight 1; linear:
K = 2; cubic: K = 4; antialiased: the filter's window, K grows with the downsampling factor),
and the output element is the product over the axes of these one-axis interpolations. The taps
depend only on the static shapes, the scales or sizes (constants after import) and the
attributes, so they are computed here once, in float32 arithmetic written the way onnxruntime
writes it (get_original_coordinate, get_nearest_pixel, SetupUpsampleBilinear, GetCubicCoeffs
with ResizeBiCubic's exclude_outside, SetupUpsampleFilterAA for antialias), and both the forward
kernel (fblc/codegen/kernels/resample.py) and the gradient rule (fblc/compiler/gradients/resample.py)
read them; neither re-derives a formula.

Supported: mode nearest (nearest_mode round_prefer_floor, round_prefer_ceil, floor, ceil), linear
and cubic (cubic_coeff_a as written: torch exports -0.75, TF -0.5; exclude_outside), antialias
(opset 18) on linear and cubic; coordinate_transformation_mode half_pixel, half_pixel_symmetric,
pytorch_half_pixel, align_corners, asymmetric, tf_half_pixel_for_nn; scales or sizes
(keep_aspect_ratio_policy stretch), the opset-18 `axes` attribute. Refused (UnsupportedOpError
naming the node): tf_crop_and_resize (roi, extrapolation_value), a scales or sizes input that is
not a constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from fblc.compiler.resize_filters import antialias_taps, cubic_taps, linear_taps
from fblc.compiler.values import attr, const_array, static_shape
from fblc.errors import UnsupportedOpError

F32 = np.float32
#: output coordinates of one axis the Resize kernel's private tap tables may hold; past it (an axis
#: that is no integer nearest upsampling) fblc/passes/split_resize.py writes the Resize as gathers
TABLE_LIMIT = 8192


@dataclass(frozen=True)
class AxisTaps:
    """The one-axis interpolation of a resized axis: out[j] = sum_k weight[j, k] x[index[j, k]]."""

    axis: int
    size_in: int
    size_out: int
    index: np.ndarray  # int64 [size_out, K], every entry in [0, size_in)
    weight: np.ndarray  # float32 [size_out, K]
    nearest: bool

    @property
    def width(self) -> int:
        """K, the taps an output reads."""
        return int(self.index.shape[1])

    def matrix(self) -> np.ndarray:
        """A [size_out, size_in]: out = A @ x along the axis (the adjoint is A^T)."""
        a = np.zeros((self.size_out, self.size_in), np.float32)
        rows = np.repeat(np.arange(self.size_out), self.width)
        np.add.at(a, (rows, self.index.reshape(-1)), self.weight.reshape(-1))
        return a

    def repeat_factor(self) -> int | None:
        """s when every input element is read by s consecutive outputs with weight 1 (nearest, integer
        upsampling: nn.Upsample(scale_factor=s)), else None."""
        if not self.nearest or self.size_out % self.size_in:
            return None
        s = self.size_out // self.size_in
        return s if np.array_equal(self.index[:, 0], np.arange(self.size_out) // s) else None

    def pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The nonzero entries of A as (output, input, weight), ascending by input then output; taps
        of one output that read one input twice (clamped at a border) are one entry, weights added."""
        outs = np.repeat(np.arange(self.size_out, dtype=np.int64), self.width)
        keys = self.index.reshape(-1) * self.size_out + outs  # input-major: sorted keys order by input
        unique, where = np.unique(keys, return_inverse=True)
        summed = np.zeros(len(unique), np.float32)
        np.add.at(summed, where.reshape(-1), self.weight.reshape(-1))
        keep = summed != 0
        return unique[keep] % self.size_out, unique[keep] // self.size_out, summed[keep]

    def reach(self) -> tuple[np.ndarray, np.ndarray]:
        """The adjoint as a gather: (rows [size_in, R] int64, weights [size_in, R] float32) with
        (A^T dy)[i] = sum_r weights[i, r] dy[rows[i, r]]; R is the most outputs that read one input,
        an input read by fewer pads with row 0, weight 0. O(size_out K) to build, no dense A."""
        outs, ins, values = self.pairs()
        counts = np.bincount(ins, minlength=self.size_in)
        depth = max(int(counts.max(initial=0)), 1)
        slot = np.arange(len(ins)) - np.searchsorted(ins, ins)
        rows = np.zeros((self.size_in, depth), np.int64)
        weights = np.zeros((self.size_in, depth), np.float32)
        rows[ins, slot] = outs
        weights[ins, slot] = values
        return rows, weights


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


#: modes fblc runs (resize_filters.py makes the taps of linear and cubic)
MODES = ("nearest", "linear", "cubic")


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
    antialias = mode != "nearest" and bool(int(attr(node, "antialias", 0)))
    coeff_a = F32(attr(node, "cubic_coeff_a", -0.75))
    exclude = bool(int(attr(node, "exclude_outside", 0)))
    if exclude and mode == "linear" and not antialias:
        raise _refuse(node, "exclude_outside=1 on linear without antialias",
                      "onnxruntime refuses it too: set exclude_outside=0, or antialias=1")
    taps = []
    for axis, (n_in, n_out, scale) in enumerate(zip(in_shape, out_shape, scales)):
        if scale == 1 and n_in == n_out:
            continue  # onnxruntime copies an axis of scale 1, even where the transform would shift it
        x = np.arange(n_out, dtype=np.float32)
        original = np.asarray(COORDINATES[transform](x, scale, n_in, n_out), np.float32)
        if mode == "nearest":
            first = np.clip(NEAREST[rounding](original), 0, n_in - 1).astype(np.int64).reshape(n_out, 1)
            one = AxisTaps(axis, n_in, n_out, first, np.ones((n_out, 1), F32), True)
        else:
            if antialias:
                index, weight = antialias_taps(original, scale, n_in, mode == "cubic", coeff_a, exclude)
            elif mode == "cubic":
                index, weight = cubic_taps(original, n_in, coeff_a, exclude)
            else:
                index, weight = linear_taps(original, n_in)
            used = np.any(weight != 0, axis=0)  # a tap no output weighs (linear at integer coordinates)
            used[0] = True
            one = AxisTaps(axis, n_in, n_out, index[:, used], weight[:, used], False)
        if (n_in == n_out and one.width == 1 and np.array_equal(one.index[:, 0], np.arange(n_out))
                and np.all(one.weight == 1)):
            continue  # the identity along this axis
        taps.append(one)
    return taps
