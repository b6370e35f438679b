"""Gradient rule of Resize (nearest, linear, cubic, antialiased): the adjoint of its per-axis interpolation.

Resize is separable (fblc/compiler/resize_taps.py): along each resized axis a the output is
A_a x, A_a a constant [out, in] matrix with K nonzeros a row (nearest 1, linear 2, cubic 4,
antialiased the filter's window), so y = A_1 .. A_k x and dx = A_k^T .. A_1^T dy, one axis at a
time. An axis's adjoint is written as existing ops that are race-free and deterministic in
onnxruntime and on the device (no atomic scatter-add):

1. nearest, integer upsampling (nn.Upsample(scale_factor=s), asymmetric/floor): every input
   element is read by s consecutive outputs, so dx = ReduceSum(Reshape(dy, [P, in, s, Q]), 2).
2. linear or cubic, integer upsampling (F.interpolate(scale_factor=s, mode='bilinear')): away
   from the borders input i is read by outputs i*s + lo .. i*s + lo + K - 1 with the same K
   weights, so A^T is a strided convolution: dx = Conv(dy viewed [P, 1, out, Q], kernel
   [1, 1, K, 1], stride s) + R^T dy, R = A - (the conv's matrix) nonzero only in the few border
   rows where the clamped taps differ (a Slice of those rows of dy and a MatMul with the constant
   R^T). Exact, since A = conv + R by construction (up to WEIGHT_NOISE_ULPS: rounding differences
   of the float32 taps are dropped).
3. otherwise (any scale, any mode): a gather over the outputs that read each input
   (AxisTaps.reach: rows and weights [in, R], R the most outputs one input feeds):
   dx = ReduceSum(GatherElements(dy, rows, axis 1) * weights, the R axis). Every input element costs R
   multiply-adds, R about K * ceil(out / in) (plus the border's clamped reads), so the adjoint
   costs O(in * R) = O(out * K), the forward's own work, at any scale; the gathered [P, in, R, Q]
   is about the size of dy times K.

The forward runs as its own gather kernel (fblc/codegen/kernels/resample.py); X is the only input
with a gradient (roi, scales and sizes are constants).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler.autodiff import register_gradient
from fblc.compiler.graph import Emitter, numel, static_shape
from fblc.compiler.resize_taps import AxisTaps, resize_taps

Grads = Sequence["ir.Value | None"]


#: the most border rows form 2 corrects with a matrix product (past it, form 3)
BORDER_ROWS = 8
#: the largest A (elements) form 2 builds densely to find its kernel and border (64 MiB in fp32)
PLAN_ELEMENTS = 1 << 24
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
    if taps.nearest or n_out % n_in or n_in < 3 or n_in * n_out > PLAN_ELEMENTS:
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


def _axis_adjoint(e: Emitter, dy: ir.Value, taps: AxisTaps) -> ir.Value:
    """dx [P, in, Q] of the one-axis interpolation `taps`, from dy [P, out, Q] (see the module docstring)."""
    p, n_out, q = (int(d) for d in dy.shape)
    n_in = taps.size_in
    factor = taps.repeat_factor()
    if factor is not None:  # form 1
        return e.reduce_sum(e.reshape(dy, [p, n_in, factor, q]), [2], keepdims=False)
    plan = _conv_plan(taps)
    if plan is not None:  # form 2
        return _conv_adjoint(e, dy, plan, n_in)
    return _gather_adjoint(e, dy, taps)  # form 3


def _gather_adjoint(e: Emitter, dy: ir.Value, taps: AxisTaps) -> ir.Value:
    """Form 3: dx [P, in, Q] = sum over r of weights[i, r] * dy[P, rows[i, r], Q], as a GatherElements
    along the out axis (its indices an Expand of the constant rows: a view) and a ReduceSum over r."""
    p, _, q = (int(d) for d in dy.shape)
    rows, weights = taps.reach()
    n_in, depth = rows.shape
    index = e.op("Expand", e.const(rows.reshape(1, n_in * depth, 1)), e.ints([p, n_in * depth, q]))
    gathered = e.op("GatherElements", dy, index, axis=1)  # [P, in * R, Q]
    if depth == 1 and np.all(weights == 1):  # every input read by exactly one output, with weight 1
        return gathered
    scaled = e.op("Mul", e.reshape(gathered, [p, n_in, depth, q]), e.const(weights.reshape(1, n_in, depth, 1)))
    return e.reduce_sum(scaled, [2], keepdims=False)


@register_gradient("Resize")
def resize_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    """dx: the adjoint of every resized axis in turn, dy viewed [P, out, Q] around the axis."""
    x = node.inputs[0]
    shape = list(static_shape(node.outputs[0]))
    dx = dys[0]
    for taps in resize_taps(node):
        around = [numel(shape[:taps.axis]), taps.size_out, numel(shape[taps.axis + 1:])]
        dx = _axis_adjoint(e, e.reshape(dx, around), taps)
        shape[taps.axis] = taps.size_in
    dx = e.reshape(dx, static_shape(x))
    return [dx] + [None] * (len(node.inputs) - 1)
