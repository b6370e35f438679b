"""The one-axis taps of Resize's interpolating modes, in onnxruntime's float32 arithmetic.

Each function maps the original (input-space) coordinates of an axis's outputs, float32 [n_out],
to (index int64 [n_out, K], weight float32 [n_out, K]) with every index in [0, n_in): a tap past a
border reads the border element (onnxruntime clamps), unless exclude_outside drops it and the
remaining weights are renormalised. fblc/compiler/resize_taps.py picks the function per mode.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def linear_taps(original: np.ndarray, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's SetupUpsampleBilinear: clamp into [0, n_in - 1], the two neighbours and their
    distances; a clamped coordinate (both neighbours the same) reads it with weights 1 + 0."""
    x = np.clip(original, F32(0), F32(n_in - 1))
    first = np.minimum(x.astype(np.int64), n_in - 1)
    second = np.minimum(first + 1, n_in - 1)
    to_first = np.abs(x - first.astype(np.float32))
    to_second = np.abs(x - second.astype(np.float32))
    same = first == second
    w_first = np.where(same, F32(1), to_second).astype(np.float32)
    w_second = np.where(same, F32(0), to_first).astype(np.float32)
    return np.stack([first, second], axis=1), np.stack([w_first, w_second], axis=1)


def cubic_coefficients(s: np.ndarray, a: np.float32) -> np.ndarray:
    """GetCubicCoeffs (Keys' kernel with parameter a) at offsets s in [0, 1): float32 [n, 4] for the
    neighbours floor - 1 .. floor + 2."""
    s = np.abs(s).astype(np.float32)
    one, two = s + F32(1), F32(1) - s
    three = F32(2) - s
    return np.stack([
        ((a * one - F32(5) * a) * one + F32(8) * a) * one - F32(4) * a,
        ((a + F32(2)) * s - (a + F32(3))) * s * s + F32(1),
        ((a + F32(2)) * two - (a + F32(3))) * two * two + F32(1),
        ((a * three - F32(5) * a) * three + F32(8) * a) * three - F32(4) * a,
    ], axis=1).astype(np.float32)


def cubic_taps(original: np.ndarray, n_in: int, a: np.float32, exclude_outside: bool
               ) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's ResizeBiCubic: the coordinate is not clamped; neighbours floor - 1 .. floor + 2
    read clamped into [0, n_in) (GetDataForCoordinate); exclude_outside zeroes the ones outside and
    divides by the remaining sum (coeff / sum, as onnxruntime multiplies)."""
    floor = np.floor(original)
    coeffs = cubic_coefficients((original - floor).astype(np.float32), a)
    taps = floor.astype(np.int64).reshape(-1, 1) + np.arange(-1, 3, dtype=np.int64)
    inside = (taps >= 0) & (taps < n_in)
    if exclude_outside:
        coeffs = np.where(inside, coeffs, F32(0)).astype(np.float32)
        total = np.zeros(len(coeffs), np.float32)
        for k in range(4):  # onnxruntime's order of summation
            total = (total + coeffs[:, k]).astype(np.float32)
        coeffs = (coeffs / total.reshape(-1, 1)).astype(np.float32)
    return np.clip(taps, 0, n_in - 1), coeffs


def _aa_filter(x: np.ndarray, cubic: bool, a: np.float32) -> np.ndarray:
    """BilinearParamsAA / BiCubicParamsAA::filter."""
    x = np.abs(x).astype(np.float32)
    if not cubic:
        return np.where(x < F32(1), F32(1) - x, F32(0)).astype(np.float32)
    near = ((a + F32(2)) * x - (a + F32(3))) * x * x + F32(1)
    far = (((x - F32(5)) * x + F32(8)) * x - F32(4)) * a
    return np.where(x < F32(1), near, np.where(x < F32(2), far, F32(0))).astype(np.float32)


def antialias_taps(original: np.ndarray, scale: np.float32, n_in: int, cubic: bool, a: np.float32,
                   exclude_outside: bool) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's SetupUpsampleFilterAA (Pillow's resampling, torch's antialias=True): a
    downsampling by 1/scale stretches the filter by 1/scale, so an output reads every input within
    support * 1/scale of its centre; taps outside [0, n_in) are dropped (exclude_outside) or fold
    into the border element; the weights are divided by their sum."""
    stretch = F32(F32(1) / scale)
    half = F32(2) if cubic else F32(1)
    support = half * stretch if stretch >= 1 else half
    inv = F32(1) / stretch if stretch >= 1 else F32(1)
    centre = (F32(0.5) + (np.arange(len(original), dtype=np.float32) if stretch == 1 else original)
              ).astype(np.float32)
    lo = np.floor((centre - support).astype(np.float32).astype(np.float64) + 0.5).astype(np.int64)
    hi = np.floor((centre + support).astype(np.float32).astype(np.float64) + 0.5).astype(np.int64)
    if exclude_outside:
        lo, hi = np.maximum(lo, 0), np.minimum(hi, n_in)
    width = max(int((hi - lo).max(initial=1)), 1)
    taps = lo.reshape(-1, 1) + np.arange(width, dtype=np.int64)
    live = taps < hi.reshape(-1, 1)
    offset = (taps.astype(np.float32) - centre.reshape(-1, 1) + F32(0.5)).astype(np.float32)
    weight = np.where(live, _aa_filter(offset * inv, cubic, a), F32(0)).astype(np.float32)
    total = np.zeros(len(weight), np.float32)
    for k in range(width):  # onnxruntime's order of summation
        total = (total + weight[:, k]).astype(np.float32)
    scaled = (total != 0) & (total != 1)
    weight = np.where(scaled.reshape(-1, 1), weight / np.where(scaled, total, F32(1)).reshape(-1, 1),
                      weight).astype(np.float32)
    return np.clip(taps, 0, n_in - 1), weight
