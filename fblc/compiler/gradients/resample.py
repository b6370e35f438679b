"""Gradient rule of Resize (nearest and linear): the adjoint of its per-axis interpolation.

Resize is separable (fblc/compiler/resize_taps.py): along each resized axis a the output is
A_a x, A_a a constant [out, in] matrix with one (nearest) or two (linear) nonzeros a row, so
y = A_1 .. A_k x and dx = A_k^T .. A_1^T dy, one axis at a time. An axis's adjoint is a scatter
of dy into x's positions with the interpolation weights; it is written as existing ops that are
race-free and deterministic in onnxruntime and on the device (no atomic scatter-add):

1. nearest, integer upsampling (nn.Upsample(scale_factor=s), asymmetric/floor): every input
   element is read by s consecutive outputs, so dx = ReduceSum(Reshape(dy, [P, in, s, Q]), 2).
2. linear, integer upsampling (F.interpolate(scale_factor=s, mode='bilinear')): away from the
   borders input i is read by outputs i*s + lo .. i*s + lo + K - 1 with the same K weights, so
   A^T is a strided convolution: dx = Conv(dy viewed [P, 1, out, Q], kernel [1, 1, K, 1],
   stride s) + R^T dy, R = A - (the conv's matrix) nonzero only in the few border rows where the
   clamped taps differ (a Slice of those rows of dy and a MatMul with the constant R^T). O(K)
   per element instead of the O(out) of a matrix product; exact, since A = conv + R by
   construction (up to WEIGHT_NOISE_ULPS: rounding differences of the float32 taps are dropped).
3. linear otherwise, when A is small: dy viewed [P, out, Q] and dx = A^T @ dy (a MatMul with the
   constant A^T, [in, out]; for the innermost axis dy [P, out] @ A), a tiled contraction.
4. otherwise (any other nearest, or a large linear A): the segment sums of gather gradients
   (fblc/compiler/gradients/segment_sum.py) with the taps as constant rows, once per tap:
   dx = segsum(w_first * dy, first) + segsum(w_second * dy, second) (nearest: the first alone).

The forward runs as its own gather kernel (fblc/codegen/kernels/resample.py); X is the only input
with a gradient (roi, scales and sizes are constants).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler.autodiff import register_gradient
from fblc.compiler.gradients.segment_sum import ONE_HOT_ELEMENTS, ONE_HOT_MACS, segment_sum
from fblc.compiler.graph import Emitter, numel, static_shape
from fblc.compiler.resize_taps import AxisTaps, resize_taps

Grads = Sequence["ir.Value | None"]


#: the most border rows form 2 corrects with a matrix product (past it, form 3 or 4)
BORDER_ROWS = 8
#: weight differences form 2 ignores, in float32 ulps of the largest source coordinate (n_in):
#: the taps' weights come from float32 coordinates, so they differ by that much from position to
#: position (x = 29.333333 and 59.333336 under a scale of 3) and from the exact weights themselves
WEIGHT_NOISE_ULPS = 4


@dataclass(frozen=True)
class _ConvPlan:
    """Form 2: A^T = the strided conv of `kernel` (taps from i*s + lo) + border.T at rows `rows`."""

    kernel: np.ndarray  # float32 [K]
    stride: int
    pads: tuple[int, int]  # before, after the out axis
    rows: np.ndarray  # int64 [m]: the rows of A the conv gets wrong
    border: np.ndarray  # float32 [m, in]: A - conv at those rows


def _conv_plan(taps: AxisTaps) -> _ConvPlan | None:
    """The plan of form 2 for a linear integer upsampling, or None (see the module docstring)."""
    n_in, n_out = taps.size_in, taps.size_out
    if taps.nearest or n_out % n_in or n_in < 3:
        return None
    s, a = n_out // n_in, taps.matrix()
    middle = n_in // 2
    read = np.nonzero(a[:, middle])[0]
    lo = int(read[0]) - middle * s
    kernel = a[middle * s + lo: int(read[-1]) + 1, middle]
    conv = np.zeros_like(a)
    for i in range(n_in):
        for t, weight in enumerate(kernel):
            if 0 <= i * s + lo + t < n_out:
                conv[i * s + lo + t, i] = weight
    noise = WEIGHT_NOISE_ULPS * float(np.spacing(np.float32(n_in)))
    residual = np.where(np.abs(a - conv) > noise, a - conv, 0)
    rows = np.nonzero(np.any(residual != 0, axis=1))[0]
    after = (n_in - 1) * s + lo + len(kernel) - n_out
    if lo > 0 or after <= -s or len(rows) > BORDER_ROWS:
        return None
    return _ConvPlan(kernel.astype(np.float32), s, (-lo, max(after, 0)), rows.astype(np.int64),
                     residual[rows].astype(np.float32))


def _conv_adjoint(e: Emitter, dy: ir.Value, plan: _ConvPlan, n_in: int) -> ir.Value:
    """Form 2: dx [P, in, Q] = Conv(dy [P, 1, out, Q]) + border^T @ (dy's border rows: a Slice a run)."""
    p, n_out, q = (int(d) for d in dy.shape)
    weight = e.const(plan.kernel.reshape(1, 1, -1, 1))
    conv = e.op("Conv", e.reshape(dy, [p, 1, n_out, q]), weight, kernel_shape=[len(plan.kernel), 1],
                strides=[plan.stride, 1], pads=[plan.pads[0], 0, plan.pads[1], 0])
    dx = e.reshape(conv, [p, n_in, q])
    if not len(plan.rows):
        return dx
    runs = np.split(plan.rows, np.nonzero(np.diff(plan.rows) != 1)[0] + 1)  # the border's row ranges
    pieces = [e.op("Slice", dy, e.ints([int(run[0])]), e.ints([int(run[-1]) + 1]), e.ints([1])) for run in runs]
    picked = pieces[0] if len(pieces) == 1 else e.op("Concat", *pieces, axis=1)
    return e.op("Add", dx, e.op("MatMul", e.const(np.ascontiguousarray(plan.border.T)), picked))


def _axis_adjoint(e: Emitter, dy: ir.Value, taps: AxisTaps, like: ir.Value) -> ir.Value:
    """dx [P, in, Q] of the one-axis interpolation `taps`, from dy [P, out, Q] (see the module docstring)."""
    p, n_out, q = (int(d) for d in dy.shape)
    n_in = taps.size_in
    factor = taps.repeat_factor()
    if factor is not None:  # form 1
        return e.reduce_sum(e.reshape(dy, [p, n_in, factor, q]), [2], keepdims=False)
    plan = _conv_plan(taps)
    if plan is not None:  # form 2
        return _conv_adjoint(e, dy, plan, n_in)
    if not taps.nearest and n_in * n_out <= ONE_HOT_ELEMENTS and p * n_in * n_out * q <= ONE_HOT_MACS:  # form 3
        matrix = taps.matrix()
        if q == 1:
            return e.reshape(e.op("MatMul", e.reshape(dy, [p, n_out]), e.const(matrix)), [p, n_in, 1])
        return e.op("MatMul", e.const(np.ascontiguousarray(matrix.T)), dy)
    total: ir.Value | None = None  # form 4
    for rows, weights in ((taps.first, taps.w_first), (taps.second, taps.w_second)):
        if not np.any(weights):
            continue
        scaled = dy if np.all(weights == 1) else e.op("Mul", dy, e.const(weights.reshape(1, n_out, 1)))
        part = segment_sum(e, scaled, rows.reshape(1, n_out), n_in, like=like)
        total = part if total is None else e.op("Add", total, part)
    return total if total is not None else e.zeros([p, n_in, q], like=like)


@register_gradient("Resize")
def resize_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """dx: the adjoint of every resized axis in turn, dy viewed [P, out, Q] around the axis."""
    x = node.inputs[0]
    shape = list(static_shape(node.outputs[0]))
    dx = dys[0]
    for taps in resize_taps(node):
        around = [numel(shape[:taps.axis]), taps.size_out, numel(shape[taps.axis + 1:])]
        dx = _axis_adjoint(e, e.reshape(dx, around), taps, like=x)
        shape[taps.axis] = taps.size_in
    dx = e.reshape(dx, static_shape(x))
    return [dx] + [None] * (len(node.inputs) - 1)
